"""Alpha-beta cost model of the collectives, reported the way nccl-tests reports.

``time = base latency + steps x hop latency + bytes on the busiest link / bandwidth``

for the algorithm and protocol NCCL would run, on a
:class:`~simcomm.model.topology.Topology` (presets in ``PRESETS`` of :mod:`simcomm.model.topology`):

* algorithms (:data:`ALGORITHMS`): ring or tree for all-reduce, and NVLink SHARP
  (``"nvls"``) inside an NVSwitch node that has it; ring for all-gather /
  reduce-scatter / broadcast / reduce (NCCL runs reduce and broadcast only as
  rings); direct pairwise exchange for all-to-all, gather and scatter; one hop
  for send/recv. The tree is NCCL's: a chain inside each node and a double
  binary tree across nodes, so it beats the ring only across many nodes.
* protocols (:data:`~simcomm.model.topology.PROTOCOLS`): Simple, LL, LL128, each
  with NCCL's own latency constants and bandwidth fraction; ``estimate`` picks
  the fastest, as NCCL's tuner does. Small messages run LL: a 1 KiB all-reduce
  on 8 H100s takes about 15 us, not the ~56 us of Simple.

**Sizes follow nccl-tests** (:func:`nccl_size` is the one place that knows the
convention). ``nbytes`` is the ``size`` column of the matching nccl-tests binary:

==================================  ============================================
all_reduce, broadcast, reduce,      the buffer each rank holds (in = out)
send_recv
all_gather, gather                  the whole output: world_size x per-rank input
reduce_scatter                      the whole input: world_size x per-rank output
scatter                             the root's whole input: world_size x per-rank output
all_to_all, all_to_all_single       each rank's send buffer (uneven splits: the
                                    busiest rank's, see :func:`all_to_all_single_size`)
==================================  ============================================

and ``algbw = nbytes / time``, ``busbw = algbw x busbw_factor(op, n)``. The
factor makes busbw the bandwidth of the busiest link for the ring
algorithms, so one number compares ops and world sizes.

Both levels of a multi-node topology work at once; a collective spanning
nodes runs at the slower of NVLink and the node's NICs, and each step waits
for the slowest hop. Traces: :func:`annotate` puts a modelled duration on every
event, :func:`modelled_timeline` lays a trace out on compute and communication
lanes (:mod:`simcomm.model.overlap`).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from ..ops import COST_OPS, canonical_op, cost_op
from ..specs import COST_SPECS, SPECS
from ..trace import Trace, TraceEvent
from . import overlap
from .topology import (
    CALIBRATIONS,
    CROSS_CHECKS,
    GB,
    NVLS_LATENCY,
    PRESETS,
    PROTOCOLS,
    Protocol,
    Reference,
    Topology,
    get_topology,
)

__all__ = ["Estimate", "estimate", "busbw_factor", "nccl_size", "nccl_counts", "all_to_all_single_size",
           "annotate", "modelled_timeline", "validation_table", "ALGORITHMS", "OPS", "Topology", "Reference",
           "PRESETS", "PROTOCOLS", "CALIBRATIONS", "CROSS_CHECKS", "get_topology", "GB"]

#: the algorithms each op can be modelled with (each row's ``algorithms``); ring is preferred on ties
ALGORITHMS: dict[str, tuple[str, ...]] = {name: spec.algorithms for name, spec in COST_SPECS.items()}
OPS = COST_OPS
assert set(ALGORITHMS) == set(COST_OPS), "the cost model and simcomm.ops disagree on the ops"

#: the protocols each algorithm can run (NCCL: NVLS is Simple only; p2p uses LL or Simple)
_ALGORITHM_PROTOCOLS = {"ring": ("LL", "LL128", "Simple"), "tree": ("LL", "LL128", "Simple"),
                        "nvls": ("Simple",), "direct": ("LL", "Simple"), "p2p": ("LL", "Simple")}


def _op(op: str, where: str) -> str:
    return canonical_op(op, COST_OPS + ("send", "recv"), where=where) if op not in COST_OPS else op


def busbw_factor(op: str, world_size: int) -> float:
    """nccl-tests' bus-bandwidth factor: ``busbw = algbw x factor``.

    all_reduce ``2(n-1)/n``; all_gather, reduce_scatter, all_to_all(_single),
    gather, scatter ``(n-1)/n``; broadcast, reduce, send_recv ``1``.
    """
    name = cost_op(_op(op, f"busbw_factor({op!r})"))
    n = _integer(world_size)
    if n is None or n < 1:
        raise ValueError(f"busbw_factor({op!r}): world_size must be a positive int, got {world_size!r}")
    return COST_SPECS[name].busbw(n)


def nccl_size(op: str, input_nbytes: int, world_size: int) -> int:
    """nccl-tests' ``size`` for a call where every rank's input holds ``input_nbytes``.

    For scatter, ``input_nbytes`` is the root's input (the whole buffer). The
    one place the convention is written; :func:`nccl_counts` is its inverse.
    """
    name = cost_op(_op(op, "nccl_size"))
    return input_nbytes * world_size if COST_SPECS[name].nccl_size == "output" else input_nbytes


def nccl_counts(op: str, size: int, world_size: int, itemsize: int) -> tuple[int, int]:
    """(elements in the nccl-tests ``size``, elements of one rank's input) for ``size`` bytes.

    Rounded down to whole elements per rank (at least one), as nccl-tests does;
    for scatter the input is the root's.
    """
    convention = COST_SPECS[cost_op(_op(op, "nccl_counts"))].nccl_size
    if convention != "buffer":              # the whole output or input: split over the ranks
        per_rank = max(1, size // (itemsize * world_size))
        total = per_rank * world_size
        return total, per_rank if convention == "output" else total
    count = max(1, size // itemsize)
    return count, count


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
    protocol: str = "Simple"

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
    """Bytes/s of the busiest link of a ring (or tree) laid over the placement (Simple protocol)."""
    if not place.multi_node:
        return topology.intra_bandwidth
    return min(topology.intra_bandwidth, topology.nic_share(place.per_node))


@dataclass(frozen=True)
class _Links:
    """Latencies and bandwidth fraction of one protocol on one topology."""

    base: float
    intra: float            # one step inside a node
    net: float              # one step between nodes
    fraction: float

    def hop(self, place: _Placement) -> float:
        """A step of a ring waits for its slowest hop: the network once nodes are spanned."""
        return max(self.intra, self.net) if place.multi_node else self.intra


def _links(topology: Topology, protocol: Protocol) -> _Links:
    if protocol.hop is None:    # Simple: the topology's own constants
        return _Links(topology.base_latency, topology.link_latency, topology.nic_latency, 1.0)
    return _Links(protocol.base, protocol.hop[topology.link_type], protocol.hop["net"],
                  protocol.bandwidth_fraction)


def _model(op: str, algorithm: str, nbytes: int, topology: Topology, place: _Placement,
           links: _Links) -> tuple[float, float] | None:
    """(latency, bandwidth time) of one call, or None where the algorithm cannot run."""
    n = place.world_size
    base, hop = links.base, links.hop(place)
    bw = _bus_bandwidth(topology, place) * links.fraction
    intra_bw = topology.intra_bandwidth * links.fraction
    if op == "all_reduce" and algorithm == "ring":
        # reduce-scatter then all-gather around the ring: 2(n-1) steps of nbytes/n
        return base + 2 * (n - 1) * hop, 2 * (n - 1) / n * nbytes / bw
    if op == "all_reduce" and algorithm == "tree":
        # NCCL's tree: a chain through each node's GPUs, a double binary tree across
        # nodes; up (reduce) then down (broadcast), pipelined. Every rank sends and
        # receives 2 x nbytes in all (n = 2: a single edge, nbytes).
        depth = (place.per_node - 1) * links.intra + math.ceil(math.log2(place.nodes)) * links.net
        volume = nbytes if n == 2 else 2 * nbytes
        return base + 2 * depth, volume / bw
    if op == "all_reduce" and algorithm == "nvls":
        # NVLink SHARP: each GPU writes its buffer into the switch, which reduces, and
        # reads the result back; nvls_busbw is the busbw it reaches
        if place.multi_node or topology.nvls_busbw <= 0:
            return None
        return NVLS_LATENCY, 2 * (n - 1) / n * nbytes / topology.nvls_busbw
    if op in ("all_gather", "reduce_scatter"):
        return base + (n - 1) * hop, (n - 1) / n * nbytes / bw
    if op in ("broadcast", "reduce"):
        # pipelined chain from (to) the root: every link carries the whole buffer
        return base + (n - 1) * hop, nbytes / bw
    nic = topology.nic_share(place.per_node) * links.fraction if place.multi_node else 0.0
    if op in ("all_to_all", "all_to_all_single"):
        # pairwise exchange, n-1 steps of nbytes/n each; across nodes the NICs
        # carry what leaves the node: per_node ranks x (n - per_node)/n of nbytes
        local = (n - 1) / n * nbytes / intra_bw
        if not place.multi_node:
            return base + (n - 1) * hop, local
        leaving = place.per_node * (n - place.per_node) / n * nbytes
        return base + (n - 1) * hop, max(local, leaving / nic)
    if op in ("gather", "scatter"):
        # the root receives (sends) one nbytes/n chunk per step from (to) each other
        # rank; across nodes, the chunks of the other nodes pass through its node's NICs
        local = (n - 1) / n * nbytes / intra_bw
        if not place.multi_node:
            return base + (n - 1) * hop, local
        remote = (n - place.per_node) / n * nbytes
        return base + (n - 1) * hop, max(local, remote / nic)
    if op == "send_recv":
        # every rank sends nbytes to the next and receives from the previous: one
        # hop; where the ring crosses nodes, a single flow goes through one NIC
        link = intra_bw if not place.multi_node else min(
            intra_bw, topology.nic_share(1) * links.fraction)
        return base + hop, nbytes / link
    raise AssertionError(f"no model for {op}/{algorithm}")  # ALGORITHMS and _model disagree


def estimate(op: str, nbytes: int, world_size: int, topology: str | Topology,
             algorithm: str | None = None, *, protocol: str | None = None, ranks=None) -> Estimate:
    """Modelled time, algbw and busbw of one ``op`` of ``nbytes`` on ``world_size`` ranks.

    ``nbytes`` follows nccl-tests' size convention (module docstring): the
    whole output for all_gather, the whole input for reduce_scatter, the
    per-rank buffer otherwise. ``topology`` is a :class:`Topology` or a
    preset name. ``algorithm``: one of ``ALGORITHMS[op]``; ``protocol``: one
    of ``"Simple"``, ``"LL"``, ``"LL128"``; ``None`` picks the fastest (ring
    and the earlier protocol win ties). ``ranks``: the GPUs the ranks run on
    (global indices); by default ranks are packed onto the first nodes.
    """
    name = cost_op(_op(op, f"estimate({op!r})"))
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
    if protocol is not None and protocol not in PROTOCOLS:
        raise ValueError(f"estimate({op!r}): protocol={protocol!r}; choose from {list(PROTOCOLS)}")
    best: Estimate | None = None
    for algo in ([algorithm] if algorithm is not None else allowed):
        for proto in _ALGORITHM_PROTOCOLS[algo]:
            if (protocol is not None and proto != protocol) or topology.link_type not in PROTOCOLS[proto].links:
                continue
            modelled = _model(name, algo, nbytes, topology, place, _links(topology, PROTOCOLS[proto]))
            if modelled is None:
                continue
            latency, transfer = modelled
            time = latency + transfer
            algbw = nbytes / time
            result = Estimate(op=name, nbytes=nbytes, world_size=world_size, algorithm=algo,
                              time=time, latency=latency, algbw=algbw,
                              busbw=algbw * busbw_factor(name, world_size), nodes=place.nodes,
                              protocol=proto)
            if best is None or result.time < best.time:
                best = result
    if best is None:
        raise ValueError(f"estimate({op!r}): algorithm={algorithm!r} with protocol={protocol!r} cannot run "
                         f"on topology {topology.name!r} with ranks on {place.nodes} node(s)")
    return best


def validation_table() -> list[dict]:
    """Each preset against its cited figures: the model's busbw and the relative error.

    ``kind`` is ``"calibration"`` for the figures a preset's parameters were
    set from (its ``reference`` and :data:`CALIBRATIONS`), ``"cross-check"`` for
    the held-out figures of :data:`CROSS_CHECKS`.
    """
    checks = [(name, t.reference, "calibration") for name, t in PRESETS.items() if t.reference]
    checks += [(name, ref, "calibration") for name, ref in CALIBRATIONS]
    checks += [(name, ref, "cross-check") for name, ref in CROSS_CHECKS]
    rows = []
    for name, ref, kind in checks:
        result = estimate(ref.op, ref.nbytes, ref.world_size, PRESETS[name], ref.algorithm, ranks=ref.ranks)
        rows.append({
            "preset": name, "kind": kind, "op": ref.op, "world_size": ref.world_size, "nbytes": ref.nbytes,
            "cited_busbw_GBps": ref.busbw / GB, "model_busbw_GBps": result.busbw / GB,
            "model_time_us": result.time * 1e6, "error": result.busbw / ref.busbw - 1,
            "algorithm": result.algorithm, "protocol": result.protocol, "source": ref.url, "figure": ref.figure,
        })
    return rows


# ---------------------------------------------------------------------------------------------
# traces


_A2AV = SPECS["all_to_all_single"]


def all_to_all_single_size(events: list[TraceEvent]) -> int:
    """The nccl-tests size an uneven ``all_to_all_single`` call counts as: the busiest rank's.

    ``events``: the call's events (one per rank; fewer if the trace is
    filtered). Rank ``i`` sends ``input_split_sizes[j]`` rows to group rank
    ``j`` and receives ``output_split_sizes[j]`` from it (``None``: even
    splits); a row is the rank's input bytes over its rows. The call lasts as
    long as its busiest rank needs to send or receive what leaves it, ``b``
    bytes; an even exchange of size ``s`` moves ``(n-1)/n x s`` per rank, so
    the size is ``b x n / (n-1)``.
    """
    busiest = 0.0
    n = len(events[0].group)
    for event in events:
        rows = event.shape[0] if event.shape else 0
        row_bytes = event.nbytes / rows if rows else 0.0
        me = event.group.index(event.rank)
        splits = {"input_split_sizes": _splits(event, "input_split_sizes", rows, n),
                  "output_split_sizes": _splits(event, "output_split_sizes", rows, n)}
        # the bytes per peer of the trace's rule (group-local ranks), with even splits filled in
        sent, received = _A2AV.peer_bytes(event.nbytes, range(n), me, args=splits, row_bytes=row_bytes)
        leaving = sum(sent.values())
        arriving = sum(received.values())
        busiest = max(busiest, leaving, arriving)
    return round(busiest * n / (n - 1)) if n > 1 else 0


def _splits(event: TraceEvent, name: str, rows: int, n: int) -> list[int]:
    splits = event.args.get(name)
    if splits is None:
        return [rows // n] * n
    splits = list(splits)
    if len(splits) != n:
        raise ValueError(f"annotate: all_to_all_single of rank {event.rank} (step {event.step}) has "
                         f"{name}={splits}, {len(splits)} entries for a group of {n}")
    return splits


#: the ops whose nccl-tests size depends on all the events of the call (:func:`_call_size`)
_WHOLE_CALL = ("all_to_all_single", "scatter")


def _call_size(event: TraceEvent, call: list[TraceEvent]) -> int:
    """An event's call in nccl-tests' size convention (the trace records each rank's input)."""
    n = len(event.group)
    if event.op == "all_to_all_single":
        return all_to_all_single_size(call)
    if event.op == "scatter":
        root = [e for e in call if e.rank == e.root]
        if root:
            return root[0].nbytes
        chunk = max(e.nbytes for e in call)
        return chunk * n                     # no root event: the ranks' chunks
    return nccl_size(event.op, event.nbytes, n)


def _event_duration(event: TraceEvent, call: list[TraceEvent], topology: Topology) -> float:
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
    return estimate(op, _call_size(event, call), len(event.group), topology, ranks=event.group).time


def annotate(trace: Trace, topology: str | Topology) -> Trace:
    """Fill every event's ``modelled`` duration (seconds) for ``topology``; returns ``trace``.

    Collectives are estimated with the event's op, bytes and group (its
    global ranks are the GPUs it runs on; an uneven ``all_to_all_single`` by
    its busiest rank, :func:`all_to_all_single_size`); ``send``/``recv``
    (blocking or not) as one point-to-point hop; ``compute`` events from their
    declared ``seconds``, or ``flops / topology.compute_flops``; ``subgroup``
    as 0. The events themselves are kept and modified in place.
    """
    topology = get_topology(topology)
    events = trace.events
    groups = overlap.GroupIndex()       # a call's key by group number: no hash of a long tuple per event
    # the size of an all_to_all_single or scatter call depends on all its events: gathered first
    calls: dict[tuple, list[TraceEvent]] = {}
    for event in events:
        if event.op in _WHOLE_CALL:
            calls.setdefault((event.op, groups(event.group), event.step), []).append(event)
    # a collective's estimate depends on its op, group and call size only: computed once per
    # op, group and input size (per call for the two above), not once per member (placing a
    # group on the topology costs O(group size))
    shared: dict[tuple, float] = {}
    hops: dict[tuple, float] = {}       # a send's or recv's estimate: its bytes, and whether the peers share a node
    node_of, max_ranks = topology.node_of, topology.max_ranks
    for event in events:
        op = event.op
        if op == "compute":
            event.modelled = _event_duration(event, [event], topology)
            continue
        if op == "send" or op == "recv":
            rank = event.rank
            peer = event.root if event.root is not None else rank
            memo = (event.nbytes, None if peer == rank else node_of(rank) == node_of(peer))
            inside = 0 <= rank < max_ranks and 0 <= peer < max_ranks
            modelled = hops.get(memo) if inside else None      # (a GPU outside: the estimate's error)
            if modelled is None:
                modelled = hops[memo] = _event_duration(event, [event], topology)
            event.modelled = modelled
            continue
        number = groups(event.group)
        whole = op in _WHOLE_CALL
        memo = (op, number, event.step, event.nbytes) if whole else (op, number, event.nbytes)
        modelled = shared.get(memo)
        if modelled is None:
            modelled = shared[memo] = _event_duration(event, calls[memo[:3]] if whole else [event], topology)
        event.modelled = modelled
    return trace


def modelled_timeline(trace: Trace, preset: str | Topology | None = None) -> overlap.Timeline:
    """Lay a trace out in modelled time, communication on its own lane per rank.

    ``preset``: annotate the trace for this topology first (:func:`annotate`);
    ``None``: the events must be annotated already. See
    :func:`simcomm.model.overlap.layout` for the rules (blocking and async calls,
    waits, exposed vs hidden communication). Iterating the result gives
    ``(event, start, end)`` for every event.
    """
    if preset is not None:
        annotate(trace, preset)
    return overlap.layout(trace)
