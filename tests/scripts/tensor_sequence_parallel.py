"""Tensor and sequence parallel with init_device_mesh, as PyTorch's tensor_parallel examples do:
an MLP block (norm -> w1 -> relu -> w2) whose linears are split column- then row-wise, trained
with SGD; with --sequence-parallel the norm runs on sequence shards. Prints each step's loss."""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.w1 = nn.Linear(width, 4 * width)
        self.w2 = nn.Linear(4 * width, width)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(self.norm(x))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    world_size = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Block(8)
    if args.sequence_parallel:
        plan = {"norm": SequenceParallel(),
                "w1": ColwiseParallel(input_layouts=Shard(1)),
                "w2": RowwiseParallel(output_layouts=Shard(1))}
    else:
        plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
    model = parallelize_module(model, mesh, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(args.steps):
        torch.manual_seed(100 + step)       # every rank draws the same batch
        x = torch.randn(2, 4 * world_size, 8)
        target = torch.randn(2, 4 * world_size, 8)
        if args.sequence_parallel:
            rank = dist.get_rank()
            seq = x.shape[1] // world_size
            x, target = x[:, rank * seq:(rank + 1) * seq], target[:, rank * seq:(rank + 1) * seq]
        out = model(x)
        local = out.to_local() if hasattr(out, "to_local") else out
        loss = ((local - target) ** 2).sum() / (2 * 4 * world_size * 8)   # the mean over the full batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if args.sequence_parallel:
            dist.all_reduce(total)
        print(f"loss step={step} {total.item():.9e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
