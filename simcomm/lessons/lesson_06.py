"""Lesson 06 (Data parallelism): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_06 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

from typing import Any

import torch

from ..parallel import data as data_parallel
from ..sim.world import World
from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .verdicts import NOT_ANSWERED, is_correct
from .verdicts import attempt as _attempt
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import judged_as_processes as _judged_as_processes
from .verdicts import not_a_function as _callable
from .verdicts import not_yet as _not_yet

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_dp_step', 'check_accumulation_step', 'ACCUMULATION_EXERCISE']


#: lesson 06's exercise 2: micro-batches per step and the reducer's bucket size (on the checkers' model)
ACCUMULATION_EXERCISE = {"microbatches": 4, "bucket_bytes": 600}


_SMALL = (8, 16, 16, 4)     # the checkers' model: small, so a check takes a fraction of a second


_WORLD = 4


def _grads_after_step(model) -> list:
    """Copies of every parameter's ``.grad`` after a learner's step; a missing one is named."""
    grads = []
    for index, p in enumerate(model.parameters()):
        if p.grad is None:
            raise ValueError(f"parameter {index} has no .grad after your step")
        grads.append(p.grad.detach().clone())
    return grads


def _dp_program(comm, step, x, y):
    model = data_parallel.make_model(_SMALL)
    xs, ys = data_parallel.rows(comm, x, y)
    step(comm, model, xs, ys)
    return _grads_after_step(model)


@_hint_on_request
@_judged_as_processes
def check_dp_step(step: Any) -> str:
    """Lesson 06: ``step(comm, model, xs, ys)`` must leave in every ``p.grad`` the gradient of the mean
    loss over the *whole* batch (``xs, ys``: this rank's rows; ``data_parallel.sum_loss``)."""
    verdict = _callable(step, "the step")
    if verdict:
        return verdict
    x, y = data_parallel.make_data(16, _SMALL, seed=5)
    ref = data_parallel.reference_grads(x, y, _SMALL)
    with World(_WORLD) as world:
        outs, verdict = _attempt(lambda: world.run(_dp_program, step, x, y))
        if verdict:
            return verdict
        reduces = sum(1 for e in world.trace.events if e.rank == 0 and e.op in ("all_reduce", "reduce_scatter"))
    if any(len(g) != len(ref) for g in outs):
        return _not_yet("the model lost or gained parameters")
    right = [all((g[i] - r).abs().max().item() <= 1e-10 for g in outs) for i, r in enumerate(ref)]
    if any(right) and not all(right):
        return _not_yet(f"parameters {[i for i, ok in enumerate(right) if not ok]} have wrong gradients, the "
                        "others are right", "communicate every parameter's gradient, weights and biases alike")
    if any(not torch.equal(a, b) for g in outs[1:] for a, b in zip(g, outs[0])):
        return _not_yet("the ranks end with different gradients: the replicas would drift apart",
                        "every parameter's gradient must be combined over the ranks (an all-reduce each)")
    errors = [(a - r).abs().max().item() for a, r in zip(outs[0], ref)]
    if max(errors) <= 1e-10:
        return f"Correct: every rank holds the whole batch's gradient ({reduces} collectives per rank)."
    return _not_yet(*_dp_gradient_problem(outs[0], ref, reduces))


def _dp_gradient_problem(got: list[torch.Tensor], ref: list[torch.Tensor], collectives: int) -> tuple[str, str]:
    """``(problem, hint)`` for gradients that agree over the ranks but not with the reference."""
    errors = [(a - r).abs().max().item() for a, r in zip(got, ref)]
    relative = max(errors) / max(r.abs().max().item() for r in ref)
    ratios = [(a.flatten() @ r.flatten() / (r.flatten() @ r.flatten())).item() for a, r in zip(got, ref)]
    for factor in (_WORLD, _WORLD ** 2, 1 / _WORLD, 1 / _WORLD ** 2):
        if all(abs(q - factor) < 1e-6 * max(1.0, factor) for q in ratios):
            shown = f"{factor:g}" if factor >= 1 else f"1/{round(1 / factor)}"
            hint = ("a SUM all-reduce of mean losses adds P means: average (ReduceOp.AVG), or divide the loss by "
                    "the world size" if factor > 1 else "you divided more than once: AVG of mean losses is enough")
            return f"every gradient is {shown} x the reference (the world size is {_WORLD})", hint
    if relative < 1e-4:
        return (f"the gradients are right only to {relative:.1e} (relative), not to float64's 1e-10: something "
                "was computed or communicated in a lower precision", "keep the gradients in their own dtype "
                "(float64) from backward through the all-reduce")
    if not collectives:
        return (f"no collective ran, yet the gradients differ from the reference by up to {max(errors):.3g}",
                "each rank's .grad only knows its own rows until the gradients are combined over ranks")
    return (f"the ranks combined their gradients ({collectives} collectives each), but the result is not the "
            f"whole batch's gradient (off by up to {max(errors):.3g})",
            "the whole batch's mean loss is the mean of the ranks' mean losses: which reduction makes a mean?")


def _accumulation_program(comm, step, x, y, microbatches, bucket_bytes):
    model = data_parallel.make_model(_SMALL)
    reducer = data_parallel.BucketedReducer(comm, model, bucket_bytes)
    xs, ys = data_parallel.rows(comm, x, y)
    step(comm, model, reducer, list(zip(xs.chunk(microbatches), ys.chunk(microbatches))), x.shape[0])
    return _grads_after_step(model)


@_hint_on_request
@_judged_as_processes
def check_accumulation_step(step: Any) -> str:
    """Lesson 06 (write it): ``step(comm, model, reducer, micro_batches, batch)`` runs one optimizer
    step's backward over this rank's ``micro_batches`` (a list of ``(x, y)`` pairs) with the
    :class:`~simcomm.parallel.data.BucketedReducer` ``reducer``, each micro-batch's loss being
    ``sum_loss / batch`` (``batch``: the whole batch's rows over all ranks). It must leave the whole
    batch's gradient in every ``p.grad`` and all-reduce each bucket once per step (``reducer.no_sync()``
    for every micro-batch but the last, then ``reducer.finish()``)."""
    verdict = _callable(step, "the step")
    if verdict:
        return verdict
    microbatches, bucket_bytes = ACCUMULATION_EXERCISE["microbatches"], ACCUMULATION_EXERCISE["bucket_bytes"]
    x, y = data_parallel.make_data(8 * _WORLD, _SMALL, seed=6)
    ref = data_parallel.reference_grads(x, y, _SMALL)
    buckets = len(data_parallel.bucket_plan([p.numel() for p in data_parallel.make_model(_SMALL).parameters()],
                                            8, bucket_bytes))
    with World(_WORLD) as world:
        outs, verdict = _attempt(lambda: world.run(_accumulation_program, step, x, y, microbatches, bucket_bytes))
        if verdict:
            if "second synchronising gradient" in verdict:
                return _not_yet("a second backward synchronised before finish(): the reducer refuses to mix two "
                                "backward passes' gradients in one bucket",
                                "run every micro-batch's backward but the last inside `with reducer.no_sync():`")
            return verdict
        calls = [e for e in world.trace.events if e.rank == 0 and e.op != "compute"]
    if any(len(g) != len(ref) for g in outs):
        return _not_yet("the model lost or gained parameters")
    if any(not torch.equal(a, b) for g in outs[1:] for a, b in zip(g, outs[0])):
        return _not_yet("the ranks end with different gradients: the replicas would drift apart",
                        "the last micro-batch's backward, outside no_sync(), starts the all-reduces; "
                        "reducer.finish() writes their results into .grad")
    reduces = [e for e in calls if e.op == "all_reduce"]
    if len(calls) != buckets or len(reduces) != buckets:
        ops = sorted({e.op for e in calls})
        return _not_yet(f"rank 0 issued {len(calls)} collectives ({', '.join(ops)}) where "
                        f"the reducer's {buckets} buckets need {buckets} all-reduces per step",
                        "let the reducer communicate: one synchronising backward per step, no collectives of "
                        "your own")
    errors = [(a - r).abs().max().item() for a, r in zip(outs[0], ref)]
    if max(errors) > 1e-10:
        return _not_yet(*_dp_gradient_problem(outs[0], ref, len(calls)))
    return (f"Correct: the whole batch's gradient on every rank, with {buckets} all-reduces per step "
            f"(one per bucket), whatever the {microbatches} micro-batches.")
