"""Ring attention: exact attention over a sequence sharded across ranks (context parallelism).

Each rank holds a shard of the sequence, ``(b, s/P, h, d)`` for q, k and v.
Attention needs every key for every query, so the K/V shards travel around
the ring: at step ``t`` rank ``r`` attends its queries to the K/V shard of rank
``r - t`` while it already passes that shard on to ``r + 1``
(``batch_isend_irecv``), and merges the partial results with the
log-sum-exp rule of the online softmax (:func:`lse_merge`). After ``P``
steps every rank has the exact attention output of its queries.

Backward (``_RingAttention``): the K/V shards go around the ring once
more, each carrying the dK/dV accumulated for it so far; every rank adds its
queries' share, and after the last step one more hop brings each shard's
dK/dV home to the rank that owns it. dQ never leaves its rank.

Causal attention and load balance. With a causal mask a query attends only
to keys at or before it. Sharding the sequence into ``P`` consecutive blocks
(``layout="contiguous"``) leaves rank 0 with one block to compute and rank
``P-1`` with ``P``: the others wait. ``layout="zigzag"`` cuts the sequence
into ``2P`` chunks and gives rank ``r`` chunks ``r`` and ``2P-1-r`` (one from
the head, one from the tail), so every rank computes the same ``2P+1`` chunk
pairs. Each block is declared as ``comm.compute(flops=...)``: the trace
measures the work per rank, and the modelled timeline shows the ring's
transfers overlapping it.

The single-device reference is :func:`simcomm.parallel.sequence.attention`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..communicator import Communicator
from ..handles import P2POp
from ..trace import backward_phase

__all__ = ["LAYOUTS", "chunk_ids", "shard_sequence", "unshard_sequence", "block_attention", "lse_merge",
           "ring_attention", "all_gather_kv_attention"]

LAYOUTS = ("contiguous", "zigzag")


def _check_layout(op: str, layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: layout={layout!r} is not one of {list(LAYOUTS)}")


def chunk_ids(rank: int, world_size: int, layout: str = "contiguous") -> list[int]:
    """The sequence chunks rank ``rank`` holds, in order.

    ``"contiguous"``: ``[rank]`` of ``world_size`` chunks; ``"zigzag"``:
    ``[rank, 2 * world_size - 1 - rank]`` of ``2 * world_size`` chunks.
    """
    _check_layout("chunk_ids", layout)
    if layout == "contiguous":
        return [rank]
    return [rank, 2 * world_size - 1 - rank]


def _chunk_count(world_size: int, layout: str) -> int:
    return world_size if layout == "contiguous" else 2 * world_size


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, layout: str = "contiguous",
                   dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of the full-sequence ``x`` (a new tensor; ``x`` is not modified).

    Raises ``ValueError`` when ``x.shape[dim]`` does not split into the layout's chunks.
    """
    _check_layout("shard_sequence", layout)
    chunks = _chunk_count(world_size, layout)
    if x.shape[dim] % chunks:
        raise ValueError(f"shard_sequence: sequence length {x.shape[dim]} (dim {dim}) is not divisible "
                         f"by the {chunks} chunks of layout {layout!r} on {world_size} ranks")
    parts = x.chunk(chunks, dim=dim)
    return torch.cat([parts[i] for i in chunk_ids(rank, world_size, layout)], dim=dim)


def unshard_sequence(shards: Sequence[torch.Tensor], layout: str = "contiguous", dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard (the inverse of :func:`shard_sequence`)."""
    _check_layout("unshard_sequence", layout)
    world_size = len(shards)
    pieces: dict[int, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        ids = chunk_ids(rank, world_size, layout)
        for index, part in zip(ids, shard.chunk(len(ids), dim=dim)):
            pieces[index] = part
    return torch.cat([pieces[i] for i in range(_chunk_count(world_size, layout))], dim=dim)


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, diagonal: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the queries ``q (b, sq, h, d)`` over one block of keys ``k, v (b, sk, h, d)``.

    Returns ``(out (b, sq, h, d), lse (b, sq, h))``: the output normalised
    over this block only, and the log-sum-exp of the block's scores, which
    is what :func:`lse_merge` needs to combine blocks exactly.
    ``diagonal=True``: q and k are the same positions; apply the causal mask.
    """
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])  # (b, h, sq, sk)
    if diagonal:
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                   # (b, h, sq)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse.unsqueeze(-1)), v)  # (b, sq, h, d)
    return out, lse.transpose(1, 2)                                          # lse: (b, sq, h)


