"""One autograd Function per collective: forward calls the transport, backward is the adjoint.

The Functions take a :class:`~simcomm.transport.Transport` as their first
argument and work unchanged on both backends. Their forward leaves its input
untouched and returns a new tensor; their backward calls are traced with phase
``"backward"``.

**Gradient convention.** Each backward is the exact adjoint (vector-Jacobian
product) of the forward *when the objective is the sum of the per-rank
losses*: rank ``r`` computes ``loss_r`` and calls ``loss_r.backward()``, and
every rank's input gradient is the derivative of ``sum_r loss_r``. When every
rank instead computes the *same* replicated loss, an all-reduce backward counts
it ``world_size`` times; the conjugate pair :class:`_CopyToGroup` /
:class:`_ReduceFromGroup` (Megatron's f and g) is written for that convention.

=================  ========================================  ==========================================
Function           forward                                   backward (adjoint)
=================  ========================================  ==========================================
_AllReduce         reduce over ranks                         SUM/AVG: all-reduce of the grads (AVG /n);
                                                             MAX/MIN: summed grad to the holder(s) of the
                                                             extreme, split evenly among ties;
                                                             PRODUCT: summed grad x product of the others
_AllGather         concat along dim                          reduce-scatter (sum) along dim
_ReduceScatter     reduce, keep chunk r                      all-gather along dim (then as _AllReduce)
_Slice             keep chunk r of a replicated tensor       all-gather of the grads (/n if scale_grad)
_AllToAll          split on scatter_dim, concat on gather    the all-to-all with the two dims swapped
_Broadcast         src's tensor everywhere                   grads summed onto src, zero elsewhere
_CopyToGroup       identity                                  all-reduce (sum) of the grads
_ReduceFromGroup   all-reduce (sum)                          identity
=================  ========================================  ==========================================
"""
from __future__ import annotations

from typing import Any

import torch

from .trace import backward_phase
from .transport import Transport

_NONLINEAR = ("max", "min", "product")


def _local_factor(transport: Transport, op: str, x: torch.Tensor, y_full: torch.Tensor | None,
                  like: torch.Tensor) -> torch.Tensor | float:
    """d(reduce_i x_i)/d x_this_rank, elementwise, for the rank's own input ``x``.

    ``y_full`` is the reduced tensor at the full shape of ``x`` (needed for
    MAX/MIN). Costs one extra all-reduce for MAX/MIN and two for PRODUCT.
    """
    if op == "sum":
        return 1.0
    if op == "avg":
        return 1.0 / transport.world_size
    if op in ("max", "min"):
        holds = (x == y_full).to(like.dtype)
        holders = transport.all_reduce(holds, "sum")  # how many ranks tie for the extreme
        return holds / holders.clamp_min(1)
    # product: the product of the *other* ranks' values, exact when some are zero
    is_zero = x == 0
    nonzero = torch.where(is_zero, torch.ones_like(x), x)
    prod_nonzero = transport.all_reduce(nonzero.contiguous(), "product")
    zeros = transport.all_reduce(is_zero.to(like.dtype).contiguous(), "sum")
    others_if_nonzero = torch.where(zeros == 0, prod_nonzero / nonzero, torch.zeros_like(prod_nonzero))
    others_if_zero = torch.where(zeros == 1, prod_nonzero, torch.zeros_like(prod_nonzero))
    return torch.where(is_zero, others_if_zero, others_if_nonzero).to(like.dtype)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, op: str) -> torch.Tensor:
        y = transport.all_reduce(x, op)
        ctx.transport, ctx.op = transport, op
        if op in _NONLINEAR:
            ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            total = ctx.transport.all_reduce(grad.contiguous(), "sum")
            if ctx.op in _NONLINEAR:
                x, y = ctx.saved_tensors
                total = total * _local_factor(ctx.transport, ctx.op, x, y, total)
            elif ctx.op == "avg":
                total = total / ctx.transport.world_size
        return None, total, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.transport, ctx.dim = transport, dim
        return transport.all_gather(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            return None, ctx.transport.reduce_scatter(grad.contiguous(), ctx.dim, "sum"), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dim: int, op: str) -> torch.Tensor:
        y = transport.reduce_scatter(x, dim, op)
        ctx.transport, ctx.dim, ctx.op = transport, dim, op
        if op in _NONLINEAR:
            ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        transport = ctx.transport
        with backward_phase():
            full = transport.all_gather(grad.contiguous(), ctx.dim)
            if ctx.op in _NONLINEAR:
                x, y = ctx.saved_tensors
                y_full = transport.all_gather(y, ctx.dim) if ctx.op != "product" else None
                full = full * _local_factor(transport, ctx.op, x, y_full, full)
            elif ctx.op == "avg":
                full = full / transport.world_size
        return None, full, None, None


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dim: int, scale_grad: bool) -> torch.Tensor:
        ctx.transport, ctx.dim, ctx.scale_grad = transport, dim, scale_grad
        shard = x.shape[dim] // transport.world_size
        return x.narrow(dim, transport.rank * shard, shard).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            full = ctx.transport.all_gather(grad.contiguous(), ctx.dim)
        if ctx.scale_grad:
            full = full / ctx.transport.world_size
        return None, full, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, scatter_dim: int, gather_dim: int
                ) -> torch.Tensor:
        ctx.transport, ctx.scatter_dim, ctx.gather_dim = transport, scatter_dim, gather_dim
        return transport.all_to_all(x, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            return None, ctx.transport.all_to_all(grad.contiguous(), ctx.gather_dim, ctx.scatter_dim), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, src: int) -> torch.Tensor:
        ctx.transport, ctx.src = transport, src
        return transport.broadcast(x, src)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            total = ctx.transport.all_reduce(grad.contiguous(), "sum")
        if ctx.transport.rank != ctx.src:
            total = torch.zeros_like(total)
        return None, total, None


class _CopyToGroup(torch.autograd.Function):
    """Megatron's *f*: identity forward, all-reduce (sum) backward."""

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor) -> torch.Tensor:
        ctx.transport = transport
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            return None, ctx.transport.all_reduce(grad.contiguous(), "sum")


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's *g*: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor) -> torch.Tensor:
        return transport.all_reduce(x, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return None, grad
