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


def _key(event: TraceEvent, groups: GroupIndex) -> tuple | None:
    """What identifies one call across its participants; None for rank-local events."""
    if event.op in ("send", "recv"):
        sender, receiver = (event.rank, event.root) if event.op == "send" else (event.root, event.rank)
        return ("p2p", sender, receiver, groups(event.group), event.step)
    if event.op == "compute" or len(event.group) < 2:
        return None
    return ("collective", event.op, groups(event.group), event.step)


def _members(key: tuple, groups: GroupIndex) -> tuple[int, ...]:
    return key[1:3] if key[0] == "p2p" else groups.members[key[2]]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as disjoint intervals of positive length, in order."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def _union_length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in _union(intervals))


def _overlap(intervals: list[tuple[float, float]], others: list[tuple[float, float]]) -> float:
    """Length of (union of ``intervals``) intersected with (union of ``others``): one sweep over
    the two unions, each in order."""
    a, b = _union(intervals), _union(others)
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


def _actions(events: list[TraceEvent], groups: GroupIndex) -> deque:
    """A rank's calls and waits in program order, each with its call's :func:`_key`: issues at
    ``start``, async waits at ``waited``."""
    keys = [_key(e, groups) for e in events]
    actions = [(e.start, 0, i, "issue", e) for i, e in enumerate(events)]
    actions += [(e.waited, 1, i, "wait", e) for i, e in enumerate(events) if e.async_op and e.waited is not None]
    # (time, issue before wait, position) is unique: the sort never compares further
    return deque((kind, event, keys[i]) for _, _, i, kind, event in sorted(actions))


def layout(trace: Trace) -> Timeline:
    """Place every event of an annotated trace on its rank's lanes (module docstring).

    Raises ``ValueError`` when an event has no modelled duration, or when the
    ranks' calls do not match up (a filtered or incomplete trace).
    """
    # every placement and stall stays alive to the end: full collections would walk them
    # again and again (two fifths of a 273,408-event layout's CPU time) and free none of them
    with FullCollectionsDeferred():
        return _layout(trace)


