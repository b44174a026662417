"""What a virtual rank's handles wait on: an issued collective's slot, or a posted message.

A :class:`~simcomm.handles.Handle` of the simulator wraps one of these. Its
``wait()`` takes the run's lock through the transport
(:meth:`~simcomm.sim.transport.SimTransport.begin_wait_and_hold`), blocks
visibly to the scheduler until the call completes, and reports back
(:meth:`~simcomm.sim.transport.SimTransport.waited`); ``is_completed()`` never
blocks, but lets ready ranks run first (:meth:`~simcomm.sim.transport.SimTransport.poll`).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from .. import memory
from ..trace import Record
from . import shape as _shape
from .rendezvous import Message, Slot, call_site, failure, materialize
from .waits import Wait

if TYPE_CHECKING:
    from .transport import SimTransport

__all__ = ["PendingCollective", "PendingMessage", "Pending", "p2p_what"]


def p2p_what(kind: str, peer: int, shape, dtype) -> str:
    what = f"send to rank {peer}" if kind == "send" else f"recv from rank {peer}"
    return f"{what} ({str(dtype).removeprefix('torch.')} {tuple(shape)})"


class PendingCollective:
    """What the handle of an asynchronous collective waits on: its slot."""

    __slots__ = ("transport", "slot", "step", "record", "where")

    def __init__(self, transport: SimTransport, slot: Slot, step: int, record: Record | None, where: str):
        self.transport, self.slot, self.step, self.record, self.where = (
            transport, slot, step, record, where)

    @property
    def what(self) -> str:
        return f"{self.slot.op}(step {self.step}, group {list(self.transport.ranks)})"

    def moved_at(self) -> float:
        return self.slot.moved

    def is_completed(self) -> bool:
        if self.slot.outputs is None:
            self.transport.poll(self)
        return self.slot.outputs is not None

    def wait(self):
        transport, slot = self.transport, self.slot
        state = transport.begin_wait_and_hold(self)
        if slot.outputs is None and not slot.failed:
            slot.waiting.append(transport.global_rank)
            state.release_and_wait(transport.global_rank, Wait(
                f"wait() on {slot.op}", sys._getframe(1), slot, transport.ranks, self.step))
        else:
            state.lock.release()
        if slot.failed:
            if slot.error is not None:       # waited on: the failure, not a forgotten handle
                transport.waited(self, None)
            raise failure(slot, transport.global_rank)
        out = materialize(slot, transport.rank, state)
        transport.waited(self, out)
        return out

    def __repr__(self) -> str:
        return f"{self.what} issued at {self.where}"


class PendingMessage:
    """What the handle of an ``isend``/``irecv`` waits on: its posted message."""

    __slots__ = ("transport", "message", "record", "peer")

    def __init__(self, transport: SimTransport, message: Message, record: Record | None, peer: int):
        self.transport, self.message, self.record, self.peer = transport, message, record, peer

    @property
    def what(self) -> str:
        message = self.message
        kind = "isend" if message.kind == "send" else "irecv"
        return kind + " " + p2p_what(message.kind, self.transport.ranks[self.peer], message.shape,
                                message.dtype).split(" ", 1)[1]

    @property
    def where(self) -> str:
        return call_site(self.message.frame)

    def moved_at(self) -> float:
        return self.message.moved

    def is_completed(self) -> bool:
        if not self.message.done:
            self.transport.poll(self)
        return self.message.done

    def wait(self):
        transport, message = self.transport, self.message
        state = transport.begin_wait_and_hold(self)
        if not message.done:
            message.blocked = True
            state.release_and_wait(transport.global_rank, Wait(f"wait() on {self.what}", sys._getframe(1)))
        else:
            state.lock.release()
        out = message.tensor if message.kind == "recv" else None
        message.tensor = None        # an isend's copy is freed here, as a real backend's Work frees it
        if out is not None and transport.state.shape_only:
            out = _shape.own(out, transport.state.device)
        out = memory.received(out)   # the message's bytes now count on this, the receiving, rank
        transport.waited(self, out)
        return out

    def __repr__(self) -> str:
        return f"{self.what} issued at {self.where}"


Pending = PendingCollective | PendingMessage
