"""One autograd Function per collective: forward calls the transport, backward is the adjoint.

The Functions take a :class:`~simcomm.transport.Transport` as their first
argument and work unchanged on both backends. Their forward leaves its input
untouched and returns a new tensor; their backward calls are traced with phase
``"backward"``.

Each backward is looked up by name in a small registry (:data:`BACKWARD_RULES`,
e.g. ``"all_gather"``), so a test can put a deliberately wrong rule in place
for a ``with`` block (:func:`replaced_backward`, used by ``real.faults``)
without touching the Function classes.

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
                                                             PRODUCT: summed grad x product of the others;
                                                             PREMUL_SUM: summed grad x this rank's factor
_AllGather         concat along dim                          reduce-scatter (sum) along dim
_ReduceScatter     reduce, keep chunk r                      all-gather along dim (then as _AllReduce)
_Slice             keep chunk r of a replicated tensor       all-gather of the grads (/n if scale_grad)
_AllToAll          split on scatter_dim, concat on gather    the all-to-all with the two dims swapped
_Broadcast         src's tensor everywhere                   reduce (sum) of the grads onto src, zero
                                                             elsewhere
_Reduce            reduction on dst, zeros elsewhere         broadcast of dst's grad (AVG /n; MAX/MIN/
                                                             PRODUCT factors as _AllReduce); the other
                                                             ranks' output grads are ignored
_Scatter           chunk r of src's tensor                   gather of the grads onto src
_Gather            concat on dst (an empty tensor elsewhere) scatter of dst's grad: chunk r to rank r
_AllToAllSingle    uneven all-to-all along dim 0             the same with the two split lists swapped
_CopyToGroup       identity                                  all-reduce (sum) of the grads
_ReduceFromGroup   all-reduce (sum)                          identity
=================  ========================================  ==========================================

**PREMUL_SUM.** Forward, every rank gets ``y = sum_s f_s x_s`` (rank ``s``
multiplies its own input by its own factor ``f_s``). With the objective
``L = sum_r L_r(y_r)`` and ``g_r = dL_r/dy_r``, ``dL/dx_r = f_r * sum_s g_s``:
the backward is the SUM all-reduce of the gradients (the same collective as for
SUM, same bytes), then this rank's own factor, locally. When every rank's
factor is the same this equals a PREMUL_SUM all-reduce of the gradients with
that factor; with different factors only the form above is the adjoint. A
factor given as a tensor that requires grad gets ``dL/df_r = sum(x_r * sum_s g_s)``.
Reduce-scatter and reduce use the same factor after their all-gather /
broadcast of the gradients.

**Higher derivatives.** Every backward is itself differentiable: it calls its
dual collective through that collective's Function (:func:`apply`), as
``torch.distributed.nn.functional`` does, so ``torch.autograd.grad(...,
create_graph=True)`` builds a graph that reaches the other ranks, and double
backward, Hessian-vector products and gradient penalties are exact. Without
``create_graph`` (grad mode off inside backward) the duals run as plain
transport calls. PRODUCT's factor (the product of the other ranks' values) is
then an all-gather of the inputs and a local product, so its own derivative
is exact too; MAX/MIN's factor (which rank holds the extreme) is piecewise
constant, its derivative zero. ``gather`` and ``scatter`` keep the ranks off
the root in the graph with an empty tensor (the saved forward output, or the
gathered gradient) so that they join the root's collectives in the double
backward. As for the first derivative, every rank must run the double
backward; a rank that skips it leaves the others waiting, which the simulator
reports as a ``DeadlockError``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .checks import PREMUL_SUM
from .collectives import premultiply
from .trace import backward_phase
from .transport import Transport

_NONLINEAR = ("max", "min", "product")


class _NoGradContext:
    """Stands in for autograd's ctx when no gradient can flow: what a rule stores on it
    is never read (one instance serves every rank and call)."""

    def save_for_backward(self, *tensors) -> None:
        pass

    def mark_non_differentiable(self, *tensors) -> None:
        pass


_NO_GRAD_CTX = _NoGradContext()


def apply(rule: type[torch.autograd.Function], transport: Transport, input_: torch.Tensor, *args: Any
          ) -> Any:
    """``rule.apply`` when a gradient can flow through ``input_`` (or a tensor argument, e.g.
    a PREMUL_SUM factor); else its forward alone, which computes the same values without
    autograd's bookkeeping. The public methods use it, and so does every backward for its
    dual collective: inside a backward, grad mode is on exactly under ``create_graph=True``."""
    if torch.is_grad_enabled():
        if input_.requires_grad:
            return rule.apply(transport, input_, *args)
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.requires_grad:
                return rule.apply(transport, input_, *args)
    return rule.forward(_NO_GRAD_CTX, transport, input_, *args)


def _others_product(transport: Transport, x: torch.Tensor) -> torch.Tensor:
    """The product of the other ranks' ``x``, differentiable across ranks (for a
    ``create_graph`` backward): an all-gather of the inputs, then a local product that
    leaves this rank's own row out, so zeros need no special case."""
    stacked = apply(_AllGather, transport, x.unsqueeze(0).contiguous(), 0)   # (world, *x.shape)
    rank = transport.rank
    return torch.cat([stacked[:rank], stacked[rank + 1:]]).prod(0)


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
        x, y_full = x.detach(), y_full.detach()   # which rank holds the extreme: piecewise constant
        holds = (x == y_full).to(like.dtype)
        holders = transport.all_reduce(holds, "sum")  # how many ranks tie for the extreme
        # no holder only where the extreme is NaN: 0/0 gives NaN there, as the single-device amax does
        return holds / holders
    # product: the product of the *other* ranks' values, exact when some are zero
    if torch.is_grad_enabled():     # a create_graph backward: its own derivative must reach the ranks
        return _others_product(transport, x).to(like.dtype)
    is_zero = x == 0
    nonzero = torch.where(is_zero, torch.ones_like(x), x)
    prod_nonzero = transport.all_reduce(nonzero.contiguous(), "product")
    zeros = transport.all_reduce(is_zero.to(like.dtype).contiguous(), "sum")
    others_if_nonzero = torch.where(zeros == 0, prod_nonzero / nonzero, torch.zeros_like(prod_nonzero))
    others_if_zero = torch.where(zeros == 1, prod_nonzero, torch.zeros_like(prod_nonzero))
    return torch.where(is_zero, others_if_zero, others_if_nonzero).to(like.dtype)


