"""Run a program on PyTorch's threaded process group, the side the benchmarks compare with.

``torch.testing._internal.distributed.multi_threaded_pg``: one thread per rank, each
its own default group (thread isolation mode). Shared by ``cpu_per_rank.py`` and
``torch_distributed.py``; imported as a sibling module (both run as scripts).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def run(world_size: int, program: Callable[..., Any], *args: Any) -> list:
    """``program(None, *args)`` on every rank thread after ``init_process_group("threaded")``;
    the ranks' return values in rank order. The first rank error is raised after every
    thread has ended; the threaded backend is uninstalled again either way."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)   # a group registry per thread
    mtpg._install_threaded_pg()
    store = dist.HashStore()
    results: list = [None] * world_size
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            results[rank] = program(None, *args)
            dist.destroy_process_group()
        except BaseException as error:   # re-raised below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(world_size)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    return results
