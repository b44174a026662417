"""What a :class:`real.Cluster` and its workers say to each other over their pipes.

Every message is a small dataclass sent with :func:`send` and read with
:func:`receive` (plain :mod:`pickle` of the dataclass: one serialiser path).
What the user's program is made of (the program and its arguments, a rank's
result, an exception) travels inside as ``bytes`` that :mod:`real.pickling`
produced, so a result the parent cannot rebuild is reported as such, with its
rank, instead of breaking the message around it.

Parent to worker: :class:`Run`, :class:`Close`.
Worker to parent: :class:`Ready` or :class:`StartFailed` once, then one
:class:`Finished` per :class:`Run`. A :class:`Finished` whose ``shared`` is set
is followed on the pipe by one file descriptor (:func:`send` with ``fd``,
:func:`receive_fd`): the shared-memory file holding the result's large
storages (:func:`real.pickling.dumps_shared`).
"""
from __future__ import annotations

import pickle
import traceback
from multiprocessing import reduction
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from simcomm.errors import safe_str

from . import pickling
from .pickling import SharedStorages

__all__ = ["WorkerSpec", "Run", "Close", "Ready", "StartFailed", "Finished", "EncodedError",
           "encode_error", "send", "receive", "receive_fd"]


@dataclass(frozen=True)
class WorkerSpec:
    """How to start worker ``rank`` (the argument of :func:`real.worker.worker_main`)."""

    rank: int
    world_size: int
    backend: str
    port: int                      # the rendezvous store, on 127.0.0.1
    start_timeout: float
    threads: int                   # torch.set_num_threads in the worker
    dump_path: str                 # where faulthandler writes the worker's stacks
    environ: dict[str, str]        # the parent's environment when the Cluster started the worker
    socket_ifname: str | None      # GLOO_SOCKET_IFNAME of the worker (None: leave it unset)
    parent_pid: int                # the process that owns the Cluster
    start_method: str | None = None  # the parent's multiprocessing start method (None: the default)


@dataclass(frozen=True)
class EncodedError:
    """An exception raised in a worker: itself (``blob``, when it survives pickling) and as text."""

    blob: bytes | None
    type_name: str
    message: str
    traceback: str


@dataclass(frozen=True)
class Run:
    """Run ``program(comm, *args, **kwargs)``; ``program`` is the :mod:`real.pickling` blob of
    ``(program, args, kwargs)``."""

    program: bytes
    clock_zero: float              # time.perf_counter() value trace times count from
    tracing: bool
    check_port: int | None         # the checked mode's store for this run (None: unchecked)
    check_timeout: float           # how long a check waits for its peers (seconds)
    track_memory: bool = False     # measure the bytes the program holds (simcomm.memory)
    regroup: int | None = None     # the default group is gone on every rank: make generation n first
    seed: int | None = None        # the run seed (simcomm.fresh_state.run_seed); None: the default


@dataclass(frozen=True)
class Close:
    """Leave the process group and exit."""


@dataclass(frozen=True)
class Ready:
    rank: int
    device: str
    own_group: bool = False        # the worker leads a process group of its own (real.worker.die_with_parent)


@dataclass(frozen=True)
class StartFailed:
    rank: int
    error: EncodedError


@dataclass(frozen=True)
class Finished:
    """The end of one :class:`Run` on one rank: ``result`` (a :mod:`real.pickling` blob) or ``error``."""

    rank: int
    result: bytes | None
    error: EncodedError | None
    events: list = field(default_factory=list)   # trace records, in the transports' format
    books: tuple = (False, {})                   # real.groups.GroupCache.books()
    output: str = ""                             # what the program printed
    memory: dict | None = None                   # simcomm.memory.RankMemory.to_dict(), when tracked
    shared: SharedStorages | None = None         # the result's large storages; their file follows
    default_group: bool = True                   # this rank still has its default process group



def encode_error(error: BaseException, skip_frames: int = 0) -> EncodedError:
    """``error`` as :class:`EncodedError`; ``skip_frames`` drops that many outermost frames.

    The exception itself travels only when it survives a pickling round trip and
    its ``str()`` works; otherwise the parent rebuilds a stand-in from the text.
    """
    tb = error.__traceback__
    for _ in range(skip_frames):
        if tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
    try:
        text = "".join(traceback.format_exception(type(error), error, tb))
    except Exception:
        text = f"{type(error).__qualname__} (its traceback could not be formatted)\n"
    message = safe_str(error)
    blob: bytes | None
    try:
        str(error)
        blob = pickling.dumps(error)
        pickling.loads(blob)
    except Exception:
        blob = None
    return EncodedError(blob, f"{type(error).__module__}.{type(error).__qualname__}", message, text)


def send(conn: Connection, message: Any, fd: int | None = None) -> None:
    """Send one message, then the file descriptor ``fd`` if given (the receiver calls
    :func:`receive_fd` after :func:`receive`; the sender still owns and closes ``fd``).
    Raises ``OSError``/``BrokenPipeError`` when the other end has gone."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    if fd is not None:
        reduction.send_handle(conn, fd, None)      # SCM_RIGHTS over the pipe's Unix socket


def receive(conn: Connection) -> Any:
    """The next message (blocks; raises ``EOFError``/``OSError`` when the other end has gone)."""
    return pickle.loads(conn.recv_bytes())


def receive_fd(conn: Connection) -> int:
    """The file descriptor sent after the message just received (this process owns it)."""
    return reduction.recv_handle(conn)
