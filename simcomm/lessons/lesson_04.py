"""Lesson 04 (A tensor-parallel MLP): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_04 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..parallel.tensor import make_mlp, mlp, shard_mlp
from ..sim.world import World
from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .verdicts import NOT_ANSWERED, is_correct
from .verdicts import attempt as _attempt
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import judged_as_processes as _judged_as_processes
from .verdicts import not_yet as _not_yet

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_tp_mlp']


def _tp_mlp_grads(comm, layer: Callable, x: torch.Tensor, params: dict):
    shards = shard_mlp(params, comm.rank, comm.world_size)
    x = x.clone().requires_grad_()
    out = layer(comm, x, shards)
    out.pow(2).sum().backward()   # the same (replicated) loss on every rank
    return out.detach(), x.grad, {name: p.grad for name, p in shards.items()}


@_hint_on_request
@_judged_as_processes
def check_tp_mlp(layer: Callable, *, world_size: int = 4, batch: int = 3, hidden: int = 4, ffn: int = 8
                 ) -> str:
    """Lesson 04: ``layer(comm, x, shards)`` must be the tensor-parallel MLP for a replicated loss.

    Compares the output, the input gradient and every shard's gradient with
    the single-device MLP (:func:`simcomm.parallel.tensor.mlp`) in float64.
    """
    params = make_mlp(hidden, ffn, seed=7)
    x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    results, verdict = _attempt(lambda: World(world_size).run(_tp_mlp_grads, layer, x, params))
    if verdict:
        return verdict
    ref_params = {name: p.clone().requires_grad_() for name, p in params.items()}
    ref_x = x.clone().requires_grad_()
    ref_out = mlp(ref_x, ref_params)
    ref_out.pow(2).sum().backward()
    for rank, (out, x_grad, grads) in enumerate(results):
        expected = shard_mlp({name: p.grad for name, p in ref_params.items()}, rank, world_size)
        for what, got, want in [("output", out, ref_out),
                                *[(f"gradient of {name}", grads[name], expected[name]) for name in expected],
                                ("input gradient", x_grad, ref_x.grad)]:
            if not isinstance(got, torch.Tensor):
                return _not_yet(f"rank {rank}: no {what}", "is every parameter used, and the output a tensor?")
            if got.shape != want.shape:
                return _not_yet(f"rank {rank}: the {what} has shape {tuple(got.shape)}, not {tuple(want.shape)}")
            error = max_error(got, want)
            if error > 1e-10:
                ratio = (got.norm() / want.norm()).item() if want.norm() > 0 else float("nan")
                return _not_yet(f"rank {rank}: the {what} differs from the single-device MLP by {error:.3g} "
                                f"(yours / reference = {ratio:.3g})",
                                "a factor of world_size points at an all-reduce in the backward that should "
                                "not be there (or a bias added on every rank before the sum); a missing "
                                "input gradient at a missing all-reduce in the backward")
    return "Correct: output and every gradient equal the single-device MLP on every rank."
