"""Each rank configures logging with its rank in the format (torchrun: rank r's records carry [rR])."""
import logging
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
logging.basicConfig(format=f"rank{rank}: log=[r{rank}] %(message)s", level=logging.INFO if rank == 0 else logging.WARNING,
                    stream=sys.stdout)
dist.barrier()                                   # the other rank configures its own in between
logging.getLogger("train").warning("step=1")
logging.getLogger("train").info("info_shown=True")
dist.destroy_process_group()
