"""One autograd Function per collective: forward calls the transport, backward is the adjoint.

The Functions take a :class:`~simcomm.transport.Transport` as their first
argument and work unchanged on both backends. Their forward leaves its input
untouched and returns a new tensor; their backward calls are traced with phase
``"backward"``.

**One path.** Each Function's ``compute(transport, x, ...)`` is its forward's
values: one transport call (or none). :func:`apply`, the one way in for the
communicator and for every backward's dual collective, runs ``compute`` alone
when no gradient can flow, else ``Function.apply``, whose ``forward`` is
``compute`` plus what the backward reads (kept on autograd's own ``ctx``, which
belongs to that one call). Each backward is written in its Function.
:data:`BACKWARD_RULES` names every backward (e.g. ``"all_gather"``), so a test
can put a deliberately wrong rule in place for a ``with`` block
(:func:`replaced_backward`, used by ``real.faults``) without touching the
Function classes: while one is replaced, :func:`apply` runs a subclass of the
Function with that backward.

**Gradient convention.** Each backward is the exact adjoint (vector-Jacobian
product) of the forward *when the objective is the sum of the per-rank
losses*: rank ``r`` computes ``loss_r`` and calls ``loss_r.backward()``, and
every rank's input gradient is the derivative of ``sum_r loss_r``. When every
rank instead computes the *same* replicated loss, an all-reduce backward counts
it ``world_size`` times; the conjugate pair :class:`CopyToGroup` /
:class:`ReduceFromGroup` (Megatron's f and g) is written for that convention.

=================  ========================================  ==========================================
Function           forward                                   backward (adjoint)
=================  ========================================  ==========================================
AllReduce          reduce over ranks                         SUM/AVG: all-reduce of the grads (AVG /n);
                                                             MAX/MIN: summed grad to the holder(s) of the
                                                             extreme, split evenly among ties;
                                                             PRODUCT: summed grad x product of the others;
                                                             PREMUL_SUM: summed grad x this rank's factor
AllGather          concat along dim                          reduce-scatter (sum) along dim
ReduceScatter      reduce, keep chunk r                      all-gather along dim (then as AllReduce) 
Slice              keep chunk r of a replicated tensor       all-gather of the grads (/n if scale_grad)
AllToAll           split on scatter_dim, concat on gather    the all-to-all with the two dims swapped
Broadcast          src's tensor everywhere                   reduce (sum) of the grads onto src, zero
                                                             elsewhere
Reduce             reduction on dst, zeros elsewhere         broadcast of dst's grad (AVG /n; MAX/MIN/
                                                             PRODUCT factors as AllReduce); the other 
                                                             ranks' output grads are ignored
Scatter            chunk r of src's tensor                   gather of the grads onto src
Gather             concat on dst (an empty tensor elsewhere) scatter of dst's grad: chunk r to rank r
AllToAllSingle     uneven all-to-all along dim 0             the same with the two split lists swapped
CopyToGroup        identity                                  all-reduce (sum) of the grads
ReduceFromGroup    all-reduce (sum)                          identity
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

__all__ = [
    "apply", "factor_kwargs", "BACKWARD_RULES", "replaced_backward",
    "AllReduce", "AllGather", "ReduceScatter", "Slice", "AllToAll", "Broadcast", "CopyToGroup",
    "ReduceFromGroup", "Reduce", "Scatter", "Gather", "AllToAllSingle",
]

_NONLINEAR = ("max", "min", "product")


def apply(rule: type[torch.autograd.Function], transport: Transport, input_: torch.Tensor, *args: Any
          ) -> Any:
    """``rule.apply`` when a gradient can flow through ``input_`` (or a tensor argument, e.g.
    a PREMUL_SUM factor); else ``rule.compute``, the same values without autograd's
    bookkeeping. The communicator uses it, and so does every backward for its dual
    collective: inside a backward, grad mode is on exactly under ``create_graph=True``."""
    if torch.is_grad_enabled() and (input_.requires_grad or any(
            isinstance(arg, torch.Tensor) and arg.requires_grad for arg in args)):
        backward = BACKWARD_RULES[rule.rule]
        if backward is not rule.backward:       # replaced_backward: a wrong rule in place
            rule = type(rule.__name__, (rule,), {"backward": staticmethod(backward)})
        return rule.apply(transport, input_, *args)
    return rule.compute(transport, input_, *args)


def factor_kwargs(factor: float | torch.Tensor | None) -> dict:
    """The transport's ``factor=`` keyword, only for PREMUL_SUM (other transports need not know it)."""
    return {} if factor is None else {"factor": factor.detach() if isinstance(factor, torch.Tensor) else factor}


