"""The c10d ops CommDebugMode counts for one call of each main collective.

Imported by tests/c10d/test_dispatch.py, which runs ``program`` on virtual ranks; run as a
script (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) it is one process of a plain gloo
run, with no simcomm at all, and prints the counts and results as JSON: the reference.
"""
import json

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode


def program(comm=None) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    t = torch.arange(4, dtype=torch.float32) + rank
    gathered = [torch.empty(4) for _ in range(world_size)]
    flat = torch.empty(4 * world_size)
    scattered = torch.empty(2)
    with CommDebugMode() as mode:
        dist.all_reduce(t)
        dist.broadcast(t, 0)
        dist.all_gather(gathered, t)
        dist.all_gather_into_tensor(flat, t)
        dist.reduce_scatter_tensor(scattered, torch.arange(2.0 * world_size) * (rank + 1))
        dist.all_reduce(t, async_op=True).wait()
        reduced = t.clone()
        dist.reduce(t, 0)                # (gloo leaves partial sums off the root: not compared)
        dist.barrier()
    counts = {str(op): count for op, count in mode.get_comm_counts().items()}
    values = [reduced, *gathered, flat, scattered]
    return {"counts": counts, "values": [v.tolist() for v in values]}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    print(json.dumps(program()))
    dist.destroy_process_group()
