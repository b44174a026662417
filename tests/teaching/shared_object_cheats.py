"""Ways a learner's distributed function can pass data between virtual ranks through Python objects
that every rank shares, with no collective: the checker tables run each exercise's cheat through
every channel here and expect a ``Not yet`` verdict naming the object.

A channel is ``(put, take, label)``: ``put(rank, value)`` stores a rank's value, ``take(rank)``
reads any rank's value back (raising ``KeyError``, ``AttributeError`` or ``NameError`` for a rank
that stored nothing), and ``label`` is what the verdict must name. :func:`reset` empties every
channel, so a table row starts from nothing.
"""
from __future__ import annotations

import argparse
import builtins
import math
import sys
import types


class Board:                                   # a class defined in the learner's notebook
    seen: dict = {}


def put_class(rank, value):
    Board.seen[rank] = value


def take_class(rank):
    return Board.seen[rank]


def put_imported_class(rank, value):           # an imported class's attribute, its name built at run time
    setattr(argparse.Namespace, "shared_" + str(rank), value)


def take_imported_class(rank):
    return getattr(argparse.Namespace, "shared_" + str(rank))


def put_module(rank, value):                   # `import math; math.board = ...`
    if not hasattr(math, "board"):
        math.board = {}
    math.board[rank] = value


def take_module(rank):
    return math.board[rank]


def put_main(rank, value):                     # sys.modules["__main__"], the notebook's own module
    vars(sys.modules["__main__"]).setdefault("board", {})[rank] = value


def take_main(rank):
    return sys.modules["__main__"].board[rank]


def put_builtins(rank, value):                 # a new builtin name, read back as a bare name
    builtins.__dict__.setdefault("board", {})[rank] = value


def take_builtins(rank):
    return board[rank]  # noqa: F821 - the builtin put_builtins made


def marker():
    """A function whose attribute holds the data (``marker.cache``)."""


def put_function_attribute(rank, value):
    if not hasattr(marker, "cache"):
        marker.cache = {}
    marker.cache[rank] = value


def take_function_attribute(rank):
    return marker.cache[rank]


#: a helper module of the learner's own, keeping the data in its module-level dict
helper = types.ModuleType("learner_helper")
exec(compile("BOARD = {}\n\ndef put(rank, value):\n    BOARD[rank] = value\n\n"
             "def take(rank):\n    return BOARD[rank]\n", "learner_helper.py", "exec"), vars(helper))
sys.modules["learner_helper"] = helper


def put_helper_module(rank, value):
    helper.put(rank, value)


def take_helper_module(rank):
    return helper.take(rank)


def put_imported_function_attribute(rank, value):     # an attribute of the helper module's function
    vars(helper.put).setdefault("cache", {})[rank] = value


def take_imported_function_attribute(rank):
    return helper.put.cache[rank]


CHANNELS = {
    "class attribute": (put_class, take_class, "Board.seen"),
    "imported class attribute": (put_imported_class, take_imported_class, "Namespace.shared_"),
    "imported module attribute": (put_module, take_module, "math.board"),
    "sys.modules['__main__']": (put_main, take_main, "__main__.board"),
    "builtins": (put_builtins, take_builtins, "builtins.board"),
    "function attribute": (put_function_attribute, take_function_attribute, "marker.cache"),
    "helper module": (put_helper_module, take_helper_module, "learner_helper.BOARD"),
    "imported function attribute": (put_imported_function_attribute, take_imported_function_attribute,
                                    "put.cache"),
}


def reset() -> None:
    """Empty every channel."""
    Board.seen.clear()
    for name in [name for name in vars(argparse.Namespace) if name.startswith("shared_")]:
        delattr(argparse.Namespace, name)
    for holder in (math, sys.modules["__main__"], builtins):
        vars(holder).pop("board", None)
    vars(marker).pop("cache", None)
    vars(helper.put).pop("cache", None)
    helper.BOARD.clear()
