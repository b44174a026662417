"""``python -m simcomm.run``: torchrun's launcher on virtual ranks.

::

    python -m simcomm.run --nproc-per-node 4 train.py --lr 0.1
    torchrun             --nproc-per-node 4 train.py --lr 0.1     # the same, in 4 processes

runs an unmodified torchrun script on ``nproc_per_node x nnodes`` virtual ranks
of one :class:`simcomm.World`, in this process. What each process of a
torchrun run has to itself, each rank has:

* torchrun's environment variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_RANK``, ``MASTER_ADDR``,
  ``MASTER_PORT``, ``TORCHELASTIC_RUN_ID``, ...) in ``os.environ`` and
  ``os.getenv`` (:func:`simcomm.sim.process_state.rank_environ`);
* its own ``sys.argv`` and its own ``__main__`` module: the script runs once
  per rank with ``runpy`` and ``run_name="__main__"``, so ``if __name__ ==
  "__main__":`` runs on every rank and the script's module-level objects are
  per rank, and so are the Python modules the script imports during the run
  (:mod:`simcomm.sim.rank_modules`);
* its own torch, Python ``random`` and NumPy random state, every rank
  starting from the same fresh state (:mod:`simcomm.sim.process_state`);
* torch.distributed: ``dist.init_process_group(...)`` creates the rank's default
  group in the run's world, as torch's does (``dist.is_initialized()`` is False
  before it, a second call raises torch's ``ValueError``, ``dist.get_backend()``
  answers the backend asked for, a ``timeout=`` bounds each wait as gloo's does:
  :func:`simcomm.c10d.init_join.install_init_join`), and every ``dist.*`` call
  works from the script's top level;
* ``__file__`` absolute and ``sys.argv[0]`` as typed, as ``python script.py`` gives them;
* an exit status: ``sys.exit(n)``, ``os._exit(n)``, ``os.abort()`` and a fatal
  signal the rank sends itself end that rank only, with the status its process
  would have had.

On a machine without a GPU each rank gets a virtual GPU backed by the CPU
(:mod:`simcomm.sim.cuda_map`; ``--no-virtual-gpus``, ``--gpu``, ``--gpu-memory``):
a script written for GPUs (``set_device``, ``.to(local_rank)``, ``"nccl"``,
``device_ids``, autocast, memory statistics) runs unmodified, with real values.

Output lines are tagged ``[rank r]``. Bad input (a missing script, a ``--trace``
that cannot be written or would overwrite an input, a ``--timeout`` that is not a
positive finite number) is refused before the script starts, in one line with
status 1. When a rank fails the others run on until they need it, as torchrun's
processes do until its agent stops them; the command then exits 1, as torchrun,
with a summary naming each rank, its exit status and, for a rank still running,
its script line; so does a collective mismatch, a deadlock, a timeout or Ctrl-C.
``--trace``, ``--tensors shape``, ``--memory`` and ``--timeout`` add what the
simulator can show. From a notebook: :func:`run_script`, which returns all that
and leaves the caller's state as it found it (docs/torchrun.md, "How a run ends").

The call chain::

    main (argument parsing) -> run_script -> World.run(_rank_program)
      -> on each rank thread: rank_environ, tagged output, runpy.run_path / run_module
"""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import posix
import random
import runpy
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .errors import Aborted, RankError, SimcommError
from .memory import MemoryReport
from .sim.cuda_map import GPUS, VirtualGPUs, gpu_preset, parse_bytes
from .sim.process_state import inherit_thread_local, rank_environ
from .sim.world import World
from .trace import Trace

__all__ = ["run_script", "ScriptRun", "rank_environment", "main"]


# -- what a rank sees ------------------------------------------------------------------------------

