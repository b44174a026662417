"""DeviceMeshes on virtual ranks are each rank's own (simcomm.sim.dist_world.mesh_identity).

Process-wide caches keyed on a mesh (DTensor's sharding propagation,
``redistribute``'s transform infos and planners) must not hand one rank's
rank-dependent answer to another. The reference is the single-device tensor
(and its shards cut with ``torch.chunk``, DTensor's rule for ``Shard``) and
gloo processes running the same program.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import simcomm

MESH = (2, 2, 2)
WORLD = 8
PLACEMENTS = [(Shard(0), Shard(0), Shard(0)), (Shard(1), Shard(0), Shard(0)),
              (Shard(0), Replicate(), Shard(1)), (Replicate(), Shard(0), Shard(1))]


def full_tensor() -> torch.Tensor:
    return torch.arange(17 * 5, dtype=torch.float64).reshape(17, 5) / 7


def local_reference(rank: int, placements) -> torch.Tensor:
    """Rank ``rank``'s shard, cut on one device: along each mesh dim, the coordinate's chunk."""
    coordinate = [rank // 4, rank // 2 % 2, rank % 2]   # row-major, as init_device_mesh
    local = full_tensor()
    for size, index, placement in zip(MESH, coordinate, placements, strict=True):
        if isinstance(placement, Shard):
            chunks = local.chunk(size, dim=placement.dim)
            local = chunks[index] if index < len(chunks) else local.narrow(placement.dim, 0, 0)
    return local


def sharding_program(comm, placements) -> dict[str, torch.Tensor]:
    """Shard the 17 x 5 tensor over a 2 x 2 x 2 mesh, then gather, compute and redistribute."""
    mesh = init_device_mesh("cpu", MESH)
    sharded = distribute_tensor(full_tensor(), mesh, placements)
    doubled = sharded * 2                                        # sharding propagation
    moved = sharded.redistribute(mesh, [Shard(1), Replicate(), Shard(0)])
    return {"local": sharded.to_local().clone(), "full": sharded.full_tensor(),
            "doubled": doubled.full_tensor(), "moved_local": moved.to_local().clone(),
            "moved": moved.full_tensor(), "sum": sharded.sum().full_tensor()}


@pytest.mark.parametrize("placements", PLACEMENTS, ids=lambda p: "".join(map(str, p)))
def test_uneven_shards_over_a_3d_mesh_gather_back_to_the_single_device_tensor(placements):
    outs = simcomm.World(WORLD).run(sharding_program, placements, timeout=120)
    full = full_tensor()
    for rank, out in enumerate(outs):
        torch.testing.assert_close(out["local"], local_reference(rank, placements), rtol=0, atol=0)
        torch.testing.assert_close(out["moved_local"],
                                   local_reference(rank, [Shard(1), Replicate(), Shard(0)]), rtol=0, atol=0)
        for name, want in (("full", full), ("doubled", full * 2), ("moved", full)):
            torch.testing.assert_close(out[name], want, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(out["sum"], full.sum())


def test_meshes_of_different_ranks_are_unequal_and_one_ranks_are_equal():
    def program(comm):
        first = init_device_mesh("cpu", (2, 2))
        second = init_device_mesh("cpu", (2, 2))
        return first, second, first == second, hash(first) == hash(second)

    outs = simcomm.World(4).run(program)
    assert all(same and same_hash for _, _, same, same_hash in outs)   # one rank: as one process
    for (mesh_a, *_), (mesh_b, *_) in itertools.combinations(outs, 2):
        assert mesh_a != mesh_b and hash(mesh_a) != hash(mesh_b)
    # the slices of one rank's mesh are that rank's too
    slices = simcomm.World(4).run(lambda comm: init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"])
    assert slices[0] != slices[1] and slices[0] != slices[2]


@pytest.mark.real
def test_uneven_shards_on_gloo_processes_give_the_same(gloo_cluster):
    placements = PLACEMENTS[0]
    real_outs = gloo_cluster(WORLD).run(sharding_program, placements)
    sim_outs = simcomm.World(WORLD).run(sharding_program, placements, timeout=120)
    for real_out, sim_out in zip(real_outs, sim_outs, strict=True):
        assert real_out.keys() == sim_out.keys()
        for name in real_out:
            torch.testing.assert_close(sim_out[name], real_out[name], rtol=0, atol=0, msg=name)
