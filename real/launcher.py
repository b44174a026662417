"""Run an SPMD program on real processes from a notebook: :func:`run` and :class:`Cluster`.

``Cluster(world_size)`` spawns one worker process per rank (spawn start
method), joins them in a ``torch.distributed`` process group whose rendezvous
store listens on 127.0.0.1 on a port the OS picks, and keeps them up between
calls, so a further :meth:`Cluster.run` costs milliseconds. :func:`run` is a
one-off Cluster.

The program travels by value (cloudpickle): a function defined in a notebook
cell, a closure or a lambda works. Every tensor in a rank's result comes back
detached, on the CPU. What a program prints comes back too, each line tagged
``[rank r]``, written to this process's stdout when the run ends.

Nothing is left behind on failure: when a rank raises, when a worker dies, or
when the run exceeds its timeout, every worker is killed and reaped and the
store's port is closed before the error is raised; the Cluster starts fresh
workers at its next run. One exception keeps the workers: every rank raised
and their books (:meth:`real.transport.GroupCache.books`) show each collective
and each send completed on all its ranks, as when every rank fails the same
argument check; then nothing is half delivered and the next run reuses them.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from multiprocessing import connection, get_context
from typing import Any

import cloudpickle
import torch.distributed as dist

from simcomm.errors import RankError, RunTimeoutError, SimcommError
from simcomm.trace import Trace

from . import pickling
from .process_group import pick_backend
from .stacks import describe_stacks
from .transport import books_agree
from .worker import worker_main

__all__ = ["Cluster", "Results", "run", "WorkerError"]

#: after the first rank raises, how long to wait for other ranks to report too
_ERROR_GRACE_S = 0.25


class WorkerError(SimcommError):
    """A worker process could not start or died without reporting an exception."""


class RemoteTraceback(Exception):
    """The traceback text of an exception raised in a worker process (set as its ``__cause__``)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n" + self.text.rstrip()


class RemoteError(Exception):
    """Stands in for a worker's exception that could not be sent back as itself."""


class Results(list):
    """The ranks' results in rank order (a list), with the run's :class:`~simcomm.trace.Trace` as ``.trace``."""

    trace: Trace


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """Start workers without re-running the parent's ``__main__`` in them.

    The spawn method normally imports the parent's main script in every child
    (so a script without an ``if __name__ == "__main__"`` guard would start
    clusters recursively). Workers receive their program by value and need
    nothing from ``__main__``, so its file and spec are hidden from
    :mod:`multiprocessing` while the children start.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _rebuild_error(encoded: tuple) -> BaseException:
    blob, type_name, message, text = encoded
    error: BaseException | None = None
    if blob is not None:
        try:
            error = cloudpickle.loads(blob)
        except Exception:
            error = None
    if not isinstance(error, BaseException):
        error = RemoteError(f"{type_name}: {message}")
    error.__cause__ = RemoteTraceback(text)
    return error


def _relay_output(printed: dict[int, str]) -> None:
    """Write what each rank's program printed to this process's stdout, each line tagged with its rank.

    The workers' own stdout is not the notebook's, so prints would otherwise be lost.
    """
    for rank in sorted(printed):
        text = printed[rank]
        if text:
            sys.stdout.write("".join(f"[rank {rank}] {line}" for line in text.splitlines(keepends=True)))
            if not text.endswith("\n"):
                sys.stdout.write("\n")
    sys.stdout.flush()


def _loopback_store() -> dist.TCPStore:
    """The rendezvous store, hosted by the parent, listening on 127.0.0.1 only.

    The listening socket is bound here (port 0: the OS picks a free port, so no
    race with other jobs) and handed to the store, which owns and closes it.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False,
                         master_listen_fd=sock.detach())


class _Worker:
    __slots__ = ("rank", "process", "conn", "dump_path")

    def __init__(self, rank: int, process, conn, dump_path: str):
        self.rank, self.process, self.conn, self.dump_path = rank, process, conn, dump_path


