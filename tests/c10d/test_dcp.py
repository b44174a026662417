"""Distributed checkpoints (DCP) of ShardedTensor and DTensor state on virtual ranks, on the CPU.

The ``"simcomm"`` backend claims the device types it serves (cpu, plus cuda where
real GPUs exist or a run of virtual GPUs claims it: ``process_group.claim_cuda``),
so ShardedTensor and DCP pick the device gloo would. Before, it claimed cuda on a
CPU build of torch and ``ShardedTensor.gather`` failed with "Torch not compiled
with CUDA enabled". The reference: the same program on gloo processes (slow tier),
and the values the program wrote (fast tier).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed import distributed_c10d as c10d

import simcomm
from simcomm.c10d import process_group

WORLD = 4
ROWS = 8


def _local_rows(rank: int) -> torch.Tensor:
    return torch.arange(6.0).view(2, 3) + 100 * rank


def checkpoint_program(comm, path: str) -> dict:
    """What PyTorch's DCP tests do: a ShardedTensor gathered to rank 0, then a state dict of a
    ShardedTensor, a DTensor and a plain tensor saved with DCP and loaded into fresh tensors
    (the DTensor resharded: saved along dim 0, loaded along dim 1)."""
    import torch.distributed._shard.sharded_tensor as sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    warnings.filterwarnings("ignore", category=FutureWarning)       # ShardedTensor's deprecation
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])
    sharded = sharded_tensor.empty(spec, ROWS, 3)
    sharded.local_shards()[0].tensor.copy_(_local_rows(rank))
    full = torch.zeros(ROWS, 3) if rank == 0 else None
    sharded.gather(dst=0, out=full)

    mesh = init_device_mesh("cpu", (world,))
    matrix = torch.arange(40.0).view(10, 4) / 3
    saved = distribute_tensor(matrix, mesh, [Shard(0)])
    dcp.save({"st": sharded, "dt": saved, "step": torch.tensor(7)}, checkpoint_id=path)

    state = {"st": sharded_tensor.zeros(spec, ROWS, 3),
             "dt": distribute_tensor(torch.zeros(10, 4), mesh, [Shard(1)]), "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)
    return {"full": full, "st": state["st"].local_shards()[0].tensor.clone(),
            "dt": state["dt"].to_local().clone(), "dt_full": state["dt"].full_tensor(),
            "step": state["step"].clone(),
            "preferred_device": str(sharded._get_preferred_device()),
            "object_device": str(c10d._get_object_coll_device())}


def test_dcp_of_sharded_and_dtensor_state_round_trips_on_virtual_ranks(tmp_path):
    outs = simcomm.World(WORLD).run(checkpoint_program, str(tmp_path), timeout=120)
    matrix = torch.arange(40.0).view(10, 4) / 3
    torch.testing.assert_close(outs[0]["full"], torch.cat([_local_rows(r) for r in range(WORLD)]),
                               rtol=0, atol=0)
    for rank, out in enumerate(outs):
        assert out["preferred_device"] == out["object_device"] == "cpu"   # gloo's answer
        torch.testing.assert_close(out["st"], _local_rows(rank), rtol=0, atol=0)
        torch.testing.assert_close(out["dt"], matrix[:, rank:rank + 1], rtol=0, atol=0)
        torch.testing.assert_close(out["dt_full"], matrix, rtol=0, atol=0)
        assert out["step"].item() == 7
        assert rank == 0 or out["full"] is None


def _expected_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def test_the_backend_claims_cpu_and_cuda_only_where_gpus_exist():
    simcomm.World(1).run(lambda comm: dist.get_backend())       # registered
    assert dist.Backend.backend_capability[process_group.BACKEND_NAME] == _expected_devices()
    assert process_group.served_devices() == _expected_devices()
    # never the default backend of a device type: cpu stays gloo's, cuda nccl's
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"
    assert dist.Backend.default_device_backend_map["cuda"] == "nccl"
    configs = simcomm.World(2).run(lambda comm: dist.get_backend_config())
    assert configs == [",".join(f"{device}:simcomm" for device in _expected_devices())] * 2


def test_a_claim_of_cuda_lasts_until_it_is_given_back_and_claims_nest():
    simcomm.World(1).run(lambda comm: None)
    capability = dist.Backend.backend_capability
    try:
        assert process_group.claim_cuda(True) == ["cpu", "cuda"]
        assert process_group.claim_cuda(True) == ["cpu", "cuda"]
        assert capability["simcomm"] == ["cpu", "cuda"]
        # a group made while cuda is claimed serves cuda too
        assert simcomm.World(2).run(lambda comm: dist.get_backend_config()) == ["cpu:simcomm,cuda:simcomm"] * 2
        assert process_group.claim_cuda(False) == ["cpu", "cuda"]          # one claim still held
    finally:
        process_group.claim_cuda(False)
    assert capability["simcomm"] == _expected_devices()
    assert simcomm.World(2).run(lambda comm: dist.get_backend_config())[0] == \
        ",".join(f"{device}:simcomm" for device in _expected_devices())
    with pytest.raises(ValueError, match="no claim of cuda is held"):
        process_group.claim_cuda(False)
    assert capability["simcomm"] == _expected_devices()


@pytest.mark.real
@pytest.mark.timeout(300)
def test_dcp_on_gloo_processes_gives_the_same(gloo_cluster, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "sim").mkdir()
    real_outs = gloo_cluster(WORLD).run(checkpoint_program, str(tmp_path / "real"))
    sim_outs = simcomm.World(WORLD).run(checkpoint_program, str(tmp_path / "sim"), timeout=120)
    for real_out, sim_out in zip(real_outs, sim_outs, strict=True):
        assert real_out.keys() == sim_out.keys()
        for name, value in real_out.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(sim_out[name], value, rtol=0, atol=0, msg=name)
            else:
                assert sim_out[name] == value, name
