# ---
# jupyter:
#   jupytext:
#     formats: ipynb,sources//py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 4: a tensor-parallel MLP
#
# **Goal:** split the two weight matrices of a transformer MLP across ranks the way Megatron-LM
# does, so each rank stores and computes a quarter of it, and get *exactly* the outputs and
# gradients of the single-device MLP, with one all-reduce forward and one backward.
#
# The MLP is `out = gelu(x @ w1.T + b1) @ w2.T + b2`, with `w1` of shape `(ffn, hidden)` and
# `w2` of shape `(hidden, ffn)`. Every check compares with the single-device MLP in float64.

# %% expect=["{'w1': (16, 8), 'b1': (16,), 'w2': (8, 16), 'b2': (8,)}"]
import torch
import simcomm
from simcomm.model import cost
import simcomm.lessons.lesson_04 as check
from simcomm import viz
from simcomm.parallel.tensor import make_mlp, mlp
viz.use_export_renderer()   # figures live in JupyterLab and survive an HTML export

world_size, batch, hidden, ffn = 4, 3, 8, 16
world = simcomm.configured_backend(world_size)
params = make_mlp(hidden, ffn, seed=0)                  # float64 weights of the whole MLP
x = torch.randn(batch, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
reference = mlp(x, params)                               # (batch, hidden), on one device
print({name: tuple(p.shape) for name, p in params.items()})


# %% [markdown]
# ## 1. Column-parallel: split `w1` by rows
#
# Rank `r` keeps rows `r*ffn/P ... (r+1)*ffn/P` of `w1` (and of `b1`). With the whole input `x`
# it computes its own columns of the hidden activation: `h_r = gelu(x @ w1_r.T + b1_r)`, of
# shape `(batch, ffn/P)`. No communication is needed: GELU acts element by element, so each
# rank's columns are finished on their own. Section 2 splits `w2` by the matching columns;
# `shard_mlp` cuts one rank's copies (leaves of its own graph) out of the whole MLP:

# %%
def shard_mlp(params, rank, world_size):
    """Rank `rank`'s parameters: rows of w1 and b1, the matching columns of w2, all of b2."""
    ffn = params["w1"].shape[0]
    if ffn % world_size:
        raise ValueError(f"shard_mlp: ffn size {ffn} is not divisible by the world size {world_size}")
    rows = slice(rank * ffn // world_size, (rank + 1) * ffn // world_size)
    return {"w1": params["w1"][rows].clone().requires_grad_(),       # (ffn/P, hidden)
            "b1": params["b1"][rows].clone().requires_grad_(),       # (ffn/P,)
            "w2": params["w2"][:, rows].clone().requires_grad_(),    # (hidden, ffn/P)
            "b2": params["b2"].clone().requires_grad_()}             # (hidden,): every rank

# %% [markdown]
# The figure shows which weights each rank holds, in its rank colour:

# %% tags=["nbval-ignore-output"]
viz.tp_mlp_shards_figure(hidden, ffn, world_size)

# %% expect=["rank 0 holds {'w1': (4, 8), 'b1': (4,), 'w2': (8, 4), 'b2': (8,)} and computes h of shape (3, 4)", "the ranks' h side by side: matches the reference"]
def column_parallel(comm, x, params):
    x, params = x.to(comm.device), {name: p.to(comm.device) for name, p in params.items()}
    shards = shard_mlp(params, comm.rank, comm.world_size)       # this rank's slices, as leaves
    h = torch.nn.functional.gelu(x @ shards["w1"].T + shards["b1"])   # (batch, ffn / P)
    return {name: tuple(p.shape) for name, p in shards.items()}, h.detach()

outs = world.run(column_parallel, x, params)
print("rank 0 holds", outs[0][0], "and computes h of shape", tuple(outs[0][1].shape))
for name in ("w1", "w2"):   # each rank stores a 1 / world_size share of both matrices
    assert all(shapes[name][0] * shapes[name][1] * world_size == params[name].numel() for shapes, _ in outs)
full_h = torch.nn.functional.gelu(x @ params["w1"].T + params["b1"])       # (batch, ffn)
print(check.assert_close(torch.cat([h for _, h in outs], dim=-1), full_h, "the ranks' h side by side"))


# %% [markdown]
# ## 2. Row-parallel: split `w2` by columns, then add up
#
# `h @ w2.T` is a sum over the `ffn` dimension. Rank `r` holds the columns of `w2` that match its
# columns of `h`, so it can compute its share of that sum: `partial_r = h_r @ w2_r.T`, already of
# the full output shape `(batch, hidden)`. The output is the **sum** of the partials over ranks:
# an all-reduce. So the whole MLP needs a single all-reduce, and no all-gather in between.

# %% expect=["sum of the partials + b2: matches the reference"]
def partial_sums(comm, x, params):
    x, params = x.to(comm.device), {name: p.to(comm.device) for name, p in params.items()}
    shards = shard_mlp(params, comm.rank, comm.world_size)
    h = torch.nn.functional.gelu(x @ shards["w1"].T + shards["b1"])   # (batch, ffn / P)
    return (h @ shards["w2"].T).detach()                              # (batch, hidden): a share

partials = world.run(partial_sums, x, params)
print(check.assert_close(sum(partials) + params["b2"], reference, "sum of the partials + b2"))
assert all(check.max_error(p, reference) > 1e-3 for p in partials), "no single rank has the answer alone"


# %% [markdown]
# ## 3. Forward and backward, with a replicated loss
#
# In a transformer, the MLP's output is the same on every rank and every rank computes the same
# loss from it. As lesson 2 showed, that calls for Megatron's conjugate pair:
#
# * **f** = `copy_to_group` where the replicated `x` enters: identity forward, all-reduce
#   backward (each rank's `x.grad` only holds its own shard's contribution; the all-reduce adds
#   the others);
# * **g** = `reduce_from_group` where the partial sums leave: all-reduce forward, identity
#   backward.
#
# Here is the layer, with a switch for section 4 (the library keeps the same function,
# `simcomm.parallel.tensor.tp_mlp`, which later lessons import; a test checks they agree):

# %%
def tp_mlp(comm, x, shards, conjugate=True):
    """The tensor-parallel MLP on this rank's `shards`; `x` is replicated, and so is the output."""
    if conjugate:
        x = comm.copy_to_group(x)                                   # f: identity, all-reduce backward
    h = torch.nn.functional.gelu(x @ shards["w1"].T + shards["b1"])   # column-parallel: (batch, ffn/P)
    partial = h @ shards["w2"].T                                    # row-parallel: this rank's share
    out = comm.reduce_from_group(partial) if conjugate else comm.all_reduce(partial)   # g, or plain
    return out + shards["b2"]                                       # the bias once, after the sum

# %% [markdown]
# Now compare everything with the single-device MLP.

# %% expect=["output on every rank: matches the reference", "x.grad on every rank: matches the reference", "every shard's gradient: matches the reference"]
def train_step(comm, x, params, conjugate, loss_scale=1.0):
    params = {name: p.to(comm.device) for name, p in params.items()}
    shards = shard_mlp(params, comm.rank, comm.world_size)
    x = x.to(comm.device, copy=True).requires_grad_()     # a leaf of this rank's own graph
    out = tp_mlp(comm, x, shards, conjugate=conjugate)
    (out.pow(2).sum() * loss_scale).backward()       # the same loss on every rank
    return out.detach(), x.grad, {name: p.grad for name, p in shards.items()}

ref_params = {name: p.clone().requires_grad_() for name, p in params.items()}
ref_x = x.clone().requires_grad_()
mlp(ref_x, ref_params).pow(2).sum().backward()
ref_grads = {name: p.grad for name, p in ref_params.items()}
ref_shards = [shard_mlp(ref_grads, rank, world_size) for rank in range(world_size)]  # slices of the grads

outs = world.run(train_step, x, params, True)
print(check.assert_close([out for out, _, _ in outs], [reference] * world_size, "output on every rank"))
print(check.assert_close([g for _, g, _ in outs], [ref_x.grad] * world_size, "x.grad on every rank"))
print(check.assert_close([grads for _, _, grads in outs], ref_shards, "every shard's gradient"))

# %% [markdown]
# What did that cost in communication? One all-reduce forward (from *g*) and one backward
# (from *f*), each over one `(batch, hidden)` activation: the trace records the buffer size of
# each call. On the wire, an all-reduce of that buffer sends `2 (n - 1) / n` of it per rank with
# the ring of lesson 3.

# %% expect=["[('all_reduce', 'forward'), ('all_reduce', 'backward')] each on 192 bytes per rank"]
calls = [(op, phase) for _, op, phase in world.trace.ops()]
assert calls == [("all_reduce", "forward"), ("all_reduce", "backward")], calls
activation_bytes = batch * hidden * 8                                  # float64
assert all(e.nbytes == activation_bytes for e in world.trace), "each all-reduce is over one activation"
print(calls, f"each on {activation_bytes} bytes per rank")

# %% [markdown]
# The timeline shows the two collectives on every rank (the real backend shows measured times,
# the simulator its own thread timings):

# %% tags=["nbval-ignore-output"]
viz.timeline_figure(world.trace)

# %% [markdown]
# How long would those two all-reduces take on an 8-GPU H100 node? The cost model of lesson 3
# can put a modelled duration on every traced call (`cost.annotate`). For an activation this
# small, each all-reduce costs its fixed latency, whatever the bytes:

# %%
cost.annotate(world.trace, "h100-nvswitch")
latency = cost.estimate("all_reduce", 0, world_size, "h100-nvswitch").time
assert all(abs(event.modelled - latency) < 0.05 * latency for event in world.trace)
print(f"each all-reduce: {world.trace.events[0].modelled * 1e6:.0f} us "
      f"(of which latency {latency * 1e6:.0f} us)")

# %% tags=["nbval-ignore-output"]
viz.timeline_figure(world.trace, modelled=True)

# %% [markdown]
# ## 4. The same code without the conjugate pair
#
# `conjugate=False` uses the plain differentiable `all_reduce` where *g* was, and no *f*. With
# the same replicated loss, the all-reduce's backward adds up the `world_size` identical copies
# of the loss's gradient:

# %% expect=["w1, b1, w2 gradients = world_size x reference: matches the reference", "b2 gradient (after the all-reduce) unchanged: matches the reference", "x.grad summed over ranks = world_size x reference: matches the reference"]
outs = world.run(train_step, x, params, False)
sharded = [{name: g for name, g in grads.items() if name != "b2"} for _, _, grads in outs]
expected = [{name: world_size * g for name, g in ref.items() if name != "b2"} for ref in ref_shards]
print(check.assert_close(sharded, expected, "w1, b1, w2 gradients = world_size x reference"))
print(check.assert_close([grads["b2"] for _, _, grads in outs], [ref_grads["b2"]] * world_size,
                           "b2 gradient (after the all-reduce) unchanged"))
print(check.assert_close(sum(g for _, g, _ in outs), world_size * ref_x.grad,
                           "x.grad summed over ranks = world_size x reference"))
assert check.max_error(outs[0][1], ref_x.grad) > 1e-3, "without f, one rank's x.grad is incomplete"

# %% [markdown]
# A communicator with only the plain all-reduce (like the vLLM-style one whose API `simcomm`
# keeps) gets these gradients, and they are
# right under the other convention: the objective is the **sum of per-rank losses**, so each
# rank scales its loss by `1 / world_size`. Then the sharded weights get exact gradients, but a
# replicated parameter such as `b2` gets only its rank's share, and must be all-reduced
# separately (as data parallelism does for every parameter):

# %% expect=["w1, b1, w2 gradients with loss / world_size: matches the reference", "b2 gradient summed over ranks: matches the reference"]
outs = world.run(train_step, x, params, False, 1 / world_size)
sharded = [{name: g for name, g in grads.items() if name != "b2"} for _, _, grads in outs]
print(check.assert_close(sharded, [{k: v for k, v in ref.items() if k != "b2"} for ref in ref_shards],
                           "w1, b1, w2 gradients with loss / world_size"))
print(check.assert_close(sum(grads["b2"] for _, _, grads in outs), ref_grads["b2"],
                           "b2 gradient summed over ranks"))


# %% [markdown]
# ## Exercise: find the bugs in a tensor-parallel MLP
#
# A colleague wrote this layer for a replicated loss, with the shards of `shard_mlp`. It runs,
# and its output even has the right shape, but it has **two** bugs. Run the check on it to see
# what it reports, find both bugs, and write the fixed layer as `my_tp_mlp` (the check
# compares your output, `x.grad` and every shard's gradient with the single-device MLP on 4
# virtual ranks).

# %%
def buggy_tp_mlp(comm, x, shards):
    h = torch.nn.functional.gelu(x @ shards["w1"].T + shards["b1"])      # (batch, ffn / P)
    return comm.reduce_from_group(h @ shards["w2"].T + shards["b2"])     # (batch, hidden)

print(check.check_tp_mlp(buggy_tp_mlp))

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def my_tp_mlp(comm, x, shards):
    raise NotImplementedError   # your fixed layer

print(check.check_tp_mlp(my_tp_mlp))

# %% [markdown] expect=["Correct: output and every gradient equal the single-device MLP on every rank."] tags=["solution"]
# <details><summary>Solution of the exercise (open it once you have tried)</summary>
#
# ```python
# # Solution of the exercise.
# # Bug 1: b2 is added on every rank before the sum, so the output holds world_size x b2.
# # Bug 2: no f (copy_to_group) where x enters, so each rank's x.grad misses the other shards' part.
# def tp_mlp_solution(comm, x, shards):
#     x = comm.copy_to_group(x)                                            # f
#     h = torch.nn.functional.gelu(x @ shards["w1"].T + shards["b1"])      # (batch, ffn / P)
#     return comm.reduce_from_group(h @ shards["w2"].T) + shards["b2"]     # g, then the bias once
#
# print(check.check_tp_mlp(tp_mlp_solution))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * Column-parallel first (split `w1` by rows), row-parallel second (split `w2` by columns): the
#   activation between them never needs to be gathered, so an MLP costs **one all-reduce forward
#   and one backward**, each of one activation.
# * Each rank stores `1 / world_size` of `w1` and `w2` and does `1 / world_size` of the work.
# * For a replicated loss, put *f* (`copy_to_group`) where the input enters and *g*
#   (`reduce_from_group`) where the output leaves. A plain all-reduce there is only right if each
#   rank's loss is scaled by `1 / world_size` and replicated parameters are all-reduced.

# %%
world.close()
