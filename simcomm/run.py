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
* torch.distributed: ``dist.init_process_group(...)`` joins the run's world
  (:func:`simcomm.c10d.init_join.install_init_join`), and every ``dist.*``
  call works from the script's top level;
* an exit status: ``sys.exit(n)`` ends the rank as a process exit would.

On a machine without a GPU each rank gets a virtual GPU backed by the CPU
(:mod:`simcomm.sim.cuda_map`; ``--no-virtual-gpus``, ``--gpu``, ``--gpu-memory``):
a script written for GPUs (``set_device``, ``.to(local_rank)``, ``"nccl"``,
``device_ids``, autocast, memory statistics) runs unmodified, with real values.

Output lines are tagged ``[rank r]``. The command exits non-zero, with a
summary of the failed ranks, when a rank raised or exited non-zero, or the
simulator found a collective mismatch or a deadlock (named with each rank's
script line). ``--trace``, ``--tensors shape``, ``--memory`` and ``--timeout``
add what the simulator can show. From a notebook: :func:`run_script`.

The call chain::

    main (argument parsing) -> run_script -> World.run(_rank_program)
      -> on each rank thread: rank_environ, tagged output, runpy.run_path / run_module
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import runpy
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from .errors import RankError, SimcommError
from .memory import MemoryReport
from .sim.cuda_map import GPUS, VirtualGPUs, gpu_preset, parse_bytes
from .sim.process_state import inherit_thread_local, rank_environ
from .errors import Aborted
from .sim.world import World
from .trace import Trace

__all__ = ["run_script", "ScriptRun", "rank_environment", "main"]


# -- what a rank sees ------------------------------------------------------------------------------

