"""Virtual ranks: the in-process transport and the scheduler that never hangs.

Every rank of a :class:`simcomm.World` is a thread running the program, and
the ranks take turns (see :class:`RunState`). A collective is a *rendezvous*:
each rank deposits its tensor in the group's slot for that step and blocks on
a lock of its own; the last rank to arrive computes the collective with
:mod:`simcomm.collectives` and marks each waiting rank ready, to be woken
exactly once when its turn comes.

An asynchronous call (``async_op=True``, ``isend``, ``irecv``) deposits a copy
of its input at the rendezvous (or posts its message) without blocking and
returns a :class:`~simcomm.handles.Handle`; the rank blocks, visibly to the
scheduler, only in the handle's ``wait()``. The step of a collective is counted
when it is issued, so the mismatch check compares what the ranks *issued* at
each step. A program that returns with a handle it never waited on raises
:class:`~simcomm.handles.UnwaitedHandleError`, naming the rank and the line
that issued it.

Because the simulator sees every rank at once, it can tell at once what real
NCCL shows as a hang:

* a rank arriving with another op or incompatible arguments than the ranks
  already waiting raises :class:`~simcomm.errors.CollectiveMismatchError`;
* a rank about to block when every other unfinished rank is blocked too (or
  a rank finishing while all the others are blocked) raises
  :class:`~simcomm.errors.DeadlockError`, listing who waits for whom;
* a communicator used after its run ended raises
  :class:`~simcomm.errors.CommunicatorClosedError`, and one used from a thread
  other than its rank's raises :class:`~simcomm.errors.WrongThreadError`
  (:meth:`RunState.lock_for`, the entry of every communication call).

Either error, or a rank's own exception, *aborts* the run: every blocked rank
is woken and unwinds with :class:`_Aborted`, and ``World.run`` raises the error.

**The lock.** ``RunState.lock`` guards the scheduler's tables (who is blocked,
who is ready, the slots and channels). Method names say what they do with it:
``*_locked`` methods are called with the lock held and return with it held;
``lock_for`` returns holding it; ``release_and_wait`` and ``abort_and_release``
are called with it held and release it; every other method takes it itself.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from . import collectives as math
from . import memory
from . import shape as _shape
from .errors import (CollectiveMismatchError, CommunicatorClosedError, DeadlockError, SimcommError,
                     WrongThreadError)
from .handles import Handle, P2POp, UnwaitedHandleError
from .rank_random import RankRandomState
from .trace import Record, Recorder
from .transport import TransportBase
from .waits import Wait as _Wait
from .waits import describe_deadlock, describe_ranks, describe_waits, format_ranks, p2p_detail, program_location

__all__ = ["SimTransport", "RunState", "program_location"]


_get_ident = threading.get_ident


class _Aborted(BaseException):
    """Unwinds a rank's program after the run was aborted (not an ``Exception``,
    so a program's ``except Exception`` does not swallow it)."""


def _shared_entries(outputs: list, owner: int) -> list[bool]:
    """Which ranks must copy their output because another rank keeps the same tensor.

    ``owner`` (the rank that computed the outputs) keeps the original of its own
    entry; every other holder gets a copy (made by :func:`_copy_small` at once, or
    by the holder itself on its own thread for large tensors).
    """
    first: dict[int, int] = {}
    shared = [False] * len(outputs)
    for index, out in enumerate(outputs):
        if isinstance(out, torch.Tensor):
            if id(out) in first:
                shared[index] = True
            else:
                first[id(out)] = index
    mine = outputs[owner]
    if shared[owner]:
        shared[owner], shared[first[id(mine)]] = False, True
    return shared


_COPY_HERE_BELOW = 1 << 16  # bytes: smaller shared outputs are copied by the rank that computed them


def _copy_small(slot: _Slot) -> None:
    """Copy small shared outputs right away, while this thread's caches are warm; a
    woken rank's first touches are the expensive ones. Large ones stay per rank."""
    for index, shared in enumerate(slot.shared):
        out = slot.outputs[index]
        if shared and out.nbytes < _COPY_HERE_BELOW:
            slot.outputs[index], slot.shared[index] = out.clone(), False


def _materialize(slot: _Slot, rank: int, state: RunState):
    out = slot.outputs[rank]
    # the slot keeps no reference to this rank's tensors or frames: they are freed when the program drops them
    slot.outputs[rank] = slot.inputs[rank] = slot.frames[rank] = None
    if state.shape_only:    # meta outputs become fake tensors of this rank's own mode
        return memory.received(_shape.own(out, state.device))
    return memory.received(out.clone() if slot.shared[rank] else out)


