"""The modelled timeline: a compute lane and a communication lane per rank, as on a GPU.

:func:`layout` places an annotated trace (every event has a ``modelled``
duration, :func:`simcomm.model.cost.annotate`) in modelled time. Each rank has

* a **compute lane**: the program itself. It walks the rank's events in
  program order; a ``compute`` event occupies it for its duration.
* a **communication lane**, like the separate CUDA stream NCCL kernels run on.
  A collective starts on it when every member of its group has issued the call
  (at the member's compute-lane time) and every member's communication lane is
  free (collectives run one after the other, in issue order, as on a stream);
  it lasts its modelled duration. A point-to-point message starts when both
  ends have issued it and their lanes are free; messages do not queue behind
  each other (sends and receives issued together, ``batch_isend_irecv``, run
  together).

A **blocking** call makes the compute lane wait until the call's end. An
**async** call (``TraceEvent.async_op``) does not: the compute lane goes on, and
waits for the call's end only at the program's ``wait()``; where that wait
happened among the rank's other calls is read from ``TraceEvent.waited``
(measured time, compared with the other events' issue times). An async call
never waited on (``waited`` is None) never stalls the compute lane.

Per rank (:class:`RankSummary`): ``communication`` is the time its
communication lane is busy; ``exposed`` the part of it during which the
compute lane waits; ``hidden = communication - exposed`` the part that overlaps
the program's own work. A compute lane can also wait while its own
communication lane is idle (a peer has not issued the collective yet):
``waiting``, the cost of imbalance rather than of communication.
"""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from operator import attrgetter, itemgetter, le
from typing import NamedTuple

from ..collector import FullCollectionsDeferred
from ..trace import Trace, TraceEvent

__all__ = ["Placed", "Stall", "RankSummary", "Timeline", "GroupIndex", "layout"]


class Placed(NamedTuple):
    """One event in modelled time (seconds); compute events on the compute lane, the rest on
    the communication lane."""

    event: TraceEvent
    start: float
    end: float

    @property
    def lane(self) -> str:
        return "compute" if self.event.op == "compute" else "communication"


class Stall(NamedTuple):
    """The compute lane of ``rank`` waits from ``start`` to ``end`` for the call ``event``."""

    rank: int
    start: float
    end: float
    event: TraceEvent


@dataclass(frozen=True)
class RankSummary:
    """Where one rank's time went (seconds)."""

    rank: int
    compute: float          # compute lane busy with compute events
    communication: float    # communication lane busy
    exposed: float          # communication during which the compute lane waits
    waiting: float          # compute lane waits while its communication lane is idle (peers late)
    end: float              # the rank's last event ends

    @property
    def hidden(self) -> float:
        """Communication that overlaps the program's own work."""
        return self.communication - self.exposed


@dataclass
class Timeline(Sequence):
    """The placed events (ordered by start, then rank), the stalls and a summary per rank."""

    placed: list[Placed]
    stalls: list[Stall]
    ranks: dict[int, RankSummary] = field(default_factory=dict)
    _stalls_by_rank: dict | None = field(default=None, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.placed)

    def __getitem__(self, index):
        return self.placed[index]

    def __iter__(self) -> Iterator[Placed]:
        return iter(self.placed)

    def exposed_parts(self, item: Placed) -> list[tuple[float, float]]:
        """The parts of a communication event during which its rank's compute lane waits."""
        if item.lane == "compute":
            return []
        if self._stalls_by_rank is None:
            self._stalls_by_rank = {}
            for stall in self.stalls:
                self._stalls_by_rank.setdefault(stall.rank, []).append(stall)
        return [(max(item.start, s.start), min(item.end, s.end)) for s in self._stalls_by_rank.get(item.event.rank, ())
                if min(item.end, s.end) > max(item.start, s.start)]


class GroupIndex:
    """Small ints for the groups (tuples of global ranks) of a trace's events.

    A call's key holds its group; a tuple does not keep its hash, so a key of a
    world-wide call would cost ``O(world size)`` at every dict operation, ``O(world
    size**2)`` for a run. Calling the index with a group gives its number: the
    events of one run share their group tuples, so a group is hashed once per
    distinct object (looked up by ``id``; the index keeps each object alive) and
    once per distinct value. ``members[i]`` is group ``i``.
    """

    def __init__(self) -> None:
        self.members: list[tuple[int, ...]] = []
        self._by_value: dict[tuple[int, ...], int] = {}
        self._by_object: dict[int, int] = {}
        self._kept: list[tuple[int, ...]] = []      # so no id is reused while the index lives

    def __call__(self, group: tuple[int, ...]) -> int:
        number = self._by_object.get(id(group))
        if number is None:
            number = self._by_value.setdefault(group, len(self.members))
            if number == len(self.members):
                self.members.append(group)
            self._by_object[id(group)] = number
            self._kept.append(group)
        return number


