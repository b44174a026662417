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
# # Lesson 5: Ulysses sequence parallelism
#
# **Goal:** split a long sequence across ranks and still compute exact full-sequence attention,
# by re-sharding from *sequence shards* to *head shards* with one all-to-all, attending, and
# re-sharding back.
#
# Tensors here have the layout `(batch, seq, heads, head_dim)`, written `(b, s, h, d)`. With `P`
# ranks, each rank starts with `s/P` consecutive tokens and all heads: `(b, s/P, h, d)`.
# Attention needs, for each query token, *every* key token, so sequence shards alone cannot
# compute it. But heads are independent of each other. Ulysses swaps what is sharded: after an
# all-to-all each rank holds the *whole* sequence for `h/P` heads, `(b, s, h/P, d)`.

# %%
import torch
import simcomm
from simcomm import lessons, viz
from simcomm.models import attention, make_qkv, ulysses_attention

world_size, batch, seq, heads, head_dim = 4, 1, 8, 4, 2
world = simcomm.configured_backend(world_size)
shard = seq // world_size                                    # tokens per rank

# %% [markdown]
# ## 1. The all-to-all, with labelled values
#
# Give every element a value that says where it sits: `10 * token + head`. Rank `r` starts with
# tokens `2r` and `2r + 1` of every head.

# %% expect=["rank 0: (1, 2, 4, 2) tokens x heads [[0, 1, 2, 3], [10, 11, 12, 13]]  ->  (1, 8, 1, 2) [0, 10, 20, 30, 40, 50, 60, 70]", "rank 1: (1, 2, 4, 2) tokens x heads [[20, 21, 22, 23], [30, 31, 32, 33]]  ->  (1, 8, 1, 2) [1, 11, 21, 31, 41, 51, 61, 71]", "rank 2: (1, 2, 4, 2) tokens x heads [[40, 41, 42, 43], [50, 51, 52, 53]]  ->  (1, 8, 1, 2) [2, 12, 22, 32, 42, 52, 62, 72]", "rank 3: (1, 2, 4, 2) tokens x heads [[60, 61, 62, 63], [70, 71, 72, 73]]  ->  (1, 8, 1, 2) [3, 13, 23, 33, 43, 53, 63, 73]"]
labels = (10 * torch.arange(seq).view(1, seq, 1, 1) + torch.arange(heads).view(1, 1, heads, 1)
          ).expand(batch, seq, heads, head_dim).double()     # (b, s, h, d)

def to_heads_and_back(comm, labels):
    mine = labels[:, comm.rank * shard:(comm.rank + 1) * shard].to(comm.device)  # (b, s/P, h, d)
    by_heads = comm.all_to_all_4D(mine, scatter_dim=2, gather_dim=1)           # (b, s, h/P, d)
    back = comm.all_to_all_4D(by_heads, scatter_dim=1, gather_dim=2)           # (b, s/P, h, d)
    return mine, by_heads, back

outs = world.run(to_heads_and_back, labels)
for rank, (mine, by_heads, _) in enumerate(outs):
    print(f"rank {rank}: {tuple(mine.shape)} tokens x heads {mine[0, :, :, 0].int().tolist()}"
          f"  ->  {tuple(by_heads.shape)} {by_heads[0, :, :, 0].int().flatten().tolist()}")

# %% [markdown]
# After the first all-to-all, rank 0 holds head 0 for all 8 tokens, rank 1 head 1, and so on.
# The second all-to-all (the dims swapped) is the exact inverse:

# %% expect=["head shards: matches the reference", "back to sequence shards: matches the reference"]
heads_per_rank = heads // world_size
expected_heads = [labels[:, :, r * heads_per_rank:(r + 1) * heads_per_rank] for r in range(world_size)]
print(lessons.assert_close([by_heads for _, by_heads, _ in outs], expected_heads, "head shards"))
print(lessons.assert_close([back for _, _, back in outs], [mine for mine, _, _ in outs],
                           "back to sequence shards"))

# %% [markdown]
# The same re-sharding as a figure, coloured by the rank each element came from (drawn on the
# simulator): the left panels are sequence shards, the right ones head shards.

