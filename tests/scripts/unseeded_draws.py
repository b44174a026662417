"""Each rank draws without seeding and reports whether the ranks' numbers differ (torchrun: they do)."""
import random

import numpy as np
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
draws = torch.tensor([torch.rand(1).item(), random.random(), float(np.random.rand())], dtype=torch.float64)
gathered = [torch.empty_like(draws) for _ in range(world_size)]
dist.all_gather(gathered, draws)
differ = [len({round(g[i].item(), 12) for g in gathered}) == world_size for i in range(3)]
print(f"rank{rank}: torch_differ={differ[0]} python_differ={differ[1]} numpy_differ={differ[2]} "
      f"seed={torch.initial_seed()} draws={draws.tolist()}", flush=True)
dist.destroy_process_group()
