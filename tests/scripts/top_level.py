# A torchrun script with no main function: every call at the module's top level.
import os

import torch
import torch.distributed as dist

dist.init_process_group(backend="gloo")
rank = dist.get_rank()
assert rank == int(os.environ["RANK"]), (rank, os.environ["RANK"])
ranks = dist.get_process_group_ranks(dist.group.WORLD)
value = torch.tensor([rank + 1.0])
dist.all_reduce(value, op=dist.ReduceOp.MAX)
print(f"loss top-level ranks={ranks} max={value.item()} initialized={dist.is_initialized()}")
dist.destroy_process_group()
print(f"after destroy initialized={dist.is_initialized()}")
