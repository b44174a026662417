"""FSDP2 (fully_shard) training with a torch.distributed.checkpoint (DCP) save and load,
as PyTorch's FSDP2 example does: train, save a sharded checkpoint to --out, build a fresh
model, load the checkpoint into it, check it equals the trained one, train on."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.fsdp import fully_shard


def build() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def train(model, optimizer, steps, first):
    rank = dist.get_rank()
    for step in range(first, first + steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)   # each rank its own batch
        x = torch.randn(4, 6, generator=generator)
        y = torch.randn(4, 2, generator=generator)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        print(f"loss step={step} {mean.item():.9e}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("cpu:gloo")
    model = build()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    train(model, optimizer, 3, 0)
    checkpoint = os.path.join(args.out, "checkpoint")
    dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=checkpoint)
    fresh = build()
    state = {"model": get_model_state_dict(fresh)}
    dcp.load(state, checkpoint_id=checkpoint)
    set_model_state_dict(fresh, state["model"])
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a.to_local(), b.to_local()), name
    train(fresh, torch.optim.Adam(fresh.parameters(), lr=0.01), 2, 3)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
