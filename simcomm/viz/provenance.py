"""Provenance tensors: values that say which rank an element came from and where it sat.

Rank ``r``'s element at flat (row-major) position ``i`` holds the number
``r * base + i``, where ``base`` is a power of ten larger than every flat
position. With shape ``(2, 3)`` and ``base=10``, rank 2 holds
``[[20, 21, 22], [23, 24, 25]]``; after any collective that only *moves* data
(all-gather, all-to-all, broadcast, gather, slice, send/recv) the value 24
still reads "rank 2, element 4", that is ``(1, 1)`` of the shape it started in.

Reductions (sum, avg, product) mix several ranks' values, so their results are
no longer codes; max and min pick one rank's value and keep it a code. The
figures know which of their panels hold codes and colour only those by source
rank.

Values are float64 so every code is exact.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

__all__ = ["provenance_base", "provenance_tensor", "provenance_tensors", "decode", "describe"]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(size) for size in shape)


def _check_shape(function: str, shape: Sequence[int]) -> tuple[int, ...]:
    try:
        shape = tuple(shape)
    except TypeError:
        raise ValueError(f"{function}: shape={shape!r} must be a sequence of positive ints") from None
    if not all(isinstance(size, int) and not isinstance(size, bool) and size > 0 for size in shape):
        raise ValueError(f"{function}: shape={shape!r} must be a sequence of positive ints")
    return shape


def provenance_base(numel: int) -> int:
    """The smallest power of ten (at least 10) larger than every flat position of ``numel`` elements."""
    if not isinstance(numel, int) or isinstance(numel, bool) or numel < 1:
        raise ValueError(f"provenance_base: numel={numel!r} must be a positive int")
    return 10 ** max(1, len(str(numel - 1)))


def provenance_tensor(rank: int, shape: Sequence[int], *, base: int | None = None,
                      dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Rank ``rank``'s tensor of ``shape`` whose element at flat position ``i`` is ``rank * base + i``.

    ``base`` defaults to :func:`provenance_base` of the tensor's size; pass a
    larger one to give several tensors (inputs and outputs of a collective)
    the same code.
    """
    shape = _check_shape("provenance_tensor", shape)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
        raise ValueError(f"provenance_tensor: rank={rank!r} must be a non-negative int")
    numel = _numel(shape)
    if base is None:
        base = provenance_base(numel)
    elif base < numel:
        raise ValueError(f"provenance_tensor: base={base} is smaller than the {numel} elements of "
                         f"shape {shape}; codes would collide")
    return (rank * base + torch.arange(numel, dtype=dtype)).reshape(shape)


def provenance_tensors(world_size: int, shape: Sequence[int], *, base: int | None = None,
                       dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """One :func:`provenance_tensor` per rank ``0 .. world_size - 1``, all with the same ``base``."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"provenance_tensors: world_size={world_size!r} must be a positive int")
    shape = _check_shape("provenance_tensors", shape)
    if base is None:
        base = provenance_base(_numel(shape))
    return [provenance_tensor(rank, shape, base=base, dtype=dtype) for rank in range(world_size)]


def decode(values: torch.Tensor | np.ndarray | Sequence, base: int) -> tuple[np.ndarray, np.ndarray]:
    """``(source_rank, flat_position)`` of every element of a provenance-coded tensor.

    Both are integer arrays of ``values``' shape. Raises ``ValueError`` when a
    value is not a code (negative or not a whole number): the tensor went
    through a reduction that mixed ranks, or was scaled.
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values, dtype=np.float64)
    if not isinstance(base, int) or isinstance(base, bool) or base < 1:
        raise ValueError(f"decode: base={base!r} must be a positive int")
    bad = ~np.isfinite(array) | (array < 0) | (array != np.round(array))
    if bad.any():
        first = array[bad].flat[0]
        raise ValueError(f"decode: value {first!r} is not a provenance code (a non-negative whole "
                         f"number); it mixes several ranks' values or was scaled")
    codes = array.astype(np.int64)
    return codes // base, codes % base


def describe(value: float, base: int, shape: Sequence[int]) -> str:
    """The code ``value`` in words, e.g. ``"rank 2, element (1, 1)"`` for ``24`` with base 10, shape (2, 3)."""
    shape = _check_shape("describe", shape)
    ranks, positions = decode(np.asarray([value]), base)
    position = int(positions[0])
    if position >= _numel(shape):
        raise ValueError(f"describe: value {value!r} encodes position {position}, outside shape {shape}")
    index = np.unravel_index(position, shape)
    where = "(" + ", ".join(str(int(i)) for i in index) + ("," if len(shape) == 1 else "") + ")"
    return f"rank {int(ranks[0])}, element {where}"
