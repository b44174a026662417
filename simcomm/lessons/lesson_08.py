"""Lesson 08 (Pipeline parallelism): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_08 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any

from ..parallel import pipeline
from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .verdicts import NOT_ANSWERED, as_number, is_correct, is_placeholder
from .verdicts import attempt as _attempt
from .verdicts import helper_verdict as _helper_verdict
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import not_a_function as _callable
from .verdicts import not_yet as _not_yet
from .verdicts import uses_helper as _uses_helper

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_bubble', 'check_1f1b', 'check_zero_bubble', 'schedule_makespan', 'BUBBLE_EXERCISE']


#: lesson 08's prediction
BUBBLE_EXERCISE = {"stages": 8, "microbatches": 32}


@_hint_on_request
def check_bubble(answer: Any) -> str:
    """Lesson 08 (predict): the bubble fraction of GPipe/1F1B for :data:`BUBBLE_EXERCISE`: a number of
    any numeric type (``Fraction``, float, numpy, a one-element tensor; text is not a number), within
    0.001."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    if isinstance(answer, bool):
        return _not_yet("a fraction is a number, not True/False")
    value = as_number(answer)
    if value is None:
        return _not_yet(f"{answer!r} is not a number: give a fraction like Fraction(3, 11), 3/11 or a float")
    p, m = BUBBLE_EXERCISE["stages"], BUBBLE_EXERCISE["microbatches"]
    want = Fraction(p - 1, m + p - 1)
    if abs(value - float(want)) < 1e-3:
        return f"Correct: (p-1)/(m+p-1) = {want} = {float(want):.3f} of the stages' time is idle."
    if abs(value - (p - 1) / m) < 1e-3:
        return _not_yet("that is (p-1)/m: the bubble's share of the useful work, not of the total time")
    if abs(value - (p - 1) / p) < 1e-3:
        return _not_yet("that is the naive schedule's bubble", "microbatches keep the stages busy together")
    if abs(value / 100 - float(want)) < 1e-3:
        return _not_yet("give a fraction between 0 and 1, not a percentage")
    return _not_yet(f"{value:g} is not it", "count idle slots: the first stage waits p-1 slots before "
                    "the last backward can reach it, out of m+p-1 slots")


def schedule_makespan(plans, forward: float = 1.0, backward: float = 2.0) -> float:
    """Finishing time of every stage's plan with blocking dependencies and no communication time
    (:func:`simcomm.parallel.pipeline.makespan`; the plans must pass its ``check_schedule``)."""
    return pipeline.makespan(plans, forward, backward)


def _malformed_action(plans: list[list], microbatches: int, kinds: tuple[str, ...] = ("F", "B")) -> str | None:
    """What is wrong with the first action that is not ``(kind, i)``, a kind of ``kinds`` and
    ``0 <= i < m``."""
    for stage, plan in enumerate(plans):
        for action in plan:
            ok = (isinstance(action, (tuple, list)) and len(action) == 2 and action[0] in kinds
                  and as_number(action[1]) is not None and float(as_number(action[1])).is_integer()
                  and 0 <= as_number(action[1]) < microbatches)
            if not ok:
                pairs = " or ".join(f"('{kind}', i)" for kind in kinds)
                return (f"stage {stage}'s action {action!r} is not {pairs} with a micro-batch "
                        f"i from 0 to {microbatches - 1}")
    return None


def _as_plans(plans: list[list]) -> list[list[tuple[str, int]]]:
    """Well-formed plans with every micro-batch number as a plain int (numpy or 0-d torch numbers too)."""
    return [[(action[0], int(as_number(action[1]))) for action in plan] for plan in plans]


