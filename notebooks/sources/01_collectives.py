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
# # Lesson 1: the collectives, one by one
#
# **Goal:** know what each collective does to every rank's tensor (all-reduce, all-gather,
# reduce-scatter, broadcast, gather, slice, all-to-all), well enough to predict the shape and
# the values every rank gets.
#
# A *collective* is a call that every rank of a group makes together. On the simulator (and
# with gloo) it returns when the data has moved; with NCCL on GPUs it returns as soon as the
# work is queued on the GPU's stream, and the result is ready for the next kernel on that
# stream, which is what lets communication overlap computation. Here every rank starts with four
# numbers that say where they came from: rank `r` holds `[10r, 10r + 1, 10r + 2, 10r + 3]`, and
# the figures label and colour every element the same way (`10r + i`, the colour of rank `r`). Each result is checked against plain torch
# on the list of all ranks' inputs. This lesson is about the forward pass; lesson 2 is about
# gradients.

# %% expect=["rank 0: [0, 1, 2, 3]", "rank 1: [10, 11, 12, 13]", "rank 2: [20, 21, 22, 23]", "rank 3: [30, 31, 32, 33]"]
import torch
import simcomm
from simcomm import ReduceOp, viz
import simcomm.lessons.lesson_01 as check
viz.use_export_renderer()   # figures live in JupyterLab and survive an HTML export

world_size = 4
world = simcomm.configured_backend(world_size)
inputs = [10.0 * rank + torch.arange(4.0) for rank in range(world_size)]   # what each rank holds

def apply(comm, op, kwargs):
    x = 10.0 * comm.rank + torch.arange(4.0, device=comm.device)   # the same as inputs[comm.rank]
    return getattr(comm, op)(x, **kwargs)

print(check.per_rank(inputs))

# %% [markdown]
# ## all_reduce: every rank gets the sum
#
# Element by element, add the tensors of all ranks; every rank gets the same result, of the
# same shape as its input. Data parallelism uses it to add up gradients.

# %% expect=["rank 0: [60, 64, 68, 72]", "rank 1: [60, 64, 68, 72]", "rank 2: [60, 64, 68, 72]", "rank 3: [60, 64, 68, 72]"]
outs = world.run(apply, "all_reduce", {})
assert all(torch.equal(out, sum(inputs)) for out in outs)
print(check.per_rank(outs))

# %% [markdown]
# Other reductions exist: `op=ReduceOp.MAX`, `MIN`, `AVG`, `PRODUCT`.

# %% expect=["rank 0: [30, 31, 32, 33]"]
outs = world.run(apply, "all_reduce", {"op": ReduceOp.MAX})
assert all(torch.equal(out, torch.stack(inputs).amax(0)) for out in outs)
print(check.per_rank(outs[:1]))

# %% [markdown]
# The figure draws the same run: one row per rank, the input on the left, the output next to
# it. An element that moved keeps its label and its rank's colour; a sum says which ranks were
# added into it.

# %% tags=["nbval-ignore-output"]
viz.collective_figure("all_reduce", world_size=world_size, shape=(4,), backward=False)

# %% [markdown]
# ## all_gather: every rank gets everything, concatenated
#
# The output is `world_size` times longer along `dim`, in rank order. Used to rebuild a tensor
# that is sharded across ranks.

# %% expect=["rank 0: [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33] (the same on every rank)"]
outs = world.run(apply, "all_gather", {"dim": 0})
assert all(torch.equal(out, torch.cat(inputs)) for out in outs)
print(check.per_rank(outs[:1]), "(the same on every rank)")

# %% tags=["nbval-ignore-output"]
viz.collective_figure("all_gather", world_size=world_size, shape=(4,), dim=0, backward=False)

# %% [markdown]
# ## reduce_scatter: sum, then each rank keeps one chunk
#
# The sum of all ranks' tensors is cut into `world_size` chunks along `dim`; rank `r` keeps
# chunk `r`. The output is `world_size` times *shorter*. It is an all-reduce in which nobody
# keeps the whole result (an all-reduce *is* a reduce-scatter followed by an all-gather; lesson 3
# shows how it is built that way).

