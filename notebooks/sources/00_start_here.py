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
# # Lesson 0: start here
#
# **Goal:** run your first program on several ranks at once, see what its all-reduce did, run
# the very same program on real processes, and meet the errors the simulator gives where real
# hardware would hang, and run code written for GPUs on virtual GPUs.
#
# Distributed training runs one copy of your program per GPU; each copy is a **rank**. The ranks
# exchange tensors through **collectives** (all-reduce, all-gather, ...), and autograd runs
# backwards through those exchanges. This suite lets you do all of that on a laptop: `simcomm`
# runs `N` *virtual ranks* inside this notebook, and shows where every element and every
# gradient goes. The lessons:
#
# | lesson | what you learn |
# |---|---|
# | 0 start here | programs on virtual ranks, the backend switch, errors instead of hangs |
# | 1 collectives | what each collective does to every rank's tensor |
# | 2 autograd through collectives | each collective's backward, and the two loss conventions |
# | 3 ring all-reduce and cost | how an all-reduce moves its bytes, and how long it takes on real hardware |
# | 4 tensor-parallel MLP | Megatron's column- and row-parallel layers |
# | 5 Ulysses sequence parallel | attention over a sequence sharded across ranks |

# %%
import torch
import simcomm
import real
import simcomm.lessons.lesson_00 as check
from simcomm import viz
viz.use_export_renderer()   # figures live in JupyterLab and survive an HTML export


# %% [markdown]
# ## 1. A program runs on every rank
#
# A program is an ordinary function `program(comm, ...)`. `World(4).run(program)` calls it once
# per rank, at the same time, each with its own `comm`: `comm.rank` is 0, 1, 2 or 3 and
# `comm.world_size` is 4. This style is called SPMD (single program, multiple data): the code is
# the same, the data depends on the rank. `run` returns what each rank returned, in rank order.
# Tensors are made on `comm.device` (the CPU here; a rank's own GPU on a GPU node), so the same
# program runs everywhere.

# %% expect=["rank 0: (0, 4, [10])", "rank 1: (1, 4, [10])", "rank 2: (2, 4, [10])", "rank 3: (3, 4, [10])"]
def hello(comm):
    x = torch.tensor([comm.rank + 1.0], device=comm.device)   # rank r holds r + 1
    total = comm.all_reduce(x)                   # every rank gets 1 + 2 + ... + world_size
    return comm.rank, comm.world_size, total

world = simcomm.World(4)
outs = world.run(hello)
print(check.per_rank(outs))
assert all(total.item() == sum(range(1, 5)) for _, _, total in outs)

# %% [markdown]
# Here is that all-reduce drawn for a small 2-D tensor per rank: each rank's input, and the
# output every rank gets. Each input element is labelled `10r + i` (rank `r`, position `i`)
# and coloured by its rank; every output element is a sum over all four ranks, and its cell
# says which ranks were added into it. (Lesson 2 adds the gradients to such figures.)

# %% tags=["nbval-ignore-output"]
viz.collective_figure("all_reduce", world_size=4, shape=(2, 3), backward=False)

# %% [markdown]
# ## 2. The trace: what each rank called, and how many bytes that costs
#
# Every collective is recorded, on every rank: the op, the shapes, the bytes, start and end
# times. `world.trace` holds the last run's events.

# %% expect=["Trace(4 events: {'all_reduce/forward': 4})", "rank 0: all_reduce of 4 bytes, sent {1: 2, 2: 2, 3: 2}"]
print(world.trace)
first = world.trace.filter(rank=0).events[0]
print(f"rank 0: {first.op} of {first.nbytes} bytes, sent {first.sent}")
assert first.nbytes == torch.tensor([1.0]).element_size()

# %% [markdown]
# What the trace counts is the *cost* of the call, not a wire log. The simulator does not run
# NCCL's algorithms; it charges each rank the bytes an all-reduce must send at the least,
# `2 (n - 1) / n` of the buffer (6 of 4 bytes here, as nccl-tests counts "bus bytes"), and
# spreads them evenly over the peers, as if every rank talked to every other one directly. A
# real library sends the same total along a ring or a tree, to one neighbour at a time: lesson 3
# runs that ring with `send`/`recv` and shows its neighbour-only matrix next to this one.
#
# `world.trace.to_chrome_trace(path)` writes the events as JSON that
# [Perfetto](https://ui.perfetto.dev) opens, one track per rank. `viz.comm_matrix_figure` shows
# the bytes each rank is charged for sending to each other rank:

