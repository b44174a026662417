"""Each rank saves its gradient to grad_<pid>.pt; rank 0 reads every rank's back (torchrun: 2 files,
sum 1.0). The pids are distinct, stable, and ids the kernel knows (os.kill with signal 0)."""
import glob
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
pid = os.getpid()
torch.save(torch.tensor([float(rank)]), f"grad_{pid}.pt")
dist.barrier()
files = sorted(glob.glob("grad_*.pt"))
total = sum(torch.load(name).item() for name in files)
pids = [None] * dist.get_world_size()
dist.all_gather_object(pids, pid)
os.kill(pid, 0)                                  # raises if no such process
print(f"rank{rank}: files={len(files)} sum={total} distinct={len(set(pids)) == len(pids)} "
      f"stable={os.getpid() == pid} alive=True", flush=True)
dist.barrier()
os.remove(f"grad_{pid}.pt")
dist.destroy_process_group()
