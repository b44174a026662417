"""The c10d ``Work`` of an asynchronous call on virtual ranks, backed by simulator handles.

``dist.all_reduce(t, async_op=True)``, ``dist.isend``/``irecv``,
``dist.batch_isend_irecv`` and every call torch's own code issues through
the C++ API (DDP's reducer, the functional collectives) return a
:class:`SimcommWork`: the simulator has issued the call (traced with
``async_op=True``, checked against the other ranks at once) and holds a
:class:`~simcomm.handles.Handle` per transport call. The program's
computation until ``wait()`` overlaps the communication: the trace shows
when the call was issued, when its data moved and when the program waited.

A Work never waited on when the program returns is reported as the
simulator reports a handle never waited on (an
:class:`~simcomm.errors.UnwaitedHandleError` naming the rank and the line
that issued it). A functional collective's result the program returns
(``return funcol.all_gather_tensor(...)``) is used, not unwaited: the run
waits it (:func:`wait_returned`), on both backends, before that check.
"""
from __future__ import annotations

import sys

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from .ops import Issued

__all__ = ["SimcommWork", "completed", "done", "wait_returned"]


class SimcommWork(dist.Work):
    """One issued c10d call: ``wait()`` waits on its handles, then writes c10d's buffers.

    * ``wait()`` blocks this rank until the call is complete on it, visibly to the
      simulator's scheduler (a wait nobody can satisfy is a DeadlockError), then
      writes the results into the call's output buffers; returns ``True``.
      Waiting again does nothing.
    * ``is_completed()`` never blocks: when every handle's data has moved it
      writes the buffers (so a program polling it may read them), else it lets
      the other ranks take a turn first, as a handle's ``is_completed`` does.
    * ``get_future()`` waits first, then returns a completed future holding the
      output tensors. c10d code waits on futures where the simulator cannot see
      (DDP's reducer blocks on its buckets' futures in C++), so a future that
      is not complete yet could hang the run; its callbacks run at once.
    """

    def __init__(self, issued: Issued, what: str):
        super().__init__()
        self._issued: Issued | None = issued
        self._outputs: list[torch.Tensor] | None = None
        self._future: Future | None = None
        self._what = what

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the call is complete on this rank and its buffers are written.

        ``timeout`` is accepted for c10d's signature and ignored: the simulator
        never hangs (every wait is visible to its scheduler).
        """
        if self._outputs is None:
            issued = self._issued
            results = [handle.wait() for handle in issued.calls]
            self._outputs = issued.finish(results)
            self._issued = None
        return True

    def is_completed(self) -> bool:
        if self._outputs is None and all(handle.is_completed() for handle in self._issued.calls):
            self.wait()       # every handle is complete: this does not block
        return self._outputs is not None

    def get_future(self) -> Future:
        if self._future is None:
            self.wait()
            future: Future = Future()
            future.set_result(self._outputs)
            self._future = future
        return self._future

    def result(self) -> list[torch.Tensor]:
        """The output tensors (waits first)."""
        self.wait()
        return self._outputs

    def block_current_stream(self) -> None:
        """Waits: on virtual ranks the program is the only stream."""
        self.wait()

    def synchronize(self) -> None:
        """Waits: on virtual ranks the program is the only stream."""
        self.wait()

    def __repr__(self) -> str:
        return f"SimcommWork({self._what}, {'waited' if self._outputs is not None else 'not waited'})"


def completed(outputs: list[torch.Tensor]) -> dist.Work:
    """The Work of a call that completed before it returned, its future holding ``outputs``."""
    future: Future = Future()
    future.set_result(outputs)
    return _create_work_from_future(future)


_DONE: list[dist.Work] = []


def done() -> dist.Work:
    """The Work every blocking call returns: complete, ``wait()`` returns at once, its future
    holds an empty list. One object for all (made once): c10d's ``dist.*`` functions only wait
    on it and return ``None`` to the program, so a blocking call costs no Work of its own."""
    if not _DONE:
        _DONE.append(completed([]))
    return _DONE[0]


def wait_returned(result: Any) -> Any:
    """``result`` with every functional collective's pending result in it waited on (an
    ``AsyncCollectiveTensor`` becomes the plain tensor it wraps): a returned tensor is used.
    Where the functional collectives were never imported, none can exist: ``result`` is returned
    as it is (importing them costs tens of milliseconds, once per process)."""
    functional = sys.modules.get("torch.distributed._functional_collectives")
    if functional is None:
        return result
    AsyncCollectiveTensor = functional.AsyncCollectiveTensor
    from torch.utils._pytree import tree_map_only

    return tree_map_only(AsyncCollectiveTensor, lambda tensor: tensor.wait(), result)
