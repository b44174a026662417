"""Loss scaling on shape-only ranks: every ``GradScaler`` step is the step without overflow.

A mixed-precision training step with ``torch.amp.GradScaler`` (also
``torch.cuda.amp.GradScaler``, ``GradScaler("cpu")``) asks the gradients a
question about their values: ``unscale_`` runs
``torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``,
which divides every gradient by the scale and sets ``found_inf`` to 1 when one
of them holds an inf or a NaN (else leaves it as it is); ``step`` then reads
``found_inf.item()`` to decide whether to run the optimizer, and ``update`` runs
``torch._amp_update_scale_(scale, growth_tracker, found_inf, ...)``, which halves
the scale after an overflow and doubles it after ``growth_interval`` steps
without one.

A shape-only rank's gradients are fake tensors: there is no inf to find. Its
rule is that **a shape-only step is the step without overflow**, the step that
updates the parameters and the optimizer's state, whose memory and
communication a shape-only run is about. So where the gradients have no value,
``_amp_foreach_non_finite_check_and_unscale_`` unscales them as fake tensors
(their storage loses any value it had) and leaves ``found_inf`` as the op leaves
it when every gradient is finite: its value (``GradScaler`` makes it with
``torch.full((), 0.0)``, a constant: module docstring of
:mod:`simcomm.sim.shape`, "Values of constants") stays. ``step`` then reads 0
and runs the optimizer, and ``_amp_update_scale_`` computes the new scale and
growth tracker with values, from constants (the initial scale, the growth
factor and interval): ``scaler.get_scale()`` and ``scaler.state_dict()`` are
what a real-valued run without overflow gives, step for step.

stderr says so once per run (:data:`AMP_NOTICE`). A real-valued run that
overflows (the first steps of fp16 training often do: the scale starts at
2**16) skips those optimizer steps and lowers its scale; the shape-only run
does not, so its ``get_scale()`` differs from such a run's, and its optimizer
state exists from the first step on (as after a step without overflow).
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["AMP_NOTICE", "WITHOUT_OVERFLOW", "unscale_without_overflow"]

#: the line a run that applies the rule prints to stderr, once
AMP_NOTICE = ("simcomm: shape-only ranks (tensors='shape') take every GradScaler step as one without "
              "overflow: the fake gradients hold no inf or NaN, so the optimizer steps and the scale "
              "grows as in a real-valued run without overflow")


def unscale_without_overflow(args: tuple, kwargs: dict) -> None:
    """After ``_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)`` ran on
    fake gradients without values: the gradients' storage loses its values (the op wrote them),
    ``found_inf`` keeps its own (no gradient was found infinite), and stderr says so once per run."""
    from .shape import forget_values, value_of
    from .shape_reads import notice_once

    grads = args[0] if args else kwargs.get("self", ())
    for grad in grads:
        forget_values(grad)
    found_inf = args[1] if len(args) > 1 else kwargs.get("found_inf")
    if value_of(found_inf) is not None:
        notice_once(AMP_NOTICE)


#: the ops whose writes a shape-only rank answers by a rule of this module where their tensors
#: have no values (:func:`simcomm.sim.shape._with_values`): op -> what to do after the fake op ran
WITHOUT_OVERFLOW: dict[Any, Any] = {
    torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default: unscale_without_overflow,
}