#: name -> backward(ctx, grad) of the Function of that name; see :func:`replaced_backward`
BACKWARD_RULES: dict[str, Callable[..., tuple]] = {}


def _rule(name: str) -> Callable[[Callable], Callable]:
    def register(backward: Callable) -> Callable:
        BACKWARD_RULES[name] = backward
        return backward
    return register


@contextlib.contextmanager
def replaced_backward(name: str, backward: Callable[..., tuple]) -> Iterator[None]:
    """Use ``backward(ctx, grad)`` as the backward rule ``name`` inside the block (every
    thread of this process sees it; for tests that show a wrong rule gets caught)."""
    if name not in BACKWARD_RULES:
        raise ValueError(f"replaced_backward: unknown rule {name!r}; known: {sorted(BACKWARD_RULES)}")
    original = BACKWARD_RULES[name]
    BACKWARD_RULES[name] = backward
    try:
        yield
    finally:
        BACKWARD_RULES[name] = original


def _factor_kwargs(factor: float | torch.Tensor | None) -> dict:
    """The transport's ``factor=`` keyword, only for PREMUL_SUM (other transports need not know it)."""
    return {} if factor is None else {"factor": factor.detach() if isinstance(factor, torch.Tensor) else factor}


def _save(ctx: Any, op: str, factor: float | torch.Tensor | None, x: torch.Tensor, y: torch.Tensor) -> None:
    """What a reducing Function's backward needs: ``(x, y)`` for MAX/MIN/PRODUCT, ``(x,)`` for a
    PREMUL_SUM whose factor is a tensor that requires grad; the factor itself on ``ctx``."""
    ctx.factor = factor
    ctx.factor_grad = isinstance(factor, torch.Tensor) and factor.requires_grad
    if op in _NONLINEAR:
        ctx.save_for_backward(x, y)
    elif ctx.factor_grad:
        ctx.save_for_backward(x)


def _factor_grad(ctx: Any, total: torch.Tensor) -> torch.Tensor | None:
    """d(sum_r L_r)/d factor on this rank: ``sum(x * total)``, ``total`` the summed gradient
    at the input's shape; ``None`` unless the factor is a tensor that requires grad."""
    if not getattr(ctx, "factor_grad", False):
        return None
    (x,) = ctx.saved_tensors
    factor = ctx.factor
    return (x * total).sum().real.to(factor.dtype).reshape(factor.shape)


