"""The math of every collective, written once: a list of per-rank tensors in, a list out.

These functions know nothing of threads or processes. ``inputs[r]`` is what
rank ``r`` passes to the collective, and the result's entry ``r`` is what rank
``r`` gets back. The simulator calls them at its rendezvous (its reductions in
gloo's order, below); figures and tests call them directly. They are ordinary differentiable torch code, so on one
device they are also the reference that the distributed backward rules are
checked against.

Entries of a result may be the *same* tensor object (every rank of an
all-reduce holds equal values); a transport hands each rank a private copy.
No function modifies its inputs, and no output is a view of an input.

Reductions keep the input dtype, as ``torch.distributed`` does: integer sums
and products wrap around (int8 ``100 + 100`` is ``-56``), and on ``bool``
SUM is a logical or, PRODUCT a logical and.

``PREMUL_SUM`` (``ReduceOp.PREMUL_SUM(factor)``) is NCCL's "multiply, then
sum": each rank multiplies its own input by its own factor, locally, in the
input's dtype (:func:`premultiply`), and the products are summed. The reducing
functions take the ranks' factors as ``factors`` (one per rank); the
transports premultiply on each rank and send the products with SUM.

Floating-point sums and products round, so their value depends on the order in
which the ranks' tensors are combined. The reductions here are plain stacked
ones (``torch.stack(inputs).sum(0)``: torch's own order), the reference that
lessons and tests read. The simulator's transport reduces in the order of
gloo's ring algorithms instead (:mod:`simcomm.sim.ring_order`), so that virtual
ranks get, bit for bit, what gloo processes get; the two agree up to rounding,
and exactly for integers, bools, MAX and MIN.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch.distributed import ReduceOp

from .checks import (BITWISE_OPS, PREMUL_SUM, check_avg_dtype, check_bitwise_dtype, check_premul_factor, check_same,
                     check_splits, reduce_op_name)

__all__ = [
    "reduce", "all_reduce", "all_gather", "reduce_scatter", "scatter", "all_to_all", "gather", "broadcast",
    "reduce_to", "scatter_from", "all_to_all_single", "premultiply", "on_the_wire",
]

_NEEDS_FLOAT = ("avg", PREMUL_SUM)   # reductions check_avg_dtype refuses for integer dtypes
_BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


def premultiply(tensor: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """One rank's side of PREMUL_SUM: ``tensor * factor``, a new tensor of ``tensor``'s dtype.

    As NCCL does, the factor is first cast to the input's dtype (its real dtype
    for a complex input: NCCL reduces a complex tensor as its real view), then
    multiplied elementwise. A tensor factor keeps its autograd graph.
    """
    real_dtype = tensor.real.dtype if tensor.is_complex() else tensor.dtype
    if isinstance(factor, torch.Tensor):
        scale = factor.reshape(()).to(device=tensor.device, dtype=real_dtype)
    else:
        scale = torch.tensor(factor, dtype=real_dtype, device=tensor.device)
    return tensor * scale


def on_the_wire(tensor: torch.Tensor, op: str, factor: float | torch.Tensor | None
                ) -> tuple[torch.Tensor, str]:
    """What one rank sends for the reduction ``op`` (a canonical name): for PREMUL_SUM its
    input premultiplied by its own ``factor`` and ``"sum"`` (both transports reduce PREMUL_SUM
    so: the factor is local to each rank, as in NCCL); otherwise ``(tensor, op)`` unchanged."""
    if op == PREMUL_SUM:
        if factor is None:
            raise ValueError("premul_sum: a transport got PREMUL_SUM without its factor")
        return premultiply(tensor, factor), "sum"
    return tensor, op


def _factors(name: str, inputs: Sequence[torch.Tensor], factors: Sequence | None) -> list | None:
    if name != PREMUL_SUM:
        if factors is not None:
            raise ValueError(f"reduce: factors={_repr(factors)} are only for PREMUL_SUM, not {name}")
        return None
    if factors is None or len(factors) != len(inputs):
        raise ValueError(f"reduce: PREMUL_SUM needs factors, one per rank ({len(inputs)}), got "
                         f"{_repr(factors)}")
    return [check_premul_factor("reduce", factor, rank, inputs[rank]) for rank, factor in enumerate(factors)]


def _repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def reduce(inputs: Sequence[torch.Tensor], op: ReduceOp | str = "sum", factors: Sequence | None = None
           ) -> torch.Tensor:
    """Elementwise reduction of the ranks' tensors: one new tensor of the common shape and dtype.

    ``factors``: for PREMUL_SUM only, rank ``r``'s factor at ``factors[r]``; the
    result is ``sum_r premultiply(inputs[r], factors[r])``.
    """
    name = reduce_op_name(op)
    if name in _NEEDS_FLOAT:
        check_avg_dtype("reduce", inputs[0], name)
    if name in BITWISE_OPS:
        check_bitwise_dtype("reduce", inputs[0], name)
        return functools.reduce(_BITWISE[name], inputs[1:], inputs[0].clone())
    if factors is not None or name == PREMUL_SUM:
        factors = _factors(name, inputs, factors)
        return reduce([premultiply(tensor, factor) for tensor, factor in zip(inputs, factors)], "sum")
    if len(inputs) == 1:
        return inputs[0].clone()
    stacked = torch.stack(list(inputs))  # (world, *shape)
    if name == "avg":
        return stacked.mean(0)
    if name in ("max", "min"):
        return stacked.amax(0) if name == "max" else stacked.amin(0)
    out = stacked.sum(0) if name == "sum" else stacked.prod(0)
    # integer and bool sums and products promote to int64: back to the input dtype, wrapping
    # as a fixed-width integer does (bool: nonzero count -> or, nonzero product -> and)
    return out if out.dtype == stacked.dtype else out.to(stacked.dtype)


def all_reduce(inputs: Sequence[torch.Tensor], op: ReduceOp | str = "sum", factors: Sequence | None = None
               ) -> list[torch.Tensor]:
    """Every rank gets the reduction of all ranks' tensors (``factors``: as :func:`reduce`)."""
    check_same("all_reduce", inputs)
    return [reduce(inputs, op, factors)] * len(inputs)


