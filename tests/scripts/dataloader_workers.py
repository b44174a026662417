"""A DataLoader with worker processes on each rank, and a multiprocessing.Process that ends with
os._exit: the children are processes of their own (torchrun: each rank sums 0..15 = 120.0)."""
import multiprocessing
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset


def child(connection):
    connection.send(os.getpid())
    os._exit(7)                    # ends the child process, not the rank that started it


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DataLoader(TensorDataset(torch.arange(16.0)), batch_size=4, num_workers=2)
    total = sum(batch[0].sum().item() for batch in loader)
    summed = torch.tensor([total])
    dist.all_reduce(summed)
    receiving, sending = multiprocessing.get_context("fork").Pipe(duplex=False)
    process = multiprocessing.get_context("fork").Process(target=child, args=(sending,))
    process.start()
    child_pid = receiving.recv() if receiving.poll(60) else None
    process.join(timeout=60)
    print(f"rank{rank}: total={total} summed={summed.item()} child_exitcode={process.exitcode} "
          f"child_pid_differs={child_pid != os.getpid()}", flush=True)
    dist.destroy_process_group()
