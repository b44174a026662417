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
# # Lesson 7: ZeRO and FSDP
#
# **Goal:** see where a data-parallel rank's memory goes (parameters, gradients, Adam's two
# moments), then remove the `P`-fold redundancy stage by stage, ZeRO-1, -2 and -3, measuring the
# bytes each rank holds and moves, and checking that every stage still takes *exactly* the step
# single-device Adam takes.
#
# The model is a small tanh MLP (`simcomm.parallel.zero.MLP`) with `psi` parameters in fp32, trained for
# 2 Adam steps on 4 ranks. The reference is `torch.optim.Adam` on the whole batch, float64.

# %% expect=["psi = 5768 parameters on 4 ranks"]
import torch
import simcomm
from simcomm.model import cost
from simcomm import viz
from simcomm.parallel import zero, fsdp
import simcomm.lessons.lesson_07 as check
viz.use_export_renderer()   # figures live in JupyterLab and survive an HTML export

world_size = 4
world = simcomm.configured_backend(world_size, memory=True)   # measure every rank's bytes
mlp = zero.MLP((16, 64, 64, 8))
psi = mlp.numel
reference = fsdp.adam_reference(mlp, steps=2)                 # float64, one device
print(f"psi = {psi} parameters on {world_size} ranks")

# %% [markdown]
# ## 1. Memory first: plain data parallelism (stage 0)
#
# `zero.train(comm, stage, mlp, steps=2)` trains on the communicator; it labels what it allocates
# (`simcomm.memory.label`) and marks `"after step k"` when step `k` is done. In plain data
# parallelism every rank holds everything: 4 bytes per parameter, 4 per gradient and 8 of Adam
# state (two fp32 moments), `16 psi` in all, four times over on four ranks.

# %% expect=["stage 0 parameters: matches the reference"]
outs = world.run(zero.train, 0, mlp, steps=2)            # the step of stage 0, section 2 writes it out
print(check.assert_close(fsdp.assemble(0, outs, mlp), reference, "stage 0 parameters", atol=1e-5))  # fp32 vs float64
reports = {"DP (stage 0)": world.memory}
volume = {"DP (stage 0)": sum(sum(e.sent.values()) for e in world.trace.events if e.rank == 0)}

# %% tags=["nbval-ignore-output"]
viz.memory_figure(world.memory, "after step 2", title="Plain data parallelism: every rank holds all model states")

# %% [markdown]
# ## 2. ZeRO-1, -2, -3, each a few lines on the communicator
#
# Each stage is one training step on the communicator (written below, after the list):
#
# * **ZeRO-1**: each rank updates only its `1/P` shard of the parameters, so Adam's moments exist
#   for that shard only. Gradients: a **reduce-scatter** gives each rank the summed gradient of
#   its shard; an **all-gather** of the updated shards gives every rank the whole model again.
# * **ZeRO-2**: the same, and the full gradient is freed as soon as its shard is reduced (here,
#   after the whole backward; section 8 reduces each layer during backward, as DeepSpeed does).
# * **ZeRO-3**: parameters are stored as shards too; each layer is **all-gathered just before it
#   runs and freed after**, in forward and again in backward. The version here gets the second
#   gather by *recomputing* each layer's forward in backward (`torch.utils.checkpoint`): it keeps no
#   activations inside a layer and pays a second forward. FSDP (PyTorch's ZeRO-3) instead keeps the
#   activations and re-gathers only the parameters, in a hook just before each layer's backward;
#   section 8 builds that way too and compares the two.
#
# A step gets this rank's `params` (one flat, padded vector per layer: whole for stages 0-2, this
# rank's `1/P` shard for stage 3), one `zero.Adam` per layer over what this rank updates, `grads`
# (where stage 2 keeps its gradient shards) and this rank's `batch`. `backward` runs the model with
# `layer(i)` giving layer `i`'s weights, under the memory labels of section 1; `zero.shard(flat,
# comm)` is this rank's chunk of a vector (a view). (The library keeps the same steps,
# `zero.step_stage(k)`, which later lessons use; a test checks that these behave alike.)

# %%
from simcomm import memory


def backward(mlp, batch, layer, recompute=False):
    x, y, global_batch = batch
    with memory.label("activations"):
        loss = mlp.loss(x, y, global_batch, layer, recompute=recompute)
    with memory.label("gradients"):
        loss.backward()


