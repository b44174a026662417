"""Run an SPMD program on real processes from a notebook: :func:`run` and :class:`Cluster`.

``Cluster(world_size)`` starts one worker process per rank, joins them in a
``torch.distributed`` process group whose rendezvous store listens on
127.0.0.1 on a port the OS picks, and keeps them up between calls, so a
further :meth:`Cluster.run` costs milliseconds. :func:`run` is a one-off
Cluster.

**Fast start.** Workers are forked from a forkserver (:mod:`multiprocessing`'s,
started once per Python process) that has imported torch and
:mod:`real.worker` beforehand, so a worker costs a fork instead of an import
of torch. The forkserver never touches CUDA; each worker initialises its
own. A worker takes the environment of the moment its Cluster started it
(variables torch reads only while it is imported keep the forkserver's values),
and dies with the forkserver, which dies with this process: no thread of
this process owns a worker, so a run from a short-lived thread is safe. In an
interactive session ``import real`` starts the forkserver in the background
(:func:`real.prestart`), so the first Cluster does not wait for torch's import.

**Workers die with this process** and may start processes of their own. They
are not daemonic (a ``DataLoader(num_workers=2)`` in a program works); at
interpreter exit the workers of every Cluster not closed are killed, and a
worker killed by its Cluster takes its process group (the processes its program
started) with it. When this process dies without cleaning up (SIGKILL, a kernel
restart, the OOM killer), every worker dies within a fraction of a second,
whatever it is running (:func:`real.worker.die_with_parent`).

**After os.fork()** a Cluster belongs to the process that made it: in the child
its :meth:`Cluster.run` raises :class:`~simcomm.errors.WorkerError` naming the fork (its workers
serve the parent), its :meth:`Cluster.close` does nothing, and a new Cluster in
the child works (with a forkserver of its own).

**Large results** come back through shared memory (:func:`real.pickling.dumps_shared`):
a rank's tensors of 1 MiB or more are copied once, by the worker, into an
anonymous shared-memory file that this process maps, so they cost one copy at
memory speed and this process holds one copy of them.

**A program that destroys the default group** (``dist.destroy_process_group()``
at its end, as PyTorch's examples do) ends its own use of it; the next run gets
a fresh default group, as the next torchrun launch would. If only some ranks
destroyed it, the next run starts fresh workers.

The program travels by value (cloudpickle): a function defined in a notebook
cell, a closure or a lambda works. Every tensor argument is placed on the
rank's device (``cuda:rank`` under NCCL), each rank's default random
generators start every run from the state of a fresh process, every tensor
in a rank's result comes back detached, on the CPU, and what a program prints
comes back, each line tagged ``[rank r]``.

**Checked mode** (on by default): each collective's op, shapes, dtypes,
root and reduction, and each send/recv pair's shape and dtype, are compared
across ranks before any data moves (:mod:`real.checked`); a mismatch raises
:class:`simcomm.CollectiveMismatchError` naming the ranks and program lines.

Nothing is left behind on failure: when a rank raises, when a worker dies, or
when the run exceeds its timeout, every worker is killed and reaped and the
store's port is closed before the error is raised; the Cluster starts fresh
workers at its next run (also after :meth:`Cluster.close`). One exception
keeps the workers: every rank raised and their books
(:meth:`real.groups.GroupCache.books`) show each collective and each send
completed on all its ranks, as when every rank fails the same argument check
or a checked mismatch stops every rank before any data moved.
"""
from __future__ import annotations

import atexit
import math
import mmap
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from multiprocessing import connection
from typing import Any

import torch.distributed as dist

from simcomm.errors import (
    CollectiveMismatchError,
    DeadlockError,
    RankError,
    RemoteError,
    RemoteTraceback,
    ResultError,
    RunTimeoutError,
    WorkerError,
)
from simcomm.fresh_state import run_seed
from simcomm.memory import MemoryReport
from simcomm.trace import Trace

