"""Virtual ranks: N ranks of one program as threads of this process, taking turns.

The call chain of one collective on a virtual rank::

    World.run (world.py)                      one thread per rank, a RunState for the run
      -> Communicator.all_reduce              checks, autograd (simcomm.communicator, simcomm.autograd)
        -> SimTransport.all_reduce (transport.py)
          -> the group's Slot (rendezvous.py)  the last rank to arrive computes simcomm.collectives
                                                 (reductions: gloo's ring order, ring_order.py)
          -> RunState.release_and_wait (scheduler.py)   the others block; the turn passes on

``pending.py`` holds what an asynchronous call's handle waits on, ``waits.py``
the deadlock and timeout reports, ``rank_random.py`` each rank's own torch
generators, ``process_state.py`` the rest of what each process has to itself
(Python's and NumPy's random state, ``sys.argv``, ``__main__``, environment
variables), ``shape.py`` shape-only ranks (fake tensors) and ``fake_cache.py`` the
dispatch cache they share.
"""
from .scheduler import RunState
from .transport import SimTransport
from .world import World

__all__ = ["World", "RunState", "SimTransport"]
