"""Shipping a program to the workers by value, with its file names and line numbers intact.

cloudpickle serializes functions defined in ``__main__`` or a notebook cell by
value, but renames their code's file to ``<dynamic-code>``, so a worker's
traceback could not point at the program's lines. Workers run the same Python as
this interpreter (forked from its forkserver), so code objects can travel as :mod:`marshal` data
instead, which keeps ``co_filename`` and the line table.
"""
from __future__ import annotations

import io
import marshal
import types
from typing import Any

import cloudpickle

__all__ = ["dumps", "loads"]


def _code_from_marshal(data: bytes) -> types.CodeType:
    return marshal.loads(data)


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any):
        if isinstance(obj, types.CodeType):
            return _code_from_marshal, (marshal.dumps(obj),)
        return super().reducer_override(obj)


def dumps(obj: Any) -> bytes:
    """cloudpickle ``obj``, keeping the file names of the code it carries."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


loads = cloudpickle.loads
