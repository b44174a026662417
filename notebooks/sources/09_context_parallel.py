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
# # Lesson 9: Context parallelism and ring attention
#
# **Goal:** compute exact attention over a sequence that is sharded across ranks without ever
# holding the whole K and V, by passing K/V blocks around a ring and merging partial softmaxes
# with their log-sum-exp; then balance causal attention with zig-zag sharding and see what the
# ring costs on the wire.
#
# Lesson 5 re-sharded the sequence into heads (Ulysses). That needs at least as many heads as
# ranks. Ring attention keeps the sequence shards `(b, s/P, h, d)` where they are and moves
# keys and values instead, one block per step.

# %%
import math
import torch
import simcomm
from simcomm import P2POp, viz
from simcomm.model import cost
from simcomm.trace import backward_phase
import simcomm.lessons.lesson_09 as check
from simcomm.viz import scaling as figures
from simcomm.parallel.sequence import attention, make_qkv, ulysses_attention
from simcomm.parallel.context import (all_gather_kv_attention, block_attention, chunk_ids, lse_merge, shard_sequence, unshard_sequence)
viz.use_export_renderer()   # figures live in JupyterLab and survive an HTML export

world_size, batch, seq, heads, head_dim = 4, 1, 16, 2, 4
world = simcomm.configured_backend(world_size)

# %% [markdown]
# ## 1. Online softmax on one device
#
# Softmax attention of a query over keys `k_1..k_n` is `sum_j exp(s_j) v_j / sum_j exp(s_j)`.
# Split the keys into two blocks. Attention over each block alone gives an output normalised by
# that block's sum, and the block's log-sum-exp `lse = log(sum_j exp(s_j))`. The two outputs
# combine exactly: `lse = log(exp(lse1) + exp(lse2))` and
# `out = exp(lse1 - lse) * out1 + exp(lse2 - lse) * out2`. This is `lse_merge`.

# %% expect=["two blocks merged: matches the reference", "four blocks, one at a time: matches the reference"]
q, k, v = make_qkv(batch, seq, heads, head_dim, seed=0)        # (b, s, h, d) each, float64
out1, lse1 = block_attention(q, k[:, :6], v[:, :6])            # keys 0-5
out2, lse2 = block_attention(q, k[:, 6:], v[:, 6:])            # keys 6-15
merged, _ = lse_merge(out1, lse1, out2, lse2)
print(check.assert_close(merged, attention(q, k, v), "two blocks merged"))

out = torch.zeros_like(q)
lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)     # nothing seen yet: an empty block
for block in range(4):
    keys = slice(4 * block, 4 * block + 4)
    out, lse = lse_merge(out, lse, *block_attention(q, k[:, keys], v[:, keys]))
print(check.assert_close(out, attention(q, k, v), "four blocks, one at a time"))

# %% [markdown]
# ## 2. Ring attention: K/V blocks travel, queries stay
#
# Rank `r` holds tokens `4r .. 4r+3` of q, k and v. At step `t` it attends its queries to the
# K/V block of rank `r - t`, while `batch_isend_irecv` already passes that block on to rank
# `r + 1`. After `P` steps it has seen every block.
#
# A rank's shard is one chunk of the sequence (`layout="contiguous"`) or two (`"zigzag"`, section 3);
# `chunk_ids(rank, P, layout)` says which. `pairs` lists the (query chunk, key chunk) pairs that
# have anything to compute: under a causal mask a key chunk after the query chunk is all masked,
# and the chunk on the diagonal needs the triangular mask. `send_to_next` issues the transfer
# and returns at once; `received` waits for it.

# %%
def send_to_next(comm, tensor):
    """Issue: send tensor to rank + 1, receive one like it from rank - 1. Returns the handles."""
    nxt, prev = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    return comm.batch_isend_irecv([P2POp("isend", tensor, nxt),
                                   P2POp("irecv", (tuple(tensor.shape), tensor.dtype), prev)])

def received(handles):
    handles[0].wait()                 # our send is done
    return handles[1].wait()          # the previous rank's block

def pairs(q_ids, k_ids, causal):
    """(query slot, key slot, diagonal) for every chunk pair with unmasked scores."""
    return [(qi, ki, causal and k == q) for qi, q in enumerate(q_ids) for ki, k in enumerate(k_ids)
            if not (causal and k > q)]