def step_stage0(comm, mlp, params, opt, grads, batch):          # plain data parallelism
    backward(mlp, batch, params.__getitem__)
    for p, adam in zip(params, opt):
        with memory.label("gradients"):
            p.grad = comm.all_reduce(p.grad)               # the whole batch's gradient, on every rank
        adam.update(p.detach(), p.grad)                    # every rank updates every parameter

# %%
def step_stage1(comm, mlp, params, opt, grads, batch):          # ZeRO-1: optimizer state sharded
    backward(mlp, batch, params.__getitem__)
    for p, adam in zip(params, opt):
        with memory.label("gradients"):                    # the full local gradient stays
            summed = comm.reduce_scatter(p.grad, dim=0)    # only my chunk of the sum
        mine = zero.shard(p.detach(), comm)                # this rank's 1/P of the parameters
        adam.update(mine, summed)                          # Adam's moments exist for that shard only
        del summed
        p.detach().copy_(comm.all_gather(mine, dim=0))     # every rank gets every updated shard


def step_stage2(comm, mlp, params, opt, grads, batch):          # ZeRO-2: gradients sharded too
    backward(mlp, batch, params.__getitem__)
    for i, (p, adam) in enumerate(zip(params, opt)):
        with memory.label("gradients"):
            grads[i] = comm.reduce_scatter(p.grad, dim=0)  # summed over ranks, only my chunk kept
        p.grad = None                                      # the full gradient is freed
        mine = zero.shard(p.detach(), comm)
        adam.update(mine, grads[i])
        p.detach().copy_(comm.all_gather(mine, dim=0))

# %%
def step_stage3(comm, mlp, params, opt, grads, batch):          # ZeRO-3: parameters sharded too
    def gathered(i):                                       # layer i, just before it runs
        with memory.label("parameters"):
            return comm.all_gather(params[i], dim=0)       # its backward: a reduce-scatter into .grad
    backward(mlp, batch, gathered, recompute=True)         # freed after forward, gathered again in backward
    for p, adam in zip(params, opt):
        adam.update(p.detach(), p.grad)                    # shard, gradient shard, moments: all 1/P


steps = {0: step_stage0, 1: step_stage1, 2: step_stage2, 3: step_stage3}

# %% [markdown]
# `zero.train(comm, stage, mlp, steps=2, step=...)` runs the labelled set-up of section 1 and then
# a step function. Every stage must take the same step as single-device Adam:

# %% expect=["ZeRO-1 parameters after 2 steps: matches the reference", "ZeRO-2 parameters after 2 steps: matches the reference", "ZeRO-3 parameters after 2 steps: matches the reference"]
for stage in (1, 2, 3):
    outs = world.run(zero.train, stage, mlp, steps=2, step=steps[stage])
    print(check.assert_close(fsdp.assemble(stage, outs, mlp), reference, f"ZeRO-{stage} parameters after 2 steps", atol=1e-5))
    reports[f"ZeRO-{stage}"] = world.memory
    volume[f"ZeRO-{stage}"] = sum(sum(e.sent.values()) for e in world.trace.events if e.rank == 0)
    if stage == 3:
        zero3_trace = world.trace

# %% [markdown]
# ## 3. Measured bytes next to the ZeRO paper's formulas
#
# The paper (Rajbhandari et al., 2020) counts mixed-precision training: 2 bytes per fp16
# parameter, 2 per fp16 gradient and `K = 12` bytes of optimizer state (fp32 master copy and two
# moments): `(2 + 2 + K) psi` per rank, divided by `P` for each state a stage shards. This model is
# fp32 throughout, so here it is `(4 + 4 + 8) psi`, with the same divisions:

# %% tags=["nbval-ignore-output"]
viz.memory_figure(reports, "after step 2", title="Bytes per rank after step 2, by stage")

# %% [markdown]
# The bars are the **steady state** after each step, what the paper's table describes. The markers
# are each rank's **peak** over the whole run, and there ZeRO-2 is only 4% below ZeRO-1: this ZeRO-2
# reduce-scatters after the whole backward, so at its peak every full gradient exists, as in ZeRO-1.
# Freeing the full gradient pays off at the peak only if each layer's gradient is reduced while
# backward still runs (section 8).

