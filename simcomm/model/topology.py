"""Hardware the cost model runs on: :class:`Topology`, NCCL's protocols, and cited presets.

This module is data: the cost model that reads it is :mod:`simcomm.model.cost`.

A topology is two levels of links:

* inside a node, every GPU has ``link_bandwidth`` bytes/s per direction to a
  switch (NVSwitch) or bus (PCIe): full bisection, so any pattern of
  point-to-point flows runs at that rate per GPU;
* between nodes, each node has ``nics_per_node`` NICs of ``nic_bandwidth``
  bytes/s per direction each.

Line rates come from datasheets; the ``*_efficiency`` fields are the fraction
of line rate NCCL's Simple protocol reaches (headers, flags, 128-byte stores
from the SMs).

**Protocols.** NCCL moves data with one of three protocols (:data:`PROTOCOLS`)
and picks, per call, the one its model predicts fastest: *Simple* (large
chunks and memory fences: full bandwidth, the highest latency), *LL*
(low-latency: 8-byte stores of 4 data bytes and a 4-byte flag, so no fence but
half the bandwidth) and *LL128* (128-byte lines with 8 flag bytes, NVLink
only: 92% of the bandwidth, latency in between). Their latencies are NCCL's
own tuning constants (``src/graph/tuning.cc``): the Simple ones are the
presets' ``base_latency`` / ``link_latency`` / ``nic_latency`` fields (base
8.4 us; NVLink 3.4 us, PCIe 5.7 us, network 9.6 us per hop, from
:data:`NCCL_TUNING_OLD`); LL and LL128 from the current table
(:data:`NCCL_TUNING`). Bandwidth fractions: LL 0.5, LL128 0.92 (same file,
"model refinements"). NCCL also caps LL/LL128 bandwidth per GPU generation;
that cap is not modelled.

**NVLink SHARP (NVLS).** On NVSwitch nodes of the Hopper generation the switch
itself reduces: an all-reduce is one write of every GPU's buffer into the
switch and one read of the result (multimem instructions), so its busbw is
above the link rate the ring reaches. A preset with ``nvls_busbw > 0`` offers
algorithm ``"nvls"`` for all-reduces inside one node: ``nvls_busbw`` is the
peak busbw NCCL reports for it, with a fixed latency of
:data:`NVLS_LATENCY` (NCCL's NVLS hardware latency on NVLink, 25 us).

Every preset carries a :class:`Reference`: the published nccl-tests figure its
efficiencies were set from, which it must reproduce within 20%.
:data:`CALIBRATIONS` holds further figures a parameter was set from (NVLS),
:data:`CROSS_CHECKS` published figures no parameter was set from, that the
presets must also meet within 20% (``tests/planning/test_model_cost.py``;
:func:`simcomm.model.cost.validation_table` lists them all).
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Reference", "Topology", "Protocol", "PROTOCOLS", "PRESETS", "CALIBRATIONS", "CROSS_CHECKS",
           "NVLS_LATENCY", "get_topology", "GB"]

GB = 1e9  # nccl-tests reports GB/s with GB = 1e9 bytes

#: NCCL's tuning table as of NCCL 2.8 (ring/Simple constants of the presets' latency fields)
NCCL_TUNING_OLD = ("https://github.com/NVIDIA/nccl/blob/01afd20a77b5804e0ecf1042509dd9d20ebf9e93/"
                   "src/graph/tuning.cc")
#: NCCL's current tuning table (``ncclTunerConstantsDefaults``: LL, LL128 and NVLS constants)
NCCL_TUNING = "https://github.com/NVIDIA/nccl/blob/v2.28.3-1/src/graph/tuning.cc"

# NCCL_TUNING_OLD, ring algorithm, Simple protocol (seconds)
_BASE_LATENCY = 8.4e-6
_NVLINK_HOP = 3.4e-6
_PCIE_HOP = 5.7e-6
_NET_HOP = 9.6e-6

#: NCCL's NVLS hardware latency on NVLink (NCCL_TUNING, NVLS/Simple), seconds
NVLS_LATENCY = 25e-6


@dataclass(frozen=True)
class Protocol:
    """One of NCCL's protocols: its latencies (seconds) and the fraction of bandwidth it reaches.

    ``hop`` maps a link type (``"nvlink"``, ``"pcie"``, ``"net"``) to the
    latency of one step over it; ``None`` for a protocol whose latencies are
    the topology's own fields (Simple). ``links``: the intra-node link types
    it runs on.
    """

    name: str
    base: float | None
    hop: dict[str, float] | None
    bandwidth_fraction: float
    links: tuple[str, ...] = ("nvlink", "pcie")


#: NCCL's protocols (module docstring); latencies in seconds from NCCL_TUNING (ring row)
PROTOCOLS: dict[str, Protocol] = {
    "Simple": Protocol("Simple", base=None, hop=None, bandwidth_fraction=1.0),
    "LL": Protocol("LL", base=6.6e-6, hop={"nvlink": 0.6e-6, "pcie": 1.0e-6, "net": 2.7e-6},
                   bandwidth_fraction=0.5),
    "LL128": Protocol("LL128", base=14.0e-6, hop={"nvlink": 1.9e-6, "pcie": 2.5e-6, "net": 4.0e-6},
                      bandwidth_fraction=0.92, links=("nvlink",)),
}


@dataclass(frozen=True)
class Reference:
    """A published measurement a preset must reproduce (within 20%).

    ``nbytes`` follows the nccl-tests size convention of ``op`` (see
    :func:`simcomm.model.cost.estimate`); ``ranks`` places the ranks on the
    topology's GPUs (global GPU indices, node ``i`` holding GPUs
    ``i * gpus_per_node ...``); ``None`` packs them onto the first nodes.
    """

    op: str
    world_size: int
    nbytes: int
    busbw: float            # bytes/s
    url: str
    figure: str             # the quoted figure, in words
    ranks: tuple[int, ...] | None = None
    algorithm: str | None = None    # as run (e.g. NCCL_ALGO=RING); None: the model's fastest


@dataclass(frozen=True)
class Topology:
    """Two-level hardware description for the alpha-beta model.

    Bandwidths are bytes/s per direction, latencies seconds; ``compute_flops``
    is the dense BF16 peak of one GPU (flop/s), used to turn
    ``comm.compute(flops=...)`` into seconds. ``link_type``: ``"nvlink"`` or
    ``"pcie"``, which of NCCL's per-protocol latencies apply inside a node.
    ``nvls_busbw``: peak all-reduce busbw of NVLink SHARP (0: no NVLS).
    """

    name: str
    gpus_per_node: int
    nodes: int
    link_bandwidth: float
    link_efficiency: float
    link_latency: float
    nics_per_node: int = 0
    nic_bandwidth: float = 0.0
    nic_efficiency: float = 1.0
    nic_latency: float = _NET_HOP
    base_latency: float = _BASE_LATENCY
    compute_flops: float = 0.0
    link_type: str = "nvlink"
    nvls_busbw: float = 0.0
    reference: Reference | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Topology {self.name!r}: {name} must be a positive int, got {value!r}")
        for name in ("link_bandwidth", "link_efficiency", "nic_efficiency"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"Topology {self.name!r}: {name} must be > 0, got {value!r}")
        for name in ("link_efficiency", "nic_efficiency"):
            if getattr(self, name) > 1:
                raise ValueError(f"Topology {self.name!r}: {name} is a fraction of line rate, "
                                 f"got {getattr(self, name)!r}")
        if self.link_type not in ("nvlink", "pcie"):
            raise ValueError(f"Topology {self.name!r}: link_type must be 'nvlink' or 'pcie', got {self.link_type!r}")
        for name in ("link_latency", "nic_latency", "base_latency", "compute_flops", "nic_bandwidth",
                     "nvls_busbw"):
            value = getattr(self, name)
            if value < 0:
                raise ValueError(f"Topology {self.name!r}: {name} must be >= 0, got {value!r}")
        if self.nodes > 1 and (self.nics_per_node < 1 or self.nic_bandwidth <= 0):
            raise ValueError(f"Topology {self.name!r}: {self.nodes} nodes need nics_per_node >= 1 "
                             f"and nic_bandwidth > 0, got {self.nics_per_node} and {self.nic_bandwidth}")

    @property
    def max_ranks(self) -> int:
        """How many GPUs the topology has: one rank per GPU."""
        return self.gpus_per_node * self.nodes

    @property
    def intra_bandwidth(self) -> float:
        """Effective bytes/s per GPU per direction inside a node (line rate x efficiency)."""
        return self.link_bandwidth * self.link_efficiency

    def nic_share(self, ranks_on_node: int) -> float:
        """Effective bytes/s out of one node when ``ranks_on_node`` of its GPUs take part.

        NCCL runs one ring channel per NIC and each GPU drives its nearest
        NIC, so a node uses ``min(nics_per_node, ranks_on_node)`` NICs.
        """
        return min(self.nics_per_node, ranks_on_node) * self.nic_bandwidth * self.nic_efficiency

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node


PRESETS: dict[str, Topology] = {}


def _preset(topology: Topology) -> Topology:
    PRESETS[topology.name] = topology
    return topology


H100_NVSWITCH = _preset(Topology(
    name="h100-nvswitch",
    gpus_per_node=8, nodes=1,
    link_bandwidth=450 * GB, link_efficiency=0.82, link_latency=_NVLINK_HOP,
    compute_flops=989e12, nvls_busbw=480 * GB,
    reference=Reference(
        op="all_reduce", world_size=8, nbytes=8 << 30, busbw=370 * GB, algorithm="ring",
        url="https://github.com/NVIDIA/nccl-tests/issues/212",
        figure="8x H100 NVSwitch, NCCL_ALGO=RING: busbw ~370 GB/s at large sizes "
               "(NCCL maintainer: 450 GB/s line rate less ~20% protocol overhead)"),
))
"""8-GPU NVSwitch node of H100/H200 class (HGX/DGX H100, H200: same NVLink 4).

