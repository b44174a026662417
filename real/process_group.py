"""Choosing the backend and device of a process, and joining a job started by ``torchrun``.

* :func:`pick_backend`: ``"nccl"`` when CUDA is available with at least one GPU
  per local rank, else ``"gloo"``.
* :func:`device_for`: where a rank's tensors live: ``cuda:<local rank>`` under
  NCCL, the CPU under gloo.
* :func:`init_from_env`: ``torchrun``'s env:// rendezvous (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), then a
  :class:`simcomm.Communicator` over the whole job.
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

from simcomm.communicator import Communicator

from .groups import GroupCache
from .transport import DistTransport

__all__ = ["pick_backend", "device_for", "init_from_env"]

BACKENDS = ("gloo", "nccl")


def pick_backend(local_world_size: int, backend: str | None = None) -> str:
    """``backend`` checked, or the default for ``local_world_size`` processes on this node."""
    # device_count() asks NVML where it can: the CUDA driver is not initialised in this process
    # (a Cluster's parent), only in the workers.
    if backend is None:
        return "nccl" if torch.cuda.device_count() >= max(local_world_size, 1) else "gloo"
    name = str(backend).lower()
    if name not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; use one of {list(BACKENDS)} or None")
    if name == "nccl":
        available = torch.cuda.device_count()
        if available < local_world_size:
            raise ValueError(f"backend='nccl' needs one GPU per local rank: {local_world_size} ranks on "
                             f"this node but {available} CUDA device(s) visible")
    return name


def device_for(backend: str, local_rank: int) -> torch.device:
    """The device of the process with ``local_rank`` on its node, made current for NCCL."""
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_from_env(backend: str | None = None, *, timeout: float = 600.0, trace: bool = True
                  ) -> Communicator:
    """Join the job ``torchrun`` started and return the communicator of the whole world.

    Initializes the default process group through the env:// rendezvous
    unless it already is (then its backend is used as it is). ``backend=None``
    picks NCCL when this node has a GPU per local rank (``LOCAL_WORLD_SIZE``),
    else gloo. The communicator's device is ``cuda:LOCAL_RANK`` under NCCL and
    the CPU under gloo. With ``trace`` the transport records simcomm trace
    events, read as a Trace from ``comm.transport.trace``. Blocks until every rank has joined
    (at most ``timeout`` seconds).
    """
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if not dist.is_initialized() and missing:
        raise RuntimeError(f"init_from_env: environment variables {missing} are not set; start the "
                           f"program with torchrun (or use real.run / real.Cluster from one process)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if dist.is_initialized():
        backend = str(dist.get_backend()).lower()
    else:
        backend = pick_backend(local_world_size, backend)
    device = device_for(backend, local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://",
                                timeout=datetime.timedelta(seconds=timeout),
                                **({"device_id": device} if backend == "nccl" else {}))
    events: list | None = [] if trace else None
    transport = DistTransport(dist.group.WORLD, device, events=events, clock_zero=time.perf_counter(),
                              cache=GroupCache())
    return Communicator(transport)
