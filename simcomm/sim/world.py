"""``World``: N virtual ranks in this process, each a thread running the same SPMD program."""
from __future__ import annotations

import contextlib
import copy
import ctypes
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .. import memory as _memory
from ..c10d.work import wait_returned
from ..collector import FullCollectionsDeferred
from ..communicator import Communicator
from ..errors import RankError, RunTimeoutError
from ..reports import format_ranks, program_location
from ..trace import Trace
from . import shape as _shape
from . import shape_reads as _shape_reads
from .cuda_map import CudaAsDevice, VirtualGPUs, cuda_answers
from .dist_world import rank_process_group
from .flops import FlopCounter
from ..errors import Aborted
from .scheduler import OneCpu, RunState, widen_futex_hash
from .transport import SimTransport

__all__ = ["World"]

#: after an abort, how long (seconds) the rank that held the turn gets to stop: it is
#: interrupted after a timeout or Ctrl-C (unless it stops by itself, at its next communication
#: call, within STOP_GRACE_S / 10), and again halfway. Still alive then, it
#: is named in the error as "could not be stopped".
STOP_GRACE_S = 1.0
#: how long the ranks woken by an abort get to unwind (they do so by themselves, in
#: milliseconds for thousands of ranks; only a program that catches the abort takes longer)
UNWIND_S = 5.0