def _format_args(sig: tuple) -> str:
    return ", ".join(f"{name}={str(value).removeprefix('torch.')}" for name, value in sig)


# -- shared state of one run ---------------------------------------------------------------

def _where(frame) -> str:
    """Where a rank called from: a live frame, or the location an asynchronous call kept
    when it was issued (its frame has moved on since)."""
    return frame if isinstance(frame, str) else program_location(frame)




class _Slot:
    """One collective of one group at one step: where the members meet.

    ``frames[i]`` is a blocked member's live frame, or the location string of a
    member that issued the call asynchronously. ``moved`` is when the last member
    computed the outputs (seconds since the run started).
    """

    __slots__ = ("op", "sig", "inputs", "frames", "arrived", "waiting", "outputs", "shared", "failed",
                 "moved")

    def __init__(self, op: str, sig: tuple, world_size: int):
        self.op, self.sig = op, sig
        self.inputs: list = [None] * world_size
        self.frames: list = [None] * world_size
        self.arrived: list[int] = []      # group-local ranks, in arrival order
        self.waiting: list[int] = []      # global ranks blocked on this slot
        self.outputs: list | None = None
        self.shared: list[bool] = []
        self.failed = False
        self.moved = 0.0


class _Message:
    """A posted send or recv waiting for its partner.

    ``owned``: ``tensor`` is a private copy made at issue (an ``isend``), handed
    over without another copy. ``blocked``: the poster is blocked on this message
    (a blocking call, or a ``wait()``) and must be woken when it completes.
    """

    __slots__ = ("kind", "rank", "tensor", "shape", "dtype", "frame", "owned", "blocked", "done",
                 "moved")

    def __init__(self, kind: str, rank: int, tensor, shape, dtype, frame, owned: bool = False):
        self.kind, self.rank, self.tensor, self.shape, self.dtype, self.frame = (
            kind, rank, tensor, shape, dtype, frame)
        self.owned = owned
        self.blocked = False
        self.done = False
        self.moved = 0.0


class _Group:
    """A set of ranks that run collectives together; shared by its members' transports."""

    __slots__ = ("key", "ranks", "slots", "channels")

    def __init__(self, key: tuple, ranks: Sequence[int]):
        self.key = key
        self.ranks = tuple(ranks)
        self.slots: dict[int, _Slot] = {}
        self.channels: dict[tuple[int, int], deque[_Message]] = {}