# %% expect=["rank 0: [60]", "rank 1: [64]", "rank 2: [68]", "rank 3: [72]"]
outs = world.run(apply, "reduce_scatter", {"dim": 0})
chunks = sum(inputs).chunk(world_size)
assert all(torch.equal(out, chunks[rank]) for rank, out in enumerate(outs))
print(check.per_rank(outs))

# %% tags=["nbval-ignore-output"]
viz.collective_figure("reduce_scatter", world_size=world_size, shape=(4,), dim=0, backward=False)

# %% [markdown]
# ## broadcast and gather: one rank is special
#
# `broadcast(x, src)` gives every rank a copy of rank `src`'s tensor. `gather(x, dst)`
# concatenates everything on rank `dst` only; the other ranks get `None`.

# %% expect=["rank 0: [20, 21, 22, 23]", "rank 1: [20, 21, 22, 23]", "rank 2: [20, 21, 22, 23]", "rank 3: [20, 21, 22, 23]", "rank 0: None", "rank 1: [0, 1, 2, 3, 10, 11, 12, 13, 20, 21, 22, 23, 30, 31, 32, 33]", "rank 2: None", "rank 3: None"]
outs = world.run(apply, "broadcast", {"src": 2})
assert all(torch.equal(out, inputs[2]) for out in outs)
print(check.per_rank(outs))
outs = world.run(apply, "gather", {"dst": 1, "dim": 0})
assert outs[0] is None and outs[2] is None and outs[3] is None and torch.equal(outs[1], torch.cat(inputs))
print(check.per_rank(outs))

# %% tags=["nbval-ignore-output"]
viz.collective_figure("broadcast", world_size=world_size, shape=(4,), src=2, backward=False)

# %% tags=["nbval-ignore-output"]
viz.collective_figure("gather", world_size=world_size, shape=(4,), dst=1, dim=0, backward=False)


# %% [markdown]
# ## slice: no communication at all
#
# `slice(x, dim, scale_grad=...)` is for a tensor that every rank already holds in the same
# version (a *replicated* tensor): rank `r` simply keeps chunk `r`. It moves no data forward; its
# backward does (lesson 2). The trace of the run stays empty.

# %% expect=["rank 0: [0, 1]", "rank 1: [2, 3]", "rank 2: [4, 5]", "rank 3: [6, 7]"]
def slice_program(comm):
    shared = torch.arange(8.0, device=comm.device)   # the same on every rank
    return comm.slice(shared, dim=0, scale_grad=False)

outs = world.run(slice_program)
assert all(torch.equal(out, torch.arange(8.0).chunk(world_size)[rank]) for rank, out in enumerate(outs))
assert len(world.trace) == 0, "slice moved data"
print(check.per_rank(outs))

# %% tags=["nbval-ignore-output"]
viz.collective_figure("slice", world_size=world_size, shape=(8,), dim=0, scale_grad=False, backward=False)

# %% [markdown]
# ## all_to_all: everyone sends a different chunk to everyone
#
# Each rank cuts its tensor into `world_size` chunks along `scatter_dim` and sends chunk `j` to
# rank `j`; rank `j` concatenates what it receives, in rank order, along `gather_dim`. Read the
# output as a transpose: rank `j` ends with the `j`-th element of every rank. Lesson 5 uses the
# 4-D form, `all_to_all_4D`, to switch between sequence shards and head shards.

# %% expect=["rank 0: [0, 10, 20, 30]", "rank 1: [1, 11, 21, 31]", "rank 2: [2, 12, 22, 32]", "rank 3: [3, 13, 23, 33]"]
outs = world.run(apply, "all_to_all", {"scatter_dim": 0, "gather_dim": 0})
assert all(torch.equal(out, torch.stack(inputs)[:, rank]) for rank, out in enumerate(outs))
print(check.per_rank(outs))

# %% [markdown]
# The figure draws the 4-D form of lesson 5 on a small tensor, each cell labelled with its
# token and head (`t5 h2`): each rank starts with 2 tokens of all 4 heads and ends with all 8
# tokens of one head.

# %% tags=["nbval-ignore-output"]
viz.collective_figure("all_to_all_4D", world_size=world_size, shape=(1, 2, 4, 1), backward=False)

