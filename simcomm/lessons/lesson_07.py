"""Lesson 07 (ZeRO and FSDP): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_07 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..sim.world import World
from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .verdicts import NOT_ANSWERED, as_number, is_correct, is_placeholder, keys_spelled_as, reduce_scatter_traffic
from .verdicts import attempt as _attempt
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import judged_as_processes as _judged_as_processes
from .verdicts import not_a_function as _callable
from .verdicts import not_yet as _not_yet

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_zero3_bytes', 'check_zero2_grads', 'ZERO3_EXERCISE', 'ZERO3_PRECISION']


#: lesson 07's prediction: the ZeRO paper's 7.5B-parameter model on 64 GPUs, mixed-precision Adam (K = 12)
ZERO3_EXERCISE = {"psi": 7_500_000_000, "world_size": 64, "K": 12}
#: how close each of lesson 07's predicted byte counts must be (relative): three significant figures
ZERO3_PRECISION = 5e-3


_WORLD = 4


@_hint_on_request
def check_zero3_bytes(answer: Any) -> str:
    """Lesson 07 (predict): bytes per rank of each model state at ZeRO-3 for :data:`ZERO3_EXERCISE`,
    as ``{"parameters": .., "gradients": .., "optimizer_state": ..}`` (fp16 parameters and gradients,
    K bytes of optimizer state per parameter). Any numeric type, within a relative
    :data:`ZERO3_PRECISION` (three significant figures); a key whatever its capitals, and with a space
    or hyphen for the underscore."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    keys = ("parameters", "gradients", "optimizer_state")
    if not isinstance(answer, dict):
        return _not_yet(f"the answer must be a dict with keys {list(keys)}, got {type(answer).__name__}")
    answer = keys_spelled_as(answer, keys)
    missing = [k for k in keys if k not in answer]
    if missing:
        return _not_yet(f"missing {missing}", "give all three model states")
    bad = [k for k in keys if as_number(answer[k]) is None]
    if bad:
        return _not_yet(f"{bad} must be numbers of bytes")
    answer = {k: as_number(answer[k]) for k in keys}
    psi, n, k = ZERO3_EXERCISE["psi"], ZERO3_EXERCISE["world_size"], ZERO3_EXERCISE["K"]
    want = {"parameters": 2 * psi / n, "gradients": 2 * psi / n, "optimizer_state": k * psi / n}
    wrong = [key for key in keys if not math.isclose(answer[key], want[key], rel_tol=ZERO3_PRECISION)]
    if not wrong:
        total = sum(want.values()) / 1e9
        return f"Correct: (2 + 2 + {k}) psi / {n} = {total:.3g} GB per rank, instead of {16 * psi / 1e9:.0f} GB."
    for key in wrong:
        if math.isclose(answer[key], want[key] * n, rel_tol=1e-3):
            return _not_yet(f"{key}: that is the unsharded size", "ZeRO-3 shards all three states over the ranks")
        if key != "optimizer_state" and math.isclose(answer[key], 2 * want[key], rel_tol=1e-3):
            return _not_yet(f"{key}: that counts 4 bytes per value", "mixed precision keeps them in fp16: 2 bytes")
    return _not_yet(f"{wrong} are off", "bytes per rank = bytes per parameter x psi / world size")


def _zero2_program(comm, fn, grads):
    out = fn(comm, grads[comm.rank].clone())
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"your function returned {type(out).__name__}, not a tensor")
    return out.detach().clone()


@_hint_on_request
@_judged_as_processes
def check_zero2_grads(fn: Any) -> str:
    """Lesson 07 (write it): ``fn(comm, grad)`` gets this rank's full local gradient (a flat vector whose
    length divides by the world size) and returns this rank's shard of the gradient *summed over ranks*:
    chunk ``comm.rank``, moving no more than a reduce-scatter does."""
    verdict = _callable(fn, "the function")
    if verdict:
        return verdict
    generator = torch.Generator().manual_seed(7)
    grads = [torch.randn(4 * _WORLD * 3, generator=generator, dtype=torch.float64) for _ in range(_WORLD)]
    total = sum(grads)
    want = list(total.chunk(_WORLD))
    with World(_WORLD) as world:
        outs, verdict = _attempt(lambda: world.run(_zero2_program, fn, grads))
        if verdict:
            return verdict
        traffic = reduce_scatter_traffic(world.trace, _WORLD, grads[0].numel() * 8)
    if any(o.shape != w.shape for o, w in zip(outs, want)):
        shapes = sorted({tuple(o.shape) for o in outs})
        return _not_yet(f"rank outputs have shapes {shapes}, expected {tuple(want[0].shape)}",
                        "return only this rank's chunk (1/world_size of the vector)")
    if any((o - w).abs().max().item() > 1e-10 for o, w in zip(outs, want)):
        if all((o - g.chunk(_WORLD)[r]).abs().max().item() < 1e-12 for r, (o, g) in enumerate(zip(outs, grads))):
            return _not_yet("each rank returned its own chunk, not summed over ranks", "the ranks must communicate")
        return _not_yet("the shards do not equal the summed gradient's chunks", "rank r keeps chunk r of the sum")
    if traffic:
        return traffic
    return "Correct: reduce-scatter gives each rank its summed shard with half an all-reduce's traffic."
