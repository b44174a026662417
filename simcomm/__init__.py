"""simcomm: simulate, visualize and verify differentiable collectives.

>>> import simcomm
>>> world = simcomm.World(4)
>>> outs = world.run(program)        # program(comm) on 4 virtual ranks
"""
from torch.distributed import ReduceOp

from . import collectives
from .backend import configured_backend
from .communicator import Communicator
from .errors import (CollectiveMismatchError, CommunicatorClosedError, DeadlockError, RankError,
                     RunTimeoutError, SimcommError, WrongThreadError)
from .handles import Handle, P2POp, UnwaitedHandleError
from .trace import Trace, TraceEvent
from .transport import Transport
from .world import World

__all__ = [
    "configured_backend",
    "World", "ReduceOp", "Communicator", "Transport", "Trace", "TraceEvent", "collectives",
    "Handle", "P2POp",
    "CollectiveMismatchError", "DeadlockError", "RankError", "RunTimeoutError", "SimcommError",
    "UnwaitedHandleError", "CommunicatorClosedError", "WrongThreadError",
]
__version__ = "0.1.0"