#: the signals torchrun's agent tells its workers it handles (TORCHELASTIC_SIGNALS_TO_HANDLE)
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def rank_environment(rank: int, nproc_per_node: int, nnodes: int = 1, *, master_addr: str = "127.0.0.1",
                     master_port: int = 29500, run_id: str = "none", role: str = "default",
                     max_restarts: int = 0, error_dir: str | None = None) -> dict[str, str]:
    """The variables torchrun's elastic agent sets for global rank ``rank`` (its
    ``LocalElasticAgent._start_workers``), with one role and no restarts.

    ``TORCHELASTIC_ERROR_FILE`` is ``<error_dir>/attempt_0/<local_rank>/error.json``, as
    torchrun names it in its log folder (``error_dir``: a temporary folder when ``None``,
    named but not created; :func:`run_script` creates it for the run and removes it after).
    """
    world_size = nproc_per_node * nnodes
    local_rank = rank % nproc_per_node
    if error_dir is None:
        error_dir = os.path.join(tempfile.gettempdir(), f"torchelastic_{run_id}")
    variables = {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank),
        "GROUP_RANK": str(rank // nproc_per_node), "ROLE_RANK": str(rank), "ROLE_NAME": role,
        "LOCAL_WORLD_SIZE": str(nproc_per_node), "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": str(nnodes), "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": os.path.join(error_dir, "attempt_0", str(local_rank), "error.json"),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS_TO_HANDLE,
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    # torchrun sets OMP_NUM_THREADS=1 for its workers when it is unset and there are several
    threads = os.environ.get("OMP_NUM_THREADS") or ("1" if nproc_per_node > 1 else None)
    if threads is not None:
        variables["OMP_NUM_THREADS"] = threads
    return variables


class _TaggedStream(io.TextIOBase):
    """``sys.stdout``/``sys.stderr`` during a launch: on a rank thread, each complete line
    goes to the real stream as ``[rank r] line``; elsewhere, writes pass through.
    A rank's unfinished line waits in its buffer until its newline or its end."""

    def __init__(self, target, local: threading.local):
        super().__init__()
        self._target = target
        self._local = local
        self._pending: dict[int, str] = {}

    def write(self, text: str) -> int:
        rank = getattr(self._local, "rank", None)
        if rank is None:
            return self._target.write(text)
        buffered = self._pending.pop(rank, "") + text
        *lines, rest = buffered.split("\n")
        if lines:
            self._target.write("".join(f"[rank {rank}] {line}\n" for line in lines))
            self._target.flush()
        if rest:
            self._pending[rank] = rest
        return len(text)

    def end_rank(self, rank: int) -> None:
        rest = self._pending.pop(rank, "")
        if rest:
            self._target.write(f"[rank {rank}] {rest}\n")
            self._target.flush()

    def flush(self) -> None:
        self._target.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return getattr(self._target, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str:
        return getattr(self._target, "errors", None) or "strict"

    @property
    def line_buffering(self) -> bool:
        return True           # each complete line is written and flushed at once

    @property
    def buffer(self) -> _TaggedBytes:
        """The binary layer, as a process's ``sys.stdout.buffer``: bytes written here are decoded
        with the stream's encoding and tagged like text."""
        return _TaggedBytes(self)

    def reconfigure(self, **settings) -> None:
        """As ``TextIOWrapper.reconfigure``: ``encoding``/``errors``/``line_buffering``/``newline``/
        ``write_through`` go to the real stream where it has the method; lines stay tagged."""
        unknown = set(settings) - {"encoding", "errors", "newline", "line_buffering", "write_through"}
        if unknown:
            raise TypeError(f"reconfigure() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        reconfigure = getattr(self._target, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(**settings)

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._target.fileno()


class _TaggedBytes(io.RawIOBase):
    """``sys.stdout.buffer`` during a launch: bytes decoded and written to the tagged text stream."""

    def __init__(self, text: _TaggedStream):
        super().__init__()
        self._text = text

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        data = bytes(data)
        self._text.write(data.decode(self._text.encoding, self._text.errors))
        return len(data)

    def flush(self) -> None:
        self._text.flush()

    def fileno(self) -> int:
        return self._text.fileno()


@contextlib.contextmanager
def _tagged_output(enabled: bool) -> Iterator[tuple[threading.local, tuple[_TaggedStream, ...]]]:
    """Swap ``sys.stdout``/``sys.stderr`` for tagging streams for the length of a launch;
    yields the thread-local that names each rank thread's rank, and the streams."""
    local = threading.local()
    inherit_thread_local(local, "rank")    # a thread a rank starts prints under its rank's tag
    if not enabled:
        yield local, ()
        return
    saved = sys.stdout, sys.stderr
    streams = _TaggedStream(saved[0], local), _TaggedStream(saved[1], local)
    sys.stdout, sys.stderr = streams
    try:
        yield local, streams
    finally:
        if (sys.stdout, sys.stderr) == streams:
            sys.stdout, sys.stderr = saved


class _RankExited(Exception):
    """A rank ended with a non-zero exit status (``sys.exit(n)``, ``os._exit(n)``, a signal):
    ends the rank as the process would end, and fails the launch as torchrun's."""

    def __init__(self, rank: int, code: int, how: str = ""):
        super().__init__(f"rank {rank} exited with code {code}" + (f" ({how})" if how else ""))
        self.rank, self.code, self.how = rank, code, how


class _RankEnded(BaseException):
    """Raised on a rank thread by ``os._exit(n)``, ``os.abort()`` or a fatal signal the rank
    sends itself, which would end the whole process: it ends the rank only, with the exit
    status the process would have had (``-signum`` for a signal). A ``BaseException``, so
    ``except Exception`` in the script does not catch it (``finally`` blocks do run)."""

    def __init__(self, code: int, how: str):
        super().__init__(how)
        self.code, self.how = code, how


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


#: signals whose default action ignores them (or stops/continues the process): no rank ends by one
_HARMLESS = {getattr(signal, name) for name in ("SIGCHLD", "SIGURG", "SIGWINCH", "SIGCONT", "SIGSTOP",
                                                 "SIGTSTP", "SIGTTIN", "SIGTTOU") if hasattr(signal, name)}


class _RankExits:
    """For the length of a launch: ``os._exit``, ``os.abort``, ``os.kill`` of this process and
    ``signal.raise_signal`` end only the rank that calls them, on a rank thread (one whose
    ``local.rank`` is set), as they would end only that rank's process under torchrun;
    on any other thread they are the real calls."""

    def __init__(self, local: threading.local):
        self.local = local
        self.saved: tuple | None = None
        self.pid: int | None = None

    def _on_rank(self) -> bool:
        """Whether the caller is a rank thread of the launching process: a child forked by a rank
        (a DataLoader worker, a multiprocessing.Process) is a process of its own, whose exits are real."""
        return getattr(self.local, "rank", None) is not None and posix.getpid() == self.pid

    def __enter__(self) -> _RankExits:
        self.pid = posix.getpid()         # the real pid: os.getpid answers a rank's own on rank threads
        real_exit, real_abort, real_kill, real_raise = os._exit, os.abort, os.kill, signal.raise_signal
        self.saved = real_exit, real_abort, real_kill, real_raise

        def _exit(code: int) -> None:
            if not self._on_rank():
                real_exit(code)
            raise _RankEnded(int(code) & 0xFF, f"os._exit({code})")

        def abort() -> None:
            if not self._on_rank():
                real_abort()
            raise _RankEnded(-signal.SIGABRT, "SIGABRT: os.abort()")

        def deliver(signum: int, call: str) -> None:
            """What ``signum`` sent to this process does to the rank that sent it."""
            signum = int(signum)
            if signum == 0:       # only asks whether the process exists
                return
            handler = signal.getsignal(signum)
            if handler == signal.SIG_IGN or (
                    handler == signal.SIG_DFL and signum in _HARMLESS):
                return
            if handler == signal.default_int_handler:        # SIGINT's: KeyboardInterrupt
                raise KeyboardInterrupt
            if callable(handler):     # the caller's handler, run on the rank as on its process
                handler(signum, sys._getframe(2))
                return
            raise _RankEnded(-signum, f"{_signal_name(signum)}: {call}")

        def kill(pid: int, signum: int) -> None:
            if self._on_rank() and pid in (0, os.getpid()):
                deliver(signum, "os.kill(os.getpid())")
                return
            real_kill(pid, signum)

        def raise_signal(signum: int) -> None:
            if self._on_rank():
                deliver(signum, "signal.raise_signal()")
                return
            real_raise(signum)

        os._exit, os.abort, os.kill = _exit, abort, kill    # simcomm.patches: "rank-exits"
        signal.raise_signal = raise_signal
        return self

    def __exit__(self, *exc_info) -> None:
        if self.saved is not None:
            os._exit, os.abort, os.kill, signal.raise_signal = self.saved
            self.saved = None


def _exit_code(exit_: SystemExit, stderr) -> int:
    """The status a process exiting with ``exit_`` has (Python prints a message code)."""
    code = exit_.code
    if code is None:
        return 0
    if isinstance(code, bool) or not isinstance(code, int):
        print(code, file=stderr)
        return 1
    return code & 0xFF        # what the parent of a process sees: sys.exit(-1) is 255


@dataclass
class _Launch:
    """One launch, shared by its rank threads: what to run, with what, and each rank's status."""

    target: str
    path: str
    module: bool
    args: list[str]
    nproc_per_node: int
    nnodes: int
    env: dict
    statuses: list
    output: threading.local
    streams: tuple
    how: dict

    def run_rank(self, rank: int) -> int:
        """Run the script as rank ``rank``'s ``__main__``, with its environment and argv;
        record its exit status. A non-zero status raises ``_RankExited``: the rank has
        failed, and the run ends when the other ranks need it (or finish)."""
        output = self.output
        output.rank = rank
        try:
            with rank_environ(rank_environment(rank, self.nproc_per_node, self.nnodes, **self.env)):
                # argv[0] as given (torchrun passes it on as typed); __file__ absolute, as
                # `python script.py` makes it
                sys.argv = [self.target if not self.module else "-m", *self.args]
                code, how = 0, ""
                try:
                    if self.module:
                        runpy.run_module(self.target, run_name="__main__", alter_sys=True)
                    else:
                        _run_main(self.path, self.target)
                except SystemExit as exit_:
                    code = _exit_code(exit_, sys.stderr)
                    how = f"sys.exit({exit_.code!r})" if code else ""
                except _RankEnded as ended:
                    code, how = ended.code, ended.how
                except KeyboardInterrupt:
                    # an uncaught KeyboardInterrupt ends a Python process by SIGINT
                    traceback.print_exc()
                    code, how = -signal.SIGINT, "SIGINT: KeyboardInterrupt"
                except Aborted:       # the run was stopped: this rank has no exit status
                    raise
                except BaseException:
                    self.statuses[rank] = 1
                    raise
                self.statuses[rank] = code
                if code != 0:
                    self.how[rank] = how
                    raise _RankExited(rank, code, how) from None
                return 0
        finally:
            for stream in self.streams:
                stream.end_rank(rank)
            output.rank = None


def _run_main(path: str, target: str) -> None:
    """Run the script ``target`` (absolute: ``path``, taken before the run: a rank may change
    the working directory) as ``__main__``, as ``python target`` does: ``__file__`` is its
    absolute path and ``sys.argv[0]`` stays as typed (``runpy.run_path`` would set both to the
    path it is given). A folder or zip archive with a ``__main__.py`` goes to ``runpy.run_path``."""
    if not os.path.isfile(path) or path.endswith((".zip", ".pyz")):
        runpy.run_path(path, run_name="__main__")
        return
    with io.open_code(path) as source:
        code = compile(source.read(), path, "exec", dont_inherit=True)
    module = types.ModuleType("__main__")
    module.__dict__.update(__file__=path, __cached__=None, __loader__=None, __spec__=None,
                           __package__=None, __builtins__=__builtins__)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        exec(code, module.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _rank_program(comm, launch: _Launch) -> int:
    return launch.run_rank(comm.rank)


# -- the result ---------------------------------------------------------------------------------

@dataclass
class ScriptRun:
    """What :func:`run_script` gives back.

    ``exit_codes[r]`` is rank ``r``'s exit status, as torchrun reports a worker's:
    ``0`` when it returned or called ``sys.exit(0)``; ``n`` for ``sys.exit(n)`` or
    ``os._exit(n)``; ``1`` when it raised; ``-signum`` when a signal it sent itself
    would have ended its process (``os.kill(os.getpid(), SIGSEGV)``: ``-11``;
    ``os.abort()``: ``-6``; an uncaught ``KeyboardInterrupt``: ``-2``). ``None`` for a
    rank still running when the run ended: torchrun's agent ends such a worker with
    SIGTERM (its ``-15``); ``stopped_at[r]`` is the script line it was at. A rank
    runs on after another fails until it needs the failed rank (a collective or a
    receive involving it), as a process does until the agent stops it.
    ``how[r]`` says how a rank with a non-zero status ended (``"os._exit(3)"``).

    ``error`` is the exception that ended the run (``RankError``,
    ``CollectiveMismatchError``, ``DeadlockError``, ``RunTimeoutError``, or
    ``KeyboardInterrupt`` for Ctrl-C), ``None`` after a clean run.
    """

    target: str
    exit_codes: list[int | None]
    trace: Trace
    memory: MemoryReport | None = None
    error: BaseException | None = None
    wall_s: float = 0.0
    nproc_per_node: int = 1
    stopped_at: dict[int, str] = field(default_factory=dict)
    how: dict[int, str] = field(default_factory=dict)

    @property
    def returncode(self) -> int:
        """The command's exit status: 0 when every rank exited 0, else 1 (as torchrun)."""
        return 0 if self.error is None and all(code == 0 for code in self.exit_codes) else 1

    def failed_ranks(self) -> list[int]:
        return [rank for rank, code in enumerate(self.exit_codes) if code != 0]

    def _root(self) -> int | None:
        error = self.error
        if isinstance(error, (RankError, _RankExited)):
            return error.rank
        return None

    def summary(self) -> str:
        """A torchrun-like report naming each rank, its exit status and, for a rank still
        running when the run ended, the script line it was at ("" after a clean run)."""
        if self.returncode == 0:
            return ""
        bar = "=" * 60
        lines = [bar, f"{self.target} FAILED", "-" * 60]
        root = self._root()
        interrupted = isinstance(self.error, KeyboardInterrupt)
        for rank, code in enumerate(self.exit_codes):
            head = f"  rank {rank} (local_rank {rank % self.nproc_per_node}): "
            if code is None:
                where = self.stopped_at.get(rank)
                if where is None:
                    status = "had not started its script (it waited for its first turn)"
                else:
                    status = f"still running at {where}"
                if interrupted:
                    status += ", stopped by Ctrl-C (torchrun forwards SIGINT to its workers)"
                elif root is not None:
                    status += "; stopped (torchrun's agent ends it with SIGTERM: exitcode -15)"
                else:
                    status += f"; stopped when the run ended with {type(self.error).__name__}"
            else:
                status = f"exitcode {code}"
                how = self.how.get(rank, "")
                if code < 0:
                    status += f" ({how or _signal_name(-code)})"
                elif how and not how.startswith("sys.exit"):
                    status += f" ({how})"
            mark = "  (root cause)" if rank == root else ""
            lines.append(head + status + mark)
        if interrupted:
            lines += ["-" * 60, "the run was interrupted (Ctrl-C)"]
        elif self.error is not None and not isinstance(self.error, (RankError, _RankExited)):
            lines += ["-" * 60, f"the run ended with {type(self.error).__name__} (above)"]
        lines.append(bar)
        return "\n".join(lines)


class _CallerState:
    """What a launch may change in the caller and puts back after it: the working directory,
    torch's default dtype, ``sys.argv``, ``sys.path``, ``os.environ``, torch's thread count,
    and the global random state of Python, NumPy and torch."""

    def __init__(self) -> None:
        self.cwd = _cwd()
        self.dtype = torch.get_default_dtype()
        self.argv = list(sys.argv)
        self.path = list(sys.path)
        self.environ = dict(os.environ)
        self.threads = torch.get_num_threads()
        self.random = random.getstate()
        self.torch_random = torch.random.get_rng_state()
        numpy = sys.modules.get("numpy")
        self.numpy_random = numpy.random.get_state() if numpy is not None else None

    def restore(self) -> None:
        if self.cwd is not None and _cwd() != self.cwd:
            with contextlib.suppress(OSError):
                os.chdir(self.cwd)
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)
        sys.argv[:] = self.argv
        sys.path[:] = self.path
        if dict(os.environ) != self.environ:
            for name in [name for name in os.environ if name not in self.environ]:
                del os.environ[name]
            os.environ.update(self.environ)
        torch.set_num_threads(self.threads)
        random.setstate(self.random)
        torch.random.set_rng_state(self.torch_random)
        numpy = sys.modules.get("numpy")
        if numpy is not None and self.numpy_random is not None:
            numpy.random.set_state(self.numpy_random)


def _cwd() -> str | None:
    try:
        return os.getcwd()
    except OSError:      # the folder was removed under the process
        return None


def run_script(script: str | os.PathLike, nproc_per_node: int = 1, args: Sequence[str] = (), *,
               nnodes: int = 1, module: bool = False, tensors: str = "real", memory: bool = False,
               timeout: float | None = None, device: str | torch.device = "cpu",
               tag_output: bool = True, master_addr: str = "127.0.0.1", master_port: int = 29500,
               run_id: str | None = None, virtual_gpus: bool | None = None, gpu: str = "H100",
               gpu_memory: int | str | None = None, scalar_reads: str = "error") -> ScriptRun:
    """Run ``script`` (a path, or a module name with ``module=True``) on ``nproc_per_node
    x nnodes`` virtual ranks, as ``torchrun --nproc-per-node N --nnodes M script args``.

    Never raises, nor exits, for what the script does: a rank's exception,
    ``sys.exit(n)``, ``os._exit(n)``, a signal it sends itself, a collective mismatch,
    a deadlock, a timeout, or Ctrl-C (``KeyboardInterrupt`` in the caller) end up in
    the returned :class:`ScriptRun` (``exit_codes``, ``error``, ``summary()``). When a
    rank fails, the others run on until they need it (:class:`ScriptRun`).
    ``tensors="shape"`` runs shape-only ranks (with ``scalar_reads="nan"``, a read of a
    floating-point value they do not have, such as a logged loss, answers ``nan``:
    :mod:`simcomm.sim.shape_reads`), ``memory=True`` fills ``ScriptRun.memory``. Raises ``ValueError`` for a bad ``nproc_per_node``/``nnodes``
    or ``timeout``, ``FileNotFoundError`` for a script that does not exist.

    The caller finds its working directory, torch's default dtype, ``sys.argv``,
    ``sys.path``, ``os.environ``, torch's thread count and its random state as they
    were before the call, whatever the script did to them.

    **Virtual GPUs.** ``virtual_gpus=None`` (the default) gives each rank a virtual GPU
    backed by the CPU when this machine has none (``torch.cuda.is_available()`` False
    before the run), announced in one line on stderr: the script's CUDA calls, ``"nccl"``,
    integer devices, ``DDP(device_ids=...)``, autocast, memory statistics run as on a node
    of ``nproc_per_node`` GPUs named ``gpu`` (:data:`simcomm.sim.cuda_map.GPUS`), each
    holding ``gpu_memory`` bytes (``"8GiB"``; default the GPU's own), and each rank's memory
    is tracked (``ScriptRun.memory``; shape-only ranks with ``memory=True``), so a rank past the capacity gets
    ``torch.OutOfMemoryError`` (:mod:`simcomm.sim.cuda_map`). ``virtual_gpus=False``: no
    virtual GPUs; a GPU script then fails as it would under torchrun on this machine.

    For the run, torch computes with the number of threads the ranks'
    ``OMP_NUM_THREADS`` says (torchrun gives its workers 1 when it is unset and
    there are several), as torchrun's processes do: a different count can change
    float results in the last digits. The caller's setting is put back after.
    """
    for name, value in (("nproc_per_node", nproc_per_node), ("nnodes", nnodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"run_script: {name}={value!r} must be a positive int")
    _check_run_timeout(timeout, "run_script: timeout")
    target = os.fspath(script)
    if not module and not os.path.isfile(target):
        raise FileNotFoundError(f"run_script: script={target!r} does not exist"
                                + (" (it is a folder)" if os.path.isdir(target) else ""))
    world_size = nproc_per_node * nnodes
    if virtual_gpus is None:
        virtual_gpus = not torch.cuda.is_available() and torch.device(device).type == "cpu"
    gpus = VirtualGPUs(gpu, gpu_memory, nproc_per_node) if virtual_gpus else None
    # virtual GPUs track each rank's memory (torch.cuda's statistics, the OOM); shape-only runs,
    # which may have thousands of ranks, only when asked (memory=True)
    world = World(world_size, device=device, tensors=tensors,
                  memory=memory or (gpus is not None and tensors == "real"), map_cuda=gpus or False,
                  peers_run_on=True, explicit_init=True, scalar_reads=scalar_reads)
    if gpus is not None:
        print(f"simcomm.run: no GPU here; each rank gets a virtual GPU backed by the CPU, a "
              f"{gpus.describe()} (--no-virtual-gpus turns this off)", file=sys.stderr)
    statuses: list[int | None] = [None] * world_size
    how: dict[int, str] = {}
    caller = _CallerState()
    run_id = run_id if run_id is not None else "none"
    # torchrun's workers find TORCHELASTIC_ERROR_FILE's folder made (torch's @record writes there)
    error_dir = tempfile.mkdtemp(prefix=f"torchelastic_{run_id[:8]}_")
    for local_rank in range(nproc_per_node):
        os.makedirs(os.path.join(error_dir, "attempt_0", str(local_rank)), exist_ok=True)
    # the script's folder leads sys.path, as `python script.py` puts it (the cwd for -m)
    search = (caller.cwd or ".") if module else os.path.dirname(os.path.abspath(target))
    error: BaseException | None = None
    start = time.perf_counter()
    try:
        sys.path.insert(0, search)
        # torchrun's workers start with OMP_NUM_THREADS=1 (when it is unset and N > 1), so their
        # torch computes with one thread; so do the ranks here, or float results could differ
        threads = rank_environment(0, nproc_per_node, nnodes).get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
        with _tagged_output(tag_output) as (output, streams), _RankExits(output):
            launch = _Launch(target, os.path.abspath(target), module, list(args), nproc_per_node, nnodes,
                             {"master_addr": master_addr, "master_port": master_port,
                              "run_id": run_id, "error_dir": error_dir},
                             statuses, output, streams, how)
            try:
                world.run(_rank_program, launch, timeout=timeout)
            except SimcommError as failure:
                error = failure
            except KeyboardInterrupt as interrupt:   # Ctrl-C: the ranks were stopped where they were
                error = interrupt
    finally:
        caller.restore()
        shutil.rmtree(error_dir, ignore_errors=True)
    if isinstance(error, RankError) and isinstance(error.error, _RankExited):
        error = error.error
    return ScriptRun(target, statuses, world.trace, world.memory, error, time.perf_counter() - start,
                     nproc_per_node, dict(world.stopped_at), how)


def _check_run_timeout(timeout, where: str) -> None:
    """``timeout`` must be None or a positive, finite number of seconds (math.inf: none)."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"{where}={timeout!r} must be a number of seconds")
    if math.isnan(timeout) or timeout <= 0:
        raise ValueError(f"{where}={timeout!r} must be a positive number of seconds")


# -- the command ------------------------------------------------------------------------------------

#: torchrun's options that mean nothing on virtual ranks: accepted, and a note says so
_IGNORED = ("rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "max_restarts", "monitor_interval",
            "start_method", "log_dir", "redirects", "tee", "local_addr", "node_rank", "logs_specs",
            "event_log_handler", "numa_binding", "signals_to_handle", "shutdown_timeout",
            "local_ranks_filter", "duplicate_stdout_filters", "duplicate_stderr_filters")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m simcomm.run",
        description="Run a torchrun script on virtual ranks in this process (torchrun's flags).")
    add = parser.add_argument
    add("--nproc-per-node", "--nproc_per_node", default="1",
        help="ranks per node: an int, or 'cpu'/'auto' (this machine's CPU count)")
    add("--nnodes", default="1", help="nodes: an int, or MIN:MAX with MIN == MAX")
    add("--standalone", action="store_true", help="accepted (every run here is standalone)")
    add("--master-addr", "--master_addr", default=None,
        help="MASTER_ADDR each rank sees (127.0.0.1; localhost with --standalone, as torchrun)")
    add("--master-port", "--master_port", type=int, default=None,
        help="MASTER_PORT each rank sees (on one node without it: a free port, as torchrun)")
    add("--role", default="default", help="ROLE_NAME each rank sees")
    add("-m", "--module", action="store_true", help="the script is a module name (python -m)")
    add("--no-python", "--no_python", action="store_true", help="not supported on virtual ranks")
    add("--run-path", "--run_path", action="store_true", help="accepted (scripts run with runpy.run_path)")
    for name in _IGNORED:
        flags = [f"--{name.replace('_', '-')}", f"--{name}"] if "_" in name else [f"--{name}"]
        if name == "redirects":
            flags.insert(0, "-r")
        if name == "tee":
            flags.insert(0, "-t")
        add(*flags, dest=name, default=None, help=argparse.SUPPRESS)
    add("--trace", metavar="PATH", help="write the run's trace as Chrome/Perfetto JSON to PATH")
    add("--tensors", choices=["real", "shape"], default="real",
        help="'shape': shape-only ranks (fake tensors: shapes, trace and memory, no values)")
    add("--scalar-reads", choices=["error", "nan"], default="error",
        help="with --tensors shape: 'nan' answers a read of a floating-point value a shape-only rank "
             "does not have (a logged loss's .item()) with nan, so the script runs on; integer and "
             "bool reads stay errors (default 'error': the read stops the run, naming it)")
    add("--memory", action="store_true", help="print each rank's peak memory by label")
    add("--timeout", default=None, metavar="S",
        help="stop the run after S seconds (a positive, finite number)")
    add("--device", default="cpu", help="the World's device (cpu, or cuda with a GPU)")
    add("--no-virtual-gpus", dest="virtual_gpus", action="store_false", default=None,
        help="no virtual GPUs (on by default on a machine without a GPU: each rank gets one, backed "
             "by the CPU); a GPU script then fails as under torchrun here")
    add("--gpu", default="H100", metavar="NAME",
        help="the virtual GPUs' model: " + ", ".join(GPUS) + " (get_device_name, get_device_properties, "
             "capacity)")
    add("--gpu-memory", default=None, metavar="SIZE",
        help="each virtual GPU's capacity, e.g. 8GiB (default: the GPU's own); a rank past it gets "
             "torch.OutOfMemoryError")
    add("training_script", help="the script (or, with -m, the module) to run")
    add("training_script_args", nargs=argparse.REMAINDER)
    return parser


def _count(flag: str, value: str) -> int:
    text = str(value).strip()
    if flag == "--nproc-per-node" and text in ("cpu", "auto"):
        return os.cpu_count() or 1
    if flag == "--nproc-per-node" and text == "gpu":
        if not torch.cuda.is_available():
            raise _Refused("--nproc-per-node gpu needs a GPU; pass a number of ranks")
        return torch.cuda.device_count()
    if flag == "--nnodes" and ":" in text:
        low, _, high = text.partition(":")
        if low != high:
            raise _Refused(f"--nnodes {text}: elastic ranges are not simulated; pass one number of nodes")
        text = low
    try:
        count = int(text)
    except ValueError:
        raise _Refused(f"{flag} {value!r} must be a positive int") from None
    if count < 1:
        raise _Refused(f"{flag} {value!r} must be a positive int")
    return count


def _memory_table(report: MemoryReport) -> str:
    labels = report.labels
    head = ["rank", *labels, "peak"]
    mib = lambda b: f"{b / 2**20:.1f}"   # noqa: E731
    rows = [[str(r.rank), *(mib(r.peak_bytes.get(name, 0)) for name in labels), mib(r.peak)]
            for r in report.ranks]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = ["memory at each rank's peak (MiB):"]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [head, *rows]]
    return "\n".join(lines)


class _Refused(Exception):
    """Input the command refuses before the script starts: one line, exit status 1."""


def _check_trace(path: str, script: str, module: bool, args: Sequence[str]) -> None:
    """``--trace PATH`` can be written and is none of the run's input files."""
    if os.path.isdir(path):
        raise _Refused(f"--trace {path}: is a folder; name the JSON file to write")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise _Refused(f"--trace {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise _Refused(f"--trace {path}: cannot be written (permission denied)")
    if os.path.exists(path):
        inputs = [] if module else [script]
        inputs += [arg for arg in args if os.path.isfile(arg)]
        inputs += [arg.split("=", 1)[1] for arg in args
                   if arg.startswith("-") and "=" in arg and os.path.isfile(arg.split("=", 1)[1])]
        for name in inputs:
            with contextlib.suppress(OSError):
                if os.path.samefile(path, name):
                    raise _Refused(f"--trace {path}: is an input of the run ({name}); writing the "
                                   f"trace there would overwrite it: name another file")
        if not module and path.endswith(".py"):
            raise _Refused(f"--trace {path}: is a Python file; writing the trace there would "
                           f"overwrite it: name a .json file")


def _check_options(options: argparse.Namespace) -> float | None:
    """Everything the command can check before the script starts; the timeout in seconds."""
    if not options.module:
        script = options.training_script
        if not os.path.exists(script):
            raise _Refused(f"can't open file {os.path.abspath(script)!r}: [Errno 2] No such file or "
                           f"directory")
        if os.path.isdir(script):
            raise _Refused(f"can't run {os.path.abspath(script)!r}: it is a folder; name the script")
        if not os.access(script, os.R_OK):
            raise _Refused(f"can't open file {os.path.abspath(script)!r}: [Errno 13] Permission denied")
    timeout = None
    if options.timeout is not None:
        try:
            timeout = float(options.timeout)
        except ValueError:
            raise _Refused(f"--timeout {options.timeout!r} must be a number of seconds") from None
        if not math.isfinite(timeout) or timeout <= 0:
            raise _Refused(f"--timeout {options.timeout!r} must be a positive, finite number of seconds")
    if options.trace:
        _check_trace(options.trace, options.training_script, options.module, options.training_script_args)
    return timeout


def main(argv: Sequence[str] | None = None) -> int:
    """The command; returns its exit status. Bad input is refused before the script starts
    with ``SystemExit("simcomm.run: error: ...")``: one line on stderr and status 1, as
    torchrun fails a launch."""
    try:
        return _main(argv)
    except _Refused as refused:    # Python prints the message and exits with status 1
        raise SystemExit(f"simcomm.run: error: {refused}") from None
    except KeyboardInterrupt:       # Ctrl-C before or after the run (during it: run_script's summary)
        print("simcomm.run: interrupted (Ctrl-C)", file=sys.stderr)
        return 1


def _main(argv: Sequence[str] | None) -> int:
    options = _parser().parse_args(argv)
    if options.no_python:
        raise _Refused("--no-python cannot run on virtual ranks: a rank is a thread of this Python "
                       "process; run a Python script or module")
    nproc = _count("--nproc-per-node", options.nproc_per_node)
    try:
        gpu_preset(options.gpu)
        if options.gpu_memory is not None:
            parse_bytes(options.gpu_memory)
    except (TypeError, ValueError) as bad:
        raise _Refused(str(bad)) from None
    if options.scalar_reads != "error" and options.tensors != "shape":
        raise _Refused(f"--scalar-reads {options.scalar_reads} needs --tensors shape (--tensors "
                       f"{options.tensors}: real-valued ranks read their own values)")
    nnodes = _count("--nnodes", options.nnodes)
    timeout = _check_options(options)
    ignored = [name for name in _IGNORED if getattr(options, name) is not None]
    if ignored:
        flags = ", ".join("--" + name.replace("_", "-") for name in ignored)
        print(f"simcomm.run: note: {flags} ignored: every rank of every node runs in this "
              f"process, and output is tagged [rank r]", file=sys.stderr)
    # torchrun on one node with no rendezvous or port named runs as --standalone: a run id of
    # its own, localhost, and a free port
    standalone = options.standalone or (nnodes == 1 and options.master_port is None
                                        and options.rdzv_endpoint is None)
    run_id = str(uuid.uuid4()) if standalone else (options.rdzv_id or "none")
    master_port = options.master_port if options.master_port is not None else (
        _free_port() if standalone else 29500)
    result = run_script(options.training_script, nproc, options.training_script_args, nnodes=nnodes,
                        module=options.module, tensors=options.tensors, memory=options.memory,
                        timeout=timeout, device=options.device,
                        master_addr=options.master_addr or ("localhost" if standalone else "127.0.0.1"),
                        master_port=master_port,
                        run_id=run_id, virtual_gpus=options.virtual_gpus, gpu=options.gpu,
                        gpu_memory=options.gpu_memory, scalar_reads=options.scalar_reads)
    status = result.returncode
    if options.trace:
        try:
            result.trace.to_chrome_trace(options.trace)
        except OSError as failed:
            print(f"simcomm.run: error: --trace {options.trace}: {failed.strerror or failed}", file=sys.stderr)
            status = 1
        else:
            print(f"simcomm.run: trace of {len(result.trace)} events written to {options.trace} "
                  f"(open it in https://ui.perfetto.dev)", file=sys.stderr)
    if options.memory and result.memory is not None:
        print(_memory_table(result.memory), file=sys.stderr)
    if result.error is not None and not isinstance(result.error, (_RankExited, KeyboardInterrupt)):
        print("".join(traceback.format_exception_only(type(result.error), result.error)).rstrip(),
              file=sys.stderr)
    if result.returncode:
        print(result.summary(), file=sys.stderr)
    return status


def _free_port() -> int:
    """A TCP port free on this machine now (torchrun's standalone rendezvous takes one so)."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _catch_sigint() -> None:
    """The command stops on Ctrl-C as torchrun does, also where it started with SIGINT ignored
    (a background job of a non-interactive shell): torchrun's agent catches SIGINT itself."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)    # simcomm.patches: "run-command-sigint"


if __name__ == "__main__":
    _catch_sigint()
    sys.exit(main())
