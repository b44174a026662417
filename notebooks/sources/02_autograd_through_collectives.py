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
# # Lesson 2: autograd through collectives
#
# **Goal:** see that the backward pass of every collective is another collective (its *dual*),
# and learn the one convention that decides whether your gradients are right or
# `world_size` times too large.
#
# On one device you call `loss.backward()` and autograd walks the graph back. In distributed
# training every rank calls `loss.backward()` on its own graph, and that graph runs *through*
# the communication: if the forward pass gathered pieces from all ranks, the backward pass must
# send each piece's gradient back to the rank it came from. Every claim below is checked with an
# `assert` against the same computation on one device, in float64.

# %%
import torch
import simcomm
from simcomm import ReduceOp, viz
import simcomm.lessons.lesson_02 as check
viz.use_export_renderer()   # figures live in JupyterLab and survive an HTML export

world_size = 4
world = simcomm.configured_backend(world_size)   # virtual ranks, or real processes if SIMCOMM_BACKEND=real
print(f"{world_size} ranks, backend {simcomm.backend.backend_name()!r}")


# %% [markdown]
# ## 1. All-gather: the forward concatenates, the backward reduce-scatters
#
# Each rank holds a shard `x` of two numbers: rank `r` holds `[10r, 10r + 1]`. `all_gather`
# gives every rank the whole vector. Then each rank computes its **own** loss with its own
# weights (as if each rank had its own micro-batch). The objective we differentiate is the
# **sum of the per-rank losses**.

# %% expect=["rank 0: all_gather -> [0.0, 1.0, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0]   x.grad = [0.0, 10.0]", "rank 1: all_gather -> [0.0, 1.0, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0]   x.grad = [20.0, 30.0]", "rank 2: all_gather -> [0.0, 1.0, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0]   x.grad = [40.0, 50.0]", "rank 3: all_gather -> [0.0, 1.0, 10.0, 11.0, 20.0, 21.0, 30.0, 31.0]   x.grad = [60.0, 70.0]"]
def gather_then_weigh(comm):
    x = (torch.arange(2, dtype=torch.float64, device=comm.device) + 10 * comm.rank).requires_grad_()  # (2,)
    full = comm.all_gather(x, dim=0)                                              # (2 * world_size,)
    weights = torch.arange(full.numel(), dtype=torch.float64, device=comm.device) * (comm.rank + 1)
    (full * weights).sum().backward()
    return full.detach(), x.grad

outs = world.run(gather_then_weigh)
for rank, (full, grad) in enumerate(outs):
    print(f"rank {rank}: all_gather -> {full.tolist()}   x.grad = {grad.tolist()}")

# %% [markdown]
# Rank 0's `x` appears in *every* rank's loss, so its gradient is the **sum over ranks** of the
# gradient that reached its slot. That is a reduce-scatter: add up the gradients of the full
# vector over ranks, and give each rank the chunk that belongs to it.
#
# The single-device reference: one tensor holding all shards, the summed loss, plain autograd.

# %% expect=["all_gather output: matches the reference", "x.grad on every rank: matches the reference"]
x = torch.cat([torch.arange(2, dtype=torch.float64) + 10 * r for r in range(world_size)]).requires_grad_()
weights = torch.arange(x.numel(), dtype=torch.float64)
total_loss = sum((x * weights * (r + 1)).sum() for r in range(world_size))
total_loss.backward()
print(check.assert_close([full for full, _ in outs], [x.detach()] * world_size, "all_gather output"))
print(check.assert_close([grad for _, grad in outs], list(x.grad.chunk(world_size)), "x.grad on every rank"))

# %% [markdown]
# The trace records every transport call, with its phase. The backward pass really did call a
# reduce-scatter:

# %% expect=["[('all_gather', 'forward'), ('reduce_scatter', 'backward')]"]
calls = [(op, phase) for _, op, phase in world.trace.ops()]
assert calls == [("all_gather", "forward"), ("reduce_scatter", "backward")], calls
print(calls)

# %% [markdown]
# The figure shows the same thing for a 2-D shard on each rank: inputs, the all-gather output,
# the incoming gradients and the resulting input gradients, coloured by the rank each element
# came from. (Figures are drawn on the simulator, whatever the backend.)

# %% tags=["nbval-ignore-output"]
viz.collective_figure("all_gather", world_size=world_size, shape=(2, 3), dim=0)


# %% [markdown]
# ## 2. Every collective has a dual
#
# A backward rule is right when it is the *adjoint* of the forward: for any input `x` and any
# incoming gradient `g`, summed over ranks, `<forward(x), g> = <x, backward(g)>`. This is the
# "dot-product test". The program below runs one collective on random 4-D tensors
# `(batch, seq, heads, head_dim)`, feeds a random gradient, and returns both sides.