class World:
    """``world_size`` virtual ranks that run SPMD programs.

    >>> world = World(4)
    >>> outs = world.run(program, *args)   # program(comm, *args) on every rank
    >>> outs[r]                             # what rank r returned
    >>> world.trace                         # the transport calls of that run
    >>> World(4, memory=True).memory        # after a run: bytes per rank by label (simcomm.memory)
    >>> World(1024, tensors="shape")        # fake tensors: shapes, trace and memory, no data (simcomm.sim.shape)
    >>> World(8, tensors="shape", count_flops=True).flops   # after a run: FLOPs per rank (simcomm.sim.flops)

    Each rank runs ``program(comm, *args, **kwargs)`` on a thread of its own,
    so rank-dependent control flow, blocking send/recv and per-rank
    ``backward()`` behave as on real processes: each rank has its own copy of
    the arguments and its own random state (see :meth:`run`).

    ``World(n, peers_run_on=True)``: when a rank fails, the others run on until none
    can make progress (each waits for the failed rank, or for a rank that does), as
    processes do before torchrun's agent stops them; by default every rank is stopped
    at once. ``World(n, explicit_init=True)``: each program creates its default group
    with ``init_process_group`` as a torchrun script does (``python -m simcomm.run``
    uses both); by default the group stands from the start and the call joins it.
    After a run that ended in an error, ``world.stopped_at[r]`` is the program line
    rank ``r`` was at when it was stopped.
    """

    def __init__(self, world_size: int, *, device: str | torch.device = "cpu", trace: bool = True,
                 memory: bool = False, tensors: str = "real", count_flops: bool = False,
                 map_cuda: bool | VirtualGPUs = False, peers_run_on: bool = False,
                 explicit_init: bool = False, scalar_reads: str = "error"):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"World: world_size={world_size!r} must be a positive int")
        if tensors not in _shape.TENSOR_MODES:
            raise ValueError(f"World: tensors={tensors!r} must be one of {list(_shape.TENSOR_MODES)}")
        self.world_size = world_size
        self.tensors = tensors
        #: shape-only ranks' answer to a read of a floating-point value they do not have: "error"
        #: (ShapeOnlyError naming the read) or "nan" (simcomm.sim.shape_reads)
        self.scalar_reads = _shape_reads.check_scalar_reads(scalar_reads, tensors)
        self.device = torch.device(device)
        if tensors == "shape":
            _shape.check_shape_device(self.device)
        #: count each rank's FLOPs at the dispatcher and trace them as compute (simcomm.sim.flops)
        self.count_flops = bool(count_flops)
        self.flops: list[int] | None = None   # FLOPs per rank of the last run (count_flops=True)
        #: a program's "cuda" means this World's device; torch.cuda answers as one GPU per rank
        #: (simcomm.sim.cuda_map: for scripts that hard-code CUDA, on a machine without one);
        #: ``map_cuda=VirtualGPUs("A100", memory="8GiB", per_node=4)`` names the virtual GPUs
        if not isinstance(map_cuda, (bool, VirtualGPUs)):
            raise TypeError(f"World: map_cuda={map_cuda!r} must be True, False or a simcomm.sim.cuda_map.VirtualGPUs")
        self.map_cuda = bool(map_cuda)
        self.virtual_gpus: VirtualGPUs | None = (
            (map_cuda if isinstance(map_cuda, VirtualGPUs) else VirtualGPUs()) if map_cuda else None)
        self.tracing = trace
        self.trace = Trace()
        self.track_memory = memory
        self.memory: _memory.MemoryReport | None = None   # bytes per rank of the last run (memory=True)
        #: when a rank fails, the others run on until none can make progress (each waits for the
        #: failed rank, or for a rank that does), as processes do before torchrun's agent stops
        #: them; False (the default): every rank is stopped at once
        self.peers_run_on = bool(peers_run_on)
        #: each rank's program creates its default process group with init_process_group, as a
        #: torchrun script does (dist.is_initialized() False before, torch's ValueError for a second
        #: call, dist.get_backend() the backend asked for); False (the default): the group stands
        #: from the start and init_process_group joins it
        self.explicit_init = bool(explicit_init)
        #: after a run that ended in an error: the script line of each rank still running then
        self.stopped_at: dict[int, str] = {}

    def __repr__(self) -> str:
        mode = f", tensors={self.tensors!r}" if self.tensors != "real" else ""
        return f"World(world_size={self.world_size}, device={self.device}{mode})"

    # A World holds no resources between runs; the context manager only mirrors real.Cluster.
    def __enter__(self) -> World:
        return self

    def __exit__(self, *exc_info) -> None:
        return None

    def close(self) -> None:
        return None

    def run(self, program: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``program(comm, *args, **kwargs)`` on every rank; return the ranks' results.

        Blocks until every rank has returned. What each rank sees is what a
        process of a real run sees:

        * **its own arguments**: every tensor among ``args``/``kwargs`` (also
          inside lists, tuples, dicts and namedtuples) and every
          ``torch.nn.Module`` is deep-copied for each rank and placed on the
          World's device, as each process unpickles its own copy. The caller's
          tensors are never modified. A tensor that requires grad must be a
          leaf (autograd does not follow a tensor into another process).
          Other objects are passed as they are.
        * **its own random state**: torch's default generators, Python's
          ``random`` and NumPy's global ``np.random`` start every run from the
          same fresh state on every rank, and one rank's seeding and drawing
          never changes another's numbers (:mod:`simcomm.sim.process_state`);
          so do ``sys.argv`` and ``sys.modules["__main__"]`` (each rank starts
          with the caller's). The caller's state is unchanged.
        * autograd's backward runs on the rank's own thread
          (``torch.autograd.set_multithreading_enabled(False)``), on any device.

        While the ranks of a shape-only run run, Python's full garbage collections wait
        (the oldest generation's threshold is raised to :data:`simcomm.collector.DEFERRED_FULL_COLLECTIONS`)
        and the youngest generation's collections are rarer (its threshold raised to
        :data:`simcomm.collector.YOUNG_COLLECTIONS`; ``gc.get_threshold()`` shows both): thousands
        of live ranks made each full collection walk all of them, and every rank's allocations
        set off young collections that walked the live ones again. The thresholds are set
        back when the run ends. A real-valued run leaves them as they are, as a process would.

        With ``World(n, tensors="shape")`` every rank runs under a fake tensor
        mode of its own (:mod:`simcomm.sim.shape`): tensor arguments (and modules'
        parameters) arrive as fake tensors, tensors the program creates are
        fake, compute is skipped, and collectives produce fake outputs of the
        shapes and dtypes a real-valued run gives, with the same trace, errors
        and memory report. The results hold fake tensors. A program that reads
        tensor values raises :class:`~simcomm.errors.RankError` caused by a
        :class:`~simcomm.errors.ShapeOnlyError` naming the op and the rank.

        A communicator, or a tensor that still holds one through its autograd
        graph (an output returned without ``.detach()``), works only inside its
        run: afterwards any call, a backward included, raises
        :class:`~simcomm.errors.CommunicatorClosedError` at once, since the
        other ranks' programs have returned and nobody would meet it.

        Raises:

        * :class:`~simcomm.errors.CollectiveMismatchError` or
          :class:`~simcomm.errors.DeadlockError` as soon as the simulator sees one;
        * :class:`~simcomm.errors.RankError` when a rank's program raised (the
          original exception is its ``__cause__``), also when a program used a
          rank's communicator from another thread
          (:class:`~simcomm.errors.WrongThreadError`);
        * :class:`~simcomm.errors.RunTimeoutError` within ``timeout`` +
          :data:`STOP_GRACE_S` seconds (plus the milliseconds the other ranks
          take to unwind), naming where each rank is and which rank
          threads could not be stopped (a thread in ``time.sleep`` or a long C
          call cannot be interrupted; it ends, unwinding, when the call returns,
          and never holds up a later run). ``timeout=None`` or ``math.inf``:
          no timeout.
        * ``ValueError`` for a ``timeout`` that is NaN or negative, or an
          argument tensor that requires grad and is not a leaf.

        After any error the World can run again.
        """
        timeout = _check_timeout(timeout)
        shape_only = self.tensors == "shape"
        if shape_only:
            _check_leaves(args, kwargs)
            _shape.install_device_mesh_values()
            # each rank makes its own fake mode and fake arguments on its own thread, in its first
            # turn (_run_rank): nothing per rank is built up front, and the mode's record of where
            # it was made is a short stack. Immutable arguments are passed as they are, to every
            # rank: not flattened and rebuilt per rank (a partition of the world as an argument
            # would cost O(world size) per rank, O(world size**2) for the run)
            rank_args = [((args, kwargs), not _immutable((args, tuple(kwargs.values()))))] * self.world_size
        elif _immutable((args, tuple(kwargs.values()))):
            rank_args = [((args, kwargs), None)] * self.world_size
        else:
            rank_args = [(_copy_arguments(args, kwargs, self.device), None) for _ in range(self.world_size)]
        state = RunState(self.world_size, self.device, self.tracing)
        state.shape_only = shape_only
        state.scalar_reads = self.scalar_reads
        state.flop_totals = [0] * self.world_size if self.count_flops else None
        state.map_cuda = self.map_cuda
        state.virtual_gpus = self.virtual_gpus
        state.peers_run_on = self.peers_run_on
        state.explicit_init = self.explicit_init
        self.stopped_at = state.stopped_at
        results: list[Any] = [None] * self.world_size
        reports = [None] * self.world_size if self.track_memory else None
        threads = [
            threading.Thread(target=_rank_main, name=f"simcomm-rank-{rank}", daemon=True,
                             args=(state, rank, program, *rank_args[rank][0], results, reports,
                                   rank_args[rank][1]))
            for rank in range(self.world_size)]
        del rank_args
        widen_futex_hash(self.world_size)
        state.random.save_caller()
        timed_out = None
        answers = cuda_answers(self.virtual_gpus, self.world_size) if self.map_cuda else _NO_MODE
        state.gpu_answers = answers.__enter__()
        # shape-only runs only: a real-valued program sees the thresholds a process has
        collections = FullCollectionsDeferred(active=shape_only, young=True)
        try:
            collections.__enter__()
            # a shape-only run's rank threads on one CPU (OneCpu: the caller's own CPUs are set
            # again once they are started)
            with OneCpu() if shape_only else _NO_MODE:
                for thread in threads:
                    thread.start()
            state.start()
            timed_out = _wait_for_run(state, timeout)
        except BaseException as interrupt:  # KeyboardInterrupt in a notebook: stop the ranks too
            state.abort(interrupt)
            try:
                stuck = _stop(threads, state, interrupt_holders=True)
            finally:
                _end_run(state)
            if stuck:
                interrupt.add_note(stuck)
            answers.__exit__(None, None, None)
            collections.__exit__()
            raise
        try:
            stuck = _stop(threads, state, interrupt_holders=timed_out is not None)
        finally:
            _end_run(state)
            answers.__exit__(None, None, None)
            collections.__exit__()
        self.trace = Trace(state.events, backend="simcomm")
        self.memory = _memory.MemoryReport(reports) if reports is not None and None not in reports else None
        self.flops = state.flop_totals
        if state.rank_errors:
            (rank, error), others = state.rank_errors[0], state.rank_errors[1:]
            failure: BaseException = RankError(rank, error, tuple(r for r, _ in others))
            failure.__cause__ = error
        elif state.error is not None:
            failure = state.error.with_traceback(None)
        else:
            return results
        if stuck:
            failure.add_note(stuck)
        raise failure


#: how often (seconds) the run's waits are checked against init_process_group(timeout=)
GROUP_TIMEOUT_POLL_S = 0.05


def _wait_for_run(state: RunState, timeout: float | None) -> RunTimeoutError | None:
    """Wait for the run to end; abort it after ``timeout`` seconds, or when a rank has waited
    in a call of its groups longer than its ``init_process_group(timeout=)`` (where gloo raises
    "Timed out waiting ... ms"). Returns the RunTimeoutError it aborted with, if any."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        # a program may give its group a timeout at any point: the wait wakes now and then to look
        step = GROUP_TIMEOUT_POLL_S if deadline is None else min(
            GROUP_TIMEOUT_POLL_S, max(0.0, deadline - time.monotonic()))
        if state.done.wait(step):
            return None
        if not state.group_timeouts and (deadline is None or time.monotonic() < deadline):
            continue
        with state.lock:
            if not state.running or state.error is not None:
                return None
            expired = state.expired_wait_locked() if state.group_timeouts else None
            if expired is not None:
                rank, limit, waited = expired
                head = (f"rank {rank} waited {waited:.1f} s in a call of its process group, longer than "
                        f"the timeout={limit:g} s its init_process_group gave (gloo raises RuntimeError "
                        f"\"Timed out waiting {limit * 1000:.0f}ms\" there); ranks still running:")
            elif deadline is not None and time.monotonic() >= deadline:
                head = f"the run did not finish within timeout={timeout} s; ranks still running:"
            else:
                continue
            where = state.describe_ranks_locked(sys._current_frames())
            timed_out = RunTimeoutError("\n".join([head, *where]))
            state.abort_locked(timed_out)
            return timed_out


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"World.run: timeout={timeout!r} must be a number of seconds, math.inf or None")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"World.run: timeout={timeout!r} must be a non-negative number of seconds "
                         f"(math.inf or None for no timeout)")
    return None if math.isinf(timeout) else float(timeout)


