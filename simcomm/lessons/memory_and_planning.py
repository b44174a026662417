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

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..models.llama import Config
from ..parallel.mesh import Layout
from ..parallel import mixed_precision
from ..planning import activations
from ..planning import planner as plan
from ..sim.world import World
from .verdicts import NOT_ANSWERED, as_number, attempt, hint_on_request, is_correct, is_placeholder, not_yet

__all__ = ["NOT_ANSWERED", "is_correct", "check_activation_prediction", "check_model_state_bytes",
           "check_skip_step", "check_plan_choice", "check_sequence_doubling", "check_out_of_memory_reason",
           "check_stage_parameters", "STAGE_CASES"]


# -- lesson 13 ---------------------------------------------------------------------------------

def _activation_bytes(seq: int, batch: int, hidden: int, heads: int, tp: int) -> dict[str, float]:
    """The bytes per layer and rank this lesson's layer stores, by recomputation mode."""
    return {mode: activations.expected_bytes(seq, batch, hidden, heads, tp, mode) for mode in activations.RECOMPUTE}


@hint_on_request
def check_activation_prediction(answer: Any, seq: int, batch: int, hidden: int, heads: int, tp: int) -> str:
    """``answer``: ``{"none": bytes, "selective": bytes, "full": bytes}`` stored per layer and rank by
    the lesson's bf16 layer at this size with tensor + sequence parallelism over ``tp`` ranks."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    if not isinstance(answer, dict):
        return not_yet(f"give a dict {{'none': ..., 'selective': ..., 'full': ...}} of bytes; got "
                       f"{type(answer).__name__}")
    missing = [mode for mode in activations.RECOMPUTE if mode not in answer]
    if missing:
        return not_yet(f"the answer has no entry for {missing}", "one number of bytes per recomputation mode")
    right = _activation_bytes(seq, batch, hidden, heads, tp)
    for mode in activations.RECOMPUTE:
        got = as_number(answer[mode])
        if got is None:
            return not_yet(f"answer[{mode!r}] = {answer[mode]!r} is not a number of bytes")
        if got == right[mode]:
            continue
        formula = activations.formula_bytes(seq, batch, hidden, heads, tp, mode)
        if got == formula:
            return not_yet(f"{mode}: {got:,.0f} is the paper's formula, not what this layer stores",
                           "each LayerNorm also keeps its mean and rstd: 2 x (s b / t) values of 2 bytes")
        if got in (right[mode] * tp, formula * tp):
            return not_yet(f"{mode}: {got:,.0f} is what one device stores",
                           f"with sequence parallelism every stored tensor is split over the t = {tp} ranks")
        return not_yet(f"{mode}: {got:,.0f} bytes is not what the layer stores",
                       "count what backward needs: s b h terms of 2 bytes, masks of 1 byte, the a s^2 b terms "
                       "only without recomputation, only the input with full recomputation")
    return "Correct: the bytes per layer and rank for all three recomputation modes."


@hint_on_request
def check_model_state_bytes(fn: Callable[..., Any]) -> str:
    """``fn(stage, psi, world_size, gradients)`` -> ``{"parameters", "gradients", "optimizer_state"}`` bytes."""
    if is_placeholder(fn):
        return NOT_ANSWERED
    if not callable(fn):
        return not_yet(f"give a function; got {type(fn).__name__}")
    labels = ("parameters", "gradients", "optimizer_state")
    for gradients in mixed_precision.GRADIENTS:
        for stage in (0, 1, 2, 3):
            for psi, world_size in ((1000, 4), (6_000, 8)):
                got, verdict = attempt(lambda s=stage, p=psi, n=world_size, g=gradients: fn(s, p, n, g))
                if verdict is not None:
                    return verdict
                if not isinstance(got, dict) or set(got) != set(labels):
                    return not_yet(f"fn({stage}, {psi}, {world_size}, {gradients!r}) returned {got!r}",
                                   f"return a dict with exactly the keys {list(labels)}")
                right = mixed_precision.expected_bytes(stage, psi, world_size, gradients)
                for label in labels:
                    value = as_number(got[label])
                    if value is None or abs(value - right[label]) > 1e-9 * right[label]:
                        return not_yet(f"stage {stage}, {gradients} gradients, psi={psi}, N={world_size}: "
                                       f"{label} = {got[label]!r}, expected {right[label]:,.0f}",
                                       "2 bytes per 16-bit parameter, 2 or 4 per gradient, 12 for master + Adam; "
                                       "stage k shards the first k of optimizer state, gradients, parameters")
    return "Correct: model-state bytes for ZeRO stages 0-3, 16-bit and fp32 main_grad gradients."


def _skip_program(comm, fn, bad_rank, value):
    grads = [torch.ones(4, dtype=torch.float16), torch.ones(3, dtype=torch.float16)]
    if comm.rank == bad_rank:
        grads[1] = torch.tensor([1.0, value, 1.0], dtype=torch.float16)
    return fn(comm, grads)


def _run_skip(fn, bad_rank, value):
    with World(4) as world:
        return world.run(_skip_program, fn, bad_rank, value)


@hint_on_request
def check_skip_step(fn: Callable[..., Any]) -> str:
    """``fn(comm, grads)`` -> bool: skip the step, the same answer on every rank, when any rank's
    fp16 gradients overflowed (inf or NaN)."""
    if is_placeholder(fn):
        return NOT_ANSWERED
    if not callable(fn):
        return not_yet(f"give a function fn(comm, grads); got {type(fn).__name__}")
    for bad_rank, value in ((None, 1.0), (2, float("inf")), (0, float("nan"))):
        outs, verdict = attempt(lambda bad=bad_rank, v=value: _run_skip(fn, bad, v),
                                "every rank must call the same collectives")
        if verdict is not None:
            return verdict
        if any(not isinstance(out, bool) for out in outs):
            return not_yet(f"fn returned {outs!r}; return True (skip) or False on every rank")
        want = bad_rank is not None
        if len(set(outs)) > 1:
            skip = [r for r, out in enumerate(outs) if out]
            return not_yet(f"with an overflow on rank {bad_rank} only ranks {skip} skip the step and the "
                           "others update: the replicas' weights diverge",
                           "combine the ranks' flags with a collective (all_reduce, MAX) before deciding")
        if outs[0] != want:
            return not_yet(f"{'an overflow on rank ' + str(bad_rank) if want else 'no overflow'}: every rank "
                           f"returned {outs[0]}, expected {want}")
    return "Correct: every rank skips together when any rank overflowed, and only then."


# -- lesson 15 ---------------------------------------------------------------------------------

_DIMS = plan.DIMENSIONS


def _int(value: Any) -> int | None:
    """``value`` as an int if it is one (Python, numpy or one-element integer torch value; not a bool)."""
    if isinstance(value, bool) or (getattr(value, "dtype", None) is not None and str(value.dtype) == "bool"):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _is_row(answer: Any) -> bool:
    return isinstance(answer, dict) and any(name in answer for name in ("step_time", "total", "parameters"))


def _layout(answer: Any) -> tuple[tuple[int, ...] | None, str | None]:
    """``(layout, problem)``: the ``(tp, cp, pp, dp)`` of ``answer`` given as a tuple or list of four ints
    (numpy / torch ints too), a dict of those four sizes (keys in any capitalisation) or a
    :class:`~simcomm.parallel.mesh.Layout`; else ``None`` and what is wrong."""
    if answer is None:
        return None, "got None: the cell must set the layout, not print it (print returns None)"
    if _is_row(answer) or (isinstance(answer, (list, tuple)) and answer and all(_is_row(a) for a in answer)):
        return None, ("that is the planner's row(s), not a layout: give the (tp, cp, pp, dp) you chose "
                      "(planner.key(row) turns a row into one)")
    if isinstance(answer, Layout):
        if answer.world_size != answer.tp * answer.cp * answer.pp * answer.dp:
            return None, f"{answer!r} splits data parallelism further than (tp, cp, pp, dp) says"
        return (answer.tp, answer.cp, answer.pp, answer.dp), None
    if isinstance(answer, dict):
        lowered = {str(k).strip().lower(): v for k, v in answer.items()}
        if set(lowered) != set(_DIMS):
            return None, f"a dict needs exactly the keys {list(_DIMS)}; got {sorted(map(str, answer))}"
        answer = [lowered[name] for name in _DIMS]
    if not isinstance(answer, (tuple, list)) or len(answer) != 4:
        return None, f"give the layout as (tp, cp, pp, dp): four ints; got {answer!r}"
    values = [_int(v) for v in answer]
    if any(v is None for v in values):
        return None, f"give the layout as (tp, cp, pp, dp): four ints; got {answer!r}"
    return tuple(values), None


@hint_on_request
def check_plan_choice(answer: Any, rows: list[dict], limit: float) -> str:
    """``answer``: the ``(tp, cp, pp, dp)`` of ``rows`` (:func:`simcomm.planning.planner.plan`) with the
    shortest modelled step whose memory per GPU fits ``limit`` bytes; a tuple or list of four ints,
    a dict of the four sizes or a ``Layout``."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    got, problem = _layout(answer)
    if got is None:
        return not_yet(problem, "write it like (1, 2, 4, 128): tp, cp, pp, dp, innermost first")
    by_layout = {plan.key(row): row for row in rows}
    if got not in by_layout:
        return not_yet(f"{got} is not a layout of the table", "copy one (tp, cp, pp, dp) from the rows")
    row = by_layout[got]
    if row["total"] > limit:
        return not_yet(f"{got} needs {row['total'] / 2**30:.1f} GiB per GPU, more than {limit / 2**30:.1f} GiB",
                       "filter the rows by memory first")
    if got != plan.fastest_fitting(rows, limit):
        return not_yet(f"{got} fits, but a layout that fits has a shorter modelled step "
                       f"(yours: {row['step_time']:.2f} s)", "among the rows that fit, take the smallest step_time")
    return f"Correct: {got} is the fastest layout that fits {limit / 2**30:.1f} GiB per GPU."


