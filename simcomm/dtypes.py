"""Which dtype x op calls a real backend accepts: the simulator accepts exactly those.

The simulator stands for gloo on the CPU and for NCCL on CUDA, so a call
gloo or NCCL refuses is refused on virtual ranks too, with the same error
class, before any data moves (and the same check runs on real workers
before the backend is called, so the words are the same on both):

* gloo (CPU), measured by ``benchmarks/gloo_dtypes.py`` on torch 2.13: no
  ``int16`` in any collective (gloo: ``RuntimeError: Invalid scalar type``;
  point-to-point calls take it); no complex ``gather`` (same error).
* NCCL (CUDA), from ``ProcessGroupNCCL``'s dtype map (not measured here):
  no ``int16``.
* Both, as ``torch.distributed`` itself decides for every backend
  (``supports_complex``): complex SUM and AVG run as real views of the
  tensor, complex MAX, MIN and PRODUCT are refused: ``ValueError`` for
  ``all_reduce`` (torch's own check), ``RuntimeError`` for ``reduce_scatter``
  and ``reduce`` (gloo's).
* ``ReduceOp.AVG`` needs a floating-point or complex dtype (gloo: a
  ``RuntimeError`` from the cast; here a ``ValueError`` on every rank before
  any data moves, as the real transport's own check words it).

:func:`check` is the one check; :data:`TABLES` the measured data, gathered from the rows of
:data:`simcomm.specs.SPECS` (``refuses``, ``reducing``) and
:data:`~simcomm.specs.EVERY_COLLECTIVE_REFUSES`.
"""
from __future__ import annotations

import torch

from .specs import EVERY_COLLECTIVE_REFUSES, SPECS

__all__ = ["TABLES", "check", "table_for"]

#: the collectives the tables apply to (those that carry data)
_COLLECTIVES = tuple(name for name, spec in SPECS.items() if spec.dtype_checked)


def _tables() -> dict[str, dict[tuple[str, torch.dtype], str]]:
    tables: dict[str, dict[tuple[str, torch.dtype], str]] = {}
    for backend, dtype, why in EVERY_COLLECTIVE_REFUSES:
        tables.setdefault(backend, {})[("*", dtype)] = why
    for name in _COLLECTIVES:
        for backend, dtype, why in SPECS[name].refuses:
            tables.setdefault(backend, {})[(name, dtype)] = why
    return tables


#: backend -> {(op, dtype): why refused}; op ``"*"`` is every collective (the rows' ``refuses``)
TABLES: dict[str, dict[tuple[str, torch.dtype], str]] = _tables()

#: reductions torch.distributed runs on complex tensors (as real views)
_COMPLEX_REDUCTIONS = ("sum", "avg", "premul_sum")
#: ops with a reduction, and the error class torch raises for an unsupported complex one
_REDUCING = {name: spec.reducing for name, spec in SPECS.items() if spec.reducing is not None}


def table_for(device: torch.device | str) -> str:
    """The backend whose table applies on ``device``: ``"nccl"`` on CUDA, ``"gloo"`` elsewhere."""
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type   # no new device
    return "nccl" if kind == "cuda" else "gloo"


#: (op, dtype, reduction, device) of the calls :func:`check` accepted: a hit costs one lookup
_ACCEPTED: set[tuple] = set()


def check(op: str, dtype: torch.dtype | None, reduction: str | None, device: torch.device | str,
          rank: int) -> None:
    """Raise what the real backend for ``device`` raises for ``op`` on ``dtype`` (with
    ``reduction``, a canonical name such as ``"max"``, for reducing ops), naming the op, the
    rank and the value; return quietly for a call it accepts. ``dtype`` None: nothing to check.
    What was accepted once is remembered (the tables never change), so a repeated call costs
    one set lookup."""
    if (op, dtype, reduction, device) in _ACCEPTED:
        return
    _check(op, dtype, reduction, device, rank)
    _ACCEPTED.add((op, dtype, reduction, device))


def _check(op: str, dtype: torch.dtype | None, reduction: str | None, device: torch.device | str,
           rank: int) -> None:
    if dtype is None or op not in _COLLECTIVES:
        return
    if reduction == "avg" and op in _REDUCING and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{op}: ReduceOp.AVG on rank {rank} needs a floating-point dtype, got {dtype}")
    backend = table_for(device)
    table = TABLES[backend]
    why = table.get((op, dtype)) or table.get(("*", dtype))
    if why is not None:
        raise RuntimeError(f"{op}: rank {rank}'s tensor has dtype {str(dtype).removeprefix('torch.')}, which "
                           f"{backend} does not support ({backend}: {why}); the simulator follows {backend}'s "
                           f"table on {torch.device(device).type} (simcomm.dtypes)")
    if dtype.is_complex and op in _REDUCING and reduction is not None and reduction not in _COMPLEX_REDUCTIONS:
        raise _REDUCING[op](f"{op} does not support {reduction.upper()} on complex tensors (rank {rank}, "
                            f"dtype {str(dtype).removeprefix('torch.')}); torch.distributed reduces complex "
                            f"tensors only with SUM or AVG, as real views")