def _through_reduction(ctx: Any, grad: torch.Tensor, full_result) -> torch.Tensor:
    """``grad`` (the gradient reaching the reduced tensor, at the input's shape) times the
    derivative of ``ctx.op``'s reduction with respect to this rank's input. ``full_result``
    brings the saved forward result to the input's shape (MAX/MIN compare it with the input);
    MAX/MIN/PRODUCT need ``ctx.saved_tensors == (x, y)``."""
    if ctx.op == "sum":
        return grad
    if ctx.op == "avg":
        return grad / ctx.transport.world_size
    if ctx.op == PREMUL_SUM:   # a tensor factor keeps its graph under create_graph
        return premultiply(grad, ctx.factor)
    x, y = ctx.saved_tensors
    y_full = full_result(y) if ctx.op != "product" else None
    return grad * _local_factor(ctx.transport, ctx.op, x, y_full, grad)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, op: str,
                factor: float | torch.Tensor | None = None) -> torch.Tensor:
        if factor is None:
            y = transport.all_reduce(x, op)
        else:
            y = transport.all_reduce(x, op, **_factor_kwargs(factor))
        if ctx is not _NO_GRAD_CTX:     # what the backward reads; nothing when it never runs
            ctx.transport, ctx.op = transport, op
            _save(ctx, op, factor, x, y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return BACKWARD_RULES["all_reduce"](ctx, grad)


@_rule("all_reduce")
def _all_reduce_backward(ctx: Any, grad: torch.Tensor):
    with backward_phase():
        total = apply(_AllReduce, ctx.transport, grad.contiguous(), "sum")
        factor_grad = _factor_grad(ctx, total)
        total = _through_reduction(ctx, total, lambda y: y)
    return None, total, None, factor_grad


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.transport, ctx.dim = transport, dim
        return transport.all_gather(x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return BACKWARD_RULES["all_gather"](ctx, grad)


@_rule("all_gather")
def _all_gather_backward(ctx: Any, grad: torch.Tensor):
    with backward_phase():
        return None, apply(_ReduceScatter, ctx.transport, grad.contiguous(), ctx.dim, "sum"), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dim: int, op: str,
                factor: float | torch.Tensor | None = None) -> torch.Tensor:
        y = transport.reduce_scatter(x, dim, op, **_factor_kwargs(factor))
        ctx.transport, ctx.dim, ctx.op = transport, dim, op
        _save(ctx, op, factor, x, y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return BACKWARD_RULES["reduce_scatter"](ctx, grad)


@_rule("reduce_scatter")
def _reduce_scatter_backward(ctx: Any, grad: torch.Tensor):
    transport = ctx.transport
    with backward_phase():
        full = apply(_AllGather, transport, grad.contiguous(), ctx.dim)
        factor_grad = _factor_grad(ctx, full)
        full = _through_reduction(ctx, full, lambda y: transport.all_gather(y, ctx.dim))
    return None, full, None, None, factor_grad


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dim: int, scale_grad: bool) -> torch.Tensor:
        ctx.transport, ctx.dim, ctx.scale_grad = transport, dim, scale_grad
        shard = x.shape[dim] // transport.world_size
        # a copy even when the chunk is already contiguous: the output never aliases the input
        return x.narrow(dim, transport.rank * shard, shard).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return BACKWARD_RULES["slice"](ctx, grad)


@_rule("slice")
def _slice_backward(ctx: Any, grad: torch.Tensor):
    with backward_phase():
        full = apply(_AllGather, ctx.transport, grad.contiguous(), ctx.dim)
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
        return BACKWARD_RULES["all_to_all"](ctx, grad)


@_rule("all_to_all")
def _all_to_all_backward(ctx: Any, grad: torch.Tensor):
    with backward_phase():
        return None, apply(_AllToAll, ctx.transport, grad.contiguous(), ctx.gather_dim, ctx.scatter_dim), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, src: int) -> torch.Tensor:
        ctx.transport, ctx.src = transport, src
        return transport.broadcast(x, src)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return BACKWARD_RULES["broadcast"](ctx, grad)


@_rule("broadcast")
def _broadcast_backward(ctx: Any, grad: torch.Tensor):
    with backward_phase():
        # broadcast's dual: the reduce (sum) onto src; the other ranks get zeros
        return None, apply(_Reduce, ctx.transport, grad.contiguous(), ctx.src, "sum"), None


class _CopyToGroup(torch.autograd.Function):
    """Megatron's *f*: identity forward, all-reduce (sum) backward."""

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor) -> torch.Tensor:
        ctx.transport = transport
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return BACKWARD_RULES["copy_to_group"](ctx, grad)


@_rule("copy_to_group")
def _copy_to_group_backward(ctx: Any, grad: torch.Tensor):
    with backward_phase():
        return None, apply(_AllReduce, ctx.transport, grad.contiguous(), "sum")


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron's *g*: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor) -> torch.Tensor:
        return transport.all_reduce(x, "sum")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return BACKWARD_RULES["reduce_from_group"](ctx, grad)


@_rule("reduce_from_group")
def _reduce_from_group_backward(ctx: Any, grad: torch.Tensor):
    return None, grad


