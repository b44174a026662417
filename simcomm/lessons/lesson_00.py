"""Lesson 00 (Start here: virtual ranks, errors that name the rank): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_00 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..errors import DeadlockError
from ..sim.world import World
from .asserts import _format, assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .verdicts import NOT_ANSWERED, is_correct
from .verdicts import Forbidden as _Forbidden
from .verdicts import as_numbers as _as_numbers
from .verdicts import attempt as _attempt
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import is_placeholder as _is_placeholder
from .verdicts import judged_as_processes as _judged_as_processes
from .verdicts import not_yet as _not_yet
from .verdicts import spelled_as as _spelled_as

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_count_ranks', 'check_deadlocks']


class _CommWithoutSize:
    """A communicator that refuses to tell its size: the exercise asks to find it with a collective."""

    _FORBIDDEN = ("world_size", "ranks", "group_size", "size")

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name: str):
        if name in self._FORBIDDEN:
            raise _Forbidden(f"your program read comm.{name}; the exercise asks you to count the ranks "
                             "with one comm.all_reduce instead")
        return getattr(self._comm, name)


def _count_ranks_program(comm, count_ranks: Callable):
    return count_ranks(_CommWithoutSize(comm))


@_hint_on_request
@_judged_as_processes
def check_count_ranks(count_ranks: Callable, *, world_sizes: Sequence[int] = (1, 2, 3, 5)) -> str:
    """Lesson 00: ``count_ranks(comm)`` must return the world size, found with an all-reduce.

    The program gets a communicator whose ``world_size`` (and ``ranks``) it
    may not read.
    """
    for world_size in world_sizes:
        world = World(world_size)
        outs, verdict = _attempt(lambda: world.run(_count_ranks_program, count_ranks))
        if verdict:
            return verdict
        for rank, out in enumerate(outs):
            value, problem = _as_numbers(out, f"rank {rank}'s result")
            if problem or value.numel() != 1:
                return _not_yet(f"on {world_size} ranks, rank {rank} returned {_format(out)}; return one "
                                "number (a Python number or a one-element tensor)")
            if value.item() != world_size:
                return _not_yet(f"on {world_size} ranks, rank {rank} returned {_format(value.item())}",
                                "if every rank contributes 1 to an all-reduce, what is the sum?")
        if world_size > 1 and not any(event.op == "all_reduce" for event in world.trace):
            return _not_yet("your program called no all_reduce", "count with one comm.all_reduce")
    return f"Correct: right on {', '.join(map(str, world_sizes))} ranks."


def _outcome(program: Callable, world_size: int) -> str:
    try:
        World(world_size).run(program)
    except DeadlockError:
        return "deadlock"
    except Exception:  # noqa: BLE001 - any other failure is "not a deadlock"
        return "error"
    return "finishes"


@_hint_on_request
def check_deadlocks(my_answer: Any, programs: dict[str, Callable], *, world_size: int = 4) -> str:
    """Lesson 00: ``my_answer`` names the programs (keys of ``programs``) that deadlock.

    Each program is run on ``world_size`` virtual ranks to find out; the answer
    is a set (or list, tuple, array) of names, empty if none deadlocks, or one name alone, or a dict
    from names to ``True`` (deadlocks) and ``False``. A name is read whatever its capitals and the
    spaces around it.
    """
    if _is_placeholder(my_answer):
        return NOT_ANSWERED
    if isinstance(my_answer, str):
        my_answer = {my_answer}
    if isinstance(my_answer, dict) and all(type(value).__name__ in ("bool", "bool_") for value in my_answer.values()):
        my_answer = [name for name, deadlocks in my_answer.items() if deadlocks]
    if hasattr(my_answer, "tolist") and not isinstance(my_answer, (list, tuple)):
        my_answer = my_answer.tolist()
        my_answer = [my_answer] if isinstance(my_answer, str) else my_answer
    if not isinstance(my_answer, (set, frozenset, list, tuple)):
        return _not_yet(f"write a set of program names, like {{'{next(iter(programs))}'}}, not {my_answer!r}")
    unknown = sorted(str(name) for name in my_answer if _spelled_as(name, programs) is None)
    if unknown:
        return _not_yet(f"{unknown} is not one of the programs {sorted(programs)}")
    my_answer = {_spelled_as(name, programs) for name in my_answer}
    deadlocking = {name for name, program in programs.items() if _outcome(program, world_size) == "deadlock"}
    if set(my_answer) != deadlocking:
        wrong = len(set(my_answer) ^ deadlocking)
        return _not_yet(f"{wrong} of the {len(programs)} programs are classified wrongly",
                        "follow ranks 0 and 1 call by call: a send waits until its receiver calls recv, "
                        "and a collective waits until every rank of the group calls it")
    return f"Correct: {', '.join(sorted(deadlocking)) or 'none'} deadlock(s) on {world_size} ranks."
