"""The project's transformer block family: one GPT-style block (pre-LayerNorm, causal attention, GELU
MLP), in the three forms the lessons and the planners need. They compute differently on purpose
(their numbers are what the lessons and tests check), so each is an option of this family,
not a copy:

==========================  ===============================================================================
form                        what it is for
==========================  ===============================================================================
checked (:func:`block`)     lesson 12: one block in float64, tensor + sequence x data x pipeline
                            parallel (:func:`block_step`), every value compared with one device;
                            separate ``wq, wk, wv``, biases, attention written out
recompute (:func:`layer`)   lesson 13: Korthikanti et al.'s GPT layer, ``(s, b, h)``, fused QKV, three
                            dropouts, written so autograd saves exactly what the paper counts;
                            tensor + sequence parallel (:func:`tp_layer`) with recomputation
                            (``"none"``, ``"selective"``, ``"full"``); its accounting is
                            :mod:`simcomm.planning.activations`
cluster (:func:`tp_block`)  lesson 15: :class:`Block` sizes, bias-free, ``scaled_dot_product_attention``,
                            Megatron tensor parallelism without sequence parallelism, random bf16 weights
                            and no reference: the trace and memory at cluster scale
                            (:mod:`simcomm.planning.cluster_step`)
==========================  ===============================================================================

**The checked block.**
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
the single-device block. :mod:`simcomm.planning.cluster_step` steps the
cluster form on the same mesh: a stack of whole blocks per stage, many
micro-batches (GPipe) and data-parallel all-reduces overlapping the backward.

**The recompute layer.**
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models") count the bytes a GPT layer keeps for its backward pass
(:mod:`simcomm.planning.activations` has their table).
:func:`layer` is that layer, written so that autograd saves exactly what the
paper counts: LayerNorm inputs (``4sbh``), the QKV input (``2sbh``), Q, K, V
(``6sbh``), the softmax output (``2as^2b``), its dropout mask (``as^2b``), the
dropped-out probabilities (``2as^2b``), the projection input (``2sbh``), the
two dropout masks after attention and MLP (``2sbh``), the MLP's first input
(``2sbh``), the GeLU input (``8sbh``) and the second input (``8sbh``). One
difference remains and :func:`simcomm.planning.activations.expected_bytes` states it: each LayerNorm also
keeps its mean and reciprocal standard deviation, ``2 sb`` elements (in the
activation dtype on the CPU), that is ``8sb`` bytes per layer in bf16, which
the paper drops as small. The causal mask is an additive ``(s, s)`` bias made
once per run (:func:`causal_bias`), so it is not a per-layer activation.

Tensor + sequence parallelism (:func:`tp_layer`) is Megatron's: between the
sublayers the activations are sharded by sequence; a sublayer's first linear
all-gathers its input and keeps only the *shard* for backward, gathering it
again there (:func:`gather_linear`), so every stored tensor is ``1/t``. Dropout
masks come from a counter-based generator keyed by layer and tensor
(:func:`dropout_mask`): the same mask on one device, on every rank's shard, and
when the layer is recomputed.

Recomputation is ``torch.utils.checkpoint(..., use_reentrant=False)`` around
the attention core (``"selective"``) or the whole layer (``"full"``).
The layers declare their flops (``comm.compute``) so a modelled timeline shows
what the recomputation costs: full recomputation runs the forward twice,
``4/3`` of the compute of forward + backward (backward = 2 x forward).

**The cluster block.**
:func:`tp_block` is one pre-norm block of :class:`Block`'s sizes, tensor-parallel
over a group (Megatron: heads and MLP units split, the input ``copy_to_group``-ed,
the attention projection and the second MLP layer ending in ``reduce_from_group``);
:func:`block_parameters` draws one rank's random shards, :func:`block_flops` its
forward flops.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import memory
from ..communicator import Communicator
from ..parallel.mesh import Layout
from ..parallel.tensor import join_grads, split_params

__all__ = ["layouts", "make_block", "block", "loss", "SHARDING", "shard_block",
           "block_step", "assemble_grads",
           "RECOMPUTE", "DROPOUT", "REPLICATED", "check_recompute", "make_layer", "shard_layer", "causal_bias",
           "dropout_mask", "layer", "tp_layer", "gather_linear", "assemble_layer_grads",
           "Block", "block_parameters", "tp_block", "block_flops"]


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
    part = _run_stages(comm, tp, stage, partner, x[mine], weights[mine], shards, head_dim, (fwd_attention, fwd_mlp))
    return {"coords": (stage, d, t), "loss": part, "grads": _sync_grads(tp, dp, shards)}


def _run_stages(comm: Communicator, tp: Communicator, stage: int, partner: int | None, x, weights, shards,
                head_dim: int, flops: tuple[float, float]) -> torch.Tensor:
    """This rank's stage of :func:`block_step`, forward and backward (``partner``: the other stage's rank,
    ``None`` with one stage); its share of the loss, 0 on stage 0 of two. The stage's activations are
    freed when it returns, before the gradients are synchronised."""
    fwd_attention, fwd_mlp = flops
    if partner is None or stage == 0:
        h = _sharded_attention(tp, x, shards, head_dim)                        # (b, S/tp, H)
        comm.compute(flops=fwd_attention)
    if partner is not None and stage == 0:
        comm.send(h.detach(), partner)
        grad_h = comm.recv(h.shape, h.dtype, partner)                          # dloss/dh from stage 1
        comm.compute(flops=2 * fwd_attention)
        h.backward(grad_h)
        return torch.zeros((), dtype=x.dtype, device=x.device)
    if partner is not None:
        h = comm.recv(x.shape, x.dtype, partner).requires_grad_()
    out = _sharded_mlp(tp, h, shards)
    comm.compute(flops=fwd_mlp)
    part = (out * weights).sum()
    comm.compute(flops=2 * (fwd_mlp + (fwd_attention if partner is None else 0)))
    part.backward()
    if partner is not None:
        comm.send(h.grad, partner)
    return part.detach()


def _sync_grads(tp: Communicator, dp: Communicator, shards: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The shards' gradients summed over tp (the replicated parameters) and then over dp (all)."""
    names = list(shards)
    replicated = [n for n in names if SHARDING[n][1] is None]
    tp_synced = dict(zip(replicated, _sync(tp, [shards[n].grad for n in replicated])))
    grads = [tp_synced.get(n, shards[n].grad) for n in names]
    with memory.label("gradients"):
        return dict(zip(names, _sync(dp, grads)))


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


