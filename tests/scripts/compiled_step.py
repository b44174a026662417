"""torch.compile of a small function on each rank, then an all_reduce of its result
(torchrun: every rank prints the same reduced sum)."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()


@torch.compile
def step(x):
    return torch.sin(x) * 2 + x.square()


x = torch.arange(4, dtype=torch.float32) + rank
out = step(x)
expected = torch.sin(x) * 2 + x.square()
dist.all_reduce(out)
print(f"rank{rank}: matches={torch.allclose(step(x), expected)} reduced={round(out.sum().item(), 4)}", flush=True)
dist.destroy_process_group()
