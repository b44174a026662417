"""One transformer block trained for a step with tensor x sequence x data x pipeline parallelism.

The block (pre-LayerNorm, causal attention, GELU MLP), on ``x (B, S, H)``::

    h   = x + (attention(LN1(x)) @ wo.T + bo)
    out = h + (gelu(LN2(h) @ w1.T + b1) @ w2.T + b2)
    loss = sum(out * weights)          # a sum over tokens: per-rank losses add up to it

A :class:`simcomm.parallel.mesh.Layout` ``Layout(pp=..., dp=..., tp=...)``
puts the ``pp * dp * tp`` ranks on the project's one mesh (pipeline outermost,
tensor-parallel ranks innermost, as ``init_device_mesh`` numbers them): global
rank ``(stage * dp + d) * tp + t``, ``layout.coordinates(rank) == (stage, d, t)``.
Each axis is a subgroup of the world (``comm.subgroup(layout.groups(dim))``):

* **tensor parallel + Megatron sequence parallelism** (``tp``): the residual
  stream is sharded by sequence, ``(b, S/tp, H)``; LayerNorm runs on the
  shard; an ``all_gather`` over the sequence (backward: reduce-scatter) feeds
  the column-parallel layer (wq/wk/wv: this rank's heads; w1/b1: its rows),
  and a ``reduce_scatter`` over the sequence (backward: all-gather) after the
  row-parallel layer (wo, w2: its columns) returns to sequence shards.
  LayerNorm weights and the output biases are replicated: each rank's
  gradient covers its sequence shard only, so they are all-reduced over
  the tp group.
* **data parallel** (``dp``): the batch is split; every gradient is
  all-reduced (summed) over the dp group, in one flat bucket.
* **pipeline parallel** (``pp`` = 1 or 2): with 2 stages, stage 0 holds the
  attention sublayer and stage 1 the MLP sublayer; ``h`` goes forward with
  ``send``/``recv`` and its gradient comes back the same way (one micro-batch:
  each stage waits while the other works, the pipeline bubble).

Each matmul is declared as ``comm.compute(flops=...)`` (backward as twice the
forward), so :func:`simcomm.model.cost.modelled_timeline` gives a step time per
topology. The single-device reference is :func:`block` / :func:`loss`.

This is the *checked* 3-D block of lesson 12: one block, float64, sequence
parallelism, pipeline stages at sublayer granularity, every value compared with
the single-device block. :mod:`simcomm.parallel.cluster_step` models something
else on the same mesh: a stack of whole blocks per stage, many micro-batches
(GPipe) and data-parallel all-reduces overlapping the backward, with random
bf16 weights and no reference, for shape-only runs at cluster scale.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import memory
from ..communicator import Communicator
from .mesh import Layout

__all__ = ["layouts", "make_block", "block", "loss", "SHARDING", "shard_block",
           "block_step", "assemble_grads"]


def layouts(world_size: int, max_pp: int = 2) -> list[Layout]:
    """Every ``Layout(pp=..., dp=..., tp=...)`` with ``pp * dp * tp == world_size`` and ``pp <= max_pp``
    (all three dims given, size 1 included), by ``pp``, then ``tp``."""
    return [Layout(pp=pp, dp=world_size // (tp * pp), tp=tp) for pp in range(1, max_pp + 1)
            if world_size % pp == 0 for tp in range(1, world_size // pp + 1) if (world_size // pp) % tp == 0]


def _layout(layout: object, op: str) -> Layout:
    if not isinstance(layout, Layout):
        raise TypeError(f"{op}: layout={layout!r} must be a simcomm.parallel.mesh.Layout with its sizes by name, "
                        "e.g. Layout(pp=2, dp=2, tp=2); a tuple's order is ambiguous")
    return layout


def _stage_d_t(rank: int, layout: Layout) -> tuple[int, int, int]:
    """``(stage, d, t)``: the pipeline, data and tensor coordinates of ``rank``."""
    return tuple(layout.coordinate(rank, dim) for dim in ("pp", "dp", "tp"))


def make_block(hidden: int, ffn: int, *, seed: int = 0, dtype: torch.dtype = torch.float64
               ) -> dict[str, torch.Tensor]:
    """Seeded parameters of one block (LayerNorm weights near 1, small biases)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=dtype) * scale

    h = hidden
    return {"ln1_w": 1 + randn(h, scale=0.1), "ln1_b": randn(h, scale=0.1),
            "wq": randn(h, h, scale=h ** -0.5), "wk": randn(h, h, scale=h ** -0.5),
            "wv": randn(h, h, scale=h ** -0.5), "wo": randn(h, h, scale=h ** -0.5), "bo": randn(h, scale=0.1),
            "ln2_w": 1 + randn(h, scale=0.1), "ln2_b": randn(h, scale=0.1),
            "w1": randn(ffn, h, scale=h ** -0.5), "b1": randn(ffn, scale=0.1),
            "w2": randn(h, ffn, scale=ffn ** -0.5), "b2": randn(h, scale=0.1)}