def rank_environment(rank: int, nproc_per_node: int, nnodes: int = 1, *, master_addr: str = "127.0.0.1",
                     master_port: int = 29500, run_id: str = "none", role: str = "default",
                     max_restarts: int = 0) -> dict[str, str]:
    """The variables torchrun's elastic agent sets for global rank ``rank`` (its
    ``LocalElasticAgent._start_workers``), with one role and no restarts."""
    world_size = nproc_per_node * nnodes
    variables = {
        "RANK": str(rank), "LOCAL_RANK": str(rank % nproc_per_node),
        "GROUP_RANK": str(rank // nproc_per_node), "ROLE_RANK": str(rank), "ROLE_NAME": role,
        "LOCAL_WORLD_SIZE": str(nproc_per_node), "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": str(nnodes), "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "False",
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
    """A rank's ``sys.exit(n)`` with ``n != 0``: ends the launch as torchrun ends it."""

    def __init__(self, rank: int, code: int):
        super().__init__(f"rank {rank} exited with code {code}")
        self.rank, self.code = rank, code


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
    module: bool
    args: list[str]
    nproc_per_node: int
    nnodes: int
    env: dict
    statuses: list
    output: threading.local
    streams: tuple

    def run_rank(self, rank: int) -> int:
        """Run the script as rank ``rank``'s ``__main__``, with its environment and argv;
        record its exit status. ``sys.exit(n != 0)`` raises ``_RankExited``, which stops
        the other ranks as torchrun stops its workers when one fails."""
        output = self.output
        output.rank = rank
        try:
            with rank_environ(rank_environment(rank, self.nproc_per_node, self.nnodes, **self.env)):
                sys.argv = [self.target if not self.module else "-m", *self.args]
                try:
                    if self.module:
                        runpy.run_module(self.target, run_name="__main__", alter_sys=True)
                    else:
                        runpy.run_path(self.target, run_name="__main__")
                except SystemExit as exit_:
                    code = _exit_code(exit_, sys.stderr)
                    self.statuses[rank] = code
                    if code != 0:
                        raise _RankExited(rank, code) from None
                    return 0
                except Aborted:       # the run was stopped: this rank has no exit status
                    raise
                except BaseException:
                    self.statuses[rank] = 1
                    raise
                self.statuses[rank] = 0
                return 0
        finally:
            for stream in self.streams:
                stream.end_rank(rank)
            output.rank = None


def _rank_program(comm, launch: _Launch) -> int:
    return launch.run_rank(comm.rank)


# -- the result ---------------------------------------------------------------------------------

@dataclass
class ScriptRun:
    """What :func:`run_script` gives back.

    ``exit_codes[r]`` is rank ``r``'s exit status (``0``: it returned or called
    ``sys.exit(0)``; ``n``: ``sys.exit(n)``; ``1``: it raised), or ``None`` for
    a rank stopped before it finished (as torchrun stops the other workers when
    one fails, or after a mismatch, deadlock or timeout). ``error`` is the
    exception that ended the run (``RankError``, ``CollectiveMismatchError``,
    ``DeadlockError``, ``RunTimeoutError``), ``None`` after a clean run.
    """

    target: str
    exit_codes: list[int | None]
    trace: Trace
    memory: MemoryReport | None = None
    error: BaseException | None = None
    wall_s: float = 0.0
    nproc_per_node: int = 1

    @property
    def returncode(self) -> int:
        """The command's exit status: 0 when every rank exited 0, else 1 (as torchrun)."""
        return 0 if self.error is None and all(code == 0 for code in self.exit_codes) else 1

    def failed_ranks(self) -> list[int]:
        return [rank for rank, code in enumerate(self.exit_codes) if code != 0]

    def summary(self) -> str:
        """A torchrun-like report of the failed ranks ("" after a clean run)."""
        if self.returncode == 0:
            return ""
        bar = "=" * 60
        lines = [bar, f"{self.target} FAILED", "-" * 60]
        root = getattr(self.error, "rank", None)
        for rank, code in enumerate(self.exit_codes):
            if code == 0:
                continue
            status = "stopped before it finished" if code is None else f"exitcode {code}"
            mark = "  (root cause)" if rank == root else ""
            lines.append(f"  rank {rank} (local_rank {rank % self.nproc_per_node}): {status}{mark}")
        if self.error is not None and not isinstance(self.error, (RankError, _RankExited)):
            lines += ["-" * 60, f"the run ended with {type(self.error).__name__} (above)"]
        lines.append(bar)
        return "\n".join(lines)


def run_script(script: str | os.PathLike, nproc_per_node: int = 1, args: Sequence[str] = (), *,
               nnodes: int = 1, module: bool = False, tensors: str = "real", memory: bool = False,
               timeout: float | None = None, device: str | torch.device = "cpu",
               tag_output: bool = True, master_addr: str = "127.0.0.1", master_port: int = 29500,
               run_id: str | None = None, virtual_gpus: bool | None = None, gpu: str = "H100",
               gpu_memory: int | str | None = None) -> ScriptRun:
    """Run ``script`` (a path, or a module name with ``module=True``) on ``nproc_per_node
    x nnodes`` virtual ranks, as ``torchrun --nproc-per-node N --nnodes M script args``.

    Never raises for what the script does: a rank's exception, ``sys.exit(n)``, a
    collective mismatch, a deadlock or a timeout end up in the returned
    :class:`ScriptRun` (``exit_codes``, ``error``, ``summary()``). ``tensors="shape"``
    runs shape-only ranks, ``memory=True`` fills ``ScriptRun.memory``. Raises
    ``ValueError`` for a bad ``nproc_per_node``/``nnodes``, ``FileNotFoundError``
    for a script that does not exist.

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
    target = os.fspath(script)
    if not module and not os.path.exists(target):
        raise FileNotFoundError(f"run_script: script={target!r} does not exist")
    world_size = nproc_per_node * nnodes
    if virtual_gpus is None:
        virtual_gpus = not torch.cuda.is_available() and torch.device(device).type == "cpu"
    gpus = VirtualGPUs(gpu, gpu_memory, nproc_per_node) if virtual_gpus else None
    # virtual GPUs track each rank's memory (torch.cuda's statistics, the OOM); shape-only runs,
    # which may have thousands of ranks, only when asked (memory=True)
    world = World(world_size, device=device, tensors=tensors,
                  memory=memory or (gpus is not None and tensors == "real"), map_cuda=gpus or False)
    if gpus is not None:
        print(f"simcomm.run: no GPU here; each rank gets a virtual GPU backed by the CPU, a "
              f"{gpus.describe()} (--no-virtual-gpus turns this off)", file=sys.stderr)
    statuses: list[int | None] = [None] * world_size
    # the script's folder leads sys.path, as `python script.py` puts it (the cwd for -m)
    search = os.getcwd() if module else os.path.dirname(os.path.abspath(target))
    sys.path.insert(0, search)
    # torchrun's workers start with OMP_NUM_THREADS=1 (when it is unset and N > 1), so their
    # torch computes with one thread; so do the ranks here, or float results could differ
    saved_threads = torch.get_num_threads()
    threads = rank_environment(0, nproc_per_node, nnodes).get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    error: BaseException | None = None
    start = time.perf_counter()
    try:
        with _tagged_output(tag_output) as (output, streams):
            launch = _Launch(target, module, list(args), nproc_per_node, nnodes,
                             {"master_addr": master_addr, "master_port": master_port,
                              "run_id": run_id if run_id is not None else "none"},
                             statuses, output, streams)
            try:
                world.run(_rank_program, launch, timeout=timeout)
            except SimcommError as failure:
                error = failure
    finally:
        torch.set_num_threads(saved_threads)
        with contextlib.suppress(ValueError):
            sys.path.remove(search)
    if isinstance(error, RankError) and isinstance(error.error, _RankExited):
        error = error.error
    return ScriptRun(target, statuses, world.trace, world.memory, error, time.perf_counter() - start,
                     nproc_per_node)


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
    add("--master-port", "--master_port", type=int, default=29500, help="MASTER_PORT each rank sees")
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
    add("--memory", action="store_true", help="print each rank's peak memory by label")
    add("--timeout", type=float, default=None, metavar="S", help="stop the run after S seconds")
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
            raise SystemExit("simcomm.run: --nproc-per-node gpu needs a GPU; pass a number of ranks")
        return torch.cuda.device_count()
    if flag == "--nnodes" and ":" in text:
        low, _, high = text.partition(":")
        if low != high:
            raise SystemExit(f"simcomm.run: --nnodes {text}: elastic ranges are not simulated; "
                             f"pass one number of nodes")
        text = low
    try:
        count = int(text)
    except ValueError:
        raise SystemExit(f"simcomm.run: {flag} {value!r} must be a positive int") from None
    if count < 1:
        raise SystemExit(f"simcomm.run: {flag} {value!r} must be a positive int")
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


def main(argv: Sequence[str] | None = None) -> int:
    """The command; returns its exit status."""
    options = _parser().parse_args(argv)
    if options.no_python:
        raise SystemExit("simcomm.run: --no-python cannot run on virtual ranks: a rank is a thread "
                         "of this Python process; run a Python script or module")
    nproc = _count("--nproc-per-node", options.nproc_per_node)
    try:
        gpu_preset(options.gpu)
        if options.gpu_memory is not None:
            parse_bytes(options.gpu_memory)
    except (TypeError, ValueError) as bad:
        raise SystemExit(f"simcomm.run: {bad}") from None
    nnodes = _count("--nnodes", options.nnodes)
    ignored = [name for name in _IGNORED if getattr(options, name) is not None]
    if ignored:
        flags = ", ".join("--" + name.replace("_", "-") for name in ignored)
        print(f"simcomm.run: note: {flags} ignored: every rank of every node runs in this "
              f"process, and output is tagged [rank r]", file=sys.stderr)
    run_id = str(uuid.uuid4()) if options.standalone else (options.rdzv_id or "none")
    result = run_script(options.training_script, nproc, options.training_script_args, nnodes=nnodes,
                        module=options.module, tensors=options.tensors, memory=options.memory,
                        timeout=options.timeout, device=options.device,
                        master_addr=options.master_addr or ("localhost" if options.standalone
                                                             else "127.0.0.1"),
                        master_port=options.master_port,
                        run_id=run_id, virtual_gpus=options.virtual_gpus, gpu=options.gpu,
                        gpu_memory=options.gpu_memory)
    if options.trace:
        result.trace.to_chrome_trace(options.trace)
        print(f"simcomm.run: trace of {len(result.trace)} events written to {options.trace} "
              f"(open it in https://ui.perfetto.dev)", file=sys.stderr)
    if options.memory and result.memory is not None:
        print(_memory_table(result.memory), file=sys.stderr)
    if result.error is not None and not isinstance(result.error, _RankExited):
        print("".join(traceback.format_exception_only(type(result.error), result.error)).rstrip(),
              file=sys.stderr)
    if result.returncode:
        print(result.summary(), file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