* Line rate: 18 NVLink 4 links x 25 GB/s = 450 GB/s per direction per GPU
  (NVIDIA H100 datasheet: "NVLink: 900GB/s" bidirectional),
  https://www.nvidia.com/en-us/data-center/h100/
* Efficiency 0.82: ring busbw ~370 GB/s, NVIDIA/nccl-tests#212 (comment by
  the NCCL maintainer), https://github.com/NVIDIA/nccl-tests/issues/212
* ``compute_flops``: 989 TFLOPS dense BF16 (H100 SXM datasheet).

* ``nvls_busbw`` 480 GB/s: NVLink SHARP all-reduce, "peak busBw of ~480GB/s
  (algbw ~275GB/s)" on 8 GPUs (NCCL maintainer, same thread;
  :data:`CALIBRATIONS`). It is NCCL's default all-reduce there at large sizes,
  above the 370 GB/s the ring reaches: the switch does the reduction.
"""

A100_NVSWITCH = _preset(Topology(
    name="a100-nvswitch",
    gpus_per_node=8, nodes=1,
    link_bandwidth=300 * GB, link_efficiency=0.77, link_latency=_NVLINK_HOP,
    compute_flops=312e12,
    reference=Reference(
        op="all_reduce", world_size=8, nbytes=8 << 30, busbw=230 * GB,
        url="https://github.com/NVIDIA/nccl-tests/issues/149",
        figure="8x A100 SXM4 NVSwitch: all_reduce busbw ~230 GB/s at 8 GB "
               "(NCCL maintainer: 12 links x ~20 GB/s effective, other limits bring it to ~230)"),
))
"""8-GPU A100 NVSwitch node (DGX/HGX A100).

