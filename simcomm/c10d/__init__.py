"""torch.distributed on virtual ranks: the ``"simcomm"`` c10d backend.

Inside :meth:`simcomm.World.run` every rank thread has torch.distributed
initialised (default group = the world, backend ``"simcomm"``), so unmodified
``dist.*`` calls, functional collectives, DTensor, FSDP2 and DDP run on the
simulator: traced, mismatch-checked and deadlock-detected like the
communicator's own calls; ``async_op=True``, ``isend``/``irecv`` and
``batch_isend_irecv`` return a :class:`SimcommWork` backed by the simulator's
handles. :func:`rank_process_group` is the one hook ``World`` enters around
each rank's program.
"""
from .process_group import SimcommProcessGroup
from .rank_state import BACKEND_NAME, rank_process_group
from .work import SimcommWork

__all__ = ["rank_process_group", "SimcommProcessGroup", "SimcommWork", "BACKEND_NAME"]
