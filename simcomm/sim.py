"""Virtual ranks: the in-process transport and the rendezvous that never hangs.

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
  :class:`~simcomm.errors.DeadlockError`, listing who waits for whom.

Either error, or a rank's own exception, *aborts* the run: every blocked rank
is woken and unwinds with :class:`_Aborted`, and ``World.run`` raises the error.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import typing_extensions

from . import collectives as math
from .errors import CollectiveMismatchError, DeadlockError
from .transport import TransportBase

__all__ = ["SimTransport", "RunState", "program_location"]


class _Aborted(BaseException):
    """Unwinds a rank's program after the run was aborted (not an ``Exception``,
    so a program's ``except Exception`` does not swallow it)."""


# -- where in the program a rank is -----------------------------------------------------

_SKIP_DIRS = tuple(os.path.dirname(p) + os.sep for p in (__file__, torch.__file__))
# decorator wrappers torch puts around its API (deprecation, context managers)
_SKIP_FILES = (threading.__file__, contextlib.__file__, typing_extensions.__file__)


def _skip_dirs() -> tuple[str, ...]:
    """simcomm's and torch's folders, and real's once it is imported."""
    real = sys.modules.get("real")
    if real is not None and getattr(real, "__file__", None):
        return (*_SKIP_DIRS, os.path.dirname(real.__file__) + os.sep)
    return _SKIP_DIRS


def program_location(frame) -> str:
    """``file:line in function`` of the innermost frame that belongs to the user's program."""
    skip = _skip_dirs()
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(skip) and filename not in _SKIP_FILES:
            return f"{filename}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<unknown location>"


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

@dataclass
class _Wait:
    """What a blocked rank waits for (for the deadlock message)."""

    op: str                           # collective name, or "send to rank 3 (float32 (2,))"
    frame: object
    slot: _Slot | None = None
    group_ranks: tuple[int, ...] = ()
    step: int = 0

    @property
    def what(self) -> str:
        if self.slot is None:
            return self.op
        return f"{self.op}(step {self.step}, group {list(self.group_ranks)})"


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
    """

    def __init__(self, world_size: int, device: torch.device, trace: bool):
        self.lock = threading.Lock()
        self.world_size = world_size
        self.device = device
        self.waiters = [threading.Lock() for _ in range(world_size)]
        for waiter in self.waiters:
            waiter.acquire()
        self.blocked: dict[int, _Wait] = {}
        self.ready: deque[int] = deque()
        self.running = world_size
        self.finished: set[int] = set()
        self.error: BaseException | None = None
        self.rank_errors: list[tuple[int, BaseException]] = []
        self.done = threading.Event()
        self.events: list[tuple] | None = [] if trace else None
        self.clock_zero = time.perf_counter()
        self.world = _Group(("world",), range(world_size))

    def start(self) -> None:
        """Give rank 0 the first turn; the others are ready in rank order."""
        with self.lock:
            self.ready.extend(range(1, self.world_size))
            self.waiters[0].release()

    def wait_turn(self, rank: int) -> None:
        """Called by a rank thread before its program: wait for the first turn."""
        self.waiters[rank].acquire()
        if self.error is not None:
            raise _Aborted

    # All methods ending in _locked are called with self.lock held.

    def _pass_turn_locked(self) -> bool:
        if self.ready:
            self.waiters[self.ready.popleft()].release()
            return True
        return False

    def wait_locked(self, rank: int, wait: _Wait) -> None:
        """Block ``rank`` until woken; releases the lock. Raises :class:`_Aborted` on abort."""
        self.blocked[rank] = wait
        if not self._pass_turn_locked() and len(self.blocked) == self.running:
            self.abort_locked(DeadlockError(self.describe_deadlock_locked()))
            self.lock.release()
            raise _Aborted
        self.lock.release()
        self.waiters[rank].acquire()
        if self.error is not None:
            raise _Aborted

    def wake_locked(self, rank: int) -> None:
        """``rank`` may continue: it runs when the current rank hands on its turn."""
        del self.blocked[rank]
        self.ready.append(rank)

    def abort_locked(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        for rank in [*self.blocked, *self.ready]:
            self.waiters[rank].release()
        self.blocked.clear()
        self.ready.clear()
        self.done.set()

    def abort(self, error: BaseException) -> None:
        with self.lock:
            self.abort_locked(error)

    def check_locked(self) -> None:
        if self.error is not None:
            self.lock.release()
            raise _Aborted

    def rank_failed(self, rank: int, error: BaseException) -> None:
        with self.lock:
            if self.error is None or self.rank_errors:
                self.rank_errors.append((rank, error))
            self.abort_locked(self.error or error)

    def rank_finished(self, rank: int) -> None:
        with self.lock:
            self.running -= 1
            self.finished.add(rank)
            if self.running == 0:
                self.done.set()
            elif (self.error is None and not self._pass_turn_locked()
                  and len(self.blocked) == self.running):
                self.abort_locked(DeadlockError(self.describe_deadlock_locked()))

    def describe_deadlock_locked(self) -> str:
        lines = ["every rank that has not finished is blocked, so none can make progress:"]
        for rank in sorted(self.blocked):
            wait = self.blocked[rank]
            where = program_location(wait.frame)
            if wait.slot is not None:
                missing = [r for i, r in enumerate(wait.group_ranks) if i not in wait.slot.arrived]
                lines.append(f"  rank {rank} waits in {wait.what} for ranks {missing} "
                             f"(arrived: {[wait.group_ranks[i] for i in sorted(wait.slot.arrived)]}) "
                             f"at {where}")
            else:
                lines.append(f"  rank {rank} waits in {wait.what} at {where}")
        for rank in sorted(self.finished):
            lines.append(f"  rank {rank} has finished its program")
        return "\n".join(lines)


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
        state.lock.acquire()
        state.check_locked()
        slot = group.slots.get(step)
        if slot is None:
            slot = group.slots[step] = _Slot(op, sig, self.world_size)
        elif slot.op != op or slot.sig != sig:
            self._mismatch_locked(slot, op, sig, frame)
        slot.inputs[me] = tensor
        slot.frames[me] = frame
        slot.arrived.append(me)
        if len(slot.arrived) < self.world_size:
            slot.waiting.append(self.global_rank)
            state.wait_locked(self.global_rank, _Wait(op, frame, slot, group.ranks, step))
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

    def _mismatch_locked(self, slot: _Slot, op: str, sig: tuple, frame) -> None:
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
        self._state.abort_locked(CollectiveMismatchError(message))
        self._state.lock.release()
        raise _Aborted

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
        state.lock.acquire()
        state.check_locked()
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
                state.abort_locked(CollectiveMismatchError(message))
                state.lock.release()
                raise _Aborted
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
        peer_global = group.ranks[peer]
        what = (f"send to rank {peer_global}" if kind == "send" else f"recv from rank {peer_global}")
        state.wait_locked(me, _Wait(f"{what} ({str(dtype).removeprefix('torch.')} {tuple(shape)})", frame))
        return message.tensor if kind == "recv" else None
