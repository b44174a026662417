"""The names torch gives a program's process groups, and what its tables hold.

torch names a group made with ``use_local_synchronization=True`` after its ranks and the
number of groups in ``_world.pg_names``, and the functional collectives find the group for a
list of ranks in ``_world.tags_to_pg``: a program can read both. Imported by
tests/sim/test_run.py, which runs ``program`` on virtual ranks and on real workers (twice in one
Cluster, and after a ``comm.subgroup``); run under torchrun (4 processes) it prints the
reference, one ``names`` line per rank.
"""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d as c10d


def program(comm=None, subgroup: bool = False) -> dict:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    if subgroup:                      # a simcomm subgroup is none of torch's groups
        comm.subgroup([[0, 1], [2, 3]])
    low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
    mine = low if rank < 2 else high
    local = dist.new_group([0, 1, 2, 3], use_local_synchronization=True)
    pair = dist.new_group([rank - rank % 2, rank - rank % 2 + 1], use_local_synchronization=True)
    # the functional collectives find the group for a list of ranks under c10d's default tag
    summed = funcol.all_reduce(torch.tensor([rank + 1.0]), "sum", [rank - rank % 2, rank - rank % 2 + 1])
    world = c10d._world
    return {"summed": funcol.wait_tensor(summed).item(), "world": dist.group.WORLD.group_name, "mine": mine.group_name, "local": local.group_name,
            "pair": pair.group_name, "groups": len(world.pg_names), "count": world.group_count,
            "tagged": sorted(len(groups) for groups in world.tags_to_pg.values())}


if __name__ == "__main__":
    import json
    print("names " + json.dumps(program(), sort_keys=True))
    dist.destroy_process_group()
