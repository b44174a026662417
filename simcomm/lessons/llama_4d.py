"""Exercise checkers of lesson 14 (a small Llama trained in 4-D against one device).

Every checker takes what the learner wrote and *returns* one verdict
(:mod:`simcomm.lessons.verdicts`): :data:`NOT_ANSWERED` for the untouched
placeholder, ``Not yet: ...`` for a wrong, partial or malformed answer,
``Correct: ...`` for a right one; the hint comes with ``show_hint=True``.
Programs a checker runs go to the simulator. The right answers come from the
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
from .verdicts import NOT_ANSWERED, as_number, attempt, hint_on_request, is_correct, is_placeholder, not_yet

__all__ = ["NOT_ANSWERED", "is_correct", "NORM_RANKS", "check_grad_norm", "check_held_bytes"]

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


@hint_on_request
def check_grad_norm(fn: Callable[..., Any]) -> str:
    """``fn(comm, sharded, replicated)`` -> the global gradient norm, the same on every rank: the
    2-norm of all the whole gradients, when ``sharded`` are this rank's row shards (over the
    ``comm`` group of tensor ranks) and ``replicated`` gradients every rank holds whole (already
    summed). Run on :data:`NORM_RANKS` virtual ranks against the norm on one device."""
    if is_placeholder(fn):
        return NOT_ANSWERED
    if not callable(fn):
        return not_yet(f"give a function fn(comm, sharded, replicated); got {type(fn).__name__}")
    for seed in (0, 1):
        outs, verdict = attempt(lambda s=seed: _run_norm(fn, s), "every rank must call the same collectives")
        if verdict is not None:
            return verdict
        values = [as_number(out) for out in outs]
        if any(value is None for value in values):
            return not_yet(f"fn returned {outs!r}; return the norm as one number (a 0-d tensor or a float)")
        sharded, replicated = _norm_case(seed)
        right = float(torch.cat([g.flatten() for g in sharded + replicated]).norm())
        if max(values) - min(values) > 1e-9 * right:
            clips = ", ".join(f"rank {r}: {min(1.0, 1.0 / v):.2f}" for r, v in enumerate(values))
            return not_yet(f"the ranks disagree on the norm ({', '.join(f'{v:.4f}' for v in values)}): with "
                           f"max_norm = 1 they would clip by ({clips}), so the shards are scaled differently "
                           f"and the model is no longer the one-device model",
                           "each rank sees only its rows of the sharded gradients: sum their squares over the "
                           "group (all_reduce) before the square root")
        got = values[0]
        if abs(got - right) <= 1e-9 * right:
            continue
        replicated_sq = float(sum(g.pow(2).sum() for g in replicated))
        counted_again = (right ** 2 + (NORM_RANKS - 1) * replicated_sq) ** 0.5
        if abs(got - counted_again) <= 1e-9 * right:
            return not_yet(f"the norm is {got:.6f}, the whole gradient's is {right:.6f}: the replicated "
                           f"gradients are counted {NORM_RANKS} times",
                           "every rank holds the replicated gradients whole: add their squares once, after "
                           "the all-reduce of the sharded ones")
        if abs(got - right ** 2) <= 1e-9 * right ** 2:
            return not_yet(f"{got:.6f} is the squared norm; the whole gradient's norm is {right:.6f}")
        return not_yet(f"the norm is {got:.6f}, the whole gradient's is {right:.6f}",
                       "the global norm is the square root of the sum of squares of every element of the "
                       "whole model's gradient, each element counted once")
    return "Correct: every rank computes the norm of the whole gradient, so all clip by the same factor."


@hint_on_request
def check_held_bytes(answer: Any, config: llama.Config, layout: Layout, rank: int = 0) -> str:
    """``answer``: ``{"dp": bytes, "fsdp": bytes}``, the float64 bytes of parameters and Adam's two
    moments ``rank`` keeps between steps on ``layout`` (a :class:`simcomm.parallel.mesh.Layout`;
    only its sizes count, not how its data dimension is split) with plain data parallelism
    (``dp_shard = 1``) and with FSDP over the whole data-parallel dim (``dp_shard = dp``)."""
    if is_placeholder(answer):
        return NOT_ANSWERED
    if not isinstance(answer, dict) or set(answer) != {"dp", "fsdp"}:
        return not_yet(f"give a dict {{'dp': bytes, 'fsdp': bytes}}; got {answer!r}")
    plain = Layout(pp=layout.pp, dp_replicate=layout.dp, dp_shard=1, cp=layout.cp, tp=layout.tp)
    sharded = Layout(pp=layout.pp, dp_replicate=1, dp_shard=layout.dp, cp=layout.cp, tp=layout.tp)
    right = {"dp": 24 * lt.held_numel(config, plain, rank), "fsdp": 24 * lt.held_numel(config, sharded, rank)}
    whole_model = 24 * sum(p.numel() for p in llama.init_params(config).values())
    no_tensor = 24 * sum(p.numel() for name, p in llama.init_params(config).items()
                         if name in _stage_names(config, plain, rank))
    for key in ("dp", "fsdp"):
        got = as_number(answer[key])
        if got is None:
            return not_yet(f"answer[{key!r}] = {answer[key]!r} is not a number of bytes")
        if got == right[key]:
            continue
        if got * 3 == right[key]:
            return not_yet(f"{key}: {got:,.0f} bytes counts the parameters only",
                           "Adam keeps two moments (exp_avg, exp_avg_sq) of every parameter element: 3 x 8 bytes")
        if key == "fsdp" and got == right["dp"]:
            return not_yet("fsdp: that is what plain data parallelism keeps",
                           f"FSDP keeps 1/{layout.dp} of each parameter (and of its Adam state) on each rank")
        if got in (whole_model, whole_model // layout.dp):
            return not_yet(f"{key}: {got:,.0f} bytes counts the whole model",
                           f"rank {rank} holds only its pipeline stage's parameters")
        if got in (no_tensor, no_tensor // layout.dp):
            return not_yet(f"{key}: {got:,.0f} bytes counts the stage's parameters whole",
                           f"tensor parallelism splits every matrix over tp = {layout.tp}; the RMSNorm weights "
                           f"stay whole")
        return not_yet(f"{key}: {got:,.0f} bytes is not what rank {rank} keeps",
                       "list the stage's parameters, divide each matrix by tp (not the norms), then by the "
                       "FSDP shards, times 3 x 8 bytes")
    return (f"Correct: rank {rank} keeps {right['dp']:,} bytes with plain data parallelism and "
            f"{right['fsdp']:,} with FSDP.")


def _stage_names(config: llama.Config, layout: Layout, rank: int) -> list[str]:
    return llama_pipeline.stage_names(config, layout.coordinate(rank, "pp"), layout.pp)
