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
# # Lesson 11: Debugging distributed programs
#
# **Goal:** meet the bugs that cost real GPU hours (hangs, wrong gradients, silent truncation,
# diverging replicas), make each one fail at once on virtual ranks with a named cause, fix it,
# and learn to read the error, the trace and its Perfetto export, and what the same bug looks
# like on a real NCCL cluster.
#
# On a real cluster a collective that one rank never reaches does not fail: every other rank
# waits until a watchdog kills the job, often after 10 minutes, with a message that names an
# operation number but not your line. The simulator sees all ranks at once, so it can say
# which rank called what, where.

# %%
import subprocess, sys, tempfile
import torch
import torch.distributed as dist
import torch.nn.functional as F
import simcomm
import simcomm.lessons.lesson_11 as check
from simcomm import viz
from simcomm.parallel.tensor import make_mlp, mlp, shard_mlp, tp_mlp
viz.use_export_renderer()   # figures live in JupyterLab and survive an HTML export

world_size = 4
sim = simcomm.World(world_size)                        # the bugs run here: they fail at once
world = simcomm.configured_backend(world_size)         # the fixes run here too

def fails(program, *args, error=simcomm.SimcommError):
    """Run a buggy program on the simulator; print its error with locations as line numbers."""
    caught = check.expect_error(lambda: sim.run(program, *args), error)
    if isinstance(caught, simcomm.RankError):          # a rank's own exception: show the exception
        caught = caught.__cause__
    print(check.error_summary(caught))

# %% [markdown]
# ## 1. A collective only some ranks call
#
# Rank 0 all-reduces a metric to log it; the others go straight on to the next collective.
# On NCCL the ranks would now be inside different collectives, a hang or garbage. Here:

# %% expect=["CollectiveMismatchError: ranks of group [0, 1, 2, 3] disagree at collective step 0:", "  rank 0 called all_reduce(shape=(2,), dtype=float32, op=sum) at line 4 of log_on_rank_0", "  rank 1 called all_gather(shape=(2,), dtype=float32, dim=0) at line 5 of log_on_rank_0", "every rank of a group must call the same collectives in the same order with matching shapes, dtypes and arguments"]
def log_on_rank_0(comm):
    x = torch.ones(2) * comm.rank
    if comm.rank == 0:
        print("metric", comm.all_reduce(x))              # BUG: a collective inside a rank branch
    return comm.all_gather(x, dim=0)

fails(log_on_rank_0)

# %% [markdown]
# The message names the group, the collective step (the first call where they disagree),
# each kind of call with its arguments, and the line of your program. Fix: every rank calls
# the collective; only rank 0 prints.
#
# ## 2. Mismatched shapes
#
# Each rank all-gathers its batch, but the last rank got a shorter one (12 samples on 4 ranks
# would be 3 each; 11 are not):

# %% expect=["CollectiveMismatchError: ranks of group [0, 1, 2, 3] disagree at collective step 0:", "  ranks [0-2] called all_gather(shape=(3,), dtype=float32, dim=0) at line 3 of gather_batches", "  rank 3 called all_gather(shape=(2,), dtype=float32, dim=0) at line 3 of gather_batches", "every rank of a group must call the same collectives in the same order with matching shapes, dtypes and arguments"]
def gather_batches(comm):
    batch = torch.ones(3 if comm.rank < 3 else 2)          # BUG: uneven shards
    return comm.all_gather(batch, dim=0)

fails(gather_batches)

# %% [markdown]
# ## 3. Both neighbours send first
#
# Every rank sends to its right neighbour, then receives from its left. A blocking send waits
# until the receiver takes the data: gloo's `dist.send` does at every size (measured with 16 B,
# 4 MB and 200 MB: when both ranks send first, both time out), as the simulator's `send` does.
# NCCL's send is "blocking for the GPU" (NCCL's documentation): the host call returns, but the
# GPU stream stalls until the peer's matching receive runs, and the next collective on that
# stream waits behind it. MPI's `MPI_Send` may return early for small messages (buffered), which
# hides the bug until the messages grow. Here every rank waits in `send` and nobody reaches `recv`:

