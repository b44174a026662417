"""Exercise checkers of lesson 14 (a small Llama trained in 4-D against one device).

Every checker takes what the learner wrote and *returns* one verdict
(:mod:`simcomm.lessons.verdicts`): :data:`NOT_ANSWERED` for the untouched
placeholder, ``Not yet: ...`` for a wrong, partial or malformed answer,
``Correct: ...`` for a right one; the hint comes with ``show_hint=True``.
Programs a checker runs go to the simulator, each rank with its own Python state as on
real processes (:class:`~simcomm.lessons.verdicts.RanksApart`); the exercise's layout is fixed here. The right answers come from the
single-device computation (the norm of the whole gradient) and from
:func:`simcomm.models.llama_training.held_numel`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..models import llama, llama_pipeline
from ..models import llama_training as lt
from ..parallel.mesh import Layout
from ..sim.world import World
from .verdicts import (NOT_ANSWERED, as_number, attempt, helper_in_caller, helper_verdict, hint_on_request,
                       is_correct, is_placeholder, judged_apart, not_yet, uses_helper)

__all__ = ["NOT_ANSWERED", "is_correct", "NORM_RANKS", "NORM_PRECISION", "HELD_LAYOUT", "check_grad_norm",
           "check_held_bytes"]

#: the tensor-parallel ranks the gradient-norm exercise runs on
NORM_RANKS = 4


def _norm_case(seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Whole gradients of one device: two sharded matrices and one replicated norm weight."""
    gen = torch.Generator().manual_seed(seed)
    sharded = [torch.randn(8, 3, dtype=torch.float64, generator=gen), torch.randn(4, 6, dtype=torch.float64,
                                                                                   generator=gen) * 3]
    replicated = [torch.randn(5, dtype=torch.float64, generator=gen) * 2]
    return sharded, replicated


def _norm_program(comm, fn, sharded, replicated):
    mine = [g.chunk(comm.world_size, 0)[comm.rank].clone() for g in sharded]     # this rank's rows
    norm = fn(comm, mine, [g.clone() for g in replicated])
    return norm


def _run_norm(fn, seed):
    sharded, replicated = _norm_case(seed)
    with World(NORM_RANKS) as world:
        return world.run(_norm_program, fn, sharded, replicated)


#: how close the norm must be (relative): float32 arithmetic on these gradients is within it
NORM_PRECISION = 1e-6


def _judge_norm(fn: Any) -> str | None:
    for seed in (0, 1, 2):
        outs, verdict = attempt(lambda s=seed: _run_norm(fn, s), "every rank must call the same collectives")
        if verdict is not None:
            return verdict
        values = [as_number(out) for out in outs]
        if any(value is None for value in values):
            return not_yet(f"fn returned {outs!r}; return the norm as one number (a 0-d tensor or a float)")
        sharded, replicated = _norm_case(seed)
        right = float(torch.cat([g.flatten() for g in sharded + replicated]).norm())
        if max(values) - min(values) > NORM_PRECISION * right:
            clips = ", ".join(f"rank {r}: {min(1.0, 1.0 / v):.2f}" for r, v in enumerate(values))
            return not_yet(f"the ranks disagree on the norm ({', '.join(f'{v:.4f}' for v in values)}): with "
                           f"max_norm = 1 they would clip by ({clips}), so the shards are scaled differently "
                           f"and the model is no longer the one-device model",
                           "each rank sees only its rows of the sharded gradients: sum their squares over the "
                           "group (all_reduce) before the square root")
        got = values[0]
        if abs(got - right) <= NORM_PRECISION * right:
            continue
        replicated_sq = float(sum(g.pow(2).sum() for g in replicated))
        counted_again = (right ** 2 + (NORM_RANKS - 1) * replicated_sq) ** 0.5
        if abs(got - counted_again) <= NORM_PRECISION * right:
            return not_yet(f"the norm is {got:.6f}, the whole gradient's is {right:.6f}: the replicated "
                           f"gradients are counted {NORM_RANKS} times",
                           "every rank holds the replicated gradients whole: add their squares once, after "
                           "the all-reduce of the sharded ones")
        if abs(got - right ** 2) <= NORM_PRECISION * right ** 2:
            return not_yet(f"{got:.6f} is the squared norm; the whole gradient's is {right:.6f}")
        if abs(got - right) <= 1e-2 * right:
            return not_yet(f"the norm is {got:.6f}, the whole gradient's is {right:.6f}: a relative error of "
                           f"{abs(got - right) / right:.1e}, more than the {NORM_PRECISION:g} the exercise allows",
                           "that is rounding, not a wrong formula: the gradients are float64; sum their squares "
                           "in float32 or float64, not in bfloat16 or float16")
        return not_yet(f"the norm is {got:.6f}, the whole gradient's is {right:.6f}",
                       "the global norm is the square root of the sum of squares of every element of the "
                       "whole model's gradient, each element counted once")
    return None