class Cluster:
    """``world_size`` worker processes in one process group, kept up between runs.

    >>> with Cluster(world_size=4) as cluster:
    ...     outs = cluster.run(program, *args)   # program(comm, *args) on every rank
    ...     cluster.trace                         # every rank's transport calls of that run

    ``backend=None`` picks NCCL when CUDA shows at least ``world_size`` GPUs
    (rank ``r`` on ``cuda:r``), else gloo on the CPU. ``timeout`` bounds each
    run (seconds); ``start_timeout`` bounds starting the workers. Workers
    start in the background at construction; the first run waits for them.
    """

    def __init__(self, world_size: int, backend: str | None = None, timeout: float = 60.0, *,
                 start_timeout: float = 120.0, trace: bool = True, threads: int | None = None):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"Cluster: world_size={world_size!r} must be a positive int")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"Cluster: timeout={timeout!r} must be positive seconds or None")
        self.world_size = world_size
        self.backend = pick_backend(world_size, backend)
        self.timeout = timeout
        self.start_timeout = start_timeout
        self.tracing = trace
        self.threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self.trace = Trace()
        self.devices: list[str] = []
        self._workers: list[_Worker] = []
        self._store: dist.TCPStore | None = None
        self._tmpdir: str | None = None
        self._ready = False
        self._closed = False
        self._start()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("ready" if self._ready else "starting")
        return f"Cluster(world_size={self.world_size}, backend={self.backend!r}, {state})"

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._kill()
        except Exception:
            pass

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers, in rank order."""
        return [w.process.pid for w in self._workers]

    # -- lifecycle --

    def _start(self) -> None:
        context = get_context("spawn")
        self._store = _loopback_store()
        self._tmpdir = tempfile.mkdtemp(prefix="simcomm-real-")
        self._workers = []
        with _main_module_hidden():
            self._spawn_workers(context)
        self._ready = False

    def _spawn_workers(self, context) -> None:
        for rank in range(self.world_size):
            parent_end, child_end = context.Pipe(duplex=True)
            dump_path = os.path.join(self._tmpdir, f"stack-{rank}.txt")
            process = context.Process(
                target=worker_main, name=f"simcomm-real-rank-{rank}", daemon=True,
                args=(rank, self.world_size, self.backend, self._store.port, child_end,
                      self.start_timeout, self.threads, dump_path))
            process.start()
            child_end.close()
            self._workers.append(_Worker(rank, process, parent_end, dump_path))

    def _await_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        devices: dict[int, str] = {}
        pending = {w.rank: w for w in self._workers}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted(pending)
                self._kill()
                raise WorkerError(f"Cluster: workers of ranks {ranks} did not join the "
                                  f"{self.backend} process group within start_timeout={self.start_timeout} s")
            for worker in self._poll(pending, remaining):
                message = self._receive(worker)
                if message is None:
                    code = self._exitcode(worker)
                    self._kill()
                    raise WorkerError(f"Cluster: the worker of rank {worker.rank} exited with code {code} "
                                      f"while starting")
                if message[0] == "init_error":
                    self._kill()
                    error = _rebuild_error(message[2])
                    raise RankError(worker.rank, error) from error
                devices[worker.rank] = message[2]
                del pending[worker.rank]
        self.devices = [devices[rank] for rank in range(self.world_size)]
        self._ready = True

    def close(self) -> None:
        """Stop the workers (politely, then by force) and close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                worker.conn.send_bytes(pickle.dumps(("close", None)))
            except OSError:
                pass
        for worker in self._workers:
            worker.process.join(5.0)
        self._kill()

    def _kill(self) -> None:
        """Kill and reap every worker, close the pipes and the store's port."""
        for worker in self._workers:
            if worker.process.is_alive():
                worker.process.kill()
        for worker in self._workers:
            worker.process.join(10.0)
            worker.conn.close()
        self._workers = []
        self._ready = False
        self._store = None             # dropping the last reference shuts the server down
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # -- running --

    def run(self, program: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> Results:
        """Run ``program(comm, *args, **kwargs)`` on every rank; return the results in rank order.

        Blocks until every rank has returned, or raises
        :class:`~simcomm.errors.RankError` (a rank raised; its traceback is in
        the message and the exception is the ``__cause__``),
        :class:`~simcomm.errors.RunTimeoutError` (``timeout`` passed; the
        message names the ranks still running and where they are) or
        :class:`WorkerError` (a worker died). After an error the workers are
        killed and the next run starts new ones, unless every rank raised with
        all its communication completed (then they stay). ``timeout`` (seconds)
        overrides the Cluster's for this run; it is not passed to the program.
        """
        if self._closed:
            raise RuntimeError("Cluster.run: the cluster is closed")
        timeout = self.timeout if timeout is None else timeout
        blob = pickling.dumps((program, args, kwargs))      # an unpicklable program fails here, harmlessly
        if not self._workers:
            self._start()
        try:
            if not self._ready:
                self._await_ready()
            message = pickle.dumps(("run", (time.perf_counter(), self.tracing, blob)))
            for worker in self._workers:
                worker.conn.send_bytes(message)
            return self._collect(timeout)
        except (RankError, RunTimeoutError, WorkerError):
            raise                       # _collect has decided whether the workers can stay
        except BaseException:
            self._kill()                # KeyboardInterrupt or any other failure: leave nothing running
            raise

    def _collect(self, timeout: float | None) -> Results:
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = {w.rank: w for w in self._workers}
        results: list[Any] = [None] * self.world_size
        events: list = []          # trace records, in the transports' format
        errors: list[tuple[int, BaseException]] = []
        dead: list[tuple[int, int | None]] = []
        books: dict[int, tuple] = {}
        printed: dict[int, str] = {}
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            ready = self._poll(pending, remaining)
            for worker in ready:
                message = self._receive(worker)
                del pending[worker.rank]
                if message is None:
                    dead.append((worker.rank, self._exitcode(worker)))
                elif message[0] == "ok":
                    results[worker.rank] = cloudpickle.loads(message[2])
                    events.extend(message[3])
                    books[worker.rank], printed[worker.rank] = message[4], message[5]
                else:
                    errors.append((worker.rank, _rebuild_error(message[2])))
                    events.extend(message[3])
                    books[worker.rank], printed[worker.rank] = message[4], message[5]
            if (errors or dead) and pending:
                grace = time.monotonic() + _ERROR_GRACE_S
                deadline = grace if deadline is None else min(deadline, grace)
        self.trace = Trace(events)
        _relay_output(printed)
        if pending and not dead and not errors:
            message_on_timeout = self._describe_timeout(timeout, sorted(pending))   # before the kill
        if dead:                     # a dead worker first: the other ranks' errors are its echo
            rank, code = dead[0]
            self._kill()
            echoes = "".join(f"; rank {r} then raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                             for r, e in errors)
            raise WorkerError(f"Cluster.run: the worker of rank {rank} exited with code {code} without "
                              f"reporting a result (ranks still running: {sorted(pending)}){echoes}")
        in_step = not pending and not dead and books_agree(books)
        if not in_step:
            self._kill()             # never reuse process groups with half-finished communication
        if errors:
            (rank, error), others = errors[0], tuple(r for r, _ in errors[1:])
            raise RankError(rank, error, others) from error
        if pending:
            raise RunTimeoutError(message_on_timeout)
        out = Results(results)
        out.trace = self.trace
        return out

    def _describe_timeout(self, timeout: float | None, waiting: list[int]) -> str:
        finished = [r for r in range(self.world_size) if r not in waiting]
        lines = [f"Cluster.run: the run did not finish within timeout={timeout} s; ranks still "
                 f"waiting: {waiting} (finished: {finished})"]
        stacks = describe_stacks([w for w in self._workers if w.rank in waiting])
        for rank in waiting:
            lines.append(f"  rank {rank}, most recent call first:")
            lines.extend(f"    {line}" for line in stacks.get(rank, ["<no stack available>"]))
        return "\n".join(lines)

    # -- pipes --

    @staticmethod
    def _poll(pending: dict[int, _Worker], timeout: float | None) -> list[_Worker]:
        """Workers in ``pending`` with a message or an exited process, waiting up to ``timeout``."""
        by_handle: dict[Any, _Worker] = {}
        for worker in pending.values():
            by_handle[worker.conn] = worker
            by_handle[worker.process.sentinel] = worker
        ready = connection.wait(list(by_handle), timeout)
        seen: dict[int, _Worker] = {}
        for handle in ready:
            worker = by_handle[handle]
            seen[worker.rank] = worker
        return list(seen.values())

    @staticmethod
    def _receive(worker: _Worker) -> tuple | None:
        """The worker's next message, or ``None`` if it exited without one."""
        try:
            if worker.conn.poll(0 if not worker.process.is_alive() else 1.0):
                return pickle.loads(worker.conn.recv_bytes())
        except (EOFError, OSError):
            return None
        return None

    @staticmethod
    def _exitcode(worker: _Worker) -> int | None:
        worker.process.join(1.0)
        return worker.process.exitcode


def run(program: Callable[..., Any], *args: Any, world_size: int, backend: str | None = None,
        timeout: float = 60.0, **kwargs: Any) -> Results:
    """Run ``program(comm, *args, **kwargs)`` once on ``world_size`` fresh processes.

    A :class:`Cluster` that lives for this call only; see :meth:`Cluster.run`
    for the results (``.trace`` holds every rank's trace) and the errors.
    """
    with Cluster(world_size, backend=backend, timeout=timeout) as cluster:
        return cluster.run(program, *args, **kwargs)
