"""real: simcomm's communicator on real processes (``torch.distributed``: NCCL on GPUs, gloo on CPU).

>>> import real
>>> outs = real.run(program, *args, world_size=4)   # program(comm, *args) on 4 processes
>>> with real.Cluster(world_size=4) as cluster:     # workers stay up between runs
...     outs = cluster.run(program, *args)
>>> comm = real.init_from_env()                     # inside a torchrun job

The program, the communicator's methods and their gradients are the same as
on :class:`simcomm.World`'s virtual ranks. ``python -m real.verify`` checks a
node against the single-device reference.
"""
from simcomm.errors import RemoteError, ResultError, WorkerError

from .communicator import DeviceCommunicatorBase
from .launcher import Cluster, Results, run
from .process_group import device_for, init_from_env, pick_backend
from .startup import interactive, prestart
from .groups import GroupCache
from .transport import DistTransport

__all__ = [
    "run", "Cluster", "prestart", "Results", "WorkerError", "ResultError", "RemoteError", "init_from_env",
    "pick_backend", "device_for", "DistTransport", "GroupCache", "DeviceCommunicatorBase",
]

if interactive():
    prestart()           # the workers' forkserver imports torch while the notebook goes on