def _grown_dimension(model: Config, gpus: int, seq: int, limit: float, **kwargs: Any) -> str:
    """The dimension (``"tp"``, ``"cp"``, ``"pp"`` or ``"dp"``) the best fitting layout grows when the
    sequence doubles (the planner run at both lengths)."""
    before = plan.fastest_fitting(plan.plan(model, gpus, seq=seq, **kwargs), limit)
    after = plan.fastest_fitting(plan.plan(model, gpus, seq=2 * seq, **kwargs), limit)
    grown = [name for name, a, b in zip(plan.DIMENSIONS, before, after) if b > a]
    return grown[0] if grown else "none"


def _word(answer: Any) -> str | None:
    """A one-word answer in any capitalisation and spacing (``"Optimizer state"`` is ``optimizer_state``)."""
    if isinstance(answer, (list, tuple)) and len(answer) == 1:
        answer = answer[0]
    if not isinstance(answer, str):
        return None
    return "_".join(answer.strip().lower().replace("-", " ").split())


@hint_on_request
def check_sequence_doubling(answer: Any, model: Config, gpus: int, seq: int, limit: float,
                            **kwargs: Any) -> str:
    """``answer``: which of ``"tp"``, ``"cp"``, ``"pp"``, ``"dp"`` the planner's best layout grows when
    ``seq`` doubles (``kwargs`` go to :func:`simcomm.planning.planner.plan`); any capitalisation."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    got = _word(answer)
    if got not in plan.DIMENSIONS:
        return not_yet(f"answer one of {list(plan.DIMENSIONS)}; got {answer!r}")
    right = _grown_dimension(model, gpus, seq, limit, **kwargs)
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
    """``answer``: the memory label (:data:`simcomm.planning.planner.LABELS`) that holds the most bytes of
    ``row``, which overflows ``limit``; any capitalisation, spaces for underscores."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    got = _word(answer)
    if got not in plan.LABELS:
        return not_yet(f"answer one of {list(plan.LABELS)}; got {answer!r}")
    right = _largest_label(row)
    if got != right:
        return not_yet(f"{got} holds {row[got] / 2**30:.1f} GiB of the {row['total'] / 2**30:.1f} GiB; "
                       "another label holds more", "read the stacked bar of that layout: the tallest part")
    return (f"Correct: {right} ({row[right] / 2**30:.1f} GiB) is the largest part of the "
            f"{row['total'] / 2**30:.1f} GiB that overflow {limit / 2**30:.1f} GiB in layout {plan.key(row)}.")


