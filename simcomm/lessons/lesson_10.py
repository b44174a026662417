"""Lesson 10 (Expert parallelism): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_10 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..parallel.expert import keep_mask, rows_per_rank, switch_aux_loss
from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .verdicts import NOT_ANSWERED, as_number, attempt, is_correct, is_placeholder
from .verdicts import as_int as _as_int
from .verdicts import as_ints as _as_ints
from .verdicts import called as _call
from .verdicts import helper_verdict as _helper_verdict
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import not_yet as _not_yet
from .verdicts import uses_helper as _uses_helper

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_split_sizes', 'check_dropped', 'check_aux_loss']


def _routings() -> list[tuple[torch.Tensor, int, int]]:
    gen = torch.Generator().manual_seed(7)
    cases = [(torch.randint(0, 8, (10, 2), generator=gen), 8, 4),
             (torch.randint(0, 6, (7, 1), generator=gen), 6, 3),
             (torch.tensor([[0, 1], [1, 0], [0, 1]]), 4, 2),      # nothing for rank 1's experts
             (torch.tensor([[5, 2], [5, 4]]), 6, 6)]
    return cases


@_hint_on_request
def check_split_sizes(split_sizes: Callable) -> str:
    """``split_sizes(experts (T, k), num_experts, world_size) -> list``: rows this rank sends to each rank
    (``input_split_sizes``), experts sharded in contiguous blocks of ``E/P``."""
    if is_placeholder(split_sizes):
        return NOT_ANSWERED
    helper = _uses_helper(split_sizes, rows_per_rank)
    if helper is not None:
        return _helper_verdict(helper, "the rows for each rank")
    for experts, num_experts, world_size in _routings():
        result, verdict = _call(split_sizes, experts.clone(), num_experts, world_size)
        if verdict:
            return verdict
        expected = torch.bincount(experts.flatten() // (num_experts // world_size), minlength=world_size).tolist()
        got = _as_ints(result)
        where = f"for experts {experts.tolist()} ({num_experts} experts on {world_size} ranks)"
        if got is None:
            return _not_yet(f"return a list of {world_size} whole numbers {where}; got {result!r}")
        if len(got) == num_experts and num_experts != world_size:
            return _not_yet(f"{got} has one entry per expert {where}; all_to_all_single needs one per rank",
                            "add up the counts of the experts each rank holds")
        if len(got) != world_size:
            return _not_yet(f"{len(got)} entries {where}; input_split_sizes has one per rank ({world_size})")
        if sum(got) != experts.numel():
            return _not_yet(f"your sizes add up to {sum(got)} {where}, but {experts.numel()} rows are sent "
                            f"(one per token per chosen expert)")
        if got != expected:
            return _not_yet(f"{got} {where} is not it", "rank r holds experts r*E/P to (r+1)*E/P - 1")
    return "Correct: split sizes for 4 routings, including a rank that receives nothing."


@_hint_on_request
def check_dropped(dropped: Callable) -> str:
    """``dropped(experts (T, k), num_experts, capacity) -> int``: assignments beyond each expert's capacity
    (the first ``capacity`` in token order are kept)."""
    if is_placeholder(dropped):
        return NOT_ANSWERED
    helper = _uses_helper(dropped, keep_mask)
    if helper is not None:
        return _helper_verdict(helper, "which copies each expert keeps")
    for experts, num_experts, _ in _routings():
        for limit in (0, 1, 2, 5):
            result, verdict = _call(dropped, experts.clone(), num_experts, limit)
            if verdict:
                return verdict
            count = _as_int(result)
            if count is None:
                return _not_yet(f"return the number of dropped assignments, a whole number; got {result!r}")
            expected = int((~keep_mask(experts, num_experts, limit)).sum())
            if count != expected:
                per_expert = torch.bincount(experts.flatten(), minlength=num_experts).tolist()
                return _not_yet(f"{count} dropped for tokens per expert {per_expert} and capacity {limit} is "
                                "not it", "each expert drops max(0, count - capacity), summed over experts")
    return "Correct: dropped assignments for 4 routings and capacities 0, 1, 2, 5."


def _aux_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Router probabilities ``(T, E)`` (float64) and their top-k choices: top-2 and top-1, balanced and
    skewed, with an expert nobody chooses."""
    gen = torch.Generator().manual_seed(11)
    cases = []
    for tokens, num_experts, top_k, skew in ((12, 8, 2, 0.0), (9, 4, 1, 0.0), (10, 6, 2, 3.0)):
        logits = torch.randn(tokens, num_experts, generator=gen, dtype=torch.float64)
        logits[:, 0] += skew
        probs = torch.softmax(logits, dim=-1)
        cases.append((probs, probs.topk(top_k, dim=-1).indices))
    return cases


