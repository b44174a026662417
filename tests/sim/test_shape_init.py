"""``torch.nn.init.trunc_normal_`` on shape-only ranks (the ``"trunc-normal"`` patch).

torch 2.13's truncated normal redraws until every value lies in its bounds and reads
``mask.any()`` of random data each time; a shape-only rank has no such value, so a model
initialised with it (torchtitan's llama3, timm's ViTs) stopped with a ShapeOnlyError.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from simcomm import World


def _init(module: torch.nn.Module) -> None:
    for param in module.parameters():
        torch.nn.init.trunc_normal_(param, mean=0.0, std=0.02, a=-0.04, b=0.04)


def test_trunc_normal_of_fake_parameters_and_of_fsdp_dtensors_keeps_their_shapes():
    def program(comm):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        dist.init_process_group("simcomm", rank=comm.rank, world_size=comm.world_size)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
        _init(model)
        plain = [tuple(p.shape) for p in model.parameters()]
        fully_shard(model, mesh=init_device_mesh("cpu", (comm.world_size,)))
        _init(model)                                  # on DTensors over fake shards
        sharded = [tuple(p.to_local().shape) for p in model.parameters()]
        loss = model(torch.randn(4, 16)).sum()
        loss.backward()
        dist.destroy_process_group()
        return plain, sharded, tuple(loss.shape)

    plain = [(32, 16), (32,), (8, 32), (8,)]
    assert World(2, tensors="shape").run(program) == [(plain, [(16, 16), (16,), (4, 32), (4,)], ())] * 2


def test_trunc_normal_of_real_tensors_is_torchs_own_on_every_thread():
    def draw() -> torch.Tensor:
        torch.manual_seed(7)
        tensor = torch.empty(256)
        torch.nn.init.trunc_normal_(tensor, std=1.0, a=-0.5, b=0.5)
        return tensor

    expected = draw()                                  # torch's own, before any shape-only run
    World(1, tensors="shape").run(lambda comm: torch.nn.init.trunc_normal_(torch.empty(3, requires_grad=False)))
    assert torch.equal(draw(), expected)               # after: the patch passes real tensors on
    on_rank = World(2).run(lambda comm: draw())
    assert all(torch.equal(each, expected) for each in on_rank)
    assert expected.abs().max() <= 0.5 and expected.std() > 0
