"""The loop each worker process of a :class:`real.Cluster` runs (the child side of the launcher).

A worker joins the process group once, then serves requests from its pipe
until told to close or until the pipe breaks (the parent has gone):

* ``("run", (clock_zero, tracing, blob))``: ``blob`` is the cloudpickled
  ``(program, args, kwargs)``; the worker runs ``program(comm, *args,
  **kwargs)`` and replies ``("ok", rank, result_blob, events, books, output)``
  with every tensor of the result detached and moved to the CPU, or
  ``("error", rank, encoded_error, events, books, output)`` with the exception
  and its traceback text. ``books`` (:meth:`real.transport.GroupCache.books`)
  lets the parent tell whether the process groups are still in step;
  ``output`` is what the program printed (Python's stdout and stderr).
* ``("close", None)``: leave the process group and exit.

Every message is a pickled tuple sent with ``send_bytes``; tensors travel by
value (plain pickling), never through shared memory, so nothing is left
behind when a worker is killed.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import io
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map_only

from simcomm.communicator import Communicator

from .process_group import device_for
from .transport import DistTransport, GroupCache

__all__ = ["worker_main", "encode_error"]


def _die_with_parent() -> None:
    """Ask Linux to kill this process when the parent dies (no orphaned workers)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def encode_error(error: BaseException, skip_frames: int = 0) -> tuple:
    """``(pickled exception or None, type name, message, traceback text)`` of ``error``.

    ``skip_frames`` drops that many outermost frames (the worker's own call site).
    """
    tb = error.__traceback__
    for _ in range(skip_frames):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    text = "".join(traceback.format_exception(type(error), error, tb))
    try:
        blob = cloudpickle.dumps(error)
        pickle.loads(blob)           # an exception that cannot be rebuilt is sent as text only
    except Exception:
        blob = None
    return blob, f"{type(error).__module__}.{type(error).__qualname__}", str(error), text


def _send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(cloudpickle.dumps(message))


def _to_cpu(result: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.detach().cpu(), result)


def worker_main(rank: int, world_size: int, backend: str, port: int, conn: Connection,
                start_timeout: float, threads: int, stack_dump_path: str) -> None:
    """Entry point of worker ``rank`` (started with the spawn method)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C in a notebook is the parent's to handle
    dump_file = open(stack_dump_path, "w")
    faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)
    if backend == "gloo" and os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # gloo listens on loopback only
    torch.set_num_threads(threads)
    try:
        device = device_for(backend, rank)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=start_timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=max(start_timeout, 600.0)),
                                **({"device_id": device} if backend == "nccl" else {}))
        cache = GroupCache()
    except BaseException as error:
        _send(conn, ("init_error", rank, encode_error(error)))
        return
    _send(conn, ("ready", rank, str(device)))
    try:
        _serve(conn, rank, device, cache)
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
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return                   # the parent has gone
        if kind == "close":
            return
        clock_zero, tracing, blob = payload
        events: list | None = [] if tracing else None
        output = io.StringIO()       # what the program prints goes back to the parent
        try:
            with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                program, args, kwargs = cloudpickle.loads(blob)
                comm = Communicator(DistTransport(dist.group.WORLD, device, events=events,
                                                  clock_zero=clock_zero, cache=cache))
                result = program(comm, *args, **kwargs)
            result_blob = cloudpickle.dumps(_to_cpu(result))
        except BaseException as error:
            _send(conn, ("error", rank, encode_error(error, skip_frames=1), events or [], cache.books(),
                         output.getvalue()))
            continue
        _send(conn, ("ok", rank, result_blob, events or [], cache.books(), output.getvalue()))
