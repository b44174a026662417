"""Lesson 01 (Collectives): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_01 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

import numbers
from typing import Any

import torch

from ..sim.world import World
from .asserts import _format, assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .verdicts import NOT_ANSWERED, is_correct
from .verdicts import as_numbers as _as_numbers
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import is_placeholder as _is_placeholder
from .verdicts import keys_spelled_as as _keys_spelled_as
from .verdicts import not_yet as _not_yet

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_shapes', 'check_prediction']


#: the collectives whose result lesson 01's second exercise asks to predict
PREDICTED_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")


def _lesson01_collective(comm, op: str, kwargs: dict):
    x = 10.0 * comm.rank + torch.arange(4.0)          # lesson 01's inputs: rank r holds [10r, ..., 10r + 3]
    return getattr(comm, op)(x, **kwargs)


@_hint_on_request
def check_prediction(prediction: Any, op: str, kwargs: dict, rank: int, what: str, hint: str | None = None,
                     world_size: int = 4) -> str:
    """Compare a learner's predicted value (a number, list or tensor) with what ``comm.op(x, **kwargs)``
    returns on ``rank`` of ``world_size`` virtual ranks when rank ``r`` holds ``[10r, ..., 10r + 3]``
    (lesson 01's inputs). The checker runs the collective itself; it trusts no value from the caller.

    A wrong prediction is answered with what differs (how many numbers, or that
    the values differ) and ``hint``, not with the actual value.
    """
    if _is_placeholder(prediction):
        return NOT_ANSWERED
    if op not in PREDICTED_OPS:
        raise ValueError(f"check_prediction: op={op!r} is not one of {list(PREDICTED_OPS)}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"check_prediction: rank={rank!r} is not a rank of {world_size}")
    predicted, problem = _as_numbers(prediction, what)
    if problem:
        return problem
    actual, _ = _as_numbers(World(world_size).run(_lesson01_collective, op, dict(kwargs))[rank], what)
    return _compare_prediction(predicted, actual, what, hint)


def _compare_prediction(predicted: torch.Tensor, actual: torch.Tensor, what: str, hint: str | None) -> str:
    if predicted.numel() != actual.numel():
        return _not_yet(f"{what} holds {actual.numel()} number(s); you gave {predicted.numel()}", hint)
    if not torch.allclose(predicted.flatten(), actual.flatten()):
        return _not_yet(f"{what} is not {_format(predicted.flatten())}", hint)
    return f"Correct: {what} is {_format(actual.flatten())}."


_SHAPE_HINTS = {
    "all_reduce": "all_reduce keeps the shape of its input",
    "all_gather": "all_gather concatenates world_size tensors along dim",
    "reduce_scatter": "reduce_scatter keeps one of world_size chunks along dim",
    "all_to_all": "all_to_all splits scatter_dim into world_size chunks and concatenates along gather_dim",
    "gather": "gather gives the concatenation to dst only",
    "broadcast": "broadcast keeps the shape",
    "slice": "slice keeps one of world_size chunks along dim",
}


def _shape_of(op: str, world_size: int, shape: tuple[int, ...], args: dict) -> tuple[int, ...] | None:
    def program(comm):
        out = getattr(comm, op)(torch.zeros(shape), **args)
        return None if out is None else tuple(out.shape)

    return World(world_size, trace=False).run(program)[0]


def _as_shape(value: Any) -> tuple[int, ...] | None | str:
    """A shape tuple, ``None``, or the string ``"malformed"``. A shape is a tuple, list,
    ``torch.Size`` or 1-d integer array of sizes, each an integer of any type (numpy, a 0-d tensor)."""
    if value is None:
        return None
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)) and \
            str(getattr(value, "dtype", "")).rpartition(".")[2].startswith(("int", "uint")):
        value = value.tolist()
    if isinstance(value, (tuple, list, torch.Size)):
        sizes = [_as_size(size) for size in value]
        if all(size is not None and size >= 0 for size in sizes):
            return tuple(sizes)
    return "malformed"


def _as_size(size: Any) -> int | None:
    """One size of a shape: an integer of any integer type (numpy, a one-element integer tensor), not
    ``True``/``False`` and not a float."""
    if isinstance(size, bool) or type(size).__name__ == "bool_":
        return None
    if isinstance(size, numbers.Integral):
        return int(size)
    if isinstance(size, torch.Tensor) and size.numel() == 1 and not (size.is_floating_point() or size.is_complex()
                                                                     or size.dtype == torch.bool):
        return int(size.item())
    return None


@_hint_on_request
def check_shapes(predictions: Any, *, world_size: int, shape: tuple[int, ...], args: dict[str, dict]) -> str:
    """Lesson 01: compare predicted output shapes (on rank 0) with what each collective returns.

    ``args`` maps every op of the exercise to the keyword arguments it is
    called with; ``predictions`` must map each of those ops to a shape tuple
    (``None`` where rank 0 gets nothing; an op's name whatever its capitals). Wrong shapes are named,
    with a hint, but not corrected.
    """
    if _is_placeholder(predictions):
        return NOT_ANSWERED
    if not isinstance(predictions, dict):
        return _not_yet(f"write a dict from op name to shape, like {{'all_reduce': (4, 8)}}, not {predictions!r}")
    predictions = _keys_spelled_as(predictions, args)
    unknown = sorted(str(op) for op in predictions if op not in args)
    if unknown:
        return _not_yet(f"{unknown} is not one of the calls {sorted(args)}")
    missing = [op for op in args if op not in predictions]
    if missing:
        return _not_yet(f"you predicted {len(predictions)} of {len(args)} calls; still missing: {missing}")
    malformed = [op for op in args if _as_shape(predictions[op]) == "malformed"]
    if malformed:
        op = malformed[0]
        return _not_yet(f"{op}: write a shape as a tuple of ints, like (4, 8), or None; not {predictions[op]!r}")
    wrong = [op for op in args if _as_shape(predictions[op]) != _shape_of(op, world_size, tuple(shape), args[op])]
    if wrong:
        return _not_yet(f"input {tuple(shape)} on {world_size} ranks: {len(wrong)} of {len(args)} shapes "
                        f"are wrong: {wrong}", "; ".join(_SHAPE_HINTS.get(op, op) for op in wrong))
    return f"Correct: all {len(args)} shapes."