@hint_on_request
def check_grad_norm(fn: Callable[..., Any]) -> str:
    """``fn(comm, sharded, replicated)`` -> the global gradient norm, the same on every rank: the
    2-norm of all the whole gradients, when ``sharded`` are this rank's row shards (over the
    ``comm`` group of tensor ranks) and ``replicated`` gradients every rank holds whole (already
    summed). Run on :data:`NORM_RANKS` virtual ranks, each with its own Python state as on real
    processes, against the norm on one device, within a relative :data:`NORM_PRECISION` (float32
    arithmetic is enough)."""
    if is_placeholder(fn):
        return NOT_ANSWERED
    if not callable(fn):
        return not_yet(f"give a function fn(comm, sharded, replicated); got {type(fn).__name__}")
    helper = uses_helper(fn, lt.grad_norm_sq)
    if helper is not None:
        return helper_verdict(helper, "the norm of the whole gradient")
    verdict = judged_apart(fn, _judge_norm)
    return verdict or "Correct: every rank computes the norm of the whole gradient, so all clip by the same factor."


#: exercise 2's layout: the 4-D layout of the lesson's section 4
HELD_LAYOUT = Layout(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2)
#: exercise 2's rank (stage 0, tensor rank 0)
HELD_RANK = 0


def _held(config: llama.Config, layout: Layout, rank: int, norms_split: bool = False,
          no_tensor: bool = False) -> int:
    """Elements ``rank`` keeps (as :func:`lt.held_numel`) and the counts of two mistakes: the norms
    split by tp too, or no matrix split by tp."""
    shapes = {name: p.shape for name, p in llama.init_params(config).items()}
    total = 0
    for name in _stage_names(config, layout, rank):
        replicated = name.split(".")[-1] in llama.REPLICATED
        split = 1 if no_tensor or (replicated and not norms_split) else layout.tp
        total += -(-shapes[name].numel() // split // layout.dp_shard) if layout.dp_shard > 1 else \
            shapes[name].numel() // split
    return total


@hint_on_request
def check_held_bytes(answer: Any, config: llama.Config | None = None, layout: Layout | None = None,
                     rank: int = HELD_RANK) -> str:
    """``answer``: ``{"dp": bytes, "fsdp": bytes}``, the float64 bytes of parameters and Adam's two
    moments rank :data:`HELD_RANK` keeps between steps on :data:`HELD_LAYOUT` with the lesson's
    config, with plain data parallelism (``dp_shard = 1``) and with FSDP over the whole
    data-parallel dim (``dp_shard = dp``). The config and layout are the exercise's; ones passed
    in must have its sizes (how the data dimension is split does not count). Any numeric type; a count of bytes is exact."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    config = llama.Config() if config is None else config
    sizes = tuple(getattr(layout or HELD_LAYOUT, dim) for dim in ("pp", "dp", "cp", "tp"))
    if config != llama.Config() or sizes != tuple(getattr(HELD_LAYOUT, dim) for dim in ("pp", "dp", "cp", "tp")) \
            or rank != HELD_RANK:
        return not_yet(f"the exercise asks about rank {HELD_RANK} of {HELD_LAYOUT} with llama.Config(); the check "
                       f"was called with rank {rank} of {layout} and {config}",
                       "keep the checker's call as the lesson wrote it")
    helper = helper_in_caller(lt.held_numel)
    if helper is not None:
        return helper_verdict(helper, "the elements each rank keeps")
    if not isinstance(answer, dict) or set(answer) != {"dp", "fsdp"}:
        return not_yet(f"give a dict {{'dp': bytes, 'fsdp': bytes}}; got {answer!r}")
    layout = HELD_LAYOUT
    plain = Layout(pp=layout.pp, dp_replicate=layout.dp, dp_shard=1, cp=layout.cp, tp=layout.tp)
    sharded = Layout(pp=layout.pp, dp_replicate=1, dp_shard=layout.dp, cp=layout.cp, tp=layout.tp)
    right = {"dp": 24 * lt.held_numel(config, plain, rank), "fsdp": 24 * lt.held_numel(config, sharded, rank)}
    whole_model = 24 * sum(p.numel() for p in llama.init_params(config).values())
    for key, lay in (("dp", plain), ("fsdp", sharded)):
        got = as_number(answer[key])
        if got is None:
            return not_yet(f"answer[{key!r}] = {answer[key]!r} is not a number of bytes")
        if got == right[key]:
            continue
        if got != int(got) and abs(got - right[key]) < 1:
            return not_yet(f"{key}: {got!r} is not a whole number of bytes", "round, or compute in integers")
        if got * 3 == right[key]:
            return not_yet(f"{key}: {got:,.0f} bytes counts the parameters only",
                           "Adam keeps two moments (exp_avg, exp_avg_sq) of every parameter element: 3 x 8 bytes")
        if got * 24 == right[key]:
            return not_yet(f"{key}: {got:,.0f} is a number of elements, not of bytes",
                           "each element is a float64 parameter plus two float64 moments: 3 x 8 bytes")
        if key == "fsdp" and got == right["dp"]:
            return not_yet("fsdp: that is what plain data parallelism keeps",
                           f"FSDP keeps 1/{layout.dp} of each parameter (and of its Adam state) on each rank")
        if got in (whole_model, whole_model // layout.dp, whole_model // layout.tp,
                   whole_model // layout.tp // layout.dp):
            return not_yet(f"{key}: {got:,.0f} bytes counts the whole model",
                           f"rank {rank} holds only its pipeline stage's parameters")
        if got == 24 * _held(config, lay, rank, norms_split=True):
            return not_yet(f"{key}: {got:,.0f} bytes splits the RMSNorm weights over tp too",
                           f"tensor parallelism splits every matrix over tp = {layout.tp}, but each tensor rank "
                           "keeps the RMSNorm weights whole (they are vectors of h, applied to every element)")
        if got == 24 * _held(config, lay, rank, no_tensor=True):
            return not_yet(f"{key}: {got:,.0f} bytes counts the stage's matrices whole",
                           f"tensor parallelism splits every matrix over tp = {layout.tp}; the RMSNorm weights "
                           "stay whole")
        if got in (right[key] * layout.cp, right[key] // layout.cp):
            return not_yet(f"{key}: {got:,.0f} bytes scales with cp = {layout.cp}",
                           "context parallelism splits the sequence, not the parameters: every context rank "
                           "keeps the same parameters")
        return not_yet(f"{key}: {got:,.0f} bytes is not what rank {rank} keeps",
                       "list the stage's parameters, divide each matrix by tp (not the norms), then by the "
                       "FSDP shards, times 3 x 8 bytes")
    return (f"Correct: rank {rank} keeps {right['dp']:,} bytes with plain data parallelism and "
            f"{right['fsdp']:,} with FSDP.")


def _stage_names(config: llama.Config, layout: Layout, rank: int) -> list[str]:
    return llama_pipeline.stage_names(config, layout.coordinate(rank, "pp"), layout.pp)
