"""FLOPs counted per rank at the dispatcher (simcomm.sim.flops), traced as compute, against
torch's FlopCounterMode on one device; shape-only CUDA devices on a build without CUDA."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import simcomm
from simcomm.model import cost, topology
from simcomm.errors import ShapeOnlyError


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 8))


def mlp_program(comm, model, rows):
    x = torch.randn(rows, 16)
    loss = model(x).pow(2).sum()
    loss.backward()
    grads = [comm.all_reduce(p.grad, "avg") for p in model.parameters()]
    return len(grads)


def _one_device_flops(rows: int) -> int:
    model = _mlp()
    with FlopCounterMode(display=False) as counter:
        model(torch.randn(rows, 16)).pow(2).sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("tensors", ["real", "shape"])
def test_counted_flops_equal_flop_counter_mode_on_one_device(tensors):
    rows = 12
    expected = _one_device_flops(rows)
    assert expected > 0
    world = simcomm.World(3, tensors=tensors, count_flops=True)
    world.run(mlp_program, _mlp(), rows)
    assert world.flops == [expected] * 3
    for rank in range(3):
        compute = [e for e in world.trace.events if e.rank == rank and e.op == "compute"]
        assert sum(e.args["flops"] for e in compute) == expected
        assert len(compute) == 8      # 3 forward matmuls; backward 2 per layer, 1 for the first (no input grad)


def test_the_modelled_timeline_gets_a_compute_lane_without_comm_compute():
    world = simcomm.World(2, tensors="shape", count_flops=True)
    world.run(mlp_program, _mlp(), 64)
    preset = topology.H100_NVSWITCH
    timeline = cost.modelled_timeline(world.trace, preset)
    for rank, summary in timeline.ranks.items():
        assert summary.compute == pytest.approx(world.flops[rank] / preset.compute_flops)
        assert summary.communication > 0
    lanes = {placed.lane for placed in timeline}
    assert "compute" in lanes and len(lanes) == 2


def test_counting_is_off_by_default_and_leaves_results_unchanged():
    plain, counted = simcomm.World(2), simcomm.World(2, count_flops=True)
    assert plain.run(mlp_program, _mlp(), 4) == counted.run(mlp_program, _mlp(), 4)
    assert plain.flops is None and not any(e.op == "compute" for e in plain.trace.events)
    assert counted.flops[0] > 0


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="this torch is built with CUDA")
def test_a_shape_only_cuda_device_without_a_cuda_build_is_refused_with_the_reason():
    with pytest.raises(ShapeOnlyError, match=r"device='cuda' needs a CUDA build of torch.*autograd aborts "
                                             r"the process.*Use device='cpu' with map_cuda=True"):
        simcomm.World(2, tensors="shape", device="cuda")
