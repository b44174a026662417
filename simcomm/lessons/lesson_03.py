"""Lesson 03 (The ring all-reduce and its cost): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_03 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..parallel.ring import ring_exchange, ring_schedule
from ..sim.world import World
from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .verdicts import NOT_ANSWERED, is_correct
from .verdicts import attempt as _attempt
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import judged_as_processes as _judged_as_processes
from .verdicts import not_yet as _not_yet

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_ring_all_gather', 'ring_all_reduce', 'ring_exchange', 'ring_schedule']


def ring_all_reduce(comm, x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the group with the ring algorithm, using only ``send``/``recv``.

    Follows :func:`simcomm.parallel.ring.ring_schedule`; each step is one
    :func:`simcomm.parallel.ring.ring_exchange` with the neighbours. Returns a new
    tensor; ``x`` is not modified. ``x.numel()`` must be divisible by the
    world size. Blocks until the whole ring has run.
    """
    world_size, rank = comm.world_size, comm.rank
    if world_size == 1:
        return x.clone()
    chunks = list(x.detach().flatten().clone().chunk(world_size))  # world_size views of (numel/P,)
    for step, transfers in enumerate(ring_schedule(world_size)):
        _, _, send_chunk = transfers[rank]
        _, _, recv_chunk = transfers[(rank - 1) % world_size]
        incoming = ring_exchange(comm, chunks[send_chunk].clone())
        if step < world_size - 1:
            chunks[recv_chunk] = chunks[recv_chunk] + incoming   # reduce-scatter: accumulate
        else:
            chunks[recv_chunk] = incoming                        # all-gather: take the finished chunk
    return torch.cat(chunks).reshape(x.shape)


def _ring_all_gather_program(comm, mine: Callable, base: float):
    x = base * comm.rank + torch.arange(3.0, dtype=torch.float64)   # (3,), this rank's shard
    before = x.clone()
    out = mine(comm, x)
    return out, torch.equal(x, before)


@_hint_on_request
@_judged_as_processes
def check_ring_all_gather(my_all_gather: Callable, *, world_sizes: Sequence[int] = (2, 3, 4, 5)) -> str:
    """Lesson 03: ``my_all_gather(comm, x)`` must all-gather along dim 0 with the ring.

    Rules: only ``comm.send``/``comm.recv`` (or :func:`ring_exchange`), each
    rank sends only to the next rank, ``world_size - 1`` sends of one shard
    each, the input is not modified; the result is every rank's ``x``
    concatenated in rank order on every rank.
    """
    deadlock_hint = "if every rank sends first, all wait; use lessons.ring_exchange(comm, chunk)"
    for world_size in world_sizes:
        world = World(world_size)
        outs, verdict = _attempt(lambda: world.run(_ring_all_gather_program, my_all_gather, 100.0),
                                 deadlock_hint)
        if verdict:
            return verdict
        expected = torch.cat([100.0 * rank + torch.arange(3.0, dtype=torch.float64)
                              for rank in range(world_size)])
        for rank, (out, untouched) in enumerate(outs):
            if not untouched:
                return _not_yet(f"rank {rank}'s input was modified", "work on copies (x.clone())")
            if not isinstance(out, torch.Tensor) or out.shape != expected.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                return _not_yet(f"on {world_size} ranks, rank {rank} returned {got}; expected shape "
                                f"{tuple(expected.shape)}", "concatenate the world_size shards in rank order")
            if not torch.equal(out.double(), expected):
                return _not_yet(f"on {world_size} ranks, rank {rank}'s result has the right shape but "
                                "wrong values or order", "after step s, rank r has just received the shard "
                                "of rank (r - 1 - s) mod world_size")
        collectives = sorted({event.op for event in world.trace} - {"send", "recv"})
        if collectives:
            return _not_yet(f"your program called {collectives}; the ring uses only send and recv")
        for event in world.trace.filter(op="send").events:
            if set(event.sent) - {(event.rank + 1) % world_size}:
                return _not_yet(f"on {world_size} ranks, rank {event.rank} sent to {sorted(event.sent)}; in "
                                "a ring each rank sends only to the next rank")
        sends = len(world.trace.filter(rank=0, op="send").events)
        if sends != world_size - 1:
            return _not_yet(f"on {world_size} ranks, rank 0 sent {sends} times; the ring needs world_size - 1 "
                            "sends of one shard each")
    return f"Correct: a ring all-gather on {', '.join(map(str, world_sizes))} ranks, neighbours only."