# %% expect=["DeadlockError: every rank that has not finished is blocked, so none can make progress:", "  ranks [0-3] (4 ranks) wait in send (float32 (2,)), each to rank r+1 (mod 4), at line 3 of shift_right"]
def shift_right(comm):
    x = torch.full((2,), float(comm.rank))
    comm.send(x, (comm.rank + 1) % comm.world_size)        # BUG: everyone sends first
    return comm.recv((2,), torch.float32, (comm.rank - 1) % comm.world_size)

fails(shift_right)

# %% [markdown]
# The cycle is in the message: 0 waits for 1, 1 for 2, 2 for 3, 3 for 0. Fix: issue the send and
# the receive together with `batch_isend_irecv` (as ring attention does), or let even ranks send
# first and odd ranks receive first (exercise 1).

# %% expect=["rank 0: [3, 3]", "rank 1: [0, 0]", "rank 2: [1, 1]", "rank 3: [2, 2]"]
def shift_right_fixed(comm):
    x = torch.full((2,), float(comm.rank))
    handles = comm.batch_isend_irecv([simcomm.P2POp("isend", x, (comm.rank + 1) % comm.world_size),
                                      simcomm.P2POp("irecv", ((2,), torch.float32), (comm.rank - 1) % comm.world_size)])
    return [handle.wait() for handle in handles][1]

print(check.per_rank(world.run(shift_right_fixed)))

# %% [markdown]
# ## 4. A replicated loss without the conjugate pair: gradients times P
#
# The tensor-parallel MLP of lesson 4 with a plain differentiable `all_reduce`: every rank
# ends with the same output and computes the same loss. The backward of the all-reduce then
# sums four identical gradients. No error, no hang, just gradients 4 times too large, which a
# learning rate tuned on one GPU can turn into a divergence with SGD. (Adam divides by a
# running estimate of the gradient's size, so a uniform factor nearly cancels there; it shows up in
# gradient clipping and logged gradient norms instead.) The check against one device finds it:

# %% expect=["conjugate=False: w1.grad is 4 x the single-device gradient", "conjugate=True: w1.grad: matches the reference"]
params, x = make_mlp(4, 8, seed=0), torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

def tp_grads(comm, x, params, conjugate):
    shards = shard_mlp(params, comm.rank, comm.world_size)
    tp_mlp(comm, x, shards, conjugate=conjugate).pow(2).sum().backward()   # the same loss on every rank
    return shards["w1"].grad

leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
mlp(x, leaves).pow(2).sum().backward()
for conjugate in (False, True):
    got = torch.cat(world.run(tp_grads, x, params, conjugate))         # (ffn, hidden) from the row shards
    if conjugate:
        print(f"conjugate=True: {check.assert_close(got, leaves['w1'].grad, 'w1.grad')}")
    else:
        print(f"conjugate=False: w1.grad is {(got / leaves['w1'].grad).mean().item():.0f} x the single-device gradient")

# %% [markdown]
# ## 5. LayerNorm weights under sequence parallelism, missing their all-reduce
#
# With sequence parallelism (lesson 12) each rank applies the same, replicated LayerNorm to its
# own slice of the sequence. Its weight gradient therefore covers only that slice. Forget the
# all-reduce over the tensor-parallel group and each rank applies a different update to what
# should be one weight; the replicas drift apart. `assert_replicated` catches it at the step it
# happens:

# %% expect=["AssertionError: LayerNorm weight gradient is not replicated: it differs from rank 0's on rank 1 by 3.59, rank 2 by 5.07, rank 3 by 5.43"]
x_seq, probe = (torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in (2, 3))

def sp_layernorm(comm, x, probe):
    mine = slice(comm.rank * 2, comm.rank * 2 + 2)                        # 2 of the 8 tokens
    weight, bias = torch.ones(6, dtype=torch.float64, requires_grad=True), torch.zeros(6, dtype=torch.float64, requires_grad=True)
    (F.layer_norm(x[mine], (6,), weight, bias) * probe[mine]).sum().backward()
    check.assert_replicated(comm, weight.grad, "LayerNorm weight gradient")     # BUG: no all-reduce before
    return weight.grad

