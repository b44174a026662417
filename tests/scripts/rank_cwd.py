"""Each rank works in a folder of its own (os.chdir) with relative paths; then each reads back its
own file and rank 0 sees both folders side by side (torchrun: state 0.0 and 1.0, no nesting)."""
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
start = os.getcwd()
os.makedirs(f"work{rank}", exist_ok=True)
os.chdir(f"work{rank}")
torch.save(torch.tensor([float(rank)]), "state.pt")
dist.barrier()
mine = torch.load("state.pt").item()
dist.barrier()
siblings = sorted(name for name in os.listdir("..") if name.startswith("work"))
print(f"rank{rank}: state={mine} folder={os.path.basename(os.getcwd())} siblings={','.join(siblings)} "
      f"nested={os.path.exists('work1')}", flush=True)
dist.destroy_process_group()
