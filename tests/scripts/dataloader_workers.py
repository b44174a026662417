"""A DataLoader with worker processes on each rank (its dataset sleeps, as one reading files might),
and a multiprocessing.Process that ends with os._exit: the children are processes of their own
(torchrun: each rank sums 0..15 = 120.0)."""
import multiprocessing
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset


class Numbers(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        time.sleep(0.001)          # in a worker process: a real sleep, nobody's turn to hand on
        return torch.tensor(float(index))


def child(connection):
    connection.send(os.getpid())
    os._exit(7)                    # ends the child process, not the rank that started it


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DataLoader(Numbers(), batch_size=4, num_workers=2)
    total = sum(batch.sum().item() for batch in loader)
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
