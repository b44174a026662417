"""A pipeline schedule with torch.distributed.pipelining: each rank holds one stage of a
stack of linears and runs GPipe or 1F1B over microbatches; the last stage prints the loss."""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8) for _ in range(2 * world_size)]    # the whole model, on every rank
    stage_module = nn.Sequential(*layers[2 * rank:2 * rank + 2])
    stage = PipelineStage(stage_module, rank, world_size, torch.device("cpu"))
    schedule_class = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
    schedule = schedule_class(stage, n_microbatches=4, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=0.1)
    for step in range(args.steps):
        torch.manual_seed(10 + step)
        x, y = torch.randn(8, 8), torch.randn(8, 8)
        losses = []
        if rank == 0:
            schedule.step(x)
        elif rank == world_size - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        if rank == world_size - 1:
            print(f"loss step={step} {torch.stack(losses).mean().item():.9e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
