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
import simcomm.lessons.lesson_05 as check
from simcomm import viz
from simcomm.parallel.sequence import attention, make_qkv
viz.use_export_renderer()   # figures live in JupyterLab and survive an HTML export

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
print(check.assert_close([by_heads for _, by_heads, _ in outs], expected_heads, "head shards"))
print(check.assert_close([back for _, _, back in outs], [mine for mine, _, _ in outs],
                           "back to sequence shards"))

# %% [markdown]
# The same re-sharding as a figure (drawn on the simulator, with `head_dim` 1 so that one cell
# is one token of one head): each cell is labelled with its token and head (`t5 h2`) and
# coloured by the rank it came from. Top row: the sequence shards each rank starts with; below:
# the head shards after the all-to-all (the figure lays the ranks side by side to fit a screen).

# %% tags=["nbval-ignore-output"]
viz.collective_figure("all_to_all_4D", world_size=world_size, shape=(batch, shard, heads, 1), backward=False)

# %% [markdown]
# ## 2. Ulysses attention equals single-device attention
#
# Ulysses attention is three all-to-alls (q, k, v to head shards), ordinary attention over the
# whole sequence for the rank's `h/P` heads, and one all-to-all back. `attention(q, k, v)` is
# single-device softmax attention on `(b, s, h, d)` tensors (the oracle below, too): each head
# attends on its own, so attending over head shards computes exactly those heads' outputs.

# %%
def ulysses_attention(comm, q, k, v, *, causal=False):
    # sequence shards (b, s/P, h, d) -> head shards (b, s, h/P, d), one all-to-all each
    q, k, v = (comm.all_to_all_4D(t, scatter_dim=2, gather_dim=1) for t in (q, k, v))
    out = attention(q, k, v, causal=causal)                       # the whole sequence, h/P heads
    return comm.all_to_all_4D(out, scatter_dim=1, gather_dim=2)   # back to (b, s/P, h, d)

# %% [markdown]
# The library keeps the same function as `simcomm.parallel.sequence.ulysses_attention` (a test
# checks that the two agree: outputs, gradients and the collectives they call). Each rank's output
# shard is its own part of the output, so the per-rank losses add up to the loss of the whole
# output: the sum-of-losses convention holds with no extra care.

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
        print(check.assert_close(got, ref.detach(), f"causal={causal} {name}"))

# %% [markdown]
# The backward pass runs the all-to-alls again, each with its dims swapped (lesson 2):

# %% expect=["8 calls: [('all_to_all', 'backward'), ('all_to_all', 'forward')]"]
calls = [(op, phase) for _, op, phase in world.trace.ops()]
assert calls == [("all_to_all", "forward")] * 4 + [("all_to_all", "backward")] * 4, calls
print(f"{len(calls)} calls: {sorted(set(calls))}")

# %% [markdown]
# ## 3. When the number of heads is not divisible by the world size
#
# With 6 heads on 4 ranks there is no even split of heads. The communicator refuses before any
# data moves, names the op, the dim, the size and the world size, and the run reports which rank
# raised, instead of truncating the heads or waiting forever.

# %%
q6, k6, v6 = make_qkv(batch, seq, 6, head_dim)
error = check.expect_error(lambda: world.run(ulysses_step, q6, k6, v6, weights, False),
                             simcomm.RankError, "all_to_all_4D", "size 6", "not divisible by the world size 4")
print(str(error).splitlines()[0])


# %% [markdown]
# ## 4. Communication: Ulysses vs all-gathering the sequence
#
# Another exact way: each rank keeps its queries and all-gathers the keys and values of the whole
# sequence (`all_gather(k, dim=1)`), then attends. Let us count the bytes each rank sends in the
# forward pass of both, from the trace, for several world sizes (the sequence grows with the
# world size, so every rank keeps the same number of tokens).

# %% expect=["2 ranks: Ulysses  1024 B, all-gather K,V  1024 B per rank  (ratio 1)", "4 ranks: Ulysses  1536 B, all-gather K,V  3072 B per rank  (ratio 2)", "8 ranks: Ulysses  1792 B, all-gather K,V  7168 B per rank  (ratio 4)"]
def sharded_attention(comm, q, k, v, method):
    per_rank = q.shape[1] // comm.world_size
    q, k, v = (t[:, comm.rank * per_rank:(comm.rank + 1) * per_rank] for t in (q, k, v))  # (b, s/P, h, d)
    if method == "Ulysses":
        return ulysses_attention(comm, q, k, v)
    return attention(q, comm.all_gather(k, dim=1), comm.all_gather(v, dim=1))   # K, V: (b, s, h, d)

