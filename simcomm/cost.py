"""Alpha-beta cost model of the collectives, reported the way nccl-tests reports.

``time = base latency + steps x hop latency + bytes on the busiest link / bandwidth``

for the algorithm NCCL would run (ring or tree for all-reduce, ring for
all-gather / reduce-scatter / broadcast / reduce, direct pairwise exchange for
all-to-all and gather, one hop for send/recv), on a
:class:`~simcomm.topology.Topology` (presets in :data:`PRESETS`).

**Sizes follow nccl-tests.** ``nbytes`` is the ``size`` column of the matching
nccl-tests binary:

==================================  ============================================
all_reduce, broadcast, reduce,      the buffer each rank holds (in = out)
send_recv
all_gather, gather                  the whole output: world_size x per-rank input
reduce_scatter                      the whole input: world_size x per-rank output
all_to_all                          each rank's send buffer (= its receive buffer)
==================================  ============================================

and ``algbw = nbytes / time``, ``busbw = algbw x busbw_factor(op, n)``. The
factor makes busbw the bandwidth of the busiest link for the ring
algorithms, so one number compares ops and world sizes.

Both levels of a multi-node topology work at once; a collective spanning
nodes runs at the slower of NVLink and the node's NICs, and each step waits
for the slowest hop.
"""
from __future__ import annotations

import math
import operator
from collections import deque
from dataclasses import dataclass

from .topology import CROSS_CHECKS, GB, PRESETS, Reference, Topology, get_topology, validation_table
from .trace import Trace, TraceEvent

__all__ = ["Estimate", "estimate", "busbw_factor", "annotate", "modelled_timeline", "ALGORITHMS", "OPS",
           "Topology", "Reference", "PRESETS", "CROSS_CHECKS", "get_topology", "validation_table", "GB"]

#: the algorithms each op can be modelled with; the first is the default when only one applies
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("ring", "tree"),
    "all_gather": ("ring",),
    "reduce_scatter": ("ring",),
    "all_to_all": ("direct",),
    "broadcast": ("ring",),
    "reduce": ("ring",),
    "gather": ("direct",),
    "send_recv": ("p2p",),
}
OPS = tuple(ALGORITHMS)
_ALIASES = {"send": "send_recv", "recv": "send_recv", "sendrecv": "send_recv",
            "alltoall": "all_to_all", "allreduce": "all_reduce", "allgather": "all_gather",
            "reducescatter": "reduce_scatter"}


def _canonical(op: str) -> str:
    name = _ALIASES.get(op, op)
    if name not in ALGORITHMS:
        raise ValueError(f"cost model: unknown op {op!r}; known ops: {list(OPS)} "
                         f"(and aliases {sorted(_ALIASES)})")
    return name


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: ``busbw = algbw x factor``.

    all_reduce ``2(n-1)/n``; all_gather, reduce_scatter, all_to_all, gather
    ``(n-1)/n``; broadcast, reduce, send_recv ``1``.
    """
    name = _canonical(op)
    n = _integer(world_size)
    if n is None or n < 1:
        raise ValueError(f"busbw_factor({op!r}): world_size must be a positive int, got {world_size!r}")
    if name == "all_reduce":
        return 2 * (n - 1) / n
    if name in ("all_gather", "reduce_scatter", "all_to_all", "gather"):
        return (n - 1) / n
    return 1.0


@dataclass(frozen=True)
class Estimate:
    """The model's answer for one collective call (times in seconds, bandwidths in bytes/s)."""

    op: str
    nbytes: int
    world_size: int
    algorithm: str
    time: float
    latency: float          # the part of ``time`` that does not depend on nbytes
    algbw: float
    busbw: float
    nodes: int              # nodes the ranks span

    @property
    def bandwidth_time(self) -> float:
        """The part of ``time`` spent moving bytes."""
        return self.time - self.latency


@dataclass(frozen=True)
class _Placement:
    world_size: int
    nodes: int              # nodes spanned
    per_node: int           # most ranks on one node

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


