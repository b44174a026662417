"""A torchrun script whose library keeps per-process state in class-level dicts
(borg_state_lib.py, the pattern of accelerate's PartialState/GradientState). Each rank
makes its state, meets the others in collectives, and prints what its state says: under
torchrun each process has its own, so each rank prints its own rank."""
import argparse

import torch
import torch.distributed as dist

from borg_state_lib import ProcessState, make_state
import borg_state_lib


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-sum", action="store_true", help="leave the sum out (shape-only ranks)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    state = make_state("first")
    dist.barrier()                       # every rank has made its state before any reads it
    again = ProcessState()
    for _ in range(3):
        again.step()
        total = torch.tensor([float(again.process_index + 1)])
        dist.all_reduce(total)
    print(f"process_index={again.process_index} num_processes={again.num_processes} "
          f"main={again.is_main_process} steps={state.steps} created={borg_state_lib.CREATED}"
          + ("" if args.no_sum else f" sum={total.item():.1f}"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
