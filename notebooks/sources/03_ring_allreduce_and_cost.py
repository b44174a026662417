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
# # Lesson 3: the ring all-reduce, and what it costs
#
# **Goal:** see how an all-reduce actually moves its data (the ring and the tree algorithms,
# step by step), count the bytes each rank sends, and use that count to predict how long an
# all-reduce takes on real hardware and to read the "busbw" numbers that NCCL's benchmarks print.
#
# Lesson 1 treated `all_reduce` as one call. Underneath, a library like NCCL runs an *algorithm*:
# a schedule of point-to-point sends between neighbours. Which one, and how many bytes it
# sends, decides the time.

# %%
import torch
import simcomm
from simcomm.model import cost
import simcomm.lessons.lesson_03 as check
from simcomm import viz
from simcomm.viz import allreduce_steps
viz.use_export_renderer()   # figures live in JupyterLab and survive an HTML export

world_size = 4
world = simcomm.configured_backend(world_size)

# %% [markdown]
# ## 1. The ring, step by step
#
# Cut each rank's buffer into `world_size` chunks and arrange the ranks in a ring. In each step,
# every rank sends one chunk to the next rank and receives one from the previous rank.
#
# * **Reduce-scatter**, `n - 1` steps: the receiver *adds* the incoming chunk to its own. After
#   `n - 1` steps each rank holds one chunk that contains the sum over all ranks.
# * **All-gather**, `n - 1` more steps: the finished chunks travel around the ring; the receiver
#   *keeps* them. Now every rank has every summed chunk.
#
# Press play, or drag the slider (the animation needs no running kernel, so it also works in an
# exported HTML file). Each cell shows a chunk's partial sum and the ranks it already contains.

# %% tags=["nbval-ignore-output"]
ring = viz.ring_allreduce_figure(world_size)
assert len(ring.frames) == 2 * (world_size - 1) + 1       # the steps, plus the start
ring


# %% [markdown]
# Stop the animation after the last reduce-scatter step (`RS3`) and read the diagonal: rank `r`
# holds the complete sum of chunk `r + 1` (mod `n`), **not** chunk `r`, which is what
# `reduce_scatter` hands rank `r` in lesson 1. In step `s` rank `r` sends chunk `r - s`, so the
# chunk that goes once around the ring and ends complete at rank `r` is the one that started at
# rank `r + 1`. Which chunk ends where only depends on where the rotation starts; a library that
# builds `reduce_scatter` from this ring starts it one chunk later. For the all-reduce it does
# not matter: the all-gather passes every finished chunk to every rank.

# %%
after_reduce_scatter = allreduce_steps(world_size, "ring")[world_size - 1]   # [0] is the start
complete = [[len(ranks) == world_size for ranks in row] for row in after_reduce_scatter.ranks]
assert all(complete[r][(r + 1) % world_size] and sum(complete[r]) == 1 for r in range(world_size))

# %% [markdown]
# ## 2. The ring, written with `send` and `recv`
#
# Here is the ring all-reduce, with nothing but `comm.send` and `comm.recv`. One step of the ring
# is `ring_exchange`: send a chunk to the next rank, receive one from the previous rank (even ranks
# send first, odd ranks receive first; the end of this section shows why). `ring_all_reduce` runs the steps of
# section 1: rank `r` sends chunk `r - step` and receives chunk `r - 1 - step`; in the first
# `n - 1` steps it *adds* what it receives, in the last `n - 1` it *keeps* it. (The library keeps
# the same two functions, `simcomm.parallel.ring.ring_exchange` and
# `simcomm.lessons.lesson_03.ring_all_reduce`; a test checks they behave like these.)

# %%
def ring_exchange(comm, outgoing):
    """Send `outgoing` to rank + 1; return what rank - 1 sent (same shape and dtype)."""
    if comm.rank % 2 == 0:                                   # even ranks send first ...
        comm.send(outgoing)
        return comm.recv(outgoing.shape, outgoing.dtype)
    incoming = comm.recv(outgoing.shape, outgoing.dtype)     # ... odd ranks receive first
    comm.send(outgoing)
    return incoming


