"""Scripts that hard-code CUDA on a machine without one: World(n, map_cuda=True) (simcomm.sim.cuda_map)
runs them unmodified, real-valued and shape-only, with the results of the same program written for CPU."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import simcomm
from simcomm.errors import RankError
from simcomm.sim.shape import trace_signature


def train(comm, device_name: str, steps: int = 2):
    """A torchrun-style FSDP2 script: set_device, init_device_mesh(device_name), .cuda()/.to(),
    CUDA events and memory queries when ``device_name == "cuda"``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cuda = device_name == "cuda"
    if cuda:
        assert torch.cuda.is_available() and torch.cuda.device_count() == dist.get_world_size()
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model = model.cuda() if cuda else model.to(device)
    mesh = init_device_mesh(device_name, (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 8, device=device)
        y = torch.randn(4, 4).to(device_name if cuda else device)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    extra = {}
    if cuda:
        end.record()
        torch.cuda.synchronize()
        extra = {"elapsed": start.elapsed_time(end), "allocated": torch.cuda.max_memory_allocated(),
                 "index": torch.cuda.current_device(), "device_type": x.device.type}
    return losses, [p.full_tensor().detach() for p in model.parameters()], extra


def test_a_cuda_script_runs_unmodified_with_the_cpu_scripts_results():
    expected = simcomm.World(2).run(train, "cpu")
    world = simcomm.World(2, map_cuda=True, memory=True)
    outs = world.run(train, "cuda")
    for rank, ((losses, params, extra), (cpu_losses, cpu_params, _)) in enumerate(zip(outs, expected)):
        assert all(torch.equal(a, b) for a, b in zip(losses, cpu_losses))
        assert all(torch.equal(a, b) for a, b in zip(params, cpu_params))
        assert extra["index"] == rank and extra["elapsed"] == 0.0 and extra["device_type"] == "cpu"
        assert extra["allocated"] > 0       # the rank's tracked bytes (World(memory=True))
    assert not torch.cuda.is_available() or torch.backends.cuda.is_built()   # restored after the run


def test_shape_only_cuda_script_traces_as_the_real_valued_run():
    real = simcomm.World(2, map_cuda=True)
    real.run(train, "cuda")
    shape = simcomm.World(2, tensors="shape", map_cuda=True)
    outs = shape.run(train, "cuda")
    assert [tuple(p.shape) for p in outs[0][1]] == [(16, 8), (16,), (4, 16), (4,)]
    assert trace_signature(shape.trace) == trace_signature(real.trace)


def test_torch_cuda_is_restored_when_a_rank_raises():
    before = (torch.cuda.is_available, torch.cuda.Stream, torch.nn.Module.cuda)

    def program(comm):
        assert torch.cuda.is_available()
        raise ValueError("stop")

    with pytest.raises(RankError, match="stop"):
        simcomm.World(2, map_cuda=True).run(program)
    assert (torch.cuda.is_available, torch.cuda.Stream, torch.nn.Module.cuda) == before