# %% tags=["nbval-ignore-output"]
viz.comm_matrix_figure(world.trace)

# %% [markdown]
# ## 3. The backend switch: the same program on real processes
#
# Nothing in `hello` is specific to the simulator. `real.run(program, world_size=N)` starts `N`
# worker processes that talk through `torch.distributed` (gloo on a CPU, NCCL when there is a GPU
# per rank), sends them the program, and returns their results. Same program, same answers:

# %% expect=["rank 0: (0, 2, [3])", "rank 1: (1, 2, [3])"]
real_outs = real.run(hello, world_size=2)
sim_outs = simcomm.World(2).run(hello)
assert [(r, n, t.item()) for r, n, t in real_outs] == [(r, n, t.item()) for r, n, t in sim_outs]
print(check.per_rank(real_outs))

# %% [markdown]
# The lessons do not call `World` or `real` directly: they ask for **the configured backend**,
# `simcomm.configured_backend(world_size)`, which is a `World` unless the environment variable
# `SIMCOMM_BACKEND` is `real`, and then a `real.Cluster` whose workers stay up between runs. Both
# have `run`, `trace` and `close`. To run every lesson on real processes, start JupyterLab with
# `SIMCOMM_BACKEND=real jupyter lab notebooks/` (or set `os.environ["SIMCOMM_BACKEND"] = "real"`
# before the call). The test suite runs every lesson both ways.

# %%
backend = simcomm.configured_backend(4)
print(f"SIMCOMM_BACKEND={simcomm.backend.backend_name()}: {type(backend).__name__}")
outs = backend.run(hello)
assert [total.item() for _, _, total in outs] == [10.0] * 4
backend.close()


# %% [markdown]
# ## 4. Errors instead of hangs
#
# On real GPUs, a rank that calls a different collective than the others, or waits for a message
# nobody sends, can make the whole job hang until a watchdog stops it, minutes later, with little
# to say. The simulator sees every rank at once, so it stops at once and says who did what.
# (These cells use `simcomm.World` directly: on real processes the same bugs just wait for the
# timeout.)

# %%
def mismatched(comm):
    x = torch.ones(2)
    return comm.all_reduce(x) if comm.rank == 0 else comm.all_gather(x)   # rank 0 differs

error = check.expect_error(lambda: simcomm.World(4).run(mismatched), simcomm.CollectiveMismatchError,
                             "all_reduce", "all_gather")
print(error)


# %%
def waits_forever(comm):
    if comm.rank == 0:
        return comm.recv((2,), src=1)                # rank 1 never sends
    return None

error = check.expect_error(lambda: simcomm.World(2).run(waits_forever), simcomm.DeadlockError, "recv")
print(error)


# %% [markdown]
# An ordinary exception on one rank stops the others too, and tells you which rank raised:

# %% expect=["rank 3 raised ZeroDivisionError"]
def fails_on_rank_3(comm):
    return 1 / (comm.rank - 3)

error = check.expect_error(lambda: simcomm.World(4).run(fails_on_rank_3), simcomm.RankError)
assert error.rank == 3 and isinstance(error.__cause__, ZeroDivisionError)
print(f"rank {error.rank} raised {type(error.__cause__).__name__}")


# %% [markdown]
# ## 5. Code written for GPUs
#
# Most distributed code you will read is written for GPUs: each rank picks its GPU with
# `torch.cuda.set_device(rank)`, puts its model there with `.to(rank)`, and gives DDP its
# `device_ids`. On a laptop without GPUs, simcomm gives every virtual rank a **virtual GPU**
# backed by the CPU: the code runs as written, with real values, and `torch.cuda` answers for
# that rank's GPU, its memory included. (`python -m simcomm.run` does this for a whole torchrun
# script: `docs/gpu_scripts.md` runs PyTorch's FSDP2 example that way.)

# %%
from simcomm.sim.cuda_map import VirtualGPUs

