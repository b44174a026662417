"""The seed-compatible constructor: real.DeviceCommunicatorBase(cpu_group, device, device_group, unique_name)."""
from __future__ import annotations

import inspect

import pytest
import torch

import real
import simcomm

pytestmark = pytest.mark.real


def test_constructor_keeps_the_seed_signature():
    params = inspect.signature(real.DeviceCommunicatorBase.__init__).parameters
    assert list(params)[:5] == ["self", "cpu_group", "device", "device_group", "unique_name"]
    assert params["device"].default is None and params["device_group"].default is None
    assert params["unique_name"].default == ""
    assert issubclass(real.DeviceCommunicatorBase, simcomm.Communicator)
    for method in ("all_reduce", "all_gather", "slice", "all_to_all_4D", "gather", "send", "recv", "destroy",
                   "reduce_scatter", "broadcast", "barrier", "subgroup"):
        assert callable(getattr(real.DeviceCommunicatorBase, method))


def _error(build) -> str | None:
    try:
        build()
    except ValueError as error:
        return str(error)
    return None


def _seed_program(comm):
    import torch.distributed as dist

    from real import DeviceCommunicatorBase

    world = DeviceCommunicatorBase(dist.group.WORLD, unique_name="world")
    # the seed's all-gather backward failed on gloo; here it is a reduce-scatter of a flat buffer
    x = torch.full((2, 3), float(world.rank), requires_grad=True)
    y = world.all_gather(x, dim=0)                                      # (8, 3)
    (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    # subgroups made by the caller: every process creates both halves, in the same order
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine, other = halves[dist.get_rank() // 2], halves[1 - dist.get_rank() // 2]
    with_device_group = DeviceCommunicatorBase(mine, torch.device("cpu"), mine, "tp")
    without = DeviceCommunicatorBase(mine)                              # no device group: its own ranks
    value = torch.tensor([float(dist.get_rank() + 1)])
    return {
        "attrs": (world.rank, world.world_size, world.ranks, world.rank_in_group, world.global_rank,
                  world.global_world_size, world.unique_name, str(world.device), world.destroy()),
        "gathered": y.detach(), "grad": x.grad,
        "sub_attrs": (with_device_group.rank, with_device_group.world_size, with_device_group.ranks,
                      with_device_group.unique_name),
        "sub_sum": with_device_group.all_reduce(value), "no_device_group_sum": without.all_reduce(value),
        "sub_gather": without.all_gather(value, dim=0),
        "errors": {
            "none": _error(lambda: DeviceCommunicatorBase(None)),
            "not_member": _error(lambda: DeviceCommunicatorBase(other)),
            "mismatch": _error(lambda: DeviceCommunicatorBase(mine, device_group=dist.group.WORLD)),
        },
    }


@pytest.mark.timeout(180)
def test_seed_constructor_with_gloo_world_and_subgroups():
    outs = real.run(_seed_program, world_size=4, backend="gloo")
    weights = torch.arange(24.0).reshape(8, 3)
    for rank, out in enumerate(outs):
        assert out["attrs"] == (rank, 4, (0, 1, 2, 3), rank, rank, 4, "world", "cpu", None)
        assert torch.equal(out["gathered"], torch.arange(4.0).repeat_interleave(2)[:, None].expand(8, 3))
        assert torch.equal(out["grad"], 4 * weights[2 * rank:2 * rank + 2])   # 4 ranks' equal losses
        half = [0, 1] if rank < 2 else [2, 3]
        assert out["sub_attrs"] == (rank % 2, 2, tuple(half), "tp")
        expected = float(sum(r + 1 for r in half))                          # never the world's 10
        assert out["sub_sum"].item() == expected == out["no_device_group_sum"].item()
        assert out["sub_gather"].tolist() == [float(r + 1) for r in half]
        errors = out["errors"]
        assert "cpu_group=None" in errors["none"] and "never falls back" in errors["none"]
        assert f"global rank {rank} is not a member" in errors["not_member"]
        assert "device_group has ranks [0, 1, 2, 3]" in errors["mismatch"]
