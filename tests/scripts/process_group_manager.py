"""A sibling module holding the process's parallel layout in a module global, as picotron's
``process_group_manager`` does: ``setup_process_group_manager`` fills it once per process and
every other module reads it. Imported by pgm_grid.py."""
import torch.distributed as dist


class ProcessGroupManager:
    def __init__(self, tp_size: int, dp_size: int):
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        assert self.world_size == tp_size * dp_size, (self.world_size, tp_size, dp_size)
        self.dp_rank, self.tp_rank = divmod(self.global_rank, tp_size)
        self.tp_group = None
        self.dp_group = None
        for dp in range(dp_size):             # every rank makes every group, in the same order
            ranks = [dp * tp_size + tp for tp in range(tp_size)]
            group = dist.new_group(ranks)
            if self.global_rank in ranks:
                self.tp_group, self.tp_ranks = group, ranks
        for tp in range(tp_size):
            ranks = [dp * tp_size + tp for dp in range(dp_size)]
            group = dist.new_group(ranks)
            if self.global_rank in ranks:
                self.dp_group, self.dp_ranks = group, ranks


process_group_manager: ProcessGroupManager | None = None


def setup_process_group_manager(tp_size: int, dp_size: int) -> None:
    global process_group_manager
    process_group_manager = ProcessGroupManager(tp_size, dp_size)