# %% [markdown]
# ## Explore
#
# Pick an op, a world size, a shape and a dim, and the figure is redrawn on virtual ranks.
# Hover over an element to see where it came from. Try a shape the world size does not divide
# for `reduce_scatter`.

# %% tags=["nbval-ignore-output"]
viz.explore("all_gather", world_size=world_size)

# %% [markdown]
# ## Exercise 1: predict the shapes
#
# Every rank passes a tensor of shape `(4, 8)` on 4 ranks. What shape does rank 0 get back from
# each call? Write tuples (`None` where rank 0 gets nothing), then run the check.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
calls = {"all_reduce": {}, "all_gather": {"dim": 0}, "reduce_scatter": {"dim": 1},
         "all_to_all": {"scatter_dim": 1, "gather_dim": 0}, "gather": {"dst": 3, "dim": 1}}
my_shapes = {"all_reduce": ..., "all_gather": ..., "reduce_scatter": ...,
             "all_to_all": ..., "gather": ...}
print(check.check_shapes(my_shapes, world_size=4, shape=(4, 8), args=calls))

# %% [markdown] expect=["Correct: all 5 shapes."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# solution = {"all_reduce": (4, 8), "all_gather": (16, 8), "reduce_scatter": (4, 2),
#             "all_to_all": (16, 2), "gather": None}
# print(check.check_shapes(solution, world_size=4, shape=(4, 8), args=calls))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 2: predict the values
#
# With the inputs of this lesson (rank `r` holds `[10r, 10r + 1, 10r + 2, 10r + 3]`), what does
# rank 3 get from `reduce_scatter(x, dim=0, op=ReduceOp.MAX)`? And rank 1 from
# `all_reduce(x, op=ReduceOp.MIN)`? Write lists of numbers.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again.", "Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
my_reduce_scatter_max_rank_3 = ...
my_all_reduce_min_rank_1 = ...
print(check.check_prediction(my_reduce_scatter_max_rank_3, "reduce_scatter", {"dim": 0, "op": ReduceOp.MAX},
                             rank=3, what="reduce_scatter(op=MAX) on rank 3",
                             hint="first the element-wise maximum over ranks, then rank r keeps chunk r"))
print(check.check_prediction(my_all_reduce_min_rank_1, "all_reduce", {"op": ReduceOp.MIN}, rank=1,
                             what="all_reduce(op=MIN) on rank 1", hint="compare the ranks element by element"))

# %% [markdown] expect=["Correct: reduce_scatter(op=MAX) on rank 3 is [33].", "Correct: all_reduce(op=MIN) on rank 1 is [0, 1, 2, 3]."] tags=["solution"]
# <details><summary>Solution of exercise 2 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 2.
# # chunk 3 of the element-wise maximum: element 3, largest on the last rank
# print(check.check_prediction([10 * (world_size - 1) + 3], "reduce_scatter", {"dim": 0, "op": ReduceOp.MAX},
#                              rank=3, what="reduce_scatter(op=MAX) on rank 3"))
# # the element-wise minimum is rank 0's tensor, on every rank
# print(check.check_prediction([0, 1, 2, 3], "all_reduce", {"op": ReduceOp.MIN}, rank=1,
#                              what="all_reduce(op=MIN) on rank 1"))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# | call | rank `r` gets | shape along `dim` |
# |---|---|---|
# | `all_reduce(x)` | the sum over ranks | same |
# | `all_gather(x, dim)` | all ranks' tensors, concatenated | `x world_size` |
# | `reduce_scatter(x, dim)` | chunk `r` of the sum | `/ world_size` |
# | `broadcast(x, src)` | rank `src`'s tensor | same |
# | `gather(x, dst, dim)` | all tensors on `dst`, `None` elsewhere | `x world_size` on `dst` |
# | `slice(x, dim)` | chunk `r` of a replicated tensor, no communication | `/ world_size` |
# | `all_to_all(x, s, g)` | chunk `r` of every rank, concatenated along `g` | `/ world_size` on `s`, `x world_size` on `g` |
#
# Sizes that must be split (`reduce_scatter`, `slice`, `all_to_all`) must be divisible by the
# world size.

# %%
world.close()
