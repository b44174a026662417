"""Lesson 02 (Autograd through collectives): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_02 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..sim.world import World
from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .verdicts import NOT_ANSWERED, is_correct
from .verdicts import attempt as _attempt
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import judged_as_processes as _judged_as_processes
from .verdicts import not_yet as _not_yet
from .verdicts import reduce_scatter_traffic as _reduce_scatter_traffic

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_all_gather_backward']


def _all_gather_grads(comm, mine: Callable, shape: tuple[int, ...], dim: int):
    gen = torch.Generator().manual_seed(100 + comm.rank)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    y = comm.all_gather(x, dim=dim)
    grad_out = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(grad_out)
    with torch.no_grad():
        return x.grad, mine(comm, grad_out, dim)


@_hint_on_request
@_judged_as_processes
def check_all_gather_backward(my_backward: Callable, *, world_size: int = 4,
                              shape: tuple[int, ...] = (2, 3), dims: Sequence[int] = (0, 1)) -> str:
    """Lesson 02: ``my_backward(comm, grad_out, dim)`` must return the gradient of an all-gather's input."""
    world = World(world_size)
    for dim in dims:
        per_rank_results, verdict = _attempt(lambda: world.run(_all_gather_grads, my_backward, shape, dim))
        if verdict:
            return verdict
        for rank, (autograd_grad, yours) in enumerate(per_rank_results):
            if not isinstance(yours, torch.Tensor) or tuple(yours.shape) != tuple(autograd_grad.shape):
                got = tuple(yours.shape) if isinstance(yours, torch.Tensor) else type(yours).__name__
                return _not_yet(f"dim={dim}, rank {rank}: your gradient is {got}; the input has shape "
                                f"{tuple(autograd_grad.shape)}", "the gradient has the shape of the input")
            error = max_error(yours, autograd_grad)
            if error > 1e-10:
                return _not_yet(f"dim={dim}, rank {rank}: your gradient differs from autograd's by {error:.3g}",
                                "every rank's output depends on this rank's input: whose gradients "
                                "must be added up?")
        traffic = _reduce_scatter_traffic(world.trace, world_size, world_size * math.prod(shape) * 8,
                                          skip_first=1)
        if traffic:
            return traffic
    return f"Correct: your backward equals autograd's on every rank, for dim in {tuple(dims)}."