def gpu_program(comm):
    rank = torch.distributed.get_rank()
    torch.cuda.set_device(rank)                          # each rank picks its own GPU
    model = torch.nn.Linear(512, 512).to(rank)           # ... and puts its model there
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank])
    x = torch.ones(8, 512, device="cuda") * (rank + 1)
    ddp(x).square().mean().backward()
    return torch.cuda.current_device(), torch.cuda.get_device_name(), torch.cuda.max_memory_allocated()

weights = (512 * 512 + 512) * 4                          # bytes of the layer's parameters
world = simcomm.World(2, map_cuda=VirtualGPUs("H100", per_node=2), memory=True)
for rank, (device, name, peak) in enumerate(world.run(gpu_program)):
    assert device == rank and "H100" in name and peak >= 2 * weights   # parameters + gradients at least
    print(f"rank {rank}: GPU {device}, a {name}, peak {peak / 2**20:.2f} MiB")

# %% [markdown]
# A virtual GPU has a real card's capacity (80 GiB for an H100) and runs out of memory as one
# does. Give it 1 MiB and the 1 MiB layer above no longer fits:

# %%
small = simcomm.World(2, map_cuda=VirtualGPUs("H100", memory="1MiB", per_node=2), memory=True)
error = check.expect_error(lambda: small.run(gpu_program), simcomm.RankError, "CUDA out of memory")
assert isinstance(error.__cause__, torch.OutOfMemoryError)
print(str(error.__cause__).split(". (")[0])


# %% [markdown]
# ## Exercise 1: count the ranks
#
# Write `count_ranks(comm)` that returns the number of ranks, as a number, **without** reading
# `comm.world_size`: use one `comm.all_reduce`. The check runs it on 1, 2, 3 and 5 virtual ranks.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def count_ranks(comm):
    raise NotImplementedError   # your code

print(check.check_count_ranks(count_ranks))


# %% [markdown] expect=["Correct: right on 1, 2, 3, 5 ranks."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# def count_ranks_solution(comm):
#     return comm.all_reduce(torch.ones(1, device=comm.device)).item()     # every rank adds 1
#
# print(check.check_count_ranks(count_ranks_solution))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 2: which programs deadlock?
#
# Read the three programs below, **without running them**, and predict which ones deadlock on
# 4 ranks (remember: `send` waits until its receiver calls `recv`, and a collective waits until
# every rank of the group has called it). `comm.send(x)` goes to the next rank, `comm.recv`
# takes from the previous one. Write the set of letters, e.g. `{"A"}`, or `set()` for none.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def program_a(comm):
    x = torch.ones(2)
    if comm.rank % 2 == 0:
        comm.send(x)
        return comm.recv((2,))
    y = comm.recv((2,))
    comm.send(x)
    return y

def program_b(comm):
    total = comm.all_reduce(torch.ones(1))
    if comm.rank == 0:
        comm.barrier()              # only rank 0 waits here
    return total

def program_c(comm):
    if comm.rank == 0:
        comm.send(torch.ones(2), dst=1)
    if comm.rank == 1:
        return comm.recv((2,), src=0)
    return None

my_deadlocks = ...
print(check.check_deadlocks(my_deadlocks, {"A": program_a, "B": program_b, "C": program_c}))

# %% [markdown] expect=["Correct: B deadlock(s) on 4 ranks."] tags=["solution"]
# <details><summary>Solution of exercise 2 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 2.
# # A: even ranks send first and odd ranks receive first, so every send meets a waiting recv.
# # B: rank 0 waits in a barrier that ranks 1-3 never reach.
# # C: only ranks 0 and 1 talk, and rank 1 does receive.
# print(check.check_deadlocks({"B"}, {"A": program_a, "B": program_b, "C": program_c}))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * A distributed program is one function run on every rank; `comm.rank` tells the copies apart.
# * `simcomm.World(n).run(program)` runs it on `n` virtual ranks here; `real.run` on real
#   processes; `simcomm.configured_backend(n)` picks by `SIMCOMM_BACKEND`.
# * Every collective is traced; mismatched collectives and deadlocks raise at once on the
#   simulator.
#
# Next: [lesson 1, the collectives](01_collectives.ipynb).
