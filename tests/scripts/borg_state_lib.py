"""A library module keeping per-process state in the borg pattern (as accelerate's
``PartialState`` does): every instance shares one class-level dict, filled by the first
instance made in the process. Imported by borg_state.py."""
import os

import torch.distributed as dist


class ProcessState:
    _shared_state: dict = {}

    def __init__(self):
        self.__dict__ = self._shared_state
        if not self._shared_state:
            self.process_index = int(os.environ["RANK"])
            self.num_processes = int(os.environ["WORLD_SIZE"])
            self.is_main_process = self.process_index == 0
            self.steps = 0

    def step(self) -> int:
        self.steps += 1
        return self.steps


#: a module-level registry as libraries keep one: each process's own
CREATED: list[str] = []


def make_state(tag: str) -> ProcessState:
    CREATED.append(f"{tag}@{dist.get_rank() if dist.is_initialized() else '-'}")
    return ProcessState()