def _members(key: tuple, groups: GroupIndex) -> tuple[int, ...]:
    return key[1:3] if key[0] == "p2p" else groups.members[key[2]]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as disjoint intervals of positive length, in order."""
    merged: list[tuple[float, float]] = []
    first = last = None                         # the interval being merged
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if last is not None and start <= last:
            if end > last:
                last = end
        else:
            if last is not None:
                merged.append((first, last))
            first, last = start, end
    if last is not None:
        merged.append((first, last))
    return merged


def _overlap(intervals: list[tuple[float, float]], others: list[tuple[float, float]]) -> float:
    """Length of (union of ``intervals``) intersected with (union of ``others``)."""
    return _overlap_of_unions(_union(intervals), _union(others))


def _overlap_of_unions(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions (:func:`_union`): one sweep over both, in order."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        (a_start, a_end), (b_start, b_end) = a[i], b[j]
        length = min(a_end, b_end) - max(a_start, b_start)
        if length > 0:
            total += length
        if a_end < b_end:
            i += 1
        else:
            j += 1
    return total


# what a rank does next (the first item of each action of :func:`_actions`)
_COMPUTE, _ALONE, _COLLECTIVE, _P2P, _WAIT, _WAIT_ALONE = range(6)
_new = tuple.__new__            # a Placed or Stall without the Python-level __new__ of a NamedTuple


def _issue(event: TraceEvent, groups: GroupIndex) -> tuple[int, tuple | None]:
    """What issuing ``event`` is (:data:`_COMPUTE`, :data:`_ALONE`, :data:`_P2P` or
    :data:`_COLLECTIVE`) and the key that identifies its call across its participants:
    ``("p2p", sender, receiver, group, step)``, ``("collective", op, group, step)`` (``group``
    numbered by ``groups``), None for rank-local events (compute, and calls on a group of one)."""
    op = event.op
    if op == "compute":
        return _COMPUTE, None
    if op == "send" or op == "recv":
        sender, receiver = (event.rank, event.root) if op == "send" else (event.root, event.rank)
        return _P2P, ("p2p", sender, receiver, groups(event.group), event.step)
    if len(event.group) < 2:
        return _ALONE, None
    return _COLLECTIVE, ("collective", op, groups(event.group), event.step)


def _actions(events: list[TraceEvent], groups: GroupIndex) -> list[tuple]:
    """A rank's calls and waits in program order, as ``(kind, event, key)`` (:func:`_issue`):
    issues at ``start``, async waits at ``waited``, a blocking call's wait right after its issue."""
    out: list[tuple] = []
    append = out.append
    starts = [e.start for e in events]
    if all(map(le, starts, islice(starts, 1, None))):
        # program order is the order of the issues' (time, position): the actions in one pass,
        # unless an async call is waited on (its wait goes where its time puts it)
        for event in events:
            if event.async_op and event.waited is not None:
                out.clear()
                break
            kind, key = _issue(event, groups)
            append((kind, event, key))
            if key is not None and not event.async_op:
                append((_WAIT, event, key))
        else:
            return out
    issues = [_issue(event, groups) for event in events]
    actions = [(e.start, 0, i, "issue", e) for i, e in enumerate(events)]
    actions += [(e.waited, 1, i, "wait", e) for i, e in enumerate(events) if e.async_op and e.waited is not None]
    # (time, issue before wait, position) is unique: the sort never compares further
    for _, _, i, what, event in sorted(actions):
        kind, key = issues[i]
        if what == "wait":
            append((_WAIT_ALONE if key is None else _WAIT, event, key))
        else:
            append((kind, event, key))
            if key is not None and not event.async_op:
                append((_WAIT, event, key))
    return out


def layout(trace: Trace) -> Timeline:
    """Place every event of an annotated trace on its rank's lanes (module docstring).

    Raises ``ValueError`` when an event has no modelled duration, or when the
    ranks' calls do not match up (a filtered or incomplete trace).
    """
    # every placement and stall stays alive to the end: full collections would walk them
    # again and again (two fifths of a 273,408-event layout's CPU time) and free none of them
    with FullCollectionsDeferred():
        return _layout(trace)