def ring_all_reduce(comm, x):
    """The sum of `x` over the ranks, by the ring: n - 1 reduce-scatter steps, then n - 1 all-gather
    steps, one chunk of `x.numel() / n` per step (`x.numel()` divisible by n). `x` is not modified."""
    n, rank = comm.world_size, comm.rank
    if n == 1:
        return x.clone()
    chunks = list(x.detach().flatten().clone().chunk(n))
    for step in range(2 * (n - 1)):
        send_chunk, recv_chunk = (rank - step) % n, (rank - 1 - step) % n
        incoming = ring_exchange(comm, chunks[send_chunk].clone())
        if step < n - 1:
            chunks[recv_chunk] = chunks[recv_chunk] + incoming      # reduce-scatter: add
        else:
            chunks[recv_chunk] = incoming                           # all-gather: keep
    return torch.cat(chunks).reshape(x.shape)

# %% [markdown]
# It runs on the configured backend and must agree with the built-in all-reduce:

# %% expect=["rank 0: [600, 604, 608, 612, 616, 620, 624, 628] (the same on every rank)"]
def ring_vs_builtin(comm):
    x = torch.arange(8.0, device=comm.device) + 100 * comm.rank      # 8 numbers = 4 chunks of 2
    return ring_all_reduce(comm, x), comm.all_reduce(x)

outs = world.run(ring_vs_builtin)
assert all(torch.equal(ring_sum, builtin) for ring_sum, builtin in outs)
print(check.per_rank([ring_sum for ring_sum, _ in outs][:1]), "(the same on every rank)")

# %% [markdown]
# Now count, from the trace, what rank 0 sent in the ring:

