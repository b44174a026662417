"""Deliberately wrong backward rules, to show that ``real.verify`` catches them (test the test).

:func:`injected` replaces one backward rule of :mod:`simcomm.autograd` for the
duration of a ``with`` block, in the process it runs in, through the rules'
own seam (:func:`simcomm.autograd.replaced_backward`). ``real.verify`` applies it on
the worker processes only, so the simulator keeps the right rules.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from simcomm import autograd as rules
from simcomm.trace import backward_phase

__all__ = ["FAULTS", "injected"]


def _all_gather_no_sum(ctx, grad):
    """Keeps this rank's chunk of its own gradient instead of reduce-scattering the ranks' gradients."""
    shard = grad.shape[ctx.dim] // ctx.transport.world_size
    return None, grad.narrow(ctx.dim, ctx.transport.rank * shard, shard).contiguous(), None


def _all_reduce_same_op(ctx, grad):
    """The seed's fault: the backward all-reduces the gradient with the forward's op (wrong for MAX/MIN/PRODUCT)."""
    with backward_phase():
        return None, ctx.transport.all_reduce(grad.contiguous(), ctx.op), None


def _all_to_all_same_dims(ctx, grad):
    """Sends the gradient back with the forward's dims instead of swapping them."""
    with backward_phase():
        return None, ctx.transport.all_to_all(grad.contiguous(), ctx.scatter_dim, ctx.gather_dim), None, None


def _broadcast_all_reduce(ctx, grad):
    """The old broadcast backward without its zeroing: every rank gets the summed gradient."""
    with backward_phase():
        return None, ctx.transport.all_reduce(grad.contiguous(), "sum"), None


def _all_to_all_single_same_splits(ctx, grad):
    """Sends the gradient back with the forward's split lists instead of swapping them."""
    with backward_phase():
        return None, ctx.transport.all_to_all_single(grad.contiguous(), ctx.output_split_sizes,
                                                     ctx.input_split_sizes), None, None


#: fault name -> (name of the backward rule in simcomm.autograd.BACKWARD_RULES, wrong backward)
FAULTS = {
    "all_gather_backward": ("all_gather", _all_gather_no_sum),
    "all_reduce_backward": ("all_reduce", _all_reduce_same_op),
    "all_to_all_backward": ("all_to_all", _all_to_all_same_dims),
    "broadcast_backward": ("broadcast", _broadcast_all_reduce),
    "all_to_all_single_backward": ("all_to_all_single", _all_to_all_single_same_splits),
}


@contextlib.contextmanager
def injected(name: str | None) -> Iterator[None]:
    """Run the block with the named wrong rule in place (``None``: no fault)."""
    if name is None:
        yield
        return
    if name not in FAULTS:
        raise ValueError(f"inject fault: unknown fault {name!r}; known: {sorted(FAULTS)}")
    rule, wrong = FAULTS[name]
    with rules.replaced_backward(rule, wrong):
        yield
