"""Two ranks meet through files, each polling with time.sleep: rank 1 writes ready.txt after some
work, rank 0 polls for it, then answers with ack.txt, which rank 1 polls for (torchrun: both see
the other's file; no collective before the files). The folder is the script's argument."""
import os
import sys
import time

import torch
import torch.distributed as dist

folder = sys.argv[1]
rank = int(os.environ["RANK"])
ready, ack = os.path.join(folder, "ready.txt"), os.path.join(folder, "ack.txt")
if rank == 1:
    total = torch.arange(1000, dtype=torch.float64).sum().item()        # some work first
    time.sleep(0.2)
    with open(ready + ".tmp", "w") as out:
        out.write(f"total={total:g}")
    os.replace(ready + ".tmp", ready)
    while not os.path.exists(ack):
        time.sleep(0.05)
    with open(ack) as answer:
        print(f"rank1: wrote=ready.txt read={answer.read()}", flush=True)
else:
    polls = 0
    while not os.path.exists(ready):
        time.sleep(0.05)
        polls += 1
    with open(ready) as data:
        seen = data.read()
    with open(ack + ".tmp", "w") as out:
        out.write("ok-from-0")
    os.replace(ack + ".tmp", ack)
    print(f"rank0: read={seen} polled={polls > 0}", flush=True)
dist.init_process_group("gloo")
dist.barrier()
if rank == 0:
    os.remove(ready)
    os.remove(ack)
dist.destroy_process_group()
