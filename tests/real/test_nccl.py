"""NCCL on GPUs: one GPU per rank; each test skips when this machine has fewer GPUs than ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import real
import simcomm
from real.verify import all_cases, evaluate, run_cases

pytestmark = pytest.mark.real

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _need(world_size: int) -> None:
    if _gpus() < world_size:
        pytest.skip(f"NCCL with {world_size} ranks needs {world_size} GPUs; {_gpus()} available")


def _placement(comm):
    x = torch.ones(2, comm.world_size * 2, requires_grad=True)        # on the CPU: moved by the transport
    y = comm.reduce_scatter(x.to(comm.device), dim=-1)
    y.sum().backward()
    comm.barrier()
    return str(comm.device), str(y.device), y, x.grad, comm.transport.backend


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.timeout(300)
def test_nccl_every_case_against_reference_and_simulator(world_size):
    _need(world_size)
    names = [case.name for case in all_cases()]
    with real.Cluster(world_size, timeout=240) as cluster:          # backend=None picks nccl here
        assert cluster.backend == "nccl"
        assert cluster.devices == [f"cuda:{rank}" for rank in range(world_size)]
        placements = cluster.run(_placement)
        got = cluster.run(run_cases, names)
    for rank, (device, y_device, y, grad, backend) in enumerate(placements):
        assert device == y_device == f"cuda:{rank}" and backend == "nccl"
        assert y.device.type == "cpu" and torch.equal(y, torch.full((2, 2), float(world_size)))
        assert torch.equal(grad, torch.full((2, world_size * 2), 1.0))
    rows = evaluate(world_size, list(got), simcomm.World(world_size).run(run_cases, names))
    assert all(row["passed"] for row in rows), [row for row in rows if not row["passed"]]


@pytest.mark.timeout(300)
def test_torchrun_verify_on_every_gpu(tmp_path):
    gpus = _gpus()
    _need(1)
    report = tmp_path / "verify.json"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
         "-m", "real.verify", "--json", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(report.read_text())
    assert data["backend"] == "nccl" and data["world_size"] == gpus and data["passed"]
