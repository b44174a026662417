"""How the simulator and checked mode word what they report: program lines, rank lists, mismatches.

Both backends name the same things the same way: where in the user's program a
rank called (:func:`program_location`), a list of ranks written with ranges
(:func:`format_ranks`), and the text of a collective mismatch
(:func:`mismatch_message`), so an error reads alike on virtual ranks and on
real processes.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterable, Sequence

import torch
import typing_extensions

__all__ = ["program_location", "program_frame", "format_ranks", "mismatch_message", "unwaited_message"]

# -- where in the program a rank is -----------------------------------------------------

_SKIP_DIRS = tuple(os.path.dirname(p) + os.sep for p in (__file__, torch.__file__))
# decorator wrappers torch puts around its API (deprecation, context managers)
_SKIP_FILES = (threading.__file__, contextlib.__file__, typing_extensions.__file__)
_UNKNOWN = "<unknown location>"


def _skip_dirs() -> tuple[str, ...]:
    """simcomm's and torch's folders, and real's once it is imported."""
    real = sys.modules.get("real")
    if real is not None and getattr(real, "__file__", None):
        return (*_SKIP_DIRS, os.path.dirname(real.__file__) + os.sep)
    return _SKIP_DIRS


def program_frame(frame):
    """The innermost frame that belongs to the user's program (``None`` if there is none)."""
    skip = _skip_dirs()
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(skip) and filename not in _SKIP_FILES:
            return frame
        frame = frame.f_back
    return None


def program_location(frame) -> str:
    """``file:line in function`` of the innermost frame that belongs to the user's program."""
    frame = program_frame(frame)
    if frame is None:
        return _UNKNOWN
    return f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


# -- rank lists -----------------------------------------------------------------------------

_MAX_PIECES = 12  # pieces of a rank list before it is cut short


def format_ranks(ranks: Iterable[int], *, ordered: bool = False) -> str:
    """``[0, 1, 5-9, 12]``: runs of three or more consecutive ranks as ranges.

    Sorted unless ``ordered`` (then the given order is kept, for lists that
    pair up with another). Past twelve pieces the list ends with
    ``..., N ranks in all``, so its length does not grow with the world size.
    """
    values = list(ranks) if ordered else sorted(ranks)
    pieces: list[str] = []
    start = 0
    while start < len(values) and len(pieces) < _MAX_PIECES:
        end = start
        while end + 1 < len(values) and values[end + 1] == values[end] + 1:
            end += 1
        if end - start >= 2:
            pieces.append(f"{values[start]}-{values[end]}")
        else:
            pieces.extend(str(v) for v in values[start:end + 1])
        start = end + 1
    if start < len(values):
        pieces.append(f"..., {len(values)} ranks in all")
    return "[" + ", ".join(pieces) + "]"


# -- a collective mismatch -------------------------------------------------------------------

def mismatch_message(group: Sequence[int], step: int, calls: Sequence[tuple[Sequence[int], str, str]],
                     problem: str = "") -> str:
    """The text of a :class:`~simcomm.errors.CollectiveMismatchError`.

    ``calls``: ``(ranks, call, location)`` for each distinct call the ranks of
    ``group`` issued at collective ``step`` (``call`` as ``op(arg=value, ...)``);
    ``problem``: an extra explanation (how two split lists fail to pair up).
    """
    body = ""
    for ranks, call, location in calls:
        ranks = list(ranks)
        who = f"ranks {format_ranks(ranks)}" if len(ranks) > 1 else f"rank {ranks[0]}"
        body += f"  {who} called {call} at {location}\n"
    if problem:
        body += f"  {problem.strip()}\n"
    return (f"ranks of group {list(group)} disagree at collective step {step}:\n{body}"
            f"every rank of a group must call the same collectives in the same order with "
            f"matching shapes, dtypes and arguments")


# -- groups made by their members only ---------------------------------------------------------

#: why the members of a ``new_group(..., use_local_synchronization=True)`` made different groups
LOCAL_GROUP_NAMES = (
    "the members named this group differently: torch names a group made by its members only "
    "(new_group(..., use_local_synchronization=True)) after its ranks and the number of process "
    "groups the calling rank belongs to, so members that belong to different numbers of groups make "
    "different groups (under torchrun, new_group hangs there). Make the groups so that every member "
    "belongs to the same number of groups when this one is made (e.g. every rank calls new_group for "
    "every group, in the same order, without use_local_synchronization)")


def local_group_call(ranks: Sequence[int], name: str) -> str:
    """``new_group(name=..., ranks=[...], use_local_synchronization=True)`` as a mismatch
    message shows a member's call (the name cut to 8 characters)."""
    return f"new_group(name={name[:8]}, ranks={list(ranks)}, use_local_synchronization=True)"


def local_group_mismatch(ranks: Sequence[int], step: int, entries: Sequence[tuple[str, str]]) -> str | None:
    """The :class:`~simcomm.errors.CollectiveMismatchError` text when the members ``ranks`` of a
    group made by its members only named it differently at their ``step``-th such meeting
    (``entries``: each member's ``(name, location)``, in the order of ``ranks``); None when
    they agree. Virtual ranks and unchecked real workers word it so; checked mode formats the
    same text from its own records."""
    if len({name for name, _ in entries}) < 2:
        return None
    calls: dict[tuple[str, str], list[int]] = {}
    for rank, (name, where) in zip(ranks, entries):
        calls.setdefault((local_group_call(ranks, name), where), []).append(rank)
    return mismatch_message(ranks, step, [(members, text, where) for (text, where), members in calls.items()],
                            LOCAL_GROUP_NAMES)


# -- handles never waited on ------------------------------------------------------------------

def unwaited_message(rank: int, issued: Sequence[tuple[str, str]]) -> str:
    """The text of an :class:`~simcomm.errors.UnwaitedHandleError`: global ``rank`` returned
    from its program with ``issued`` (``(what, where)`` of each call) never waited on."""
    lines = [f"rank {rank}: the program returned without waiting on {len(issued)} handle(s):"]
    lines += [f"  {what} issued at {where}" for what, where in issued]
    lines.append("call wait() on every handle (async_op=True, isend, irecv, batch_isend_irecv) "
                 "before the program returns")
    return "\n".join(lines)
