"""Activation memory of a transformer layer, and what recomputation buys: Korthikanti et al. 2022.

"Reducing Activation Recomputation in Large Transformer Models" counts the
bytes a GPT layer keeps for its backward pass (16-bit activations, 1-byte
dropout masks), for sequence length ``s``, micro-batch ``b``, hidden size
``h``, ``a`` attention heads and ``t`` tensor-parallel ranks:

=====================================  ============================  ===========================
recomputation                          stored per layer (bytes)      what is kept
=====================================  ============================  ===========================
none, no parallelism                   ``sbh (34 + 5 a s / h)``      every saved tensor
none, tensor + sequence parallel       ``sbh (34 + 5 a s / h) / t``  each rank its shard
selective (attention core recomputed)  ``34 sbh / t``                all but the ``a s^2`` terms
full (whole layer recomputed)          ``2 sbh / t``                 the layer's input
=====================================  ============================  ===========================

:func:`layer` is that layer, written so that autograd saves exactly what the
paper counts: LayerNorm inputs (``4sbh``), the QKV input (``2sbh``), Q, K, V
(``6sbh``), the softmax output (``2as^2b``), its dropout mask (``as^2b``), the
dropped-out probabilities (``2as^2b``), the projection input (``2sbh``), the
two dropout masks after attention and MLP (``2sbh``), the MLP's first input
(``2sbh``), the GeLU input (``8sbh``) and the second input (``8sbh``). One
difference remains and :func:`expected_bytes` states it: each LayerNorm also
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
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .. import memory
from ..communicator import Communicator
from .tensor import join_grads, split_params

__all__ = ["RECOMPUTE", "make_layer", "shard_layer", "causal_bias", "dropout_mask", "layer", "tp_layer",
           "gather_linear", "formula_bytes", "expected_bytes", "layer_flops", "recompute_flops",
           "activation_run", "stack_loss", "assemble_grads", "measure", "REPLICATED", "DROPOUT"]

#: the recomputation modes
RECOMPUTE = ("none", "selective", "full")
#: dropout probability of the three dropouts (attention probabilities, after attention, after the MLP)
DROPOUT = 0.1
#: parameters every tensor-parallel rank holds whole (their gradients are summed over the ranks)
REPLICATED = ("ln1_w", "ln1_b", "proj_b", "ln2_w", "ln2_b", "fc2_b")


def _check_mode(recompute: str, where: str) -> None:
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
    _check_mode(recompute, "activations.layer")
    if recompute == "full":
        return checkpoint(_sublayers, x, params, heads, bias, seed, p, "none", None, use_reentrant=False)
    return _sublayers(x, params, heads, bias, seed, p, recompute, None)


def tp_layer(comm: Communicator, x: torch.Tensor, params: dict[str, torch.Tensor], heads: int,
             bias: torch.Tensor, *, seed: int = 0, p: float = DROPOUT, recompute: str = "none") -> torch.Tensor:
    """The same layer with tensor + sequence parallelism over ``comm``: ``x`` is this rank's
    sequence chunk ``(s/t, b, h)``, ``params`` its :func:`shard_layer`; returns ``(s/t, b, h)``.
    Collective over ``comm`` (forward, backward, and the recomputed forward)."""
    _check_mode(recompute, "activations.tp_layer")
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


# -- the accounting ----------------------------------------------------------------------------

def formula_bytes(seq: int, batch: int, hidden: int, heads: int, tp: int = 1, recompute: str = "none") -> float:
    """Korthikanti et al.'s activation bytes per layer and rank (the table in the module docstring)."""
    _check_mode(recompute, "activations.formula_bytes")
    sbh = seq * batch * hidden
    per_layer = {"none": sbh * (34 + 5 * heads * seq / hidden), "selective": 34 * sbh, "full": 2 * sbh}
    return per_layer[recompute] / tp


def expected_bytes(seq: int, batch: int, hidden: int, heads: int, tp: int = 1, recompute: str = "none",
                   itemsize: int = 2) -> float:
    """This layer's stored bytes per layer and rank: :func:`formula_bytes`, plus the LayerNorms'
    mean and rstd (``2 x 2 sb/t`` elements of ``itemsize`` bytes) unless the layer is recomputed;
    for ``itemsize`` other than 2 every 2-byte term scales with it (masks stay 1 byte)."""
    formula = formula_bytes(seq, batch, hidden, heads, tp, recompute)
    sb = seq * batch / tp
    masks = {"none": 2 * sb * hidden + heads * seq * sb * batch, "selective": 2 * sb * hidden, "full": 0}[recompute]
    stats = 0 if recompute == "full" else 4 * sb * itemsize
    return (formula - masks) * itemsize / 2 + masks + stats


def layer_flops(seq: int, batch: int, hidden: int, tp: int = 1) -> dict[str, float]:
    """Forward flops of one layer on one rank: the matmuls (``24 sbh^2``) and the attention core
    (``4 b s^2 h``: scores and probabilities times V), each ``/ t``."""
    return {"matmuls": 24 * seq * batch * hidden ** 2 / tp, "attention": 4 * batch * seq ** 2 * hidden / tp}


def recompute_flops(seq: int, batch: int, hidden: int, tp: int, recompute: str) -> float:
    """The extra forward flops recomputation adds per layer: none, the attention core, or the layer."""
    _check_mode(recompute, "activations.recompute_flops")
    flops = layer_flops(seq, batch, hidden, tp)
    return {"none": 0.0, "selective": flops["attention"], "full": flops["matmuls"] + flops["attention"]}[recompute]