@_hint_on_request
def check_aux_loss(aux_loss: Callable) -> str:
    """``aux_loss(probs (T, E), experts (T, k)) -> 0-d tensor``: Switch Transformer's load-balancing loss
    ``E * sum_e f_e * P_e`` (``f_e``: share of the ``T * k`` assignments that go to ``e``; ``P_e``: mean
    router probability of ``e``). Its value and its gradient with respect to ``probs`` must equal the
    formula's (float64) for three routings."""
    if is_placeholder(aux_loss):
        return NOT_ANSWERED
    if not callable(aux_loss):
        return _not_yet(f"aux_loss must be a function, got {type(aux_loss).__name__}")
    helper = switch_aux_loss if aux_loss is switch_aux_loss else _uses_helper(aux_loss, switch_aux_loss)
    if helper is not None:
        return _helper_verdict(helper, "the load-balancing loss")
    for probs, experts in _aux_cases():
        tokens, num_experts = probs.shape
        where = f"for {tokens} tokens, {num_experts} experts, top-{experts.shape[1]}"
        leaf = probs.clone().requires_grad_()
        result, verdict = _call(aux_loss, leaf, experts.clone())
        if verdict:
            return verdict
        if not isinstance(result, torch.Tensor):
            value = as_number(result)
            if value is None:
                return _not_yet(f"{where}: return a 0-d tensor; got {result!r}")
            return _not_yet(f"{where}: you returned a plain number ({value:g}); the router learns from this "
                            "loss, so it must stay a tensor autograd can differentiate",
                            "no .item(), float() or .tolist() on the way")
        if result.numel() != 1:
            return _not_yet(f"{where}: the loss has shape {tuple(result.shape)}; it must be one number",
                            "sum over the experts")
        want = switch_aux_loss(probs, experts)
        value = float(result.detach())
        if abs(value - float(want)) > 1e-9 * max(1.0, abs(float(want))):
            ratio = value / float(want) if float(want) else math.nan
            if abs(ratio * num_experts - 1) < 1e-6:
                return _not_yet(f"{where}: {value:.4f} is the formula divided by E = {num_experts}",
                                "multiply by the number of experts: then a uniform router scores 1")
            if abs(ratio - experts.shape[1]) < 1e-6:
                return _not_yet(f"{where}: {value:.4f} is k = {experts.shape[1]} times the formula",
                                "f_e is a share of the T * k assignments, not of the T tokens")
            return _not_yet(f"{where}: {value:.4f} is not E * sum_e f_e * P_e = {float(want):.4f}",
                            "f_e: bincount of the chosen experts over T * k; P_e: probs.mean(0)")
        if not result.requires_grad:
            return _not_yet(f"{where}: the value is right but no gradient reaches probs",
                            "P_e must be computed from probs, not from a detached copy or the counts")
        grads, verdict = attempt(lambda: torch.autograd.grad(result.sum(), [leaf], allow_unused=True))
        if verdict:
            return verdict
        grad, want_grad = grads[0], _aux_gradient(probs, experts)
        if grad is None or not torch.allclose(grad, want_grad, atol=1e-12, rtol=0):
            return _not_yet(f"{where}: the value is right, but its gradient with respect to probs is not the "
                            "formula's", "f_e is a count (no gradient); the gradient flows through P_e only")
    return "Correct: the load-balancing loss and its gradient for 3 routings (top-2, top-1, a skewed router)."


def _aux_gradient(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    leaf = probs.clone().requires_grad_()
    (grad,) = torch.autograd.grad(switch_aux_loss(leaf, experts), [leaf])
    return grad