def all_gather(inputs: Sequence[torch.Tensor], dim: int = -1) -> list[torch.Tensor]:
    """Every rank gets the ranks' tensors concatenated along ``dim`` in rank order."""
    check_same("all_gather", inputs)
    return [torch.cat(list(inputs), dim)] * len(inputs)


def scatter(tensor: torch.Tensor, world_size: int, dim: int = -1) -> list[torch.Tensor]:
    """Chunk ``r`` of ``tensor`` along ``dim`` for each rank ``r`` (the forward of ``slice``)."""
    if tensor.shape[dim] % world_size:
        raise ValueError(
            f"scatter: size {tensor.shape[dim]} of dim={dim} is not divisible by the world size {world_size}")
    shard = tensor.shape[dim] // world_size
    # narrow, not split: a zero-size shard is fine; clone: no chunk is a view of the input
    return [tensor.narrow(dim, rank * shard, shard).clone(memory_format=torch.contiguous_format)
            for rank in range(world_size)]


def reduce_scatter(inputs: Sequence[torch.Tensor], dim: int = -1, op: ReduceOp | str = "sum",
                   factors: Sequence | None = None) -> list[torch.Tensor]:
    """Reduce the ranks' tensors, then rank ``r`` keeps chunk ``r`` along ``dim``
    (``factors``: as :func:`reduce`)."""
    check_same("reduce_scatter", inputs)
    return scatter(reduce(inputs, op, factors), len(inputs), dim % max(inputs[0].dim(), 1))