fails(sp_layernorm, x_seq, probe, error=simcomm.RankError)

# %% [markdown]
# The fix is exercise 2.
#
# ## 6. An uneven shard, silently truncated by a naive slice
#
# 10 samples on 4 ranks. `rows = 10 // 4 = 2` gives each rank 2 rows: rows 8 and 9 belong to
# no rank, and the sum over ranks is simply wrong, without any error:

# %% expect=["naive slice: rows 0-7 summed, 2 rows lost, wrong by 1.50", "ValueError: slice: size 10 of dim=0 (shape (10, 3)) is not divisible by the world size 4; pad it or pick a divisible size", "tensor_split: all 10 rows summed: matches the reference"]
data = torch.randn(10, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

def naive_sum(comm, data):
    rows = data.shape[0] // comm.world_size                               # BUG: 10 // 4 = 2
    return comm.all_reduce(data[comm.rank * rows:(comm.rank + 1) * rows].sum(0))

wrong = world.run(naive_sum, data)[0]
print(f"naive slice: rows 0-7 summed, 2 rows lost, wrong by {(wrong - data.sum(0)).abs().max():.2f}")
error = check.expect_error(lambda: sim.run(lambda comm: comm.slice(data, dim=0, scale_grad=False)), simcomm.RankError)
print(check.error_summary(error.__cause__).replace(f" on rank {error.rank}", ""))     # every rank raises the same
split_sum = world.run(lambda comm, data: comm.all_reduce(torch.tensor_split(data, comm.world_size)[comm.rank].sum(0)), data)
print(f"tensor_split: all 10 rows summed: {check.assert_close(split_sum[0], data.sum(0), 'x').split(': ')[1]}")

# %% [markdown]
# The communicator's `slice` refuses an uneven split and says so; `torch.tensor_split` gives
# the first ranks one row more (3, 3, 2, 2) and loses nothing.
#
# ## 7. Random state that differs between ranks
#
# Data-parallel replicas that initialise their weights from a generator seeded alike on every
# rank agree, as long as every rank draws the same random numbers in the same order. Here rank
# 0 draws one extra number first, say to pick a sample to log:

# %% expect=["AssertionError: initial weights is not replicated: it differs from rank 0's on rank 1 by 1.87, rank 2 by 1.87, rank 3 by 1.87", "fixed: initial weights replicated on every rank"]
def init_weights(comm, fixed):
    gen = torch.Generator().manual_seed(1234)          # the same seed on every rank
    if comm.rank == 0:
        torch.rand(1, generator=gen)                    # BUG: rank 0 alone advances its generator
    w = torch.randn(3, generator=gen)
    if fixed:
        w = comm.broadcast(w, src=0)                    # what DDP does when it wraps a model
    check.assert_replicated(comm, w, "initial weights")
    return w

fails(init_weights, False, error=simcomm.RankError)
world.run(init_weights, True)
print("fixed: initial weights replicated on every rank")

# %% [markdown]
# ## 8. The same bug in a torch.distributed program (DDP)
#
# Unmodified `torch.distributed` code runs on virtual ranks too. Here DDP averages the
# gradients in its backward pass, and rank 0 alone all-reduces the loss to log it, exactly
# bug 1. The simulator names the two different all-reduces (the loss, against DDP's gradient
# bucket, 10 elements) and the lines that issued them. It is collective step 3 because wrapping
# the model in DDP already made three collectives on every rank (steps 0 to 2: an all-gather and a
# broadcast that check the replicas' parameter shapes, and the broadcast of rank 0's parameters;
# lesson 06). The loss is a 0-d tensor, reported with its own shape `()`, as gloo takes it:

# %% expect=["CollectiveMismatchError: ranks of group [0, 1, 2, 3] disagree at collective step 3:", "  ranks [1-3] called all_reduce(shape=(10,), dtype=float32, op=sum) at line 6 of ddp_step", "  rank 0 called all_reduce(shape=(), dtype=float32, op=sum) at line 5 of ddp_step", "every rank of a group must call the same collectives in the same order with matching shapes, dtypes and arguments"]
def ddp_step(comm, log_on_every_rank):
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    loss = model(torch.ones(3, 4) * comm.rank).sum()
    if log_on_every_rank or comm.rank == 0:
        dist.all_reduce(loss.detach().clone())                            # BUG when only rank 0 does it
    loss.backward()
    return model.module.weight.grad

fails(ddp_step, False)

# %% expect=["fixed: weight.grad: matches the reference"]
grads = world.run(ddp_step, True)
inputs = torch.cat([torch.ones(3, 4) * rank for rank in range(world_size)])
reference = torch.nn.Linear(4, 2)
(reference(inputs).sum() / world_size).backward()                        # DDP averages over ranks
print("fixed: " + check.assert_close(grads, [reference.weight.grad] * world_size, "weight.grad", atol=1e-6))

# %% [markdown]
# ## 9. Reading the trace, in a figure and in Perfetto
#
# Every run keeps a trace: each call of each rank, forward or backward, with its group, shapes
# and bytes. The collective steps named in the errors are counted in it. Drawn, and exported
# as Chrome trace JSON, which https://ui.perfetto.dev (or `chrome://tracing`) opens:

# %% tags=["nbval-ignore-output"]
sim.run(ddp_step, True)
path = tempfile.mkdtemp() + "/ddp_step.json"
sim.trace.to_chrome_trace(path)
print(f"{len(sim.trace.events)} events written to {path}: open it in https://ui.perfetto.dev")
viz.timeline_figure(sim.trace)

# %% [markdown]
# ## 10. The same bugs on a real NCCL cluster
#
# * **A hang, not an error.** Bugs 1 to 3 block the ranks inside NCCL. PyTorch's watchdog
#   thread notices after the process group's timeout (10 minutes by default for NCCL) and
#   aborts, logging something like `Watchdog caught collective operation timeout:
#   WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=10, ...) ran for 600000 milliseconds before
#   timing out`, on every rank that waited. The rank that is *not* waiting prints nothing.
#   `SeqNum` is the collective step; compare it across ranks to find who is behind.
# * **The flight recorder.** With `TORCH_NCCL_TRACE_BUFFER_SIZE=2000` (a number of entries) and
#   `TORCH_NCCL_DUMP_ON_TIMEOUT=1` each rank keeps its last collectives and dumps them on a
#   timeout; `python -m torch.distributed.flight_recorder.fr_trace <dump folder>` compares the
#   ranks and reports the first mismatch, the same report the simulator gives at once.
#   `TORCH_DISTRIBUTED_DEBUG=DETAIL` checks every collective's shapes across ranks before it
#   runs (bug 2), at a cost in speed.
# * **Silent bugs stay silent.** Bugs 4 to 7 run at full speed on NCCL too. Only a comparison
#   catches them: a loss curve against a single-GPU run, `assert_replicated` on the weights
#   every few hundred steps, or a conformance check of the collectives themselves.
#
# That conformance check is `python -m real.verify` (under `torchrun` on a GPU node, or with
# its own gloo workers here). It runs every collective's forward and backward on real
# processes and compares with one device and with the simulator. To test the test, it can
# inject a wrong backward rule (`SIMCOMM_VERIFY_FAULT`, `real/faults.py`): here all-gather's
# backward keeps its own gradient instead of reduce-scattering everyone's:

# %% expect=["all_reduce[sum]: ok", "all_gather[dim=-1]: FAIL"]
command = [sys.executable, "-m", "real.verify", "--nproc", "2", "--backend", "gloo",
           "--cases", "all_reduce[sum]", "all_gather[dim=-1]"]
result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                        env={**__import__("os").environ, "SIMCOMM_VERIFY_FAULT": "all_gather_backward"})
for line in result.stdout.splitlines():
    if line.startswith(("all_reduce[sum]", "all_gather[dim=-1]")):
        print(f"{line.split()[0]}: {line.split()[-1]}")

