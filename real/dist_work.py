"""What the handle of an asynchronous ``torch.distributed`` call waits on (:class:`DistWork`).

A :class:`~simcomm.handles.Handle` of :class:`real.transport.DistTransport` holds
a :class:`DistWork`: the backend's ``Work``, and how its buffers become the
call's output at the wait. Until it is waited on, the run's
:class:`~real.groups.GroupCache` lists it as pending (an unwaited handle is an
error when the program returns), unless a checked call issues it
(:func:`issuing_deferred`: the checked call registers its own handle).
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from simcomm import memory
from simcomm.reports import program_location
from simcomm.trace import Record

from .call_memory import output, wait_released

__all__ = ["DistWork", "Done", "issuing_deferred"]

_issuing = threading.local()      # .deferred: a checked call's thread is issuing (real.checked)


@contextlib.contextmanager
def issuing_deferred() -> Iterator[None]:
    """The calls made in the block are a checked call's own (its handle is registered as pending)."""
    _issuing.deferred = True
    try:
        yield
    finally:
        _issuing.deferred = False


def _moved(cell: list, now: Callable[[], float], _future) -> None:
    """A Work's future completed: the time its data moved, in ``cell``."""
    cell[0] = now()


class Done:
    """What a :class:`DistWork` holds instead of its ``Work`` once waited on (the backend's
    references to the call's tensors are then the only ones left, and they are waited for)."""

    @staticmethod
    def is_completed() -> bool:
        return True

    @staticmethod
    def wait() -> None:
        return None


class DistWork:
    """What the handle of an asynchronous ``torch.distributed`` call waits on.

    ``result()`` turns the backend's buffers into the call's output once the
    ``Work`` is done (a move of dims, a division, a concatenation).
    """

    __slots__ = ("transport", "record", "work", "result", "moved", "held", "into", "future")

    def __init__(self, transport: Any, record: Record | None, work: dist.Work,
                 result: Callable[[], Any], held: list[tuple[Any, int]] | None = None,
                 into: torch.Tensor | None = None):
        self.transport, self.record, self.work, self.result = transport, record, work, result
        self.held = held         # the call's tensors and their counts before it (memory tracked)
        self.into = into         # the buffer the output is written into at the wait (the call's into)
        self.moved: list[float | None] = [None]   # when the data moved; the future's callback writes it
        # memory tracked: the Work's future, held here so that it dies on this thread at the wait. A
        # future keeps weak references to its output's storages, and a storage counts until the
        # last of those goes: dying on the backend's thread, a moment after the wait, it kept an
        # output the program had freed at once counted a moment longer (1 mark in about 100).
        self.future = None
        if held is not None and memory.current_bytes() is not None:
            try:
                self.future = work.get_future()
            except (RuntimeError, AttributeError):   # a Work without a future
                pass
        if not getattr(_issuing, "deferred", False):    # a checked call registers its own handle
            transport.cache.pending[id(self)] = (transport.describe_last(), program_location(sys._getframe(1)))
        if record is not None:
            try:
                # the callback holds the cell and the clock only: the backend's thread runs it and
                # drops it a moment later, and it must not keep this object (and the call's tensors) alive
                work.get_future().add_done_callback(functools.partial(_moved, self.moved, transport.recorder.now))
            except (RuntimeError, AttributeError):   # a Work without a future: moved = waited
                pass


    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> Any:
        self.transport.cache.pending.pop(id(self), None)
        try:
            self.work.wait()
        except BaseException:
            self.transport.cache.broken = True
            raise
        held, self.held = self.held, None
        future, self.future = self.future, None
        if held is not None and memory.current_bytes() is not None:   # as DistTransport._released
            self.work = Done()
            wait_released(held, future)
        del held, future  # the call's copy of its input is freed before its output counts, as in the simulator
        with memory.untracked():    # the output (not what making it takes) counts from here, in output
            result = self.result()
        out = output(result, self.into)
        self.into = None
        record = self.record
        if record is not None:
            recorder = self.transport.recorder
            recorder.moved(record, out, at=self.moved[0])
            recorder.waited(record)
        return out
