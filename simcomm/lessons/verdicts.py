"""What every exercise checker returns, and how a learner's error becomes feedback.

A checker *returns* a verdict as text and never raises for anything the
learner wrote: :data:`NOT_ANSWERED` while the placeholder (``...``, or a
function raising ``NotImplementedError``) is still there; ``"Not yet: ..."``
and a hint for a wrong, partial or malformed answer (or code that raised,
deadlocked or broke a rule of the exercise); ``"Correct ..."`` for a right
one. A verdict states the problem only; the hint (how to fix it) is a second
answer the learner asks for, by calling the checker again with
``show_hint=True`` (:func:`hint_on_request`). The checker modules of the lessons (:mod:`simcomm.lessons.foundations`,
:mod:`simcomm.lessons.training`, :mod:`simcomm.lessons.scaling`) share these.
"""
from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CollectiveMismatchError, DeadlockError, RankError
from ..reports import format_ranks

__all__ = ["NOT_ANSWERED", "HINT_OFFER", "is_correct", "not_yet", "hint_on_request", "is_placeholder",
           "as_number", "TRAFFIC_RULE", "rank_traffic", "reduce_scatter_traffic",
           "Forbidden", "attempt"]

#: what a checker returns while the exercise still holds its placeholder
NOT_ANSWERED = "Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."


#: what replaces the hint of a ``Not yet`` verdict until the learner asks for it
HINT_OFFER = "(Stuck? Run the same check again with show_hint=True for a hint.)"


def is_correct(verdict: str) -> bool:
    """True for a checker's verdict on a right answer."""
    return verdict.startswith("Correct")


def not_yet(problem: str, hint: str | None = None) -> str:
    """The verdict on a wrong, partial or malformed answer: the problem, then a hint."""
    return f"Not yet: {problem}" + (f"\nHint: {hint}" if hint else "")


def hint_on_request(checker: Callable[..., str]) -> Callable[..., str]:
    """Give ``checker`` a keyword ``show_hint=False``: its ``Not yet`` verdict then says only what is
    wrong, and offers the hint (:data:`HINT_OFFER`); with ``show_hint=True`` it also gives the hint."""
    @functools.wraps(checker)
    def checked(*args: Any, show_hint: bool = False, **kwargs: Any) -> str:
        verdict = checker(*args, **kwargs)
        problem, marker, _ = verdict.partition("\nHint: ")
        return verdict if show_hint or not marker else f"{problem}\n{HINT_OFFER}"
    return checked


def as_number(answer: Any) -> float | None:
    """``answer`` as a float if it is one real number of any numeric type (``int``, ``float``,
    ``Fraction``, numpy scalars, 0-d and one-element tensors or arrays); ``None`` otherwise
    (``bool`` too: True/False is not a count)."""
    if isinstance(answer, bool) or getattr(answer, "dtype", None) is not None and str(answer.dtype) == "bool":
        return None
    if isinstance(answer, numbers.Real):
        return float(answer)
    if hasattr(answer, "numel") and hasattr(answer, "item"):           # torch tensors
        if answer.numel() != 1 or answer.is_complex():
            return None
        return float(answer.item())
    if hasattr(answer, "size") and hasattr(answer, "item") and hasattr(answer, "dtype"):   # numpy arrays
        if answer.size != 1 or answer.dtype.kind not in "iuf":
            return None
        return float(answer.item())
    return None


def is_placeholder(answer: Any) -> bool:
    """Not answered yet, the one rule every checker uses: the untouched ``...`` placeholder,
    alone or as a value of a dict, list or tuple. A checker answers it with
    :data:`NOT_ANSWERED`; anything else (``None`` too) is an answer, judged with a hint."""
    if answer is ...:
        return True
    values = answer.values() if isinstance(answer, dict) else answer if isinstance(answer, (list, tuple)) else ()
    return any(value is ... for value in values)


#: the one traffic rule, as the lessons state it (02's all-gather backward, 07's ZeRO-2 shard)
TRAFFIC_RULE = ("the backward of all-gather is a reduce-scatter, and it moves the fewest bytes: an all-reduce "
                "then a chunk has the right values but moves about twice the bytes, and a reduce to one rank "
                "then a scatter loads that rank's links")


