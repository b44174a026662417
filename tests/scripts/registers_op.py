"""A torchrun script using an operator its library registers with torch at import
(registers_op_lib.py): each process imports it once."""
import torch
import torch.distributed as dist

import registers_op_lib


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    registers_op_lib.IMPORTED_BY.append(rank)
    value = registers_op_lib.scale(torch.tensor([float(rank + 1)]), 3.0)
    dist.all_reduce(value)
    print(f"scaled_sum={value.item():.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
