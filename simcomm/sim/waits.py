"""Where each virtual rank is: waits, and the deadlock and timeout reports.

A report names every rank, but ranks that wait in the same place (the same
op, step and group, at the same line of the program) share one line with
their ranks written as ranges, ``ranks [0-2, 4-3999]``. So a deadlock of
4000 ranks reads in a few lines, and writing it costs one pass over the ranks.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..reports import format_ranks, program_frame, program_location

__all__ = ["Wait", "p2p_detail", "describe_waits", "describe_deadlock", "describe_ranks"]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- what a blocked rank waits for ---------------------------------------------------------------

@dataclass(slots=True)
class Wait:
    """What a blocked rank waits for (read by the deadlock and timeout reports).

    A collective wait has a ``slot`` (the group's meeting point at ``step``).
    A point-to-point wait names its ``peer`` (global rank) and ``detail``
    (dtype and shape); without ``peer``, ``op`` is the whole description.
    """

    op: str                           # "all_reduce", "send", "recv", or a whole description
    frame: object
    slot: object | None = None        # the collective's meeting point (has ``arrived``)
    group_ranks: tuple[int, ...] = ()
    step: int = 0
    peer: int | None = None           # point to point: the other rank (global)
    detail: str = ""                  # point to point: "float32 (2,)"

    @property
    def what(self) -> str:
        """The op as one rank sees it: ``all_reduce(step 0, group [0-3])``, ``send to rank 1 (...)``."""
        if self.slot is not None:
            return f"{self.op}(step {self.step}, group {format_ranks(self.group_ranks)})"
        if self.peer is not None:
            direction = "to" if self.op == "send" else "from"
            return f"{self.op} {direction} rank {self.peer} ({self.detail})"
        return self.op

    def where(self) -> str:
        return program_location(self.frame)


def p2p_detail(dtype: torch.dtype, shape: Sequence[int]) -> str:
    return f"{_dtype_name(dtype)} {tuple(shape)}"


# -- reports ------------------------------------------------------------------------------------

_ONE_LINE_EACH = 3  # groups of up to this many ranks get one line per rank


def _subject(ranks: list[int], singular: str, plural: str) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} {singular}"
    return f"ranks {format_ranks(ranks)} ({len(ranks)} ranks) {plural}"


def _collective_lines(ranks: list[int], wait: Wait, where: str) -> list[str]:
    arrived_local = set(wait.slot.arrived)
    group = wait.group_ranks
    missing = [rank for index, rank in enumerate(group) if index not in arrived_local]
    arrived = sorted(group[index] for index in arrived_local)
    if len(arrived) <= _ONE_LINE_EACH:
        arrived_text = format_ranks(arrived)
    else:
        arrived_text = f"{len(arrived)} of {len(group)}: {format_ranks(arrived)}"
    tail = f"for ranks {format_ranks(missing)} (arrived: {arrived_text}) at {where}"
    if len(ranks) <= _ONE_LINE_EACH:
        return [f"  rank {rank} waits in {wait.what} {tail}" for rank in ranks]
    return [f"  {_subject(ranks, 'waits', 'wait')} in {wait.what} {tail}"]


def _p2p_lines(ranks: list[int], waits: list[Wait], where: str, world_size: int) -> list[str]:
    if len(ranks) <= _ONE_LINE_EACH or waits[0].peer is None:
        return [f"  rank {rank} waits in {wait.what} at {where}" for rank, wait in zip(ranks, waits)]
    first = waits[0]
    direction = "to" if first.op == "send" else "from"
    offsets = {(wait.peer - rank) % world_size for rank, wait in zip(ranks, waits)}
    if len(offsets) == 1:
        offset = offsets.pop()
        peers = f"each {direction} rank r{'+' if offset <= world_size // 2 else '-'}" \
                f"{offset if offset <= world_size // 2 else world_size - offset} (mod {world_size})"
    else:
        peers = f"{direction} ranks {format_ranks([w.peer for w in waits], ordered=True)} respectively"
    return [f"  {_subject(ranks, 'waits', 'wait')} in {first.op} ({first.detail}), {peers}, at {where}"]


def describe_waits(blocked: dict[int, Wait], world_size: int) -> list[str]:
    """One line per place where ranks wait (per rank for small groups), in rank order."""
    places: dict[tuple, tuple[list[int], list[Wait], str]] = {}
    locations: dict[object, str] = {}
    for rank in sorted(blocked):
        wait = blocked[rank]
        # SPMD ranks wait at the same few lines: format each distinct line once
        frame = program_frame(wait.frame)
        line = (frame.f_code, frame.f_lineno) if frame is not None else None
        where = locations.get(line)
        if where is None:
            where = locations[line] = program_location(frame)
        if wait.slot is not None:
            key = ("collective", id(wait.slot), where)
        else:
            key = ("p2p", wait.op, wait.detail if wait.peer is not None else wait.what, where)
        places.setdefault(key, ([], [], where))
        places[key][0].append(rank)
        places[key][1].append(wait)
    lines = []
    for key, (ranks, waits, where) in places.items():
        if key[0] == "collective":
            lines.extend(_collective_lines(ranks, waits[0], where))
        else:
            lines.extend(_p2p_lines(ranks, waits, where, world_size))
    return lines


def _c10d_local_name(slot) -> str | None:
    """The name torch gave the group of ``slot`` when the group was made with
    ``new_group(..., use_local_synchronization=True)`` (its key is ``("c10d", name, ranks)``,
    :mod:`simcomm.sim.dist_world`), else None."""
    key = getattr(getattr(slot, "group", None), "key", None)
    if isinstance(key, tuple) and len(key) == 3 and key[0] == "c10d" and isinstance(key[1], str):
        return key[1]
    return None


def _groups_apart(blocked: dict[int, Wait]) -> list[str]:
    """Notes for ranks that wait at one step in different groups of the same ranks: each
    group meets apart, so none of them can complete (a common way to deadlock with c10d)."""
    by_ranks: dict[tuple, dict[int, tuple[object, list[int]]]] = {}
    for rank in sorted(blocked):
        wait = blocked[rank]
        if wait.slot is not None:
            places = by_ranks.setdefault((tuple(sorted(wait.group_ranks)), wait.step), {})
            places.setdefault(id(wait.slot), (wait.slot, []))[1].append(rank)
    notes = []
    for (ranks, step), places in by_ranks.items():
        if len(places) < 2:
            continue
        apart = " and ".join(f"rank {r[0]}" if len(r) == 1 else f"ranks {format_ranks(r)}"
                             for _, r in places.values())
        notes.append(f"  note: {apart} wait at step {step} of {len(places)} different groups of the same "
                     f"ranks {format_ranks(list(ranks))}: the members of a group meet in that group only")
        names = [_c10d_local_name(slot) for slot, _ in places.values()]
        if all(name is not None for name in names):
            notes.append(
                "    these groups were made by their members only (as dist.new_group(..., "
                "use_local_synchronization=True) makes them), and torch names such a group after its "
                "ranks and the number of process groups the calling rank belongs to "
                f"(here {', '.join(name[:8] for name in names)}): ranks that belong to different numbers "
                "of groups make different groups. Create the groups so that every member of this one "
                "belongs to the same number of groups when it is made (e.g. every rank calls new_group "
                "for every group, in the same order, without use_local_synchronization)")
    return notes


def describe_deadlock(blocked: dict[int, Wait], finished: Iterable[int], world_size: int) -> str:
    """The :class:`~simcomm.errors.DeadlockError` message: who waits for whom, where."""
    lines = ["every rank that has not finished is blocked, so none can make progress:"]
    lines.extend(describe_waits(blocked, world_size))
    done = sorted(finished)
    if done:
        if len(done) <= _ONE_LINE_EACH:
            lines.extend(f"  rank {rank} has finished its program" for rank in done)
        else:
            lines.append(f"  {_subject(done, '', 'have finished their programs')}")
    lines.extend(_groups_apart(blocked))
    return "\n".join(lines)


def describe_ranks(states: dict[int, str], world_size: int) -> list[str]:
    """Lines for ranks that are not blocked in the scheduler, grouped by what is said of them
    (``{rank: "computes at file:12 in program"}``)."""
    by_text: dict[str, list[int]] = {}
    for rank in sorted(states):
        by_text.setdefault(states[rank], []).append(rank)
    lines = []
    for text, ranks in by_text.items():
        if len(ranks) <= _ONE_LINE_EACH:
            lines.extend(f"  rank {rank} {text}" for rank in ranks)
        else:
            lines.append(f"  ranks {format_ranks(ranks)} ({len(ranks)} ranks) {text}")
    return lines
