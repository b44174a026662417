"""The communicator a program receives: the seed's API with autograd on every collective.

One :class:`Communicator` exists per rank and group. It checks arguments
(:mod:`simcomm.checks`), makes inputs contiguous, and calls the autograd rules
of :mod:`simcomm.autograd`, which call its transport. The same class serves the
simulator (:class:`simcomm.sim.SimTransport`) and real processes
(``real.transport.DistTransport``).

Every method leaves its input unmodified and, by default, blocks until this
rank's part of the call is done. With ``async_op=True`` a method returns a
:class:`~simcomm.handles.Handle` at once; ``handle.wait()`` blocks and returns
what the blocking call would have returned, with the same autograd graph:
the handle applies the collective's autograd rule to the output that arrived
(:class:`_Arrived`), so the backward is the same dual collective, issued
blocking in the backward pass. ``src``/``dst`` are ranks *within the group*.
Gradients follow the sum-of-per-rank-losses convention; see :mod:`simcomm.autograd`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ReduceOp

from . import autograd as rules
from .checks import check_4d, check_divisible, check_partition, check_peer, normalize_dim
from .collectives import reduce_op_name
from .handles import Handle, P2POp
from .transport import Transport

__all__ = ["Communicator"]


class _NoGradContext:
    """Stands in for autograd's ctx when no gradient can flow: what a rule stores on it
    is never read (one instance serves every rank and call)."""

    def save_for_backward(self, *tensors) -> None:
        pass


_NO_GRAD_CTX = _NoGradContext()


def _apply(rule: type[torch.autograd.Function], transport: Transport, input_: torch.Tensor, *args):
    """``rule.apply`` when a gradient can flow through ``input_``; else its forward alone,
    which computes the same values without autograd's bookkeeping."""
    if input_.requires_grad and torch.is_grad_enabled():
        return rule.apply(transport, input_, *args)
    return rule.forward(_NO_GRAD_CTX, transport, input_, *args)


_TAKEN = object()


class _Arrived:
    """The transport as an autograd rule sees it when a handle is waited on.

    The rule's forward makes exactly one call to the transport's ``op``; here
    that call returns the ``output`` that already arrived. Every other call
    (the rule's backward) goes to the real transport, so the async form has
    the same graph and the same backward as the blocking one.
    """

    def __init__(self, transport: Transport, op: str, output: Any):
        self._transport, self._op, self._output = transport, op, output

    def __getattr__(self, name: str) -> Any:
        if name == self._op and self._output is not _TAKEN:
            output, self._output = self._output, _TAKEN
            return lambda *args, **kwargs: output
        return getattr(self._transport, name)


