"""A torchrun script whose rank 1 fails after step 1 while rank 0 works on: rank 0's step-2
line and checkpoint come before it needs rank 1 again (the step-2 all_reduce), so a launcher
that loses nothing shows both. Its --how says how rank 1 ends."""
import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", default="raise",
                        choices=["raise", "exit", "os_exit", "segv", "abort", "none"])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    weight = torch.zeros(4)
    for step in (1, 2, 3):
        weight += torch.full((4,), float(step * (rank + 1)))     # this rank's own work
        print(f"step {step} local {weight.sum().item()}", flush=True)
        if rank == 0:
            torch.save(weight.clone(), os.path.join(args.out, f"ckpt_step{step}.pt"))
        if step == 2 and rank == 1:
            if args.how == "raise":
                raise RuntimeError("rank 1 fails after step 1")
            if args.how == "exit":
                sys.exit(3)
            if args.how == "os_exit":
                os._exit(3)
            if args.how == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if args.how == "abort":
                os.abort()
        dist.all_reduce(weight)
        print(f"step {step} reduced {weight.sum().item()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