# %% [markdown]
# ## Exercise 1: fix the neighbour exchange
#
# Every rank must receive `x` from both neighbours (`(rank - 1) % P` and `(rank + 1) % P`)
# using *blocking* `comm.send` / `comm.recv` only (the checker rejects collectives and the
# non-blocking `isend` / `irecv` / `batch_isend_irecv` of section 3's fix). The version below
# deadlocks. Fix it so that it works on 2 to 5 ranks. Stuck? Call the checker again with
# `show_hint=True`.

# %% expect=["Not yet: it deadlocks on 2 ranks: every rank is blocked (rank 0 in send, rank 1 in send)", "(Stuck? Run the same check again with show_hint=True for a hint.)"]
def exchange(comm, x):
    left, right = (comm.rank - 1) % comm.world_size, (comm.rank + 1) % comm.world_size
    comm.send(x, right)
    from_left = comm.recv(x.shape, x.dtype, left)
    comm.send(x, left)
    from_right = comm.recv(x.shape, x.dtype, right)
    return from_left, from_right

print(check.check_neighbour_exchange(exchange))

# %% [markdown] expect=["Correct: the exchange finishes on 2 to 5 ranks and every rank gets both neighbours' tensors."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# def exchange_solution(comm, x):
#     left, right = (comm.rank - 1) % comm.world_size, (comm.rank + 1) % comm.world_size
#     if comm.rank % 2 == 0:                            # even ranks send first ...
#         comm.send(x, right)
#         from_left = comm.recv(x.shape, x.dtype, left)
#         comm.send(x, left)
#         from_right = comm.recv(x.shape, x.dtype, right)
#     else:                                             # ... odd ranks receive first
#         from_left = comm.recv(x.shape, x.dtype, left)
#         comm.send(x, right)
#         from_right = comm.recv(x.shape, x.dtype, right)
#         comm.send(x, left)
#     return from_left, from_right
#
# print(check.check_neighbour_exchange(exchange_solution))
# ```
#
# </details>

