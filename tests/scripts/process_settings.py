"""Once-per-process settings on every rank: mp.set_start_method and a SIGTERM handler (torchrun:
each process's first call succeeds, a second set_start_method raises, the handler is its own)."""
import multiprocessing as mp
import signal

import torch.distributed as dist
import torch.multiprocessing as tmp

dist.init_process_group("gloo")
rank = dist.get_rank()
mp.set_start_method("spawn")
dist.barrier()                                   # the other rank sets its own in between
try:
    tmp.set_start_method("fork")
    second = "accepted"
except RuntimeError as error:
    second = "refused" if "already been set" in str(error) else repr(error)


def on_term(signum, frame):
    pass


previous = signal.signal(signal.SIGTERM, on_term)
dist.barrier()
print(f"rank{rank}: method={mp.get_start_method()} second={second} "
      f"handler_mine={signal.getsignal(signal.SIGTERM) is on_term} previous_default={previous == signal.SIG_DFL}",
      flush=True)
dist.destroy_process_group()
