"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) state dicts on virtual ranks.

A sharded state dict holds one ShardedTensor per parameter, placed on the group's default
device (c10d's ``_get_pg_default_device``, read from the group's ``_device_types``); a
full state dict gathers every parameter on every rank. Both are checked after one
training step, for a program written for GPUs on virtual GPUs and for its CPU twin on the
CPU device, against the same step computed on one device without distribution: each
rank's shard is its rows of the parameter, and the full state dict is the whole of it.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

import simcomm

WORLD = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def _batch(rank: int, device) -> torch.Tensor:
    return torch.arange(24.0, device=device).reshape(4, 6) / 10 * (rank + 1) - 1


def _program(comm, device: str):
    """One SGD step of FSDP1, then its sharded and full state dicts (as plain tensors)."""
    rank = dist.get_rank()
    if device == "cuda":
        torch.cuda.set_device(rank)
    fsdp = FSDP(_model(), device_id=rank if device == "cuda" else torch.device("cpu"))
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    fsdp(_batch(rank, device)).square().mean().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)   # FSDP1's and ShardedTensor's deprecations
        warnings.simplefilter("ignore", UserWarning)
        with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
            sharded = {}
            for name, value in fsdp.state_dict().items():
                (shard,) = value.local_shards()
                sharded[name] = (list(shard.metadata.shard_offsets), str(shard.metadata.placement),
                                 str(shard.tensor.device), shard.tensor.clone())
        with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=False)):
            full = {name: value.clone() for name, value in fsdp.state_dict().items()}
    return dist.distributed_c10d._get_pg_default_device().type, sharded, full


def _one_device_step() -> dict[str, torch.Tensor]:
    """The same step without distribution: FSDP averages the ranks' gradients, which for
    equal batches is the gradient of the mean loss over both batches."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [model(_batch(rank, "cpu")).square().mean() for rank in range(WORLD)]
    (sum(losses) / WORLD).backward()
    opt.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def _check(outs, expected):
    for rank, (default_device, sharded, full) in enumerate(outs):
        assert default_device == "cpu"
        assert full.keys() == sharded.keys() == expected.keys()
        for name, whole in expected.items():
            torch.testing.assert_close(full[name], whole)
            offsets, placement, device, shard = sharded[name]
            rows = -(-whole.shape[0] // WORLD)
            assert offsets[0] == rows * rank and all(o == 0 for o in offsets[1:])
            assert placement == f"rank:{rank}/cpu" and device == "cpu"
            torch.testing.assert_close(shard, whole[rows * rank: rows * (rank + 1)])


def test_fsdp1_sharded_and_full_state_dicts_on_virtual_gpus_equal_their_cpu_twin_and_one_device():
    gpu = simcomm.World(WORLD, map_cuda=True).run(_program, "cuda")
    cpu = simcomm.World(WORLD).run(_program, "cpu")
    expected = _one_device_step()
    _check(gpu, expected)
    _check(cpu, expected)
    for (_, gpu_sharded, gpu_full), (_, cpu_sharded, cpu_full) in zip(gpu, cpu):
        for name in expected:        # the same program on the same CPU: bitwise the same
            assert torch.equal(gpu_full[name], cpu_full[name])
            assert torch.equal(gpu_sharded[name][3], cpu_sharded[name][3])


def test_a_simcomm_group_serves_cpu_as_gloo_does():
    """gloo's groups serve cpu (and cuda), so c10d's default device of a group is cpu; a simcomm
    group answers the same, also on virtual GPUs, where a ``"cuda"`` tensor is a CPU tensor."""
    def program(comm):
        sub = dist.new_group([0, 1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # _get_pg_default_device's deprecation
            return ("cpu" in [d.type for d in dist.group.WORLD._device_types],
                    dist.distributed_c10d._get_pg_default_device().type,
                    dist.distributed_c10d._get_pg_default_device(sub).type)
    assert simcomm.World(WORLD).run(program) == [(True, "cpu", "cpu")] * WORLD
    assert simcomm.World(WORLD, map_cuda=True).run(program) == [(True, "cpu", "cpu")] * WORLD


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fsdp1_state_dicts_on_a_cuda_world_place_the_shards_on_cuda_as_nccl_does():
    def program(comm):
        torch.cuda.set_device(0)
        fsdp = FSDP(_model(), device_id=torch.cuda.current_device())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with FSDP.state_dict_type(fsdp, StateDictType.SHARDED_STATE_DICT):
                shards = {name: (str(value.local_shards()[0].metadata.placement),
                                 value.local_shards()[0].tensor.cpu()) for name, value in fsdp.state_dict().items()}
            default = dist.distributed_c10d._get_pg_default_device().type
        return default, shards

    expected = {name: value.detach() for name, value in _model().state_dict().items()}
    for rank, (default, shards) in enumerate(simcomm.World(WORLD, device="cuda").run(program)):
        assert default == "cuda"
        for name, whole in expected.items():
            placement, shard = shards[name]
            rows = -(-whole.shape[0] // WORLD)
            assert placement.startswith(f"rank:{rank}/cuda")
            torch.testing.assert_close(shard, whole[rows * rank: rows * (rank + 1)])
