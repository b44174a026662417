"""Argument checks shared by every collective, in one place, with one wording.

Each check raises :class:`ValueError` naming the op, the rank, the argument and
the value, so a learner reading the message knows which call on which rank to
fix. Both backends call these before any communication, so a bad argument is
reported the same way on virtual ranks and on real processes.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def normalize_dim(op: str, tensor: torch.Tensor, dim: int, rank: int, arg: str = "dim") -> int:
    """Return ``dim`` as a non-negative index into ``tensor``'s dimensions."""
    ndim = tensor.dim()
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ValueError(f"{op}: {arg}={dim!r} on rank {rank} must be an int")
    if ndim == 0:
        raise ValueError(f"{op}: rank {rank} passed a 0-d tensor; {arg}={dim} needs at least one dimension")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{op}: {arg}={dim} is out of range for the {ndim}-D tensor of shape "
            f"{tuple(tensor.shape)} on rank {rank} (valid: {-ndim} to {ndim - 1})"
        )
    return dim % ndim


def check_divisible(op: str, tensor: torch.Tensor, dim: int, world_size: int, rank: int,
                    arg: str = "dim") -> int:
    """Check that ``tensor.shape[dim]`` splits into ``world_size`` equal shards; return the shard size."""
    size = tensor.shape[dim]
    if size % world_size:
        raise ValueError(
            f"{op}: size {size} of {arg}={dim} (shape {tuple(tensor.shape)}) on rank {rank} "
            f"is not divisible by the world size {world_size}; pad it or pick a divisible size"
        )
    return size // world_size


def check_peer(op: str, peer: int, world_size: int, rank: int, arg: str) -> int:
    """Check that ``peer`` is a rank of the group (group-local numbering)."""
    if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < world_size:
        raise ValueError(
            f"{op}: {arg}={peer!r} on rank {rank} is not a rank of this group "
            f"(valid: 0 to {world_size - 1})"
        )
    return peer


def check_4d(op: str, tensor: torch.Tensor, rank: int) -> None:
    if tensor.dim() != 4:
        raise ValueError(
            f"{op}: expects a 4-D (batch, seq, heads, head_dim) tensor, got shape "
            f"{tuple(tensor.shape)} on rank {rank}"
        )


def check_partition(op: str, groups: Sequence[Sequence[int]], world_size: int, rank: int
                    ) -> tuple[tuple[int, ...], ...]:
    """Check that ``groups`` partitions ``range(world_size)``; return it as sorted tuples."""
    try:
        normalized = tuple(tuple(int(r) for r in group) for group in groups)
    except TypeError:
        raise ValueError(f"{op}: groups={groups!r} on rank {rank} must be a list of lists of ranks") from None
    flat = sorted(r for group in normalized for r in group)
    if flat != list(range(world_size)) or any(len(group) == 0 for group in normalized):
        raise ValueError(
            f"{op}: groups={[list(g) for g in normalized]} on rank {rank} must partition the "
            f"ranks 0..{world_size - 1}: every rank in exactly one non-empty group"
        )
    return normalized
