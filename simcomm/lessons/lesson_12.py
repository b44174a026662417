"""Lesson 12 (A transformer in 3-D): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_12 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any


from ..parallel.mesh import Layout
from ..planning.planner import fastest_fitting
from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .verdicts import NOT_ANSWERED, is_correct, is_placeholder
from .verdicts import as_ints as _as_ints
from .verdicts import called as _call
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import not_yet as _not_yet
from .verdicts import uses_helper as _uses_helper

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_mesh_coords', 'check_layout_choice', 'LAYOUT_EXERCISE']


@_hint_on_request
def check_mesh_coords(coords: Callable) -> str:
    """``coords(rank, pp=..., dp=..., tp=...) -> (stage, d, t)``: the coordinates of
    :class:`simcomm.parallel.mesh.Layout` (pipeline outermost, tensor parallelism innermost)."""
    if is_placeholder(coords):
        return NOT_ANSWERED
    if _uses_helper(coords, Layout) is not None:
        return _not_yet("Layout computes the coordinates for you: the exercise asks you to work them out from "
                        "the rank and the sizes", "the tensor index changes fastest, then the data index, "
                        "then the stage")
    for sizes in (dict(pp=2, dp=2, tp=2), dict(pp=1, dp=2, tp=4), dict(pp=2, dp=4, tp=1), dict(pp=4, dp=1, tp=2),
                  dict(pp=1, dp=2, tp=3)):
        layout = Layout(**sizes)
        named = ", ".join(f"{dim}={size}" for dim, size in sizes.items())
        for rank in range(layout.world_size):
            result, verdict = _call(lambda r, sizes=sizes: coords(r, **sizes), rank)
            if verdict:
                return verdict
            got = _as_ints(result)
            if got is None or len(got) != 3:
                return _not_yet(f"coords({rank}, {named}) returned {result!r}; return "
                                "(stage, d, t), three whole numbers")
            expected = list(layout.coordinates(rank))
            if got != expected:
                return _not_yet(f"rank {rank} with {named}: {tuple(got)} is not its (stage, d, t)",
                                "the tp ranks are neighbours (rank % tp), then dp, then the stage")
    return "Correct: mesh coordinates for 5 layouts, every rank."


#: the exercise's table: the 8-rank layouts of section 3, of which this many fit the memory limit
LAYOUT_EXERCISE = {"world_size": 8, "layouts": 7, "fitting": 5,
                   "topologies": ("NVLink node", "InfiniBand cluster"), "topology": "InfiniBand cluster"}


def _not_the_table(rows: Any, memory_limit: Any, topology: Any) -> str | None:
    """What makes ``rows``, ``memory_limit`` and ``topology`` not the exercise's (the checker does not
    trust a table the learner's cell passes in: a shorter or edited one would make any answer right)."""
    want = LAYOUT_EXERCISE
    if topology != want["topology"]:
        return f"the exercise asks about the {want['topology']}; the check was called with {topology!r}"
    if not isinstance(rows, list) or len(rows) != want["layouts"] or not all(isinstance(row, dict) for row in rows):
        return f"rows must be the table of section 3, {want['layouts']} layouts of {want['world_size']} ranks"
    keys = {"pp", "dp", "tp", "peak_bytes", *want["topologies"]}
    if any(not keys <= set(row) for row in rows) or \
            any(row["pp"] * row["dp"] * row["tp"] != want["world_size"] for row in rows) or \
            len({(row["pp"], row["dp"], row["tp"]) for row in rows}) != want["layouts"]:
        return f"rows must be the table of section 3, {want['layouts']} different layouts of {want['world_size']} ranks"
    fitting = sum(row["peak_bytes"] <= memory_limit for row in rows) if isinstance(memory_limit, (int, float)) else -1
    if fitting != want["fitting"]:
        return (f"with memory_limit = {memory_limit!r}, {fitting} layouts fit; the exercise's limit lets "
                f"{want['fitting']} of the {want['layouts']} fit")
    return None


@_hint_on_request
def check_layout_choice(choice: Any, rows: list[dict], memory_limit: int, topology: str) -> str:
    """``choice``: the ``Layout(pp=, dp=, tp=)`` with the shortest ``topology`` step time whose peak memory
    per rank fits ``memory_limit`` bytes, read from ``rows``
    (:func:`simcomm.planning.layout_choice.layout_table`); or that row of ``rows`` itself."""
    if is_placeholder(choice):
        return NOT_ANSWERED
    if isinstance(choice, dict) and isinstance(choice.get("layout"), Layout) and any(choice is row for row in rows):
        choice = choice["layout"]                            # the chosen row of the table itself
    if not isinstance(choice, Layout) or choice.cp != 1:
        return _not_yet(f"give the layout by name, as Layout(pp=..., dp=..., tp=...); got {choice!r}",
                        "a row's own row['layout'] is one")
    name = lambda pp, dp, tp: Layout(pp=pp, dp=dp, tp=tp)   # noqa: E731  one spelling for every message
    problem = _not_the_table(rows, memory_limit, topology)
    if problem:
        return _not_yet(problem, "keep the checker's call as the lesson wrote it: rows, memory_limit and the "
                        "topology of section 3 and exercise 2")
    by_layout = {(row["pp"], row["dp"], row["tp"]): row for row in rows}
    got = (choice.pp, choice.dp, choice.tp)
    if got not in by_layout:
        return _not_yet(f"{name(*got)!r} is not a layout of the table; pick one of "
                        f"{', '.join(repr(name(*key)) for key in sorted(by_layout))}")
    best = fastest_fitting(rows, memory_limit, topology)
    row = by_layout[got]
    if row["peak_bytes"] > memory_limit:
        return _not_yet(f"{name(*got)!r} needs {row['peak_bytes']:,} bytes per rank, more than the limit "
                        f"{memory_limit:,}", "shard more (larger tp or pp)")
    if name(*got) != best:
        return _not_yet(f"{name(*got)!r} fits, but another layout that fits is faster on the {topology} "
                        f"({row[topology] * 1e6:.1f} us for yours)", "compare the step times of the rows that fit")
    return (f"Correct: {name(*got)!r} is the fastest layout on the {topology} within {memory_limit:,} bytes "
            "per rank.")
