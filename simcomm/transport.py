"""The raw, non-differentiable primitives a backend provides.

The :class:`~simcomm.communicator.Communicator` checks arguments and wires
autograd; a transport only moves data. Two transports implement this protocol:
:class:`simcomm.sim.SimTransport` (virtual ranks, threads of one process) and
``real.transport.DistTransport`` (``torch.distributed``).

Contract of every primitive, which the Communicator guarantees to the
transport and the transport to its caller:

* ``tensor`` is contiguous, ``dim`` arguments are non-negative and in range,
  sizes split evenly over the group, reduce ops are canonical names
  (``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``), ``src``/``dst``
  are group-local ranks;
* inputs are never modified; outputs are new tensors on the transport's device;
* every call blocks until this rank's part of it is complete.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from .trace import current_phase

__all__ = ["Transport", "TransportBase"]


@runtime_checkable
class Transport(Protocol):
    rank: int                      # rank within the group
    world_size: int                # size of the group
    ranks: tuple[int, ...]         # global ranks of the group's members
    device: torch.device

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor: ...
    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor: ...
    def reduce_scatter(self, tensor: torch.Tensor, dim: int, op: str) -> torch.Tensor: ...
    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor: ...
    def gather(self, tensor: torch.Tensor, dst: int, dim: int) -> torch.Tensor | None: ...
    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor: ...
    def send(self, tensor: torch.Tensor, dst: int) -> None: ...
    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor: ...
    def barrier(self) -> None: ...
    def subgroup(self, groups: tuple[tuple[int, ...], ...]) -> Transport: ...
    def compute(self, seconds: float | None = None, flops: float | None = None) -> None: ...
    # zeros off dst; (chunk, whether src's tensor requires grad); uneven along dim 0
    def reduce(self, tensor: torch.Tensor, dst: int, op: str) -> torch.Tensor: ...
    def scatter(self, tensor: torch.Tensor | None, src: int, dim: int, requires_grad: bool = False
                ) -> tuple[torch.Tensor, bool]: ...
    def all_to_all_single(self, tensor: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int]) -> torch.Tensor: ...


class TransportBase:
    """What both transports share: identity, the step counter and trace recording."""

    def __init__(self, rank: int, ranks: Sequence[int], device: torch.device,
                 events: list[tuple] | None, clock_zero: float):
        self.rank = rank
        self.ranks = tuple(ranks)
        self.world_size = len(self.ranks)
        self.global_rank = self.ranks[rank]
        self.device = device
        self._events = events
        self._clock_zero = clock_zero
        self._step = 0

    def _next_step(self) -> int:
        step = self._step
        self._step += 1
        return step

    def _begin(self, op: str, step: int, tensor: torch.Tensor | None, root: int | None = None,
               nbytes: int | None = None, args: dict | tuple | None = None) -> list | None:
        """Start the trace record of this call (``None`` when tracing is off)."""
        if self._events is None:
            return None
        return [op, self.ranks, self.global_rank, step, current_phase(),
                tensor.shape if tensor is not None else None,
                tensor.dtype if tensor is not None else None,
                nbytes, time.perf_counter() - self._clock_zero,
                self.ranks[root] if root is not None else None, args]

    def _end(self, record: list | None, out: torch.Tensor | None) -> None:
        """Finish a record and keep it (see :meth:`TraceEvent.from_record` for the layout)."""
        if record is None:
            return
        record.append(time.perf_counter() - self._clock_zero)
        record.append(out.shape if out is not None else None)
        self._events.append(tuple(record))

    def compute(self, seconds: float | None = None, flops: float | None = None) -> None:
        """Record a compute marker (no communication): a cost model gives it a duration."""
        self._end(self._begin("compute", -1, None, args={"seconds": seconds, "flops": flops}), None)