class Communicator:
    """Differentiable collectives for one rank of one group."""

    def __init__(self, transport: Transport):
        self.transport = transport

    @property
    def rank(self) -> int:
        """This rank's index within the group."""
        return self.transport.rank

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        return self.transport.world_size

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global ranks of the group's members, in group order."""
        return self.transport.ranks

    @property
    def global_rank(self) -> int:
        return self.transport.ranks[self.transport.rank]

    @property
    def device(self) -> torch.device:
        """The device this rank's tensors live on."""
        return self.transport.device

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
                f"ranks={list(self.ranks)}, device={self.device})")

    def _issue(self, rule: type[torch.autograd.Function], op: str, input_: torch.Tensor,
               transport_args: tuple, rule_args: tuple) -> Handle:
        """Issue ``op`` asynchronously; the handle's wait applies ``rule`` to what arrived,
        under the grad mode of the issuing call."""
        work = getattr(self.transport, op)(input_.detach(), *transport_args, async_op=True)
        transport, grad_enabled = self.transport, torch.is_grad_enabled()

        def finish(output: Any) -> Any:
            with torch.set_grad_enabled(grad_enabled):
                return _apply(rule, _Arrived(transport, op, output), input_, *rule_args)

        return Handle(work, finish)

    # -- collectives -----------------------------------------------------------------

    def all_reduce(self, input_: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM, *,
                   async_op: bool = False) -> torch.Tensor | Handle:
        """Reduce ``input_`` over the group; every rank gets the result.

        Backward: SUM/AVG all-reduce the gradients; MAX/MIN send the summed
        gradient to the rank(s) holding the extreme (ties share it evenly);
        PRODUCT multiplies the summed gradient by the product of the other
        ranks' values (exact with zeros). ``async_op=True``: returns a handle
        (the same backward flows through ``handle.wait()``).
        """
        op = reduce_op_name(op)
        if async_op:
            return self._issue(rules._AllReduce, "all_reduce", input_.contiguous(), (op,), (op,))
        return _apply(rules._AllReduce, self.transport, input_.contiguous(), op)

    def all_gather(self, input_: torch.Tensor, dim: int = -1, *, async_op: bool = False
                   ) -> torch.Tensor | Handle:
        """Concatenate the ranks' tensors along ``dim`` in rank order.

        Backward: reduce-scatter (sum) of the gradient along ``dim``, also for
        the ``async_op=True`` form (a handle whose ``wait()`` gives the output).
        """
        dim = normalize_dim("all_gather", input_, dim, self.rank)
        if async_op:
            return self._issue(rules._AllGather, "all_gather", input_.contiguous(), (dim,), (dim,))
        return _apply(rules._AllGather, self.transport, input_.contiguous(), dim)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1, op: ReduceOp | str = ReduceOp.SUM,
                       *, async_op: bool = False) -> torch.Tensor | Handle:
        """Reduce over the group, then rank ``r`` keeps chunk ``r`` along ``dim``.

        ``input_.shape[dim]`` must be divisible by the world size. Backward:
        all-gather of the gradient along ``dim`` (with the MAX/MIN/PRODUCT
        factors of :meth:`all_reduce`). ``async_op=True``: returns a handle.
        """
        dim = normalize_dim("reduce_scatter", input_, dim, self.rank)
        check_divisible("reduce_scatter", input_, dim, self.world_size, self.rank)
        op = reduce_op_name(op)
        if async_op:
            return self._issue(rules._ReduceScatter, "reduce_scatter", input_.contiguous(), (dim, op), (dim, op))
        return _apply(rules._ReduceScatter, self.transport, input_.contiguous(), dim, op)

    def slice(self, input_: torch.Tensor, dim: int = -1, *, scale_grad: bool, async_op: bool = False
              ) -> torch.Tensor | Handle:
        """Keep this rank's chunk of a tensor every rank holds the same copy of.

        No communication forward. Backward: all-gather of the gradients, so
        every rank's input gradient is the full gradient of the summed losses;
        divided by the world size when ``scale_grad`` (for a replicated loss).
        ``async_op=True``: a handle that is complete at once (nothing moves).
        """
        dim = normalize_dim("slice", input_, dim, self.rank)
        check_divisible("slice", input_, dim, self.world_size, self.rank)
        out = _apply(rules._Slice, self.transport, input_, dim, scale_grad)
        return Handle.completed(out) if async_op else out

    def all_to_all(self, input_: torch.Tensor, scatter_dim: int, gather_dim: int, *,
                   async_op: bool = False) -> torch.Tensor | Handle:
        """Split along ``scatter_dim``, send chunk ``j`` to rank ``j``, concatenate what
        arrives along ``gather_dim``. Backward: the same with the two dims swapped.
        ``async_op=True``: returns a handle."""
        scatter_dim = normalize_dim("all_to_all", input_, scatter_dim, self.rank, "scatter_dim")
        gather_dim = normalize_dim("all_to_all", input_, gather_dim, self.rank, "gather_dim")
        check_divisible("all_to_all", input_, scatter_dim, self.world_size, self.rank, "scatter_dim")
        return self._all_to_all(input_, scatter_dim, gather_dim, async_op)

    def _all_to_all(self, input_: torch.Tensor, scatter_dim: int, gather_dim: int, async_op: bool):
        if async_op:
            dims = (scatter_dim, gather_dim)
            return self._issue(rules._AllToAll, "all_to_all", input_.contiguous(), dims, dims)
        return _apply(rules._AllToAll, self.transport, input_.contiguous(), scatter_dim, gather_dim)

    def all_to_all_4D(self, input_: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1, *,
                      async_op: bool = False) -> torch.Tensor | Handle:
        """Ulysses re-sharding of ``(batch, seq, heads, head_dim)`` tensors.

        ``(2, 1)``: sequence shards ``(b, s/P, h, d)`` -> head shards ``(b, s, h/P, d)``.
        ``(1, 2)``: the inverse. Backward: the all-to-all with the dims swapped.
        ``async_op=True``: returns a handle.
        """
        check_4d("all_to_all_4D", input_, self.rank)
        if (scatter_dim, gather_dim) not in ((2, 1), (1, 2)):
            raise ValueError(
                f"all_to_all_4D: (scatter_dim, gather_dim)=({scatter_dim}, {gather_dim}) on rank "
                f"{self.rank}; only (2, 1) (sequence -> heads) and (1, 2) (heads -> sequence) exist")
        what = "heads" if scatter_dim == 2 else "sequence"
        check_divisible("all_to_all_4D", input_, scatter_dim, self.world_size, self.rank,
                        f"scatter_dim ({what})")
        return self._all_to_all(input_, scatter_dim, gather_dim, async_op)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1, *, async_op: bool = False
               ) -> torch.Tensor | Handle | None:
        """Concatenate the ranks' tensors along ``dim`` on rank ``dst``; ``None`` elsewhere.

        Not differentiable: the other ranks hold no output to call backward
        on. Use :meth:`all_gather` when gradients must flow. ``async_op=True``:
        returns a handle (its ``wait()`` gives ``None`` off ``dst``).
        """
        dim = normalize_dim("gather", input_, dim, self.rank)
        check_peer("gather", dst, self.world_size, self.rank, "dst")
        return self.transport.gather(input_.detach().contiguous(), dst, dim, async_op=async_op)

    def broadcast(self, input_: torch.Tensor, src: int = 0, *, async_op: bool = False
                  ) -> torch.Tensor | Handle:
        """Every rank gets a copy of rank ``src``'s tensor (all ranks pass the same shape).

        Backward: the gradients summed onto ``src``, zero on the other ranks.
        ``async_op=True``: returns a handle.
        """
        check_peer("broadcast", src, self.world_size, self.rank, "src")
        if async_op:
            return self._issue(rules._Broadcast, "broadcast", input_.contiguous(), (src,), (src,))
        return _apply(rules._Broadcast, self.transport, input_.contiguous(), src)

    def copy_to_group(self, input_: torch.Tensor, *, async_op: bool = False) -> torch.Tensor | Handle:
        """Megatron's *f*: identity forward, all-reduce of the gradients backward.

        Put it where a replicated activation enters a tensor-parallel region.
        ``async_op=True``: a handle that is complete at once (nothing moves forward).
        """
        out = _apply(rules._CopyToGroup, self.transport, input_.contiguous())
        return Handle.completed(out) if async_op else out

    def reduce_from_group(self, input_: torch.Tensor, *, async_op: bool = False) -> torch.Tensor | Handle:
        """Megatron's *g*: all-reduce (sum) forward, identity backward.

        Put it where partial sums leave a tensor-parallel region and every
        rank then computes the same replicated loss. ``async_op=True``: returns a handle.
        """
        if async_op:
            return self._issue(rules._ReduceFromGroup, "all_reduce", input_.contiguous(), ("sum",), ())
        return _apply(rules._ReduceFromGroup, self.transport, input_.contiguous())

    # -- point to point and control ----------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int | None = None, *, async_op: bool = False
             ) -> Handle | None:
        """Send ``tensor`` to rank ``dst`` (default: the next rank). Blocks.

        In the simulator a send returns once the matching :meth:`recv` has
        taken the data, the strictest behaviour real backends may show, so
        a program that works here cannot rely on buffering. Not
        differentiable: pipeline code passes gradients by hand.
        ``async_op=True`` is :meth:`isend`.
        """
        dst = self._peer("send", dst, +1, "dst")
        return self.transport.send(tensor.detach().contiguous(), dst, async_op=async_op)

    def recv(self, size: Sequence[int] | torch.Size, dtype: torch.dtype = torch.float32,
             src: int | None = None, *, async_op: bool = False) -> torch.Tensor | Handle:
        """Receive a new tensor of ``size`` and ``dtype`` from rank ``src`` (default: the
        previous rank). Blocks; ``async_op=True`` is :meth:`irecv`."""
        src = self._peer("recv", src, -1, "src")
        return self.transport.recv(tuple(size), dtype, src, async_op=async_op)

    def isend(self, tensor: torch.Tensor, dst: int | None = None) -> Handle:
        """Start sending ``tensor`` to rank ``dst`` (default: the next rank); does not block.

        ``tensor`` is copied now, so the program may reuse it at once.
        ``handle.wait()`` (returns ``None``) blocks until the message is
        delivered (simulator) or handed to the backend (real). Not differentiable.
        """
        return self.send(tensor, dst, async_op=True)

    def irecv(self, size: Sequence[int] | torch.Size, dtype: torch.dtype = torch.float32,
              src: int | None = None) -> Handle:
        """Start receiving a tensor of ``size`` and ``dtype`` from rank ``src`` (default: the
        previous rank); does not block. ``handle.wait()`` returns the new tensor. Not
        differentiable."""
        return self.recv(size, dtype, src, async_op=True)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Handle]:
        """Issue a batch of point-to-point ops without blocking; one handle per op, in order.

        ``ops``: :class:`~simcomm.handles.P2POp` items, ``P2POp("isend", tensor, peer)``
        or ``P2POp("irecv", (size, dtype), peer)`` (torch's ``P2POp`` with a
        size and dtype instead of a receive buffer; an irecv's ``wait()``
        returns the new tensor). As in torch, the order of sends and receives
        within the batch cannot deadlock, while messages between one pair of
        ranks in one direction match in order. Not differentiable.
        """
        if isinstance(ops, P2POp) or not isinstance(ops, Sequence) or not ops:
            raise ValueError(f"batch_isend_irecv: ops on rank {self.rank} must be a non-empty list of "
                             f"simcomm.P2POp, got {ops!r}")
        checked = []
        for index, item in enumerate(ops):
            if not isinstance(item, P2POp) or item.op not in ("isend", "irecv"):
                raise ValueError(
                    f"batch_isend_irecv: ops[{index}] on rank {self.rank} is {item!r}; expected "
                    f"P2POp('isend', tensor, peer) or P2POp('irecv', (size, dtype), peer)")
            peer = self._peer(f"batch_isend_irecv ({item.op}, ops[{index}])", item.peer, 0, "peer")
            if item.op == "isend":
                if not isinstance(item.data, torch.Tensor):
                    raise ValueError(f"batch_isend_irecv: ops[{index}] on rank {self.rank} is an isend "
                                     f"of {type(item.data).__name__}; it needs a tensor")
                checked.append(P2POp("isend", item.data.detach().contiguous(), peer))
            else:
                spec = item.data
                if (not isinstance(spec, tuple) or len(spec) != 2 or not isinstance(spec[1], torch.dtype)):
                    raise ValueError(f"batch_isend_irecv: ops[{index}] on rank {self.rank} is an irecv "
                                     f"with data={spec!r}; it needs (size, dtype), e.g. ((2, 3), torch.float32)")
                checked.append(P2POp("irecv", (tuple(spec[0]), spec[1]), peer))
        return self.transport.batch_isend_irecv(checked)

    def _peer(self, op: str, peer: int | None, default_step: int, arg: str) -> int:
        """Check a point-to-point peer (``None``: this rank + ``default_step``, if one)."""
        if peer is None and default_step:
            peer = (self.rank + default_step) % self.world_size
        check_peer(op, peer, self.world_size, self.rank, arg)
        if peer == self.rank:
            role = {"dst": "sending", "src": "receiving"}.get(arg, "calling")
            raise ValueError(f"{op}: {arg}={peer} on rank {self.rank} is the {role} rank itself")
        return peer

    def barrier(self, *, async_op: bool = False) -> Handle | None:
        """Wait until every rank of the group has reached this call.

        ``async_op=True``: returns a handle; its ``wait()`` blocks until every rank has issued it.
        """
        return self.transport.barrier(async_op=async_op)

    def compute(self, seconds: float | None = None, *, flops: float | None = None) -> None:
        """Declare compute work at this point of the program (no communication).

        Adds a ``compute`` event to the trace, so :func:`simcomm.cost.annotate`
        can place it on a modelled timeline: ``seconds`` as given, or ``flops``
        divided by the topology's compute rate.
        """
        if (seconds is None) == (flops is None):
            raise ValueError(f"compute: rank {self.rank} must give exactly one of seconds= and flops=")
        self.transport.compute(seconds, flops)

    def subgroup(self, groups: Sequence[Sequence[int]]) -> Communicator:
        """Split this group; return the communicator of the part this rank belongs to.

        A collective: every rank of the group calls it with the same
        ``groups``, a partition of the group's ranks (group-local numbering),
        e.g. ``[[0, 1], [2, 3]]``.
        """
        normalized = check_partition("subgroup", groups, self.world_size, self.rank)
        return Communicator(self.transport.subgroup(normalized))