# %% tags=["nbval-ignore-output"]
viz.collective_figure("all_to_all_4D", world_size=world_size, shape=(batch, shard, heads, head_dim))  # per-rank shape

# %% [markdown]
# ## 2. Ulysses attention equals single-device attention
#
# `simcomm.models.ulysses_attention(comm, q, k, v)` is three all-to-alls (q, k, v to head
# shards), ordinary attention over the whole sequence for `h/P` heads, and one all-to-all back.
# Each rank's output shard is its own part of the output, so the per-rank losses add up to the
# loss of the whole output: the sum-of-losses convention holds with no extra care.

# %% expect=["causal=False output: matches the reference", "causal=False q.grad: matches the reference", "causal=False k.grad: matches the reference", "causal=False v.grad: matches the reference", "causal=True output: matches the reference", "causal=True q.grad: matches the reference", "causal=True k.grad: matches the reference", "causal=True v.grad: matches the reference"]
q, k, v = make_qkv(batch, seq, heads, head_dim, seed=0)           # (b, s, h, d) each, float64
weights = torch.randn(batch, seq, heads, head_dim, dtype=torch.float64,
                      generator=torch.Generator().manual_seed(1))   # a loss that weighs every element

def ulysses_step(comm, q, k, v, weights, causal):
    mine = slice(comm.rank * shard, (comm.rank + 1) * shard)
    q, k, v = (t[:, mine].to(comm.device, copy=True).requires_grad_() for t in (q, k, v))  # (b, s/P, h, d)
    out = ulysses_attention(comm, q, k, v, causal=causal)                                 # (b, s/P, h, d)
    (out * weights[:, mine].to(comm.device)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad

for causal in (False, True):
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out = attention(ref_q, ref_k, ref_v, causal=causal)
    (ref_out * weights).sum().backward()
    outs = world.run(ulysses_step, q, k, v, weights, causal)
    for index, (name, ref) in enumerate([("output", ref_out), ("q.grad", ref_q.grad),
                                         ("k.grad", ref_k.grad), ("v.grad", ref_v.grad)]):
        got = torch.cat([out[index] for out in outs], dim=1)      # the shards in sequence order
        print(lessons.assert_close(got, ref.detach(), f"causal={causal} {name}"))

# %% [markdown]
# The backward pass runs the all-to-alls again, each with its dims swapped (lesson 2):

# %% expect=["8 calls: [('all_to_all', 'backward'), ('all_to_all', 'forward')]"]
calls = [(op, phase) for _, op, phase in world.trace.ops()]
assert calls == [("all_to_all", "forward")] * 4 + [("all_to_all", "backward")] * 4, calls
print(f"{len(calls)} calls: {sorted(set(calls))}")

# %% [markdown]
# ## 3. When the heads do not divide the world size
#
# With 6 heads on 4 ranks there is no even split of heads. The communicator refuses before any
# data moves, names the op, the dim, the size and the world size, and the run reports which rank
# raised, instead of truncating the heads or waiting forever.

# %%
q6, k6, v6 = make_qkv(batch, seq, 6, head_dim)
error = lessons.expect_error(lambda: world.run(ulysses_step, q6, k6, v6, weights, False),
                             simcomm.RankError, "all_to_all_4D", "size 6", "not divisible by the world size 4")
print(str(error).splitlines()[0])


# %% [markdown]
# ## 4. Communication: Ulysses vs all-gathering the sequence
#
# Another exact way: each rank keeps its queries and all-gathers the keys and values of the whole
# sequence (`all_gather(k, dim=1)`), then attends. Let us count the bytes each rank sends in the
# forward pass of both, from the trace, for several world sizes (the sequence grows with the
# world size, so every rank keeps the same number of tokens).

# %%
def my_tokens(comm, seq_len):
    per_rank = seq_len // comm.world_size
    return slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)

def allgather_kv_step(comm, q, k, v):
    mine = my_tokens(comm, q.shape[1])
    k_all, v_all = comm.all_gather(k[:, mine], dim=1), comm.all_gather(v[:, mine], dim=1)  # (b, s, h, d)
    return attention(q[:, mine], k_all, v_all)                                           # (b, s/P, h, d)

