"""A program's own ``dist.init_process_group(...)`` joins the run it runs in, as under torchrun.

Every torchrun script calls ``init_process_group``; inside a run the run's world
already stands (a virtual rank's, made on first use, or a real worker's gloo or
NCCL group). :func:`install_init_join` puts ``init_process_group`` in torch's
place: a call whose arguments agree with the run returns at once, having joined
it; one that disagrees raises naming what disagrees
(:func:`check_init_arguments`). Everywhere else the call is torch's own.

Who serves the call is registered here, so this module knows no backend: the
simulator registers a *thread join* (``thread_join=``, answering on a virtual
rank's thread: :mod:`simcomm.sim.dist_world`), a real worker registers its
process's world (``process_world=True``).
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .process_group import BACKEND_NAME, install_group_tags

__all__ = ["install_init_join", "uninstall_init_join", "check_init_arguments", "JOINABLE_BACKENDS",
           "ThreadJoin", "original_init_process_group"]

#: torch's own ``init_process_group`` (what the joining one calls outside a run)
original_init_process_group = c10d.init_process_group
#: the backend names a program may ask for: every one is served by the run's own world
#: (the simulator on virtual ranks; the worker's gloo or NCCL group on real workers)
JOINABLE_BACKENDS = ("gloo", "nccl", BACKEND_NAME, "undefined")

#: ``join(backend, world_size, rank, init_method, timeout) -> bool``: True when it served the
#: call (the calling thread is a rank of a run), False to let the next rule decide
ThreadJoin = Callable[[Any, int, int, Any, Any], bool]

_process_world_joins = False     # a real worker: the process's default group is the run's world
_thread_join: ThreadJoin | None = None


def install_init_join(*, process_world: bool = False, thread_join: ThreadJoin | None = None) -> None:
    """Make ``dist.init_process_group`` join the run a program runs in, as under torchrun.

    ``thread_join`` (the simulator's): a call on a thread it answers for is served
    by it; on a real worker (``process_world=True``, called once by the worker after
    it joined its group) the process's default group is the run's world. There, a
    call whose arguments agree with the run (see :func:`check_init_arguments`)
    returns at once, having joined it; one that disagrees raises ``ValueError``
    naming what disagrees. Everywhere else the call is torch's own.
    """
    global _process_world_joins, _thread_join
    install_group_tags()
    if process_world:
        _process_world_joins = True
    if thread_join is not None:
        _thread_join = thread_join
    if dist.init_process_group is not init_process_group:    # simcomm.patches: "init-process-group"
        dist.init_process_group = init_process_group
        c10d.init_process_group = init_process_group
    # DeviceMesh creates the default group itself when none stands, through the name it imported
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    if getattr(mesh_module, "init_process_group", None) is original_init_process_group:
        mesh_module.init_process_group = init_process_group


def uninstall_init_join() -> None:
    """Put torch's own ``init_process_group`` back (and forget who served the calls)."""
    global _process_world_joins, _thread_join
    _process_world_joins, _thread_join = False, None
    if dist.init_process_group is init_process_group:
        dist.init_process_group = original_init_process_group
    if c10d.init_process_group is init_process_group:
        c10d.init_process_group = original_init_process_group
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    if getattr(mesh_module, "init_process_group", None) is init_process_group:
        mesh_module.init_process_group = original_init_process_group


def check_init_arguments(backend: Any, world_size: int, rank: int, init_method: Any,
                         run_rank: int, run_world_size: int, nccl: bool = True) -> None:
    """Raise ``ValueError`` unless ``init_process_group(backend, world_size=, rank=,
    init_method=)`` on rank ``run_rank`` agrees with a run of ``run_world_size`` ranks.

    ``world_size``/``rank`` of ``-1`` (torch's default: read them from the environment,
    which the launcher set to agree) are accepted; ``backend`` may be ``None``, one of
    :data:`JOINABLE_BACKENDS`, or a device map such as ``"cpu:gloo,cuda:nccl"``;
    ``init_method`` may be ``None`` or any URL (``env://``, ``tcp://``, ``file://``):
    the run is the rendezvous. ``nccl=False`` (a torch without NCCL, real tensors on
    the CPU) refuses ``"nccl"`` with ``RuntimeError`` as torchrun's processes would.
    """
    where = f"init_process_group on rank {run_rank}"
    if backend is not None:
        if not isinstance(backend, str):
            raise ValueError(f"{where}: backend={backend!r} must be a backend name (a str) or None")
        for piece in backend.lower().split(","):
            name = piece.split(":", 1)[-1].strip()
            if name not in JOINABLE_BACKENDS:
                raise ValueError(
                    f"{where}: backend={backend!r}: {name!r} cannot be served here; the run's world "
                    f"stands for any of {list(JOINABLE_BACKENDS[:3])} (alone or as a device map "
                    f"such as 'cpu:gloo,cuda:nccl')")
            if name == "nccl" and not nccl:
                raise RuntimeError(
                    f"{where}: backend={backend!r} needs NCCL, and this torch has none "
                    f"(dist.is_nccl_available() is False): under torchrun its processes fail "
                    f"the same way (\"Distributed package doesn't have NCCL built in\"). Use "
                    f"'gloo', or plan the GPU run shape-only (--tensors shape)")
    if init_method is not None and not isinstance(init_method, str):
        raise ValueError(f"{where}: init_method={init_method!r} must be a URL string or None")
    if world_size not in (-1, None) and world_size != run_world_size:
        raise ValueError(
            f"{where}: world_size={world_size!r} disagrees with the run, which has "
            f"{run_world_size} ranks; pass world_size={run_world_size} or leave it out "
            f"(torchrun's WORLD_SIZE)")
    if rank not in (-1, None) and rank != run_rank:
        raise ValueError(
            f"{where}: rank={rank!r} disagrees with the run: this is rank {run_rank} of "
            f"{run_world_size}; pass rank={run_rank} (e.g. int(os.environ['RANK'])) or leave it out")


@functools.wraps(original_init_process_group)
def init_process_group(backend: str | None = None, init_method: str | None = None, timeout=None,
                       world_size: int = -1, rank: int = -1, store: dist.Store | None = None,
                       group_name: str = "", pg_options: Any = None, device_id: Any = None,
                       **kwargs: Any) -> None:
    """torch's ``init_process_group``, which inside a run joins the run's world
    (:func:`install_init_join`); ``store``, ``group_name``, ``pg_options`` and ``device_id``
    are then accepted and have no effect; on virtual ranks ``timeout`` bounds each wait in
    the rank's groups, as gloo's does (:mod:`simcomm.sim.dist_world`)."""
    if _thread_join is not None and _thread_join(backend, world_size, rank, init_method, timeout):
        return None
    if _process_world_joins and c10d.is_initialized():
        check_init_arguments(backend, world_size, rank, init_method, dist.get_rank(),
                             dist.get_world_size(), nccl=dist.is_nccl_available())
        return None
    return original_init_process_group(backend, init_method, timeout, world_size, rank, store,
                                       group_name, pg_options, device_id, **kwargs)
