"""A small transformer overfitting one batch per dp rank, trained with tensor parallel inside FSDP2 on a 2-D mesh (dp x tp), as
PyTorch's FSDP+TP example and torchtitan lay it out: attention heads and the MLP's hidden
units split over "tp" (ColwiseParallel in, RowwiseParallel out), every block and the root
sharded over "dp" with fully_shard, AdamW. Each dp rank trains on its own batch; the loss
printed is the mean over the dp ranks.

    torchrun --standalone --nproc-per-node 4 tests/scripts/transformer_2d.py
    python -m simcomm.run --nproc-per-node 4 tests/scripts/transformer_2d.py
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.o = nn.Linear(width, width, bias=False)

    def forward(self, x):
        batch, seq, _ = x.shape
        # local heads: ColwiseParallel leaves heads / tp of them on each rank
        q, k, v = (proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)  # (b, h/tp, s, d)
                   for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)          # (b, h/tp, s, d)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))            # (b, s, width)


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = Attention(width, heads)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    world_size = int(os.environ["WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Transformer()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {
            "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(),
            "attention.v": ColwiseParallel(), "attention.o": RowwiseParallel(),
            "up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(args.steps):
        generator = torch.Generator().manual_seed(dp_rank)   # each dp rank its own batch, every step
        tokens = torch.randint(0, 64, (4, 17), generator=generator)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        if dist.get_rank() == 0:
            print(f"loss step={step} {mean.item():.9e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