def block_flops(q, k_len):
    b, sq, h, d = q.shape
    return 4.0 * b * h * sq * k_len * d          # two matmuls of 2 * sq * sk * d, per head

# %% [markdown]
# The forward ring. `kv` is the K/V block in hand; the next transfer is issued *before* the
# block is computed, so it runs during the compute, and waited for after. Each block's partial
# result joins the running one by `lse_merge` (section 1):

# %%
def ring_forward(comm, q, k, v, causal, layout):
    P, rank = comm.world_size, comm.rank
    q_ids = chunk_ids(rank, P, layout)
    q_parts = q.chunk(len(q_ids), dim=1)                                  # (b, c, h, d) each
    out = [torch.zeros_like(part) for part in q_parts]
    lse = [torch.full(part.shape[:3], float("-inf"), dtype=q.dtype) for part in q_parts]   # nothing seen
    kv = torch.stack([k, v])                                              # (2, b, s/P, h, d)
    for step in range(P):
        pending = send_to_next(comm, kv) if step < P - 1 else None        # pass the block on, now
        k_ids = chunk_ids((rank - step) % P, P, layout)                   # whose block this is
        k_parts, v_parts = kv[0].chunk(len(k_ids), dim=1), kv[1].chunk(len(k_ids), dim=1)
        flops = 0.0
        for qi, ki, diagonal in pairs(q_ids, k_ids, causal):
            block_out, block_lse = block_attention(q_parts[qi], k_parts[ki], v_parts[ki], diagonal=diagonal)
            out[qi], lse[qi] = lse_merge(out[qi], lse[qi], block_out, block_lse)
            flops += block_flops(q_parts[qi], k_parts[ki].shape[1])
        if flops:
            comm.compute(flops=flops)                                     # the work, for the trace
        if pending is not None:
            kv = received(pending)
    return torch.cat(out, dim=1), torch.cat(lse, dim=1)                   # (b, s/P, h, d), (b, s/P, h)

# %% [markdown]
# Backward. One block's gradients need only the block, the queries' *final* output and
# log-sum-exp, and `dout`: the softmax probabilities are `exp(score - lse)` with the final `lse`,
# so no block has to wait for another (the FlashAttention backward):

# %%
def block_grads(q, k, v, out, lse, dout, diagonal):
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale                # (b, h, sq, sk)
    if diagonal:
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.exp(scores - lse.transpose(1, 2).unsqueeze(-1))          # softmax over all keys
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, dout)
    dprobs = torch.einsum("bqhd,bkhd->bhqk", dout, v)
    delta = (dout * out).sum(-1).transpose(1, 2).unsqueeze(-1)             # (b, h, sq, 1)
    dscores = probs * (dprobs - delta) * scale
    return (torch.einsum("bhqk,bkhd->bqhd", dscores, k), torch.einsum("bhqk,bqhd->bkhd", dscores, q), dv)

# %% [markdown]
# The backward ring: K and V travel again, now with their dK and dV (zeros at the start, 4
# tensors in one message). Every rank adds its queries' share to the block in hand before
# passing it on; after `P` steps a rank holds the finished dK/dV of rank `r + 1`'s block, and one
# more hop brings it home. dQ never leaves its rank:

# %%
def ring_backward(comm, q, k, v, out, lse, dout, causal, layout):
    P, rank = comm.world_size, comm.rank
    q_ids = chunk_ids(rank, P, layout)
    n = len(q_ids)                                                        # chunks per shard
    q_parts, out_parts, lse_parts, dout_parts = (t.chunk(n, dim=1) for t in (q, out, lse, dout))
    dq = [torch.zeros_like(part) for part in q_parts]
    travelling = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])   # k, v, dk, dv
    for step in range(P):
        k_ids = chunk_ids((rank - step) % P, P, layout)
        k_parts, v_parts = travelling[0].chunk(n, dim=1), travelling[1].chunk(n, dim=1)
        dk, dv, flops = [torch.zeros_like(p) for p in k_parts], [torch.zeros_like(p) for p in v_parts], 0.0
        for qi, ki, diagonal in pairs(q_ids, k_ids, causal):
            gq, gk, gv = block_grads(q_parts[qi], k_parts[ki], v_parts[ki], out_parts[qi], lse_parts[qi],
                                     dout_parts[qi], diagonal)
            dq[qi], dk[ki], dv[ki] = dq[qi] + gq, dk[ki] + gk, dv[ki] + gv
            flops += 2 * block_flops(q_parts[qi], k_parts[ki].shape[1])
        travelling = torch.cat([travelling[:2], travelling[2:] + torch.stack([torch.cat(dk, 1), torch.cat(dv, 1)])])
        if flops:
            comm.compute(flops=flops)
        if step < P - 1:
            travelling = received(send_to_next(comm, travelling))         # k, v, dk, dv move on
    grads = travelling[2:]                        # the dK/dV of rank + 1's block: one hop home
    if P > 1:
        grads = received(send_to_next(comm, grads.contiguous()))
    return torch.cat(dq, dim=1), grads[0], grads[1]

