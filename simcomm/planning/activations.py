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

The layer is :func:`simcomm.models.transformer.layer` (one device) and
:func:`~simcomm.models.transformer.tp_layer` (tensor + sequence parallel), the
family's recompute form: it saves exactly what the paper counts, with one
difference that :func:`expected_bytes` states (each LayerNorm's mean and
reciprocal standard deviation). This module counts: the formulas, the bytes
expected of the layer, the flops recomputation adds, and a measured run
(:func:`activation_run`, :func:`measure`).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import memory
from ..communicator import Communicator
from ..models.transformer import (DROPOUT, RECOMPUTE, assemble_layer_grads, causal_bias, check_recompute, layer,
                                  make_layer, shard_layer, tp_layer)

__all__ = ["formula_bytes", "expected_bytes", "layer_flops", "recompute_flops", "activation_run", "stack_loss",
           "assemble_grads", "measure"]

# -- the accounting ----------------------------------------------------------------------------

def formula_bytes(seq: int, batch: int, hidden: int, heads: int, tp: int = 1, recompute: str = "none") -> float:
    """Korthikanti et al.'s activation bytes per layer and rank (the table in the module docstring)."""
    check_recompute(recompute, "activations.formula_bytes")
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
    check_recompute(recompute, "activations.recompute_flops")
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
    whole world (``t = comm.world_size``; ``t = 1`` runs :func:`~simcomm.models.transformer.layer`
    itself), in ``dtype``.

    Memory: the layers' forward runs under the label ``"activations"``; marks
    ``"forward, layer i"`` after each layer, ``"after forward"``, and ``"backward, layer i"``
    as each layer's input gradient arrives. Compute is declared per layer (forward, backward
    = 2 x forward, recomputation before the backward). Returns this rank's ``loss`` part
    (float64) and its gradients (``grads[i][name]``, float64): the sequence-parallel shards
    of the replicated parameters' gradients are summed by :func:`assemble_grads`.
    """
    check_recompute(recompute, "activations.activation_run")
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
    """The full gradients of each layer from the ranks' :func:`activation_run` results
    (:func:`simcomm.models.transformer.assemble_layer_grads` of each layer)."""
    return [assemble_layer_grads([o["grads"][index] for o in outs], hidden) for index in range(len(outs[0]["grads"]))]


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