def _integer(value) -> int | None:
    """``value`` as an int when it is an integer (numpy ints included, bools not), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _placement(op: str, world_size: int, topology: Topology, ranks) -> _Placement:
    checked = _integer(world_size)
    if checked is None or checked < 2:
        raise ValueError(f"estimate({op!r}): world_size must be an int >= 2 (one rank "
                         f"communicates with nobody), got {world_size!r}")
    world_size = checked
    if ranks is None:
        if world_size > topology.max_ranks:
            raise ValueError(f"estimate({op!r}): world_size={world_size} exceeds the "
                             f"{topology.max_ranks} GPUs of topology {topology.name!r}")
        ranks = range(world_size)
    ranks = tuple(ranks)
    if len(ranks) != world_size or len(set(ranks)) != world_size:
        raise ValueError(f"estimate({op!r}): ranks={ranks} must be {world_size} distinct GPU indices")
    bad = [r for r in ranks if not 0 <= r < topology.max_ranks]
    if bad:
        raise ValueError(f"estimate({op!r}): ranks {bad} are outside the "
                         f"{topology.max_ranks} GPUs of topology {topology.name!r}")
    counts: dict[int, int] = {}
    for r in ranks:
        counts[topology.node_of(r)] = counts.get(topology.node_of(r), 0) + 1
    return _Placement(world_size, len(counts), max(counts.values()))


def _bus_bandwidth(topology: Topology, place: _Placement) -> float:
    """Bytes/s of the busiest link of a ring (or tree) laid over the placement."""
    if not place.multi_node:
        return topology.intra_bandwidth
    return min(topology.intra_bandwidth, topology.nic_share(place.per_node))


def _hop_latency(topology: Topology, place: _Placement) -> float:
    """A step of a ring waits for its slowest hop: the network once nodes are spanned."""
    return max(topology.link_latency, topology.nic_latency) if place.multi_node else topology.link_latency


def _model(op: str, algorithm: str, nbytes: int, topology: Topology, place: _Placement
           ) -> tuple[float, float]:
    """(latency, bandwidth time) of one call."""
    n = place.world_size
    base = topology.base_latency
    hop = _hop_latency(topology, place)
    bw = _bus_bandwidth(topology, place)
    if op == "all_reduce" and algorithm == "ring":
        # reduce-scatter then all-gather around the ring: 2(n-1) steps of nbytes/n
        return base + 2 * (n - 1) * hop, 2 * (n - 1) / n * nbytes / bw
    if op == "all_reduce" and algorithm == "tree":
        # double binary tree, pipelined: up (reduce) then down (broadcast). Every
        # rank is inner node of one tree, leaf of the other, so it sends and
        # receives 2 x nbytes in all (n = 2: a single edge, nbytes).
        depth = (math.ceil(math.log2(place.nodes)) * max(topology.link_latency, topology.nic_latency)
                 + math.ceil(math.log2(place.per_node)) * topology.link_latency)
        volume = nbytes if n == 2 else 2 * nbytes
        return base + 2 * depth, volume / bw
    if op in ("all_gather", "reduce_scatter"):
        return base + (n - 1) * hop, (n - 1) / n * nbytes / bw
    if op in ("broadcast", "reduce"):
        # pipelined chain from (to) the root: every link carries the whole buffer
        return base + (n - 1) * hop, nbytes / bw
    if op == "all_to_all":
        # pairwise exchange, n-1 steps of nbytes/n each; across nodes the NICs
        # carry what leaves the node: per_node ranks x (n - per_node)/n of nbytes
        local = (n - 1) / n * nbytes / topology.intra_bandwidth
        if not place.multi_node:
            return base + (n - 1) * hop, local
        leaving = place.per_node * (n - place.per_node) / n * nbytes
        return base + (n - 1) * hop, max(local, leaving / topology.nic_share(place.per_node))
    if op == "gather":
        # the root receives one nbytes/n chunk per step from each other rank;
        # across nodes, the chunks of the other nodes come in through its node's NICs
        local = (n - 1) / n * nbytes / topology.intra_bandwidth
        if not place.multi_node:
            return base + (n - 1) * hop, local
        arriving = (n - place.per_node) / n * nbytes
        return base + (n - 1) * hop, max(local, arriving / topology.nic_share(place.per_node))
    if op == "send_recv":
        # every rank sends nbytes to the next and receives from the previous: one
        # hop; where the ring crosses nodes, a single flow goes through one NIC
        link = topology.intra_bandwidth if not place.multi_node else min(
            topology.intra_bandwidth, topology.nic_share(1))
        return base + hop, nbytes / link
    raise AssertionError(f"no model for {op}/{algorithm}")  # ALGORITHMS and _model disagree


def estimate(op: str, nbytes: int, world_size: int, topology: str | Topology,
             algorithm: str | None = None, *, ranks=None) -> Estimate:
    """Modelled time, algbw and busbw of one ``op`` of ``nbytes`` on ``world_size`` ranks.

    ``nbytes`` follows nccl-tests' size convention (module docstring): the
    whole output for all_gather, the whole input for reduce_scatter, the
    per-rank buffer otherwise. ``topology`` is a :class:`Topology` or a
    preset name. ``algorithm``: one of ``ALGORITHMS[op]``; ``None`` picks the
    fastest (ring wins ties). ``ranks``: the GPUs the ranks run on (global
    indices); by default ranks are packed onto the first nodes.
    """
    name = _canonical(op)
    topology = get_topology(topology)
    checked = _integer(nbytes)
    if checked is None or checked < 0:
        raise ValueError(f"estimate({op!r}): nbytes must be an int >= 0, got {nbytes!r}")
    nbytes = checked
    place = _placement(op, world_size, topology, ranks)
    world_size = place.world_size
    allowed = ALGORITHMS[name]
    if algorithm is not None and algorithm not in allowed:
        raise ValueError(f"estimate({op!r}): algorithm={algorithm!r} is not modelled for "
                         f"{name}; choose from {list(allowed)}")
    best: Estimate | None = None
    for algo in ([algorithm] if algorithm is not None else allowed):
        latency, transfer = _model(name, algo, nbytes, topology, place)
        time = latency + transfer
        algbw = nbytes / time
        result = Estimate(op=name, nbytes=nbytes, world_size=world_size, algorithm=algo,
                          time=time, latency=latency, algbw=algbw,
                          busbw=algbw * busbw_factor(name, world_size), nodes=place.nodes)
        if best is None or result.time < best.time:
            best = result
    return best


# ---------------------------------------------------------------------------------------------
# traces


def _nccl_size(event: TraceEvent) -> int:
    """An event's bytes in nccl-tests' convention (the trace records the rank's input)."""
    if event.op in ("all_gather", "gather"):
        return event.nbytes * len(event.group)
    return event.nbytes


def _event_duration(event: TraceEvent, topology: Topology) -> float:
    op = event.op
    if op == "compute":
        seconds, flops = event.args.get("seconds"), event.args.get("flops")
        if seconds is not None:
            return float(seconds)
        if flops is None:
            raise ValueError(f"annotate: compute event of rank {event.rank} has neither seconds nor flops")
        if topology.compute_flops <= 0:
            raise ValueError(f"annotate: compute event of rank {event.rank} declares flops={flops} "
                             f"but topology {topology.name!r} has compute_flops="
                             f"{topology.compute_flops}")
        return float(flops) / topology.compute_flops
    if op == "subgroup":
        return 0.0          # sets up communicators; no data moves
    if op in ("send", "recv"):
        # one hop between this rank and its peer, on the GPUs they run on
        peer = event.root if event.root is not None else event.rank
        return estimate("send_recv", event.nbytes, 2, topology, ranks=(event.rank, peer)
                        if peer != event.rank else None).time
    if len(event.group) < 2:
        return 0.0          # a group of one communicates with nobody
    if op == "barrier":
        return estimate("all_reduce", 0, len(event.group), topology, ranks=event.group).time
    return estimate(op, _nccl_size(event), len(event.group), topology,
                    ranks=event.group).time


def annotate(trace: Trace, topology: str | Topology) -> Trace:
    """Fill every event's ``modelled`` duration (seconds) for ``topology``; returns ``trace``.

    Collectives are estimated with the event's op, bytes and group (its
    global ranks are the GPUs it runs on); ``send``/``recv`` as one
    point-to-point hop; ``compute`` events from their declared ``seconds``, or
    ``flops / topology.compute_flops``; ``subgroup`` as 0. The events
    themselves are kept and modified in place.
    """
    topology = get_topology(topology)
    for event in trace.events:
        event.modelled = _event_duration(event, topology)
    return trace


def _matches(event: TraceEvent, other: TraceEvent) -> bool:
    """Is ``other`` (at the head of another rank's queue) the same call as ``event``?"""
    if event.op in ("send", "recv"):
        partner = "recv" if event.op == "send" else "send"
        return (other.op == partner and other.root == event.rank and other.rank == event.root
                and other.group == event.group and other.step == event.step)
    return other.op == event.op and other.group == event.group and other.step == event.step


def modelled_timeline(trace: Trace) -> list[tuple[TraceEvent, float, float]]:
    """Lay an annotated trace out in modelled time: ``(event, start, end)`` in seconds.

    Each rank runs its events in order. A collective starts when the last
    member of its group reaches it and all members leave together; a send
    and its recv start when both ranks have reached them (both block). Compute
    events and calls on one-rank groups only advance their own rank. Raises
    ``ValueError`` when an event is not annotated (:func:`annotate` first) or
    its partners are missing from the trace.
    """
    queues: dict[int, deque[TraceEvent]] = {}
    for event in trace.events:
        if event.modelled is None:
            raise ValueError(f"modelled_timeline: {event.op} of rank {event.rank} (step {event.step}) "
                             f"has no modelled duration; call simcomm.cost.annotate(trace, topology) first")
        queues.setdefault(event.rank, deque()).append(event)
    clock = dict.fromkeys(queues, 0.0)
    placed: list[tuple[TraceEvent, float, float]] = []
    while any(queues.values()):
        progressed = False
        for rank, queue in queues.items():
            while queue:
                event = queue[0]
                if event.op in ("send", "recv"):
                    members = [event.rank, event.root]
                elif event.op == "compute" or len(event.group) < 2:
                    members = [event.rank]
                else:
                    members = list(event.group)
                heads = [queues.get(m) for m in members]
                if not all(q and (q[0] is event or _matches(event, q[0])) for q in heads):
                    break
                calls = [q.popleft() for q in heads]
                start = max(clock[m] for m in members)
                end = start + max(call.modelled for call in calls)
                for member, call in zip(members, calls):
                    clock[member] = end
                    placed.append((call, start, end))
                progressed = True
        if not progressed:
            stuck = {rank: f"{q[0].op} step {q[0].step} group {q[0].group}" for rank, q in queues.items() if q}
            raise ValueError(f"modelled_timeline: the ranks' events do not match up (each rank's next "
                             f"event: {stuck}); is the trace filtered or incomplete?")
    placed.sort(key=lambda item: (item[1], item[0].rank))
    return placed
