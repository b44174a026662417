"""Memory per rank on real worker processes: the same report as the simulator's."""
from __future__ import annotations

import pytest
import torch

import real
import simcomm
from simcomm import memory
from simcomm.parallel import zero

pytestmark = pytest.mark.real

MLP = zero.MLP((16, 64, 64, 8))   # psi = 5768
WORLD_SIZE = 2
MODEL_STATES = ("parameters", "gradients", "optimizer_state")


def _tracked_zero(comm, stage: int, mlp: zero.MLP):
    """Runs inside each worker: ZeRO training under tracking; returns the plain report."""
    _, report = memory.run_tracked(comm.rank, zero.train, (comm, stage, mlp), {"steps": 2, "batch_size": 8},
                                   device=comm.device)
    return report


def _sim_report(stage: int) -> memory.MemoryReport:
    world = simcomm.World(WORLD_SIZE, memory=True)
    world.run(zero.train, stage, MLP, steps=2, batch_size=8)
    return world.memory


def test_each_worker_measures_what_the_simulator_measures():
    with real.Cluster(WORLD_SIZE, backend="gloo") as cluster:
        for stage in zero.STAGES:
            dicts = cluster.run(_tracked_zero, stage, MLP)
            got = memory.MemoryReport.from_dicts(list(dicts))
            want = _sim_report(stage)
            expected = zero.expected_bytes(stage, MLP.numel, WORLD_SIZE)
            assert [r.rank for r in got.ranks] == list(range(WORLD_SIZE))
            for rank, (g, w) in enumerate(zip(got.at("after step 2"), want.at("after step 2"))):
                for name in MODEL_STATES:
                    assert g[name] == w[name], (stage, rank, name, g[name], w[name])
                    assert abs(g[name] - expected[name]) <= 0.05 * expected[name]
                assert g["activations"] == 0
            assert got.device_peak == [None] * WORLD_SIZE       # CPU: no allocator statistic


def test_cluster_reports_memory_like_world():
    def program(comm):
        with memory.label("parameters"):
            kept = torch.zeros(100 * (comm.rank + 1))
        memory.mark("m")
        return kept.numel()

    with real.Cluster(WORLD_SIZE, backend="gloo", memory=True) as cluster:
        results = cluster.run(program)
    report = results.memory
    assert isinstance(report, memory.MemoryReport)
    assert [s["parameters"] for s in report.at("m")] == [400 * (r + 1) for r in range(WORLD_SIZE)]
    assert cluster.memory == report


def _by_label(report: memory.RankMemory) -> dict:
    """Everything a rank's report says, without zero entries (a label that was live once and is not now)."""
    nonzero = lambda bytes_: {k: v for k, v in bytes_.items() if v}   # noqa: E731
    return {"peak": report.peak, "peak_bytes": nonzero(report.peak_bytes), "current": report.current,
            "current_bytes": nonzero(report.current_bytes),
            "marks": [(m.name, m.total, m.peak, nonzero(m.bytes)) for m in report.marks]}


@pytest.mark.parametrize("repeat", range(2))
def test_zero_stages_count_the_same_bytes_on_workers_and_virtual_ranks(repeat):
    """Lesson 07's runs, 4 ranks: the peak, the peak by label, every mark and the end, to the byte.

    Two sim/real differences this holds: gloo's worker thread dropping a call's tensors a moment
    after the call returned (a buffer the program freed right after the call died later, on that
    thread: ZeRO-1's peak was 4,160 B higher on real workers), and output buffers counted as
    "other" from their allocation instead of "communication" as the simulator counts them."""
    mlp, world_size = MLP, 4
    sim = simcomm.World(world_size, memory=True)
    with real.Cluster(world_size, backend="gloo", memory=True) as cluster:
        for stage in zero.STAGES:
            sim.run(zero.train, stage, mlp, steps=2)
            cluster.run(zero.train, stage, mlp, steps=2)
            for rank in range(world_size):
                got, want = _by_label(cluster.memory.ranks[rank]), _by_label(sim.memory.ranks[rank])
                assert got == want, (stage, rank, got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_device_peak_is_reported():
    def program(comm):
        with memory.label("parameters"):
            kept = torch.zeros(1 << 20, device="cuda")         # 4 MiB
        memory.mark("m")
        return kept.numel()

    result, report = memory.run_tracked(0, program, (None,), device="cuda")
    assert result == 1 << 20
    assert report["marks"][0][1] == {"parameters": 4 << 20}
    assert report["device_peak"] >= 4 << 20
