"""The in-process transport of one virtual rank in one group.

:class:`SimTransport` implements :class:`simcomm.transport.Transport` on the
tables of :mod:`simcomm.sim.rendezvous`, under the scheduler's lock
(:mod:`simcomm.sim.scheduler`, whose docstring states the lock-naming rule).

A blocking collective arrives at its group's slot and blocks until the last
member has computed it. An asynchronous call (``async_op=True``, ``isend``,
``irecv``) deposits a copy of its input at the rendezvous (or posts its
message) without blocking and returns a :class:`~simcomm.handles.Handle`
(:mod:`simcomm.sim.pending`); the rank blocks, visibly to the scheduler, only
in the handle's ``wait()``. The step of a collective is counted when it is
issued, so the mismatch check compares what the ranks *issued* at each step: a
rank arriving with another op or incompatible arguments than the ranks
already waiting raises :class:`~simcomm.errors.CollectiveMismatchError`. A
program that returns with a handle it never waited on raises
:class:`~simcomm.errors.UnwaitedHandleError`, naming the rank and the line
that issued it. When the collective's math refuses the inputs (the last member
computes it, e.g. MAX of complex tensors), every member raises a copy of that
error, from the call or from its handle's ``wait()``, as every real rank's call
would fail.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from .. import collectives, dtypes, memory
from ..checks import PREMUL_SUM, check_splits
from ..errors import Aborted, CollectiveMismatchError, DeadlockError, SimcommError, UnwaitedHandleError
from ..handles import Handle, P2POp
from ..reports import mismatch_message, program_location, unwaited_message
from ..specs import SPECS
from ..trace import Record, Recorder
from ..transport import TransportBase
from . import ring_order
from . import shape as _shape
from .pending import Pending, PendingCollective, PendingMessage
from .rendezvous import Group, Message, Slot, call_site, copy_small_shared, failure, format_args, materialize
from .scheduler import RunState, handoff
from .waits import Wait, p2p_detail

#: op -> what its ranks must pass alike (:meth:`simcomm.specs.CollectiveSpec.agreed_fields`)
_AGREED = {name: spec.agreed_fields for name, spec in SPECS.items() if spec.kind == "collective"}
#: what a send and its recv must agree on (their rows: shape and dtype, as checked mode compares)
_PAIRED = SPECS["send"].agreed_fields

__all__ = ["SimTransport"]


class SimTransport(TransportBase):
    """The :class:`~simcomm.transport.Transport` of one virtual rank in one group.

    ``pending`` holds the rank's issued, not yet waited asynchronous calls; the
    transports of the rank's subgroups share it (and the trace ``recorder``).
    """

    def __init__(self, state: RunState, group: Group, rank: int, pending: dict | None = None,
                 recorder: Recorder | None = None):
        if recorder is None and state.events is not None:
            recorder = Recorder(state.events, state.clock_zero)
        # one partition table for the run: every rank passes the whole partition to subgroup
        super().__init__(rank, group.ranks, state.device, recorder, state.partitions)
        self.state = state
        self.group = group
        self.pending: dict[int, Pending] = {} if pending is None else pending
        # the rank's thread (an object, not an ident: idents are reused by later runs' threads)
        self._thread = threading.current_thread()
        self._fruitless_polls = 0

    def __repr__(self) -> str:
        return f"SimTransport(rank={self.rank}, ranks={list(self.ranks)})"

    # -- collectives --

    def _collective(self, op: str, tensor: torch.Tensor | None, sig: tuple,
                    compute: Callable[[list], list], root: int | None = None, async_op: bool = False,
                    reduction: str | None = None, into: torch.Tensor | None = None):
        """One collective of this rank: check, count, trace, then meet the group.

        ``sig`` is what every member must pass alike, as ``(name, value)`` pairs (for a tensor
        op ``shape`` and ``dtype`` first; the rest are the call's arguments in the trace);
        ``reduction`` the canonical reduce op of a reducing collective; ``into`` a buffer of
        the output's number of elements that receives this rank's output and is returned
        (the c10d adapter's output tensor; :func:`~simcomm.sim.rendezvous.materialize`)."""
        # what the real backend this run stands for refuses (gloo on CPU, NCCL on CUDA)
        dtypes.check(op, None if tensor is None else tensor.dtype, reduction, self.device, self.rank)
        step = self._next_step()
        record = None
        if self._recorder is not None:   # the arguments as pairs: the trace keeps them flat (Record.kept)
            record = self._begin(op, step, tensor, root, args=sig[2:] if tensor is not None else sig,
                                 async_op=async_op)
        if async_op:   # the input is copied: the program may reuse its tensor before wait()
            return self._issue(op, step, tensor.clone() if tensor is not None else None, sig, compute,
                               record, into)
        out = self._rendezvous(op, step, tensor, sig, compute, sys._getframe(1), into)
        if record is not None:
            self._recorder.end(record, out)
        return out

    def _arrive_and_hold(self, op: str, step: int, tensor, sig: tuple, frame, into=None) -> Slot:
        """Deposit this rank's input (and its output buffer ``into``) in its group's slot for ``step``.

        Takes the run's lock and returns *holding it*; on a mismatch it aborts
        the run, releases the lock and raises :class:`Aborted`.
        """
        state, group, me = self.state, self.group, self.rank
        state.lock_for(self.global_rank, op)
        slot = group.slots.get(step)
        if slot is None:
            slot = group.slots[step] = Slot(op, sig, self.world_size, group)
        elif slot.op != op or slot.sig != sig:
            self._mismatch_and_release(slot, op, sig, frame)
        slot.inputs[me] = tensor
        slot.frames[me] = frame
        slot.arrived.append(me)
        if into is not None:
            if slot.into is None:
                slot.into = [None] * self.world_size
            slot.into[me] = into
        return slot

    def _complete(self, slot: Slot, step: int, compute: Callable[[list], list]) -> None:
        """The last rank to arrive does the collective's tensor work (with warm caches),
        outside the lock, then wakes the members blocked on the slot."""
        state = self.state
        try:
            with memory.untracked():    # outputs are counted on the ranks that receive them
                if state.shape_only:    # meta outputs; each rank rebuilds its own (materialize)
                    slot.outputs = _shape.compute_on_meta(compute, slot.inputs)
                else:
                    slot.outputs = compute(slot.inputs)
                    copy_small_shared(slot, self.rank)
        except BaseException as error:
            slot.failed = True
            if isinstance(error, Exception):   # the math refused these inputs: every member sees it
                slot.error = error
            raise
        finally:
            slot.moved = time.perf_counter() - state.clock_zero
            with state.lock:
                del self.group.slots[step]
                wake = state.wake_locked
                for rank in slot.waiting:
                    wake(rank)

    def _rendezvous(self, op: str, step: int, tensor, sig: tuple, compute: Callable[[list], list],
                    frame=None, into=None):
        """A blocking collective: arrive, then wait for the last member or be it. ``frame``: the
        program's frame that called (default: the caller's caller)."""
        state = self.state
        if frame is None:
            frame = sys._getframe(2)
        slot = self._arrive_and_hold(op, step, tensor, sig, frame, into)
        if len(slot.arrived) < self.world_size:
            me = self.global_rank
            slot.waiting.append(me)
            state.release_and_wait(me, Wait(op, frame, slot, self.group.ranks, step))
            if slot.failed:
                raise failure(slot, me)
            return materialize(slot, self.rank, state)
        state.lock.release()
        self._complete(slot, step, compute)
        return materialize(slot, self.rank, state)

    def meet(self, op: str, value: tuple, compare: Callable[[int, list], list], frame=None):
        """Meet this group's other members once, untraced, at the group's next step: a blocking
        rendezvous of ``value`` (no tensor); the last member to arrive calls ``compare(step,
        entries)`` (every member's ``value``), which returns each member's answer or aborts the
        run. ``frame``: the program's frame that called (default: the caller's caller)."""
        step = self._next_step()
        if frame is None:
            frame = sys._getframe(2)
        return self._rendezvous(op, step, value, (), lambda entries: compare(step, entries), frame)

    def _issue(self, op: str, step: int, tensor, sig: tuple, compute: Callable[[list], list],
               record: Record | None, into=None) -> Handle:
        """An asynchronous collective: arrive without blocking (completing the collective
        if this rank is the last member); the rank blocks only in the handle's ``wait()``,
        which writes ``into`` then."""
        where = program_location(sys._getframe(2))
        slot = self._arrive_and_hold(op, step, tensor, sig, where, into)
        last = len(slot.arrived) == self.world_size
        self.state.lock.release()
        if last:
            self._complete(slot, step, compute)
        return self._handle(PendingCollective(self, slot, step, record, where))

    def _mismatch_and_release(self, slot: Slot, op: str, sig: tuple, frame) -> NoReturn:
        """Abort the run with a CollectiveMismatchError. Called with the lock held; releases it."""
        ranks = self.group.ranks
        arrived = [ranks[i] for i in slot.arrived]
        message = mismatch_message(ranks, self._step - 1, [
            (arrived, f"{slot.op}({format_args(slot.sig)})", call_site(slot.frames[slot.arrived[0]])),
            ([ranks[self.rank]], f"{op}({format_args(sig)})", call_site(frame))])
        self.state.abort_and_release(CollectiveMismatchError(message))

    # ``sig``: what every member must pass alike, from the op's row of simcomm.specs (checked mode
    # on real workers compares the same fields: real.checked_calls)

    # ``into`` (all_reduce, all_gather, reduce_scatter, broadcast): see _collective

    def all_reduce(self, tensor: torch.Tensor, op: str, async_op: bool = False, *,
                   factor: float | torch.Tensor | None = None, into: torch.Tensor | None = None):
        # PREMUL_SUM: premultiplied, summed
        sent, wire = (tensor, op) if op != PREMUL_SUM else collectives.on_the_wire(tensor, op, factor)
        return self._collective("all_reduce", sent, _AGREED["all_reduce"](tensor.shape, tensor.dtype, op),
                                lambda inputs: ring_order.all_reduce(inputs, wire), async_op=async_op,
                                reduction=op, into=into)

    def all_gather(self, tensor: torch.Tensor, dim: int, async_op: bool = False, *,
                   into: torch.Tensor | None = None):
        return self._collective("all_gather", tensor, _AGREED["all_gather"](tensor.shape, tensor.dtype, dim),
                                lambda inputs: collectives.all_gather(inputs, dim), async_op=async_op, into=into)

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, op: str, async_op: bool = False, *,
                       factor: float | torch.Tensor | None = None, into: torch.Tensor | None = None,
                       separately: bool = False):
        """``separately``: each rank's chunk is reduced as a buffer of its own, in its own order
        (:func:`simcomm.sim.ring_order.reduce_scatter`; c10d's list form, as gloo runs it)."""
        sent, wire = collectives.on_the_wire(tensor, op, factor)
        return self._collective("reduce_scatter", sent, _AGREED["reduce_scatter"](tensor.shape, tensor.dtype, dim, op),
                                lambda inputs: ring_order.reduce_scatter(inputs, dim, wire, separately=separately),
                                async_op=async_op, reduction=op, into=into)

    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int, async_op: bool = False):
        return self._collective("all_to_all", tensor,
                                _AGREED["all_to_all"](tensor.shape, tensor.dtype, scatter_dim, gather_dim),
                                lambda inputs: collectives.all_to_all(inputs, scatter_dim, gather_dim),
                                async_op=async_op)

    def gather(self, tensor: torch.Tensor, dst: int, dim: int, async_op: bool = False):
        return self._collective("gather", tensor, _AGREED["gather"](tensor.shape, tensor.dtype, dst, dim),
                                lambda inputs: collectives.gather(inputs, dst, dim), root=dst, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False, *,
                  into: torch.Tensor | None = None):
        return self._collective("broadcast", tensor, _AGREED["broadcast"](tensor.shape, tensor.dtype, src),
                                lambda inputs: collectives.broadcast(inputs, src), root=src, async_op=async_op,
                                into=into)

    def barrier(self, async_op: bool = False):
        return self._collective("barrier", None, _AGREED["barrier"](None, None), lambda inputs: [None] * len(inputs), async_op=async_op)

    def subgroup(self, groups: tuple[tuple[int, ...], ...]) -> SimTransport:
        """This rank's transport in its part of ``groups`` (normalized by the run's partition table).

        Checked like a collective (every member must pass the same partition, else the run aborts
        with a :class:`CollectiveMismatchError` naming both calls) and traced as one, but it does
        not block: the rank's part, its position and the part's shared :class:`Group` follow
        from the partition alone, so the rank goes on at once. A program that builds its own
        partition lists (``O(world size)`` each) can then drop them before the next rank builds
        its own, instead of every rank holding its lists while it waits for the last one
        (``O(world size**2)`` for a shape-only run of thousands of ranks). Real ``new_group``
        calls synchronise; a rank that skips the call still surfaces, as a deadlock at the next
        collective of the group it should have joined."""
        state, parent = self.state, self.group
        step = self._next_step()
        sig = _AGREED["subgroup"](None, None, groups)
        record = self._begin("subgroup", step, None, args=sig) if self._recorder is not None else None
        index, position = state.partitions.membership(groups, self.rank)
        slot = self._arrive_and_hold("subgroup", step, None, sig, program_location(sys._getframe(1)))
        try:
            if slot.outputs is None:                  # the parts' shared groups, made by their first member
                slot.outputs = [None] * len(groups)
            group = slot.outputs[index]
            if group is None:
                group = slot.outputs[index] = Group((*parent.key, step, index),
                                                    [parent.ranks[r] for r in groups[index]])
            if len(slot.arrived) == self.world_size:  # the last member: the slot has done its work
                del parent.slots[step]
        finally:
            state.lock.release()
        if record is not None:
            self._recorder.end(record, (group, position))
        return SimTransport(state, group, position, self.pending, self._recorder)

    # -- point to point --

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> Handle | None:
        """Blocking: returns once the matching recv has taken the data. ``async_op``: an
        ``isend``, whose copy of ``tensor`` is taken now and handed over when matched.

        Memory (:mod:`simcomm.memory`) counts what real workers hold: an ``isend``'s copy counts
        on the sender, under its active label, from the call until its handle's ``wait()``, as a
        real backend's ``Work`` holds what it sends until then; the receiver counts a storage of
        its own once it has the message (a ``recv``, or an ``irecv``'s ``wait()``)."""
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

        A blocking call blocks until matched; an asynchronous one returns a handle (an ``isend``'s
        holds its copy until the wait). While memory is tracked the receiver gets a copy of its
        own, made untracked and counted where it receives it; else an ``isend``'s copy is handed
        over as it is.
        """
        state, group = self.state, self.group
        frame = program_location(sys._getframe(2)) if async_op else sys._getframe(2)
        me = self.global_rank
        state.lock_for(me, kind)
        channel = group.channels.setdefault(key, deque())
        if channel and channel[0].kind != kind:
            partner = channel.popleft()
            if _PAIRED(partner.shape, partner.dtype) != _PAIRED(shape, dtype):   # the send/recv rows' rule
                self._p2p_mismatch_and_release(Message(kind, me, tensor, shape, dtype, frame), partner)
            if kind == "send":
                if state.shape_only or (async_op and not memory.any_tracked()):
                    partner.tensor = tensor
                else:
                    with memory.untracked():     # counted on the receiver, which claims it
                        partner.tensor = tensor.clone()
                self._deliver_locked(partner)
                state.lock.release()
                out = None
            else:
                state.lock.release()
                if state.shape_only:   # the sender's fake tensor, rebuilt in this rank's mode
                    out = _shape.own(partner.tensor, state.device)
                elif partner.owned:
                    out = partner.tensor
                else:                  # the sender waits, or holds its isend's copy until its wait
                    with memory.untracked():     # counted once received (memory.received)
                        out = partner.tensor.clone()
                with state.lock:
                    self._deliver_locked(partner)
            if not async_op:
                self._end(record, out)
                return out
            # complete at issue; an isend's handle holds its copy until the wait
            message = Message(kind, me, out if kind == "recv" else tensor, shape, dtype, frame)
            message.done, message.moved = True, partner.moved
            return self._handle(PendingMessage(self, message, record, peer))
        message = Message(kind, me, tensor, shape, dtype, frame, owned=async_op and not memory.any_tracked())
        channel.append(message)
        if async_op:
            state.lock.release()
            return self._handle(PendingMessage(self, message, record, peer))
        message.blocked = True
        state.release_and_wait(me, Wait(kind, frame, peer=group.ranks[peer], detail=p2p_detail(dtype, shape)))
        out = message.tensor if kind == "recv" else None
        if out is not None and state.shape_only:
            out = _shape.own(out, state.device)
        self._end(record, out)
        return out

    def _deliver_locked(self, message: Message) -> None:
        """A posted message found its partner: mark it done, wake its rank if blocked on it."""
        message.done = True
        message.moved = time.perf_counter() - self.state.clock_zero
        if message.blocked:
            message.blocked = False
            self.state.wake_locked(message.rank)

    def _p2p_mismatch_and_release(self, mine: Message, partner: Message) -> None:
        send, recv = (mine, partner) if mine.kind == "send" else (partner, mine)
        message = (
            f"send/recv mismatch in group {list(self.group.ranks)}:\n"
            f"  rank {send.rank} sends {str(send.dtype).removeprefix('torch.')} "
            f"{tuple(send.shape)} at {call_site(send.frame)}\n"
            f"  rank {recv.rank} expects {str(recv.dtype).removeprefix('torch.')} "
            f"{tuple(recv.shape)} at {call_site(recv.frame)}")
        self.state.abort_and_release(CollectiveMismatchError(message))

    # -- rooted and uneven collectives --

    def reduce(self, tensor: torch.Tensor, dst: int, op: str, async_op: bool = False, *,
               factor: float | torch.Tensor | None = None):
        """The reduction on ``dst``; zeros of the input's shape and dtype on the other ranks."""
        sent, wire = collectives.on_the_wire(tensor, op, factor)
        return self._collective("reduce", sent, _AGREED["reduce"](tensor.shape, tensor.dtype, dst, op),
                                lambda inputs: ring_order.reduce_to(inputs, dst, wire), root=dst, async_op=async_op,
                                reduction=op)

    def scatter(self, tensor: torch.Tensor | None, src: int, dim: int, requires_grad: bool = False,
                async_op: bool = False):
        """``(chunk r of src's tensor along dim, whether src said requires_grad)``; ``tensor`` is
        ``None`` off ``src``, and each rank's ``dim`` must name src's dim (negative allowed)."""
        dtypes.check("scatter", None if tensor is None else tensor.dtype, None, self.device, self.rank)
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
            chunks = collectives.scatter_from([entry[0] for entry in inputs], src, source_dim)
            return [(chunk, flag) for chunk in chunks]

        def arrived(out: tuple) -> tuple:
            args["dtype"] = str(out[0].dtype).removeprefix("torch.")
            return out

        entry = (tensor.clone() if async_op and tensor is not None else tensor, requires_grad, dim)
        sig = _AGREED["scatter"](None, None, src)
        if async_op:
            return Handle(self._issue("scatter", step, entry, sig, compute, event), arrived)
        out = arrived(self._rendezvous("scatter", step, entry, sig, compute))
        self._end(event, out[0])
        return out

    def all_to_all_single(self, tensor: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], async_op: bool = False):
        """Uneven all-to-all along dim 0; the ranks' split lists are checked against each other."""
        dtypes.check("all_to_all_single", tensor.dtype, None, self.device, self.rank)
        step = self._next_step()
        outputs, inputs_ = list(output_split_sizes), list(input_split_sizes)
        event = self._begin("all_to_all_single", step, tensor,
                            args={"input_split_sizes": inputs_, "output_split_sizes": outputs},
                            async_op=async_op)
        sig = _AGREED["all_to_all_single"](tensor.shape, tensor.dtype, rows_label="shape[1:]")

        def compute(entries: list) -> list:
            try:
                check_splits("all_to_all_single", [e[2] for e in entries], [e[1] for e in entries])
            except ValueError as error:   # the ranks disagree: a mismatch, as on real processes' checked mode
                self.state.abort(CollectiveMismatchError(mismatch_message(
                    self.ranks, step, [], f"(group-local ranks) {error}")))
                raise Aborted from None
            return collectives.all_to_all_single([e[0] for e in entries], [e[1] for e in entries],
                                          [e[2] for e in entries])

        if async_op:
            return self._issue("all_to_all_single", step, (tensor.clone(), outputs, inputs_), sig, compute, event)
        out = self._rendezvous("all_to_all_single", step, (tensor, outputs, inputs_), sig, compute)
        self._end(event, out)
        return out

    # -- asynchronous calls --

    def _handle(self, pending: Pending) -> Handle:
        self.pending[id(pending)] = pending
        return Handle(pending)

    def check_all_waited(self) -> None:
        """Raise :class:`~simcomm.errors.UnwaitedHandleError` if this rank issued a handle
        (in any of its groups) that was never waited on. Called when the program returns."""
        if not self.pending:
            return
        raise UnwaitedHandleError(unwaited_message(
            self.global_rank, [(pending.what, pending.where) for pending in self.pending.values()]))

    def begin_wait_and_hold(self, pending: Pending) -> RunState:
        """Checks before a handle's ``wait()`` blocks; returns with the run's lock *held*."""
        state = self.state
        if threading.current_thread() is not self._thread:
            if not state.closed and threading.current_thread() not in state.threads:
                # a helper thread of a live run: fails the run with WrongThreadError, as a
                # communicator call from it does
                state.lock_for(self.global_rank, f"wait() on the handle of {pending.what}")
            raise SimcommError(
                f"wait() on the handle of {pending.what} issued by rank {self.global_rank} at "
                f"{pending.where}: called outside that rank's program (its run has ended, or "
                f"another thread called it); wait on handles inside the program that issued them")
        state.lock_for(self.global_rank, f"wait() on {pending.what}")
        return state

    def waited(self, pending: Pending, out) -> None:
        """A handle's wait returned ``out``: the call is no longer pending; keep its record."""
        del self.pending[id(pending)]
        self._fruitless_polls = 0
        if pending.record is not None:
            self._recorder.moved(pending.record, out,
                                 at=pending.moved_at())
            self._recorder.waited(pending.record)

    def poll(self, pending: Pending) -> None:
        """A handle that is not complete was polled: let the ranks that are ready run first.

        When no rank is ready, every other unfinished rank is blocked, so only this
        rank can complete the call; a program that keeps polling instead would spin
        forever, and after :data:`FRUITLESS_POLLS` such polls in a row the run is
        aborted with a :class:`~simcomm.errors.DeadlockError`.
        """
        state, me = self.state, self.global_rank
        if threading.current_thread() is not self._thread:
            return
        with state.lock:
            if state.error is not None:
                raise_aborted = True
            elif state.ready:
                raise_aborted = False
                state.ready.append(me)
                state.random.hand_off(me)   # this rank's random streams, argv, __main__: kept
                next_rank = state.ready.popleft()
            else:
                self._fruitless_polls += 1
                if self._fruitless_polls >= FRUITLESS_POLLS:
                    state.abort_locked(DeadlockError(
                        f"rank {me} polls is_completed() on the handle of {pending.what} issued at "
                        f"{pending.where}, which cannot complete: every other rank is blocked or has "
                        f"finished ({FRUITLESS_POLLS} polls in a row); wait() on it, or make the call "
                        f"its peers wait for first"))
                    raise_aborted = True
                else:
                    return
        if not raise_aborted:
            self._fruitless_polls = 0
            handoff(state.waiters[next_rank], state.waiters[me])
            if state.error is None:
                state.random.take_turn(me)
        if state.error is not None:
            raise Aborted


#: polls of an incomplete handle, with no other rank able to run, after which the run is a deadlock
FRUITLESS_POLLS = 10_000