class RunState:
    """Everything the ranks of one run share: the lock, whose turn it is, the first error.

    Ranks take turns: exactly one rank thread runs at a time, and it hands the
    turn on only when it blocks in a communication call or finishes. A rank
    woken by a completed collective joins the ``ready`` queue instead of
    running at once, so every handoff wakes exactly one thread and no two rank
    threads compete for the interpreter lock. Runs are therefore
    deterministic, and a deadlock is simply "nobody ready, everybody blocked".

    At each handoff the rank handing the turn on saves torch's default
    generator state and the rank taking it loads its own
    (:class:`~simcomm.rank_random.RankRandomState`), so each rank draws from
    a random stream of its own.

    Lock discipline (see the module docstring): the scheduler's decisions are
    taken under ``lock``; waking another rank's thread and blocking on one's
    own waiter happen after it is released.
    """

    def __init__(self, world_size: int, device: torch.device, trace: bool):
        self.lock = threading.Lock()
        self.world_size = world_size
        self.device = device
        self.waiters = [threading.Lock() for _ in range(world_size)]
        for waiter in self.waiters:
            waiter.acquire()
        self.threads: list[threading.Thread | None] = [None] * world_size
        self.thread_ids: list[int | None] = [None] * world_size
        self.started: set[int] = set()
        self.blocked: dict[int, _Wait] = {}
        self.ready: deque[int] = deque()
        self.running = world_size
        self.finished: set[int] = set()
        self.error: BaseException | None = None
        self.rank_errors: list[tuple[int, BaseException]] = []
        self.closed = False
        self.woken_by_abort: set[int] = set()
        self.done = threading.Event()
        self.random = RankRandomState(world_size, device)
        self.events: list[tuple] | None = [] if trace else None
        self.clock_zero = time.perf_counter()
        self.world = _Group(("world",), range(world_size))
        #: fake tensors on every rank (simcomm.shape): collective math on meta tensors
        self.shape_only = False

    # -- the run's life: called by World and by each rank thread (each takes the lock) --

    def start(self) -> None:
        """Give rank 0 the first turn; the others are ready in rank order."""
        with self.lock:
            self.ready.extend(range(1, self.world_size))
        self.waiters[0].release()

    def wait_turn(self, rank: int) -> None:
        """Called by rank ``rank``'s thread before its program: wait for the first turn."""
        self.threads[rank] = threading.current_thread()
        self.thread_ids[rank] = threading.get_ident()
        self.waiters[rank].acquire()
        if self.error is not None:
            raise _Aborted
        self.started.add(rank)
        self.random.set_state(self.random.states[rank])

    def rank_failed(self, rank: int, error: BaseException) -> None:
        """``rank``'s program raised ``error``: record it and abort the run."""
        with self.lock:
            if self.error is None or self.rank_errors:
                self.rank_errors.append((rank, error))
            self.abort_locked(self.error or error)

    def rank_finished(self, rank: int) -> None:
        """``rank``'s program returned (or unwound): hand the turn on, or end the run."""
        with self.lock:
            self.running -= 1
            self.finished.add(rank)
            if self.running == 0:
                self.done.set()
                return
            if self.error is not None:
                return
            next_rank = self.ready.popleft() if self.ready else None
            if next_rank is None and len(self.blocked) == self.running:
                self.abort_locked(DeadlockError(self.describe_deadlock_locked()))
        if next_rank is not None:
            self.waiters[next_rank].release()

    def abort(self, error: BaseException) -> None:
        """Abort the run from outside it (a timeout, Ctrl-C)."""
        with self.lock:
            self.abort_locked(error)

    def close(self) -> None:
        """The run has ended: any later use of its communicators raises at once."""
        with self.lock:
            self.closed = True

    # -- the entry of every communication call --

    def lock_for(self, rank: int, op: str) -> None:
        """Take the lock for a communication call ``op`` of rank ``rank``; return holding it.

        Raises instead, without the lock: :class:`_Aborted` on an aborted run's own
        rank thread; :class:`~simcomm.errors.CommunicatorClosedError` when the run
        has ended; :class:`~simcomm.errors.WrongThreadError` (and the run fails with
        it) when the caller is not rank ``rank``'s thread.
        """
        if _get_ident() != self.thread_ids[rank] or self.closed:
            raise self._refusal(rank, op)
        self.lock.acquire()
        if self.error is not None:
            self.lock.release()
            raise _Aborted

    def _refusal(self, rank: int, op: str) -> BaseException:
        """The error for a call of rank ``rank``'s communicator from a thread not its own."""
        caller = threading.current_thread()
        if self.error is not None and caller in self.threads:
            return _Aborted()   # a rank thread of an aborted run, still unwinding
        if self.closed:
            return CommunicatorClosedError(
                f"{op} on rank {rank}: the run this communicator belongs to has ended, so no "
                f"rank is there to meet this call. A communicator works only inside its run; "
                f"if this is the backward of a tensor a program returned, call backward inside "
                f"the program or return the tensor's .detach()")
        error = WrongThreadError(
            f"{op} on rank {rank}: the communicator of rank {rank} was used from thread "
            f"{caller.name!r}; each rank's communicator must be used on its rank's thread "
            f"({self.threads[rank].name if self.threads[rank] else 'not started'!r})")
        if caller not in self.threads:
            self.rank_failed(rank, error)   # a helper thread's error would otherwise go unseen
        return error

    # -- blocking and waking: called by the transport with the lock held --

    def release_and_wait(self, rank: int, wait: _Wait) -> None:
        """Block ``rank`` until woken. Called with the lock held; releases it.

        Under the lock: record the wait, pick the next ready rank, or see that
        nobody can run (a deadlock: abort). Then, released: wake the next rank,
        sleep on this rank's waiter, and on waking load this rank's random state.
        Raises :class:`_Aborted` if the run was aborted.
        """
        self.blocked[rank] = wait
        random = self.random
        random.states[rank] = random.get_state()
        next_rank = self.ready.popleft() if self.ready else None
        deadlock = next_rank is None and len(self.blocked) == self.running
        if deadlock:
            self.abort_locked(DeadlockError(self.describe_deadlock_locked()))
        self.lock.release()
        if deadlock:
            raise _Aborted
        if next_rank is not None:
            self.waiters[next_rank].release()
        self.waiters[rank].acquire()
        if self.error is not None:
            raise _Aborted
        random.set_state(random.states[rank])

    def abort_and_release(self, error: BaseException) -> NoReturn:
        """Abort the run with ``error``. Called with the lock held; releases it and
        raises :class:`_Aborted` to unwind the calling rank."""
        self.abort_locked(error)
        self.lock.release()
        raise _Aborted

    def wake_locked(self, rank: int) -> None:
        """``rank`` may continue: it runs when the current rank hands on its turn."""
        del self.blocked[rank]
        self.ready.append(rank)

    def abort_locked(self, error: BaseException) -> None:
        """Record the run's first error and wake every blocked or ready rank to unwind."""
        if self.error is None:
            self.error = error
        for rank in [*self.blocked, *self.ready]:
            self.waiters[rank].release()
            self.woken_by_abort.add(rank)
        self.blocked.clear()
        self.ready.clear()
        self.done.set()

    # -- reports --

    def describe_deadlock_locked(self) -> str:
        return describe_deadlock(self.blocked, self.finished, self.world_size)

    def turn_holders(self) -> list[int]:
        """Unfinished ranks that were running program code, not waiting in the scheduler,
        when the run was aborted: the rank that held the turn. The abort woke every
        other rank, and those unwind by themselves."""
        with self.lock:
            return [rank for rank in self.started
                    if rank not in self.finished and rank not in self.woken_by_abort]

    def describe_ranks_locked(self, frames: dict[int, object]) -> list[str]:
        """Where each unfinished rank is (for the timeout message); ``frames`` maps
        thread ids to their current frames (``sys._current_frames()``)."""
        lines = describe_waits(self.blocked, self.world_size)
        others: dict[int, str] = {}
        for rank in range(self.world_size):
            if rank in self.blocked or rank in self.finished:
                continue
            thread = self.threads[rank]
            if rank not in self.started:
                others[rank] = "never started (waiting for a first turn)"
            elif rank in self.ready:
                others[rank] = ("is ready and waits for its turn at "
                                + program_location(frames.get(thread.ident) if thread else None))
            else:
                others[rank] = "computes at " + program_location(frames.get(thread.ident) if thread else None)
        lines.extend(describe_ranks(others, self.world_size))
        return lines