# %% expect=["6 sends of 8 bytes: 48 bytes for a 32-byte buffer"]
sends = world.trace.filter(rank=0, op="send").events
buffer_bytes = 8 * torch.tensor(0.0).element_size()                     # one rank's x: 8 float32
ring_bytes = sum(event.nbytes for event in sends)
assert len(sends) == 2 * (world_size - 1)
assert all(event.nbytes == buffer_bytes // world_size for event in sends)   # one chunk per step
assert ring_bytes == 2 * (world_size - 1) / world_size * buffer_bytes
print(f"{len(sends)} sends of {sends[0].nbytes} bytes: {ring_bytes} bytes for a {buffer_bytes}-byte buffer")


# %% [markdown]
# The trace of that run holds both all-reduces. Lesson 0's trace *charged* the built-in
# `all_reduce` to every peer evenly (the simulator does not run an algorithm; it counts the
# bytes any all-reduce must send); the ring's `send`s are recorded one by one, as they moved.
# Pick the op in the figure's menu: `send` fills only the band "rank r -> rank r + 1", the
# `all_reduce` row fills the whole matrix, and both charge each rank the same 48 bytes.

# %%
charged = sum(sum(event.sent.values()) for event in world.trace.filter(rank=0, op="all_reduce").events)
assert charged == ring_bytes
assert all(set(event.sent) == {(event.rank + 1) % world_size} for event in world.trace.filter(op="send").events)
viz.comm_matrix_figure(world.trace)

# %% [markdown]
# Each rank sends `2 (n - 1) / n` times its buffer, **whatever the number of ranks**: 1.5x for
# 4 ranks, 1.75x for 8, never more than 2x. That is why the ring is the algorithm of choice for
# large messages: adding ranks does not add bytes per link.
#
# A detail that matters on real hardware: a rank's `send` may block until the neighbour receives
# (the simulator always blocks, the strictest case). If every rank sent first, all would wait
# forever; `ring_exchange` above lets even ranks send first and odd ranks receive first. The
# simulator catches the naive version at once:

# %% expect=["DeadlockError"]
def everyone_sends_first(comm):
    comm.send(torch.ones(2))              # to the next rank
    return comm.recv((2,))                # from the previous rank

error = check.expect_error(lambda: simcomm.World(world_size).run(everyone_sends_first),
                             simcomm.DeadlockError, "send")
print(type(error).__name__)

# %% [markdown]
# ## 3. The tree: fewer steps, more bytes
#
# A tree all-reduce adds buffers up a *binomial* tree to rank 0 (in step `k`, every rank
# `r` with `r mod 2^(k+1) = 2^k` sends to rank `r - 2^k`) and sends the result back down the
# same tree. It takes only `2 log2(n)` steps, but every send carries the *whole* buffer. Step
# through it:

# %% tags=["nbval-ignore-output"]
viz.tree_allreduce_figure(world_size)


# %% [markdown]
# Both schedules, counted from their step lists for several world sizes: the number of steps
# (each costs a fixed latency) and the most bytes one rank sends (in buffers):

# %% expect=[" 2 ranks: ring  2 steps, 1 buffers;  tree 2 steps, 1 buffers", " 4 ranks: ring  6 steps, 1.5 buffers;  tree 4 steps, 2 buffers", " 8 ranks: ring 14 steps, 1.75 buffers;  tree 6 steps, 3 buffers", "16 ranks: ring 30 steps, 1.88 buffers;  tree 8 steps, 4 buffers"]
def most_sent(steps, n):
    sent = [0.0] * n
    for step in steps:
        for src, _, chunks in step.sends:
            sent[src] += len(chunks) / n       # a chunk is 1/n of the buffer
    return max(sent)

for n in (2, 4, 8, 16):
    ring_steps, tree_steps = allreduce_steps(n, "ring")[1:], allreduce_steps(n, "tree")[1:]  # [0] is the start
    assert len(ring_steps) == 2 * (n - 1) and most_sent(ring_steps, n) == 2 * (n - 1) / n
    print(f"{n:2} ranks: ring {len(ring_steps):2} steps, {most_sent(ring_steps, n):.3g} buffers;"
          f"  tree {len(tree_steps)} steps, {most_sent(tree_steps, n):.3g} buffers")

# %% [markdown]
# The ring's steps grow with `n`, its bytes do not; the tree's steps grow only as `log2(n)`,
# its bytes do. (NCCL's tree is a pipelined double binary tree that sends far fewer bytes than
# this simple one; the cost model below models NCCL's.)

# %% [markdown]
# ## 4. From bytes to time: the alpha-beta model
#
# A simple model predicts the time of a collective well:
#
# `time = latency + steps x hop latency + bytes on the busiest link / bandwidth`
#
# `simcomm.model.cost.estimate(op, nbytes, world_size, topology)` evaluates it for presets of real
# machines (their sources are cited in `simcomm.model.topology`). Small messages pay latency per
# step, so the algorithm with fewer steps wins; large ones pay bytes, so the one with fewer
# bytes wins. Inside one NVLink node NCCL's tree is a chain (no fewer steps than the ring);
# the tree's `log2` steps pay off *across nodes*. An all-reduce over 16 GPUs on two
# InfiniBand-connected A100 nodes:

# %%
cluster = cost.get_topology("a100-hdr-cluster")
for nbytes in (2 ** 10, 2 ** 20, 2 ** 30):
    ring_est = cost.estimate("all_reduce", nbytes, 16, cluster, algorithm="ring")
    tree_est = cost.estimate("all_reduce", nbytes, 16, cluster, algorithm="tree")
    print(f"{nbytes:>10} B: ring {ring_est.time * 1e6:8.1f} us, tree {tree_est.time * 1e6:8.1f} us")

small = [cost.estimate("all_reduce", 2 ** 10, 16, cluster, algorithm=a) for a in ("ring", "tree")]
large = [cost.estimate("all_reduce", 2 ** 30, 16, cluster, algorithm=a) for a in ("ring", "tree")]
assert small[1].time < small[0].time, "small messages: fewer steps win (latency)"
assert large[0].time < large[1].time, "large messages: fewer bytes win (bandwidth)"
assert small[0].latency / small[0].time > 0.9 and large[0].latency / large[0].time < 0.1
simple_tree_bytes = most_sent(allreduce_steps(16, "tree")[1:], 16) * 2 ** 30
assert large[1].bandwidth_time < simple_tree_bytes / cluster.nic_share(8)   # NCCL's tree sends less

# %% [markdown]
# For 1 KiB, latency is almost all of the time and the tree's fewer steps win; for 1 GiB the
# bytes dominate and the ring wins. (For small messages NCCL also switches protocol: its LL
# protocol trades bandwidth for latency, and the model picks the fastest of Simple, LL and LL128,
# as NCCL's tuner does.) Inside one 8-GPU H100 node, the bandwidth part of the ring is exactly
# the byte count of section 2 divided by the link's bandwidth:

# %% expect=["1.750 GiB over 369 GB/s = 5.09 ms"]
topology = cost.get_topology("h100-nvswitch")
n = 8
nbytes = 2 ** 30
ring_est = cost.estimate("all_reduce", nbytes, n, topology, algorithm="ring")
bytes_per_link = 2 * (n - 1) / n * nbytes
assert abs(ring_est.bandwidth_time - bytes_per_link / topology.intra_bandwidth) < 1e-6 * ring_est.time
print(f"{bytes_per_link / 2 ** 30:.3f} GiB over {topology.intra_bandwidth / 1e9:.0f} GB/s "
      f"= {ring_est.bandwidth_time * 1e3:.2f} ms")

# %% [markdown]
# ## 5. algbw and busbw: reading nccl-tests
#
# NCCL's benchmark (nccl-tests) prints two bandwidths. **algbw** = size / time: what your program
# sees. **busbw** = algbw x a factor per op, for the all-reduce `2 (n - 1) / n`: exactly the
# ring's bytes per buffer from section 2. busbw is therefore the bandwidth each link really
# carries, and it can be compared across ops and world sizes, and with the hardware's link rate.

# %% expect=["busbw of a 1 GiB all-reduce: 365 GB/s, algbw 209 GB/s"]
assert cost.busbw_factor("all_reduce", world_size) == ring_bytes / buffer_bytes   # measured in section 2
assert cost.busbw_factor("all_gather", world_size) == (world_size - 1) / world_size
print(f"busbw of a 1 GiB all-reduce: {ring_est.busbw / 1e9:.0f} GB/s, algbw {ring_est.algbw / 1e9:.0f} GB/s")
assert ring_est.busbw / topology.intra_bandwidth > 0.95, "large messages reach the link's bandwidth"

# %% [markdown]
# One exception to "busbw is at most the link rate": H100 NVSwitches can add the buffers
# themselves (NVLink SHARP, NCCL's `NVLS` algorithm), so each GPU sends its data once and
# receives the sum once instead of taking part in `2 (n - 1)` ring steps. Its busbw, computed
# with the same ring factor, then exceeds the link rate: NVIDIA quotes about 480 GB/s on an
# 8-GPU H100 node, and the model's `nvls` algorithm is calibrated to that figure.

# %%
nvls = cost.estimate("all_reduce", 2 ** 33, 8, topology, algorithm="nvls")
print(f"8 GiB all-reduce with NVLS: busbw {nvls.busbw / 1e9:.0f} GB/s (link rate {topology.intra_bandwidth / 1e9:.0f} GB/s)")
assert nvls.busbw > topology.intra_bandwidth

# %% [markdown]
# busbw against size, from the model (`real.bench --json` results can be drawn on the same
# axes: `viz.busbw_figure("bench.json", "h100-nvswitch")`):

# %% tags=["nbval-ignore-output"]
viz.busbw_figure(topology="h100-nvswitch", world_size=8, algorithms=True)

# %% [markdown]
# ## 6. Crossing nodes
#
# Inside a node, GPUs talk over NVLink; between nodes, over network cards (InfiniBand) that are
# an order of magnitude slower per GPU. A collective over two nodes runs at the slower level.
# That is why tensor parallelism, which all-reduces activations in every layer, is usually kept
# inside one node:

# %%
for preset in ("a100-hdr-cluster", "h100-ndr-cluster"):
    machine = cost.get_topology(preset)
    per_gpu_network = machine.nic_share(machine.gpus_per_node) / machine.gpus_per_node
    ratio = machine.intra_bandwidth / per_gpu_network
    assert 5 < ratio < 30
    print(f"{preset}: NVLink {machine.intra_bandwidth / 1e9:.0f} GB/s per GPU, network "
          f"{per_gpu_network / 1e9:.1f} GB/s per GPU: {ratio:.0f}x slower")

cluster = cost.get_topology("a100-hdr-cluster")
one_node = cost.estimate("all_reduce", 2 ** 26, 8, cluster)
two_nodes = cost.estimate("all_reduce", 2 ** 26, 16, cluster)
assert (one_node.nodes, two_nodes.nodes) == (1, 2)
assert two_nodes.time > 2 * one_node.time
print(f"64 MiB all-reduce: 8 GPUs in one node {one_node.time * 1e3:.2f} ms, "
      f"16 GPUs on two nodes {two_nodes.time * 1e3:.2f} ms")


# %% [markdown]
# ## Exercise: write a ring all-gather
#
# The all-reduce's second half *is* an all-gather. Write `my_ring_all_gather(comm, x)`: every
# rank holds one shard `x`; return every rank's shard concatenated in rank order (dim 0), as
# `comm.all_gather(x, dim=0)` would, using only the ring: in each of `n - 1` steps, pass one
# shard to the next rank and receive one from the previous rank, with
# `ring_exchange(comm, shard)` of section 2 (which orders the send and the recv so that no rank
# waits forever; it returns what the previous rank passed). Do not modify `x`. The check runs
# it on 2 to 5 virtual ranks and reads the trace: only `send`/`recv`, to the next rank only,
# `n - 1` sends per rank.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def my_ring_all_gather(comm, x):
    raise NotImplementedError   # your code

print(check.check_ring_all_gather(my_ring_all_gather))

# %% [markdown] expect=["Correct: a ring all-gather on 2, 3, 4, 5 ranks, neighbours only."] tags=["solution"]
# <details><summary>Solution of the exercise (open it once you have tried)</summary>
#
# ```python
# # Solution of the exercise.
# def ring_all_gather_solution(comm, x):
#     n, rank = comm.world_size, comm.rank
#     shards = [None] * n
#     shards[rank] = x.clone()
#     for step in range(n - 1):
#         # pass on the shard received in the previous step (first: my own); receive my predecessor's
#         shards[(rank - 1 - step) % n] = ring_exchange(comm, shards[(rank - step) % n])
#     return torch.cat(shards)
#
# print(check.check_ring_all_gather(ring_all_gather_solution))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * An all-reduce is an algorithm of point-to-point steps. The ring = reduce-scatter + all-gather:
#   `2 (n - 1)` steps, `2 (n - 1) / n` of the buffer sent per rank, however many ranks.
# * The tree takes fewer steps (`2 log2 n`) but sends whole buffers: better for small messages.
# * Time = latency x steps + bytes on the busiest link / bandwidth. busbw = algbw x `2 (n - 1) / n`
#   is the per-link bandwidth, comparable with the hardware's.
# * Crossing nodes costs several times more: keep the chattiest parallelism inside a node.
# * An all-gather is the ring's second half: `n - 1` steps, each passing one shard to a neighbour.

# %%
world.close()