# %% expect=["all_reduce      backward calls all_reduce      dot-product test passed", "all_gather      backward calls reduce_scatter  dot-product test passed", "reduce_scatter  backward calls all_gather      dot-product test passed", "all_to_all_4D   backward calls all_to_all      dot-product test passed", "broadcast       backward calls reduce          dot-product test passed", "reduce          backward calls broadcast       dot-product test passed"]
def dot_test(comm, op, kwargs):
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(2, 4, 4, 3, dtype=torch.float64, generator=gen).to(comm.device).requires_grad_()
    y = getattr(comm, op)(x, **kwargs)                              # x: (b, s, h, d)
    g = torch.randn(y.shape, dtype=torch.float64, generator=gen).to(comm.device)  # arriving at y
    y.backward(g)
    return (y * g).sum().item(), (x * x.grad).sum().item()

cases = {"all_reduce": {}, "all_gather": {"dim": 1}, "reduce_scatter": {"dim": 1},
         "all_to_all_4D": {"scatter_dim": 2, "gather_dim": 1}, "broadcast": {"src": 0},
         "reduce": {"dst": 0}}
for op, kwargs in cases.items():
    sides = world.run(dot_test, op, kwargs)
    forward_side, backward_side = sum(s for s, _ in sides), sum(s for _, s in sides)
    assert abs(forward_side - backward_side) < 1e-9 * max(1.0, abs(forward_side)), op
    backward_ops = sorted({name for _, name, phase in world.trace.ops() if phase == "backward"})
    print(f"{op:15} backward calls {', '.join(backward_ops):15} dot-product test passed")


# %% [markdown]
# * all-gather and reduce-scatter are each other's duals;
# * an all-to-all's dual is the all-to-all with the two dims swapped (for Ulysses:
#   sequence -> heads forward, heads -> sequence backward);
# * a sum all-reduce is its own dual;
# * broadcast and reduce are each other's duals: broadcast's backward reduces (sums) the
#   gradients onto the source rank, reduce's backward broadcasts the destination's gradient;
# * scatter and gather are each other's duals too (`comm.scatter`'s backward gathers the
#   chunks' gradients onto the source);
# * the uneven `all_to_all_single` (expert parallelism's dispatch) runs backward with its two
#   split lists swapped, so every gradient row returns to the rank and row it came from.
#
# `slice` is special: it takes a tensor that is the *same* on every rank (replicated) and keeps
# this rank's chunk, with no communication at all. Its backward all-gathers the gradients, so
# every rank ends with the full gradient of the shared tensor. With `scale_grad=True` that
# gradient is divided by the world size.

# %% expect=["slice(scale_grad=False) x.grad: matches the reference", "  calls: [('all_gather', 'backward')]", "slice(scale_grad=True) x.grad: matches the reference", "  calls: [('all_gather', 'backward')]"]
def slice_program(comm, scale_grad):
    x = torch.arange(8, dtype=torch.float64, device=comm.device, requires_grad=True)   # replicated
    mine = comm.slice(x, dim=0, scale_grad=scale_grad)              # (8 / world_size,)
    (mine ** 2).sum().backward()
    return x.grad

for scale_grad in (False, True):
    grads = world.run(slice_program, scale_grad)
    shared = torch.arange(8, dtype=torch.float64)
    expected = 2 * shared / (world_size if scale_grad else 1)      # d/dx of sum_r (x_r chunk)^2
    print(check.assert_close(grads, [expected] * world_size, f"slice(scale_grad={scale_grad}) x.grad"))
    print(f"  calls: {[(op, phase) for _, op, phase in world.trace.ops()]}")

# %% [markdown]
# Which is right? Only `scale_grad=True` passes the dot-product test, which counts every
# rank's copy of `x` as an input of its own: the sum over ranks of `<x, x.grad>` is then
# `world_size` times `<y, g>` without the scaling. Both settings are right, for different `x`:
#
# * `scale_grad=False`: `x` is **one** tensor every rank holds a copy of, and nothing upstream
#   sums the ranks' gradients again (a constant input, a weight each rank updates itself).
#   Every rank's `x.grad` is then the full gradient of the sum of losses, as checked above.
# * `scale_grad=True`: the copies came out of a collective whose backward sums over ranks (an
#   all-gather, an all-reduce, Megatron's *f*), or their gradients are all-reduced later, as
#   data parallelism does. That sum would count the gradient `world_size` times, so `slice`
#   divides first. Below, `slice(all_gather(y))` gives each rank its own `y` back, so `y.grad`
#   must equal `2 y`:

