"""DTensor sharding of the CPU's flash attention, for virtual GPUs.

A virtual GPU computes with the CPU's kernels, so ``F.scaled_dot_product_attention`` of a
program written for GPUs runs ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its
backward) where a real GPU runs ``aten._scaled_dot_product_flash_attention``. DTensor has
sharding strategies for the CUDA op (replicated; sharded on the heads, ``Shard(1)``, as tensor
parallelism shards attention; sharded on the batch, ``Shard(0)``) and none for the CPU op, so a
tensor-parallel attention block that runs on GPUs stopped on virtual GPUs in its first forward.

:func:`install` registers, once per process, strategies of the same three kinds for the CPU
op and its backward with DTensor's own registration
(``ShardingPropagator.register_op_strategy``; simcomm.patches: "sdpa-cpu-sharding"). They
answer only on a rank thread with virtual GPUs (``World(map_cuda=True)``, ``python -m
simcomm.run`` without a GPU). Everywhere else (plain CPU virtual ranks, any other thread) they
raise the NotImplementedError DTensor raises for an op without a strategy, word for word, so a
program on CPU ranks fails as it does under torchrun with gloo. DTensor keeps its sharding
answers per thread, and rank threads are new in every run, so an answer given on virtual GPUs
is never reused elsewhere.

Differences from the CUDA op's strategies: the CPU op returns ``(output, logsumexp)`` only (no
sequence lengths, random state or debug mask), its backward takes six tensors
(``grad_out, query, key, value, out, logsumexp``), and it refuses ``dropout_p > 0`` itself.
An ``attn_mask`` given as a DTensor is not covered (the strategies take positional tensors
only): such a call raises a NotImplementedError naming the op and the argument.
"""
from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["install", "FORWARD", "BACKWARD"]

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

_lock = threading.Lock()
_installed = False


def _on_virtual_gpus() -> bool:
    from .cuda_map import on_virtual_gpu

    return on_virtual_gpu()


def _check(op_schema: Any) -> None:
    """Raise as DTensor does for an op without a strategy off virtual GPUs; refuse a DTensor mask."""
    from torch.distributed.tensor._op_schema import OpStrategy

    if not _on_virtual_gpus():
        raise NotImplementedError(f"Operator {op_schema.op} does not have a sharding strategy registered.")
    mask = op_schema.kwargs_schema.get("attn_mask")
    if isinstance(mask, OpStrategy):
        raise NotImplementedError(
            f"{op_schema.op}: attn_mask is a DTensor (placements {mask.strategies[0].output_spec.placements}); "
            "simcomm's sharding of the CPU's flash attention on virtual GPUs covers query, key and value only: "
            "pass the mask as part of is_causal, or call attention on local tensors (DTensor.to_local())")


def _forward_strategy(op_schema: Any) -> Any:
    """Placements as ``[output, logsumexp, query, key, value]`` on one mesh dim, expanded to the mesh."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    _check(op_schema)
    mesh = op_schema.get_mesh_from_args()
    per_dim = [[Replicate()] * 5,          # everything replicated
               [Shard(1)] * 5,             # heads sharded (tensor parallel): out (B,H,L,E), lse (B,H,L)
               [Shard(0)] * 5]             # batch sharded
    return expand_to_full_mesh_op_strategy(mesh, op_schema, per_dim, input_index=2)


def _backward_strategy(op_schema: Any) -> Any:
    """Placements as ``[grad_q, grad_k, grad_v, grad_out, query, key, value, out, logsumexp]``."""
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    _check(op_schema)
    mesh = op_schema.get_mesh_from_args(validate=False)
    per_dim = [[Replicate()] * 9, [Shard(1)] * 9, [Shard(0)] * 9]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, per_dim, input_index=3)


def install() -> None:
    """Register the strategies with DTensor's sharding propagator, once per process (module
    docstring). A strategy for these ops that is already registered (a later torch's own) is kept."""
    global _installed
    with _lock:
        if _installed:
            return
        from torch.distributed.tensor import DTensor

        propagator = DTensor._op_dispatcher.sharding_propagator
        for op, strategy in ((FORWARD, _forward_strategy), (BACKWARD, _backward_strategy)):
            if op not in propagator.op_strategy_funcs and op not in propagator.op_single_dim_strategy_funcs:
                propagator.register_op_strategy(op, strategy)
        _installed = True
