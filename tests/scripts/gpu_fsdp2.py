"""FSDP2 written for any accelerator, as PyTorch's newer examples are:
``torch.accelerator.current_accelerator()``, ``set_device_index(local_rank)``, the device's
default backend (``"nccl"`` for CUDA), ``init_device_mesh(device.type, ...)``, ``fully_shard``
per layer and at the root, a DataLoader with a DistributedSampler and pinned batches, memory
statistics, and a DCP checkpoint of the model. Rank 0 prints the loss averaged over the ranks.

Under torchrun it needs one GPU per process; ``python -m simcomm.run`` runs it unmodified on
virtual GPUs. Its CPU twin (tests/sim/test_cuda.py, ``cpu_twin``) takes the CPU as the device
and leaves out the lines marked ``# gpu``.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--width", type=int, default=32)
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.accelerator.current_accelerator()
    torch.accelerator.set_device_index(local_rank)  # gpu
    dist.init_process_group(dist.get_default_backend_for_device(device))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world_size,))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, args.width), nn.Tanh(), nn.Linear(args.width, args.width), nn.Tanh(),
                          nn.Linear(args.width, 4)).to(device)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    generator = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(64, 16, generator=generator), torch.randn(64, 4, generator=generator))
    sampler = DistributedSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=8, sampler=sampler, pin_memory=True)
    step = 0
    for x, y in loader:
        if step == args.steps:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"loss step={step} {total.item() / world_size:.9e}")
        step += 1
    torch.accelerator.synchronize()  # gpu
    print(f"gpu count={torch.accelerator.device_count()} index={torch.accelerator.current_device_index()} "  # gpu
          f"allocated={torch.cuda.memory_allocated()} peak={torch.cuda.max_memory_allocated()}")  # gpu
    if args.out:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(args.out, "checkpoint"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