# getters and sort keys that run in C: no Python-level call per event
_first, _second = itemgetter(0), itemgetter(1)
_modelled = attrgetter("modelled")
_by_start_then_rank = attrgetter("start", "event.rank")
_stall_order = attrgetter("start", "rank")


def _layout(trace: Trace) -> Timeline:
    by_rank: dict[int, list[TraceEvent]] = {}
    for event in trace.events:      # ordered by start: each rank's calls in program order
        if event.modelled is None:
            raise ValueError(f"modelled_timeline: {event.op} of rank {event.rank} (step {event.step}) "
                             f"has no modelled duration; call simcomm.model.cost.annotate(trace, topology) first")
        mine = by_rank.get(event.rank)
        if mine is None:
            by_rank[event.rank] = [event]
        else:
            mine.append(event)
    groups = GroupIndex()
    ranks = list(by_rank)
    actions = [_actions(by_rank[rank], groups) for rank in ranks]
    done = [0] * len(ranks)                    # per rank position: its actions taken so far
    cpu = dict.fromkeys(by_rank, 0.0)
    lane_free = dict.fromkeys(by_rank, 0.0)    # after the last collective on the lane
    p2p_free = dict.fromkeys(by_rank, 0.0)     # after the last point-to-point message
    lane_queue: dict[int, deque] = {rank: deque() for rank in by_rank}
    issued: dict[tuple, dict[int, tuple[TraceEvent, float]]] = {}
    ends: dict[tuple, float] = {}
    placed: list[Placed] = []
    stalls: list[Stall] = []
    place_one = placed.append
    stall = stalls.append
    members_of = groups.members

    order: dict[tuple, int] = {}                # each call's position in issue order

    def placeable(key: tuple) -> bool:
        if key in ends:
            return False
        members, calls = _members(key, groups), issued[key]
        if len(calls) < len(members):          # calls holds members only: some member has not issued it
            return False
        return key[0] != "collective" or all(lane_queue[m][0] == key for m in members)

    def place(key: tuple) -> list[tuple]:
        """Place one call; return the calls its placement may make placeable (new lane heads)."""
        calls = issued[key]
        issues = calls.values()
        if key[0] == "collective":
            members = members_of[key[2]]
            free = max(map(max, map(lane_free.__getitem__, members), map(p2p_free.__getitem__, members)))
            start = max(max(map(_second, issues)), free)
            end = start + max(map(_modelled, map(_first, issues)))
            enabled = []
            for member in members:
                lane_free[member] = end
                queue = lane_queue[member]
                queue.popleft()
                if queue:
                    enabled.append(queue[0])
                place_one(_new(Placed, (calls[member][0], start, end)))
        else:
            members = key[1:3]
            start = max(max(map(_second, issues)), max(map(lane_free.__getitem__, members)))
            end = start + max(map(_modelled, map(_first, issues)))
            enabled = []
            for member in members:
                p2p_free[member] = max(p2p_free[member], end)
                place_one(_new(Placed, (calls[member][0], start, end)))
        ends[key] = end
        woken(key)
        return enabled

    def place_ready(first: tuple) -> None:
        # passes over the candidates in issue order, as a scan of every unplaced call would
        # make them: a call enabled by a placement later in the order is placed in the same
        # pass, one earlier in the order in the next pass
        pending = [first]
        while pending:
            heap = [(order[k], k) for k in pending]
            heapq.heapify(heap)
            pending, seen = [], set()
            while heap:
                position, key = heapq.heappop(heap)
                if key in seen or not placeable(key):
                    continue
                seen.add(key)
                for other in place(key):
                    if other in issued and other not in ends:
                        if order[other] > position:
                            heapq.heappush(heap, (order[other], other))
                        else:
                            pending.append(other)
            pending = sorted(set(pending), key=order.__getitem__)

    # Passes over the ranks in the order of their first events, each rank going on until it
    # waits on a call not yet placed. A rank that waits is visited again only once its call is
    # placed: later in the same pass when it comes after the rank whose issue placed the call,
    # in the next pass otherwise, the order a scan of every rank in every pass would visit it in.
    waiting: dict[tuple, list[int]] = {}       # a call not yet placed -> positions of ranks waiting on it
    this_pass, next_pass = list(range(len(ranks))), []
    visiting = -1
    alone_end: dict[int, float] = {}           # id of an async call on a group of one -> its end

    def woken(key: tuple) -> None:
        for position in waiting.pop(key, ()):
            if position > visiting:
                heapq.heappush(this_pass, position)
            else:
                next_pass.append(position)

    while this_pass or next_pass:
        if not this_pass:
            this_pass, next_pass = sorted(next_pass), []
        visiting = heapq.heappop(this_pass)
        rank = ranks[visiting]
        todo = actions[visiting]
        i, count = done[visiting], len(todo)
        now = cpu[rank]
        while i < count:
            kind, event, key = todo[i]
            if kind == _COMPUTE:
                place_one(_new(Placed, (event, now, now + event.modelled)))
                now += event.modelled
            elif kind == _WAIT:
                end = ends.get(key)
                if end is None:
                    waiting.setdefault(key, []).append(visiting)
                    break
                if end > now:
                    stall(_new(Stall, (rank, now, end, event)))
                    now = end
            elif kind == _COLLECTIVE or kind == _P2P:
                if kind == _COLLECTIVE:
                    lane_queue[rank].append(key)
                    needed = len(members_of[key[2]])
                else:
                    needed = 2
                calls = issued.get(key)
                if calls is None:
                    calls = issued[key] = {}
                calls[rank] = (event, now)
                if key not in order:
                    order[key] = len(order)
                if len(calls) >= needed and key not in ends:    # else it cannot be placed yet
                    place_ready(key)
            elif kind == _ALONE:    # a call on a group of one: its own lane only
                start = max(now, lane_free[rank])
                lane_free[rank] = start + event.modelled
                place_one(_new(Placed, (event, start, lane_free[rank])))
                if event.async_op:
                    alone_end[id(event)] = lane_free[rank]
                elif lane_free[rank] > now:
                    stall(_new(Stall, (rank, now, lane_free[rank], event)))
                    now = lane_free[rank]
            else:                   # the wait on an async call on a group of one
                end = alone_end.pop(id(event))
                if end > now:
                    stall(_new(Stall, (rank, now, end, event)))
                    now = end
            i += 1
        done[visiting] = i
        cpu[rank] = now
    stuck = {}
    for position, rank in enumerate(ranks):
        if done[position] < len(actions[position]):
            kind, event, _ = actions[position][done[position]]
            stuck[rank] = (f"{'waits on' if kind >= _WAIT else 'issues'} {event.op} step {event.step} "
                           f"group {event.group}")
    unplaced = [key for key in issued if key not in ends]
    if stuck or unplaced:
        raise ValueError(f"modelled_timeline: the ranks' events do not match up (each rank's next "
                         f"event: {stuck}; calls some member never issued: "
                         f"{[f'{k[1]} step {k[-1]}' for k in unplaced]}); is the trace filtered or incomplete?")
    placed.sort(key=_by_start_then_rank)
    stalls.sort(key=_stall_order)
    return Timeline(placed, stalls, _summaries(by_rank, placed, stalls, cpu, lane_free))