from . import messages, pickling, startup
from .checked_store import find_deadlock
from .messages import Close, EncodedError, Finished, Ready, Run, StartFailed, WorkerSpec
from .process_group import pick_backend
from .stacks import describe_stacks
from .groups import books_agree
from .worker import worker_main

__all__ = ["Cluster", "Results", "run"]

#: after the first rank raises, how long to wait for other ranks to report too
_ERROR_GRACE_S = 1.0
#: how much longer than the run a checked-mode wait may take (the run's timeout fires first)
_CHECK_MARGIN_S = 30.0
#: how often a checked run looks for ranks that wait on each other (seconds)
_DEADLOCK_POLL_S = 0.5

#: every Cluster of this process with workers (their workers are killed at interpreter exit)
_LIVE_CLUSTERS: weakref.WeakSet[Cluster] = weakref.WeakSet()
#: the stores of Clusters a forked child inherited: never destroyed there (their server threads
#: live in the parent only), kept until the child exits
_INHERITED_STORES: list = []


class Results(list):
    """The ranks' results in rank order (a list), with the run's :class:`~simcomm.trace.Trace` as
    ``.trace`` and, for a Cluster made with ``memory=True``, the bytes each rank held as ``.memory``
    (a :class:`simcomm.memory.MemoryReport`; ``None`` otherwise)."""

    trace: Trace
    memory: MemoryReport | None = None


