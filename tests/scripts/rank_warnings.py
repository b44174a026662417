"""Warnings per process: each rank's filters, catch_warnings records and "default" registry are
its own, as each torchrun process's are (a barrier inside each block hands the turn over on
virtual ranks). Prints what each rank saw; a shown "default" warning goes to stderr."""
import warnings

import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()


def tell(text):
    warnings.warn(text, UserWarning, stacklevel=2)


# a "default" warning shows once per location in each process, however often it is made
for _ in range(2):
    tell("shown once by each process")
    dist.barrier()

# each rank records its own warnings, not the other's, while the other records too
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    tell(f"first of rank {rank}")
    dist.barrier()
    tell(f"second of rank {rank}")
    dist.barrier()
print(f"rank {rank} recorded {[str(w.message) for w in seen]}", flush=True)

# a filter one rank sets is its own: rank 0 makes warnings errors, rank 1 ignores them
warnings.simplefilter("error" if rank == 0 else "ignore")
dist.barrier()
try:
    tell(f"filtered on rank {rank}")
    outcome = "passed"
except UserWarning as error:
    outcome = f"raised {error}"
print(f"rank {rank} {outcome}", flush=True)
dist.destroy_process_group()
