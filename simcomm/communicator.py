"""The communicator a program receives: vLLM's ``DeviceCommunicatorBase`` API with autograd on every collective.

One :class:`Communicator` exists per rank and group. It checks arguments
(:mod:`simcomm.checks`), makes inputs contiguous, and calls the autograd rules
of :mod:`simcomm.autograd`, which call its transport. The same class serves the
simulator (:class:`simcomm.sim.transport.SimTransport`) and real processes
(``real.transport.DistTransport``).

Every method leaves its input unmodified, returns tensors that alias no input,
and, by default, blocks until this rank's part of the call is done. A
non-tensor where a tensor belongs raises ``TypeError`` naming the op, the rank
and the argument. With ``async_op=True`` a method returns a
:class:`~simcomm.handles.Handle` at once; ``handle.wait()`` blocks and returns
what the blocking call would have returned, with the same autograd graph:
the handle applies the collective's autograd rule to the output that arrived
(``_Arrived``), so the backward is the same dual collective, issued
blocking in the backward pass. ``src``/``dst`` are ranks *within the group*.
Gradients follow the sum-of-per-rank-losses convention; see :mod:`simcomm.autograd`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ReduceOp

from . import autograd as rules
from .checks import (
    check_4d,
    check_avg_dtype,
    check_divisible,
    check_even_split,
    check_premul_factor,
    check_partition,
    check_peer,
    check_recv_spec,
    check_split_sizes,
    check_tensor,
    normalize_dim,
    reduce_op_and_factor,
)
from .handles import Handle, P2POp
from .transport import Transport

__all__ = ["Communicator"]


_TAKEN = object()

#: the reductions that need a floating-point (or complex) dtype (checks.check_avg_dtype)
_NEEDS_FLOAT = ("avg", "premul_sum")


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
               transport_args: tuple, rule_args: tuple, transport_input: Any = _TAKEN,
               factor: float | torch.Tensor | None = None) -> Handle:
        """Issue ``op`` asynchronously; the handle's wait applies ``rule`` to what arrived,
        under the grad mode of the issuing call. The transport gets ``input_`` detached,
        or ``transport_input`` when given (scatter off its source passes ``None``), and
        PREMUL_SUM's ``factor``."""
        if transport_input is _TAKEN:
            transport_input = input_.detach()
        work = getattr(self.transport, op)(transport_input, *transport_args, async_op=True,
                                           **rules.factor_kwargs(factor))
        transport, grad_enabled = self.transport, torch.is_grad_enabled()

        def finish(output: Any) -> Any:
            with torch.set_grad_enabled(grad_enabled):
                return rules.apply(rule, _Arrived(transport, op, output), input_, *rule_args)

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

        ``op=ReduceOp.PREMUL_SUM(factor)`` (or ``dist._make_nccl_premul_sum(factor)``):
        the sum of every rank's ``factor * input_``, each rank with its own factor
        (a Python number, or a one-element tensor of the input's dtype), floating-point
        dtypes only; backward: the summed gradient times this rank's factor.
        """
        check_tensor("all_reduce", input_, self.transport.rank)
        op, factor = self._reduction("all_reduce", input_, op)
        if async_op:
            return self._issue(rules.AllReduce, "all_reduce", input_.contiguous(), (op,), (op, *factor),
                               factor=factor[0] if factor else None)
        return rules.apply(rules.AllReduce, self.transport, input_.contiguous(), op, *factor)

    def _reduction(self, call: str, input_: torch.Tensor, op: ReduceOp | str) -> tuple[str, tuple]:
        """``op``'s canonical name, checked against ``input_``'s dtype, and ``(factor,)`` for a
        PREMUL_SUM (``()`` for the others: the rules' extra argument)."""
        rank = self.transport.rank
        name, factor = reduce_op_and_factor(call, op, rank)
        if name in _NEEDS_FLOAT:
            check_avg_dtype(call, input_, name, rank)
        if factor is None:
            return name, ()
        return name, (check_premul_factor(call, factor, rank, input_),)

    def all_gather(self, input_: torch.Tensor, dim: int = -1, *, async_op: bool = False
                   ) -> torch.Tensor | Handle:
        """Concatenate the ranks' tensors along ``dim`` in rank order.

        Backward: reduce-scatter (sum) of the gradient along ``dim``, also for
        the ``async_op=True`` form (a handle whose ``wait()`` gives the output).
        """
        check_tensor("all_gather", input_, self.rank)
        dim = normalize_dim("all_gather", input_, dim, self.rank)
        if async_op:
            return self._issue(rules.AllGather, "all_gather", input_.contiguous(), (dim,), (dim,))
        return rules.apply(rules.AllGather, self.transport, input_.contiguous(), dim)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1, op: ReduceOp | str = ReduceOp.SUM,
                       *, async_op: bool = False) -> torch.Tensor | Handle:
        """Reduce over the group, then rank ``r`` keeps chunk ``r`` along ``dim``.

        ``input_.shape[dim]`` must be divisible by the world size. Backward:
        all-gather of the gradient along ``dim`` (with the MAX/MIN/PRODUCT
        factors of :meth:`all_reduce`, and its PREMUL_SUM). ``async_op=True``: returns a handle.
        """
        check_tensor("reduce_scatter", input_, self.rank)
        dim = normalize_dim("reduce_scatter", input_, dim, self.rank)
        check_divisible("reduce_scatter", input_, dim, self.world_size, self.rank)
        op, factor = self._reduction("reduce_scatter", input_, op)
        if async_op:
            return self._issue(rules.ReduceScatter, "reduce_scatter", input_.contiguous(), (dim, op),
                               (dim, op, *factor), factor=factor[0] if factor else None)
        return rules.apply(rules.ReduceScatter, self.transport, input_.contiguous(), dim, op, *factor)

    def slice(self, input_: torch.Tensor, dim: int = -1, *, scale_grad: bool, async_op: bool = False
              ) -> torch.Tensor | Handle:
        """Keep this rank's chunk of a tensor every rank holds the same copy of.

        No communication forward. Backward: all-gather of the gradients, so
        every rank's input gradient is the full gradient of the summed losses;
        divided by the world size when ``scale_grad`` (for a replicated loss).
        ``async_op=True``: a handle that is complete at once (nothing moves).
        """
        check_tensor("slice", input_, self.rank)
        dim = normalize_dim("slice", input_, dim, self.rank)
        check_divisible("slice", input_, dim, self.world_size, self.rank)
        out = rules.apply(rules.Slice, self.transport, input_, dim, scale_grad)
        return Handle.completed(out) if async_op else out

    def all_to_all(self, input_: torch.Tensor, scatter_dim: int, gather_dim: int, *,
                   async_op: bool = False) -> torch.Tensor | Handle:
        """Split along ``scatter_dim``, send chunk ``j`` to rank ``j``, concatenate what
        arrives along ``gather_dim``. Backward: the same with the two dims swapped.
        ``async_op=True``: returns a handle."""
        check_tensor("all_to_all", input_, self.rank)
        scatter_dim = normalize_dim("all_to_all", input_, scatter_dim, self.rank, "scatter_dim")
        gather_dim = normalize_dim("all_to_all", input_, gather_dim, self.rank, "gather_dim")
        check_divisible("all_to_all", input_, scatter_dim, self.world_size, self.rank, "scatter_dim")
        return self._all_to_all(input_, scatter_dim, gather_dim, async_op)

    def _all_to_all(self, input_: torch.Tensor, scatter_dim: int, gather_dim: int, async_op: bool):
        if async_op:
            dims = (scatter_dim, gather_dim)
            return self._issue(rules.AllToAll, "all_to_all", input_.contiguous(), dims, dims)
        return rules.apply(rules.AllToAll, self.transport, input_.contiguous(), scatter_dim, gather_dim)

    def all_to_all_4D(self, input_: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1, *,
                      async_op: bool = False) -> torch.Tensor | Handle:
        """Ulysses re-sharding of ``(batch, seq, heads, head_dim)`` tensors.

        ``(2, 1)``: sequence shards ``(b, s/P, h, d)`` -> head shards ``(b, s, h/P, d)``.
        ``(1, 2)``: the inverse. Backward: the all-to-all with the dims swapped.
        ``async_op=True``: returns a handle.
        """
        check_tensor("all_to_all_4D", input_, self.rank)
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

        Differentiable where a gradient can flow: when ``input_`` requires grad
        (and grad mode is on), the other ranks get an *empty* tensor (size 0
        along ``dim``) instead of ``None``; it carries no value, but a rank that
        calls backward through it (e.g. adds ``y.sum()``, which is 0, to its
        loss) receives its chunk of ``dst``'s gradient. Backward: scatter of
        ``dst``'s gradient, chunk ``r`` to rank ``r``; every rank must take part
        in the backward, as in every collective. Without gradients, ``None``
        off ``dst`` as before. :meth:`all_gather` when every rank needs the result.
        ``async_op=True``: returns a handle (its ``wait()`` gives what the
        blocking call returns).
        """
        check_tensor("gather", input_, self.rank)
        dim = normalize_dim("gather", input_, dim, self.rank)
        check_peer("gather", dst, self.world_size, self.rank, "dst")
        if input_.requires_grad and torch.is_grad_enabled():
            if async_op:
                return self._issue(rules.Gather, "gather", input_.contiguous(), (dst, dim), (dst, dim))
            return rules.apply(rules.Gather, self.transport, input_.contiguous(), dst, dim)
        return self.transport.gather(input_.detach().contiguous(), dst, dim, async_op=async_op)

    def broadcast(self, input_: torch.Tensor, src: int = 0, *, async_op: bool = False
                  ) -> torch.Tensor | Handle:
        """Every rank gets a copy of rank ``src``'s tensor (all ranks pass the same shape).

        Backward: :meth:`reduce` (sum) of the gradients onto ``src``, zero on the other ranks.
        ``async_op=True``: returns a handle.
        """
        check_tensor("broadcast", input_, self.rank)
        check_peer("broadcast", src, self.world_size, self.rank, "src")
        if async_op:
            return self._issue(rules.Broadcast, "broadcast", input_.contiguous(), (src,), (src,))
        return rules.apply(rules.Broadcast, self.transport, input_.contiguous(), src)

    def copy_to_group(self, input_: torch.Tensor, *, async_op: bool = False) -> torch.Tensor | Handle:
        """Megatron's *f*: identity forward, all-reduce of the gradients backward.

        Put it where a replicated activation enters a tensor-parallel region.
        ``async_op=True``: a handle that is complete at once (nothing moves forward).
        """
        check_tensor("copy_to_group", input_, self.rank)
        out = rules.apply(rules.CopyToGroup, self.transport, input_.contiguous())
        return Handle.completed(out) if async_op else out

    def reduce_from_group(self, input_: torch.Tensor, *, async_op: bool = False) -> torch.Tensor | Handle:
        """Megatron's *g*: all-reduce (sum) forward, identity backward.

        Put it where partial sums leave a tensor-parallel region and every
        rank then computes the same replicated loss. ``async_op=True``: returns a handle.
        """
        check_tensor("reduce_from_group", input_, self.rank)
        if async_op:
            return self._issue(rules.ReduceFromGroup, "all_reduce", input_.contiguous(), ("sum",), ())
        return rules.apply(rules.ReduceFromGroup, self.transport, input_.contiguous())

    def reduce(self, input_: torch.Tensor, dst: int = 0, op: ReduceOp | str = ReduceOp.SUM, *,
               async_op: bool = False) -> torch.Tensor | Handle:
        """Reduce ``input_`` over the group onto rank ``dst``.

        ``dst`` gets the reduction; every other rank gets zeros of the input's
        shape and dtype (a new tensor, the same on both backends), so every
        rank holds an output it can call backward through. Backward: broadcast
        of ``dst``'s gradient to every rank (AVG divides by the world size;
        MAX/MIN/PRODUCT apply the factors of :meth:`all_reduce`); the other
        ranks' output gradients are ignored, since their zeros do not depend on
        any input. ``async_op=True``: returns a handle. PREMUL_SUM: as :meth:`all_reduce`.
        """
        check_tensor("reduce", input_, self.rank)
        check_peer("reduce", dst, self.world_size, self.rank, "dst")
        op, factor = self._reduction("reduce", input_, op)
        if async_op:
            return self._issue(rules.Reduce, "reduce", input_.contiguous(), (dst, op), (dst, op, *factor),
                               factor=factor[0] if factor else None)
        return rules.apply(rules.Reduce, self.transport, input_.contiguous(), dst, op, *factor)

    def scatter(self, input_: torch.Tensor | None, src: int = 0, dim: int = -1, *, async_op: bool = False
                ) -> torch.Tensor | Handle:
        """Rank ``r`` gets chunk ``r`` along ``dim`` of rank ``src``'s tensor.

        Only ``src`` needs a tensor (its ``shape[dim]`` divisible by the world
        size); the other ranks pass ``None`` (or any tensor: its values are
        ignored, its gradient is zero) and learn the shape and dtype from
        ``src``. The output requires grad on every rank exactly when ``src``'s
        tensor does (and grad mode is on there and here). Backward: gather of
        the ranks' gradients onto ``src`` along ``dim``; every rank must run it
        (``loss.backward()``; ``torch.autograd.grad`` off ``src`` runs it only
        when asked for the gradient of the tensor the rank passed).
        ``async_op=True``: returns a handle.
        """
        is_src = check_peer("scatter", src, self.world_size, self.rank, "src") == self.rank
        if not is_src and input_ is not None:
            check_tensor("scatter", input_, self.rank)
        if is_src:
            check_tensor("scatter", input_, self.rank)
            dim = normalize_dim("scatter", input_, dim, self.rank)
            check_divisible("scatter", input_, dim, self.world_size, self.rank)
        elif not isinstance(dim, int) or isinstance(dim, bool):
            raise ValueError(f"scatter: dim={dim!r} on rank {self.rank} must be an int")
        grad_on = torch.is_grad_enabled()
        source = input_.detach().contiguous() if is_src else None
        if is_src and not (grad_on and input_.requires_grad):
            rule_input = None
        elif is_src:
            rule_input = input_.contiguous()
        elif grad_on:   # a placeholder input, so the output can require grad when src's does
            rule_input = input_ if input_ is not None and input_.requires_grad else \
                torch.empty(0, device=self.device, requires_grad=True)
        else:
            rule_input = None
        if rule_input is None:     # no gradient can flow: the chunk alone
            if async_op:
                return Handle(self.transport.scatter(source, src, dim, False, async_op=True),
                              lambda arrived: arrived[0])
            return rules.Scatter.compute(self.transport, source, src, dim, False)
        args = (src, dim, is_src)
        if async_op:
            return self._issue(rules.Scatter, "scatter", rule_input, args, args, transport_input=source)
        return rules.apply(rules.Scatter, self.transport, rule_input, *args)

    def all_to_all_single(self, input_: torch.Tensor, output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None, *, async_op: bool = False
                          ) -> torch.Tensor | Handle:
        """Uneven all-to-all along dim 0, with ``torch.distributed.all_to_all_single``'s split lists.

        Rank ``i`` sends ``input_split_sizes[j]`` consecutive rows of ``input_``
        to rank ``j`` (``None``: ``input_.shape[0]`` split evenly) and receives
        ``output_split_sizes[j]`` rows from rank ``j`` (``None``: as many rows
        as it sends in all, split evenly), concatenated in rank order. Sizes
        may be zero. ``output_split_sizes[j]`` on rank ``i`` must equal
        ``input_split_sizes[i]`` on rank ``j``: the simulator compares the ranks'
        lists at the rendezvous; real processes exchange them first (one small
        all-gather); either way the error names both ranks and their lists.
        Backward: the same all-to-all with the two split lists swapped, so
        every gradient row goes back to the rank and row it came from.
        ``async_op=True``: returns a handle.
        """
        op = "all_to_all_single"
        check_tensor(op, input_, self.rank)
        if input_.dim() == 0:
            raise ValueError(f"{op}: rank {self.rank} passed a 0-d tensor; dim 0 is split, so it needs "
                             f"at least one dimension")
        rows = input_.shape[0]
        if input_split_sizes is None:
            inputs_ = [check_even_split(op, input_, self.world_size, self.rank, "input_split_sizes")
                       ] * self.world_size
        else:
            inputs_ = check_split_sizes(op, input_split_sizes, rows, self.rank, "input_split_sizes",
                                        self.world_size)
        if output_split_sizes is None:
            outputs = [check_even_split(op, input_, self.world_size, self.rank, "output_split_sizes")
                       ] * self.world_size
        else:
            outputs = check_split_sizes(op, output_split_sizes, None, self.rank, "output_split_sizes",
                                        self.world_size)
        if async_op:
            return self._issue(rules.AllToAllSingle, "all_to_all_single", input_.contiguous(),
                               (outputs, inputs_), (outputs, inputs_))
        return rules.apply(rules.AllToAllSingle, self.transport, input_.contiguous(), outputs, inputs_)

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
        check_tensor("send", tensor, self.rank, "tensor")
        dst = self._peer("send", dst, +1, "dst")
        return self.transport.send(tensor.detach().contiguous(), dst, async_op=async_op)

    def recv(self, size: Sequence[int] | torch.Size, dtype: torch.dtype = torch.float32,
             src: int | None = None, *, async_op: bool = False) -> torch.Tensor | Handle:
        """Receive a new tensor of ``size`` and ``dtype`` from rank ``src`` (default: the
        previous rank). Blocks; ``async_op=True`` is :meth:`irecv`."""
        op = "irecv" if async_op else "recv"
        shape, dtype = check_recv_spec(op, size, dtype, self.rank)
        src = self._peer(op, src, -1, "src")
        return self.transport.recv(shape, dtype, src, async_op=async_op)

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
                if not isinstance(spec, tuple) or len(spec) != 2:
                    raise ValueError(f"batch_isend_irecv: ops[{index}] on rank {self.rank} is an irecv "
                                     f"with data={spec!r}; it needs (size, dtype), e.g. ((2, 3), torch.float32)")
                shape, dtype = check_recv_spec(f"batch_isend_irecv (irecv, ops[{index}])", spec[0], spec[1],
                                               self.rank, "data[0] (size)", "data[1] (dtype)")
                checked.append(P2POp("irecv", (shape, dtype), peer))
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

        Adds a ``compute`` event to the trace, so :func:`simcomm.model.cost.annotate`
        can place it on a modelled timeline: ``seconds`` as given, or ``flops``
        divided by the topology's compute rate.
        """
        if (seconds is None) == (flops is None):
            raise ValueError(f"compute: rank {self.rank} must give exactly one of seconds= and flops=")
        self.transport.compute(seconds, flops)

    def subgroup(self, groups: Sequence[Sequence[int]]) -> Communicator:
        """Split this group; return the communicator of the part this rank belongs to.

        A collective: every rank of the group calls it with the same
        ``groups``, a partition of the group's ranks (group-local numbering,
        ints), e.g. ``[[0, 1], [2, 3]]``. Within a part, ranks are numbered in
        sorted order, as ``torch.distributed.new_group`` numbers them:
        ``[[1, 0]]`` is the same group as ``[[0, 1]]`` on both backends.
        """
        # one normalized partition shared by every rank that passed an equal one (checks.PartitionTable)
        table = getattr(self.transport, "partitions", None)
        normalized = (table.check if table is not None else check_partition)(
            "subgroup", groups, self.world_size, self.rank)
        return Communicator(self.transport.subgroup(normalized))
