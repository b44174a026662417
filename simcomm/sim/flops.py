"""FLOPs per rank, counted at the dispatcher and recorded on the trace as compute.

``World(n, count_flops=True)`` (with ``tensors="shape"`` or real values) puts a
:class:`FlopCounter` on every rank thread: a ``TorchDispatchMode`` that, for each
aten op that has a FLOP formula in PyTorch's flop counter
(``torch.utils.flop_counter``: matmuls, convolutions, attention, forward and
backward), records a ``compute`` event with ``flops=`` on the rank's trace, as
``comm.compute(flops=...)`` does. :func:`simcomm.model.cost.modelled_timeline`
turns each into seconds with the topology's ``compute_flops``, so the modelled
timeline has a compute lane between the communication without the program
declaring any.

Call chain: aten op on a rank thread -> ``FlopCounter.__torch_dispatch__`` ->
the op runs (on fake tensors: metadata only) -> ``FORMULAS[op](shapes)`` ->
``transport.compute(flops=...)`` -> a ``compute`` event in the run's trace.

**Against FlopCounterMode.** The formulas are torch's own (the
``flop_registry`` dict), so an op counts what ``FlopCounterMode`` counts for it,
with one addition: CPU's fused attention (``_scaled_dot_product_flash_attention_for_cpu``
and its backward, what ``scaled_dot_product_attention`` runs on CPU tensors,
fake ones included) is counted with torch's formula for the CUDA attention
kernels; FlopCounterMode has no entry for it and counts it as zero. No op is
decomposed for counting (FlopCounterMode decomposes ops without a formula
when they have a decomposition), so what the memory tracker sees is what the
program runs. Elementwise ops, norms and softmax count zero, as in
FlopCounterMode. Causal attention is counted in full, as torch counts it.

Cost: one Python call per aten op on the rank (as memory tracking); off unless asked for.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop

from ..transport import Transport

__all__ = ["FORMULAS", "FlopCounter", "op_flops"]

_aten = torch.ops.aten

#: aten op packet -> its FLOP formula ``f(*args, out_val=out, **kwargs) -> int``: torch's, plus CPU attention
FORMULAS: dict[Any, Any] = dict(flop_registry)
FORMULAS.setdefault(_aten._scaled_dot_product_flash_attention_for_cpu, sdpa_flop)
FORMULAS.setdefault(_aten._scaled_dot_product_flash_attention_for_cpu_backward, sdpa_backward_flop)


def op_flops(func, args: tuple, kwargs: dict, out: Any) -> int:
    """FLOPs of one aten op call (0 for an op without a formula)."""
    formula = FORMULAS.get(getattr(func, "_overloadpacket", None))
    if formula is None:
        return 0
    return int(formula(*args, **kwargs, out_val=out))


class FlopCounter(TorchDispatchMode):
    """Records each counted op of this thread as a ``compute`` event of ``transport`` (the
    rank's); ``total`` and ``by_op`` (op name -> FLOPs) keep the sums. Use as a context manager
    on the rank's thread, for the whole program."""

    def __init__(self, transport: Transport):
        super().__init__()
        self.transport = transport
        self.total = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops = op_flops(func, args, kwargs, out)
        if flops:
            self.total += flops
            name = func._overloadpacket.__name__
            self.by_op[name] = self.by_op.get(name, 0) + flops
            self.transport.compute(flops=flops)
        return out