@_hint_on_request
def check_1f1b(fn: Any) -> str:
    """Lesson 08 (write it): ``fn(stage, stages, microbatches)`` returns stage ``stage``'s list of actions
    ``("F", i)`` / ``("B", i)``; it must run without deadlock, hold at most ``min(stages - stage,
    microbatches)`` microbatches, and finish as early as GPipe, for several ``(stages, microbatches)``."""
    verdict = _callable(fn, "the schedule")
    if verdict:
        return verdict
    helper = _uses_helper(fn, pipeline.schedule)
    if helper is not None:
        return _helper_verdict(helper, "the schedule")
    for stages, microbatches in ((4, 8), (4, 4), (3, 7), (4, 2), (1, 3)):
        plans, verdict = _attempt(lambda: [list(fn(s, stages, microbatches)) for s in range(stages)])
        if verdict:
            return verdict
        where = f"for {stages} stages and {microbatches} microbatches"
        malformed = _malformed_action(plans, microbatches)
        if malformed:
            return _not_yet(f"{where}: {malformed}", "an action is a pair: ('F', 3) is the forward of micro-batch 3, "
                            "('B', 3) its backward; a stage's plan is a list of them")
        plans = _as_plans(plans)
        problem = pipeline.check_schedule(plans, microbatches)
        if problem:
            return _not_yet(f"{where}: {problem}", "warm up with stages - stage - 1 forwards, then alternate "
                            "one forward and one backward, then drain the backwards")
        for stage, plan in enumerate(plans):
            limit = min(stages - stage, microbatches)
            if pipeline.held(plan) > limit:
                return _not_yet(f"{where}: stage {stage} holds {pipeline.held(plan)} microbatches at once; "
                                f"1F1B holds at most {limit}", "start backwards as soon as the first one can run")
        best = (microbatches + stages - 1) * 3.0
        got = schedule_makespan(plans)
        if got > best + 1e-9:
            return _not_yet(f"{where}: the schedule takes {got:g} time units, GPipe takes {best:g}",
                            "a stage should never idle while it has a forward it could run")
    return "Correct: no deadlock, at most p - s microbatches held, and as fast as GPipe."


@_hint_on_request
def check_zero_bubble(fn: Any) -> str:
    """Lesson 08 (write it): ``fn(stage, stages, microbatches)`` returns stage ``stage``'s ZB-H1 actions
    ``("F", i)``, ``("B", i)`` (input gradient only) and ``("W", i)`` (weight gradient). For several
    ``(stages, microbatches)`` with ``microbatches >= stages`` it must run without deadlock, split every
    backward, hold at most ``stages`` micro-batches (1F1B's peak, on stage 0) on every stage, and finish in
    ``3m + p - 1`` time units with F = B = W = 1: the bubble ``(p-1)/(3m+p-1)`` of Qi et al. 2023."""
    verdict = _callable(fn, "the schedule")
    if verdict:
        return verdict
    helper = _uses_helper(fn, pipeline.schedule)
    if helper is not None:
        return _helper_verdict(helper, "the schedule")
    for stages, microbatches in ((4, 8), (4, 4), (3, 7), (2, 5), (1, 3)):
        plans, verdict = _attempt(lambda: [list(fn(s, stages, microbatches)) for s in range(stages)])
        if verdict:
            return verdict
        where = f"for {stages} stages and {microbatches} microbatches"
        malformed = _malformed_action(plans, microbatches, ("F", "B", "W"))
        if malformed:
            return _not_yet(f"{where}: {malformed}", "an action is a pair: ('F', 3) is micro-batch 3's forward, "
                            "('B', 3) the gradient of its input, ('W', 3) the gradient of the weights; a stage's "
                            "plan is a list of them")
        plans = _as_plans(plans)
        unsplit = [stage for stage, plan in enumerate(plans) if not any(kind == "W" for kind, _ in plan)]
        if unsplit:
            return _not_yet(f"{where}: stage {unsplit[0]} never runs a W: its backward is not split",
                            "every micro-batch needs F i, B i and W i on every stage")
        problem = pipeline.check_schedule(plans, microbatches)
        if problem:
            return _not_yet(f"{where}: {problem}", "keep 1F1B's order of the Fs and Bs (warm up with stages - "
                            "stage - 1 forwards, then one F one B, then drain); W i may run any time after B i")
        limit = min(stages, microbatches)
        for stage, plan in enumerate(plans):
            if pipeline.held(plan) > limit:
                return _not_yet(f"{where}: stage {stage} holds {pipeline.held(plan)} micro-batches at once "
                                f"(from F i to W i); 1F1B's peak is {limit}", "a micro-batch is held until its W: "
                                "do not put off more Ws than a stage can hold")
        best = 3.0 * microbatches + stages - 1
        got = schedule_makespan(plans)
        if got > best + 1e-9:
            return _not_yet(f"{where}: the schedule takes {got:g} time units (F = B = W = 1); ZB-H1 takes "
                            f"{best:g}", "a stage's W has no message to wait for: put them where the stage would "
                            "idle. Stage s idles at the end, while the last Bs travel to stage 0: hold each W "
                            "back by s backwards")
    return ("Correct: no deadlock, at most p micro-batches held on any stage (1F1B's peak), and the step takes "
            "3m + p - 1 slots: a bubble of (p-1)/(3m+p-1).")
