"""A torchrun script that reports what its process sees: environment, argv, __main__,
random numbers (Python, NumPy, torch), and a collective through init_process_group."""
import argparse
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist

COUNTER = []          # a module-level singleton: one per process under torchrun, one per rank here


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", default="none")
    parser.add_argument("--exit", type=int, default=None, help="sys.exit with this code on the last rank")
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method="env://")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    COUNTER.append(rank)
    names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "MASTER_ADDR", "MASTER_PORT")
    env = {name: os.environ.get(name) for name in names}
    print(f"env {' '.join(f'{k}={env[k]}' for k in names)} getenv={os.getenv('RANK')}")
    print(f"argv {sys.argv[1:]} tag={args.tag} main={__name__} counter={COUNTER}")
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    first = (random.random(), float(np.random.rand()), float(torch.rand(())))
    dist.barrier()
    second = (random.random(), float(np.random.randn()), float(torch.randn(())))
    print(f"random {first!r} {second!r}")
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    print(f"sum {total.item()}")
    if args.exit is not None and rank == world_size - 1:
        sys.exit(args.exit)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