# %% expect=["every stage: measured bytes = the formula (within 1%)"]
rows = []
for stage, name in enumerate(reports):
    formula = zero.expected_bytes(stage, psi, world_size)
    measured = reports[name].at("after step 2")[0]
    for state, want in formula.items():
        assert abs(measured[state] - want) <= 0.01 * want, (name, state, measured[state], want)
    rows.append(f"{name:13} " + "  ".join(f"{s} {measured[s]:>6} (formula {formula[s]:>6.0f})" for s in formula))
print("every stage: measured bytes = the formula (within 1%)")

# %% tags=["nbval-ignore-output"]
print("\n".join(rows))

# %% [markdown]
# ## 4. What it costs in communication
#
# In units of `psi` values per rank (a ring sends `(P-1)/P` of a buffer per all-gather or
# reduce-scatter, twice that per all-reduce): DP all-reduces the gradients, `2 psi`. ZeRO-1 and
# -2 reduce-scatter gradients (`psi`) and all-gather parameters (`psi`): the **same** `2 psi`, for
# a quarter of the optimizer memory. ZeRO-3 gathers parameters twice (forward and backward):
# `3 psi`. Measured from the trace, per step:

# %% expect=["DP (stage 0): 2.0 psi, ZeRO-1: 2.0 psi, ZeRO-2: 2.0 psi, ZeRO-3: 3.0 psi per step"]
unit = (world_size - 1) / world_size * psi * 4 * 2           # (P-1)/P psi fp32 values, over 2 steps
print(", ".join(f"{name}: {sent / unit:.1f} psi" for name, sent in volume.items()) + " per step")

# %% [markdown]
# ## 5. The punchline: all-gather forward, reduce-scatter backward
#
# Lesson 2 showed that the backward of an all-gather is a reduce-scatter. ZeRO-3's code never
# calls a reduce-scatter itself: it all-gathers each layer in forward, and autograd runs the dual
# collective in backward (a reduce-scatter of every layer's gradient, in the trace below), leaving
# each rank exactly the summed gradient of its shard.

# %% expect=["ZeRO-3, first step on rank 0: 3 all_gather forward, 3 all_gather (again, in backward), 3 reduce_scatter backward"]
first = [e for e in zero3_trace.events if e.rank == 0][:9]
gathers = [e for e in first if e.op == "all_gather"]
scatters = [e for e in first if e.op == "reduce_scatter"]
assert len(gathers) == 6 and len(scatters) == 3 and all(e.phase == "backward" for e in scatters)
assert sorted(e.nbytes for e in scatters) == sorted(e.nbytes * world_size for e in gathers[:3])
print("ZeRO-3, first step on rank 0: 3 all_gather forward, 3 all_gather (again, in backward), 3 reduce_scatter backward")

# %% [markdown]
# ## 6. Prefetching: gather the next layer while this one computes
#
# Just-in-time gathering makes each layer wait for its parameters. FSDP issues the *next* layer's
# all-gather (async) before computing the current one, so the gather travels while the GPU works.
# `fsdp.zero3_forward` declares 20 us of compute per layer; the modelled timeline shows both:

# %% expect=["prefetching hides all but the first gather; output: matches the reference"]
x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
timelines, exposed = {}, {}
for prefetch in (False, True):
    outs = world.run(fsdp.zero3_forward, x, mlp, prefetch=prefetch)
    timelines[prefetch] = viz.timeline_figure(world.trace, modelled=True, topology="a100-hdr-cluster")
    exposed[prefetch] = cost.modelled_timeline(world.trace, "a100-hdr-cluster").ranks[0].exposed
assert exposed[True] < 0.5 * exposed[False]
verdict = check.assert_close(outs, [fsdp.reference_forward(x, mlp)] * world_size, "output", atol=1e-5)
print("prefetching hides all but the first gather;", verdict)

# %% tags=["nbval-ignore-output"]
display(timelines[False].update_layout(title="ZeRO-3 forward, gathering each layer just in time (no prefetch)"))
timelines[True].update_layout(title="ZeRO-3 forward with prefetch: the next layer's gather overlaps this layer")

# %% [markdown]
# ## 7. FSDP2: `fully_shard` on virtual ranks
#
# PyTorch's FSDP2 wraps each layer with `fully_shard`: parameters become DTensors sharded over the
# ranks, gathered before use and freed after, gradients reduce-scattered. It runs unchanged on the
# virtual ranks (`fsdp.fsdp2_grads`), and its gradients are the single-device ones:

