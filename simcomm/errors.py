"""Every error simcomm and ``real`` raise, in one module.

The errors the simulator raises instead of hanging:

Real NCCL shows a mismatched collective or a missing ``recv`` as a job that
hangs until a watchdog fires minutes later. The simulator sees every rank at
once, so it names the problem as soon as it exists:

* :class:`CollectiveMismatchError` - the ranks of one group called different
  collectives, or the same collective with incompatible arguments, at the
  same step.
* :class:`DeadlockError` - every rank that has not finished is blocked.
* :class:`RankError` - a rank's own program raised; the original exception is
  the ``__cause__``.
* :class:`CommunicatorClosedError` - a communicator (or the backward of an
  output that still holds one) was used after its run ended.
* :class:`WrongThreadError` - a rank's communicator was called from a thread
  other than that rank's own.
* :class:`RunTimeoutError` - the run did not finish within its timeout.
* :class:`UnwaitedHandleError` - a rank's program returned with a handle it
  issued (``async_op=True``, ``isend``, ``irecv``) never waited on.
* :class:`ShapeOnlyError` - a program run with ``tensors="shape"`` called an
  op that needs tensor values.

Those of ``real``'s gloo and NCCL workers (the ones above are raised there too):

* :class:`WorkerError` - a worker process could not start, died, or could not
  be reached.
* :class:`ResultError` - a rank's result could not be rebuilt in this process.
* :class:`RemoteError` - stands in for a worker's exception that could not be
  sent back as itself; :class:`RemoteTraceback` carries a worker's traceback
  text as the ``__cause__`` of the exception it raised.

And one that is not an error: :class:`Aborted` unwinds a virtual rank's program
after its run was aborted (a ``BaseException``, so ``except Exception`` in a
program does not swallow it).
"""
from __future__ import annotations

import traceback


class SimcommError(RuntimeError):
    """Base class of the errors :meth:`simcomm.World.run` raises."""


class CollectiveMismatchError(SimcommError):
    """Ranks of one group disagree on the collective they are calling."""


class DeadlockError(SimcommError):
    """Every unfinished rank waits for another one: nothing can progress."""


class RankError(SimcommError):
    """A rank's program raised an exception.

    ``rank`` is the global rank that raised first, ``others`` the ranks that
    raised afterwards, and ``__cause__`` the original exception.
    """

    def __init__(self, rank: int, error: BaseException, others: tuple[int, ...] = ()):
        self.rank = rank
        self.error = error
        self.others = others
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        also = f" (ranks {list(others)} raised too)" if others else ""
        super().__init__(
            f"rank {rank} raised {type(error).__name__}: {safe_str(error)}{also}\n"
            f"--- traceback of rank {rank} ---\n{tb.rstrip()}"
        )
        self.__cause__ = error

    def __reduce__(self):
        return (type(self), (self.rank, self.error, self.others))


class RunTimeoutError(SimcommError, TimeoutError):
    """A run did not finish within its timeout; the message says where each rank is,
    and which rank threads could not be stopped."""


class CommunicatorClosedError(SimcommError):
    """A communicator was used after the run it belongs to had ended.

    Raised at once, on the calling thread, for any communication call, including
    the collectives an autograd backward makes: a tensor a program returned
    without ``.detach()`` still holds its rank's communicator, and its backward
    would need every other rank, whose programs have already returned.
    """


class WrongThreadError(SimcommError):
    """A rank's communicator was called from a thread that is not the rank's own.

    Each virtual rank is one thread, and the scheduler knows each rank by its
    thread; a helper thread a program starts has no place in the turn order. On
    a real backend it would be a second, unsynchronised user of the process's
    communicator. The run fails with this error as the rank's error.
    """


class UnwaitedHandleError(SimcommError):
    """A rank's program returned while a handle it issued was never waited on."""


class ShapeOnlyError(SimcommError):
    """A program run with ``tensors="shape"`` called an op that needs tensor values."""


class WorkerError(SimcommError):
    """A worker process could not start, died, or could not be reached."""


class ResultError(SimcommError):
    """A rank's result could not be rebuilt in this process (its unpickling raised, the ``__cause__``)."""


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in a worker process (set as its ``__cause__``)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text.rstrip()


class RemoteError(Exception):
    """Stands in for a worker's exception that could not be sent back as itself."""


class Aborted(BaseException):
    """Unwinds a rank's program after the run was aborted (not an ``Exception``,
    so a program's ``except Exception`` does not swallow it)."""


def safe_str(error: BaseException) -> str:
    """``str(error)``, or a placeholder when the exception's own ``__str__`` raises."""
    try:
        return str(error)
    except BaseException as failure:  # noqa: BLE001 - any failure of a user's __str__
        return f"<str() of the {type(error).__name__} raised {type(failure).__name__}>"
