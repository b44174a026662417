"""PyTorch's own parallelism on virtual ranks (4 ranks, 2x2 meshes), against one device in float64."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import simcomm

from .. import torch_dist_programs as progs

WORLD = progs.WORLD


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_dtensor_placements_redistribution_and_matmul(mesh_shape):
    world = simcomm.World(WORLD)
    outs = world.run(progs.dtensor_matmul_program, mesh_shape)
    for rank, got in enumerate(outs):
        want = progs.dtensor_reference(mesh_shape, rank)
        assert got.keys() == want.keys()
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, msg=f"rank {rank} {name}")
    groups = {e.group for e in world.trace}
    if mesh_shape == (2, 2):   # the mesh's column and row groups
        assert groups >= {(0, 2), (1, 3), (0, 1), (2, 3)}
    else:
        assert groups == {(0, 1, 2, 3)}


def test_parallelize_module_colwise_rowwise_mlp():
    world = simcomm.World(WORLD)
    outs = world.run(progs.tensor_parallel_program)
    y, grads = progs.tensor_parallel_reference()
    for got_y, got_grads in outs:
        torch.testing.assert_close(got_y, y)
        for got, want in zip(got_grads, grads, strict=True):
            torch.testing.assert_close(got, want)
    phases = {(e.op, e.phase) for e in world.trace}
    assert ("all_reduce", "forward") in phases and ("all_reduce", "backward") in phases


def test_fsdp2_two_steps_equal_single_device_training():
    world = simcomm.World(WORLD)
    outs = world.run(progs.fsdp_program)
    want = progs.data_parallel_reference()
    for params in outs:
        for got, ref in zip(params, want, strict=True):
            torch.testing.assert_close(got, ref)
    by_phase = {(e.op, e.phase) for e in world.trace}
    assert ("all_gather", "forward") in by_phase
    assert ("reduce_scatter", "backward") in by_phase and ("reduce_scatter", "forward") not in by_phase


def test_ddp_two_steps_equal_single_device_training():
    world = simcomm.World(WORLD)
    outs = world.run(progs.ddp_program)
    want = progs.data_parallel_reference()
    for params in outs:
        for got, ref in zip(params, want, strict=True):
            torch.testing.assert_close(got, ref)
    assert {e.phase for e in world.trace if e.op == "all_reduce"} == {"backward"}


# -- pipelining ----------------------------------------------------------------------------

def _stage_layers(stages: int) -> list[nn.Module]:
    torch.manual_seed(3)
    return [nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double() for _ in range(stages)]


def _pipeline_program(comm, schedule_name: str, microbatches: int):
    from torch.distributed import pipelining
    rank, stages = dist.get_rank(), dist.get_world_size()
    module = _stage_layers(stages)[rank]
    stage = pipelining.PipelineStage(module, rank, stages, torch.device("cpu"))
    schedule = getattr(pipelining, schedule_name)(
        stage, n_microbatches=microbatches, loss_fn=lambda out, target: (out - target).pow(2).sum())
    x, target = progs.rank_input(0, (8, 4)), progs.rank_input(1, (8, 4))
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(x)
    elif rank == stages - 1:
        schedule.step(target=target, losses=losses)
    else:
        schedule.step()
    return [p.grad for p in module.parameters()], [loss.detach() for loss in losses]


def _pipeline_reference(stages: int, microbatches: int):
    layers = _stage_layers(stages)
    model = nn.Sequential(*layers)
    x, target = progs.rank_input(0, (8, 4)), progs.rank_input(1, (8, 4))
    losses = [(model(xm) - tm).pow(2).sum() for xm, tm in zip(x.chunk(microbatches), target.chunk(microbatches))]
    (sum(losses) / microbatches).backward()   # the schedule scales gradients by 1/microbatches
    return [[p.grad for p in layer.parameters()] for layer in layers], [loss.detach() for loss in losses]


def _check_pipeline(stages: int, schedule_name: str, microbatches: int = 4) -> simcomm.World:
    world = simcomm.World(stages)
    outs = world.run(_pipeline_program, schedule_name, microbatches)
    grads, losses = _pipeline_reference(stages, microbatches)
    for rank, (got_grads, got_losses) in enumerate(outs):
        for got, want in zip(got_grads, grads[rank], strict=True):
            torch.testing.assert_close(got, want)
    for got, want in zip(outs[-1][1], losses, strict=True):
        torch.testing.assert_close(got, want)
    return world


@pytest.mark.parametrize("stages", [2, 4])
def test_pipelining_gpipe(stages):
    _check_pipeline(stages, "ScheduleGPipe")


@pytest.mark.parametrize("stages", [2, 4])
def test_pipelining_1f1b(stages):
    """1F1B posts a stage's send and its receive together (batch_isend_irecv)."""
    world = _check_pipeline(stages, "Schedule1F1B")
    p2p = [e for e in world.trace if e.op in ("send", "recv") and e.nbytes == 2 * 4 * 8]   # (2, 4) float64
    # a send and a recv of each microbatch's activation and of its gradient at every stage boundary
    assert len(p2p) == 2 * 2 * 4 * (stages - 1)
    assert all(e.async_op and e.start <= e.end <= e.waited for e in p2p)


def _looped_program(comm, schedule_name: str, stages_per_rank: int, microbatches: int):
    """Stage ``rank + world * k`` of the model on each rank (k < stages_per_rank)."""
    from torch.distributed import pipelining
    rank, world = dist.get_rank(), dist.get_world_size()
    total = world * stages_per_rank
    layers = _stage_layers(total)
    mine = [rank + world * k for k in range(stages_per_rank)]
    stages = [pipelining.PipelineStage(layers[index], index, total, torch.device("cpu")) for index in mine]
    schedule = getattr(pipelining, schedule_name)(
        stages, n_microbatches=microbatches, loss_fn=lambda out, target: (out - target).pow(2).sum())
    x, target = progs.rank_input(0, (8, 4)), progs.rank_input(1, (8, 4))
    losses: list[torch.Tensor] = []
    if rank == 0:
        schedule.step(x)
    elif rank == world - 1:
        schedule.step(target=target, losses=losses)
    else:
        schedule.step()
    return {index: [p.grad for p in layers[index].parameters()] for index in mine}, [
        loss.detach() for loss in losses]


@pytest.mark.parametrize("schedule_name", ["ScheduleInterleaved1F1B", "ScheduleLoopedBFS"])
def test_pipelining_with_two_stages_per_rank(schedule_name):
    ranks, per_rank, microbatches = 2, 2, 4
    outs = simcomm.World(ranks).run(_looped_program, schedule_name, per_rank, microbatches)
    grads, losses = _pipeline_reference(ranks * per_rank, microbatches)
    for rank, (got_grads, _) in enumerate(outs):
        assert sorted(got_grads) == [rank + ranks * k for k in range(per_rank)]
        for index, stage_grads in got_grads.items():
            for got, want in zip(stage_grads, grads[index], strict=True):
                torch.testing.assert_close(got, want)
    for got, want in zip(outs[-1][1], losses, strict=True):
        torch.testing.assert_close(got, want)
