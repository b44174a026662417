"""A torchrun script whose parallel layout lives in a sibling module's global
(process_group_manager.py, picotron's pattern): each rank sets it up, then reads it back,
also through ``from ... import`` in a helper, after collectives over its groups."""
import argparse

import torch
import torch.distributed as dist

import process_group_manager as pgm
from process_group_manager import setup_process_group_manager


def tp_sum(value: float) -> float:
    from process_group_manager import process_group_manager as manager
    tensor = torch.tensor([value])
    dist.all_reduce(tensor, group=manager.tp_group)
    return tensor.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    setup_process_group_manager(args.tp, dist.get_world_size() // args.tp)
    dist.barrier()
    manager = pgm.process_group_manager
    total = tp_sum(float(manager.global_rank))
    dp = torch.tensor([float(manager.global_rank)])
    dist.all_reduce(dp, group=manager.dp_group)
    print(f"rank={manager.global_rank} tp_rank={manager.tp_rank} dp_rank={manager.dp_rank} "
          f"tp_ranks={manager.tp_ranks} dp_ranks={manager.dp_ranks} tp_sum={total:.0f} "
          f"dp_sum={dp.item():.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
