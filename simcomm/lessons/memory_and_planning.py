"""Exercise checkers of lessons 13 and 15 (activation memory, mixed precision, planning a cluster).

Every checker takes what the learner wrote and *returns* one verdict
(:mod:`simcomm.lessons.verdicts`): :data:`NOT_ANSWERED` for the untouched
placeholder, ``Not yet: ...`` for a wrong, partial or malformed answer,
``Correct: ...`` for a right one. A ``Not yet`` verdict states the problem
only; the hint comes with ``show_hint=True`` (every checker takes it). Programs
a checker runs go to the simulator. The right answers are computed from the
library (``activations.expected_bytes``, ``mixed_precision.expected_bytes``,
the planner); the solutions live in the lessons, as collapsed Markdown cells
that Run All does not execute.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..models.llama import Config
from ..parallel import mixed_precision
from ..planning import activations
from ..planning import planner as plan
from ..sim.world import World
from .verdicts import NOT_ANSWERED, as_number, attempt, hint_on_request, is_correct, is_placeholder, not_yet

__all__ = ["NOT_ANSWERED", "is_correct", "check_activation_prediction", "check_model_state_bytes",
           "check_skip_step", "check_plan_choice", "check_sequence_doubling", "check_out_of_memory_reason"]


# -- lesson 13: its checkers live in simcomm.lessons.lesson_13 ------------------------------------

from .lesson_13 import check_activation_prediction, check_model_state_bytes, check_skip_step  # noqa: E402


# -- lesson 15 ---------------------------------------------------------------------------------

def _layout(answer: Any) -> tuple[int, ...] | None:
    if not isinstance(answer, (tuple, list)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                        for v in answer):
        return None
    return tuple(answer)


@hint_on_request
def check_plan_choice(answer: Any, rows: list[dict], limit: float) -> str:
    """``answer``: the ``(tp, cp, pp, dp)`` of ``rows`` (:func:`simcomm.planning.planner.plan`) with the
    shortest modelled step whose memory per GPU fits ``limit`` bytes."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    got = _layout(answer)
    if got is None or len(got) != 4:
        return not_yet(f"give the layout as a tuple (tp, cp, pp, dp) of four ints; got {answer!r}")
    by_layout = {plan.key(row): row for row in rows}
    if got not in by_layout:
        return not_yet(f"{got} is not a layout of the table", "copy one (tp, cp, pp, dp) from the rows")
    row = by_layout[got]
    if row["total"] > limit:
        return not_yet(f"{got} needs {row['total'] / 2**30:.1f} GiB per GPU, more than {limit / 2**30:.0f} GiB",
                       "filter the rows by memory first")
    if got != plan.fastest_fitting(rows, limit):
        return not_yet(f"{got} fits, but a layout that fits has a shorter modelled step "
                       f"(yours: {row['step_time']:.2f} s)", "among the rows that fit, take the smallest step_time")
    return f"Correct: {got} is the fastest layout that fits {limit / 2**30:.0f} GiB per GPU."


def _grown_dimension(model: Config, gpus: int, seq: int, limit: float, **kwargs: Any) -> str:
    """The dimension (``"tp"``, ``"cp"``, ``"pp"`` or ``"dp"``) the best fitting layout grows when the
    sequence doubles (the planner run at both lengths)."""
    before = plan.fastest_fitting(plan.plan(model, gpus, seq=seq, **kwargs), limit)
    after = plan.fastest_fitting(plan.plan(model, gpus, seq=2 * seq, **kwargs), limit)
    grown = [name for name, a, b in zip(plan.DIMENSIONS, before, after) if b > a]
    return grown[0] if grown else "none"


@hint_on_request
def check_sequence_doubling(answer: Any, model: Config, gpus: int, seq: int, limit: float,
                            **kwargs: Any) -> str:
    """``answer``: which of ``"tp"``, ``"cp"``, ``"pp"``, ``"dp"`` the planner's best layout grows when
    ``seq`` doubles (``kwargs`` go to :func:`simcomm.planning.planner.plan`)."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    if not isinstance(answer, str) or answer.strip().lower() not in plan.DIMENSIONS:
        return not_yet(f"answer one of {list(plan.DIMENSIONS)}; got {answer!r}")
    right = _grown_dimension(model, gpus, seq, limit, **kwargs)
    got = answer.strip().lower()
    if got != right:
        return not_yet(f"the best layout at seq {2 * seq} does not grow {got}",
                       "activations grow with s (and the a s^2 terms with s^2): which dimension divides the "
                       "sequence without multiplying the weight traffic? Run plan() at both lengths")
    return f"Correct: at twice the sequence the best layout grows {right}."


def _largest_label(row: dict) -> str:
    """The label that holds the most bytes of ``row`` (a planner row)."""
    return max(plan.LABELS, key=lambda label: row[label])


@hint_on_request
def check_out_of_memory_reason(answer: Any, row: dict, limit: float) -> str:
    """``answer``: the memory label (``"parameters"``, ``"gradients"``, ``"optimizer_state"``,
    ``"activations"``) that makes ``row`` overflow ``limit``: the largest one."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    if not isinstance(answer, str) or answer.strip() not in plan.LABELS:
        return not_yet(f"answer one of {list(plan.LABELS)}; got {answer!r}")
    got = answer.strip()
    right = _largest_label(row)
    if got != right:
        return not_yet(f"{got} holds {row[got] / 2**30:.1f} GiB of the {row['total'] / 2**30:.1f} GiB; "
                       "another label holds more", "read the stacked bar of that layout: the tallest part")
    return (f"Correct: {right} ({row[right] / 2**30:.1f} GiB) is what overflows "
            f"{limit / 2**30:.0f} GiB in layout {plan.key(row)}.")
