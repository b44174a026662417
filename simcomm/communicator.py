"""The communicator a program receives: the seed's API with autograd on every collective.

One :class:`Communicator` exists per rank and group. It checks arguments
(:mod:`simcomm.checks`), makes inputs contiguous, and calls the autograd rules
of :mod:`simcomm.autograd`, which call its transport. The same class serves the
simulator (:class:`simcomm.sim.SimTransport`) and real processes
(``real.transport.DistTransport``).

Every method leaves its input unmodified, returns tensors that alias no input,
and blocks until this rank's part of the call is done. A non-tensor where a
tensor belongs raises ``TypeError`` naming the op, the rank and the argument.
``src``/``dst`` are ranks *within the group*. Gradients
follow the sum-of-per-rank-losses convention; see :mod:`simcomm.autograd`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ReduceOp

from . import autograd as rules
from .checks import (check_4d, check_divisible, check_partition, check_peer, check_split_sizes, check_tensor,
                     normalize_dim)
from .collectives import check_avg_dtype, reduce_op_name
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

    # -- collectives -----------------------------------------------------------------

    def all_reduce(self, input_: torch.Tensor, op: ReduceOp | str = ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``input_`` over the group; every rank gets the result.

        Backward: SUM/AVG all-reduce the gradients; MAX/MIN send the summed
        gradient to the rank(s) holding the extreme (ties share it evenly);
        PRODUCT multiplies the summed gradient by the product of the other
        ranks' values (exact with zeros).
        """
        check_tensor("all_reduce", input_, self.rank)
        op = reduce_op_name(op)
        check_avg_dtype("all_reduce", input_, op, self.rank)
        return _apply(rules._AllReduce, self.transport, input_.contiguous(), op)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate the ranks' tensors along ``dim`` in rank order.

        Backward: reduce-scatter (sum) of the gradient along ``dim``.
        """
        check_tensor("all_gather", input_, self.rank)
        dim = normalize_dim("all_gather", input_, dim, self.rank)
        return _apply(rules._AllGather, self.transport, input_.contiguous(), dim)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1, op: ReduceOp | str = ReduceOp.SUM
                       ) -> torch.Tensor:
        """Reduce over the group, then rank ``r`` keeps chunk ``r`` along ``dim``.

        ``input_.shape[dim]`` must be divisible by the world size. Backward:
        all-gather of the gradient along ``dim`` (with the MAX/MIN/PRODUCT
        factors of :meth:`all_reduce`).
        """
        check_tensor("reduce_scatter", input_, self.rank)
        dim = normalize_dim("reduce_scatter", input_, dim, self.rank)
        check_divisible("reduce_scatter", input_, dim, self.world_size, self.rank)
        op = reduce_op_name(op)
        check_avg_dtype("reduce_scatter", input_, op, self.rank)
        return _apply(rules._ReduceScatter, self.transport, input_.contiguous(), dim, op)

    def slice(self, input_: torch.Tensor, dim: int = -1, *, scale_grad: bool) -> torch.Tensor:
        """Keep this rank's chunk of a tensor every rank holds the same copy of.

        No communication forward. Backward: all-gather of the gradients, so
        every rank's input gradient is the full gradient of the summed losses;
        divided by the world size when ``scale_grad`` (for a replicated loss).
        """
        check_tensor("slice", input_, self.rank)
        dim = normalize_dim("slice", input_, dim, self.rank)
        check_divisible("slice", input_, dim, self.world_size, self.rank)
        return _apply(rules._Slice, self.transport, input_, dim, scale_grad)

    def all_to_all(self, input_: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        """Split along ``scatter_dim``, send chunk ``j`` to rank ``j``, concatenate what
        arrives along ``gather_dim``. Backward: the same with the two dims swapped."""
        check_tensor("all_to_all", input_, self.rank)
        scatter_dim = normalize_dim("all_to_all", input_, scatter_dim, self.rank, "scatter_dim")
        gather_dim = normalize_dim("all_to_all", input_, gather_dim, self.rank, "gather_dim")
        check_divisible("all_to_all", input_, scatter_dim, self.world_size, self.rank, "scatter_dim")
        return _apply(rules._AllToAll, self.transport, input_.contiguous(), scatter_dim, gather_dim)

    def all_to_all_4D(self, input_: torch.Tensor, scatter_dim: int = 2, gather_dim: int = 1) -> torch.Tensor:
        """Ulysses re-sharding of ``(batch, seq, heads, head_dim)`` tensors.

        ``(2, 1)``: sequence shards ``(b, s/P, h, d)`` -> head shards ``(b, s, h/P, d)``.
        ``(1, 2)``: the inverse. Backward: the all-to-all with the dims swapped.
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
        return _apply(rules._AllToAll, self.transport, input_.contiguous(), scatter_dim, gather_dim)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """Concatenate the ranks' tensors along ``dim`` on rank ``dst``; ``None`` elsewhere.

        Differentiable where a gradient can flow: when ``input_`` requires grad
        (and grad mode is on), the other ranks get an *empty* tensor (size 0
        along ``dim``) instead of ``None``; it carries no value, but a rank that
        calls backward through it (e.g. adds ``y.sum()``, which is 0, to its
        loss) receives its chunk of ``dst``'s gradient. Backward: scatter of
        ``dst``'s gradient, chunk ``r`` to rank ``r``; every rank must take part
        in the backward, as in every collective. Without gradients, ``None``
        off ``dst`` as before. :meth:`all_gather` when every rank needs the result.
        """
        check_tensor("gather", input_, self.rank)
        dim = normalize_dim("gather", input_, dim, self.rank)
        check_peer("gather", dst, self.world_size, self.rank, "dst")
        if input_.requires_grad and torch.is_grad_enabled():
            return rules._Gather.apply(self.transport, input_.contiguous(), dst, dim)
        return self.transport.gather(input_.detach().contiguous(), dst, dim)

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Every rank gets a copy of rank ``src``'s tensor (all ranks pass the same shape).

        Backward: :meth:`reduce` (sum) of the gradients onto ``src``, zero on the other ranks.
        """
        check_tensor("broadcast", input_, self.rank)
        check_peer("broadcast", src, self.world_size, self.rank, "src")
        return _apply(rules._Broadcast, self.transport, input_.contiguous(), src)

    def copy_to_group(self, input_: torch.Tensor) -> torch.Tensor:
        """Megatron's *f*: identity forward, all-reduce of the gradients backward.

        Put it where a replicated activation enters a tensor-parallel region.
        """
        check_tensor("copy_to_group", input_, self.rank)
        return _apply(rules._CopyToGroup, self.transport, input_.contiguous())

    def reduce_from_group(self, input_: torch.Tensor) -> torch.Tensor:
        """Megatron's *g*: all-reduce (sum) forward, identity backward.

        Put it where partial sums leave a tensor-parallel region and every
        rank then computes the same replicated loss.
        """
        check_tensor("reduce_from_group", input_, self.rank)
        return _apply(rules._ReduceFromGroup, self.transport, input_.contiguous())

    def reduce(self, input_: torch.Tensor, dst: int = 0, op: ReduceOp | str = ReduceOp.SUM) -> torch.Tensor:
        """Reduce ``input_`` over the group onto rank ``dst``.

        ``dst`` gets the reduction; every other rank gets zeros of the input's
        shape and dtype (a new tensor, the same on both backends), so every
        rank holds an output it can call backward through. Backward: broadcast
        of ``dst``'s gradient to every rank (AVG divides by the world size;
        MAX/MIN/PRODUCT apply the factors of :meth:`all_reduce`); the other
        ranks' output gradients are ignored, since their zeros do not depend on
        any input.
        """
        check_tensor("reduce", input_, self.rank)
        check_peer("reduce", dst, self.world_size, self.rank, "dst")
        op = reduce_op_name(op)
        check_avg_dtype("reduce", input_, op, self.rank)
        return _apply(rules._Reduce, self.transport, input_.contiguous(), dst, op)

    def scatter(self, input_: torch.Tensor | None, src: int = 0, dim: int = -1) -> torch.Tensor:
        """Rank ``r`` gets chunk ``r`` along ``dim`` of rank ``src``'s tensor.

        Only ``src`` needs a tensor (its ``shape[dim]`` divisible by the world
        size); the other ranks pass ``None`` (or any tensor: its values are
        ignored, its gradient is zero) and learn the shape and dtype from
        ``src``. The output requires grad on every rank exactly when ``src``'s
        tensor does (and grad mode is on there and here). Backward: gather of
        the ranks' gradients onto ``src`` along ``dim``; every rank must run it
        (``loss.backward()``; ``torch.autograd.grad`` off ``src`` runs it only
        when asked for the gradient of the tensor the rank passed).
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
        if is_src:
            flag = grad_on and input_.requires_grad
            if flag:
                return rules._Scatter.apply(self.transport, input_.contiguous(), src, dim, True)
            return self.transport.scatter(input_.detach().contiguous(), src, dim, requires_grad=False)[0]
        if grad_on:   # a placeholder input, so the output can require grad when src's does
            placeholder = input_ if input_ is not None and input_.requires_grad else \
                torch.empty(0, device=self.device, requires_grad=True)
            return rules._Scatter.apply(self.transport, placeholder, src, dim, False)
        return self.transport.scatter(None, src, dim)[0]

    def all_to_all_single(self, input_: torch.Tensor, output_split_sizes: Sequence[int] | None = None,
                          input_split_sizes: Sequence[int] | None = None) -> torch.Tensor:
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
        """
        op = "all_to_all_single"
        check_tensor(op, input_, self.rank)
        if input_.dim() == 0:
            raise ValueError(f"{op}: rank {self.rank} passed a 0-d tensor; dim 0 is split, so it needs "
                             f"at least one dimension")
        rows = input_.shape[0]
        if input_split_sizes is None:
            check_divisible(op, input_, 0, self.world_size, self.rank, "dim 0 (input_split_sizes=None)")
            inputs_ = [rows // self.world_size] * self.world_size
        else:
            inputs_ = check_split_sizes(op, input_split_sizes, rows, self.rank, "input_split_sizes",
                                        self.world_size)
        if output_split_sizes is None:
            check_divisible(op, input_, 0, self.world_size, self.rank, "dim 0 (output_split_sizes=None)")
            outputs = [rows // self.world_size] * self.world_size
        else:
            outputs = check_split_sizes(op, output_split_sizes, None, self.rank, "output_split_sizes",
                                        self.world_size)
        return _apply(rules._AllToAllSingle, self.transport, input_.contiguous(), outputs, inputs_)

    # -- point to point and control ----------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        """Send ``tensor`` to rank ``dst`` (default: the next rank). Blocks.

        In the simulator a send returns once the matching :meth:`recv` has
        taken the data, the strictest behaviour real backends may show, so
        a program that works here cannot rely on buffering. Not
        differentiable: pipeline code passes gradients by hand.
        """
        if dst is None:
            dst = (self.rank + 1) % self.world_size
        check_tensor("send", tensor, self.rank, "tensor")
        check_peer("send", dst, self.world_size, self.rank, "dst")
        if dst == self.rank:
            raise ValueError(f"send: dst={dst} on rank {self.rank} is the sending rank itself")
        self.transport.send(tensor.detach().contiguous(), dst)

    def recv(self, size: Sequence[int] | torch.Size, dtype: torch.dtype = torch.float32,
             src: int | None = None) -> torch.Tensor:
        """Receive a tensor of ``size`` and ``dtype`` from rank ``src`` (default: the previous rank). Blocks."""
        if src is None:
            src = (self.rank - 1) % self.world_size
        check_peer("recv", src, self.world_size, self.rank, "src")
        if src == self.rank:
            raise ValueError(f"recv: src={src} on rank {self.rank} is the receiving rank itself")
        return self.transport.recv(tuple(size), dtype, src)

    def barrier(self) -> None:
        """Wait until every rank of the group has reached this call."""
        self.transport.barrier()

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
        ``groups``, a partition of the group's ranks (group-local numbering,
        ints), e.g. ``[[0, 1], [2, 3]]``. Within a part, ranks are numbered in
        sorted order, as ``torch.distributed.new_group`` numbers them:
        ``[[1, 0]]`` is the same group as ``[[0, 1]]`` on both backends.
        """
        normalized = check_partition("subgroup", groups, self.world_size, self.rank)
        return Communicator(self.transport.subgroup(normalized))