* Line rate: 12 NVLink 3 links x 25 GB/s = 300 GB/s per direction per GPU
  (A100 datasheet: "NVLink: 600GB/s" bidirectional),
  https://www.nvidia.com/en-us/data-center/a100/
* Efficiency 0.77: all-reduce busbw ~230 GB/s, NVIDIA/nccl-tests#149,
  https://github.com/NVIDIA/nccl-tests/issues/149
* ``compute_flops``: 312 TFLOPS dense BF16 (A100 datasheet).
"""

PCIE_2GPU = _preset(Topology(
    name="pcie-2gpu",
    gpus_per_node=2, nodes=1,
    link_bandwidth=31.5 * GB, link_efficiency=0.70, link_latency=_PCIE_HOP,
    compute_flops=362e12, link_type="pcie",
    reference=Reference(
        op="all_reduce", world_size=2, nbytes=1 << 30, busbw=22 * GB,
        url="https://github.com/NVIDIA/nccl/issues/1202",
        figure="L40S GPUs under one PCIe Gen4 switch, single node: all_reduce busbw "
               "constant at 22 GB/s whatever the GPU count"),
))
"""Two GPUs on PCIe Gen4 x16 behind one switch (no NVLink), e.g. 2x L40S.

* Line rate: 16 GT/s x 16 lanes x 128/130 = 31.5 GB/s per direction
  (PCI-SIG PCIe 4.0).
* Efficiency 0.70: all-reduce busbw 22 GB/s, NVIDIA/nccl#1202,
  https://github.com/NVIDIA/nccl/issues/1202
* ``compute_flops``: 362 TFLOPS dense BF16 (NVIDIA L40S datasheet).
"""

A100_HDR_CLUSTER = _preset(Topology(
    name="a100-hdr-cluster",
    gpus_per_node=8, nodes=16,
    link_bandwidth=300 * GB, link_efficiency=0.77, link_latency=_NVLINK_HOP,
    nics_per_node=4, nic_bandwidth=25 * GB, nic_efficiency=0.92, nic_latency=_NET_HOP,
    compute_flops=312e12,
    reference=Reference(
        op="all_reduce", world_size=16, nbytes=8 << 30, busbw=91 * GB,
        url="https://github.com/NVIDIA/nccl-tests/issues/100",
        figure="2 HGX A100 nodes (16 GPUs), 4x ConnectX-6 HDR 200 Gb/s per node: "
               "all_reduce busbw 91 GB/s at 1-8 GB"),
))
"""Multi-node InfiniBand cluster of A100 nodes: NVLink inside, 4 HDR NICs per node.