def _others_product(transport: Transport, x: torch.Tensor) -> torch.Tensor:
    """The product of the other ranks' ``x``, differentiable across ranks (for a
    ``create_graph`` backward): an all-gather of the inputs, then a local product that
    leaves this rank's own row out, so zeros need no special case."""
    stacked = apply(AllGather, transport, x.unsqueeze(0).contiguous(), 0)   # (world, *x.shape)
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


class AllReduce(torch.autograd.Function):
    rule = "all_reduce"

    @staticmethod
    def compute(transport: Transport, x: torch.Tensor, op: str,
                factor: float | torch.Tensor | None = None) -> torch.Tensor:
        return transport.all_reduce(x, op, **factor_kwargs(factor))

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, op: str,
                factor: float | torch.Tensor | None = None) -> torch.Tensor:
        y = AllReduce.compute(transport, x, op, factor)
        ctx.transport, ctx.op = transport, op
        _save(ctx, op, factor, x, y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            total = apply(AllReduce, ctx.transport, grad.contiguous(), "sum")
            factor_grad = _factor_grad(ctx, total)
            total = _through_reduction(ctx, total, lambda y: y)
        return None, total, None, factor_grad


class AllGather(torch.autograd.Function):
    rule = "all_gather"

    @staticmethod
    def compute(transport: Transport, x: torch.Tensor, dim: int) -> torch.Tensor:
        return transport.all_gather(x, dim)

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.transport, ctx.dim = transport, dim
        return AllGather.compute(transport, x, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            return None, apply(ReduceScatter, ctx.transport, grad.contiguous(), ctx.dim, "sum"), None


class ReduceScatter(torch.autograd.Function):
    rule = "reduce_scatter"

    @staticmethod
    def compute(transport: Transport, x: torch.Tensor, dim: int, op: str,
                factor: float | torch.Tensor | None = None) -> torch.Tensor:
        return transport.reduce_scatter(x, dim, op, **factor_kwargs(factor))

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dim: int, op: str,
                factor: float | torch.Tensor | None = None) -> torch.Tensor:
        y = ReduceScatter.compute(transport, x, dim, op, factor)
        ctx.transport, ctx.dim, ctx.op = transport, dim, op
        _save(ctx, op, factor, x, y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        transport = ctx.transport
        with backward_phase():
            full = apply(AllGather, transport, grad.contiguous(), ctx.dim)
            factor_grad = _factor_grad(ctx, full)
            full = _through_reduction(ctx, full, lambda y: transport.all_gather(y, ctx.dim))
        return None, full, None, None, factor_grad


class Slice(torch.autograd.Function):
    rule = "slice"

    @staticmethod
    def compute(transport: Transport, x: torch.Tensor, dim: int, scale_grad: bool) -> torch.Tensor:
        shard = x.shape[dim] // transport.world_size
        # a copy even when the chunk is already contiguous: the output never aliases the input
        return x.narrow(dim, transport.rank * shard, shard).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dim: int, scale_grad: bool) -> torch.Tensor:
        ctx.transport, ctx.dim, ctx.scale_grad = transport, dim, scale_grad
        return Slice.compute(transport, x, dim, scale_grad)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            full = apply(AllGather, ctx.transport, grad.contiguous(), ctx.dim)
        if ctx.scale_grad:
            full = full / ctx.transport.world_size
        return None, full, None, None


class AllToAll(torch.autograd.Function):
    rule = "all_to_all"

    @staticmethod
    def compute(transport: Transport, x: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        return transport.all_to_all(x, scatter_dim, gather_dim)

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, scatter_dim: int, gather_dim: int
                ) -> torch.Tensor:
        ctx.transport, ctx.scatter_dim, ctx.gather_dim = transport, scatter_dim, gather_dim
        return AllToAll.compute(transport, x, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            return None, apply(AllToAll, ctx.transport, grad.contiguous(), ctx.gather_dim, ctx.scatter_dim), None, None


class Broadcast(torch.autograd.Function):
    rule = "broadcast"

    @staticmethod
    def compute(transport: Transport, x: torch.Tensor, src: int) -> torch.Tensor:
        return transport.broadcast(x, src)

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, src: int) -> torch.Tensor:
        ctx.transport, ctx.src = transport, src
        return Broadcast.compute(transport, x, src)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            # broadcast's dual: the reduce (sum) onto src; the other ranks get zeros
            return None, apply(Reduce, ctx.transport, grad.contiguous(), ctx.src, "sum"), None


class CopyToGroup(torch.autograd.Function):
    """Megatron's *f*: identity forward, all-reduce (sum) backward."""

    rule = "copy_to_group"

    @staticmethod
    def compute(transport: Transport, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor) -> torch.Tensor:
        ctx.transport = transport
        return CopyToGroup.compute(transport, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            return None, apply(AllReduce, ctx.transport, grad.contiguous(), "sum")


class ReduceFromGroup(torch.autograd.Function):
    """Megatron's *g*: all-reduce (sum) forward, identity backward."""

    rule = "reduce_from_group"

    @staticmethod
    def compute(transport: Transport, x: torch.Tensor) -> torch.Tensor:
        return transport.all_reduce(x, "sum")

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor) -> torch.Tensor:
        return ReduceFromGroup.compute(transport, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return None, grad


class Reduce(torch.autograd.Function):
    """Reduction onto ``dst``; the other ranks get zeros (a constant: their output grads are ignored)."""

    rule = "reduce"

    @staticmethod
    def compute(transport: Transport, x: torch.Tensor, dst: int, op: str,
                factor: float | torch.Tensor | None = None) -> torch.Tensor:
        return transport.reduce(x, dst, op, **factor_kwargs(factor))

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dst: int, op: str,
                factor: float | torch.Tensor | None = None) -> torch.Tensor:
        y = Reduce.compute(transport, x, dst, op, factor)
        ctx.transport, ctx.dst, ctx.op = transport, dst, op
        _save(ctx, op, factor, x, y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        transport = ctx.transport
        with backward_phase():
            total = apply(Broadcast, transport, grad.contiguous(), ctx.dst)   # dst's grad, on every rank
            factor_grad = _factor_grad(ctx, total)
            total = _through_reduction(ctx, total, lambda y: transport.broadcast(y, ctx.dst))   # dst's result
        return None, total, None, None, factor_grad


class Scatter(torch.autograd.Function):
    """Chunk ``r`` of ``src``'s tensor on rank ``r``.

    ``x`` is src's tensor on ``src``; on the other ranks a placeholder that
    requires grad (its gradient is ``None``: zero), so their output can
    require grad too: it does exactly when src's tensor requires grad (src
    says so in the same call).
    """

    rule = "scatter"

    @staticmethod
    def scatter(transport: Transport, x: torch.Tensor, src: int, dim: int, requires_grad: bool
                ) -> tuple[torch.Tensor, bool]:
        """``(the chunk, whether src's tensor requires grad)``: the transport's scatter."""
        return transport.scatter(x if transport.rank == src else None, src, dim, requires_grad=requires_grad)

    @staticmethod
    def compute(transport: Transport, x: torch.Tensor, src: int, dim: int, requires_grad: bool
                ) -> torch.Tensor:
        return Scatter.scatter(transport, x, src, dim, requires_grad)[0]

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, src: int, dim: int,
                requires_grad: bool) -> torch.Tensor:
        chunk, source_requires_grad = Scatter.scatter(transport, x, src, dim, requires_grad)
        # off src ``dim`` may be negative: name it as src does, for the backward's gather
        ctx.transport, ctx.src, ctx.dim = transport, src, dim % chunk.dim()
        ctx.placeholder_shape = x.shape
        if not source_requires_grad:
            ctx.mark_non_differentiable(chunk)
        return chunk

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        transport = ctx.transport
        with backward_phase():
            if not torch.is_grad_enabled():
                full = transport.gather(grad.contiguous(), ctx.src, ctx.dim)   # None off src
            else:   # create_graph: the gather as a Function; off src its empty output stays in the graph
                gathered = apply(Gather, transport, grad.contiguous(), ctx.src, ctx.dim)
                full = gathered if transport.rank == ctx.src else \
                    torch.zeros(ctx.placeholder_shape, dtype=grad.dtype, device=grad.device) + gathered.sum()
        return None, full, None, None, None


class Gather(torch.autograd.Function):
    """Concatenation on ``dst``; the other ranks get an empty tensor (size 0 along ``dim``)
    that carries no value but lets them take part in the backward (``compute`` alone gives
    ``None`` there)."""

    rule = "gather"

    @staticmethod
    def compute(transport: Transport, x: torch.Tensor, dst: int, dim: int) -> torch.Tensor | None:
        return transport.gather(x, dst, dim)

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, dst: int, dim: int) -> torch.Tensor:
        ctx.transport, ctx.dst, ctx.dim = transport, dst, dim
        out = Gather.compute(transport, x, dst, dim)
        if out is None:
            out = x.new_empty((*x.shape[:dim], 0, *x.shape[dim + 1:]))   # size 0 at dim
            ctx.save_for_backward(out)   # a create_graph backward keeps this rank in the graph with it
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        transport = ctx.transport
        is_dst = transport.rank == ctx.dst
        with backward_phase():
            if not torch.is_grad_enabled():
                chunk, _ = transport.scatter(grad.contiguous() if is_dst else None, ctx.dst, ctx.dim)
            else:   # create_graph: the scatter as a Function; off dst the saved empty output is its
                # placeholder, so this rank's double backward runs this gather's scatter again
                (placeholder,) = (grad.contiguous(),) if is_dst else ctx.saved_tensors
                chunk = apply(Scatter, transport, placeholder, ctx.dst, ctx.dim, is_dst and grad.requires_grad)
        return None, chunk, None, None