# %% expect=["FSDP2 gradients: matches the reference"]
xb, yb = (torch.randn(8, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n)) for n in (16, 8))
grads = world.run(fsdp.fsdp2_grads, xb, yb, mlp)
print(check.assert_close(grads, [fsdp.reference_grads(xb, yb, mlp)] * world_size, "FSDP2 gradients"))
fsdp_trace = world.trace

# %% tags=["nbval-ignore-output"]
calls = sorted({(e.op, e.phase) for e in fsdp_trace.events})
print("FSDP2's calls:", calls or "not traced (real processes: FSDP2 talks to gloo directly)")
viz.timeline_figure(fsdp_trace) if fsdp_trace.events else None

# %% [markdown]
# That timeline is **measured** on virtual ranks: a bar is the wall-clock time a rank's thread spent
# in the call while the ranks took turns on the CPU (rank 0's all-gather lasts until the last rank
# arrives; the last rank's is short). It shows the order of the calls, not what a network would
# take; the modelled timelines of section 6 do that.
#
# ## 8. Two more ways: ZeRO-2 during backward, and ZeRO-3 as FSDP does it
#
# `zero.train(..., variant=...)` runs the same stages differently (`zero.VARIANTS`):
#
# * ZeRO-2 `"in_backward"`: a hook on each layer's parameters reduce-scatters its gradient the
#   moment backward has produced it, and frees it: the whole model's full gradient never exists.
# * ZeRO-3 `"fsdp"`: a saved-tensor hook keeps each layer's activations but not its gathered
#   parameters, and re-gathers them when backward reaches the layer; the all-gather's backward
#   reduce-scatters the gradient (FSDP's pre- and post-backward steps). No forward is recomputed.
#
# A deeper model (8 equal hidden layers) makes the peaks differ; all four take Adam's step:

# %% expect=["ZeRO-2 in backward: the peak is 24% below ZeRO-2 after backward's; at its peak it holds less than half a full gradient", "ZeRO-3: both ways 9 reduce-scatters in backward; FSDP's way re-gathers 8 layers in backward, checkpointing re-runs 9 forwards", "every way, fp32 against float64 Adam: matches the reference"]
deep = zero.MLP((16,) + (64,) * 8 + (8,))
ways = {"ZeRO-2 after backward": (2, "after_backward"), "ZeRO-2 in backward": (2, "in_backward"),
        "ZeRO-3 checkpointing": (3, "checkpoint"), "ZeRO-3 FSDP's way": (3, "fsdp")}
peaks, calls, results = {}, {}, []
for name, (stage, variant) in ways.items():
    outs = world.run(zero.train, stage, deep, steps=1, variant=variant)
    results.append(fsdp.assemble(stage, outs, deep))
    peaks[name] = world.memory
    calls[name] = [(e.op, e.phase) for e in world.trace.events if e.rank == 0 and e.op != "compute"]
after, during = peaks["ZeRO-2 after backward"].ranks[0], peaks["ZeRO-2 in backward"].ranks[0]
assert during.peak_bytes.get("gradients", 0) < 4 * deep.numel / 2 <= after.peak_bytes["gradients"]
print(f"ZeRO-2 in backward: the peak is {1 - during.peak / after.peak:.0%} below ZeRO-2 after backward's; "
      "at its peak it holds less than half a full gradient")
fsdp_calls, checkpoint_calls = calls["ZeRO-3 FSDP's way"], calls["ZeRO-3 checkpointing"]
assert fsdp_calls.count(("reduce_scatter", "backward")) == checkpoint_calls.count(("reduce_scatter", "backward")) == 9
assert fsdp_calls.count(("all_gather", "backward")) == 8 and checkpoint_calls.count(("all_gather", "forward")) == 18
print("ZeRO-3: both ways 9 reduce-scatters in backward; FSDP's way re-gathers 8 layers in backward, "
      "checkpointing re-runs 9 forwards")
assert all(torch.equal(a, b) for way in results for a, b in zip(way, results[0])), "every way: the same step"
# Adam's first step moves a weight by lr * g / (|g| + eps): where a gradient is as small as eps (this
# deep stack's first layer has some of 4e-9), fp32 rounding of g moves that step by a few percent of
# lr = 1e-2; a wrong step (a gradient not reduced, a stale shard) moves weights by about lr itself
print(check.assert_close(results, [fsdp.adam_reference(deep, steps=1)] * len(ways),
                   "every way, fp32 against float64 Adam", atol=1e-3))