# -- the recompute layer (lesson 13) ----------------------------------------------------------------------

#: the recomputation modes
RECOMPUTE = ("none", "selective", "full")
#: dropout probability of the three dropouts (attention probabilities, after attention, after the MLP)
DROPOUT = 0.1
#: parameters every tensor-parallel rank holds whole (their gradients are summed over the ranks)
REPLICATED = ("ln1_w", "ln1_b", "proj_b", "ln2_w", "ln2_b", "fc2_b")


def check_recompute(recompute: str, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``recompute`` is one of :data:`RECOMPUTE`."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"{where}: recompute={recompute!r} must be one of {list(RECOMPUTE)}")


def make_layer(hidden: int, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """The parameters of one GPT layer (LayerNorms, QKV, projection, 4h MLP), from a generator of their own."""
    gen = torch.Generator().manual_seed(seed)
    h = hidden
    randn = lambda *shape, scale: (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale)  # noqa: E731
    params = {"ln1_w": 1 + randn(h, scale=0.1), "ln1_b": randn(h, scale=0.1),
              "qkv_w": randn(3 * h, h, scale=h ** -0.5), "qkv_b": randn(3 * h, scale=0.1),
              "proj_w": randn(h, h, scale=h ** -0.5), "proj_b": randn(h, scale=0.1),
              "ln2_w": 1 + randn(h, scale=0.1), "ln2_b": randn(h, scale=0.1),
              "fc1_w": randn(4 * h, h, scale=h ** -0.5), "fc1_b": randn(4 * h, scale=0.1),
              "fc2_w": randn(h, 4 * h, scale=(4 * h) ** -0.5), "fc2_b": randn(h, scale=0.1)}
    return {name: p.to(dtype) for name, p in params.items()}


def shard_layer(params: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensor-parallel shard: QKV and ``fc1`` by output rows (whole heads: the
    QKV weight is ``(3, heads, d)`` rows, each of Q, K, V split alike), ``proj`` and ``fc2`` by
    input columns; the :data:`REPLICATED` ones whole. Copies (no views of ``params``)."""
    h = params["proj_w"].shape[0]
    by_part = {name: p.reshape(3, h, *p.shape[1:]) if name in _QKV else p for name, p in params.items()}
    out = split_params(by_part, rank, tp, _split_dim)
    return {name: p.reshape(3 * h // tp, *p.shape[2:]) if name in _QKV else p for name, p in out.items()}


_QKV = ("qkv_w", "qkv_b")


def _split_dim(name: str) -> int | None:
    """The dimension :func:`shard_layer` splits ``name`` along (QKV's seen as ``(3, h, ...)``)."""
    if name in REPLICATED:
        return None
    return 0 if name in ("fc1_w", "fc1_b") else 1


def causal_bias(seq: int, dtype: torch.dtype) -> torch.Tensor:
    """``(s, s)``: 0 on and below the diagonal, ``-inf`` above (added to the attention scores)."""
    return torch.full((seq, seq), float("-inf"), dtype=dtype).triu(1)


def dropout_mask(shape: Sequence[int], seed: int, p: float = DROPOUT) -> torch.Tensor:
    """A bool keep-mask of ``shape`` (1 byte an element), ``P(keep) = 1 - p``, the same for a seed
    wherever it is drawn (its own generator)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(tuple(shape), generator=gen) >= p


def _dropout(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    return x * keep * (1 / (1 - p))          # autograd keeps only ``keep`` (bool) for the backward


def _attention_core(q, k, v, bias, seed, heads, rank, p):
    """Scores, softmax, dropout, times V; ``q, k, v`` are this rank's heads ``(b, a/t, s, d)``.
    The dropout mask is drawn here, so a recomputation draws it again instead of keeping it."""
    b, local_heads, s, _ = q.shape
    keep = dropout_mask((b, heads, s, s), seed * 3 + 1, p)[:, rank * local_heads:(rank + 1) * local_heads].clone()
    scores = torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5) + bias   # (b, heads, s, s)
    probs = torch.softmax(scores, dim=-1)                                          # saved: 2 a s^2 b
    return torch.matmul(_dropout(probs, keep, p), v)                               # (b, heads, s, d)


def _masks(seed: int, s: int, b: int, h: int, tp: int, rank: int, p: float):
    """The dropout masks after attention and after the MLP, this rank's sequence chunk."""
    after_attn = dropout_mask((s, b, h), seed * 3 + 2, p).chunk(tp, 0)[rank]
    after_mlp = dropout_mask((s, b, h), seed * 3 + 3, p).chunk(tp, 0)[rank]
    return after_attn.clone(), after_mlp.clone()   # clones: no view keeps the whole mask


def _sublayers(x, params, heads, bias, seed, p, recompute, tp_comm):
    """The layer on ``x`` ``(s/t, b, h)``; ``tp_comm`` None means one device (t = 1)."""
    tp = 1 if tp_comm is None else tp_comm.world_size
    rank = 0 if tp_comm is None else tp_comm.rank
    s, b, h = x.shape[0] * tp, x.shape[1], x.shape[2]
    local_heads, d = heads // tp, h // heads
    keep_attn_out, keep_mlp_out = _masks(seed, s, b, h, tp, rank, p)
    y = F.layer_norm(x, (h,), params["ln1_w"], params["ln1_b"])                        # (s/t, b, h)
    if tp_comm is None:
        qkv = F.linear(y, params["qkv_w"], params["qkv_b"])                            # (s, b, 3h)
    else:
        qkv = gather_linear(tp_comm, y, params["qkv_w"], params["qkv_b"])              # (s, b, 3h/t)
    q, k, v = qkv.view(s, b, 3, local_heads, d).permute(2, 1, 3, 0, 4).unbind(0)     # each (b, a/t, s, d)
    if recompute == "selective":
        core = checkpoint(_attention_core, q, k, v, bias, seed, heads, rank, p, use_reentrant=False)
    else:
        core = _attention_core(q, k, v, bias, seed, heads, rank, p)
    core = core.permute(2, 0, 1, 3).reshape(s, b, local_heads * d)                    # (s, b, h/t)
    out = F.linear(core, params["proj_w"])                                             # (s, b, h) partial sums
    if tp_comm is not None:
        out = tp_comm.reduce_scatter(out, dim=0)                                       # (s/t, b, h)
    x = x + _dropout(out + params["proj_b"], keep_attn_out, p)
    y = F.layer_norm(x, (h,), params["ln2_w"], params["ln2_b"])                        # (s/t, b, h)
    if tp_comm is None:
        y = F.linear(y, params["fc1_w"], params["fc1_b"])                              # (s, b, 4h)
    else:
        y = gather_linear(tp_comm, y, params["fc1_w"], params["fc1_b"])                # (s, b, 4h/t)
    y = F.linear(F.gelu(y), params["fc2_w"])                                           # (s, b, h) partial sums
    if tp_comm is not None:
        y = tp_comm.reduce_scatter(y, dim=0)                                           # (s/t, b, h)
    return x + _dropout(y + params["fc2_b"], keep_mlp_out, p)


def layer(x: torch.Tensor, params: dict[str, torch.Tensor], heads: int, bias: torch.Tensor, *, seed: int = 0,
          p: float = DROPOUT, recompute: str = "none") -> torch.Tensor:
    """One GPT layer on one device: ``x`` ``(s, b, h)`` -> ``(s, b, h)`` (module docstring).

    ``seed`` picks the dropout masks; ``bias`` is :func:`causal_bias`. ``x`` is not modified."""
    check_recompute(recompute, "activations.layer")
    if recompute == "full":
        return checkpoint(_sublayers, x, params, heads, bias, seed, p, "none", None, use_reentrant=False)
    return _sublayers(x, params, heads, bias, seed, p, recompute, None)


def tp_layer(comm: Communicator, x: torch.Tensor, params: dict[str, torch.Tensor], heads: int,
             bias: torch.Tensor, *, seed: int = 0, p: float = DROPOUT, recompute: str = "none") -> torch.Tensor:
    """The same layer with tensor + sequence parallelism over ``comm``: ``x`` is this rank's
    sequence chunk ``(s/t, b, h)``, ``params`` its :func:`shard_layer`; returns ``(s/t, b, h)``.
    Collective over ``comm`` (forward, backward, and the recomputed forward)."""
    check_recompute(recompute, "activations.tp_layer")
    if heads % comm.world_size:
        raise ValueError(f"activations.tp_layer: rank {comm.rank}: heads={heads} must divide by "
                         f"tp={comm.world_size}")
    if recompute == "full":
        return checkpoint(_sublayers, x, params, heads, bias, seed, p, "none", comm, use_reentrant=False)
    return _sublayers(x, params, heads, bias, seed, p, recompute, comm)


class _GatherLinear(torch.autograd.Function):
    """All-gather along the sequence, then a linear; keeps only the shard for backward."""

    @staticmethod
    def forward(ctx, comm, shard, weight, bias):
        ctx.comm = comm
        ctx.save_for_backward(shard, weight)
        full = comm.all_gather(shard, dim=0)                          # (s, b, h)
        return F.linear(full, weight, bias)                           # (s, b, out/t)

    @staticmethod
    def backward(ctx, grad_out):
        shard, weight = ctx.saved_tensors
        comm = ctx.comm
        full = comm.all_gather(shard, dim=0)                          # gathered again: (s, b, h)
        grad_full = grad_out @ weight                                 # (s, b, h), this rank's heads' part
        grad_shard = comm.reduce_scatter(grad_full, dim=0)            # (s/t, b, h), summed over the ranks
        grad_weight = grad_out.flatten(0, 1).T @ full.flatten(0, 1)   # (out/t, h)
        return None, grad_shard, grad_weight, grad_out.sum((0, 1))


def gather_linear(comm: Communicator, shard: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
                  ) -> torch.Tensor:
    """Megatron's sequence-parallel column linear: ``linear(all_gather(shard, dim=0), weight, bias)``.

    Backward all-gathers the shard again (it is all autograd keeps) and reduce-scatters the
    input gradient. Collective over ``comm`` in forward and backward; ``shard`` is not modified."""
    return _GatherLinear.apply(comm, shard, weight, bias)


def assemble_layer_grads(grads: list[dict[str, torch.Tensor]], hidden: int) -> dict[str, torch.Tensor]:
    """One layer's full gradients from each rank's shard gradients (in rank order): shards put back
    in :func:`shard_layer`'s order, the :data:`REPLICATED` ones summed."""
    tp, h = len(grads), hidden
    parts = [{name: g.reshape(3, h // tp, *g.shape[1:]) if name in _QKV else g for name, g in ranks.items()}
             for ranks in grads]
    full = join_grads(parts, _split_dim)
    return {name: g.reshape(3 * h, *g.shape[2:]) if name in _QKV else g for name, g in full.items()}


# -- the cluster block (lesson 15) ------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    """Sizes of the model and the batch: GPT-2 medium's block by default."""

    hidden: int = 1024
    heads: int = 16
    seq: int = 1024
    micro_batch: int = 1
    micro_batches: int = 1
    layers: int = 1                # blocks per pipeline stage
    dtype: torch.dtype = torch.bfloat16


def block_parameters(block: Block, tp: int) -> dict[str, torch.Tensor]:
    """This tensor-parallel rank's parameters of one block (random, ``0.02`` scale, ``block.dtype``, leaves)."""
    h, ffn = block.hidden, 4 * block.hidden
    scale = 0.02
    shapes = {"ln1": (h,), "qkv": (3 * h // tp, h), "proj": (h, h // tp),
              "ln2": (h,), "fc1": (ffn // tp, h), "fc2": (h, ffn // tp)}
    return {name: (torch.randn(shape, dtype=block.dtype) * scale).requires_grad_()
            for name, shape in shapes.items()}


def tp_block(tensor: Communicator, x: torch.Tensor, params: dict[str, torch.Tensor], block: Block
           ) -> torch.Tensor:
    """One pre-norm transformer block, tensor-parallel over ``tensor``; ``x`` is ``(b, s, h)``."""
    b, s, h = x.shape
    heads = block.heads // tensor.world_size
    head_dim = h // block.heads
    y = tensor.copy_to_group(F.layer_norm(x, (h,), params["ln1"]))
    qkv = (y @ params["qkv"].T).view(b, s, 3, heads, head_dim)          # (b, s, 3, heads/tp, d)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)                        # each (b, heads/tp, s, d)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)      # (b, heads/tp, s, d)
    attn = attn.transpose(1, 2).reshape(b, s, heads * head_dim)         # (b, s, h/tp)
    x = x + tensor.reduce_from_group(attn @ params["proj"].T)           # (b, s, h)
    y = tensor.copy_to_group(F.layer_norm(x, (h,), params["ln2"]))
    y = F.gelu(y @ params["fc1"].T)                                      # (b, s, 4h/tp)
    return x + tensor.reduce_from_group(y @ params["fc2"].T)            # (b, s, h)


def block_flops(block: Block, tp: int) -> float:
    """Forward flops of one block on one tensor-parallel rank for one micro-batch."""
    tokens, h = block.micro_batch * block.seq, block.hidden
    matmuls = 2 * tokens * (3 * h * h + h * h + 8 * h * h) / tp
    attention = 4 * block.micro_batch * block.seq ** 2 * h / tp
    return matmuls + attention