def _summaries(by_rank, placed, stalls, cpu, lane_free) -> dict[int, RankSummary]:
    summaries = {}
    # per rank, in the timeline's order: its compute events' durations, its communication
    # events' intervals of positive length, every event's end
    parts: dict[int, tuple[list, list, list]] = {}
    for placement in placed:
        event, start, end = placement
        mine = parts.get(event.rank)
        if mine is None:
            mine = parts[event.rank] = ([], [], [])
        if placement.lane == "compute":
            mine[0].append(end - start)
        elif end > start:
            mine[1].append((start, end))
        mine[2].append(end)
    waited: dict[int, list[tuple[float, float]]] = {}
    for rank, start, end, _ in stalls:
        mine = waited.get(rank)
        if mine is None:
            waited[rank] = [(start, end)]
        else:
            mine.append((start, end))
    nothing = ([], [], [])
    for rank in sorted(by_rank):
        durations, busy, ends = parts.get(rank, nothing)
        comm = _union(busy)
        waits = _union(waited.get(rank, []))
        exposed = _overlap_of_unions(waits, comm)
        summaries[rank] = RankSummary(
            rank=rank, compute=sum(durations), communication=sum(end - start for start, end in comm),
            exposed=exposed, waiting=sum(end - start for start, end in waits) - exposed,
            end=max([cpu[rank], lane_free[rank]] + ends))
    return summaries
