"""Where the ranks of a virtual run meet: slots of collectives, posted messages, groups.

A collective is a *rendezvous*: each member of a :class:`Group` deposits its
input in the group's :class:`Slot` for that step, and the last to arrive
computes the outputs (:mod:`simcomm.collectives`). A send or recv is a
:class:`Message` posted on the group's ``(sender, receiver)`` channel until its
partner comes. The scheduler (:mod:`simcomm.sim.scheduler`) decides who runs;
the transport (:mod:`simcomm.sim.transport`) fills these tables under the
run's lock.

When one computed tensor is the output of several ranks (a broadcast, an
all-reduce), every holder but one gets a copy of its own, so no two ranks
share storage, as no two processes would.
"""
from __future__ import annotations

import copy
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .. import memory
from ..buffers import write_into
from ..reports import program_location
from . import shape as _shape

if TYPE_CHECKING:
    from .scheduler import RunState

__all__ = ["Slot", "Message", "Group", "copy_small_shared", "materialize", "format_args",
           "call_site"]


_COPY_HERE_BELOW = 1 << 16  # bytes: smaller shared outputs are copied by the rank that computed them


def copy_small_shared(slot: Slot, owner: int) -> None:
    """Give each member of a completed slot an output of its own, where several entries of
    ``slot.outputs`` are the same tensor (every rank of an all-reduce gets equal values).

    A small shared tensor is copied right away by ``owner``, the rank that computed it (its
    caches are warm; a woken rank's first touches are the expensive ones): ``owner`` keeps the
    original of its own entry, the first other holder the original of any other. A large one
    stays shared; ``slot.holders`` counts its holders, and each copies it on its own thread
    except the last to take it, which gets the original (:func:`materialize`).
    """
    outputs = slot.outputs
    tensor = torch.Tensor
    first = outputs[0] if outputs else None
    if isinstance(first, tensor) and len(set(map(id, outputs))) == 1:
        # one tensor for every member (all_reduce, all_gather, broadcast); members that passed a
        # buffer of their own (``slot.into``) copy into it when they take it: no copy here
        if first.nbytes >= _COPY_HERE_BELOW or slot.into is not None:
            slot.holders = {id(first): len(outputs)} if len(outputs) > 1 else {}
        else:
            for index in range(len(outputs)):
                if index != owner:
                    outputs[index] = first.clone()
            slot.holders = {}
        return
    count: dict[int, int] = {}
    for out in outputs:
        if isinstance(out, tensor):
            key = id(out)
            count[key] = count.get(key, 0) + 1
    holders: dict[int, int] = {}
    if len(count) < len(outputs):   # some tensor is held more than once (or there are non-tensors)
        kept = {id(outputs[owner])}
        for index, out in enumerate(outputs):
            if index == owner or not isinstance(out, tensor):
                continue
            key = id(out)
            held = count[key]
            if held == 1:
                continue
            if out.nbytes >= _COPY_HERE_BELOW:
                holders[key] = held
            elif key in kept:
                outputs[index] = out.clone()
            else:
                kept.add(key)
    slot.holders = holders


def materialize(slot: Slot, rank: int, state: RunState):
    """This rank's output of a completed slot, counted on this rank (:func:`simcomm.memory.received`).

    A tensor that other members of the slot still share is copied; the last member to
    take it gets the original (``slot.holders`` counts the members yet to take each shared
    tensor, so this costs the same at any group size). So no rank is counted for a shared output another rank
    has not taken yet (the count would depend on which rank the scheduler ran first),
    as in the shape-only run, where every member builds its own output.

    A member that passed a buffer of its own (``slot.into``: c10d's output tensor) gets its
    output copied into that buffer, which is returned: no tensor is made, so nothing new is
    counted, as a native backend writes into the buffer it was given. The copy goes through a
    detached alias and leaves the buffer's version counter as it was (the c10d adapter moves
    it as the native backend does).
    """
    out = slot.outputs[rank]
    # the slot keeps no reference to this rank's tensors or frames: they are freed when the program drops them
    slot.outputs[rank] = slot.inputs[rank] = slot.frames[rank] = None
    into = None
    if slot.into is not None:
        into, slot.into[rank] = slot.into[rank], None
    if state.shape_only:    # meta outputs become fake tensors of this rank's own mode; a fake buffer
        if into is not None:    # holds no values: one it had from constants is gone now
            _shape.forget_values(into)
            return into
        return memory.received(_shape.own(out, state.device))
    holders = slot.holders
    if holders and id(out) in holders:
        left = holders[id(out)] - 1     # members still to take it after this one
        holders[id(out)] = left
        if left and into is None:
            out = out.clone()
    if into is not None:
        write_into(into, out)
        return into
    return memory.received(out)


def failure(slot: Slot, rank: int) -> BaseException:
    """What a member of a failed slot raises: when the collective's math raised an error
    (on the member that computed it), a copy of that error, so that every member sees the
    failed call as every real rank would; else (the run was aborted) ``Aborted``."""
    from ..errors import Aborted

    error = slot.error
    if error is None:
        return Aborted()
    mine = copy.copy(error)
    mine.__traceback__ = mine.__cause__ = mine.__context__ = None
    mine.__notes__ = list(getattr(error, "__notes__", ()))    # the copy's own list
    mine.add_note(f"(raised on rank {rank} too: the collective {slot.op} failed for the whole group)")
    return mine


def format_args(sig: tuple) -> str:
    return ", ".join(f"{name}={str(value).removeprefix('torch.')}" for name, value in sig)


def call_site(frame) -> str:
    """Where a rank called from: a live frame, or the location an asynchronous call kept
    when it was issued (its frame has moved on since)."""
    return frame if isinstance(frame, str) else program_location(frame)


class Slot:
    """One collective of one group at one step: where the members meet.

    ``frames[i]`` is a blocked member's live frame, or the location string of a
    member that issued the call asynchronously. ``moved`` is when the last member
    computed the outputs (seconds since the run started).
    """

    __slots__ = ("op", "sig", "inputs", "frames", "arrived", "waiting", "outputs", "holders",
                 "failed", "error", "moved", "into", "group")

    def __init__(self, op: str, sig: tuple, world_size: int, group: Group | None = None):
        self.op, self.sig = op, sig
        self.group = group                # the group it belongs to (read by the deadlock report)
        self.inputs: list = [None] * world_size
        self.frames: list = [None] * world_size
        self.arrived: list[int] = []      # group-local ranks, in arrival order
        self.waiting: list[int] = []      # global ranks blocked on this slot
        self.outputs: list | None = None
        self.holders: dict[int, int] = {}     # id of a shared large output -> members yet to take it
        self.failed = False
        self.error: Exception | None = None   # what the collective's math raised, if it did
        self.moved = 0.0
        self.into: list | None = None    # members' own output buffers (materialize), when any passed one


class Message:
    """A posted send or recv waiting for its partner.

    ``owned``: ``tensor`` is a private copy made at issue (an ``isend``) that the receiver takes
    without another copy (memory is not tracked: else the sender's handle holds its copy, counted
    on the sender, until its wait). ``blocked``: the poster is blocked on this message
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


class Group:
    """A set of ranks that run collectives together; shared by its members' transports."""

    __slots__ = ("key", "ranks", "slots", "channels")

    def __init__(self, key: tuple, ranks: Sequence[int]):
        self.key = key
        self.ranks = tuple(ranks)
        self.slots: dict[int, Slot] = {}
        self.channels: dict[tuple[int, int], deque[Message]] = {}