# -- the transport -----------------------------------------------------------------------

class SimTransport(TransportBase):
    """The :class:`~simcomm.transport.Transport` of one virtual rank in one group.

    ``pending`` holds the rank's issued, not yet waited asynchronous calls; the
    transports of the rank's subgroups share it (and the trace ``recorder``).
    """

    def __init__(self, state: RunState, group: _Group, rank: int, pending: dict | None = None,
                 recorder: Recorder | None = None):
        if recorder is None and state.events is not None:
            recorder = Recorder(state.events, state.clock_zero)
        super().__init__(rank, group.ranks, state.device, recorder)
        self._state = state
        self._group = group
        self._pending: dict[int, _Pending] = {} if pending is None else pending
        # the rank's thread (an object, not an ident: idents are reused by later runs' threads)
        self._thread = threading.current_thread()
        self._fruitless_polls = 0

    def __repr__(self) -> str:
        return f"SimTransport(rank={self.rank}, ranks={list(self.ranks)})"

    # -- collectives --

    def _collective(self, op: str, tensor: torch.Tensor | None, sig: tuple,
                    compute: Callable[[list], list], root: int | None = None, async_op: bool = False):
        step = self._next_step()
        record = None
        if self._recorder is not None:
            record = self._begin(op, step, tensor, root, args=dict(sig[2:] if tensor is not None else sig),
                                 async_op=async_op)
        if async_op:   # the input is copied: the program may reuse its tensor before wait()
            return self._issue(op, step, tensor.clone() if tensor is not None else None, sig, compute,
                               record)
        out = self._rendezvous(op, step, tensor, sig, compute)
        self._end(record, out)
        return out

    def _arrive(self, op: str, step: int, tensor, sig: tuple, frame) -> _Slot:
        """Deposit this rank's input in its group's slot for ``step``.

        Takes the run's lock and returns *holding it*; on a mismatch it aborts
        the run, releases the lock and raises :class:`_Aborted`.
        """
        state, group, me = self._state, self._group, self.rank
        state.lock_for(self.global_rank, op)
        slot = group.slots.get(step)
        if slot is None:
            slot = group.slots[step] = _Slot(op, sig, self.world_size)
        elif slot.op != op or slot.sig != sig:
            self._mismatch_and_release(slot, op, sig, frame)
        slot.inputs[me] = tensor
        slot.frames[me] = frame
        slot.arrived.append(me)
        return slot

    def _complete(self, slot: _Slot, step: int, compute: Callable[[list], list]) -> None:
        """The last rank to arrive does the collective's tensor work (with warm caches),
        outside the lock, then wakes the members blocked on the slot."""
        state = self._state
        try:
            with memory.untracked():    # outputs are counted on the ranks that receive them
                if state.shape_only:    # meta outputs; each rank rebuilds its own (_materialize)
                    slot.outputs = _shape.compute_on_meta(compute, slot.inputs)
                else:
                    slot.outputs = compute(slot.inputs)
                    slot.shared = _shared_entries(slot.outputs, owner=self.rank)
                    _copy_small(slot)
        except BaseException:
            slot.failed = True
            raise
        finally:
            slot.moved = time.perf_counter() - state.clock_zero
            with state.lock:
                del self._group.slots[step]
                for rank in slot.waiting:
                    state.wake_locked(rank)

    def _rendezvous(self, op: str, step: int, tensor, sig: tuple, compute: Callable[[list], list]):
        """A blocking collective: arrive, then wait for the last member or be it."""
        state = self._state
        frame = sys._getframe(2)
        slot = self._arrive(op, step, tensor, sig, frame)
        if len(slot.arrived) < self.world_size:
            slot.waiting.append(self.global_rank)
            state.release_and_wait(self.global_rank, _Wait(op, frame, slot, self._group.ranks, step))
            if slot.failed:
                raise _Aborted
            return _materialize(slot, self.rank, state)
        state.lock.release()
        self._complete(slot, step, compute)
        return _materialize(slot, self.rank, state)

    def _issue(self, op: str, step: int, tensor, sig: tuple, compute: Callable[[list], list],
               record: Record | None) -> Handle:
        """An asynchronous collective: arrive without blocking (completing the collective
        if this rank is the last member); the rank blocks only in the handle's ``wait()``."""
        where = program_location(sys._getframe(2))
        slot = self._arrive(op, step, tensor, sig, where)
        last = len(slot.arrived) == self.world_size
        self._state.lock.release()
        if last:
            self._complete(slot, step, compute)
        return self._handle(_PendingCollective(self, slot, step, record, where))

    def _mismatch_and_release(self, slot: _Slot, op: str, sig: tuple, frame) -> NoReturn:
        """Abort the run with a CollectiveMismatchError. Called with the lock held; releases it."""
        ranks = self._group.ranks
        first = slot.arrived[0]
        arrived = sorted(ranks[i] for i in slot.arrived)
        message = (
            f"ranks of group {list(ranks)} disagree at collective step {self._step - 1}:\n"
            f"  {f'ranks {format_ranks(arrived)}' if len(arrived) > 1 else f'rank {arrived[0]}'} called "
            f"{slot.op}({_format_args(slot.sig)}) "
            f"at {_where(slot.frames[first])}\n"
            f"  rank {ranks[self.rank]} called {op}({_format_args(sig)}) at {_where(frame)}\n"
            f"every rank of a group must call the same collectives in the same order with "
            f"matching shapes, dtypes and arguments")
        self._state.abort_and_release(CollectiveMismatchError(message))

    @staticmethod
    def _sig(tensor: torch.Tensor, **args) -> tuple:
        return (("shape", tuple(tensor.shape)), ("dtype", tensor.dtype), *args.items())

    def all_reduce(self, tensor: torch.Tensor, op: str, async_op: bool = False):
        return self._collective("all_reduce", tensor, self._sig(tensor, op=op),
                                lambda inputs: math.all_reduce(inputs, op), async_op=async_op)

    def all_gather(self, tensor: torch.Tensor, dim: int, async_op: bool = False):
        return self._collective("all_gather", tensor, self._sig(tensor, dim=dim),
                                lambda inputs: math.all_gather(inputs, dim), async_op=async_op)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, op: str, async_op: bool = False):
        return self._collective("reduce_scatter", tensor, self._sig(tensor, dim=dim, op=op),
                                lambda inputs: math.reduce_scatter(inputs, dim, op), async_op=async_op)

    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int, async_op: bool = False):
        return self._collective("all_to_all", tensor,
                                self._sig(tensor, scatter_dim=scatter_dim, gather_dim=gather_dim),
                                lambda inputs: math.all_to_all(inputs, scatter_dim, gather_dim),
                                async_op=async_op)

    def gather(self, tensor: torch.Tensor, dst: int, dim: int, async_op: bool = False):
        return self._collective("gather", tensor, self._sig(tensor, dst=dst, dim=dim),
                                lambda inputs: math.gather(inputs, dst, dim), root=dst, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False):
        return self._collective("broadcast", tensor, self._sig(tensor, src=src),
                                lambda inputs: math.broadcast(inputs, src), root=src, async_op=async_op)

    def barrier(self, async_op: bool = False):
        return self._collective("barrier", None, (), lambda inputs: [None] * len(inputs), async_op=async_op)

    def subgroup(self, groups: tuple[tuple[int, ...], ...]) -> SimTransport:
        parent, step = self._group, self._step

        def split(inputs: list) -> list:
            members = [None] * len(inputs)
            for index, part in enumerate(groups):
                group = _Group((*parent.key, step, index), [parent.ranks[r] for r in part])
                for position, rank in enumerate(part):
                    members[rank] = (group, position)
            return members

        group, position = self._collective("subgroup", None, (("groups", groups),), split)
        return SimTransport(self._state, group, position, self._pending, self._recorder)

    # -- point to point --

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> Handle | None:
        """Blocking: returns once the matching recv has taken the data. ``async_op``: an
        ``isend``, whose copy of ``tensor`` is taken now and handed over when matched."""
        record = self._p2p_begin("send", dst, tensor, async_op=async_op)
        if async_op:
            tensor = tensor.clone()
        return self._p2p("send", dst, (self.rank, dst), tensor, tensor.shape, tensor.dtype, record, async_op)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, async_op: bool = False):
        shape = torch.Size(shape)
        record = self._p2p_begin("recv", src, None, shape.numel() * dtype.itemsize, async_op)
        out = self._p2p("recv", src, (src, self.rank), None, shape, dtype, record, async_op)
        return out if async_op else memory.received(out)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Handle]:
        """Issue every op without blocking, in list order; one handle per op."""
        return [self.send(op.data, op.peer, async_op=True) if op.op == "isend"
                else self.recv(op.data[0], op.data[1], op.peer, async_op=True) for op in ops]

    def _p2p(self, kind: str, peer: int, key: tuple[int, int], tensor, shape, dtype,
             record: Record | None, async_op: bool):
        """Match this send/recv with its partner on the (sender, receiver) channel, or post it.

        A blocking call blocks until matched; an asynchronous one returns a handle.
        """
        state, group = self._state, self._group
        frame = program_location(sys._getframe(2)) if async_op else sys._getframe(2)
        me = self.global_rank
        state.lock_for(me, kind)
        channel = group.channels.setdefault(key, deque())
        if channel and channel[0].kind != kind:
            partner = channel.popleft()
            if partner.shape != shape or partner.dtype != dtype:
                self._p2p_mismatch_and_release(_Message(kind, me, tensor, shape, dtype, frame), partner)
            if kind == "send":
                partner.tensor = tensor if async_op or state.shape_only else tensor.clone()
                self._deliver_locked(partner)
                state.lock.release()
                out = None
            else:
                state.lock.release()
                if state.shape_only:   # the sender's fake tensor, rebuilt in this rank's mode
                    out = _shape.own(partner.tensor, state.device)
                else:
                    out = partner.tensor if partner.owned else partner.tensor.clone()  # the sender waits
                with state.lock:
                    self._deliver_locked(partner)
            if not async_op:
                self._end(record, out)
                return out
            message = _Message(kind, me, out, shape, dtype, frame)   # complete at issue
            message.done, message.moved = True, partner.moved
            return self._handle(_PendingMessage(self, message, record, peer))
        message = _Message(kind, me, tensor, shape, dtype, frame, owned=async_op)
        channel.append(message)
        if async_op:
            state.lock.release()
            return self._handle(_PendingMessage(self, message, record, peer))
        message.blocked = True
        state.release_and_wait(me, _Wait(kind, frame, peer=group.ranks[peer], detail=p2p_detail(dtype, shape)))
        out = message.tensor if kind == "recv" else None
        if out is not None and state.shape_only:
            out = _shape.own(out, state.device)
        self._end(record, out)
        return out

    def _deliver_locked(self, message: _Message) -> None:
        """A posted message found its partner: mark it done, wake its rank if blocked on it."""
        message.done = True
        message.moved = time.perf_counter() - self._state.clock_zero
        if message.blocked:
            message.blocked = False
            self._state.wake_locked(message.rank)

    def _p2p_mismatch_and_release(self, mine: _Message, partner: _Message) -> None:
        send, recv = (mine, partner) if mine.kind == "send" else (partner, mine)
        message = (
            f"send/recv mismatch in group {list(self._group.ranks)}:\n"
            f"  rank {send.rank} sends {str(send.dtype).removeprefix('torch.')} "
            f"{tuple(send.shape)} at {_where(send.frame)}\n"
            f"  rank {recv.rank} expects {str(recv.dtype).removeprefix('torch.')} "
            f"{tuple(recv.shape)} at {_where(recv.frame)}")
        self._state.abort_and_release(CollectiveMismatchError(message))

    # -- rooted and uneven collectives --

    def reduce(self, tensor: torch.Tensor, dst: int, op: str, async_op: bool = False):
        """The reduction on ``dst``; zeros of the input's shape and dtype on the other ranks."""
        return self._collective("reduce", tensor, self._sig(tensor, dst=dst, op=op),
                                lambda inputs: math.reduce_to(inputs, dst, op), root=dst, async_op=async_op)

    def scatter(self, tensor: torch.Tensor | None, src: int, dim: int, requires_grad: bool = False,
                async_op: bool = False):
        """``(chunk r of src's tensor along dim, whether src said requires_grad)``; ``tensor`` is
        ``None`` off ``src``, and each rank's ``dim`` must name src's dim (negative allowed)."""
        step = self._next_step()
        # off src the dtype is known once the data arrives; it is added to args then (for the bytes)
        dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else None
        args = {"src": src, "dim": dim, "dtype": dtype}
        event = self._begin("scatter", step, tensor, src, args=args, async_op=async_op)

        def compute(inputs: list) -> list:
            source, flag, source_dim = inputs[src]
            ndim = source.dim()
            for rank, (_, _, rank_dim) in enumerate(inputs):
                if not -ndim <= rank_dim < ndim or rank_dim % ndim != source_dim:
                    raise ValueError(
                        f"scatter: dim={rank_dim} on rank {rank} does not name the dim "
                        f"dim={source_dim} of the source rank {src}'s "
                        f"{ndim}-D tensor {tuple(source.shape)}")
            chunks = math.scatter_from([entry[0] for entry in inputs], src, source_dim)
            return [(chunk, flag) for chunk in chunks]

        def arrived(out: tuple) -> tuple:
            args["dtype"] = str(out[0].dtype).removeprefix("torch.")
            return out

        entry = (tensor.clone() if async_op and tensor is not None else tensor, requires_grad, dim)
        if async_op:
            return Handle(self._issue("scatter", step, entry, (("src", src),), compute, event), arrived)
        out = arrived(self._rendezvous("scatter", step, entry, (("src", src),), compute))
        self._end(event, out[0])
        return out

    def all_to_all_single(self, tensor: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], async_op: bool = False):
        """Uneven all-to-all along dim 0; the ranks' split lists are checked against each other."""
        step = self._next_step()
        outputs, inputs_ = list(output_split_sizes), list(input_split_sizes)
        event = self._begin("all_to_all_single", step, tensor,
                            args={"input_split_sizes": inputs_, "output_split_sizes": outputs},
                            async_op=async_op)
        sig = (("dtype", tensor.dtype), ("shape[1:]", tuple(tensor.shape[1:])))

        def compute(entries: list) -> list:
            try:
                math.check_splits("all_to_all_single", [e[2] for e in entries], [e[1] for e in entries])
            except ValueError as error:   # the ranks disagree: a mismatch, as on real processes' checked mode
                self._state.abort(CollectiveMismatchError(
                    f"ranks of group {list(self.ranks)} disagree at collective step {step} "
                    f"(group-local ranks below):\n  {error}\nevery rank of a group must call the same "
                    f"collectives in the same order with matching shapes, dtypes and arguments"))
                raise _Aborted from None
            return math.all_to_all_single([e[0] for e in entries], [e[1] for e in entries],
                                          [e[2] for e in entries])

        if async_op:
            return self._issue("all_to_all_single", step, (tensor.clone(), outputs, inputs_), sig, compute, event)
        out = self._rendezvous("all_to_all_single", step, (tensor, outputs, inputs_), sig, compute)
        self._end(event, out)
        return out

    # -- asynchronous calls --

    def _handle(self, pending: _Pending) -> Handle:
        self._pending[id(pending)] = pending
        return Handle(pending)

    def check_all_waited(self) -> None:
        """Raise :class:`~simcomm.handles.UnwaitedHandleError` if this rank issued a handle
        (in any of its groups) that was never waited on. Called when the program returns."""
        if not self._pending:
            return
        lines = [f"rank {self.global_rank}: the program returned without waiting on "
                 f"{len(self._pending)} handle(s):"]
        lines += [f"  {pending.what} issued at {pending.where}" for pending in self._pending.values()]
        lines.append("call wait() on every handle (async_op=True, isend, irecv, batch_isend_irecv) "
                     "before the program returns")
        raise UnwaitedHandleError("\n".join(lines))

    def _wait_begins(self, pending: _Pending) -> RunState:
        """Checks before a handle's ``wait()`` blocks; returns with the run's lock *held*."""
        state = self._state
        if threading.current_thread() is not self._thread:
            raise SimcommError(
                f"wait() on the handle of {pending.what} issued by rank {self.global_rank} at "
                f"{pending.where}: called outside that rank's program (its run has ended, or "
                f"another thread called it); wait on handles inside the program that issued them")
        state.lock_for(self.global_rank, f"wait() on {pending.what}")
        return state

    def _waited(self, pending: _Pending, out) -> None:
        """A handle's wait returned ``out``: the call is no longer pending; keep its record."""
        del self._pending[id(pending)]
        self._fruitless_polls = 0
        if pending.record is not None:
            self._recorder.moved(pending.record, out,
                                 at=pending.moved_at())
            self._recorder.waited(pending.record)

    def _poll(self, pending: _Pending) -> None:
        """A handle that is not complete was polled: let the ranks that are ready run first.

        When no rank is ready, every other unfinished rank is blocked, so only this
        rank can complete the call; a program that keeps polling instead would spin
        forever, and after :data:`_FRUITLESS_POLLS` such polls in a row the run is
        aborted with a :class:`~simcomm.errors.DeadlockError`.
        """
        state, me = self._state, self.global_rank
        if threading.current_thread() is not self._thread:
            return
        with state.lock:
            if state.error is not None:
                raise_aborted = True
            elif state.ready:
                raise_aborted = False
                state.ready.append(me)
                state.random.states[me] = state.random.get_state()   # this rank's stream, kept
                state.waiters[state.ready.popleft()].release()
            else:
                self._fruitless_polls += 1
                if self._fruitless_polls >= _FRUITLESS_POLLS:
                    state.abort_locked(DeadlockError(
                        f"rank {me} polls is_completed() on the handle of {pending.what} issued at "
                        f"{pending.where}, which cannot complete: every other rank is blocked or has "
                        f"finished ({_FRUITLESS_POLLS} polls in a row); wait() on it, or make the call "
                        f"its peers wait for first"))
                    raise_aborted = True
                else:
                    return
        if not raise_aborted:
            self._fruitless_polls = 0
            state.waiters[me].acquire()
            if state.error is None:
                state.random.set_state(state.random.states[me])
        if state.error is not None:
            raise _Aborted