#: the layouts :func:`check_stage_parameters` tries: pipeline and no pipeline, tensor parallel or not
STAGE_CASES = ((1, 1, 1, 1024), (8, 1, 1, 128), (1, 2, 4, 128), (8, 1, 16, 8), (2, 1, 2, 256))


@hint_on_request
def check_stage_parameters(answer: Any, models: Sequence[Config]) -> str:
    """``answer``: a function ``f(model, layout)`` returning the parameters one GPU holds on the
    pipeline stage that holds the most (``layout`` a ``(tp, cp, pp, dp)`` tuple), as
    :func:`simcomm.planning.planner.stage_parameters` counts them; tried on every model of
    ``models`` at :data:`STAGE_CASES`. Any real number type is accepted as the result."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    if answer is plan.stage_parameters:
        return not_yet("that is the planner's own function: write yours (fix the one in the lesson)")
    if not callable(answer):
        return not_yet(f"give a function f(model, layout); got {answer!r}",
                       "define it with def, then pass its name (no parentheses)")
    for model in models:
        for layout in STAGE_CASES:
            want = plan.stage_parameters(model, layout)
            result, verdict = attempt(lambda: answer(model, layout))
            if verdict is not None:
                return verdict
            got = as_number(result)
            if got is None:
                return not_yet(f"f({model.name}, {layout}) returned {result!r}, not a number")
            if abs(got - want) > 0.5 + 1e-9 * want:
                tp, cp, pp, dp = layout
                return not_yet(f"f({model.name}, {layout}) = {got:,.0f}; the fullest stage holds {want:,.0f} "
                               f"parameters per GPU ({got - want:+,.0f})",
                               "with pp == 1 one stage holds the embedding and the output layer (each vocab x "
                               "hidden, not tied) and the final norm; everything is split tp ways"
                               if pp == 1 else "the last stage holds the output layer and the final norm")
    return (f"Correct: your function agrees with the planner on {len(models) * len(STAGE_CASES)} cases, "
            "pipeline or not.")