def lse_merge(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key blocks: the online-softmax step.

    ``out_i (b, sq, h, d)`` is normalised over block i, ``lse_i (b, sq, h)``
    its log-sum-exp. The result is attention over both blocks:
    ``lse = log(e^lse1 + e^lse2)``, ``out = e^(lse1-lse) out1 + e^(lse2-lse) out2``.
    ``lse1 = -inf`` (an empty block) gives ``(out2, lse2)``.
    """
    lse = torch.logaddexp(lse1, lse2)
    out = out1 * torch.exp(lse1 - lse).unsqueeze(-1) + out2 * torch.exp(lse2 - lse).unsqueeze(-1)
    return out, lse


def _pairs(q_ids: list[int], k_ids: list[int], causal: bool) -> list[tuple[int, int, bool]]:
    """(query chunk slot, key chunk slot, diagonal) for each chunk pair that has unmasked scores."""
    pairs = []
    for qi, q_chunk in enumerate(q_ids):
        for ki, k_chunk in enumerate(k_ids):
            if causal and k_chunk > q_chunk:
                continue                         # every key after every query: nothing to compute
            pairs.append((qi, ki, causal and k_chunk == q_chunk))
    return pairs


def _ring_exchange(comm: Communicator, tensor: torch.Tensor) -> list:
    """Issue: send ``tensor`` to the next rank, receive one like it from the previous rank."""
    nxt, prev = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    return comm.batch_isend_irecv([P2POp("isend", tensor, nxt),
                                   P2POp("irecv", (tuple(tensor.shape), tensor.dtype), prev)])


def _received(handles: list) -> torch.Tensor:
    handles[0].wait()
    return handles[1].wait()


def _flops(q: torch.Tensor, k_len: int) -> float:
    b, sq, h, d = q.shape
    return 4.0 * b * h * sq * k_len * d          # two matmuls of 2 * sq * sk * d each, per head


def _ring_forward(comm: Communicator, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    world_size, rank = comm.world_size, comm.rank
    q_ids = chunk_ids(rank, world_size, layout)
    q_parts = q.chunk(len(q_ids), dim=1)                                   # (b, c, h, d) each
    out = [torch.zeros_like(part) for part in q_parts]
    lse = [torch.full(part.shape[:3], float("-inf"), dtype=q.dtype, device=q.device) for part in q_parts]
    kv = torch.stack([k, v])                                               # (2, b, s/P, h, d)
    for step in range(world_size):
        pending = _ring_exchange(comm, kv) if step < world_size - 1 else None
        k_ids = chunk_ids((rank - step) % world_size, world_size, layout)
        k_parts, v_parts = kv[0].chunk(len(k_ids), dim=1), kv[1].chunk(len(k_ids), dim=1)
        flops = 0.0
        for qi, ki, diagonal in _pairs(q_ids, k_ids, causal):
            block_out, block_lse = block_attention(q_parts[qi], k_parts[ki], v_parts[ki], diagonal=diagonal)
            out[qi], lse[qi] = lse_merge(out[qi], lse[qi], block_out, block_lse)
            flops += _flops(q_parts[qi], k_parts[ki].shape[1])
        if flops:
            comm.compute(flops=flops)
        if pending is not None:
            kv = _received(pending)
    return torch.cat(out, dim=1), torch.cat(lse, dim=1)                    # (b, s/P, h, d), (b, s/P, h)


def _block_grads(q, k, v, out, lse, dout, diagonal):
    """dq, dk, dv of one block, from the final output and log-sum-exp of the queries."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale                 # (b, h, sq, sk)
    if diagonal:
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.exp(scores - lse.transpose(1, 2).unsqueeze(-1))           # (b, h, sq, sk)
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, dout)                       # (b, sk, h, d)
    dprobs = torch.einsum("bqhd,bkhd->bhqk", dout, v)                       # (b, h, sq, sk)
    delta = (dout * out).sum(-1).transpose(1, 2).unsqueeze(-1)              # (b, h, sq, 1)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", dscores, k)
    dk = torch.einsum("bhqk,bqhd->bkhd", dscores, q)
    return dq, dk, dv


