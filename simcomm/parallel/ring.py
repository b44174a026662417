"""The ring: its all-reduce schedule and the neighbour exchange it is built from.

Written once here; the lessons' ``ring_all_reduce``, the ring animation
(:mod:`simcomm.viz.algorithms`) and the send/recv figure
(:mod:`simcomm.viz.collective`) use these.
"""
from __future__ import annotations

import torch

__all__ = ["ring_schedule", "ring_exchange"]


def ring_schedule(world_size: int) -> list[list[tuple[int, int, int]]]:
    """The ring all-reduce as steps of ``(sender, receiver, chunk)`` transfers.

    The buffer is cut into ``world_size`` chunks. Steps ``0 .. n-2`` are the
    reduce-scatter (the receiver adds the incoming chunk to its own), steps
    ``n-1 .. 2n-3`` the all-gather (the receiver keeps the incoming chunk). In
    every step rank ``r`` sends chunk ``(r - step) mod n`` to rank ``r + 1``.

    After the reduce-scatter, rank ``r`` holds the finished sum of chunk
    ``(r + 1) mod n``, not chunk ``r``: the chunk a rank finishes is the one
    that started at its successor and went once around. (``reduce_scatter``
    as a collective hands rank ``r`` chunk ``r``; a library that builds it
    from this ring just starts the rotation one chunk later.)
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"ring_schedule: world_size={world_size!r} must be a positive int")
    return [[(rank, (rank + 1) % world_size, (rank - step) % world_size) for rank in range(world_size)]
            for step in range(2 * (world_size - 1))]


def ring_exchange(comm, outgoing: torch.Tensor) -> torch.Tensor:
    """Send ``outgoing`` to the next rank and return what the previous rank sent (same shape, dtype).

    Blocks until both transfers are done. ``send`` may block until the peer
    receives (the simulator always blocks), so if every rank sent first all
    would wait forever: even ranks send first and odd ranks receive first.
    With an odd world size the last rank and rank 0 are both even; the ring
    still completes, because rank 0's first send is received by rank 1 first.
    ``outgoing`` is not modified.
    """
    if comm.rank % 2 == 0:
        comm.send(outgoing)
        return comm.recv(outgoing.shape, outgoing.dtype)
    incoming = comm.recv(outgoing.shape, outgoing.dtype)
    comm.send(outgoing)
    return incoming