def ulysses_forward(comm, q, k, v):
    mine = my_tokens(comm, q.shape[1])
    return ulysses_attention(comm, q[:, mine], k[:, mine], v[:, mine])

def bytes_sent_by_rank_0(trace):
    return sum(sum(event.sent.values()) for event in trace.filter(rank=0))


# %% expect=["2 ranks: Ulysses  1024 B, all-gather K,V  1024 B per rank  (ratio 1)", "4 ranks: Ulysses  1536 B, all-gather K,V  3072 B per rank  (ratio 2)", "8 ranks: Ulysses  1792 B, all-gather K,V  7168 B per rank  (ratio 4)"]
for size in (2, 4, 8):
    sim = simcomm.World(size)                                   # byte counts: the simulator's trace
    q_n, k_n, v_n = make_qkv(batch, 4 * size, 8, head_dim)      # 4 tokens per rank, 8 heads
    ours = torch.cat(sim.run(ulysses_forward, q_n, k_n, v_n), dim=1)
    ulysses_bytes = bytes_sent_by_rank_0(sim.trace)
    theirs = torch.cat(sim.run(allgather_kv_step, q_n, k_n, v_n), dim=1)
    gather_bytes = bytes_sent_by_rank_0(sim.trace)
    lessons.assert_close([ours, theirs], [attention(q_n, k_n, v_n)] * 2, "both methods")
    assert gather_bytes / ulysses_bytes == size / 2
    print(f"{size} ranks: Ulysses {ulysses_bytes:5} B, all-gather K,V {gather_bytes:5} B per rank"
          f"  (ratio {gather_bytes / ulysses_bytes:g})")


# %% [markdown]
# With a fixed number of tokens per rank, Ulysses sends almost the same bytes per rank however
# many ranks there are (each all-to-all sends `(P-1)/P` of the rank's shard), while gathering K
# and V grows with `P`: the ratio is `P / 2`. (The all-gather way also keeps the whole K and V
# on every rank.) Ulysses' limit is the other one you just met: at most `h` ranks, and `h` must
# divide evenly.

# %% [markdown]
# ## Exercise: predict Ulysses' bytes
#
# Write `per_rank_bytes(batch, seq, heads, head_dim, world_size, itemsize)`: the bytes one rank
# sends in the forward pass of `ulysses_attention` (four all-to-alls), for tensors of
# `itemsize` bytes per element. The check compares with traced runs for several shapes.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def per_rank_bytes(batch, seq, heads, head_dim, world_size, itemsize):
    raise NotImplementedError   # your formula

print(lessons.check_ulysses_bytes(per_rank_bytes))


# %% [markdown]
# Solution (expand the cell to see it):

# %% expect=["Correct: bytes per rank for 4 shapes and world sizes."] jupyter={"source_hidden": true} tags=["solution"]
def ulysses_bytes_solution(batch, seq, heads, head_dim, world_size, itemsize):
    shard_bytes = batch * (seq // world_size) * heads * head_dim * itemsize   # one (b, s/P, h, d) tensor
    return 4 * shard_bytes * (world_size - 1) / world_size                    # 4 all-to-alls, keep 1/P

print(lessons.check_ulysses_bytes(ulysses_bytes_solution))
# forgetting that each rank keeps its own chunk is caught:
failure = lessons.expect_error(
    lambda: lessons.check_ulysses_bytes(lambda b, s, h, d, p, i: 4 * b * (s // p) * h * d * i),
    AssertionError, "you said")

# %% [markdown]
# ## Takeaway
#
# * `all_to_all_4D(x, scatter_dim=2, gather_dim=1)` turns sequence shards `(b, s/P, h, d)` into
#   head shards `(b, s, h/P, d)`; `(1, 2)` turns them back. Its backward is the swapped one.
# * Attention on head shards is ordinary attention, so Ulysses gives exactly the single-device
#   outputs and gradients, causal or not.
# * The heads must divide the world size; the communicator says so instead of hanging.
# * Per rank, Ulysses sends `4 (P-1)/P` shards forward, independent of `P`; gathering K and V
#   sends `2 (P-1)` shards, `P/2` times more.

# %%
world.close()