for size in (2, 4, 8):
    sim = simcomm.World(size)                                   # byte counts: the simulator's trace
    q_n, k_n, v_n = make_qkv(batch, 4 * size, 8, head_dim)      # 4 tokens per rank, 8 heads
    sent = {}
    for method in ("Ulysses", "all-gather K,V"):
        out = torch.cat(sim.run(sharded_attention, q_n, k_n, v_n, method), dim=1)   # shards in order
        check.assert_close(out, attention(q_n, k_n, v_n), method)
        sent[method] = sum(sum(event.sent.values()) for event in sim.trace.filter(rank=0).events)
    ratio = sent["all-gather K,V"] / sent["Ulysses"]
    assert ratio == size / 2
    print(f"{size} ranks: " + ", ".join(f"{m} {b:5} B" for m, b in sent.items()) + f" per rank  (ratio {ratio:g})")


# %% [markdown]
# With a fixed number of tokens per rank, Ulysses sends almost the same bytes per rank however
# many ranks there are (each all-to-all sends `(P-1)/P` of the rank's shard), while gathering K
# and V grows with `P`: the ratio is `P / 2`. (The all-gather way also keeps the whole K and V
# on every rank.) Ulysses' limit is the other one you just met: at most `h` ranks, and the
# number of heads `h` must be divisible by the world size.

# %% [markdown]
# ## Exercise: Ulysses bytes with grouped-query attention
#
# Many models use *grouped-query attention* (GQA): `q` has `q_heads` heads, but `k` and `v` have
# only `kv_heads` (each key/value head serves `q_heads / kv_heads` query heads). Ulysses then
# all-to-alls `q`, `k` and `v` as before (each rank gets `q_heads / P` query heads and the
# `kv_heads / P` key/value heads they use; both counts must be divisible by `P`), attends, and
# all-to-alls the output back. Write `gqa_bytes(batch, seq, q_heads, kv_heads, head_dim,
# world_size, itemsize)`: the bytes one rank sends in that forward pass. The check traces runs
# of Ulysses GQA attention for several shapes and world sizes.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def gqa_bytes(batch, seq, q_heads, kv_heads, head_dim, world_size, itemsize):
    raise NotImplementedError   # your formula

print(check.check_ulysses_gqa_bytes(gqa_bytes))

# %% [markdown] expect=["Correct: bytes per rank for 4 shapes and world sizes."] tags=["solution"]
# <details><summary>Solution of the exercise (open it once you have tried)</summary>
#
# ```python
# # Solution of the exercise.
# def gqa_bytes_solution(batch, seq, q_heads, kv_heads, head_dim, world_size, itemsize):
#     per_head = batch * (seq // world_size) * head_dim * itemsize     # one head of a (b, s/P, h, d) shard
#     heads_moved = 2 * q_heads + 2 * kv_heads                          # q and the output; k and v
#     return heads_moved * per_head * (world_size - 1) / world_size     # each all-to-all keeps 1/P
#
# print(check.check_ulysses_gqa_bytes(gqa_bytes_solution))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * `all_to_all_4D(x, scatter_dim=2, gather_dim=1)` turns sequence shards `(b, s/P, h, d)` into
#   head shards `(b, s, h/P, d)`; `(1, 2)` turns them back. Its backward is the swapped one.
# * Attention on head shards is ordinary attention, so Ulysses gives exactly the single-device
#   outputs and gradients, causal or not.
# * The number of heads must be divisible by the world size; the communicator says so instead of
#   hanging.
# * Per rank, Ulysses sends `4 (P-1)/P` shards forward: fewer than 4 at any `P`, almost independent
#   of it; gathering K and V
#   sends `2 (P-1)` shards, `P/2` times more. With GQA, `k` and `v` are smaller and so is their
#   share: `(2 q_heads + 2 kv_heads) / (4 q_heads)` of the MHA bytes.

# %%
world.close()
