"""The loop each worker process of a :class:`real.Cluster` runs (the child side of the launcher).

Workers are forked from a forkserver that has imported torch and this module
once (see :mod:`real.launcher`), so starting one costs a fork, not an import
of torch. CUDA is initialised here, in the worker, never in the forkserver.

A worker first takes the environment the Cluster was started with (the
forkserver's may be older), binds gloo to ``spec.socket_ifname``, joins the
process group and replies :class:`~real.messages.Ready` (or
:class:`~real.messages.StartFailed`). Then it serves its pipe until
:class:`~real.messages.Close` or until the pipe breaks (the parent has gone):

* :class:`~real.messages.Run`: reset the default random generators to the
  state of a fresh process, unpickle ``(program, args, kwargs)``, place every
  tensor argument on this rank's device, run ``program(comm, *args,
  **kwargs)`` and reply :class:`~real.messages.Finished` with the result
  (every tensor detached, on the CPU) or the exception, the trace records,
  the books (:meth:`real.transport.GroupCache.books`) and what the program
  printed. With ``check_port`` the communicator's transport is a
  :class:`real.checked.CheckedTransport` over that run's store.

Tensors travel by value (pickling), never through shared memory, so nothing
is left behind when a worker is killed.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import io
import math
import os
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from simcomm import memory
from simcomm.c10d.work import wait_returned
from simcomm.communicator import Communicator
from simcomm.sim.rank_random import FRESH_SEED

from . import messages, pickling
from .checked import CheckedTransport, Checker
from .checked_pg import run_process_groups
from .messages import Close, Finished, Ready, Run, StartFailed, WorkerSpec
from .process_group import device_for
from .transport import DistTransport, GroupCache

__all__ = ["worker_main", "FRESH_PROCESS_SEED", "reset_random_state"]

#: The seed every run starts from, here and on the simulator's virtual ranks
#: (:data:`simcomm.sim.rank_random.FRESH_SEED`, c10's ``default_rng_seed_val``), so a
#: program draws the same numbers on both backends and in every run.
FRESH_PROCESS_SEED = FRESH_SEED


def reset_random_state() -> None:
    """Reset the default CPU generator (and every CUDA generator, lazily) to a fresh process's state."""
    torch.manual_seed(FRESH_PROCESS_SEED)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to kill this process when the process that forked it (the forkserver, which
    lives as long as the Cluster's process) dies; exit at once if the owner is already gone."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    try:
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        os._exit(1)
    except PermissionError:
        pass


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
    _die_with_parent(spec.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C in a notebook is the parent's to handle
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
        cache = GroupCache()
    except BaseException as error:
        messages.send(conn, StartFailed(spec.rank, messages.encode_error(error)))
        return
    messages.send(conn, Ready(spec.rank, str(device)))
    try:
        _serve(conn, spec.rank, device, cache)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        dump_file.close()
    # Nothing is left to clean up: skip the interpreter's slow teardown of torch.
    sys.stdout.flush()
    sys.stderr.flush()
    conn.close()
    os._exit(0)


def _serve(conn: Connection, rank: int, device: torch.device, cache: GroupCache) -> None:
    while True:
        try:
            request = messages.receive(conn)
        except (EOFError, OSError):
            return                   # the parent has gone
        if isinstance(request, Close):
            return
        try:
            messages.send(conn, _run(request, rank, device, cache))
        except (EOFError, OSError):
            return


def _run(request: Run, rank: int, device: torch.device, cache: GroupCache) -> Finished:
    events: list | None = [] if request.tracing else None
    output = io.StringIO()           # what the program prints goes back to the parent
    check_store = checker = None
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            reset_random_state()
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
        result_blob = pickling.dumps(_to_cpu(result))
    except BaseException as error:
        return Finished(rank, None, messages.encode_error(error, skip_frames=1), events or [],
                        cache.books(), output.getvalue())
    finally:
        del check_store, checker
    return Finished(rank, result_blob, None, events or [], cache.books(), output.getvalue(), memory_report)
