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
# # Lesson 6: data parallelism
#
# **Goal:** train one model on `P` ranks by giving every rank a full copy of the model and a
# `1/P` slice of the batch, combine the gradients so that every rank gets *exactly* the
# single-device gradient of the whole batch, and hide that communication behind the backward
# pass the way PyTorch's DDP does.
#
# The model is a 5-layer tanh MLP (`simcomm.parallel.data.make_model`), the loss the mean squared
# error over a batch of 16 rows. Every check compares with the single-device model in float64.

# %% expect=["4 ranks, 4 rows each; 10 parameter tensors, 207880 parameters"]
import torch
import simcomm
from simcomm import ReduceOp, viz
from simcomm.model import cost
from simcomm.parallel import data as dp
import simcomm.lessons.lesson_06 as check
viz.use_export_renderer()   # figures live in JupyterLab and survive an HTML export

world_size = 4
world = simcomm.configured_backend(world_size)
x, y = dp.make_data(16)                         # (16, 32) inputs, (16, 8) targets, float64
reference = dp.reference_grads(x, y)            # d(mean loss over all 16 rows) / d(every parameter)
numels = [p.numel() for p in dp.make_model().parameters()]
print(f"{world_size} ranks, {16 // world_size} rows each; {len(numels)} parameter tensors, {sum(numels)} parameters")

# %% [markdown]
# ## 1. Replicate the model, shard the batch, average the gradients
#
# Every rank builds the same model (same seed), takes its own 4 rows (`dp.rows`), and runs an
# ordinary forward and backward on them. Its `.grad` is then the gradient of *its* rows' mean
# loss. The whole batch's mean loss is the average of the 4 ranks' means, so its gradient is the
# **average of the ranks' gradients**: one all-reduce with `ReduceOp.AVG` per parameter.

