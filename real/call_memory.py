"""A real call's tensors in the memory count, as the simulator counts a collective's.

``Cluster(memory=True)`` counts each worker's storage as the simulator counts
a virtual rank's (:mod:`simcomm.memory`): a call's output buffers under the
program's label (:func:`communicating`), its output counted when the program
gets it (:func:`output`), and its tensors freed when the program frees them:
a backend's worker thread holds a call's tensors until a moment after the call
completes, so a blocking call (and an async call's handle, at its wait) waits
until the backend has dropped them (:func:`references`, :func:`wait_released`).
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from simcomm import memory
from simcomm.buffers import write_into

__all__ = ["RELEASE_WAIT_S", "communicating", "use_count", "references", "wait_released", "output"]

#: the longest a blocking call waits for the backend's worker to drop its references to the call's
#: tensors (measured: microseconds; the bound keeps a backend that holds them longer from hanging)
RELEASE_WAIT_S = 0.5


def communicating(call: Callable) -> Callable:
    """A transport call whose output buffers count as the simulator counts a collective's output
    (:func:`simcomm.memory.communicating`): under the program's label, else ``"communication"``."""
    @functools.wraps(call)
    def counted(*args: Any, **kwargs: Any) -> Any:
        with memory.communicating():
            return call(*args, **kwargs)
    return counted


def use_count(held: torch.Tensor | torch.UntypedStorage) -> int:
    """How many references (the backend's too) hold a tensor or a storage. A backend that keeps
    the call's tensor itself holds its TensorImpl, not another reference to its storage, so a
    blocking call waits on both counts."""
    if isinstance(held, torch.Tensor):
        return held._use_count()
    return torch._C._storage_Use_Count(held._cdata)


def references(tensors: Iterable[torch.Tensor | None]) -> list[tuple[Any, int]]:
    """Each tensor and its storage with its reference count now, before a backend takes them."""
    held = [t for t in tensors if t is not None]
    held += [t.untyped_storage() for t in held]
    return [(obj, use_count(obj)) for obj in held]


def wait_released(held: list[tuple[Any, int]], future: Any = None) -> None:
    """Wait (at most :data:`RELEASE_WAIT_S`) until no count of :func:`references` is higher, but
    for the references of ``future`` (a completed ``Work``'s future, which this thread holds)."""
    if future is not None:
        held = _allowing(held, future)
    deadline = time.monotonic() + RELEASE_WAIT_S
    while any(use_count(obj) > count for obj, count in held) and time.monotonic() < deadline:
        time.sleep(20e-6)


def _allowing(held: list[tuple[Any, int]], future: Any) -> list[tuple[Any, int]]:
    """``held`` with each count raised by the references ``future``'s value holds to it."""
    try:
        value = future.value()
    except Exception:                 # the call failed: its future holds no tensors
        return held
    values = [v for v in (value if isinstance(value, (list, tuple)) else [value]) if isinstance(v, torch.Tensor)]
    tensors = [obj for obj, _ in held if isinstance(obj, torch.Tensor)]
    others = [v for v in values if not any(v is t for t in tensors)]   # views of their own: a storage reference
    return [(obj, count + (sum(v is obj for v in values) if isinstance(obj, torch.Tensor) else
                           sum(v.untyped_storage()._cdata == obj._cdata for v in others)))
            for obj, count in held]


def output(result: torch.Tensor | Any, into: torch.Tensor | None) -> Any:
    """A call's output: ``result`` counted on this rank as the simulator counts a call's output;
    with a buffer ``into``, ``result`` copied into it (unless it is that buffer) and ``into``."""
    if into is None:
        return memory.received(result)
    if result is not into:
        write_into(into, result)
    return into