def rank_traffic(trace: Any, rank: int, skip_first: int = 0) -> tuple[int, int]:
    """``(sent, received)``: the bytes ``rank`` sent and received in ``trace``'s forward-phase calls,
    after its first ``skip_first`` calls (a checker's own set-up collectives)."""
    calls = [e for e in trace.events if e.rank == rank and e.op != "compute"][skip_first:]
    forward = [e for e in calls if e.phase == "forward"]
    return sum(sum(e.sent.values()) for e in forward), sum(sum(e.received.values()) for e in forward)


def reduce_scatter_traffic(trace: Any, world_size: int, input_bytes: int, skip_first: int = 0) -> str | None:
    """The one traffic rule of the checkers (:data:`TRAFFIC_RULE`): ``None`` when every rank of
    ``trace`` sent and received no more than a reduce-scatter of ``input_bytes`` would,
    ``(P - 1) / P * input_bytes`` each way; otherwise the ``Not yet`` verdict naming every rank over
    that budget and how many bytes it moved. Every rank is counted: a reduce to rank 0 then a
    scatter keeps rank 0's *sent* bytes within budget while it receives ``P - 1`` whole tensors and
    the other ranks each send a whole one. Checkers judge the values first, then this."""
    budget = (world_size - 1) * input_bytes // world_size
    over: dict[str, list[int]] = {}           # what a rank moved beyond the budget -> those ranks
    for rank in range(world_size):
        sent, received = rank_traffic(trace, rank, skip_first)
        moved = " and ".join(f"{word} {count} B" for word, count in (("sent", sent), ("received", received))
                             if count > budget)
        if moved:
            over.setdefault(moved, []).append(rank)
    if not over:
        return None
    named = "; ".join(f"rank {ranks[0]} {moved}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)} each {moved}"
                      for moved, ranks in over.items())
    return not_yet(f"right values, but more bytes than necessary: a reduce-scatter sends and receives {budget} B "
                   f"per rank, and {named}", TRAFFIC_RULE)


class Forbidden(Exception):
    """The learner's code used something the exercise rules out (its message is the verdict)."""


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def attempt(call: Callable[[], Any], deadlock_hint: str | None = None) -> tuple[Any, str | None]:
    """``(result, None)``, or ``(None, verdict)`` when the learner's code raised.

    The one place that recognises the placeholder (``NotImplementedError``,
    also when a rank raised it) and turns any other error into a short
    ``Not yet`` line instead of a traceback.
    """
    try:
        return call(), None
    except Exception as error:  # the learner's code: any error becomes feedback
        causes = list(_chain(error))
        if any(isinstance(cause, NotImplementedError) for cause in causes):
            return None, NOT_ANSWERED
        forbidden = next((cause for cause in causes if isinstance(cause, Forbidden)), None)
        if forbidden is not None:
            return None, not_yet(str(forbidden))
        if isinstance(error, DeadlockError):
            return None, not_yet("the ranks deadlocked: " + _summary(error), deadlock_hint)
        if isinstance(error, CollectiveMismatchError):
            return None, not_yet("the ranks called different collectives: " + _summary(error))
        where, cause = (f" on rank {error.rank}", error.__cause__ or error) if isinstance(error, RankError) \
            else ("", error)
        return None, not_yet(f"your code raised {type(cause).__name__}{where}: {_summary(cause)}")


def _summary(error: BaseException, most_lines: int = 8) -> str:
    """The first line of an error's message, and the lines it announces (a first line ending in ':',
    such as "ranks still running:" or "... none can make progress:", is followed by what it lists)."""
    lines = [line.rstrip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    if not lines[0].endswith(":"):
        return lines[0]
    listed = lines[1:most_lines + 1] + (["  ..."] if len(lines) > most_lines + 1 else [])
    return "\n".join([lines[0], *listed]) if listed else lines[0] + " (nothing listed)"
