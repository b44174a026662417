"""The math of every collective, written once: a list of per-rank tensors in, a list out.

These functions know nothing of threads or processes. ``inputs[r]`` is what
rank ``r`` passes to the collective, and the result's entry ``r`` is what rank
``r`` gets back. The simulator calls them at its rendezvous; figures and tests
call them directly. They are ordinary differentiable torch code, so on one
device they are also the reference that the distributed backward rules are
checked against.

Entries of a result may be the *same* tensor object (every rank of an
all-reduce holds equal values); a transport hands each rank a private copy.
No function modifies its inputs.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ReduceOp

__all__ = [
    "REDUCE_OPS", "reduce_op_name", "to_reduce_op", "reduce", "all_reduce", "all_gather",
    "reduce_scatter", "scatter", "all_to_all", "gather", "broadcast", "check_same",
]

#: The reductions every backend supports, by canonical name.
REDUCE_OPS = ("sum", "avg", "max", "min", "product")
_ALIASES = {"mean": "avg", "prod": "product", "premul_sum": None}


_NAMES: dict = {**{getattr(ReduceOp, name.upper()): name for name in REDUCE_OPS},
                **{name: name for name in REDUCE_OPS}}


def reduce_op_name(op: ReduceOp | str) -> str:
    """The canonical name (``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``) of ``op``.

    Accepts ``torch.distributed.ReduceOp`` members and their names as strings.
    """
    try:
        return _NAMES[op]
    except (KeyError, TypeError):
        pass
    if isinstance(op, str):
        name = _ALIASES.get(op.lower(), op.lower())
        if name in REDUCE_OPS:
            return name
    else:
        for name in REDUCE_OPS:
            if op == getattr(ReduceOp, name.upper()):
                return name
    raise ValueError(f"unsupported reduce op {op!r}; use one of ReduceOp.SUM, AVG, MAX, MIN, PRODUCT")


def to_reduce_op(name: str) -> ReduceOp:
    """The ``torch.distributed.ReduceOp`` member for a canonical name."""
    return getattr(ReduceOp, reduce_op_name(name).upper())


def check_same(op: str, inputs: Sequence[torch.Tensor]) -> None:
    """Raise ``ValueError`` unless every rank's tensor has the same shape and dtype."""
    if not inputs:
        raise ValueError(f"{op}: needs at least one rank's tensor")
    first = inputs[0]
    for rank, tensor in enumerate(inputs):
        if tensor.shape != first.shape or tensor.dtype != first.dtype:
            raise ValueError(
                f"{op}: rank {rank} has {tensor.dtype} {tuple(tensor.shape)} but rank 0 has "
                f"{first.dtype} {tuple(first.shape)}; every rank must pass the same shape and dtype"
            )


_ACCUMULATE_FROM = 1 << 16  # elements per rank from which large reductions accumulate in place
_COMBINE_INPLACE = {"sum": torch.Tensor.add_, "avg": torch.Tensor.add_, "max": None, "min": None,
                    "product": torch.Tensor.mul_}


def _reduce_accumulate(inputs: Sequence[torch.Tensor], name: str) -> torch.Tensor:
    """Fold the inputs into one new tensor in place: every input is read once and no
    ``(world, ...)`` stack is allocated (for large tensors the stack's copy costs more
    than the reduction). Not differentiable."""
    if name in ("max", "min"):
        combine = torch.maximum if name == "max" else torch.minimum
        out = combine(inputs[0], inputs[1])
        for tensor in inputs[2:]:
            combine(out, tensor, out=out)
        return out
    out = inputs[0] + inputs[1] if name != "product" else inputs[0] * inputs[1]
    for tensor in inputs[2:]:
        _COMBINE_INPLACE[name](out, tensor)
    if name == "avg":
        out /= len(inputs)
    return out


def reduce(inputs: Sequence[torch.Tensor], op: ReduceOp | str = "sum") -> torch.Tensor:
    """Elementwise reduction of the ranks' tensors: one new tensor of the common shape."""
    name = reduce_op_name(op)
    if len(inputs) == 1:
        return inputs[0].clone()
    if name == "avg" and not (inputs[0].is_floating_point() or inputs[0].is_complex()):
        raise ValueError(f"reduce: ReduceOp.AVG needs a floating-point dtype, got {inputs[0].dtype}")
    large = inputs[0].numel() >= _ACCUMULATE_FROM
    if large and not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return _reduce_accumulate(inputs, name)
    stacked = torch.stack(list(inputs))  # (world, *shape)
    if name == "sum":
        return stacked.sum(0)
    if name == "avg":
        return stacked.mean(0)
    if name == "max":
        return stacked.amax(0)
    if name == "min":
        return stacked.amin(0)
    return stacked.prod(0)


def all_reduce(inputs: Sequence[torch.Tensor], op: ReduceOp | str = "sum") -> list[torch.Tensor]:
    """Every rank gets the reduction of all ranks' tensors."""
    check_same("all_reduce", inputs)
    return [reduce(inputs, op)] * len(inputs)


def all_gather(inputs: Sequence[torch.Tensor], dim: int = -1) -> list[torch.Tensor]:
    """Every rank gets the ranks' tensors concatenated along ``dim`` in rank order."""
    check_same("all_gather", inputs)
    return [torch.cat(list(inputs), dim)] * len(inputs)


def scatter(tensor: torch.Tensor, world_size: int, dim: int = -1) -> list[torch.Tensor]:
    """Chunk ``r`` of ``tensor`` along ``dim`` for each rank ``r`` (the forward of ``slice``)."""
    if tensor.shape[dim] % world_size:
        raise ValueError(
            f"scatter: size {tensor.shape[dim]} of dim={dim} is not divisible by the world size {world_size}")
    return [chunk.contiguous() for chunk in tensor.split(tensor.shape[dim] // world_size, dim)]


def reduce_scatter(inputs: Sequence[torch.Tensor], dim: int = -1, op: ReduceOp | str = "sum"
                   ) -> list[torch.Tensor]:
    """Reduce the ranks' tensors, then rank ``r`` keeps chunk ``r`` along ``dim``."""
    check_same("reduce_scatter", inputs)
    return scatter(reduce(inputs, op), len(inputs), dim)


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
    pieces = [tensor.split(shard, scatter_dim) for tensor in inputs]  # pieces[src][dst]
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