# %% [markdown]
# (With an odd number of ranks, the last even rank and rank 0 both send first to each other,
# but rank 0's first send goes to rank 1, which receives first, so the chain unwinds.)
#
# ## Exercise 2: fix the sequence-parallel LayerNorm
#
# Write `step(comm, x, weight, bias, probe)`: LayerNorm of this rank's sequence shard `x`,
# loss `sum(out * probe)`, backward, and return `(weight_grad, bias_grad)` equal on every rank
# to the single-device LayerNorm's over the whole sequence.

# %% expect=["Not yet: rank 0's weight gradient is only its own shard's share", "(Stuck? Run the same check again with show_hint=True for a hint.)"]
def step(comm, x, weight, bias, probe):
    (F.layer_norm(x, x.shape[-1:], weight, bias) * probe).sum().backward()
    return weight.grad, bias.grad

print(check.check_sp_layernorm(step))

# %% [markdown] expect=["Correct: on 4 ranks every rank's LayerNorm weight and bias gradients equal the single-device ones."] tags=["solution"]
# <details><summary>Solution of exercise 2 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 2.
# def step_solution(comm, x, weight, bias, probe):
#     (F.layer_norm(x, x.shape[-1:], weight, bias) * probe).sum().backward()
#     return comm.all_reduce(weight.grad), comm.all_reduce(bias.grad)     # sum over the sequence shards
#
# print(check.check_sp_layernorm(step_solution))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * A hang on a cluster is a mismatch in the simulator: which ranks called which collective,
#   at which step, from which line. Collectives inside rank branches, uneven shapes and
#   send-before-receive cycles are the usual causes.
# * Wrong gradients do not hang: a replicated loss through a plain all-reduce multiplies them
#   by P; a replicated weight under sequence parallelism needs its gradient summed over the
#   shards. Compare with one device, and assert that replicas stay replicated.
# * Never slice `n // P` rows: use an op that refuses uneven splits, or `tensor_split`.
# * Random draws must happen on every rank alike, or broadcast what should be equal.
# * On NCCL: watchdog timeouts with sequence numbers, the flight recorder to compare ranks,
#   and `python -m real.verify` to check the collectives' forward and backward themselves.

# %%
world.close()