A collective spanning nodes is limited by the slower level: 4 NICs x 25 GB/s
x 0.92 = 92 GB/s out of a node against 231 GB/s of NVLink.

* NIC line rate: HDR InfiniBand 200 Gb/s = 25 GB/s per direction.
* Efficiency 0.92: all-reduce busbw 91 GB/s on 2 nodes, NVIDIA/nccl-tests#100,
  https://github.com/NVIDIA/nccl-tests/issues/100 (also nccl-tests#119: 3 such
  nodes, 96 GB/s peak against 100 GB/s theoretical).
* Intra-node figures as :data:`A100_NVSWITCH`.
"""

H100_NDR_CLUSTER = _preset(Topology(
    name="h100-ndr-cluster",
    gpus_per_node=8, nodes=16,
    link_bandwidth=450 * GB, link_efficiency=0.82, link_latency=_NVLINK_HOP,
    nics_per_node=8, nic_bandwidth=50 * GB, nic_efficiency=0.94, nic_latency=_NET_HOP,
    compute_flops=989e12,
    reference=Reference(
        op="all_reduce", world_size=2, nbytes=8 << 30, busbw=47 * GB, ranks=(0, 8),
        url="https://github.com/NVIDIA/nccl-tests/issues/290",
        figure="H100 nodes with ConnectX-7 NDR 400 Gb/s: 46-48 GB/s per NIC "
               "(NCCL developer), checked with one rank on each of two nodes"),
))
"""Multi-node InfiniBand cluster of H100 nodes: NVLink 4 inside, 8 NDR NICs per node.

* NIC line rate: NDR InfiniBand 400 Gb/s = 50 GB/s per direction, one NIC per GPU.
* Efficiency 0.94: "46-48 GB/s per NIC" for NDR, NVIDIA/nccl-tests#290,
  https://github.com/NVIDIA/nccl-tests/issues/290
* Intra-node figures as :data:`H100_NVSWITCH`.
"""


#: further (preset, figure) pairs a parameter was set from, beside each preset's ``reference``
CALIBRATIONS: list[tuple[str, Reference]] = [
    ("h100-nvswitch", Reference(
        op="all_reduce", world_size=8, nbytes=8 << 30, busbw=480 * GB, algorithm="nvls",
        url="https://github.com/NVIDIA/nccl-tests/issues/212",
        figure="8x H100 NVSwitch, default algorithm (NVLink SHARP): peak busbw ~480 GB/s "
               "(algbw ~275 GB/s) at large sizes (NCCL maintainer)")),
]

#: (preset, figure) pairs held out from calibration: other sizes, node counts and ops
CROSS_CHECKS: list[tuple[str, Reference]] = [
    ("a100-hdr-cluster", Reference(
        op="all_reduce", world_size=24, nbytes=128 << 20, busbw=96 * GB,
        url="https://github.com/NVIDIA/nccl-tests/issues/119",
        figure="3 nodes x 8 A100 SXM4, 4x HDR per node: all_reduce peak busbw ~96 GB/s "
               "(run up to 128 MB)")),
    ("a100-nvswitch", Reference(
        op="send_recv", world_size=8, nbytes=1 << 30, busbw=195 * GB,
        url="https://github.com/li-plus/playground/blob/b85070fb449ea55858fed14cf69cefe10592261b/cuda/nccl.md",
        figure="8x A100 NVLink: sendrecv_perf busbw 195 GB/s at 1 GB")),
    ("h100-nvswitch", Reference(
        op="all_gather", world_size=8, nbytes=8 << 30, busbw=370 * GB,
        url="https://github.com/NVIDIA/nccl-tests/issues/212",
        figure="8x H100: ~370 GB/s effective NVLink bandwidth, observed as busbw of the "
               "non-allreduce ops (NCCL maintainer)")),
    ("h100-nvswitch", Reference(
        op="all_reduce", world_size=8, nbytes=1024, busbw=0.11 * GB,
        url="https://github.com/deepseek-ai/DeepEP/issues/303",
        figure="8x H20 (Hopper, NVLink 4 through NVSwitch as H100) all_reduce_perf: 1 KiB in "
               "16.38 us, busbw 0.11 GB/s (the LL protocol's latency; Simple alone would take ~56 us)")),
]


def get_topology(topology: str | Topology) -> Topology:
    """``topology`` itself, or the preset of that name."""
    if isinstance(topology, Topology):
        return topology
    try:
        return PRESETS[topology]
    except KeyError:
        raise ValueError(f"unknown topology preset {topology!r}; presets: {sorted(PRESETS)}") from None
