"""Exercise checkers of lesson 13 (activation memory, mixed precision, the fp16 skip).

Every checker takes what the learner wrote and *returns* one verdict
(:mod:`simcomm.lessons.verdicts`): :data:`NOT_ANSWERED` for the untouched
placeholder, ``Not yet: ...`` for a wrong, partial or malformed answer (or the
lesson's own helper given as the answer), ``Correct: ...`` for a right one; the
hint comes with ``show_hint=True``. The sizes of each exercise are fixed here,
not taken from the learner's cell. A learner's distributed function runs on
virtual ranks each with its own Python state (:class:`~simcomm.lessons.verdicts.RanksApart`),
as on real processes. The right answers come from the library
(``activations.expected_bytes``, ``mixed_precision.expected_bytes``); the
solutions live in the lesson, as collapsed Markdown cells Run All does not execute.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..parallel import mixed_precision
from ..planning import activations
from ..sim.world import World
from .verdicts import (NOT_ANSWERED, as_number, attempt, helper_in_caller, helper_verdict, hint_on_request,
                       is_correct, is_placeholder, judged_apart, not_yet, uses_helper)

__all__ = ["NOT_ANSWERED", "is_correct", "EXERCISE_1", "PRECISION", "check_activation_prediction",
           "check_model_state_bytes", "check_skip_step"]

#: exercise 1's layer: (s, b, h, a, t)
EXERCISE_1 = (256, 1, 128, 8, 4)
#: how close a number of bytes must be (relative): a float computation of an integer count
PRECISION = 1e-9


def _close(got: float, right: float) -> bool:
    return abs(got - right) <= PRECISION * max(abs(right), 1.0)


@hint_on_request
def check_activation_prediction(answer: Any, seq: int = 256, batch: int = 1, hidden: int = 128, heads: int = 8,
                                tp: int = 4) -> str:
    """``answer``: ``{"none": bytes, "selective": bytes, "full": bytes}`` stored per layer and rank by
    the lesson's bf16 layer (on the CPU) at the exercise's size :data:`EXERCISE_1` with tensor +
    sequence parallelism; any numeric type, within a relative :data:`PRECISION`."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    if (seq, batch, hidden, heads, tp) != EXERCISE_1:
        return not_yet(f"the exercise asks about s, b, h, a, t = {EXERCISE_1}; the check was called with "
                       f"{(seq, batch, hidden, heads, tp)}", "keep the checker's call as the lesson wrote it")
    helper = helper_in_caller(activations.expected_bytes, activations.formula_bytes)
    if helper is not None:
        return helper_verdict(helper, "the bytes")
    if not isinstance(answer, dict):
        return not_yet(f"give a dict {{'none': ..., 'selective': ..., 'full': ...}} of bytes; got "
                       f"{type(answer).__name__}")
    missing = [mode for mode in activations.RECOMPUTE if mode not in answer]
    if missing:
        return not_yet(f"the answer has no entry for {missing}", "one number of bytes per recomputation mode")
    seq, batch, hidden, heads, tp = EXERCISE_1
    for mode in activations.RECOMPUTE:
        got = as_number(answer[mode])
        if got is None:
            return not_yet(f"answer[{mode!r}] = {answer[mode]!r} is not a number of bytes")
        right = activations.expected_bytes(seq, batch, hidden, heads, tp, mode)
        if _close(got, right):
            continue
        formula = activations.formula_bytes(seq, batch, hidden, heads, tp, mode)
        cuda_stats = activations.expected_bytes(seq, batch, hidden, heads, tp, mode) + 8 * seq * batch / tp
        if abs(got - right) < 1:
            return not_yet(f"{mode}: {got!r} is {got - right:+.3g} bytes from the count", "a count of bytes is a "
                           f"whole number: round, or compute in integers (within a relative {PRECISION:g})")
        if _close(got, formula):
            return not_yet(f"{mode}: {got:,.0f} is the paper's formula, not what this layer stores",
                           "each LayerNorm also keeps its mean and rstd: 2 x (s b / t) values of 2 bytes")
        if mode != "full" and _close(got, cuda_stats):
            return not_yet(f"{mode}: {got:,.0f} counts the LayerNorm statistics in fp32, as CUDA keeps them",
                           "this lesson's layer runs on the CPU, where a bf16 LayerNorm keeps its mean and rstd "
                           "in bf16: 2 bytes each")
        if any(_close(got, value * tp) for value in (right, formula)):
            return not_yet(f"{mode}: {got:,.0f} is what one device stores",
                           f"with sequence parallelism every stored tensor is split over the t = {tp} ranks")
        return not_yet(f"{mode}: {got:,.0f} bytes is not what the layer stores",
                       "count what backward needs: s b h terms of 2 bytes, masks of 1 byte, the a s^2 b terms "
                       "only without recomputation, only the input with full recomputation")
    return "Correct: the bytes per layer and rank for all three recomputation modes."