class _Reduce(torch.autograd.Function):
    """Reduction onto ``dst``; the other ranks get zeros (a constant: their output grads are ignored)."""

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dst: int, op: str,
                factor: float | torch.Tensor | None = None) -> torch.Tensor:
        y = transport.reduce(x, dst, op, **_factor_kwargs(factor))
        ctx.transport, ctx.dst, ctx.op = transport, dst, op
        _save(ctx, op, factor, x, y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return BACKWARD_RULES["reduce"](ctx, grad)


@_rule("reduce")
def _reduce_backward(ctx: Any, grad: torch.Tensor):
    transport = ctx.transport
    with backward_phase():
        total = apply(_Broadcast, transport, grad.contiguous(), ctx.dst)   # dst's grad, on every rank
        factor_grad = _factor_grad(ctx, total)
        total = _through_reduction(ctx, total, lambda y: transport.broadcast(y, ctx.dst))   # dst's result
    return None, total, None, None, factor_grad


class _Scatter(torch.autograd.Function):
    """Chunk ``r`` of ``src``'s tensor on rank ``r``.

    ``x`` is src's tensor on ``src``; on the other ranks a placeholder that
    requires grad (its gradient is ``None``: zero), so their output can
    require grad too: it does exactly when src's tensor requires grad (src
    says so in the same call).
    """

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, src: int, dim: int,
                requires_grad: bool) -> torch.Tensor:
        is_src = transport.rank == src
        chunk, source_requires_grad = transport.scatter(x if is_src else None, src, dim,
                                                        requires_grad=requires_grad)
        # off src ``dim`` may be negative: name it as src does, for the backward's gather
        ctx.transport, ctx.src, ctx.dim = transport, src, dim % chunk.dim()
        ctx.placeholder_shape = x.shape
        if not source_requires_grad:
            ctx.mark_non_differentiable(chunk)
        return chunk

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return BACKWARD_RULES["scatter"](ctx, grad)


@_rule("scatter")
def _scatter_backward(ctx: Any, grad: torch.Tensor):
    transport = ctx.transport
    with backward_phase():
        if not torch.is_grad_enabled():
            full = transport.gather(grad.contiguous(), ctx.src, ctx.dim)   # None off src
        else:   # create_graph: the gather as a Function; off src its empty output stays in the graph
            gathered = apply(_Gather, transport, grad.contiguous(), ctx.src, ctx.dim)
            full = gathered if transport.rank == ctx.src else \
                torch.zeros(ctx.placeholder_shape, dtype=grad.dtype, device=grad.device) + gathered.sum()
    return None, full, None, None, None


class _Gather(torch.autograd.Function):
    """Concatenation on ``dst``; the other ranks get an empty tensor (size 0 along ``dim``)
    that carries no value but lets them take part in the backward."""

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dst: int, dim: int) -> torch.Tensor:
        ctx.transport, ctx.dst, ctx.dim = transport, dst, dim
        out = transport.gather(x, dst, dim)
        if out is None:
            out = x.new_empty((*x.shape[:dim], 0, *x.shape[dim + 1:]))   # size 0 at dim
            ctx.save_for_backward(out)   # a create_graph backward keeps this rank in the graph with it
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return BACKWARD_RULES["gather"](ctx, grad)


@_rule("gather")
def _gather_backward(ctx: Any, grad: torch.Tensor):
    transport = ctx.transport
    is_dst = transport.rank == ctx.dst
    with backward_phase():
        if not torch.is_grad_enabled():
            chunk, _ = transport.scatter(grad.contiguous() if is_dst else None, ctx.dst, ctx.dim)
        else:   # create_graph: the scatter as a Function; off dst the saved empty output is its
            # placeholder, so this rank's double backward runs this gather's scatter again
            (placeholder,) = (grad.contiguous(),) if is_dst else ctx.saved_tensors
            chunk = _Scatter.apply(transport, placeholder, ctx.dst, ctx.dim, is_dst and grad.requires_grad)
    return None, chunk, None, None


class _AllToAllSingle(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, output_split_sizes: list[int],
                input_split_sizes: list[int]) -> torch.Tensor:
        ctx.transport = transport
        ctx.output_split_sizes, ctx.input_split_sizes = output_split_sizes, input_split_sizes
        return transport.all_to_all_single(x, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return BACKWARD_RULES["all_to_all_single"](ctx, grad)


@_rule("all_to_all_single")
def _all_to_all_single_backward(ctx: Any, grad: torch.Tensor):
    with backward_phase():
        # every row goes back where it came from: the two split lists swap roles
        back = apply(_AllToAllSingle, ctx.transport, grad.contiguous(), ctx.input_split_sizes,
                     ctx.output_split_sizes)
    return None, back, None, None