# %% expect=["every rank's averaged gradient: matches the reference", "one rank alone is off by more than 1e-3"]
def dp_step(comm, x, y):
    model = dp.make_model()                          # the same replica on every rank
    xs, ys = dp.rows(comm, x, y)                     # this rank's (4, 32) and (4, 8)
    (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()        # mean over MY rows
    local = dp.grads_of(model)
    averaged = [comm.all_reduce(p.grad, ReduceOp.AVG) for p in model.parameters()]
    return local, averaged

outs = world.run(dp_step, x, y)
print(check.assert_close([avg for _, avg in outs], [reference] * world_size, "every rank's averaged gradient"))
assert check.max_error(outs[0][0], reference) > 1e-3
print("one rank alone is off by more than 1e-3")

# %% [markdown]
# ## 2. AVG, or divide the loss by P: lesson 2's convention
#
# Lesson 2 said the backward rules are exact when the objective is the **sum of the per-rank
# losses**. Make each rank's loss `sum over my rows / 16` (its mean divided by `P`): the 4 losses
# then *add up* to the whole batch's mean, and a plain SUM all-reduce gives the right gradient
# (`mode="scaled"`). Mixing the conventions, mean loss *and* SUM, adds 4 means: every gradient
# comes out `P = 4` times too big (`mode="sum"`). It trains: with SGD it is a 4x learning rate;
# with Adam, which divides by a running estimate of the gradient's size, a uniform factor nearly
# cancels, and the bug shows up instead in gradient clipping (the threshold now cuts 4x sooner) and in
# logged gradient norms. Either way it is silent: only the comparison with one device catches it.

# %% expect=["loss / P with SUM: matches the reference", "mean loss with SUM = 4 x reference: matches the reference"]
scaled = world.run(dp.dp_grads, x, y, "scaled")
print(check.assert_close(scaled, [reference] * world_size, "loss / P with SUM"))
summed = world.run(dp.dp_grads, x, y, "sum")
print(check.assert_close(summed, [[world_size * g for g in reference]] * world_size, "mean loss with SUM = 4 x reference"))
assert check.max_error(summed, [reference] * world_size) > 1e-2, "the wrong factor of P is caught"

# %% [markdown]
# ## 3. Gradient accumulation: communicate once per step
#
# When 4 rows do not fit in memory, each rank runs its rows as 4 microbatches of 1 row, calling
# `backward()` after each: autograd *adds* into `.grad`, so after the last microbatch `.grad`
# holds the gradient of the rank's whole share, with no communication in between. Only then is each
# gradient all-reduced, once per step, not once per microbatch (exercise 2 does the same with the
# buckets of section 4, the way DDP's `no_sync()` does):

# %% expect=["accumulated over 4 microbatches: matches the reference", "10 all-reduces per rank for the step (one per parameter tensor, not 4 x 10)"]
accumulated = world.run(dp.accumulation_grads, x, y, 4)
print(check.assert_close(accumulated, [reference] * world_size, "accumulated over 4 microbatches"))
calls = [e for e in world.trace.events if e.rank == 0 and e.op == "all_reduce"]
assert len(calls) == len(numels)
print(f"{len(calls)} all-reduces per rank for the step (one per parameter tensor, not 4 x {len(numels)})")

# %% [markdown]
# ## 4. Buckets: communicate while backward still runs
#
# Backward produces the gradients last layer first. The last layer's gradient is final long before
# the first layer's is computed, so its all-reduce can start right away, on the network, while the
# GPU keeps computing. `BucketedReducer` below does what DDP does: a hook on every parameter
# (`register_post_accumulate_grad_hook`) puts the finished gradient into a **bucket**; when a
# bucket is full, its gradients are flattened into one buffer and an `all_reduce(...,
# async_op=True)` is issued; after `backward()`, `finish()` waits on the handles and writes the
# sums back. `bucket_plan` fills the buckets in backward order (last parameter first). The hooks
# also declare each parameter's backward compute (`comm.compute`), so the cost model can place
# everything on a timeline (`cost.modelled_timeline`, lesson 3's model of an A100 InfiniBand
# cluster): per rank a compute row and a communication row, like a CUDA stream. `no_sync()` is
# for exercise 2. (The library keeps the same class, `simcomm.parallel.data.BucketedReducer`, which
# later lessons use; a test checks that the two behave alike.)

# %%
from contextlib import contextmanager
from simcomm.trace import backward_phase


def bucket_plan(numels, itemsize, bucket_bytes):
    """Parameter indices per bucket, last parameter first; a bucket closes once it holds at least
    `bucket_bytes` (0: one bucket)."""
    order = list(range(len(numels)))[::-1]
    if bucket_bytes <= 0:
        return [order]
    plan, current, size = [], [], 0
    for index in order:
        current.append(index)
        size += numels[index] * itemsize
        if size >= bucket_bytes:
            plan.append(current)
            current, size = [], 0
    return plan + [current] if current else plan

# %% [markdown]
# The reducer: its buckets, and a hook on every parameter (the methods follow, one cell each).

# %%
class BucketedReducer:
    """Sum a model's gradients over the ranks a bucket at a time, while backward still runs."""

    def __init__(self, comm, model, bucket_bytes, seconds_per_param=dp.BACKWARD_SECONDS_PER_PARAM):
        self.comm, self.params, self.seconds_per_param = comm, list(model.parameters()), seconds_per_param
        self.plan = bucket_plan([p.numel() for p in self.params], self.params[0].element_size(), bucket_bytes)
        self.bucket_of = {index: b for b, bucket in enumerate(self.plan) for index in bucket}
        self.ready, self.handles, self.sync = [0] * len(self.plan), [], True
        for index, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, index=index: self._ready(index))

    @contextmanager
    def no_sync(self):
        """Inside this block backward only accumulates into .grad: no collective."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

# %%
def _ready(self, index):                       # the hook: this parameter's gradient is final
    self.comm.compute(seconds=self.params[index].numel() * self.seconds_per_param)
    if not self.sync:
        return
    bucket = self.bucket_of[index]
    if self.ready[bucket] == len(self.plan[bucket]):
        raise RuntimeError(f"BucketedReducer: parameter {index} on rank {self.comm.rank} got a second "
                           "synchronising gradient before finish(): run the backward of every "
                           "micro-batch but the last inside reducer.no_sync()")
    self.ready[bucket] += 1
    if self.ready[bucket] == len(self.plan[bucket]):                  # the bucket is full: send it
        flat = torch.cat([self.params[i].grad.reshape(-1) for i in self.plan[bucket]])
        with backward_phase():
            self.handles.append((bucket, self.comm.all_reduce(flat, async_op=True)))

BucketedReducer._ready = _ready

# %%
def finish(self):
    """Wait for every bucket and write the summed gradients into .grad."""
    partial = [b for b, count in enumerate(self.ready) if 0 < count < len(self.plan[b])]
    for bucket, handle in self.handles:
        flat = handle.wait()
        sizes = [self.params[i].numel() for i in self.plan[bucket]]
        for i, piece in zip(self.plan[bucket], flat.split(sizes)):
            self.params[i].grad.copy_(piece.view_as(self.params[i].grad))
    self.handles, self.ready = [], [0] * len(self.plan)
    if partial:
        raise RuntimeError(f"BucketedReducer.finish on rank {self.comm.rank}: buckets {partial} were "
                           "only partly ready: some parameters got no gradient in the last backward")

BucketedReducer.finish = finish

# %%
def bucketed_grads(comm, x, y, bucket_bytes):
    """One data-parallel backward with buckets; the averaged gradients."""
    model = dp.make_model()
    reducer = BucketedReducer(comm, model, bucket_bytes)
    xs, ys = dp.rows(comm, x, y)
    comm.compute(seconds=sum(p.numel() for p in reducer.params) * reducer.seconds_per_param / 2)   # forward
    (dp.sum_loss(model, xs, ys) / x.shape[0]).backward()
    reducer.finish()
    return dp.grads_of(model)

# %% [markdown]
# Four bucket sizes, each against one device:

# %% expect=["every bucket size: matches the reference"]
bucket_sizes = {"per tensor": 1, "256 KiB": 256 << 10, "1 MiB": 1 << 20, "one bucket": 0}
summaries, figures, grads = {}, {}, []
for label, bucket_bytes in bucket_sizes.items():
    grads += world.run(bucketed_grads, x, y, bucket_bytes)
    summaries[label] = dp.overlap_of(world.trace)      # rank 0's modelled compute / exposed / hidden
    figures[label] = viz.timeline_figure(world.trace, modelled=True, topology=dp.PRESET)
print(check.assert_close(grads, [reference] * (world_size * len(bucket_sizes)), "every bucket size"))

# %% [markdown]
# With one bucket, nothing can start before the whole backward is done: all of the communication
# is **exposed** (the program waits for it). Smaller buckets start earlier and **hide** more of it
# behind compute; but every call pays the latency of an all-reduce, so one bucket per tensor
# communicates for the longest. The best is in between; DDP's default is 25 MiB, for models
# thousands of times bigger than this one.

# %% expect=["one bucket: 100% exposed; 1 MiB buckets hide part of it and end the step sooner"]
assert summaries["one bucket"]["hidden"] < 1e-12 < summaries["1 MiB"]["hidden"]
assert summaries["1 MiB"]["exposed"] < summaries["one bucket"]["exposed"]
assert summaries["1 MiB"]["end"] < min(summaries["one bucket"]["end"], summaries["per tensor"]["end"])
assert summaries["per tensor"]["communication"] > summaries["one bucket"]["communication"]
print("one bucket: 100% exposed; 1 MiB buckets hide part of it and end the step sooner")

# %% tags=["nbval-ignore-output"]
viz.bucket_overlap_figure(summaries)

# %% [markdown]
# The timeline of one step with 1 MiB buckets: the cross-hatched part of each all-reduce is
# exposed, the plain part runs while backward computes. Move the slider to see the other bucket
# sizes (it needs a running kernel; a static copy of this page, such as the handout, shows the
# 1 MiB figure in its place).

# %% tags=["nbval-ignore-output"]
viz.bucket_slider(figures, default="1 MiB")

# %% [markdown]
# ## 5. PyTorch's DDP on virtual ranks
#
# `torch.nn.parallel.DistributedDataParallel` does all of this for you. Inside a simulated run,
# torch.distributed is initialised on the virtual ranks, so unmodified DDP code runs there and is
# traced like the communicator's calls (`dp.ddp_grads` wraps the same model in DDP and calls
# `backward()`). Its gradients are the single-device ones too:

# %% expect=["DDP's gradients on every rank: matches the reference"]
ddp = world.run(dp.ddp_grads, x, y)
print(check.assert_close(ddp, [reference] * world_size, "DDP's gradients on every rank"))
ddp_trace = world.trace

# %% tags=["nbval-ignore-output"]
ddp_calls = [(e.op, e.phase, e.nbytes) for e in ddp_trace.events if e.rank == 0]
print("DDP's calls on rank 0:", ddp_calls or "not traced (real processes: DDP talks to gloo directly)")

# %% [markdown]
# When it wraps the model, DDP first checks that every replica has the same parameters: the
# 8-byte `all_gather` (each rank's parameter count) and the 240-byte `broadcast` (rank 0's shapes)
# that open its trace. Then it broadcasts rank 0's parameters (so the replicas start equal), and
# all-reduces its buckets during backward. Its **first** backward uses one bucket whatever the
# model's size (it does not know yet in which order backward produces the gradients); from the
# second iteration on, it rebuilds the buckets of `bucket_cap_mb` (25 MiB) in the order it saw.
# One iteration here, so one bucket, like our `"one bucket"`.
#
# Side by side, **measured** timelines of the two programs (on the simulator; DDP's calls are not in
# the trace on real processes): first the hand-written buckets, then DDP. On virtual ranks a measured
# bar is the wall-clock time a rank's thread spent inside the call, and the ranks take turns on the
# CPU: rank 0's all-reduce lasts until the last rank arrives, rank 3's is short because it arrives
# last. These bars show turn-taking in one process, not a network; how long the communication would
# take on hardware is what the modelled timelines above show.

# %% tags=["nbval-ignore-output"]
world.run(dp.bucketed_grads, x, y, 1 << 20)
display(viz.timeline_figure(world.trace))                    # hand-written, 1 MiB buckets
viz.timeline_figure(ddp_trace) if ddp_trace.events else "no DDP trace on this backend"   # DDP

# %% [markdown]
# ## Exercise 1: find the bug
#
# This data-parallel step runs, and the ranks' gradients even agree with each other. But it
# trains with the wrong gradient. Find the bug, and write the fixed step as `my_dp_step`: it gets
# the model and this rank's rows, and must leave in every `p.grad` the gradient of the mean loss
# over the whole batch. The check runs it on 4 virtual ranks against the single-device gradient.

# %%
def buggy_dp_step(comm, model, xs, ys):
    (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()
    for p in model.parameters():
        p.grad = comm.all_reduce(p.grad)

print(check.check_dp_step(buggy_dp_step))

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def my_dp_step(comm, model, xs, ys):
    raise NotImplementedError   # your fixed step

print(check.check_dp_step(my_dp_step))

# %% [markdown] expect=["Correct: every rank holds the whole batch's gradient (6 collectives per rank)."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# # The loss is each rank's mean, and SUM adds 4 means: 4 x the gradient. Average instead
# # (or divide the loss by comm.world_size and keep SUM).
# def dp_step_solution(comm, model, xs, ys):
#     (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()
#     for p in model.parameters():
#         p.grad = comm.all_reduce(p.grad, ReduceOp.AVG)
#
# print(check.check_dp_step(dp_step_solution))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 2: accumulate with buckets (transfer)
#
# Section 3 accumulated without buckets; section 4 bucketed without accumulating. Put them
# together, as DDP's `no_sync()` does. Write `my_accumulation_step(comm, model, reducer,
# micro_batches, batch)`: `reducer` is a `BucketedReducer` (section 4) already hooked onto `model`,
# `micro_batches` this rank's list of `(x, y)` pairs (4 of them), `batch` the whole batch's rows over
# every rank. Each micro-batch's loss is `dp.sum_loss(model, x, y) / batch`. After your step, every
# `p.grad` must hold the gradient of the whole batch's mean loss, and each bucket must have been
# all-reduced **once** for the step, not once per micro-batch. Read `BucketedReducer` again first:
# `with reducer.no_sync():` makes a backward only accumulate, and `reducer.finish()` waits for the
# buckets and writes them back. Below, the naive loop the reducer refuses.

# %%
def naive_accumulation_step(comm, model, reducer, micro_batches, batch):
    for x_micro, y_micro in micro_batches:
        (dp.sum_loss(model, x_micro, y_micro) / batch).backward()
    reducer.finish()

print(check.check_accumulation_step(naive_accumulation_step))

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def my_accumulation_step(comm, model, reducer, micro_batches, batch):
    raise NotImplementedError   # your step

print(check.check_accumulation_step(my_accumulation_step))

# %% [markdown] expect=["Correct: the whole batch's gradient on every rank, with 3 all-reduces per step (one per bucket), whatever the 4 micro-batches."] tags=["solution"]
# <details><summary>Solution of exercise 2 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 2.
# # Every backward but the last only adds into .grad; the last one, outside no_sync(), fires the
# # bucket all-reduces of the accumulated gradients; finish() waits and writes them back.
# def accumulation_step_solution(comm, model, reducer, micro_batches, batch):
#     with reducer.no_sync():
#         for x_micro, y_micro in micro_batches[:-1]:
#             (dp.sum_loss(model, x_micro, y_micro) / batch).backward()
#     x_micro, y_micro = micro_batches[-1]
#     (dp.sum_loss(model, x_micro, y_micro) / batch).backward()
#     reducer.finish()
#
# print(check.check_accumulation_step(accumulation_step_solution))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * Data parallelism: the same model on every rank, `1/P` of the batch each, and one all-reduce
#   of the gradients. AVG of per-rank mean losses, or SUM of losses divided by `P`: the two
#   conventions agree; mixing them scales the gradient by `P`, silently.
# * Gradient accumulation communicates once per optimizer step, not once per microbatch: with
#   buckets, every backward but the last runs under `no_sync()`.
# * Buckets issued from gradient hooks overlap the all-reduce with the rest of backward. Too big
#   and nothing overlaps; too small and latency dominates. DDP does this (plus a parameter check and
#   broadcast when it wraps the model, and buckets rebuilt after the first iteration), with the same
#   gradients as one device.

# %%
world.close()