def _ring_backward(comm: Communicator, q, k, v, out, lse, dout, causal: bool, layout: str):
    world_size, rank = comm.world_size, comm.rank
    q_ids = chunk_ids(rank, world_size, layout)
    n = len(q_ids)
    q_parts, out_parts, lse_parts, dout_parts = (t.chunk(n, dim=1) for t in (q, out, lse, dout))
    dq = [torch.zeros_like(part) for part in q_parts]
    travelling = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])  # (4, b, s/P, h, d): k, v, dk, dv
    for step in range(world_size):
        k_ids = chunk_ids((rank - step) % world_size, world_size, layout)
        k_parts, v_parts = travelling[0].chunk(n, dim=1), travelling[1].chunk(n, dim=1)
        dk = [torch.zeros_like(part) for part in k_parts]
        dv = [torch.zeros_like(part) for part in v_parts]
        flops = 0.0
        for qi, ki, diagonal in _pairs(q_ids, k_ids, causal):
            gq, gk, gv = _block_grads(q_parts[qi], k_parts[ki], v_parts[ki], out_parts[qi], lse_parts[qi],
                                      dout_parts[qi], diagonal)
            dq[qi] = dq[qi] + gq
            dk[ki], dv[ki] = dk[ki] + gk, dv[ki] + gv
            flops += 2 * _flops(q_parts[qi], k_parts[ki].shape[1])
        travelling = torch.cat([travelling[:2], (travelling[2:] + torch.stack([torch.cat(dk, 1), torch.cat(dv, 1)]))])
        if flops:
            comm.compute(flops=flops)
        if step < world_size - 1:
            travelling = _received(_ring_exchange(comm, travelling))   # k, v and their dK/dV move on
    grads = travelling[2:]                        # dK/dV of the shard of rank + 1: one more hop home
    if world_size > 1:
        grads = _received(_ring_exchange(comm, grads.contiguous()))
    return torch.cat(dq, dim=1), grads[0], grads[1]


class _RingAttention(torch.autograd.Function):
    """Forward: the K/V ring with online-softmax merging. Backward: the ring again, dK/dV riding
    along with their K/V shard and returned to its owner (the adjoint under the sum of the
    per-rank losses: each rank's output shard is its own part of the output)."""

    @staticmethod
    def forward(ctx, comm, causal, layout, q, k, v):
        out, lse = _ring_forward(comm, q, k, v, causal, layout)
        ctx.comm, ctx.causal, ctx.layout = comm, causal, layout
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with backward_phase():
            dq, dk, dv = _ring_backward(ctx.comm, q, k, v, out, lse, dout.contiguous(), ctx.causal, ctx.layout)
        return None, None, None, dq, dk, dv


def ring_attention(comm: Communicator, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   causal: bool = False, layout: str = "contiguous") -> torch.Tensor:
    """Exact attention of this rank's queries over the whole sequence; every arg a shard ``(b, s/P, h, d)``.

    The shards follow ``layout`` (:func:`shard_sequence`); the output is this
    rank's shard of the attention output in the same layout. Blocks while the
    ring runs (each transfer is issued before the block it overlaps and waited
    after it). Inputs are not modified. Gradients flow to q, k and v of every
    rank through the backward ring (see the module docstring).
    """
    _check_layout("ring_attention", layout)
    shapes = {tuple(t.shape) for t in (q, k, v)}
    if len(shapes) != 1 or q.dim() != 4:
        raise ValueError(f"ring_attention: rank {comm.rank} needs q, k, v of one 4-d shape (b, s/P, h, d), "
                         f"got {[tuple(t.shape) for t in (q, k, v)]}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"ring_attention: layout 'zigzag' needs an even shard length on rank {comm.rank} "
                         f"(two chunks), got {q.shape[1]}")
    return _RingAttention.apply(comm, causal, layout, q, k, v)


def all_gather_kv_attention(comm: Communicator, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                            causal: bool = False) -> torch.Tensor:
    """The simple alternative: all-gather K and V (contiguous shards), attend locally.

    Every rank then holds the whole K and V. Differentiable: the all-gather's
    backward reduce-scatters dK/dV back to their owners.
    """
    k_all, v_all = comm.all_gather(k, dim=1), comm.all_gather(v, dim=1)   # (b, s, h, d)
    shard = q.shape[1]
    outs, lses = [], []
    for block in range(comm.rank + 1 if causal else comm.world_size):
        keys = slice(block * shard, (block + 1) * shard)
        o, l = block_attention(q, k_all[:, keys], v_all[:, keys], diagonal=causal and block == comm.rank)
        outs.append(o)
        lses.append(l)
    lse = torch.logsumexp(torch.stack(lses), dim=0)                         # (b, s/P, h)
    return sum(o * torch.exp(l - lse).unsqueeze(-1) for o, l in zip(outs, lses))
