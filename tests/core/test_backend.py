"""simcomm.configured_backend: SIMCOMM_BACKEND picks simcomm.World or real.Cluster."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import simcomm


def _program(comm):
    x = torch.tensor([float(comm.rank + 1)], requires_grad=True)
    comm.all_reduce(x, op="product").backward()
    return x.grad


def test_default_and_sim_give_a_world(monkeypatch):
    monkeypatch.delenv("SIMCOMM_BACKEND", raising=False)
    assert isinstance(simcomm.configured_backend(2), simcomm.World)
    monkeypatch.setenv("SIMCOMM_BACKEND", "sim")
    with simcomm.configured_backend(3, trace=False) as world:
        assert isinstance(world, simcomm.World) and world.world_size == 3
        # the sum of the 3 ranks' equal losses: 3 x the product of the others
        assert [g.item() for g in world.run(_program)] == [18.0, 9.0, 6.0]


def test_unknown_backend_is_named(monkeypatch):
    monkeypatch.setenv("SIMCOMM_BACKEND", "mpi")
    with pytest.raises(ValueError, match="SIMCOMM_BACKEND='mpi' is not a backend"):
        simcomm.configured_backend(2)


def test_simcomm_does_not_import_real():
    code = "import simcomm, sys; simcomm.configured_backend(2); assert 'real' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={"SIMCOMM_BACKEND": "sim"})


@pytest.mark.real
@pytest.mark.timeout(120)
def test_real_gives_a_cluster_with_the_same_run(monkeypatch):
    import real

    monkeypatch.setenv("SIMCOMM_BACKEND", "real")
    with simcomm.configured_backend(2, backend="gloo", timeout=60) as cluster:
        assert isinstance(cluster, real.Cluster)
        grads = cluster.run(_program)
        assert [g.item() for g in grads] == [4.0, 2.0]
        world = simcomm.World(2)
        world.run(_program)
        assert cluster.trace.ops() == world.trace.ops() and len(cluster.trace.ops()) == 4
        pids = cluster.pids
    assert cluster.pids == [] and pids
