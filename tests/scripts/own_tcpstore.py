"""A script's own TCPStore: the server on rank 0 (port MASTER_PORT + 1), a client on every other
rank; rank 1 sets a key that rank 0 reads with get and wait; a barrier made of the store (add,
then rank 0 polls the count and sets "go", which the others wait for); then the default group is
made over the same store (torchrun: every rank reads the key and reduces to the world size)."""
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1, world,
                      is_master=rank == 0, timeout=timedelta(seconds=60))
if rank == 1:
    time.sleep(0.1)
    store.set("weights", "from-rank-1")
got = "-"
if rank == 0:
    got = store.get("weights").decode()
    store.wait(["weights"], timedelta(seconds=30))
store.add("arrived", 1)
if rank == 0:
    while int(store.add("arrived", 0)) < world:
        time.sleep(0.01)
    store.set("go", "1")
else:
    store.wait(["go"])
arrived = int(store.add("arrived", 0))
dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank{rank}: got={got} arrived={arrived} go={store.get('go').decode()} total={total.item():g}",
      flush=True)
dist.barrier()
dist.destroy_process_group()
