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