# %% [markdown]
# An autograd function joins the two rings, so that `.backward()` runs the second. Its backward
# runs in `backward_phase()`, which labels the trace's events "backward":

# %%
class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, causal, layout, q, k, v):
        out, lse = ring_forward(comm, q, k, v, causal, layout)
        ctx.comm, ctx.causal, ctx.layout = comm, causal, layout
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with backward_phase():
            dq, dk, dv = ring_backward(ctx.comm, q, k, v, out, lse, dout.contiguous(), ctx.causal, ctx.layout)
        return None, None, None, dq, dk, dv

def ring_attention(comm, q, k, v, *, causal=False, layout="contiguous"):
    """This rank's shard (b, s/P, h, d) of exact attention over the whole sequence."""
    return RingAttention.apply(comm, causal, layout, q, k, v)

# %% [markdown]
# Outputs and all gradients equal one device. (The library keeps the same function,
# `simcomm.parallel.context.ring_attention`, which later lessons import; a test checks that the
# two agree: outputs, gradients and the collectives they call.)

# %% expect=["causal=False output: matches the reference", "causal=False q.grad: matches the reference", "causal=False k.grad: matches the reference", "causal=False v.grad: matches the reference", "causal=True output: matches the reference", "causal=True q.grad: matches the reference", "causal=True k.grad: matches the reference", "causal=True v.grad: matches the reference"]
weights = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