#: polls of an incomplete handle, with no other rank able to run, after which the run is a deadlock
_FRUITLESS_POLLS = 10_000


def _p2p_what(kind: str, peer: int, shape, dtype) -> str:
    what = f"send to rank {peer}" if kind == "send" else f"recv from rank {peer}"
    return f"{what} ({str(dtype).removeprefix('torch.')} {tuple(shape)})"


class _PendingCollective:
    """What the handle of an asynchronous collective waits on: its slot."""

    __slots__ = ("transport", "slot", "step", "record", "where")

    def __init__(self, transport: SimTransport, slot: _Slot, step: int, record: Record | None, where: str):
        self.transport, self.slot, self.step, self.record, self.where = (
            transport, slot, step, record, where)

    @property
    def what(self) -> str:
        return f"{self.slot.op}(step {self.step}, group {list(self.transport.ranks)})"

    def moved_at(self) -> float:
        return self.slot.moved

    def is_completed(self) -> bool:
        if self.slot.outputs is None:
            self.transport._poll(self)
        return self.slot.outputs is not None

    def wait(self):
        transport, slot = self.transport, self.slot
        state = transport._wait_begins(self)
        if slot.outputs is None and not slot.failed:
            slot.waiting.append(transport.global_rank)
            state.release_and_wait(transport.global_rank, _Wait(
                f"wait() on {slot.op}", sys._getframe(1), slot, transport.ranks, self.step))
        else:
            state.lock.release()
        if slot.failed:
            raise _Aborted
        out = _materialize(slot, transport.rank, state)
        transport._waited(self, out)
        return out

    def __repr__(self) -> str:
        return f"{self.what} issued at {self.where}"