def _check_timeout(value: float | None, where: str) -> float | None:
    """``value`` as seconds, or None for no timeout (``None`` or ``inf``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: timeout={value!r} must be positive seconds, inf or None")
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{where}: timeout={value!r} must be positive seconds, inf or None")
    return None if math.isinf(value) else float(value)


def _rebuild_error(encoded: EncodedError) -> BaseException:
    error: BaseException | None = None
    if encoded.blob is not None:
        try:
            error = pickling.loads(encoded.blob)
        except Exception:
            error = None
    if not isinstance(error, BaseException):
        error = RemoteError(f"{encoded.type_name}: {encoded.message}")
    error.__cause__ = RemoteTraceback(encoded.traceback)
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


class _Worker:
    __slots__ = ("rank", "process", "conn", "dump_path", "own_group")

    def __init__(self, rank: int, process, conn, dump_path: str):
        self.rank, self.process, self.conn, self.dump_path = rank, process, conn, dump_path
        self.own_group = False        # leads a process group of its own (said in its Ready)


class Cluster:
    """``world_size`` worker processes in one process group, kept up between runs.

    >>> with Cluster(world_size=4) as cluster:
    ...     outs = cluster.run(program, *args)   # program(comm, *args) on every rank
    ...     cluster.trace                         # every rank's transport calls of that run

    ``backend=None`` picks NCCL when CUDA shows at least ``world_size`` GPUs
    (rank ``r`` on ``cuda:r``), else gloo on the CPU. ``timeout`` bounds each
    run (seconds; ``None`` or ``inf``: no bound); ``start_timeout`` bounds
    starting the workers. ``checked`` compares every call across ranks before
    it runs (:mod:`real.checked`). gloo binds to ``socket_ifname`` (default
    the loopback interface ``"lo"``, whatever ``GLOO_SOCKET_IFNAME`` says in
    this process's environment), or to the interface named (``None``: leave
    ``GLOO_SOCKET_IFNAME`` as the environment has it). ``start_method``:
    ``"forkserver"`` (fast: workers are forked from a process that imported
    torch once) or ``"spawn"`` (each worker a fresh interpreter importing torch
    itself: seconds per worker; on Linux its workers die with the thread that
    started them). Workers start at construction; the first run
    waits until they have joined the process group. ``memory=True`` measures
    the bytes each rank's program holds, as ``World(n, memory=True)`` does
    (:mod:`simcomm.memory`; under CUDA with ``torch.cuda.max_memory_allocated``
    too): after a run, ``cluster.memory`` and ``results.memory``.

    Runs from several threads are serialised: each caller gets its own
    results, a second caller waits until the run in progress has finished
    (at most its timeout). A closed Cluster starts fresh workers at its next
    run, so re-running a notebook cell after the one that closed it works.
    """

    def __init__(self, world_size: int, backend: str | None = None, timeout: float | None = 60.0, *,
                 start_timeout: float = 120.0, trace: bool = True, threads: int | None = None,
                 checked: bool = True, socket_ifname: str | None = "lo", start_method: str = "forkserver",
                 memory: bool = False):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"Cluster: world_size={world_size!r} must be a positive int")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"Cluster: start_method={start_method!r} must be 'forkserver' or 'spawn'")
        self.world_size = world_size
        self.start_method = start_method
        self.backend = pick_backend(world_size, backend)
        self.timeout = _check_timeout(timeout, "Cluster")
        self.start_timeout = _check_timeout(start_timeout, "Cluster (start_timeout)") or 10 * 365 * 86400.0
        self.tracing = trace
        self.checked = bool(checked)
        self.track_memory = bool(memory)
        self.memory: MemoryReport | None = None
        self.socket_ifname = startup.default_ifname() if socket_ifname == "lo" else socket_ifname
        self.threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        self.trace = Trace()
        self.devices: list[str] = []
        self._workers: list[_Worker] = []
        self._store: dist.TCPStore | None = None
        self._tmpdir: str | None = None
        self._ready = False
        self._closed = False
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._regroup: int | None = None          # the default group to make at the next run
        self._generation = 0
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
        startup.clean_stale_tmpdirs()
        context, slow = startup.worker_context(self.start_method)
        startup.notice(f"real.Cluster: starting {self.world_size} {self.backend} worker processes{slow}",
                       visible=bool(slow))
        self._store = startup.loopback_store()
        self._tmpdir = tempfile.mkdtemp(prefix=f"{startup.TMP_PREFIX}{os.getpid()}-")
        self._workers = []
        self._ready = False
        environ = dict(os.environ)
        with startup.hide_main():
            for rank in range(self.world_size):
                parent_end, child_end = context.Pipe(duplex=True)
                dump_path = os.path.join(self._tmpdir, f"stack-{rank}.txt")
                spec = WorkerSpec(rank, self.world_size, self.backend, self._store.port, self.start_timeout,
                                  self.threads, dump_path, environ, self.socket_ifname, os.getpid(),
                                  multiprocessing.get_start_method(allow_none=True))
                # not daemonic: a program may start processes (a DataLoader's workers); the
                # workers die with this process all the same (_kill_all_at_exit, die_with_parent)
                process = context.Process(target=worker_main, name=f"simcomm-real-rank-{rank}",
                                          daemon=False, args=(spec, child_end))
                process.start()
                child_end.close()
                self._workers.append(_Worker(rank, process, parent_end, dump_path))
        self._regroup = None
        _LIVE_CLUSTERS.add(self)

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
                if isinstance(message, StartFailed):
                    self._kill()
                    error = _rebuild_error(message.error)
                    raise RankError(worker.rank, error) from error
                assert isinstance(message, Ready), message
                devices[worker.rank] = message.device
                worker.own_group = message.own_group
                del pending[worker.rank]
        self.devices = [devices[rank] for rank in range(self.world_size)]
        self._ready = True

    def close(self) -> None:
        """Stop the workers (politely, then by force) and close the store. Idempotent.

        Waits for a run in progress on another thread. A later :meth:`run`
        starts fresh workers.
        """
        if self._forked():
            return                          # the workers serve the parent; nothing here to stop
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for worker in self._workers:
                try:
                    messages.send(worker.conn, Close())
                except OSError:
                    pass
            for worker in self._workers:
                worker.process.join(5.0)
            self._kill()

    def _forked(self) -> bool:
        """Whether this process is a fork of the one that made this Cluster."""
        return os.getpid() != self._owner_pid

    def _forget_in_forked_child(self) -> None:
        """In a child of os.fork(): drop the parent's workers without touching them (close this
        process's copies of their pipes, so their end of the pipe still breaks when the parent
        goes), and keep the inherited store alive but unused."""
        for worker in self._workers:
            try:
                worker.conn.close()
            except OSError:
                pass
        self._workers = []
        self._ready = False
        if self._store is not None:
            _INHERITED_STORES.append(self._store)
        self._store = None
        self._tmpdir = None                 # the parent's folder

    def _kill(self) -> None:
        """Kill and reap every worker (with the processes its program started), close the pipes and
        the store's port."""
        if self._forked():
            return
        _LIVE_CLUSTERS.discard(self)
        for worker in self._workers:        # also after a clean exit: what its program left running
            _kill_worker(worker)
        for worker in self._workers:
            worker.process.join(10.0)
            worker.conn.close()
        self._workers = []
        self._ready = False
        self._store = None             # dropping the last reference shuts the server down
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def _restart_dead_idle_workers(self) -> None:
        """Workers that died between runs (killed, out of memory): start fresh ones, with a warning."""
        dead = [(w.rank, w.process.exitcode) for w in self._workers if not w.process.is_alive()]
        if dead:
            warnings.warn(f"Cluster.run: the worker of rank {dead[0][0]} exited with code {dead[0][1]} "
                          f"between runs; starting fresh workers", RuntimeWarning, stacklevel=3)
            self._kill()
            self._start()

    # -- running --

    def run(self, program: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> Results:
        """Run ``program(comm, *args, **kwargs)`` on every rank; return the results in rank order.

        Every rank gets its own copy of the arguments, its tensors on the
        rank's device; the program may modify them. Blocks until every rank
        has returned, or raises :class:`~simcomm.errors.CollectiveMismatchError`
        (checked mode: ranks disagree on a call; the message names their
        lines), :class:`~simcomm.errors.RankError` (a rank raised; its
        traceback is in the message and the exception is the ``__cause__``),
        :class:`~simcomm.errors.RunTimeoutError` (``timeout`` passed; the
        message names the ranks still running and where they are),
        :class:`~simcomm.errors.WorkerError` (a worker died) or :class:`~simcomm.errors.ResultError` (a
        result cannot be unpickled here). After an error the workers are
        killed and the next run starts new ones, unless every rank raised
        with all its communication completed (then they stay). ``timeout``
        (seconds, ``inf`` for none) overrides the Cluster's for this run; it
        is not passed to the program. Runs from several threads take turns.
        A result's tensors of 1 MiB or more come back in shared memory (one
        copy, no pickled bytes): their storages cannot be resized, as those
        :mod:`torch.multiprocessing` delivers. In a child of ``os.fork()``
        this Cluster's ``run`` raises :class:`~simcomm.errors.WorkerError`: make a new one there.
        """
        if self._forked():
            raise WorkerError(f"Cluster.run: this Cluster was made by process {self._owner_pid}, and this "
                              f"process ({os.getpid()}) is a fork of it (os.fork()); its workers serve the "
                              f"process that started them. Make a new real.Cluster in this process")
        timeout = self.timeout if timeout is None else _check_timeout(timeout, "Cluster.run")
        blob = pickling.dumps((program, args, kwargs))      # an unpicklable program fails here, harmlessly
        with self._lock:
            if self._closed:
                self._closed = False          # a closed Cluster starts fresh workers
            if not self._workers:
                self._start()
            check_store = None
            try:
                if not self._ready:
                    self._await_ready()
                self._restart_dead_idle_workers()
                if not self._ready:
                    self._await_ready()
                if self.checked and self.world_size > 1:
                    check_store = startup.loopback_store()
                request = Run(blob, time.perf_counter(), self.tracing,
                              check_store.port if check_store is not None else None,
                              math.inf if timeout is None else timeout + _CHECK_MARGIN_S, self.track_memory,
                              self._regroup, run_seed())
                for worker in self._workers:
                    try:
                        messages.send(worker.conn, request)
                    except OSError as error:
                        code = self._exitcode(worker)
                        self._kill()
                        raise WorkerError(f"Cluster.run: could not reach the worker of rank {worker.rank} "
                                          f"(exit code {code}): {type(error).__name__}: {error}; the next "
                                          f"run starts fresh workers") from error
                return self._collect(timeout, check_store)
            except (RankError, RunTimeoutError, WorkerError, CollectiveMismatchError, DeadlockError, ResultError):
                raise                       # _collect has decided whether the workers can stay
            except BaseException:
                self._kill()                # KeyboardInterrupt or any other failure: leave nothing running
                raise
            finally:
                del check_store             # the checks' keys go with their store

    def _collect(self, timeout: float | None, check_store=None) -> Results:
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = {w.rank: w for w in self._workers}
        finished: dict[int, Finished] = {}
        mappings: dict[int, mmap.mmap] = {}
        dead: list[tuple[int, int | None]] = []
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            if check_store is not None:          # look for ranks waiting on each other twice a second
                remaining = _DEADLOCK_POLL_S if remaining is None else min(remaining, _DEADLOCK_POLL_S)
            ready = self._poll(pending, remaining)
            if not ready and check_store is not None and not dead and not _finished_with_error(finished):
                deadlock = find_deadlock(check_store, sorted(pending))
                if deadlock is not None:
                    self._relay_and_trace(finished)
                    self._kill()
                    raise DeadlockError(deadlock)
            for worker in ready:
                message = self._receive(worker)
                del pending[worker.rank]
                if isinstance(message, Finished) and message.shared is not None:
                    mapping = self._receive_shared(worker, message)
                    if mapping is None:
                        message = None
                    else:
                        mappings[worker.rank] = mapping
                if isinstance(message, Finished):
                    finished[worker.rank] = message
                else:
                    dead.append((worker.rank, self._exitcode(worker)))
            if (dead or _finished_with_error(finished)) and pending:
                grace = time.monotonic() + _ERROR_GRACE_S
                deadline = grace if deadline is None else min(deadline, grace)
        self._relay_and_trace(finished)
        errors = [(rank, _rebuild_error(m.error)) for rank, m in sorted(finished.items()) if m.error is not None]
        if pending and not dead and not errors:
            message_on_timeout = self._describe_timeout(timeout, sorted(pending))   # before the kill
        if dead:                     # a dead worker first: the other ranks' errors are its echo
            rank, code = dead[0]
            self._kill()
            echoes = "".join(f"; rank {r} then raised {type(e).__name__}: {_first_line(e)}" for r, e in errors)
            raise WorkerError(f"Cluster.run: the worker of rank {rank} exited with code {code} without "
                              f"reporting a result (ranks still running: {sorted(pending)}){echoes}")
        in_step = (not pending and books_agree({rank: m.books for rank, m in finished.items()})
                   and self._plan_default_group(finished))
        if not in_step:
            self._kill()             # never reuse process groups with half-finished communication
        mismatches = [error for _, error in errors if isinstance(error, (CollectiveMismatchError, DeadlockError))]
        if mismatches:
            raise mismatches[0].with_traceback(None) from None   # the same message as the simulator's
        if errors:
            (rank, error), others = errors[0], tuple(r for r, _ in errors[1:])
            raise RankError(rank, error, others) from error
        if pending:
            raise RunTimeoutError(message_on_timeout)
        results: list[Any] = []
        for rank in range(self.world_size):
            try:
                results.append(pickling.loads_shared(finished[rank].result, mappings.get(rank),
                                                     finished[rank].shared))
            except Exception as error:
                raise ResultError(f"Cluster.run: the result of rank {rank} could not be unpickled in this "
                                  f"process: {type(error).__name__}: {_first_line(error)}; return plain "
                                  f"data (tensors, numbers, lists, dicts) or types this process can import"
                                  ) from error
        out = Results(results)
        out.trace = self.trace
        reports = [finished[rank].memory for rank in range(self.world_size)]
        self.memory = MemoryReport.from_dicts(reports) if self.track_memory else None
        out.memory = self.memory
        return out

    def _plan_default_group(self, finished: dict[int, Finished]) -> bool:
        """After a run: whether the workers can serve the next one as to their default group. A
        program that destroyed it on every rank gets a fresh one made at the next run (a new
        generation); one destroyed on some ranks only means fresh workers (False)."""
        kept = [message.default_group for message in finished.values()]
        if all(kept):
            self._regroup = None
            return True
        if any(kept):
            return False
        self._generation += 1                 # every generation its own keys in the store
        self._regroup = self._generation
        return True

    def _relay_and_trace(self, finished: dict[int, Finished]) -> None:
        self.trace = Trace([event for rank in sorted(finished) for event in finished[rank].events],
                           backend=self.backend)
        _relay_output({rank: m.output for rank, m in finished.items()})

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
    def _receive(worker: _Worker) -> Any:
        """The worker's next message, or ``None`` if it exited without one."""
        try:
            if worker.conn.poll(0 if not worker.process.is_alive() else 1.0):
                return messages.receive(worker.conn)
        except (EOFError, OSError):
            return None
        return None

    @staticmethod
    def _receive_shared(worker: _Worker, message: Finished) -> mmap.mmap | None:
        """Map the shared-memory file that follows ``message`` on the pipe (None if it broke)."""
        try:
            fd = messages.receive_fd(worker.conn)
        except (EOFError, OSError, RuntimeError):
            return None
        try:
            return pickling.map_shared(fd, message.shared)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    @staticmethod
    def _exitcode(worker: _Worker) -> int | None:
        worker.process.join(1.0)
        return worker.process.exitcode


def _kill_worker(worker: _Worker) -> None:
    """SIGKILL a worker and its process group (the processes its program started, even after
    the worker itself exited: the group's id stays reserved while a member lives), or the
    worker alone before it has said it made its group."""
    if worker.own_group or _leads_its_group(worker.process.pid):
        try:
            os.killpg(worker.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if worker.process.is_alive():
        worker.process.kill()


def _leads_its_group(pid: int | None) -> bool:
    try:
        return pid is not None and os.getpgid(pid) == pid
    except (ProcessLookupError, PermissionError):
        return False


def _kill_all_at_exit() -> None:
    """At interpreter exit, kill the workers of every Cluster not closed. Registered after
    multiprocessing's own exit handler, so it runs first: that handler joins every non-daemonic
    child, and the workers would wait for their pipe forever."""
    for cluster in list(_LIVE_CLUSTERS):
        try:
            cluster._kill()
        except Exception:
            pass


def _after_fork_in_child() -> None:
    for cluster in list(_LIVE_CLUSTERS):
        cluster._forget_in_forked_child()
    _LIVE_CLUSTERS.clear()
    startup.forget_forkserver()


atexit.register(_kill_all_at_exit)
os.register_at_fork(after_in_child=_after_fork_in_child)


def _finished_with_error(finished: dict[int, Finished]) -> bool:
    return any(message.error is not None for message in finished.values())


def _first_line(error: BaseException) -> str:
    try:
        text = str(error)
    except Exception:
        text = f"<{type(error).__name__} whose str() raised>"
    return (text.splitlines() or [""])[0][:200]


def run(program: Callable[..., Any], *args: Any, world_size: int, backend: str | None = None,
        timeout: float | None = 60.0, checked: bool = True, **kwargs: Any) -> Results:
    """Run ``program(comm, *args, **kwargs)`` once on ``world_size`` fresh processes.

    A :class:`Cluster` that lives for this call only; see :meth:`Cluster.run`
    for the results (``.trace`` holds every rank's trace) and the errors.
    ``checked`` as for :class:`Cluster`.
    """
    with Cluster(world_size, backend=backend, timeout=timeout, checked=checked) as cluster:
        return cluster.run(program, *args, **kwargs)
