"""Deliberately wrong backward rules, to show that ``real.verify`` catches them (test the test).

:func:`injected` patches one rule of :mod:`simcomm.autograd` for the duration
of a ``with`` block, in the process it runs in. ``real.verify`` applies it on
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


#: name -> (autograd Function, wrong backward)
FAULTS = {
    "all_gather_backward": (rules._AllGather, _all_gather_no_sum),
    "all_reduce_backward": (rules._AllReduce, _all_reduce_same_op),
    "all_to_all_backward": (rules._AllToAll, _all_to_all_same_dims),
}


@contextlib.contextmanager
def injected(name: str | None) -> Iterator[None]:
    """Run the block with the named wrong rule in place (``None``: no fault)."""
    if name is None:
        yield
        return
    if name not in FAULTS:
        raise ValueError(f"inject fault: unknown fault {name!r}; known: {sorted(FAULTS)}")
    function, wrong = FAULTS[name]
    original = function.__dict__["backward"]
    function.backward = staticmethod(wrong)
    try:
        yield
    finally:
        function.backward = original
