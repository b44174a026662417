"""``World``: N virtual ranks in this process, each a thread running the same SPMD program."""
from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from . import memory as _memory
from .c10d import rank_process_group
from .communicator import Communicator
from .errors import RankError, RunTimeoutError
from .sim import RunState, SimTransport, _Aborted, program_location
from .trace import Trace

__all__ = ["World"]

#: how long aborted ranks get to unwind before an exception is injected into them
_UNWIND_GRACE_S = 5.0


class World:
    """``world_size`` virtual ranks that run SPMD programs.

    >>> world = World(4)
    >>> outs = world.run(program, *args)   # program(comm, *args) on every rank
    >>> outs[r]                             # what rank r returned
    >>> world.trace                         # the transport calls of that run
    >>> World(4, memory=True).memory        # after a run: bytes per rank by label (simcomm.memory)

    Each rank runs ``program(comm, *args, **kwargs)`` on a thread of its own,
    so rank-dependent control flow, blocking send/recv and per-rank
    ``backward()`` behave as on real processes. ``run`` returns when every
    rank has returned, or raises:

    * :class:`~simcomm.errors.CollectiveMismatchError` or
      :class:`~simcomm.errors.DeadlockError` as soon as the simulator sees one;
    * :class:`~simcomm.errors.RankError` when a rank's program raised (the
      original exception is its ``__cause__``);
    * :class:`~simcomm.errors.RunTimeoutError` when ``timeout`` seconds pass.

    After any error every rank thread has ended and the World can run again.
    """

    def __init__(self, world_size: int, *, device: str | torch.device = "cpu", trace: bool = True,
                 memory: bool = False):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"World: world_size={world_size!r} must be a positive int")
        self.world_size = world_size
        self.device = torch.device(device)
        self.tracing = trace
        self.trace = Trace()
        self.track_memory = memory
        self.memory: _memory.MemoryReport | None = None   # bytes per rank of the last run (memory=True)

    def __repr__(self) -> str:
        return f"World(world_size={self.world_size}, device={self.device})"

    # A World holds no resources between runs; the context manager only mirrors real.Cluster.
    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc_info) -> None:
        return None

    def close(self) -> None:
        return None

    def run(self, program: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``program(comm, *args, **kwargs)`` on every rank; return the ranks' results."""
        state = RunState(self.world_size, self.device, self.tracing)
        results: list[Any] = [None] * self.world_size
        reports = [None] * self.world_size if self.track_memory else None
        threads = [
            threading.Thread(target=_rank_main, name=f"simcomm-rank-{rank}", daemon=True,
                             args=(state, rank, program, args, kwargs, results, reports))
            for rank in range(self.world_size)]
        try:
            for thread in threads:
                thread.start()
            state.start()
            if not state.done.wait(timeout):
                state.abort(RunTimeoutError(_describe_timeout(timeout, threads, state)))
        except BaseException as interrupt:  # KeyboardInterrupt in a notebook: stop the ranks too
            state.abort(interrupt)
            _join(threads)
            raise
        _join(threads)
        self.trace = Trace(state.events)
        self.memory = _memory.MemoryReport(reports) if reports is not None and None not in reports else None
        if state.rank_errors:
            (rank, error), others = state.rank_errors[0], state.rank_errors[1:]
            raise RankError(rank, error, tuple(r for r, _ in others)) from error
        if state.error is not None:
            raise state.error.with_traceback(None)
        return results


def _rank_main(state: RunState, rank: int, program: Callable, args: tuple, kwargs: dict,
               results: list, reports: list | None) -> None:
    comm = Communicator(SimTransport(state, state.world, rank))
    try:
        state.wait_turn(rank)
        with rank_process_group(comm), _memory.track(rank, reports):
            results[rank] = program(comm, *args, **kwargs)
            comm.transport.check_all_waited()   # a handle never waited on is an error
    except _Aborted:
        pass
    except BaseException as error:
        if not _caused_by_abort(error):
            state.rank_failed(rank, error)
    finally:
        state.rank_finished(rank)


def _caused_by_abort(error: BaseException | None) -> bool:
    """Whether ``error`` was raised while unwinding from an abort (a program may catch
    the abort and raise something else from it)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, _Aborted):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _describe_timeout(timeout: float | None, threads: list[threading.Thread], state: RunState) -> str:
    frames = sys._current_frames()
    lines = [f"the run did not finish within timeout={timeout} s; ranks still running:"]
    for rank, thread in enumerate(threads):
        if thread.is_alive() and rank not in state.finished:
            wait = state.blocked.get(rank)
            where = program_location(frames.get(thread.ident))
            lines.append(f"  rank {rank} " + (f"waits in {wait.what} " if wait else "computes ") + f"at {where}")
    return "\n".join(lines)


def _join(threads: list[threading.Thread]) -> None:
    """Wait for every rank thread; stop stragglers by raising ``_Aborted`` inside them."""
    for thread in threads:
        thread.join(_UNWIND_GRACE_S)
    for thread in threads:
        if thread.is_alive() and thread.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                       ctypes.py_object(_Aborted))
    for thread in threads:
        thread.join(_UNWIND_GRACE_S)