# %% expect=["slice(scale_grad=False): sum of <x, x.grad> / sum of <y, g> = 4, y.grad after all_gather = 4 x exact", "slice(scale_grad=True): sum of <x, x.grad> / sum of <y, g> = 1, y.grad after all_gather = 1 x exact"]
def slice_dot_test(comm, scale_grad):
    x = torch.randn(8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = x.to(comm.device).requires_grad_()
    y = comm.slice(x, dim=0, scale_grad=scale_grad)            # x is the same on every rank
    g = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1 + comm.rank))
    g = g.to(comm.device)
    y.backward(g)
    return (y * g).sum().item(), (x * x.grad).sum().item()

def gathered_then_sliced(comm, scale_grad):
    y = torch.arange(2.0, dtype=torch.float64, device=comm.device) + 10 * comm.rank + 1   # this rank's own
    y.requires_grad_()
    mine = comm.slice(comm.all_gather(y, dim=0), dim=0, scale_grad=scale_grad)          # y again
    (mine ** 2).sum().backward()
    return (y.grad / (2 * y.detach())).mean().item()             # 1 when y.grad is exact

for scale_grad in (False, True):
    sides = world.run(slice_dot_test, scale_grad)
    ratio = sum(b for _, b in sides) / sum(f for f, _ in sides)
    factor = world.run(gathered_then_sliced, scale_grad)[0]
    print(f"slice(scale_grad={scale_grad}): sum of <x, x.grad> / sum of <y, g> = {ratio:.3g}, "
          f"y.grad after all_gather = {factor:.3g} x exact")


# %% [markdown]
# ## 3. Sum of losses, or one replicated loss?
#
# The rules above are exact when the objective is the **sum of the per-rank losses**. Often,
# though, every rank computes the *same* loss: after an all-reduce every rank holds the same
# tensor, and each computes `loss = (s ** 2).sum()`. The objective you mean is that one number,
# not `world_size` copies of it. Each rank's backward still runs the all-reduce's backward (an
# all-reduce of the gradients), which adds up the `world_size` identical copies: the gradient
# comes out `world_size` times too large.
#
# Megatron's fix is a pair of operators: `reduce_from_group` (called *g*: all-reduce forward,
# identity backward) and `copy_to_group` (called *f*: identity forward, all-reduce backward).

# %% expect=["loss on every rank: matches the reference", "grads with reduce_from_group: matches the reference", "grads with all_reduce = world_size x reference: matches the reference"]
def replicated_loss(comm, conjugate):
    a = torch.tensor([1.0, 2.0], dtype=torch.float64, device=comm.device) * (comm.rank + 1)
    a.requires_grad_()
    s = comm.reduce_from_group(a) if conjugate else comm.all_reduce(a)   # the same on every rank
    loss = (s ** 2).sum()                                                # the same number on every rank
    loss.backward()
    return loss.detach(), a.grad

a = torch.stack([torch.tensor([1.0, 2.0], dtype=torch.float64) * (r + 1) for r in range(world_size)])
a.requires_grad_()
reference_loss = (a.sum(0) ** 2).sum()          # one loss, computed once
reference_loss.backward()

plain = world.run(replicated_loss, False)
megatron = world.run(replicated_loss, True)
print(check.assert_close([l for l, _ in plain], [reference_loss.detach()] * world_size, "loss on every rank"))
print(check.assert_close([g for _, g in megatron], list(a.grad), "grads with reduce_from_group"))
print(check.assert_close([g for _, g in plain], list(world_size * a.grad),
                           "grads with all_reduce = world_size x reference"))

# %% [markdown]
# Neither rule is wrong: they answer different questions. With `all_reduce`, the gradient is
# exact for the objective `world_size * loss` (the sum of the `world_size` per-rank losses);
# with `reduce_from_group` it is exact for one copy of the loss. The code must say which one it
# means. Lesson 4 compares the two in a tensor-parallel MLP.

# %% expect=["all_reduce gradients / reduce_from_group gradients = [4.0]"]
ratio = torch.stack([g for _, g in plain]) / torch.stack([g for _, g in megatron])
assert torch.allclose(ratio, torch.full_like(ratio, world_size))
print(f"all_reduce gradients / reduce_from_group gradients = {ratio.unique().tolist()}")


# %% [markdown]
# ## 4. The gradient of a MAX all-reduce
#
# `all_reduce(x, op=ReduceOp.MAX)` is not linear: only the rank holding the largest value
# influences the result, so only it receives the gradient. When several ranks tie, they share it
# evenly (as `torch.amax` does on one device).