class _PendingMessage:
    """What the handle of an ``isend``/``irecv`` waits on: its posted message."""

    __slots__ = ("transport", "message", "record", "peer")

    def __init__(self, transport: SimTransport, message: _Message, record: Record | None, peer: int):
        self.transport, self.message, self.record, self.peer = transport, message, record, peer

    @property
    def what(self) -> str:
        message = self.message
        kind = "isend" if message.kind == "send" else "irecv"
        return kind + " " + _p2p_what(message.kind, self.transport.ranks[self.peer], message.shape,
                                message.dtype).split(" ", 1)[1]

    @property
    def where(self) -> str:
        return _where(self.message.frame)

    def moved_at(self) -> float:
        return self.message.moved

    def is_completed(self) -> bool:
        if not self.message.done:
            self.transport._poll(self)
        return self.message.done

    def wait(self):
        transport, message = self.transport, self.message
        state = transport._wait_begins(self)
        if not message.done:
            message.blocked = True
            state.release_and_wait(transport.global_rank, _Wait(f"wait() on {self.what}", sys._getframe(1)))
        else:
            state.lock.release()
        out = message.tensor if message.kind == "recv" else None
        if out is not None and transport._state.shape_only:
            out = _shape.own(out, transport._state.device)
        transport._waited(self, out)
        return out

    def __repr__(self) -> str:
        return f"{self.what} issued at {self.where}"


_Pending = _PendingCollective | _PendingMessage
