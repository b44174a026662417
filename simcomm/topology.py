"""Hardware the cost model runs on: :class:`Topology` and cited presets.

A topology is two levels of links:

* inside a node, every GPU has ``link_bandwidth`` bytes/s per direction to a
  switch (NVSwitch) or bus (PCIe): full bisection, so any pattern of
  point-to-point flows runs at that rate per GPU;
* between nodes, each node has ``nics_per_node`` NICs of ``nic_bandwidth``
  bytes/s per direction each.

Line rates come from datasheets; the ``*_efficiency`` fields are the fraction
of line rate NCCL's Simple protocol reaches (headers, flags, 128-byte stores
from the SMs). Per-hop latencies are NCCL's own ring/Simple tuning constants
(``src/graph/tuning.cc``: base 8.4 us; NVLink 3.4 us, PCIe 5.7 us, network
9.6 us per hop).

Every preset carries a :class:`Reference`: the published nccl-tests figure its
efficiencies were set from, which it must reproduce within 20%.
:data:`CROSS_CHECKS` are further published figures, not used to set any
parameter, that the presets must also meet within 20% (``tests/test_cost.py``;
:func:`validation_table` lists both).
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Reference", "Topology", "PRESETS", "CROSS_CHECKS", "get_topology", "validation_table"]

GB = 1e9  # nccl-tests reports GB/s with GB = 1e9 bytes

# NCCL src/graph/tuning.cc, ring algorithm, Simple protocol (microseconds)
_BASE_LATENCY = 8.4e-6
_NVLINK_HOP = 3.4e-6
_PCIE_HOP = 5.7e-6
_NET_HOP = 9.6e-6


@dataclass(frozen=True)
class Reference:
    """A published measurement a preset must reproduce (within 20%).

    ``nbytes`` follows the nccl-tests size convention of ``op`` (see
    :func:`simcomm.cost.estimate`); ``ranks`` places the ranks on the
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


@dataclass(frozen=True)
class Topology:
    """Two-level hardware description for the alpha-beta model.

    Bandwidths are bytes/s per direction, latencies seconds; ``compute_flops``
    is the dense BF16 peak of one GPU (flop/s), used to turn
    ``comm.compute(flops=...)`` into seconds.
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
        for name in ("link_latency", "nic_latency", "base_latency", "compute_flops", "nic_bandwidth"):
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
    compute_flops=989e12,
    reference=Reference(
        op="all_reduce", world_size=8, nbytes=8 << 30, busbw=370 * GB,
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

The model is the ring/tree path; NVLink SHARP (NVLS, ~480 GB/s all-reduce
busbw on 8 GPUs, same thread; 475 GB/s on H200 in nccl-tests#272) is not
modelled.
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
    compute_flops=362e12,
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
]


def get_topology(topology: str | Topology) -> Topology:
    """``topology`` itself, or the preset of that name."""
    if isinstance(topology, Topology):
        return topology
    try:
        return PRESETS[topology]
    except KeyError:
        raise ValueError(f"unknown topology preset {topology!r}; presets: {sorted(PRESETS)}") from None


def validation_table() -> list[dict]:
    """Each preset against its cited figures: the model's busbw and the relative error.

    ``kind`` is ``"calibration"`` for the figure a preset's efficiencies were
    set from, ``"cross-check"`` for the held-out figures of :data:`CROSS_CHECKS`.
    """
    from .cost import estimate

    checks = [(name, t.reference, "calibration") for name, t in PRESETS.items() if t.reference]
    checks += [(name, ref, "cross-check") for name, ref in CROSS_CHECKS]
    rows = []
    for name, ref, kind in checks:
        topology = PRESETS[name]
        result = estimate(ref.op, ref.nbytes, ref.world_size, topology, ranks=ref.ranks)
        rows.append({
            "preset": name, "kind": kind, "op": ref.op, "world_size": ref.world_size, "nbytes": ref.nbytes,
            "cited_busbw_GBps": ref.busbw / GB, "model_busbw_GBps": result.busbw / GB,
            "error": result.busbw / ref.busbw - 1, "algorithm": result.algorithm,
            "source": ref.url, "figure": ref.figure,
        })
    return rows
