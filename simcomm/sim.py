"""Virtual ranks: the in-process transport and the scheduler that never hangs.

Every rank of a :class:`simcomm.World` is a thread running the program, and
the ranks take turns (see :class:`RunState`). A collective is a *rendezvous*:
each rank deposits its tensor in the group's slot for that step and blocks on
a lock of its own; the last rank to arrive computes the collective with
:mod:`simcomm.collectives` and marks each waiting rank ready, to be woken
exactly once when its turn comes.

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
from .errors import CollectiveMismatchError, CommunicatorClosedError, DeadlockError, WrongThreadError
from .rank_random import RankRandomState
from .transport import TransportBase
from .waits import Wait as _Wait
from .waits import describe_deadlock, describe_ranks, describe_waits, p2p_detail, program_location

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


def _materialize(slot: _Slot, rank: int):
    out = slot.outputs[rank]
    return out.clone() if slot.shared[rank] else out


def _format_args(sig: tuple) -> str:
    return ", ".join(f"{name}={str(value).removeprefix('torch.')}" for name, value in sig)


# -- shared state of one run ---------------------------------------------------------------

class _Slot:
    """One collective of one group at one step: where the members meet."""

    __slots__ = ("op", "sig", "inputs", "frames", "arrived", "waiting", "outputs", "shared", "failed")

    def __init__(self, op: str, sig: tuple, world_size: int):
        self.op, self.sig = op, sig
        self.inputs: list = [None] * world_size
        self.frames: list = [None] * world_size
        self.arrived: list[int] = []      # group-local ranks, in arrival order
        self.waiting: list[int] = []      # global ranks blocked on this slot
        self.outputs: list | None = None
        self.shared: list[bool] = []
        self.failed = False


class _Message:
    """A posted send or recv waiting for its partner."""

    __slots__ = ("kind", "rank", "tensor", "shape", "dtype", "frame")

    def __init__(self, kind: str, rank: int, tensor, shape, dtype, frame):
        self.kind, self.rank, self.tensor, self.shape, self.dtype, self.frame = (
            kind, rank, tensor, shape, dtype, frame)


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
    """The :class:`~simcomm.transport.Transport` of one virtual rank in one group."""

    def __init__(self, state: RunState, group: _Group, rank: int):
        super().__init__(rank, group.ranks, state.device, state.events, state.clock_zero)
        self._state = state
        self._group = group
        self._p2p_steps: dict[tuple[int, int], int] = {}

    def __repr__(self) -> str:
        return f"SimTransport(rank={self.rank}, ranks={list(self.ranks)})"

    # -- collectives --

    def _collective(self, op: str, tensor: torch.Tensor | None, sig: tuple,
                    compute: Callable[[list], list], root: int | None = None):
        step = self._next_step()
        event = self._begin(op, step, tensor, root, args=sig[2:] if tensor is not None else sig)
        out = self._rendezvous(op, step, tensor, sig, compute)
        self._end(event, out if isinstance(out, torch.Tensor) else None)
        return out

    def _rendezvous(self, op: str, step: int, tensor, sig: tuple, compute: Callable[[list], list]):
        state, group, me = self._state, self._group, self.rank
        frame = sys._getframe(2)
        state.lock_for(self.global_rank, op)
        slot = group.slots.get(step)
        if slot is None:
            slot = group.slots[step] = _Slot(op, sig, self.world_size)
        elif slot.op != op or slot.sig != sig:
            self._mismatch_and_release(slot, op, sig, frame)
        slot.inputs[me] = tensor
        slot.frames[me] = frame
        slot.arrived.append(me)
        if len(slot.arrived) < self.world_size:
            slot.waiting.append(self.global_rank)
            state.release_and_wait(self.global_rank, _Wait(op, frame, slot, group.ranks, step))
            if slot.failed:
                raise _Aborted
            return _materialize(slot, me)
        # The last rank to arrive does the collective's tensor work, with warm caches.
        state.lock.release()
        try:
            slot.outputs = compute(slot.inputs)
            slot.shared = _shared_entries(slot.outputs, owner=me)
            _copy_small(slot)
        except BaseException:
            slot.failed = True
            raise
        finally:
            with state.lock:
                del group.slots[step]
                for rank in slot.waiting:
                    state.wake_locked(rank)
        return _materialize(slot, me)

    def _mismatch_and_release(self, slot: _Slot, op: str, sig: tuple, frame) -> NoReturn:
        """Abort the run with a CollectiveMismatchError. Called with the lock held; releases it."""
        ranks = self._group.ranks
        first = slot.arrived[0]
        arrived = sorted(ranks[i] for i in slot.arrived)
        message = (
            f"ranks of group {list(ranks)} disagree at collective step {self._step - 1}:\n"
            f"  rank{'s' if len(arrived) > 1 else ''} {arrived} called {slot.op}({_format_args(slot.sig)}) "
            f"at {program_location(slot.frames[first])}\n"
            f"  rank {ranks[self.rank]} called {op}({_format_args(sig)}) at {program_location(frame)}\n"
            f"every rank of a group must call the same collectives in the same order with "
            f"matching shapes, dtypes and arguments")
        self._state.abort_and_release(CollectiveMismatchError(message))

    @staticmethod
    def _sig(tensor: torch.Tensor, **args) -> tuple:
        return (("shape", tuple(tensor.shape)), ("dtype", tensor.dtype), *args.items())

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return self._collective("all_reduce", tensor, self._sig(tensor, op=op),
                                lambda inputs: math.all_reduce(inputs, op))

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return self._collective("all_gather", tensor, self._sig(tensor, dim=dim),
                                lambda inputs: math.all_gather(inputs, dim))

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, op: str) -> torch.Tensor:
        return self._collective("reduce_scatter", tensor, self._sig(tensor, dim=dim, op=op),
                                lambda inputs: math.reduce_scatter(inputs, dim, op))

    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        return self._collective("all_to_all", tensor,
                                self._sig(tensor, scatter_dim=scatter_dim, gather_dim=gather_dim),
                                lambda inputs: math.all_to_all(inputs, scatter_dim, gather_dim))

    def gather(self, tensor: torch.Tensor, dst: int, dim: int) -> torch.Tensor | None:
        return self._collective("gather", tensor, self._sig(tensor, dst=dst, dim=dim),
                                lambda inputs: math.gather(inputs, dst, dim), root=dst)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self._collective("broadcast", tensor, self._sig(tensor, src=src),
                                lambda inputs: math.broadcast(inputs, src), root=src)

    def barrier(self) -> None:
        self._collective("barrier", None, (), lambda inputs: [None] * len(inputs))

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
        return SimTransport(self._state, group, position)

    # -- point to point --

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        event = self._p2p_event("send", dst, tensor)
        self._p2p("send", dst, (self.rank, dst), tensor, tensor.shape, tensor.dtype)
        self._end(event, None)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        event = self._p2p_event("recv", src, None, nbytes)
        out = self._p2p("recv", src, (src, self.rank), None, torch.Size(shape), dtype)
        self._end(event, out)
        return out

    def _p2p_event(self, op: str, peer: int, tensor, nbytes: int | None = None) -> list | None:
        key = (self.rank, peer) if op == "send" else (peer, self.rank)
        step = self._p2p_steps.get(key, 0)
        self._p2p_steps[key] = step + 1
        return self._begin(op, step, tensor, peer, nbytes=nbytes)

    def _p2p(self, kind: str, peer: int, key: tuple[int, int], tensor, shape, dtype):
        state, group = self._state, self._group
        frame = sys._getframe(2)
        me = self.global_rank
        state.lock_for(me, kind)
        channel = group.channels.setdefault(key, deque())
        if channel and channel[0].kind != kind:
            partner = channel.popleft()
            if partner.shape != shape or partner.dtype != dtype:
                send, recv = (self_msg := _Message(kind, me, tensor, shape, dtype, frame), partner)
                if kind == "recv":
                    send, recv = partner, self_msg
                message = (
                    f"send/recv mismatch in group {list(group.ranks)}:\n"
                    f"  rank {send.rank} sends {str(send.dtype).removeprefix('torch.')} "
                    f"{tuple(send.shape)} at {program_location(send.frame)}\n"
                    f"  rank {recv.rank} expects {str(recv.dtype).removeprefix('torch.')} "
                    f"{tuple(recv.shape)} at {program_location(recv.frame)}")
                state.abort_and_release(CollectiveMismatchError(message))
            if kind == "send":
                partner.tensor = tensor.clone()
                state.wake_locked(partner.rank)
                state.lock.release()
                return None
            state.lock.release()
            out = partner.tensor.clone()   # the sender stays blocked until woken below
            with state.lock:
                if partner.rank in state.blocked:
                    state.wake_locked(partner.rank)
            return out
        message = _Message(kind, me, tensor, shape, dtype, frame)
        channel.append(message)
        state.release_and_wait(me, _Wait(kind, frame, peer=group.ranks[peer], detail=p2p_detail(dtype, shape)))
        return message.tensor if kind == "recv" else None
