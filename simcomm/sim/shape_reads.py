"""Stand-in values for reads of floating-point scalars on shape-only ranks.

A shape-only rank (``World(..., tensors="shape")``) has no values for data, parameters, random
draws or what a collective wrote, so a program that reads one (``loss.item()``, ``float(loss)``,
``f"{loss:.4f}"``) stops with :class:`~simcomm.errors.ShapeOnlyError` naming the read. Most
training scripts read exactly one kind of such value: a floating-point scalar they print or log
(the loss, a gradient norm, a learning rate computed from one). With
``World(..., tensors="shape", scalar_reads="nan")`` (``python -m simcomm.run --tensors shape
--scalar-reads nan``) such a read answers ``nan`` instead, stderr says so once per run
(:data:`READS_NOTICE`), and the script runs on to its end, so its memory, trace and
collectives are those of every step, not of the steps before its first log line.

What the rule covers, and what it does not:

* only ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``int(t)``, ``.tolist()``,
  ``bool(t)`` of one element, formatting) of a floating-point or complex tensor that has no
  value. A tensor with a value (computed from constants) answers its value, as always;
* integer and bool reads stay the named error: they are indices, sizes, counts and branches
  (``if found_inf.item()``, ``nonzero``, a split size), and a made-up integer would change
  what the program does, not only what it prints;
* a branch on a stand-in takes the side a NaN takes in Python (every comparison with ``nan``
  is false), and a value computed from it is ``nan`` too. A program whose control flow depends
  on its loss (early stopping, a loss-spike skip) follows that side: the run is then not the
  run the real values would give, and the notice says so.
"""
from __future__ import annotations

import math
import sys
import threading
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["SCALAR_READS", "READS_NOTICE", "check_scalar_reads", "set_scalar_reads", "stand_in",
           "notice_once"]

#: the values of ``World(..., scalar_reads=)``: ``"error"`` (the default) or ``"nan"``
SCALAR_READS = ("error", "nan")

#: the line a run that answers a read with a stand-in prints to stderr, once
READS_NOTICE = ("simcomm: shape-only ranks (tensors='shape', scalar_reads='nan') answer a read of a "
                "floating-point value they do not have (.item(), float(t), formatting) with nan; "
                "integer and bool reads stay errors, and a branch on a stand-in takes nan's side "
                "(every comparison false)")

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
_MODE_ATTRIBUTE = "_simcomm_scalar_reads"

_noticed: dict[str, weakref.WeakSet] = {}       # notice -> the runs (RunState) that printed it
_noticed_outside_runs: set[str] = set()
_lock = threading.Lock()


def check_scalar_reads(scalar_reads: Any, tensors: str) -> str:
    """``scalar_reads`` checked for ``World(..., tensors=tensors)``: raise ``ValueError`` naming
    the argument and the value for one that is not in :data:`SCALAR_READS`, or ``"nan"`` without
    shape-only ranks (a real-valued rank has every value)."""
    if scalar_reads not in SCALAR_READS:
        raise ValueError(f"World: scalar_reads={scalar_reads!r} must be one of {list(SCALAR_READS)}")
    if scalar_reads != "error" and tensors != "shape":
        raise ValueError(f"World: scalar_reads={scalar_reads!r} needs tensors='shape' (tensors="
                         f"{tensors!r}: a real-valued rank reads its own values)")
    return scalar_reads


def set_scalar_reads(mode: Any, scalar_reads: str) -> None:
    """Give a rank's fake mode the run's rule for reads of values it does not have."""
    if scalar_reads != "error":
        setattr(mode, _MODE_ATTRIBUTE, scalar_reads)


def stand_in(func: Any, args: tuple, mode: Any) -> float | complex | None:
    """What a shape-only rank answers for ``func(*args)`` on a tensor without a value under its
    mode's rule: ``nan`` for a read of a floating-point (``complex(nan, nan)`` for a complex)
    scalar where the rule is ``"nan"``; ``None`` (torch's refusal follows, the named error) for
    everything else."""
    if func is not _SCALAR_READ or getattr(mode, _MODE_ATTRIBUTE, None) != "nan":
        return None
    tensor = args[0] if args else None
    if type(tensor) is not FakeTensor or not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        return None
    notice_once(READS_NOTICE)
    return complex(math.nan, math.nan) if tensor.dtype.is_complex else math.nan


def notice_once(notice: str) -> None:
    """Print ``notice`` to stderr once per run (once for code outside any run)."""
    from .dist_world import _local as _rank_local

    context = getattr(_rank_local, "rank", None)
    run = context.state if context is not None else None
    with _lock:
        if run is None:
            if notice in _noticed_outside_runs:
                return
            _noticed_outside_runs.add(notice)
        else:
            runs = _noticed.setdefault(notice, weakref.WeakSet())
            if run in runs:
                return
            runs.add(run)
    print(notice, file=sys.stderr, flush=True)