#: name -> (pipeline stage with pp=2, tensor-parallel shard dim or None for replicated)
SHARDING: dict[str, tuple[int, int | None]] = {
    "ln1_w": (0, None), "ln1_b": (0, None), "wq": (0, 0), "wk": (0, 0), "wv": (0, 0), "wo": (0, 1),
    "bo": (0, None), "ln2_w": (1, None), "ln2_b": (1, None), "w1": (1, 0), "b1": (1, 0), "w2": (1, 1),
    "b2": (1, None)}


def _heads_attention(y: torch.Tensor, wq, wk, wv, head_dim: int) -> torch.Tensor:
    """Causal attention of ``y (b, s, H)`` for the heads whose rows of wq/wk/wv are given."""
    b, s, _ = y.shape
    q, k, v = ((y @ w.T).view(b, s, -1, head_dim).transpose(1, 2) for w in (wq, wk, wv))  # (b, heads, s, hd)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)                              # (b, heads, s, s)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=y.device).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)                   # (b, s, heads*hd)


def _attention_sublayer(x, p, head_dim):
    y = F.layer_norm(x, x.shape[-1:], p["ln1_w"], p["ln1_b"])
    return x + _heads_attention(y, p["wq"], p["wk"], p["wv"], head_dim) @ p["wo"].T + p["bo"]


def _mlp_sublayer(h, p):
    y = F.layer_norm(h, h.shape[-1:], p["ln2_w"], p["ln2_b"])
    return h + F.gelu(y @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]


def block(x: torch.Tensor, params: dict[str, torch.Tensor], heads: int) -> torch.Tensor:
    """The single-device block on ``x (B, S, H)``."""
    head_dim = x.shape[-1] // heads
    return _mlp_sublayer(_attention_sublayer(x, params, head_dim), params)


def loss(x: torch.Tensor, weights: torch.Tensor, params: dict[str, torch.Tensor], heads: int) -> torch.Tensor:
    """The single-device loss ``sum(block(x) * weights)``."""
    return (block(x, params, heads) * weights).sum()


def _check_layout(layout: Layout, world_size: int, batch: int, seq: int, heads: int, ffn: int) -> None:
    problems = []
    if layout.world_size != world_size:
        problems.append(f"tp*dp*pp = {layout.world_size} is not the world size {world_size}")
    if layout.cp != 1:
        problems.append(f"cp={layout.cp}: this block has no context parallelism")
    if layout.pp not in (1, 2):
        problems.append(f"pp={layout.pp}: this block has 2 sublayers, so 1 or 2 stages")
    for name, size, by in (("batch", batch, layout.dp), ("seq", seq, layout.tp), ("heads", heads, layout.tp),
                           ("ffn", ffn, layout.tp)):
        if size % by:
            problems.append(f"{name}={size} is not divisible by {'dp' if name == 'batch' else 'tp'}={by}")
    if problems:
        raise ValueError(f"block_step: layout {layout!r} does not fit: " + "; ".join(problems))


def shard_block(params: dict[str, torch.Tensor], layout: Layout, rank: int) -> dict[str, torch.Tensor]:
    """The leaf parameters global rank ``rank`` holds (its stage's, its tensor-parallel shard)."""
    layout = _layout(layout, "shard_block")
    stage, _, t = _stage_d_t(rank, layout)
    shards = {}
    for name, (owner, dim) in SHARDING.items():
        if layout.pp == 2 and owner != stage:
            continue
        value = params[name] if dim is None else params[name].chunk(layout.tp, dim=dim)[t]
        shards[name] = value.clone().requires_grad_()
    return shards


def _sharded_attention(tp: Communicator, x, p, head_dim):
    """Attention sublayer on sequence shards ``x (b, S/tp, H)``; returns the same shape."""
    y = F.layer_norm(x, x.shape[-1:], p["ln1_w"], p["ln1_b"])           # (b, S/tp, H)
    y = tp.all_gather(y, dim=1)                                          # (b, S, H)
    heads_out = _heads_attention(y, p["wq"], p["wk"], p["wv"], head_dim)  # (b, S, H/tp): this rank's heads
    return x + tp.reduce_scatter(heads_out @ p["wo"].T, dim=1) + p["bo"]  # (b, S/tp, H)


def _sharded_mlp(tp: Communicator, h, p):
    y = tp.all_gather(F.layer_norm(h, h.shape[-1:], p["ln2_w"], p["ln2_b"]), dim=1)  # (b, S, H)
    partial = F.gelu(y @ p["w1"].T + p["b1"]) @ p["w2"].T                            # (b, S, H), a share
    return h + tp.reduce_scatter(partial, dim=1) + p["b2"]                           # (b, S/tp, H)


def _attention_flops(b, s, hidden, tp):
    return (4 * 2 * b * s * hidden * hidden + 4 * b * s * s * hidden) / tp   # q, k, v, o; scores and AV


