"""Lesson 05 (Ulysses sequence parallelism): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_05 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..sim.world import World
from .asserts import _format, assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .verdicts import NOT_ANSWERED, is_correct
from .verdicts import as_numbers as _as_numbers
from .verdicts import attempt as _attempt
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import is_placeholder as _is_placeholder
from .verdicts import not_yet as _not_yet

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_ulysses_gqa_bytes']


def _ulysses_gqa_forward(comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Ulysses attention with grouped-query attention: ``q`` has more heads than ``k`` and ``v``."""
    q, k, v = (comm.all_to_all_4D(t, scatter_dim=2, gather_dim=1) for t in (q, k, v))  # (b, s, h/P, d)
    group = q.shape[2] // k.shape[2]                       # query heads per kv head
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)   # (b, s, hq/P, d)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)  # (b, s, hq/P, d)
    return comm.all_to_all_4D(out, scatter_dim=1, gather_dim=2)                  # (b, s/P, hq, d)


@_hint_on_request
def check_ulysses_gqa_bytes(per_rank_bytes: Callable[..., float]) -> str:
    """Lesson 05: bytes one rank sends in the forward of Ulysses attention with grouped-query attention.

    ``per_rank_bytes(batch, seq, q_heads, kv_heads, head_dim, world_size, itemsize)``,
    checked against the trace of a run (four all-to-alls: q, k, v in, the
    output back) for several shapes and world sizes, float64.
    """
    if _is_placeholder(per_rank_bytes):
        return NOT_ANSWERED
    if not callable(per_rank_bytes):
        return _not_yet(f"give a function per_rank_bytes(batch, seq, q_heads, kv_heads, head_dim, world_size, "
                        f"itemsize); got {type(per_rank_bytes).__name__}")
    cases = [(1, 8, 4, 2, 2, 2), (2, 8, 8, 2, 3, 2), (1, 12, 6, 3, 2, 3), (1, 16, 8, 4, 4, 4)]
    for batch, seq, q_heads, kv_heads, head_dim, world_size in cases:
        answer, verdict = _attempt(lambda: per_rank_bytes(batch, seq, q_heads, kv_heads, head_dim, world_size, 8))
        if verdict:
            return verdict
        if _is_placeholder(answer):
            return NOT_ANSWERED
        value, problem = _as_numbers(answer, "your function's result")
        if problem or value.numel() != 1:
            return problem or _not_yet("return one number of bytes")
        gen = torch.Generator().manual_seed(0)
        shard = seq // world_size
        q = torch.randn(batch, shard, q_heads, head_dim, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(batch, shard, kv_heads, head_dim, generator=gen, dtype=torch.float64) for _ in "kv")
        world = World(world_size)
        world.run(_ulysses_gqa_forward, q, k, v)
        sent = sum(sum(event.sent.values()) for event in world.trace.filter(rank=0, phase="forward"))
        if abs(value.item() - sent) > 1e-6:
            return _not_yet(f"batch={batch}, seq={seq}, q_heads={q_heads}, kv_heads={kv_heads}, "
                            f"head_dim={head_dim} on {world_size} ranks: rank 0 does not send "
                            f"{_format(value.item())} bytes",
                            "k and v have kv_heads heads, q and the output q_heads; each all-to-all keeps "
                            "1/world_size of the rank's shard and sends the rest")
    return f"Correct: bytes per rank for {len(cases)} shapes and world sizes."