# -- each rank's own copy of the arguments ---------------------------------------------------

_IMMUTABLE_LEAVES = (int, float, complex, str, bytes, bool, type(None), type(Ellipsis), range,
                     torch.dtype, torch.device, torch.Size, torch.memory_format, torch.layout)


def _immutable(value: Any) -> bool:
    """Whether ``value`` is built of tuples and frozensets of numbers, strings, dtypes and the
    like only: nothing a rank could change, so one object can serve every rank (a real process's
    unpickled copy is indistinguishable from it)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, (tuple, frozenset)):
            stack.extend(item)
        elif not isinstance(item, _IMMUTABLE_LEAVES):
            return False
    return True


def _own_copy(leaf: Any, memo: dict) -> Any:
    """A rank's own deep copy of a mutable argument that is neither a tensor nor a module; an
    immutable one as it is. An object ``copy.deepcopy`` refuses (a lock, a socket) is shared: a
    real run could not pickle it at all."""
    if _immutable(leaf):
        return leaf
    try:
        return copy.deepcopy(leaf, memo)
    except Exception:
        return leaf


def _copy_arguments(args: tuple, kwargs: dict, device: torch.device) -> tuple[tuple, dict]:
    """One rank's deep copy of ``args``/``kwargs``, tensors and modules on ``device``, as a real
    process unpickles its own: lists, dicts and other mutable objects are the rank's own too
    (an object ``copy.deepcopy`` refuses is shared); immutable leaves are shared.

    Tensors that share storage within the arguments share it in the copy too
    (one ``deepcopy`` memo per rank), as after unpickling; ``.grad`` is not
    copied (pickling drops it).
    """
    leaves, spec = pytree.tree_flatten((args, kwargs))
    memo: dict = {}
    copies = []
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            leaf = _copy_tensor(leaf, device, memo, lambda: _argument_name(args, kwargs, index))
        elif isinstance(leaf, torch.nn.Module):
            leaf = copy.deepcopy(leaf, memo).to(device)
            for parameter in leaf.parameters():
                parameter.grad = None
        else:
            leaf = _own_copy(leaf, memo)
        copies.append(leaf)
    return pytree.tree_unflatten(copies, spec)


def _check_leaves(args: tuple, kwargs: dict) -> None:
    """The argument check of :func:`_copy_tensor`, for shape-only runs (which copy no data)."""
    for index, leaf in enumerate(pytree.tree_leaves((args, kwargs))):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and not leaf.is_leaf:
            _copy_tensor(leaf, leaf.device, {}, lambda: _argument_name(args, kwargs, index))


def _copy_tensor(tensor: torch.Tensor, device: torch.device, memo: dict, name: Callable[[], str]
                 ) -> torch.Tensor:
    if tensor.requires_grad and not tensor.is_leaf:
        raise ValueError(
            f"World.run: argument {name()} requires grad and is not a leaf (grad_fn="
            f"{type(tensor.grad_fn).__name__}); each rank gets its own copy of its arguments, as each "
            f"process of a real run unpickles its own, and autograd cannot follow a tensor into that "
            f"copy: pass .detach() (or .detach().requires_grad_() for a new leaf)")
    if tensor.device == device:
        mine = copy.deepcopy(tensor, memo)
        mine.grad = None
        return mine
    with torch.no_grad():
        moved = tensor.detach().to(device, copy=True)
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(moved, requires_grad=tensor.requires_grad)
    return moved.requires_grad_(tensor.requires_grad)


def _argument_name(args: tuple, kwargs: dict, index: int) -> str:
    """``args[1]['w1']``: where the ``index``-th leaf sits in the arguments."""
    paths, _ = pytree.tree_flatten_with_path((args, kwargs))
    path, _leaf = paths[index]
    head, rest = path[0], path[1:]
    return ("args" if head.idx == 0 else "kwargs") + pytree.keystr(rest)


# -- a rank thread -------------------------------------------------------------------------------

def _rank_main(state: RunState, rank: int, program: Callable, args: tuple, kwargs: dict,
               results: list, reports: list | None, fake_arguments: bool | None = None) -> None:
    try:
        try:
            _run_rank(state, rank, program, args, kwargs, results, reports, fake_arguments)
        finally:
            state.release_if_held()   # an interrupt that landed while this thread held the lock
    except Aborted:   # raised into this thread while it was already finishing
        pass


def _run_rank(state: RunState, rank: int, program: Callable, args: tuple, kwargs: dict,
              results: list, reports: list | None, fake_arguments: bool | None = None) -> None:
    """Rank ``rank``'s whole program on its thread. ``fake_arguments``: ``None`` for a
    real-valued run (``args``/``kwargs`` are the rank's own already); on a shape-only run the
    rank makes its own fake mode in its first turn, and with ``True`` turns ``args``/``kwargs``
    into fake tensors of that mode (and copies other mutable objects) first."""
    comm = Communicator(SimTransport(state, state.world, rank))
    fake_mode = None
    try:
        # backward on this thread, where the scheduler sees its waits (CUDA would use
        # autograd's device threads, shared by every rank); thread-local
        torch.autograd.set_multithreading_enabled(False)
        state.wait_turn(rank)
        if fake_arguments is not None:
            fake_mode = _shape.rank_mode(state.scalar_reads)
            if fake_arguments:
                args, kwargs = _shape.fake_arguments(args, kwargs, fake_mode, state.device, _own_copy)
        # shape-only: this thread's own fake mode (simcomm.sim.shape), innermost, for the whole program
        counter = FlopCounter(comm.transport) if state.flop_totals is not None else None
        with (rank_process_group(comm), fake_mode if fake_mode is not None else _NO_MODE,
              _shape.FunctionalCollectives(fake_mode) if fake_mode is not None else _NO_MODE,
              _track(state, rank, reports), counter if counter is not None else _NO_MODE,
              CudaAsDevice(state.device) if state.map_cuda else _NO_MODE):
            try:
                result = program(comm, *args, **kwargs)
                # returned: used (functional collectives' results waited on)
                results[rank] = result if _immutable(result) else wait_returned(result)
            finally:
                if counter is not None:
                    state.flop_totals[rank] = counter.total
            comm.transport.check_all_waited()   # a handle never waited on is an error
    except Aborted:
        pass
    except BaseException as error:
        if not _caused_by_abort(error):
            if fake_mode is not None:
                refusal = _shape.data_dependent_error(error, rank)
                if refusal is not None:
                    refusal.__cause__, error = error, refusal
            state.rank_failed(rank, error)
    finally:
        state.rank_finished(rank)


_NO_MODE = contextlib.nullcontext()


def _track(state: RunState, rank: int, reports: list | None):
    """The rank's memory tracking: on virtual GPUs with the GPU's capacity (torch.OutOfMemoryError past it)."""
    if not state.map_cuda or reports is None:
        return _memory.track(rank, reports)
    return _memory.track(rank, reports, capacity=state.virtual_gpus.capacity,
                         over_capacity=state.gpu_answers.out_of_memory)


def _caused_by_abort(error: BaseException | None) -> bool:
    """Whether ``error`` was raised while unwinding from an abort (a program may catch
    the abort and raise something else from it)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, Aborted):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


