"""The loop each worker process of a :class:`real.Cluster` runs (the child side of the launcher).

Workers are forked from a forkserver that has imported torch and this module
once (see :mod:`real.launcher`), so starting one costs a fork, not an import
of torch. CUDA is initialised here, in the worker, never in the forkserver.

A worker first ties its life to the Cluster's process (:func:`die_with_parent`),
takes the environment the Cluster was started with (the forkserver's may be
older), binds gloo to ``spec.socket_ifname``, joins the process group and
replies :class:`~real.messages.Ready` (or :class:`~real.messages.StartFailed`).
Then it serves its pipe until :class:`~real.messages.Close` or until the pipe
breaks (the parent has gone):

* :class:`~real.messages.Run`: re-create the default process group if the
  last run destroyed it on every rank (``request.regroup``, see below), reset
  the default random generators to the state of a fresh process, unpickle
  ``(program, args, kwargs)``, place every tensor argument on this rank's
  device, run ``program(comm, *args, **kwargs)`` and reply
  :class:`~real.messages.Finished` with the result (every tensor detached, on
  the CPU) or the exception, the trace records, the books
  (:meth:`real.groups.GroupCache.books`), what the program printed and
  whether the default group is still there. With ``check_port`` the
  communicator's transport is a :class:`real.checked.CheckedTransport` over
  that run's store.

Results: small tensors travel pickled; a storage of 1 MiB or more travels
through an anonymous shared-memory file whose descriptor follows the
:class:`~real.messages.Finished` message (:func:`real.pickling.dumps_shared`).
The file has no name, so nothing is left behind when a worker is killed.

**A program may destroy the default group** (``dist.destroy_process_group()``
ends PyTorch's tensor-parallel examples). That ends the program's use of it,
as under torchrun; the next run gets a fresh default group, made in this
process on the Cluster's store under a new prefix (generation ``n``), with a
fresh :class:`~real.groups.GroupCache`.

**A program may start processes** (``DataLoader(num_workers=2)``): workers are
not daemonic. They die with the Cluster's process anyway, whatever they are
running: the forkserver's "alive" pipe is closed here, so the forkserver exits
when the Cluster's process does, and ``PR_SET_PDEATHSIG`` (Linux) then kills
the worker; a watchdog thread waiting on the Cluster's process (a pidfd, or a
poll where there is none) kills the worker's process group, which holds the
processes the program started, at once.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import io
import math
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from simcomm import memory
from simcomm.c10d.init_join import install_init_join
from simcomm.c10d.work import wait_returned
from simcomm.communicator import Communicator
from simcomm.fresh_state import DEFAULT_RUN_SEED, rank_seed, seed_process

from . import messages, pickling, startup
from .checked import CheckedTransport
from .checked_store import Checker
from .checked_pg import run_process_groups
from .messages import Close, Finished, Ready, Run, StartFailed, WorkerSpec
from .process_group import device_for
from .groups import GroupCache
from .transport import DistTransport

__all__ = ["worker_main", "reset_random_state", "die_with_parent"]

#: how often the watchdog looks at the Cluster's process where there is no pidfd (seconds)
_PARENT_POLL_S = 0.2

def reset_random_state(seed: int | None, rank: int) -> None:
    """Start a run from the state virtual rank ``rank`` starts from: torch's generators (CPU and
    CUDA), Python's ``random`` and NumPy's global ``np.random`` seeded with
    :func:`simcomm.fresh_state.rank_seed` of the run seed ``seed`` (``None``: the default one)."""
    seed_process(rank_seed(DEFAULT_RUN_SEED if seed is None else seed, rank))


def die_with_parent(parent_pid: int) -> bool:
    """Make this process (and the processes it starts, in its own process group) die within a
    fraction of a second of ``parent_pid``, the Cluster's process, whatever it is running.

    Three layers, for a parent killed with SIGKILL (a kernel restart, the OOM killer):

    * the forkserver's "alive" pipe end this worker inherited is closed, so the forkserver
      exits as soon as the Cluster's process is gone (it otherwise lives until every worker
      holding that end has exited, and the workers wait for it); a forkserver-context process
      this worker starts later gets a forkserver of its own;
    * ``PR_SET_PDEATHSIG`` (Linux): the kernel sends SIGKILL when the forking process (the
      forkserver, or the parent itself under ``spawn``) dies;
    * a watchdog thread blocks on a pidfd of ``parent_pid`` (or polls it every
      ``_PARENT_POLL_S`` s) and kills this worker's process group when it exits.

    Exits at once if ``parent_pid`` is already gone. Returns whether this process now leads a
    process group of its own (the Cluster then kills that group with it).
    """
    startup.forget_forkserver()
    with_group = False
    try:
        os.setpgid(0, 0)                     # a group of its own: the processes a program starts
        with_group = True
    except OSError:
        pass
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    try:
        pidfd = os.pidfd_open(parent_pid)
    except ProcessLookupError:
        _kill_own_group(with_group)
        return
    except (AttributeError, OSError):
        pidfd = None
        if not startup.process_alive(parent_pid):
            _kill_own_group(with_group)
    threading.Thread(target=_watch, args=(parent_pid, pidfd, with_group),
                     name="simcomm-parent-watchdog", daemon=True).start()
    return with_group


def _watch(parent_pid: int, pidfd: int | None, with_group: bool) -> None:
    if pidfd is not None:
        while True:
            try:
                readable, _, _ = select.select([pidfd], [], [])
            except InterruptedError:
                continue
            if readable:
                break
    else:
        original_ppid = os.getppid()
        while startup.process_alive(parent_pid) and os.getppid() == original_ppid:
            time.sleep(_PARENT_POLL_S)
    _kill_own_group(with_group)


def _kill_own_group(with_group: bool) -> None:
    """SIGKILL this process and, when it leads its process group, every process in that group."""
    if with_group and os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _to_cpu(result: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), result)


def _to_device(value: Any, device: torch.device) -> Any:
    """Every tensor in ``value`` on ``device`` (the unpickled arguments are this rank's own copies)."""
    def place(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == device:
            return tensor
        return tensor.detach().to(device).requires_grad_(tensor.requires_grad)

    return tree_map_only(torch.Tensor, place, value)


def _check_store(port: int, timeout: float) -> dist.TCPStore:
    seconds = timeout if math.isfinite(timeout) else 10 * 365 * 86400.0
    return dist.TCPStore("127.0.0.1", port, None, is_master=False,
                         timeout=datetime.timedelta(seconds=seconds))


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of worker ``spec.rank`` (started by the launcher's forkserver)."""
    own_group = die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C in a notebook is the parent's to handle
    # processes the program starts use the parent's start method (a forkserver child's default
    # would be the forkserver: a DataLoader's workers would start another one and pickle by name)
    multiprocessing.set_start_method(spec.start_method, force=True)
    os.environ.clear()
    os.environ.update(spec.environ)
    if spec.socket_ifname is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = spec.socket_ifname
    dump_file = open(spec.dump_path, "w")
    faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
    torch.set_num_threads(spec.threads)
    try:
        device = device_for(spec.backend, spec.rank)
        store = dist.TCPStore("127.0.0.1", spec.port, spec.world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=spec.start_timeout))
        dist.init_process_group(spec.backend, store=store, rank=spec.rank, world_size=spec.world_size,
                                timeout=datetime.timedelta(seconds=max(spec.start_timeout, 600.0)),
                                **({"device_id": device} if spec.backend == "nccl" else {}))
        install_init_join(process_world=True)   # a program's init_process_group joins this group
        cache = GroupCache()
    except BaseException as error:
        messages.send(conn, StartFailed(spec.rank, messages.encode_error(error)))
        return
    messages.send(conn, Ready(spec.rank, str(device), own_group))
    try:
        _serve(conn, spec, device, store, cache)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        dump_file.close()
    # Nothing is left to clean up: skip the interpreter's slow teardown of torch.
    sys.stdout.flush()
    sys.stderr.flush()
    conn.close()
    os._exit(0)


def _serve(conn: Connection, spec: WorkerSpec, device: torch.device, store: dist.Store,
           cache: GroupCache) -> None:
    while True:
        try:
            request = messages.receive(conn)
        except (EOFError, OSError):
            return                   # the parent has gone
        if isinstance(request, Close):
            return
        if request.regroup is not None and not dist.is_initialized():
            cache.close()            # the destroyed world's groups, hidden from its destroy_process_group
            try:
                cache = _regroup(spec, store, request.regroup, device)
            except BaseException as error:
                finished = Finished(spec.rank, None, messages.encode_error(error), [], cache.books(), "",
                                    default_group=False)
                try:
                    messages.send(conn, finished)
                except (EOFError, OSError):
                    return
                continue
        finished, fd = _run(request, spec.rank, device, cache)
        try:
            messages.send(conn, finished, fd)
        except (EOFError, OSError):
            return
        finally:
            if fd is not None:
                os.close(fd)


def _regroup(spec: WorkerSpec, store: dist.Store, generation: int, device: torch.device) -> GroupCache:
    """The default process group again, after a program destroyed it on every rank: a fresh one on
    the Cluster's store under the prefix of ``generation`` (the old group's keys are still there)."""
    dist.init_process_group(spec.backend, store=dist.PrefixStore(f"simcomm-regroup-{generation}/", store),
                            rank=spec.rank, world_size=spec.world_size,
                            timeout=datetime.timedelta(seconds=max(spec.start_timeout, 600.0)),
                            **({"device_id": device} if spec.backend == "nccl" else {}))
    return GroupCache()


def _run(request: Run, rank: int, device: torch.device, cache: GroupCache) -> tuple[Finished, int | None]:
    """Run the request's program; the Finished message and the descriptor of the shared-memory
    file holding its result's large storages (None when there are none)."""
    events: list | None = [] if request.tracing else None
    output = io.StringIO()           # what the program prints goes back to the parent
    check_store = checker = None
    fd = None
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            reset_random_state(request.seed, rank)
            program, args, kwargs = pickling.loads(request.program)
            args, kwargs = _to_device((args, kwargs), device)
            transport = DistTransport(dist.group.WORLD, device, events=events,
                                      clock_zero=request.clock_zero, cache=cache)
            if request.check_port is not None:
                check_store = _check_store(request.check_port, request.check_timeout)
                checker = Checker(check_store, dist.get_rank(), dist.get_world_size())
                transport = CheckedTransport(transport, checker)
            with run_process_groups(transport):     # dist.* checked and traced as comm.*
                if request.track_memory:
                    result, memory_report = memory.run_tracked(
                        rank, program, (Communicator(transport), *args), kwargs, device=device)
                else:
                    result, memory_report = program(Communicator(transport), *args, **kwargs), None
                result = wait_returned(result)      # a returned tensor is used, not unwaited
            if checker is not None:
                checker.ended()
        result_blob, fd, shared = pickling.dumps_shared(_to_cpu(result))
        del result
    except BaseException as error:
        if fd is not None:
            os.close(fd)
        return Finished(rank, None, messages.encode_error(error, skip_frames=1), events or [],
                        cache.books(), output.getvalue(), default_group=dist.is_initialized()), None
    finally:
        del check_store, checker
    return Finished(rank, result_blob, None, events or [], cache.books(), output.getvalue(), memory_report,
                    shared, dist.is_initialized()), fd