# -- a measured run ----------------------------------------------------------------------------

def stack_loss(x: torch.Tensor, weights: torch.Tensor, stack: list[dict[str, torch.Tensor]], heads: int, *,
               recompute: str = "none", p: float = DROPOUT) -> torch.Tensor:
    """The single-device reference: ``sum(stack(x) * weights)`` for layers seeded 0, 1, ..."""
    bias = causal_bias(x.shape[0], x.dtype)
    for index, params in enumerate(stack):
        x = layer(x, params, heads, bias, seed=index, p=p, recompute=recompute)
    return (x * weights).sum()


def activation_run(comm: Communicator, x: torch.Tensor, weights: torch.Tensor,
                   stack: list[dict[str, torch.Tensor]], heads: int, recompute: str = "none",
                   p: float = DROPOUT, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Forward and backward of ``len(stack)`` layers with tensor + sequence parallelism over the
    whole world (``t = comm.world_size``; ``t = 1`` runs :func:`layer` itself), in ``dtype``.

    Memory: the layers' forward runs under the label ``"activations"``; marks
    ``"forward, layer i"`` after each layer, ``"after forward"``, and ``"backward, layer i"``
    as each layer's input gradient arrives. Compute is declared per layer (forward, backward
    = 2 x forward, recomputation before the backward). Returns this rank's ``loss`` part
    (float64) and its gradients (``grads[i][name]``, float64): the sequence-parallel shards
    of the replicated parameters' gradients are summed by :func:`assemble_grads`.
    """
    _check_mode(recompute, "activations.activation_run")
    tp, rank = comm.world_size, comm.rank
    s, b, h = x.shape
    with memory.label("inputs"):
        bias = causal_bias(s, dtype)
        shard = x.chunk(tp, 0)[rank].to(dtype)                                 # (s/t, b, h)
        mine = weights.chunk(tp, 0)[rank].to(dtype)
    leaves = [{name: shard_layer(params, rank, tp)[name].to(dtype).requires_grad_() for name in params}
              for params in stack] if tp > 1 else [{n: p_.to(dtype).requires_grad_() for n, p_ in params.items()}
                                                   for params in stack]
    flops = layer_flops(s, b, h, tp)
    forward = flops["matmuls"] + flops["attention"]
    extra = recompute_flops(s, b, h, tp, recompute)
    def arrived(index):
        def hook(grad):                           # layer ``index``'s backward (and recomputation) is done
            if extra:
                comm.compute(flops=extra)
            comm.compute(flops=2 * forward)
            memory.mark(f"backward, layer {index}")
            return grad
        return hook

    out = shard.requires_grad_()
    with memory.label("activations"):
        for index, params in enumerate(leaves):
            out.register_hook(arrived(index))     # no list of the inputs: backward may free them
            if tp == 1:
                out = layer(out, params, heads, bias, seed=index, p=p, recompute=recompute)
            else:
                out = tp_layer(comm, out, params, heads, bias, seed=index, p=p, recompute=recompute)
            comm.compute(flops=forward)
            memory.mark(f"forward, layer {index}")
    memory.mark("after forward")
    loss = (out * mine).sum()
    del out
    loss.backward()
    return {"loss": loss.detach().double(),
            "grads": [{name: q.grad.double() for name, q in params.items()} for params in leaves]}


def assemble_grads(outs: list[dict], hidden: int) -> list[dict[str, torch.Tensor]]:
    """The full gradients of each layer from the ranks' :func:`activation_run` results: shards
    put back in :func:`shard_layer`'s order, the :data:`REPLICATED` ones summed."""
    tp, h = len(outs), hidden
    layers = []
    for index in range(len(outs[0]["grads"])):
        parts = [{name: g.reshape(3, h // tp, *g.shape[1:]) if name in _QKV else g
                  for name, g in o["grads"][index].items()} for o in outs]
        full = join_grads(parts, _split_dim)
        layers.append({name: g.reshape(3 * h, *g.shape[2:]) if name in _QKV else g for name, g in full.items()})
    return layers


def measure(world, sizes: Sequence[tuple[int, int, int, int]], layers: int = 2, seed: int = 0) -> list[dict]:
    """Run :func:`activation_run` on ``world`` (a ``World`` or ``real.Cluster`` made with
    ``memory=True``; ``t`` = its world size) for each ``(s, b, h, heads)`` of ``sizes`` and each
    recomputation mode. One row each: ``size``, ``mode``, ``formula`` and ``expected`` bytes per
    layer and rank, ``measured`` (per rank: activation bytes after the forward / ``layers``) and
    the run's memory ``report``."""
    rows = []
    for size in sizes:
        s, b, h, heads = size
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(s, b, h, dtype=torch.float64, generator=gen)
        weights = torch.randn(s, b, h, dtype=torch.float64, generator=gen)
        stack = [make_layer(h, seed=seed + i) for i in range(layers)]
        for mode in RECOMPUTE:
            world.run(activation_run, x, weights, stack, heads, mode)
            if world.memory is None:
                raise ValueError("activations.measure: the backend tracks no memory; make it with memory=True")
            tp = len(world.memory)
            rows.append({"size": size, "mode": mode, "formula": formula_bytes(s, b, h, heads, tp, mode),
                         "expected": expected_bytes(s, b, h, heads, tp, mode),
                         "measured": [snap["activations"] / layers for snap in world.memory.at("after forward")],
                         "report": world.memory})
    return rows
