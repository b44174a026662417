"""A torchrun script that logs through a module configured once per process with its rank
(rank_log.py): every line a rank logs carries that rank."""
import torch
import torch.distributed as dist

import rank_log


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logger = rank_log.setup(rank)
    logger.setLevel("INFO")
    dist.barrier()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    rank_log.info(f"sum={value.item():.0f} configured_for={rank_log._configured_for}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