# %% tags=["nbval-ignore-output"]
for name, report in peaks.items():
    top = report.ranks[0]
    print(f"{name:22} rank 0's peak {top.peak:>7,} B, of which gradients {top.peak_bytes.get('gradients', 0):>7,} B")

# %% [markdown]
# Reducing each layer's gradient during backward takes ZeRO-2's peak from about 321 kB to 244 kB (on
# the simulator; the real backend's buffers add a few kB): the whole model's full gradient never
# exists. (Checkpointing's recomputed all-gathers run forward code,
# so they are traced as forward calls: 18 forward all-gathers instead of FSDP's 9 + 8.) The two
# ZeRO-3 ways peak alike here because 2 rows per rank make activations tiny (516 B); FSDP's way
# keeps every layer's activations (memory grows with the batch), checkpointing recomputes them
# (compute grows by a forward). FSDP's way also skips re-gathering the first layer: its input needs
# no gradient, so backward never needs that weight. The peaks, by label:

# %% tags=["nbval-ignore-output"]
viz.memory_figure(peaks, "peak", title="Peak bytes per rank, deeper model: ZeRO-2 and ZeRO-3, two ways each")

# %% [markdown]
# ## Exercise 1: predict the memory
#
# The ZeRO paper's example: a 7.5 billion parameter model, mixed-precision Adam (2-byte
# parameters and gradients, `K = 12` bytes of optimizer state per parameter), on 64 GPUs with
# ZeRO-3. How many bytes of each model state does one GPU hold? Give a dict of three numbers.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
zero3_bytes = {"parameters": ..., "gradients": ..., "optimizer_state": ...}

print(check.check_zero3_bytes(zero3_bytes))


# %% [markdown] expect=["Correct: (2 + 2 + 12) psi / 64 = 1.88 GB per rank, instead of 120 GB."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# # ZeRO-3 shards all three states: each is its bytes per parameter x psi / P.
# big_psi, gpus = 7.5e9, 64
# print(check.check_zero3_bytes({"parameters": 2 * big_psi / gpus, "gradients": 2 * big_psi / gpus,
#                             "optimizer_state": 12 * big_psi / gpus}))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 2: write ZeRO-2's gradient path
#
# After backward, each rank holds its full local gradient `grad` (a flat vector whose length
# divides by the world size). Return this rank's shard (chunk `comm.rank`) of the gradient summed
# over all ranks, moving no more bytes than necessary. The check runs it on 4 virtual ranks,
# compares with the single-device sum and counts the bytes **every** rank sends and receives.
# The rule is lesson 02's: right values first, then no rank may move more than a reduce-scatter
# does. An all-reduce then a chunk moves about twice the bytes; a reduce to rank 0 then a scatter
# keeps rank 0's sends low but has it receive three whole gradients while the others each send a
# whole one.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def my_gradient_shard(comm, grad):
    raise NotImplementedError   # return this rank's shard of the summed gradient

print(check.check_zero2_grads(my_gradient_shard))

# %% [markdown] expect=["Correct: reduce-scatter gives each rank its summed shard with half an all-reduce's traffic."] tags=["solution"]
# <details><summary>Solution of exercise 2 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 2.
# # An all-reduce and then a slice is right but sends twice the bytes: reduce-scatter is the op.
# def gradient_shard_solution(comm, grad):
#     return comm.reduce_scatter(grad, dim=0)
#
# print(check.check_zero2_grads(gradient_shard_solution))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * Data parallelism keeps `P` copies of parameters, gradients and optimizer state. ZeRO-1
#   shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3/FSDP also the parameters:
#   `(2 + 2 + K) psi` per rank becomes `(2 + 2 + K) psi / P`, and the step stays exactly Adam's.
# * ZeRO-1 and -2 move the same `2 psi` as an all-reduce; ZeRO-3 moves `3 psi`, and prefetching
#   hides the extra gathers behind compute.
# * ZeRO-3's gradients come for free from lesson 2: the backward of an all-gather is a
#   reduce-scatter.
# * Peaks are not the steady state: ZeRO-2 lowers the peak only if it reduces each gradient during
#   backward. ZeRO-3 gets its second gather by recomputing (checkpointing) or, as FSDP does, by
#   re-gathering in backward while keeping the activations.

# %%
world.close()