def ring_step(comm, q, k, v, weights, causal, layout):
    q, k, v = (shard_sequence(t, comm.rank, comm.world_size, layout).requires_grad_() for t in (q, k, v))
    out = ring_attention(comm, q, k, v, causal=causal, layout=layout)          # (b, s/P, h, d)
    (out * shard_sequence(weights, comm.rank, comm.world_size, layout)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad

for causal in (False, True):
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = attention(*ref, causal=causal)
    (ref_out * weights).sum().backward()
    outs = world.run(ring_step, q, k, v, weights, causal, "contiguous")
    for index, (name, expected) in enumerate(zip(["output", "q.grad", "k.grad", "v.grad"],
                                                 [ref_out.detach()] + [t.grad for t in ref])):
        got = unshard_sequence([out[index] for out in outs])                    # (b, s, h, d)
        print(check.assert_close(got, expected, f"causal={causal} {name}"))

# %% [markdown]
# The trace shows the ring: in the forward pass rank 0 sends the K/V block 3 times to rank 1;
# in the backward pass it sends K, V, dK and dV 3 times and dK, dV once more (home):

# %% expect=["forward: 3 sends to rank 1 of 512 B", "backward: 4 sends to rank 1 of [1024, 1024, 1024, 512] B"]
sim = simcomm.World(world_size)                     # the simulator's trace, whatever the backend
sim.run(ring_step, q, k, v, weights, False, "contiguous")
for phase in ("forward", "backward"):
    sends = sim.trace.filter(op="send", rank=0, phase=phase).events
    sizes = sorted({e.nbytes for e in sends}) if phase == "forward" else [e.nbytes for e in sends]
    print(f"{phase}: {len(sends)} sends to rank {sends[0].root} of {sizes[0] if len(sizes) == 1 else sizes} B")

# %% [markdown]
# ## 3. Causal attention leaves ranks idle; zig-zag sharding balances them
#
# With a causal mask, query `i` only sees keys `j <= i`. Rank 0 holds the first tokens: only
# its own block has anything to compute. Rank 3 attends to all four blocks. Every block is
# declared to the trace as compute (`comm.compute(flops=...)`), so the trace measures the work.
# Zig-zag sharding cuts the sequence into `2P` chunks and gives rank `r` chunks `r` and
# `2P-1-r`, one early and one late.

# %% expect=["contiguous: forward work per rank 1, 2, 3, 4 (x 512 flops)", "zigzag: forward work per rank 2.25, 2.25, 2.25, 2.25 (x 512 flops)"]
work = {}
for layout in ("contiguous", "zigzag"):
    outs = sim.run(ring_step, q, k, v, weights, True, layout)
    work[layout] = [sum(e.args["flops"] for e in sim.trace.filter(op="compute", rank=r, phase="forward").events)
                    for r in range(world_size)]
    check.assert_close(unshard_sequence([o[0] for o in outs], layout), attention(q, k, v, causal=True), layout)
    print(f"{layout}: forward work per rank " + ", ".join(f"{w / work['contiguous'][0]:g}" for w in work[layout])
          + f" (x {work['contiguous'][0]:g} flops)")
assert len(set(work["zigzag"])) == 1 and max(work["zigzag"]) < max(work["contiguous"])

# %% tags=["nbval-ignore-output"]
figures.bars_per_rank({f"{k}": [w / 1e3 for w in v] for k, v in work.items()},
                      title="causal ring attention: forward work per rank", y_title="kFLOP")

# %% [markdown]
# Contiguous: rank `r` computes `r + 1` blocks, so the step lasts as long as rank 3's four while
# rank 0 idles for three. Zig-zag: every rank computes `2P + 1 = 9` quarter-size chunk pairs,
# `2.25` blocks; the slowest rank does 44% less than before.
#
# ## 4. Bytes on the wire, and does the transfer hide under compute?
#
# Three exact ways to attend over a sharded sequence: ring attention, Ulysses (lesson 5) and
# all-gathering K and V. Bytes each rank sends in one forward and backward pass (the simulator's
# trace; 4 ranks, 4 heads):

# %% expect=["ring: 3072 B forward, 7168 B backward per rank; 14 calls, modelled 50.5 us", "Ulysses: 1536 B forward, 1536 B backward per rank; 8 calls, modelled 67.2 us", "all-gather K,V: 3072 B forward, 3072 B backward per rank; 4 calls, modelled 33.6 us"]
def sharded_step(comm, q, k, v, method):
    q, k, v = (shard_sequence(t, comm.rank, comm.world_size).requires_grad_() for t in (q, k, v))
    attend = {"ring": ring_attention, "Ulysses": ulysses_attention, "all-gather K,V": all_gather_kv_attention}
    attend[method](comm, q, k, v).sum().backward()

q4, k4, v4 = make_qkv(batch, seq, 4, head_dim, seed=2)             # 4 heads, so that Ulysses can run
for method in ("ring", "Ulysses", "all-gather K,V"):
    sim.run(sharded_step, q4, k4, v4, method)
    sent = {phase: sum(sum(e.sent.values()) for e in sim.trace.filter(rank=0, phase=phase).events)
            for phase in ("forward", "backward")}
    lane = cost.modelled_timeline(sim.trace, "h100-nvswitch").ranks[0]        # rank 0 on an H100 node
    calls = len([e for e in sim.trace.filter(rank=0).events if e.op != "compute"])
    print(f"{method}: {sent['forward']} B forward, {sent['backward']} B backward per rank; "
          f"{calls} calls, modelled {lane.communication * 1e6:.1f} us")

# %% [markdown]
# Forward, the ring sends what the all-gather sends: `P - 1` K/V blocks, `2 (P-1)` shards
# (6 here). Its advantage is memory (two K/V blocks at a time, the one being computed and the one
# in flight, instead of the whole sequence) and overlap: each transfer runs while a block is
# computed. Backward it sends K, V, dK and dV round the ring, plus one hop to bring the gradients
# home: 7168 B against the all-gather's 3072 B of reduce-scatter here, 2.33 times, not 2 (the
# extra hop). Ulysses sends `4 (P-1)/P` shards (3 here): fewer than 4 at any `P`, almost
# independent of it, and the fewest; but it needs `h >= P`. The modelled times (rank 0's communication lane, one H100
# node) are almost all latency at this tiny size: the all-gather's 4 calls win over the ring's
# 7 steps (each a send and a receive) and Ulysses' 8 all-to-alls. The ring's timeline shows
# each transfer beside a block of compute that is far too small to hide it:

# %% tags=["nbval-ignore-output"]
sim.run(ring_step, q, k, v, weights, True, "zigzag")
viz.timeline_figure(sim.trace, modelled=True, topology="h100-nvswitch")

# %% [markdown]
# Per step a rank computes `4 c^2 h d` flops on its `c` tokens but sends only `2 c h d` numbers:
# compute grows as `c^2`, the transfer as `c`. The cost model says where the transfer of one
# K/V block (bf16, `h d = 4096`) hides under one block of compute on an H100 node. The compute
# times assume the H100's peak dense bf16 rate, 989 TFLOP/s (the preset's `compute_flops`); real
# attention kernels reach a fraction of it, which makes compute longer and hiding easier:

# %% expect=["tokens per rank   1024: transfer 57.3 us, compute 17.4 us: exposed", "tokens per rank   4096: transfer 193.7 us, compute 277.9 us: hidden", "tokens per rank  16384: transfer 739.3 us, compute 4447.0 us: hidden"]
for tokens in (1024, 4096, 16384):
    transfer = cost.estimate("send_recv", 2 * tokens * 4096 * 2, 2, "h100-nvswitch").time
    compute = 4 * tokens * tokens * 4096 / cost.get_topology("h100-nvswitch").compute_flops
    print(f"tokens per rank {tokens:6}: transfer {transfer * 1e6:.1f} us, compute {compute * 1e6:.1f} us: "
          f"{'hidden' if transfer < compute else 'exposed'}")

# %% [markdown]
# ## Exercise 1: write the LSE merge
#
# Write `merge(out1, lse1, out2, lse2)` returning `(out, lse)`: attention over two disjoint key
# blocks from each block's output `(b, sq, h, d)` and log-sum-exp `(b, sq, h)`. It must also
# accept an empty first block (`out1 = 0`, `lse1 = -inf`), where the ring starts, and stay finite
# in float32 when the logits are large (an lse near 100: `exp(100)` does not fit in a float32).

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def merge(out1, lse1, out2, lse2):
    raise NotImplementedError   # your merge

print(check.check_lse_merge(merge))

# %% [markdown] expect=["Correct: 3 pairs of blocks merge to attention over both, large logits stay finite in float32, and an empty block changes nothing."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# def merge_solution(out1, lse1, out2, lse2):
#     lse = torch.logaddexp(lse1, lse2)                       # log(e^lse1 + e^lse2), safe with -inf
#     out = out1 * torch.exp(lse1 - lse)[..., None] + out2 * torch.exp(lse2 - lse)[..., None]
#     return out, lse
#
# print(check.check_lse_merge(merge_solution))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 2: zig-zag chunks
#
# Write `chunks(rank, world_size)`: the two of the `2 * world_size` sequence chunks that rank
# holds under zig-zag sharding, so that causal work is the same on every rank. (The checker
# judges the work per rank: any pairing that balances it is right.)

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def chunks(rank, world_size):
    raise NotImplementedError   # your two chunk indices

print(check.check_zigzag_chunks(chunks))

# %% [markdown] expect=["Correct: balanced chunks for 1 to 8 ranks: every rank does the same causal work, 2P + 1 blocks (zig-zag: one chunk from the head, one from the tail)."] tags=["solution"]
# <details><summary>Solution of exercise 2 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 2.
# def chunks_solution(rank, world_size):
#     return [rank, 2 * world_size - 1 - rank]     # chunk r has r + 1 causal key chunks, 2P-1-r has 2P - r
#
# print(check.check_zigzag_chunks(chunks_solution))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * Partial attentions merge exactly by their log-sum-exp: `lse = logaddexp(lse1, lse2)`, each
#   output weighed by `exp(lse_i - lse)`. That is all ring attention needs.
# * Ring attention moves K/V blocks, `P - 1` hops forward; backward the blocks go round again
#   with their dK/dV, and one more hop brings the gradients home. Output and gradients equal
#   single-device attention, causal or not.
# * Causal masking with contiguous shards makes rank `r` do `r + 1` blocks; zig-zag sharding
#   (chunks `r` and `2P-1-r`) gives every rank the same work.
# * Forward bytes equal all-gathering K/V, but only two blocks are held at a time (the one being
#   computed and the one in flight) and each transfer overlaps a block of compute, which hides it
#   once shards are long (`c^2` vs `c`).

# %%
world.close()