@hint_on_request
def check_model_state_bytes(fn: Callable[..., Any]) -> str:
    """``fn(stage, psi, world_size, gradients)`` -> ``{"parameters", "gradients", "optimizer_state"}`` bytes,
    any numeric type, within a relative :data:`PRECISION`; written out, not ``mixed_precision.expected_bytes``."""
    if is_placeholder(fn):
        return NOT_ANSWERED
    if not callable(fn):
        return not_yet(f"give a function; got {type(fn).__name__}")
    helper = uses_helper(fn, mixed_precision.expected_bytes)
    if helper is not None:
        return helper_verdict(helper, "the bytes of each stage")
    labels = ("parameters", "gradients", "optimizer_state")
    for gradients in mixed_precision.GRADIENTS:
        for stage in (0, 1, 2, 3):
            for psi, world_size in ((1000, 4), (6_000, 8), (5_768, 4)):
                got, verdict = attempt(lambda s=stage, p=psi, n=world_size, g=gradients: fn(s, p, n, g))
                if verdict is not None:
                    return verdict
                if not isinstance(got, dict) or set(got) != set(labels):
                    return not_yet(f"fn({stage}, {psi}, {world_size}, {gradients!r}) returned {got!r}",
                                   f"return a dict with exactly the keys {list(labels)}")
                right = mixed_precision.expected_bytes(stage, psi, world_size, gradients)
                for label in labels:
                    value = as_number(got[label])
                    if value is None or not _close(value, right[label]):
                        return not_yet(f"stage {stage}, {gradients} gradients, psi={psi}, N={world_size}: "
                                       f"{label} = {got[label]!r}, expected {right[label]:,.0f}",
                                       "2 bytes per 16-bit parameter, 2 or 4 per gradient, 12 for master + Adam; "
                                       "stage k shards the first k of optimizer state, gradients, parameters")
    return "Correct: model-state bytes for ZeRO stages 0-3, 16-bit and fp32 main_grad gradients."


# -- exercise 3: skip the fp16 step together -----------------------------------------------------------

#: (rank, gradient, position, value) overflows of each case, none for a clean step; ranks of 4
SKIP_CASES: tuple[tuple[tuple[int, int, int, float], ...], ...] = (
    (),
    ((2, 1, 1, float("inf")),),
    ((0, 1, 2, float("nan")),),
    ((1, 0, 0, float("-inf")),),                      # the first gradient: a check of grads[-1] misses it
    ((3, 0, 3, float("nan")),),
    ((0, 0, 1, float("inf")), (3, 1, 0, float("inf"))),
)
#: the ranks exercise 3's checker runs on
SKIP_RANKS = 4


def _skip_grads(rank: int, overflows: tuple) -> list[torch.Tensor]:
    grads = [torch.full((4,), 60000.0, dtype=torch.float16) if rank == 1 else torch.ones(4, dtype=torch.float16),
             torch.ones(3, dtype=torch.float16)]       # 60000: large, still finite in fp16
    for where, gradient, position, value in overflows:
        if where == rank:
            grads[gradient][position] = value
    return grads


def _skip_program(comm, fn, overflows):
    return fn(comm, _skip_grads(comm.rank, overflows))


def _as_flag(out: Any) -> bool | None:
    """A returned decision as a bool: ``bool``, a numpy bool or a one-element bool tensor."""
    if isinstance(out, bool):
        return out
    if type(out).__name__ == "bool_":
        return bool(out)
    if isinstance(out, torch.Tensor) and out.dtype == torch.bool and out.numel() == 1:
        return bool(out.item())
    return None


def _judge_skip(fn: Any) -> str | None:
    for case in SKIP_CASES:
        overflows = case
        with World(SKIP_RANKS) as world:
            outs, verdict = attempt(lambda: world.run(_skip_program, fn, overflows),
                                    "every rank must call the same collectives")
        if verdict is not None:
            return verdict
        flags = [_as_flag(out) for out in outs]
        if any(flag is None for flag in flags):
            return not_yet(f"fn returned {outs!r}; return True (skip) or False on every rank")
        want = bool(overflows)
        where = (" and ".join(f"grads[{g}] of rank {r}" for r, g, _, _ in overflows) if want else "")
        if len(set(flags)) > 1:
            skip = [r for r, flag in enumerate(flags) if flag]
            return not_yet(f"with an overflow in {where} only ranks {skip} skip the step and the others update: "
                           "the replicas' weights diverge",
                           "combine the ranks' flags with a collective (all_reduce, MAX) before deciding")
        if flags[0] != want:
            return not_yet(f"{'an overflow in ' + where if want else 'no overflow (the largest gradient 60000 is finite in fp16)'}: "
                           f"every rank returned {flags[0]}, expected {want}",
                           "look at every element of every gradient: inf, -inf and NaN all overflowed"
                           if want else "only inf, -inf or NaN is an overflow")
    return None


@hint_on_request
def check_skip_step(fn: Callable[..., Any]) -> str:
    """``fn(comm, grads)`` -> bool: skip the step, the same answer on every rank, when any element of any
    of any rank's fp16 gradients overflowed (inf, -inf or NaN). Run on :data:`SKIP_RANKS` ranks, each
    with its own Python state as on real processes, for every case of :data:`SKIP_CASES`."""
    if is_placeholder(fn):
        return NOT_ANSWERED
    if not callable(fn):
        return not_yet(f"give a function fn(comm, grads); got {type(fn).__name__}")
    helper = fn if fn is mixed_precision.any_overflow else uses_helper(fn, mixed_precision.any_overflow)
    if helper is not None:                        # the lesson's train decides with it until you have written yours
        return helper_verdict(helper, "whether every rank skips the step")
    verdict = judged_apart(fn, _judge_skip)
    return verdict or "Correct: every rank skips together when any rank overflowed, and only then."
