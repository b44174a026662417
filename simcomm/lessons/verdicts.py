"""What every exercise checker returns, and how a learner's error becomes feedback.

A checker *returns* a verdict as text and never raises for anything the
learner wrote: :data:`NOT_ANSWERED` while the placeholder (``...``, or a
function raising ``NotImplementedError``) is still there; ``"Not yet: ..."``
and a hint for a wrong, partial or malformed answer (or code that raised,
deadlocked or broke a rule of the exercise); ``"Correct ..."`` for a right
one. The checker modules of the lessons (:mod:`simcomm.lessons.foundations`,
:mod:`simcomm.lessons.training`, :mod:`simcomm.lessons.scaling`) share these.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ..errors import CollectiveMismatchError, DeadlockError, RankError

__all__ = ["NOT_ANSWERED", "is_correct", "not_yet", "is_placeholder", "Forbidden", "attempt"]

#: what a checker returns while the exercise still holds its placeholder
NOT_ANSWERED = "Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."


def is_correct(verdict: str) -> bool:
    """True for a checker's verdict on a right answer."""
    return verdict.startswith("Correct")


def not_yet(problem: str, hint: str | None = None) -> str:
    """The verdict on a wrong, partial or malformed answer: the problem, then a hint."""
    return f"Not yet: {problem}" + (f"\nHint: {hint}" if hint else "")


def is_placeholder(answer: Any) -> bool:
    """Not answered yet, the one rule every checker uses: the untouched ``...`` placeholder,
    alone or as a value of a dict, list or tuple. A checker answers it with
    :data:`NOT_ANSWERED`; anything else (``None`` too) is an answer, judged with a hint."""
    if answer is ...:
        return True
    values = answer.values() if isinstance(answer, dict) else answer if isinstance(answer, (list, tuple)) else ()
    return any(value is ... for value in values)


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
            return None, not_yet("the ranks deadlocked: " + str(error).splitlines()[0], deadlock_hint)
        if isinstance(error, CollectiveMismatchError):
            return None, not_yet("the ranks called different collectives: " + str(error).splitlines()[0])
        where, cause = (f" on rank {error.rank}", error.__cause__ or error) if isinstance(error, RankError) \
            else ("", error)
        first = str(cause).splitlines()[0] if str(cause) else ""
        return None, not_yet(f"your code raised {type(cause).__name__}{where}: {first}")