def _mlp_flops(b, s, hidden, ffn, tp):
    return 2 * 2 * b * s * hidden * ffn / tp


def _sync(group: Communicator, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum ``grads`` over ``group`` in one flat bucket (one all-reduce)."""
    if not grads or group.world_size == 1:
        return grads
    total = group.all_reduce(torch.cat([g.flatten() for g in grads]))
    return [part.view_as(g) for part, g in zip(total.split([g.numel() for g in grads]), grads)]


def block_step(comm: Communicator, x: torch.Tensor, weights: torch.Tensor, params: dict[str, torch.Tensor],
               heads: int, layout: Layout) -> dict:
    """One training step's forward and backward of the block on this rank; gradients synchronised.

    ``x``, ``weights``: the full ``(B, S, H)`` input and loss weights (each rank
    takes its batch rows and sequence shard); ``params``: the full parameters
    (each rank clones its shards). Returns ``{"coords", "loss", "grads"}``:
    this rank's ``(stage, d, t)`` (``layout.coordinate`` along pp, dp, tp), its share of the loss (0 off the last
    stage) and the gradients of its shards after the tp and dp all-reduces.
    Collective over the whole group; inputs are not modified.
    """
    layout = _layout(layout, "block_step")
    batch, seq, hidden = x.shape
    ffn = params["w1"].shape[0]
    _check_layout(layout, comm.world_size, batch, seq, heads, ffn)
    stage, d, t = _stage_d_t(comm.rank, layout)
    tp = comm.subgroup(layout.groups("tp"))
    dp = comm.subgroup(layout.groups("dp"))
    with memory.label("parameters"):
        shards = shard_block(params, layout, comm.rank)
    b, s = batch // layout.dp, seq // layout.tp
    mine = (slice(d * b, (d + 1) * b), slice(t * s, (t + 1) * s))
    head_dim = hidden // heads
    fwd_attention, fwd_mlp = _attention_flops(b, seq, hidden, layout.tp), _mlp_flops(b, seq, hidden, ffn, layout.tp)
    partner = layout.rank(pp=1 - stage, dp=d, tp=t) if layout.pp == 2 else None   # the other stage
    result_loss = torch.zeros((), dtype=x.dtype, device=x.device)
    if layout.pp == 1 or stage == 0:
        h = _sharded_attention(tp, x[mine], shards, head_dim)                  # (b, S/tp, H)
        comm.compute(flops=fwd_attention)
    if layout.pp == 2 and stage == 0:
        comm.send(h.detach(), partner)
        grad_h = comm.recv(h.shape, h.dtype, partner)                          # dloss/dh from stage 1
        comm.compute(flops=2 * fwd_attention)
        h.backward(grad_h)
    else:
        if layout.pp == 2:
            h = comm.recv((b, s, hidden), x.dtype, partner).requires_grad_()
        out = _sharded_mlp(tp, h, shards)
        comm.compute(flops=fwd_mlp)
        part = (out * weights[mine]).sum()
        comm.compute(flops=2 * (fwd_mlp + (fwd_attention if layout.pp == 1 else 0)))
        part.backward()
        result_loss = part.detach()
        if layout.pp == 2:
            comm.send(h.grad, partner)
    names = list(shards)
    replicated = [n for n in names if SHARDING[n][1] is None]
    tp_synced = dict(zip(replicated, _sync(tp, [shards[n].grad for n in replicated])))
    grads = [tp_synced.get(n, shards[n].grad) for n in names]
    with memory.label("gradients"):
        grads = dict(zip(names, _sync(dp, grads)))
    return {"coords": (stage, d, t), "loss": result_loss, "grads": grads}


def assemble_grads(outs: list[dict], layout: Layout) -> dict[str, torch.Tensor]:
    """Full gradients from every rank's :func:`block_step` result (the ``d = 0`` replicas).

    Raises ``AssertionError`` when replicas that must agree (the dp copies of a
    shard, the tp copies of a replicated parameter) differ.
    """
    layout = _layout(layout, "assemble_grads")
    full = {}
    for name, (owner, dim) in SHARDING.items():
        stage = owner if layout.pp == 2 else 0
        pieces = []
        for t in range(layout.tp):
            copies = [outs[layout.rank(pp=stage, dp=d, tp=t)]["grads"][name] for d in range(layout.dp)]
            if any(not torch.allclose(c, copies[0], rtol=0, atol=1e-12) for c in copies):
                raise AssertionError(f"assemble_grads: the dp replicas of {name} (tp index {t}) differ")
            pieces.append(copies[0])
        if dim is None:
            if any(not torch.allclose(p, pieces[0], rtol=0, atol=1e-12) for p in pieces):
                raise AssertionError(f"assemble_grads: the tp replicas of {name} differ")
            full[name] = pieces[0]
        else:
            full[name] = torch.cat(pieces, dim=dim)
    return full