# -- ending a run ------------------------------------------------------------------------------

def _interrupt(state: RunState, rank: int, deadline: float) -> None:
    """Raise ``Aborted`` inside rank ``rank``'s thread at its next Python instruction (a
    thread in ``time.sleep``, a lock wait or a C call gets it only when that call returns),
    unless the rank has begun to finish.

    Decided under the run's ``exit_lock``, which a rank takes as it enters
    ``rank_finished``, so no interrupt is sent to a thread past that point (it would
    land in its last lines or in ``threading``'s own). That lock is held for a moment
    only, by finishing ranks; the run's main lock, which hundreds of unwinding ranks
    may hold in turn for seconds on a loaded machine, is not waited for. Waited for
    until ``deadline`` (``time.monotonic()``) at most.
    """
    if not state.exit_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        return
    try:
        thread = state.threads[rank]
        if rank not in state.exiting and thread is not None and thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                       ctypes.py_object(Aborted))
    finally:
        state.exit_lock.release()


def _stop(threads: list[threading.Thread], state: RunState, *, interrupt_holders: bool) -> str:
    """Wait for every rank thread to end; return the note naming those that could not be
    stopped ("" when all ended).

    The rank that held the turn when the run was aborted from outside (timeout,
    Ctrl-C) stops by itself at its next communication call; one still running
    after a tenth of :data:`STOP_GRACE_S` is interrupted (an exception raised
    into a thread may land anywhere, even in a callback that swallows it), and
    any holder still alive halfway through :data:`STOP_GRACE_S` again; holders
    get :data:`STOP_GRACE_S` in all. The
    ranks the abort woke unwind by themselves and get :data:`UNWIND_S` (a
    program that catches the abort and goes on could take longer).
    """
    start = time.monotonic()
    holder_ranks = state.turn_holders()
    holders = [threads[rank] for rank in holder_ranks]
    if interrupt_holders:
        for thread in holders:
            thread.join(max(0.0, start + STOP_GRACE_S / 10 - time.monotonic()))
        for rank in holder_ranks:
            _interrupt(state, rank, start + STOP_GRACE_S / 4)
    for thread in holders:
        thread.join(max(0.0, start + STOP_GRACE_S / 2 - time.monotonic()))
    for rank in holder_ranks:
        _interrupt(state, rank, start + STOP_GRACE_S * 3 / 4)
    for thread in holders:
        thread.join(max(0.0, start + STOP_GRACE_S - time.monotonic()))
    for thread in threads:
        if thread not in holders:
            thread.join(max(0.0, start + UNWIND_S - time.monotonic()))
    stuck = [rank for rank, thread in enumerate(threads) if thread.is_alive()]
    if not stuck:
        return ""
    frames = sys._current_frames()
    by_place: dict[str, list[int]] = {}
    for rank in stuck:
        by_place.setdefault(program_location(frames.get(threads[rank].ident)), []).append(rank)
    lines = ["rank threads that could not be stopped (they keep running in the background, unwind "
             "when their current call returns, and hold up no later run):"]
    lines.extend(f"  rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks) if len(ranks) > 1 else ranks[0]} "
                 f"at {place}" for place, ranks in by_place.items())
    return "\n".join(lines)


def _end_run(state: RunState) -> None:
    """Close the run's communicators and give the caller its random state back."""
    state.close()
    state.random.restore_caller()
