"""A script's own FileStore (its file in the folder given as the argument): rank 1 sets a key
after some work, rank 0 reads it with get; rank 1 waits for rank 0's reply (torchrun: both read
the other's key)."""
import os
import sys
import time

import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.FileStore(os.path.join(sys.argv[1], "store"), world)
if rank == 1:
    time.sleep(0.2)
    store.set("question", "from-rank-1")
    store.wait(["reply"])
    print(f"rank1: reply={store.get('reply').decode()}", flush=True)
else:
    question = store.get("question").decode()
    store.set("reply", "from-rank-0")
    print(f"rank0: question={question}", flush=True)
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
