"""torch.distributed over any transport: the ``"simcomm"`` c10d backend.

A :class:`SimcommProcessGroup` is a c10d ProcessGroup whose every call is one
translation (:mod:`simcomm.c10d.ops`) onto a :class:`~simcomm.transport.Transport`:
the simulator's on virtual ranks (inside :meth:`simcomm.World.run` every rank
thread has torch.distributed initialised, default group = the world, backend
``"simcomm"``: :mod:`simcomm.sim.dist_world`), a real worker's in
:mod:`real.checked_pg`. So unmodified ``dist.*`` calls, functional collectives,
DTensor, FSDP2 and DDP are traced, mismatch-checked and deadlock-detected like
the communicator's own calls; ``async_op=True``, ``isend``/``irecv`` and
``batch_isend_irecv`` return a :class:`SimcommWork` backed by the transport's
handles. This package imports no simulator module.
"""
from .process_group import BACKEND_NAME, SimcommProcessGroup
from .work import SimcommWork

__all__ = ["SimcommProcessGroup", "SimcommWork", "BACKEND_NAME"]
