"""simcomm: simulate, visualize and verify differentiable collectives.

>>> import simcomm
>>> world = simcomm.World(4)
>>> outs = world.run(program)        # program(comm) on 4 virtual ranks

The package is layered (docs/architecture.md draws the import rule):

=====================  ================================================================
``simcomm`` (this)     the core contract: communicator, checks, autograd rules, the
                       collectives' reference math, one row per collective (specs),
                       the transport protocol, handles, errors, reports, trace, the
                       op vocabulary, memory, the process patches, the backend switch
``simcomm.c10d``       torch.distributed over any transport: the ``"simcomm"`` backend
``simcomm.sim``        virtual ranks: scheduler, rendezvous, SimTransport, World, the
                       per-rank torch.distributed world, gloo's ring order
``simcomm.model``      what the hardware would do: cost model, topologies, timeline
``simcomm.parallel``   the parallelisms the lessons teach (techniques), with references
``simcomm.models``     the models they run: one transformer block family, one Llama
``simcomm.planning``   planner, layout choice, cluster step, activation accounting
``simcomm.lessons``    the lessons' exercise checkers and their verdicts
``simcomm.viz``        figures and widgets
``simcomm.run``        ``python -m simcomm.run``: torchrun scripts on virtual ranks (``run_script``)
=====================  ================================================================
"""
from torch.distributed import ReduceOp

from . import collectives
from .backend import configured_backend
from .communicator import Communicator
from .errors import (
                     CollectiveMismatchError,
                     CommunicatorClosedError,
                     DeadlockError,
                     RankError,
                     RunTimeoutError,
                     SimcommError,
                     UnwaitedHandleError,
                     WrongThreadError,
)
from .handles import Handle, P2POp
from .model import cost, topology
from .sim.world import World
from .trace import Trace, TraceEvent
from .transport import Transport

__all__ = [
    "configured_backend",
    "World", "ReduceOp", "Communicator", "Transport", "Trace", "TraceEvent", "collectives",
    "Handle", "P2POp", "cost", "topology",
    "CollectiveMismatchError", "DeadlockError", "RankError", "RunTimeoutError", "SimcommError",
    "UnwaitedHandleError", "CommunicatorClosedError", "WrongThreadError", "run_script",
]


def __getattr__(name: str):
    # run_script lives in simcomm.run, the module `python -m simcomm.run` executes: imported
    # on first use, so that command does not find its own module imported already
    if name == "run_script":
        from .run import run_script
        return run_script
    raise AttributeError(f"module 'simcomm' has no attribute {name!r}")
__version__ = "0.1.0"
