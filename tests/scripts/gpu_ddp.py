"""A DDP training script written for GPUs, as published ones are: a GPU-count check,
``torch.cuda.set_device(local_rank)``, ``init_process_group("nccl", device_id=...)``,
``.to(local_rank)``, ``DDP(device_ids=[local_rank])``, pinned non-blocking copies, bf16
autocast with a ``GradScaler``, CUDA events, TF32 flags and memory statistics. Rank 0 prints
the loss averaged over the ranks every ``--log-every`` steps (each step by default; 0: never,
as a shape-only run, which has no loss values, needs), the scaler's state, and saves the model.

Under torchrun it needs one GPU per process; ``python -m simcomm.run`` runs it unmodified on
virtual GPUs. Its CPU twin (tests/sim/test_cuda.py, ``cpu_twin``) is the same text with
"cuda" -> "cpu", "nccl" -> "gloo", the device ids dropped and the lines marked ``# gpu`` left out.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--log-every", type=int, default=1, help="print the loss every N steps (0: never)")
    parser.add_argument("--growth-interval", type=int, default=2000, help="the GradScaler's growth_interval")
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    if not torch.cuda.is_available() or torch.cuda.device_count() < int(os.environ["LOCAL_WORLD_SIZE"]):  # gpu
        raise SystemExit("gpu_ddp.py needs one GPU per process")  # gpu
    torch.cuda.set_device(local_rank)  # gpu
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True

    torch.manual_seed(0)
    torch.cuda.manual_seed_all(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(local_rank)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", growth_interval=args.growth_interval)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # gpu
    torch.cuda.reset_peak_memory_stats()  # gpu
    start.record()  # gpu

    data = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        x = torch.randn(8, 16, generator=data).pin_memory().to(local_rank, non_blocking=True)
        y = torch.randn(8, 4, generator=data).to(device, non_blocking=True)
        noise = torch.randn(8, 4, device=local_rank) * 0.01
        with torch.amp.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
            loss = nn.functional.mse_loss(out.float() + noise, y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0 and args.log_every and (step + 1) % args.log_every == 0:
            print(f"loss step={step} {total.item() / world_size:.9e} scale={scaler.get_scale()}")

    if rank == 0:
        print(f"scaler {scaler.state_dict()}")
    end.record()  # gpu
    torch.cuda.synchronize()  # gpu
    print(f"gpu name={torch.cuda.get_device_name(local_rank)} count={torch.cuda.device_count()} "  # gpu
          f"current={torch.cuda.current_device()} accelerator={torch.accelerator.current_accelerator()} "  # gpu
          f"index={torch.accelerator.current_device_index()} allocated={torch.cuda.memory_allocated()} "  # gpu
          f"peak={torch.cuda.max_memory_allocated()} elapsed={start.elapsed_time(end)} "  # gpu
          f"out_dtype={out.dtype}")  # gpu
    if rank == 0 and args.out:
        torch.save(model.module.state_dict(), os.path.join(args.out, "model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
