"""The configured backend: virtual ranks or real processes, chosen by ``SIMCOMM_BACKEND``.

A notebook or test asks for ``configured_backend(world_size)`` and runs its
programs on what it gets; switching to real processes is a matter of the
environment, not of the code:

=====================  ================================================
``SIMCOMM_BACKEND``    what :func:`configured_backend` returns
=====================  ================================================
unset, ``sim``         :class:`simcomm.World` (threads in this process)
``real``               ``real.Cluster`` (worker processes; gloo or NCCL)
=====================  ================================================

Both have ``run(program, *args, **kwargs)``, ``trace`` and ``close()``, and
both are context managers.
"""
from __future__ import annotations

import os
from typing import Any

from .sim.world import World

__all__ = ["configured_backend", "backend_name", "BACKEND_ENV"]

BACKEND_ENV = "SIMCOMM_BACKEND"
_NAMES = ("sim", "real")


def backend_name() -> str:
    """The backend ``SIMCOMM_BACKEND`` selects: ``"sim"`` (default) or ``"real"``."""
    value = os.environ.get(BACKEND_ENV)
    if value is None or value.strip() == "":
        return "sim"
    name = value.strip().lower()
    if name not in _NAMES:
        raise ValueError(f"{BACKEND_ENV}={value!r} is not a backend; use one of {list(_NAMES)}")
    return name


def configured_backend(world_size: int, **kwargs: Any):
    """A :class:`simcomm.World` or a ``real.Cluster`` of ``world_size`` ranks, per ``SIMCOMM_BACKEND``.

    ``kwargs`` go to the constructor (``World``: ``device``, ``trace``;
    ``Cluster``: ``backend``, ``timeout``, ``trace``). A Cluster starts its
    worker processes at once; close it (or use ``with``) when done.
    """
    if backend_name() == "sim":
        return World(world_size, **kwargs)
    import real  # imported here only: simcomm does not depend on real

    return real.Cluster(world_size, **kwargs)