# %% expect=["rank 0: x = [0.0, 3.0, 1.0, 0.0]  max = [3.0, 3.0, 1.0, 5.0]  x.grad = [0.0, 4.0, 1.0, 0.0]", "rank 1: x = [1.0, 2.0, 1.0, 0.0]  max = [3.0, 3.0, 1.0, 5.0]  x.grad = [0.0, 0.0, 1.0, 0.0]", "rank 2: x = [2.0, 1.0, 1.0, 5.0]  max = [3.0, 3.0, 1.0, 5.0]  x.grad = [0.0, 0.0, 1.0, 4.0]", "rank 3: x = [3.0, 0.0, 1.0, 0.0]  max = [3.0, 3.0, 1.0, 5.0]  x.grad = [4.0, 0.0, 1.0, 0.0]"]
def max_program(comm):
    r = comm.rank
    x = torch.tensor([r, 3 - r, 1, 5 * (r == 2)], dtype=torch.float64, device=comm.device)
    x.requires_grad_()
    y = comm.all_reduce(x, op=ReduceOp.MAX)
    y.sum().backward()                 # each rank's loss; the objective is their sum
    return x.detach(), y.detach(), x.grad

outs = world.run(max_program)
for rank, (x_r, y_r, grad) in enumerate(outs):
    print(f"rank {rank}: x = {x_r.tolist()}  max = {y_r.tolist()}  x.grad = {grad.tolist()}")

# %% expect=["MAX all-reduce gradients: matches the reference"]
stacked = torch.stack([x_r for x_r, _, _ in outs]).requires_grad_()     # (world_size, 4)
sum(stacked.amax(0).sum() for _ in range(world_size)).backward()         # the sum of the 4 losses
print(check.assert_close([grad for _, _, grad in outs], list(stacked.grad), "MAX all-reduce gradients"))


# %% [markdown]
# Column 2 ties on every rank, so each rank gets a quarter of the summed gradient (4 / 4 = 1).

# %% [markdown]
# ## 5. A gradient check across ranks
#
# `torch.autograd.gradcheck` compares autograd with finite differences on one device.
# `check.gradcheck_across_ranks` does the same through the collectives: it nudges *every*
# rank's input along a random direction, re-runs the whole program, and compares the change of
# the summed loss with what the ranks' `x.grad` predict.

# %%
def chain(comm, x):
    y = comm.all_gather(x, dim=0)                                   # (3 * world_size,)
    z = comm.reduce_scatter(torch.sin(y) * (comm.rank + 1), dim=0)  # (3,)
    m = comm.all_reduce(z, op=ReduceOp.MAX)                         # (3,)
    return (m ** 2).sum() + comm.all_reduce(x * x, op=ReduceOp.PRODUCT).sum()

inputs = [torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(r))
          for r in range(world_size)]
error = check.gradcheck_across_ranks(world, chain, inputs)
print(f"largest relative error: {error:.1e}")


# %% [markdown]
# ## Exercise: write the backward of all-gather
#
# Given `grad_out`, the gradient arriving at the output of `all_gather(x, dim)`, return the
# gradient of this rank's input `x`. One collective call does it. Replace the
# `raise NotImplementedError` and run the check (it runs your function on 4 virtual ranks).
#
# The check judges the values first, then the bytes every rank sends and receives, by the rule
# lesson 07 uses too: the backward of all-gather is a reduce-scatter, and it moves the fewest
# bytes. An all-reduce followed by a chunk has the right values but moves about twice the bytes,
# so it is not accepted.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def my_all_gather_backward(comm, grad_out, dim):
    raise NotImplementedError   # your code: return the gradient of this rank's x

print(check.check_all_gather_backward(my_all_gather_backward))

# %% [markdown] expect=["Correct: your backward equals autograd's on every rank, for dim in (0, 1)."] tags=["solution"]
# <details><summary>Solution of the exercise (open it once you have tried)</summary>
#
# ```python
# # Solution of the exercise.
# def all_gather_backward(comm, grad_out, dim):
#     return comm.reduce_scatter(grad_out, dim=dim)   # sum over ranks, keep my chunk
#
# print(check.check_all_gather_backward(all_gather_backward))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * Each collective's backward is its dual collective: all-gather <-> reduce-scatter,
#   all-to-all <-> the swapped all-to-all, sum all-reduce <-> itself, slice -> all-gather.
# * The rules are exact for the **sum of the per-rank losses**. If every rank computes the same
#   replicated loss, a plain all-reduce's backward gives `world_size` times the gradient; use the
#   conjugate pair `copy_to_group` / `reduce_from_group` there.
# * MAX/MIN all-reduce send the gradient only to the rank(s) holding the extreme.
# * You can check any distributed gradient numerically by perturbing all ranks at once.

# %%
world.close()