def _layout(trace: Trace) -> Timeline:
    by_rank: dict[int, list[TraceEvent]] = {}
    for event in trace.events:      # ordered by start: each rank's calls in program order
        if event.modelled is None:
            raise ValueError(f"modelled_timeline: {event.op} of rank {event.rank} (step {event.step}) "
                             f"has no modelled duration; call simcomm.model.cost.annotate(trace, topology) first")
        by_rank.setdefault(event.rank, []).append(event)
    groups = GroupIndex()
    actions = {rank: _actions(events, groups) for rank, events in by_rank.items()}
    cpu = dict.fromkeys(by_rank, 0.0)
    lane_free = dict.fromkeys(by_rank, 0.0)    # after the last collective on the lane
    p2p_free = dict.fromkeys(by_rank, 0.0)     # after the last point-to-point message
    lane_queue: dict[int, deque] = {rank: deque() for rank in by_rank}
    issued: dict[tuple, dict[int, tuple[TraceEvent, float]]] = {}
    ends: dict[tuple, float] = {}
    placed: list[Placed] = []
    stalls: list[Stall] = []

    order: dict[tuple, int] = {}                # each call's position in issue order
    candidates: list[tuple] = []                # calls that may have become placeable

    def placeable(key: tuple) -> bool:
        if key in ends:
            return False
        members, calls = _members(key, groups), issued[key]
        if len(calls) < len(members):          # calls holds members only: some member has not issued it
            return False
        return key[0] != "collective" or all(lane_queue[m][0] == key for m in members)

    def place(key: tuple) -> list[tuple]:
        """Place one call; return the calls its placement may make placeable (new lane heads)."""
        members, calls = _members(key, groups), issued[key]
        collective = key[0] == "collective"
        free = [max(lane_free[m], p2p_free[m]) if collective else lane_free[m] for m in members]
        start = max(max(t for _, t in calls.values()), max(free))
        end = start + max(e.modelled for e, _ in calls.values())
        enabled = []
        for member in members:
            if collective:
                lane_free[member] = end
                lane_queue[member].popleft()
                if lane_queue[member]:
                    enabled.append(lane_queue[member][0])
            else:
                p2p_free[member] = max(p2p_free[member], end)
            placed.append(Placed(calls[member][0], start, end))
        ends[key] = end
        woken(key)
        return enabled

    def place_ready() -> None:
        # passes over the candidates in issue order, as a scan of every unplaced call would
        # make them: a call enabled by a placement later in the order is placed in the same
        # pass, one earlier in the order in the next pass
        pending = sorted(set(candidates), key=order.__getitem__)
        candidates.clear()
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

    def wait(rank: int, event: TraceEvent, end: float) -> None:
        if end > cpu[rank]:
            stalls.append(Stall(rank, cpu[rank], end, event))
            cpu[rank] = end

    # Passes over the ranks in the order of their first events, each rank going on until it
    # waits on a call not yet placed. A rank that waits is visited again only once its call is
    # placed: later in the same pass when it comes after the rank whose issue placed the call,
    # in the next pass otherwise, the order a scan of every rank in every pass would visit it in.
    ranks = list(actions)
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
        queue = actions[rank]
        while queue:
            kind, event, key = queue[0]
            if kind == "issue" and key is None:
                if event.op == "compute":
                    placed.append(Placed(event, cpu[rank], cpu[rank] + event.modelled))
                    cpu[rank] += event.modelled
                else:               # a call on a group of one: its own lane only
                    start = max(cpu[rank], lane_free[rank])
                    lane_free[rank] = start + event.modelled
                    placed.append(Placed(event, start, lane_free[rank]))
                    if event.async_op:
                        alone_end[id(event)] = lane_free[rank]
                    else:
                        wait(rank, event, lane_free[rank])
                queue.popleft()
            elif kind == "issue":
                if event.op not in ("send", "recv"):
                    lane_queue[rank].append(key)
                issued.setdefault(key, {})[rank] = (event, cpu[rank])
                order.setdefault(key, len(order))
                candidates.append(key)
                queue.popleft()
                if not event.async_op:
                    queue.appendleft(("wait", event, key))
                place_ready()
            else:
                if key is None:     # an async call on a group of one
                    wait(rank, event, alone_end.pop(id(event)))
                elif key not in ends:
                    waiting.setdefault(key, []).append(visiting)
                    break
                else:
                    wait(rank, event, ends[key])
                queue.popleft()
    stuck = {rank: f"{'waits on' if q[0][0] == 'wait' else 'issues'} {q[0][1].op} step {q[0][1].step} "
                   f"group {q[0][1].group}" for rank, q in actions.items() if q}
    unplaced = [key for key in issued if key not in ends]
    if stuck or unplaced:
        raise ValueError(f"modelled_timeline: the ranks' events do not match up (each rank's next "
                         f"event: {stuck}; calls some member never issued: "
                         f"{[f'{k[1]} step {k[-1]}' for k in unplaced]}); is the trace filtered or incomplete?")
    placed.sort(key=lambda p: (p.start, p.event.rank))
    stalls.sort(key=lambda s: (s.start, s.rank))
    return Timeline(placed, stalls, _summaries(by_rank, placed, stalls, cpu, lane_free))


def _summaries(by_rank, placed, stalls, cpu, lane_free) -> dict[int, RankSummary]:
    summaries = {}
    placed_by: dict[int, list[Placed]] = {}
    for p in placed:
        placed_by.setdefault(p.event.rank, []).append(p)
    stalls_by: dict[int, list[Stall]] = {}
    for s in stalls:
        stalls_by.setdefault(s.rank, []).append(s)
    for rank in sorted(by_rank):
        mine = placed_by.get(rank, [])
        comm = [(p.start, p.end) for p in mine if p.lane == "communication" and p.end > p.start]
        waits = [(s.start, s.end) for s in stalls_by.get(rank, [])]
        exposed = _overlap(waits, comm)
        summaries[rank] = RankSummary(
            rank=rank, compute=sum(p.end - p.start for p in mine if p.lane == "compute"),
            communication=_union_length(comm), exposed=exposed,
            waiting=_union_length(waits) - exposed, end=max([cpu[rank], lane_free[rank]] + [p.end for p in mine]))
    return summaries
