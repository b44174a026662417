"""The raw, non-differentiable primitives a backend provides.

The :class:`~simcomm.communicator.Communicator` checks arguments and wires
autograd; a transport only moves data. Two transports implement this protocol:
:class:`simcomm.sim.transport.SimTransport` (virtual ranks, threads of one process) and
``real.transport.DistTransport`` (``torch.distributed``).

Contract of every primitive, which the Communicator guarantees to the
transport and the transport to its caller:

* ``tensor`` is contiguous, ``dim`` arguments are non-negative and in range,
  sizes split evenly over the group, reduce ops are canonical names
  (``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``, ``"premul_sum"``, and the
  bitwise ``"band"``, ``"bor"``, ``"bxor"`` for integer and bool tensors;
  the reducing primitives take PREMUL_SUM's factor as ``factor=``, this rank's
  own), ``src``/``dst`` are group-local ranks;
* inputs are never modified; outputs are new tensors on the transport's device;
* with ``async_op=False`` (the default) every call blocks until this rank's
  part of it is complete; with ``async_op=True`` it returns a
  :class:`~simcomm.handles.Handle` at once (the input copied at issue), whose
  ``wait()`` blocks and returns the output. ``send``/``recv`` with
  ``async_op=True`` are ``isend``/``irecv``; ``batch_isend_irecv`` issues a
  list of :class:`~simcomm.handles.P2POp` and returns one handle each.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .checks import PartitionTable
from .handles import Handle, P2POp
from .trace import Record, Recorder

__all__ = ["Transport", "TransportBase"]


@runtime_checkable
class Transport(Protocol):
    rank: int                      # rank within the group
    world_size: int                # size of the group
    ranks: tuple[int, ...]         # global ranks of the group's members
    device: torch.device

    # each collective returns a Handle instead of its output when async_op=True. ``into`` (the
    # c10d adapter's output buffer, as many elements as the output): the output is written into
    # it, as a native backend writes c10d's tensor, and it is returned instead of a new tensor
    def all_reduce(self, tensor: torch.Tensor, op: str, async_op: bool = False, *,
                   factor: float | torch.Tensor | None = None, into: torch.Tensor | None = None) -> Any: ...
    def all_gather(self, tensor: torch.Tensor, dim: int, async_op: bool = False, *,
                   into: torch.Tensor | None = None) -> Any: ...
    # separately: each rank's chunk is reduced as a buffer of its own (c10d's list form)
    def reduce_scatter(self, tensor: torch.Tensor, dim: int, op: str, async_op: bool = False, *,
                       factor: float | torch.Tensor | None = None, into: torch.Tensor | None = None,
                       separately: bool = False) -> Any: ...
    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int,
                   async_op: bool = False) -> Any: ...
    def gather(self, tensor: torch.Tensor, dst: int, dim: int, async_op: bool = False) -> Any: ...
    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False, *,
                  into: torch.Tensor | None = None) -> Any: ...
    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> Handle | None: ...
    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, async_op: bool = False) -> Any: ...
    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Handle]: ...
    def barrier(self, async_op: bool = False) -> Handle | None: ...
    def subgroup(self, groups: tuple[tuple[int, ...], ...]) -> Transport: ...
    def compute(self, seconds: float | None = None, flops: float | None = None) -> None: ...
    # zeros off dst; (chunk, whether src's tensor requires grad); uneven along dim 0
    def reduce(self, tensor: torch.Tensor, dst: int, op: str, async_op: bool = False, *,
               factor: float | torch.Tensor | None = None) -> Any: ...
    def scatter(self, tensor: torch.Tensor | None, src: int, dim: int, requires_grad: bool = False,
                async_op: bool = False) -> Any: ...
    def all_to_all_single(self, tensor: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], async_op: bool = False) -> Any: ...


class TransportBase:
    """What both transports share: identity, the step counters and trace recording.

    ``recorder`` is the run's (or process's) :class:`~simcomm.trace.Recorder`,
    shared with the subgroups made from this transport; ``None``: no tracing.
    ``partitions``: the :class:`~simcomm.checks.PartitionTable` that
    :meth:`Communicator.subgroup <simcomm.communicator.Communicator.subgroup>` checks
    partitions with (one per run of virtual ranks); ``None``: a table of its own.
    """

    def __init__(self, rank: int, ranks: Sequence[int], device: torch.device,
                 recorder: Recorder | None, partitions: PartitionTable | None = None):
        self.rank = rank
        self.ranks = tuple(ranks)
        self.world_size = len(self.ranks)
        self.global_rank = self.ranks[rank]
        self.device = device
        self._recorder = recorder
        self._step = 0
        self._p2p_steps: dict[tuple[int, int], int] = {}
        #: the partitions subgroup calls accepted, shared by the ranks that may pass equal ones
        #: (a virtual run's ranks share the run's table; a process has one per transport)
        self.partitions = PartitionTable() if partitions is None else partitions

    @property
    def recorder(self) -> Recorder | None:
        """Where this rank's calls are traced (``None`` when the run is not traced); the
        transports of the rank's subgroups share it."""
        return self._recorder

    def _next_step(self) -> int:
        step = self._step
        self._step += 1
        return step

    def _begin(self, op: str, step: int, tensor: torch.Tensor | None, root: int | None = None,
               nbytes: int | None = None, args: dict | tuple | None = None, async_op: bool = False
               ) -> Record | None:
        """Start the trace record of this call (``None`` when tracing is off).

        ``root`` is group-local; ``args`` the call's arguments, a dict or ``(name, value)`` pairs.
        """
        if self._recorder is None:
            return None
        return self._recorder.begin(op, self.ranks, self.global_rank, step, tensor,
                                    self.ranks[root] if root is not None else None, nbytes, args,
                                    async_op)

    def _end(self, record: Record | None, out: torch.Tensor | None) -> None:
        """A blocking call returned: finish its record and keep it."""
        if record is not None:
            self._recorder.end(record, out)

    def _p2p_begin(self, op: str, peer: int, tensor: torch.Tensor | None, nbytes: int | None = None,
                   async_op: bool = False) -> Record | None:
        """Count a ``send``/``recv`` with group-local ``peer`` and start its record.

        The step of a message is its position among the messages of its
        (sender, receiver) pair, so a send and its recv have the same step.
        """
        key = (self.rank, peer) if op == "send" else (peer, self.rank)
        step = self._p2p_steps.get(key, 0)
        self._p2p_steps[key] = step + 1
        return self._begin(op, step, tensor, peer, nbytes=nbytes, async_op=async_op)

    def compute(self, seconds: float | None = None, flops: float | None = None) -> None:
        """Record a compute marker (no communication): a cost model gives it a duration."""
        self._end(self._begin("compute", -1, None, args={"seconds": seconds, "flops": flops}), None)