class AllToAllSingle(torch.autograd.Function):
    rule = "all_to_all_single"

    @staticmethod
    def compute(transport: Transport, x: torch.Tensor, output_split_sizes: list[int],
                input_split_sizes: list[int]) -> torch.Tensor:
        return transport.all_to_all_single(x, output_split_sizes, input_split_sizes)

    @staticmethod
    def forward(ctx: Any, transport: Transport, x: torch.Tensor, output_split_sizes: list[int],
                input_split_sizes: list[int]) -> torch.Tensor:
        ctx.transport = transport
        ctx.output_split_sizes, ctx.input_split_sizes = output_split_sizes, input_split_sizes
        return AllToAllSingle.compute(transport, x, output_split_sizes, input_split_sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        with backward_phase():
            # every row goes back where it came from: the two split lists swap roles
            back = apply(AllToAllSingle, ctx.transport, grad.contiguous(), ctx.input_split_sizes,
                         ctx.output_split_sizes)
        return None, back, None, None


#: name -> the backward(ctx, grad) in use for the Function of that name (its ``rule``): its
#: own, unless :func:`replaced_backward` put another in place
BACKWARD_RULES: dict[str, Callable[..., tuple]] = {
    function.rule: function.backward
    for function in (AllReduce, AllGather, ReduceScatter, Slice, AllToAll, Broadcast, CopyToGroup,
                     ReduceFromGroup, Reduce, Scatter, Gather, AllToAllSingle)}


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