def all_to_all(inputs: Sequence[torch.Tensor], scatter_dim: int, gather_dim: int) -> list[torch.Tensor]:
    """Rank ``i`` splits its tensor into ``world_size`` chunks along ``scatter_dim`` and
    sends chunk ``j`` to rank ``j``; rank ``j`` concatenates what it receives along
    ``gather_dim`` in rank order.

    With ``scatter_dim=2, gather_dim=1`` on ``(b, s/P, h, d)`` shards this is the
    Ulysses re-sharding from sequence shards to head shards ``(b, s, h/P, d)``;
    swapping the two dims is its inverse.
    """
    check_same("all_to_all", inputs)
    world_size = len(inputs)
    shard = inputs[0].shape[scatter_dim] // world_size
    if shard * world_size != inputs[0].shape[scatter_dim]:
        raise ValueError(
            f"all_to_all: size {inputs[0].shape[scatter_dim]} of scatter_dim={scatter_dim} is not "
            f"divisible by the world size {world_size}")
    pieces = [[tensor.narrow(scatter_dim, dst * shard, shard) for dst in range(world_size)]
              for tensor in inputs]  # pieces[src][dst]; narrow allows zero-size shards
    return [torch.cat([pieces[src][dst] for src in range(world_size)], gather_dim)
            for dst in range(world_size)]


def gather(inputs: Sequence[torch.Tensor], dst: int = 0, dim: int = -1) -> list[torch.Tensor | None]:
    """Rank ``dst`` gets the concatenation along ``dim``; every other rank gets ``None``."""
    check_same("gather", inputs)
    gathered = torch.cat(list(inputs), dim)
    return [gathered if rank == dst else None for rank in range(len(inputs))]


def broadcast(inputs: Sequence[torch.Tensor], src: int = 0) -> list[torch.Tensor]:
    """Every rank gets a copy of rank ``src``'s tensor."""
    check_same("broadcast", inputs)
    return [inputs[src].clone()] * len(inputs)


def reduce_to(inputs: Sequence[torch.Tensor], dst: int = 0, op: ReduceOp | str = "sum",
              factors: Sequence | None = None) -> list[torch.Tensor]:
    """Rank ``dst`` gets the reduction of all ranks' tensors; every other rank gets zeros
    of the same shape and dtype (what it contributes to a loss: nothing). ``factors``: as
    :func:`reduce`."""
    check_same("reduce", inputs)
    reduced = reduce(inputs, op, factors)
    zeros = torch.zeros_like(inputs[0])
    return [reduced if rank == dst else zeros for rank in range(len(inputs))]


def scatter_from(inputs: Sequence[torch.Tensor | None], src: int = 0, dim: int = -1) -> list[torch.Tensor]:
    """Rank ``r`` gets chunk ``r`` along ``dim`` of rank ``src``'s tensor (the other entries
    of ``inputs`` are ignored and may be ``None``)."""
    return scatter(inputs[src], len(inputs), dim)


def all_to_all_single(inputs: Sequence[torch.Tensor], output_split_sizes: Sequence[Sequence[int]],
                      input_split_sizes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Uneven all-to-all along dim 0, as ``torch.distributed.all_to_all_single``.

    Rank ``i`` sends rows ``sum(input_split_sizes[i][:j])`` onwards, ``input_split_sizes[i][j]``
    of them, to rank ``j``; rank ``j`` concatenates what it receives in rank order.
    ``output_split_sizes[j][i]`` must equal ``input_split_sizes[i][j]`` (checked).
    """
    world_size = len(inputs)
    first = inputs[0]
    for rank, tensor in enumerate(inputs):
        if tensor.shape[1:] != first.shape[1:] or tensor.dtype != first.dtype:
            raise ValueError(
                f"all_to_all_single: rank {rank} has {tensor.dtype} {tuple(tensor.shape)} but rank 0 has "
                f"{first.dtype} {tuple(first.shape)}; every rank must pass the same dtype and the same "
                f"sizes after dim 0")
    check_splits("all_to_all_single", input_split_sizes, output_split_sizes)
    pieces = [tensor.split(list(splits), 0) for tensor, splits in zip(inputs, input_split_sizes)]
    return [torch.cat([pieces[src][dst] for src in range(world_size)], 0) for dst in range(world_size)]
