"""Exercise checkers of lessons 06-08 (data parallelism, ZeRO/FSDP, pipeline parallelism).

Each checker *returns* a verdict and never raises for what the learner wrote:
``NOT_ANSWERED`` while the placeholder (``...`` or ``raise NotImplementedError``)
is still there, ``"Not yet: ..."`` with a hint for a wrong, partial or
malformed answer (or code that raised or deadlocked), ``"Correct: ..."`` for a
right one. Programs run on the simulator (``World``), whatever the backend the
lesson uses: an exercise checks understanding, not the transport. Every check
compares with a single-device float64 reference or the exact formula.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import torch

from ..parallel import data as data_parallel
from ..parallel import pipeline
from ..sim.world import World
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import judged_as_processes as _judged_as_processes
from .verdicts import uses_helper as _uses_helper
from .verdicts import helper_verdict as _helper_verdict
from .verdicts import NOT_ANSWERED, as_number, is_correct, is_placeholder, reduce_scatter_traffic
from .verdicts import attempt as _attempt
from .verdicts import not_yet as _not_yet

__all__ = ["NOT_ANSWERED", "is_correct", "check_dp_step", "check_accumulation_step", "check_zero3_bytes",
           "check_zero2_grads", "check_bubble", "check_1f1b", "check_zero_bubble", "schedule_makespan",
           "ACCUMULATION_EXERCISE", "ZERO3_EXERCISE", "BUBBLE_EXERCISE"]


#: lesson 06's exercise 2: micro-batches per step and the reducer's bucket size (on the checkers' model)
ACCUMULATION_EXERCISE = {"microbatches": 4, "bucket_bytes": 600}
#: lesson 07's prediction: the ZeRO paper's 7.5B-parameter model on 64 GPUs, mixed-precision Adam (K = 12)
ZERO3_EXERCISE = {"psi": 7_500_000_000, "world_size": 64, "K": 12}
#: lesson 08's prediction
BUBBLE_EXERCISE = {"stages": 8, "microbatches": 32}

_SMALL = (8, 16, 16, 4)     # the checkers' model: small, so a check takes a fraction of a second
_WORLD = 4


def _callable(fn: Any, name: str) -> str | None:
    if is_placeholder(fn):
        return NOT_ANSWERED
    if not callable(fn):
        return _not_yet(f"{name} must be a function, got {type(fn).__name__}")
    return None


def _grads_after_step(model) -> list:
    """Copies of every parameter's ``.grad`` after a learner's step; a missing one is named."""
    grads = []
    for index, p in enumerate(model.parameters()):
        if p.grad is None:
            raise ValueError(f"parameter {index} has no .grad after your step")
        grads.append(p.grad.detach().clone())
    return grads


# -- lesson 06 ----------------------------------------------------------------------------------

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


# -- lesson 07 ----------------------------------------------------------------------------------

@_hint_on_request
def check_zero3_bytes(answer: Any) -> str:
    """Lesson 07 (predict): bytes per rank of each model state at ZeRO-3 for :data:`ZERO3_EXERCISE`,
    as ``{"parameters": .., "gradients": .., "optimizer_state": ..}`` (fp16 parameters and gradients,
    K bytes of optimizer state per parameter)."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    keys = ("parameters", "gradients", "optimizer_state")
    if not isinstance(answer, dict):
        return _not_yet(f"the answer must be a dict with keys {list(keys)}, got {type(answer).__name__}")
    missing = [k for k in keys if k not in answer]
    if missing:
        return _not_yet(f"missing {missing}", "give all three model states")
    bad = [k for k in keys if as_number(answer[k]) is None]
    if bad:
        return _not_yet(f"{bad} must be numbers of bytes")
    answer = {k: as_number(answer[k]) for k in keys}
    psi, n, k = ZERO3_EXERCISE["psi"], ZERO3_EXERCISE["world_size"], ZERO3_EXERCISE["K"]
    want = {"parameters": 2 * psi / n, "gradients": 2 * psi / n, "optimizer_state": k * psi / n}
    wrong = [key for key in keys if not math.isclose(answer[key], want[key], rel_tol=1e-3)]
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


# -- lesson 08 ----------------------------------------------------------------------------------

@_hint_on_request
def check_bubble(answer: Any) -> str:
    """Lesson 08 (predict): the bubble fraction of GPipe/1F1B for :data:`BUBBLE_EXERCISE`."""
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
