"""What an asynchronous call returns, and the description of one batched point-to-point op.

Every collective of the :class:`~simcomm.communicator.Communicator` (and of both
transports) takes ``async_op=True`` and then returns a :class:`Handle` instead
of its output, as ``torch.distributed`` returns a ``Work``:

>>> handle = comm.all_reduce(grad, async_op=True)   # issued: the data may not have moved yet
>>> ...                                              # compute that overlaps the communication
>>> total = handle.wait()                            # blocks until done; returns the output

``isend``/``irecv`` and ``batch_isend_irecv`` return handles too; their ops
are described by :class:`P2POp`.

Rules a program must follow, as on real backends: every rank of a group
issues the group's collectives in the same order (the step of a call is
counted when it is *issued*), the input is not modified before ``wait()``
(the transports copy it at issue, so it would not change the result, but a
real backend reading it in place might), and every handle is waited on
before the program returns; the simulator raises
:class:`~simcomm.errors.UnwaitedHandleError` naming the rank and the line that issued it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch

__all__ = ["Handle", "P2POp"]


class _Work(Protocol):
    def wait(self) -> Any: ...
    def is_completed(self) -> bool: ...


class _Done:
    """The work of a call that completed when it was issued (no communication)."""

    __slots__ = ("output",)

    def __init__(self, output: Any):
        self.output = output

    def wait(self) -> Any:
        return self.output

    def is_completed(self) -> bool:
        return True


class Handle:
    """An issued asynchronous call.

    :meth:`wait` blocks until the call is complete on this rank and returns its
    output (``None`` for ``barrier`` and ``isend``; ``gather`` gives ``None`` off
    the destination). Waiting again returns the same object. On the
    communicator, autograd flows through the output exactly as through the
    blocking call's: the handle applies the collective's autograd rule when
    the data has arrived, so the backward is the same dual collective
    (blocking, traced with phase ``backward``).
    """

    __slots__ = ("_work", "_finish", "_output", "_waited")

    def __init__(self, work: _Work, finish: Callable[[Any], Any] | None = None):
        self._work = work
        self._finish = finish
        self._output = None
        self._waited = False

    @classmethod
    def completed(cls, output: Any) -> Handle:
        """A handle whose call is already complete (a call that moves no data)."""
        return cls(_Done(output))

    def wait(self) -> Any:
        """Block until the call is complete on this rank; return its output.

        In the simulator the rank blocks visibly to the scheduler (a wait
        nobody can satisfy is a :class:`~simcomm.errors.DeadlockError`).
        """
        if not self._waited:
            output = self._work.wait()
            if self._finish is not None:
                output = self._finish(output)
            self._output, self._waited, self._finish = output, True, None
        return self._output

    def is_completed(self) -> bool:
        """Whether the call's data has moved on this rank (never blocks).

        In the simulator a call that is not complete yet lets the other ranks
        take a turn first, so a loop polling this makes progress.
        """
        return self._waited or self._work.is_completed()

    def __repr__(self) -> str:   # no is_completed() here: in the simulator a poll may yield the turn
        return f"Handle({'waited' if self._waited else 'not waited'}, {self._work!r})"


class P2POp(NamedTuple):
    """One operation of :meth:`~simcomm.communicator.Communicator.batch_isend_irecv`.

    ``P2POp("isend", tensor, peer)`` sends ``tensor`` to rank ``peer``;
    ``P2POp("irecv", (size, dtype), peer)`` receives a new tensor of that size
    and dtype from ``peer`` (returned by the handle's ``wait()``: unlike torch,
    no buffer is written in place). ``peer`` is a rank within the group.
    """

    op: str
    data: torch.Tensor | tuple[Sequence[int], torch.dtype]
    peer: int
