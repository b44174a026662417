"""Checked mode's calls: what one rank is about to do, as compared with its peers.

:data:`EXTRACTORS` maps a transport primitive's name to a function with the
primitive's signature that returns the :class:`Call` (or calls, for a batch)
to compare. What a collective's ranks must pass alike is its row's rule in
:data:`simcomm.specs.SPECS` (:meth:`~simcomm.specs.CollectiveSpec.agreed_fields`),
the rule the simulator's mismatch check reads too; the row's collectives get
their extractor from the row and the signature of the
:class:`~simcomm.transport.Transport` protocol's method. Written here are only
what is more than equal fields: ``scatter`` (only the source has a tensor),
``all_to_all_single`` (split sizes agreed pairwise) and point-to-point calls.
:mod:`real.checked_store` compares the calls; :mod:`real.checked` wraps a transport
with both.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from simcomm.specs import SPECS, CollectiveSpec
from simcomm.transport import Transport

__all__ = ["Call", "EXTRACTORS", "describe", "shape_dtype", "batch_op_name", "batch_op_tensor"]

@dataclass(frozen=True)
class Call:
    """What one rank is about to do, as compared with its peers.

    ``kind`` is ``"collective"``, ``"send"`` or ``"recv"``; ``compared`` must
    be equal on every rank of a collective (for a pair: the send's and the
    recv's shape and dtype); ``shown`` is only described; ``peer`` is the
    group-local peer of a send/recv; ``splits`` is ``(dim 0 size, output
    split sizes, input split sizes)`` of an ``all_to_all_single``.
    """

    kind: str
    op: str
    compared: tuple = ()
    shown: tuple = ()
    peer: int | None = None
    splits: tuple | None = None


def describe(call: Call) -> str:
    """``op(name=value, ...)`` as the simulator's mismatch messages write calls."""
    fields = [*call.compared, *call.shown]
    return f"{call.op}(" + ", ".join(f"{name}={_short(value)}" for name, value in fields) + ")"


def _short(value: Any) -> str:
    return str(value).removeprefix("torch.")


def _tensor(tensor: torch.Tensor) -> tuple:
    return _SEND(tensor.shape, tensor.dtype)


def _collective(op: str, *fields: tuple, shown: tuple = (), splits: tuple | None = None) -> list[Call]:
    return [Call("collective", op, tuple(fields), shown, splits=splits)]


def shape_dtype(call: Call) -> str:
    """``dtype shape`` of a send's or recv's call, as the mismatch message writes them."""
    fields = dict(call.compared)
    return f"{_short(fields['dtype'])} {fields['shape']}"


# -- the table: one function per primitive, with the primitive's signature --------------

# ``into`` (a rank's own output buffer) is each rank's own: not compared; PREMUL_SUM's factor is
# each rank's own (the ranks may differ): not compared. Each row's ``agreed`` arguments are.

#: how checked mode writes an agreed argument it compares (the simulator gets them so already)
_PLAIN: dict[str, Callable[[Any], Any]] = {"op": str, "groups": lambda groups: tuple(tuple(part) for part in groups)}


def _from_row(spec: CollectiveSpec) -> Callable[..., list[Call]]:
    """The extractor of a collective whose ranks compare equal fields: its row's rule, with the
    signature of the :class:`~simcomm.transport.Transport` protocol's method."""
    full = inspect.signature(getattr(Transport, spec.name))
    signature = full.replace(parameters=list(full.parameters.values())[1:])      # no self
    names, whole = spec.agreed, spec.tensor == "whole"

    def extract(*args, **kwargs) -> list[Call]:
        arguments = signature.bind(*args, **kwargs).arguments
        values = [_PLAIN.get(name, _same)(arguments[name]) for name in names]
        tensor = arguments["tensor"] if whole else None
        fields = spec.agreed_fields(tensor.shape, tensor.dtype, *values) if whole else spec.agreed_fields(
            None, None, *values)
        return _collective(spec.name, *fields)

    extract.__signature__ = signature
    extract.__name__ = extract.__qualname__ = f"_{spec.name}"
    return extract


def _same(value):
    return value


def _scatter(tensor, src, dim, requires_grad=False, async_op=False):
    # only the source's tensor matters (the others may pass None), and only the source knows
    # its rank count to normalise a negative dim: both shown, not compared (the transport
    # checks each rank's dim against the source's once the header arrives)
    return _collective("scatter", *SPECS["scatter"].agreed_fields(None, None, src),
                       shown=(("dim", dim), *(_tensor(tensor) if isinstance(tensor, torch.Tensor) else ())))


def _all_to_all_single(tensor, output_split_sizes, input_split_sizes, async_op=False):
    rows = tensor.shape[0] if tensor.dim() else 0
    splits = (rows, _split_list(output_split_sizes), _split_list(input_split_sizes))
    return _collective("all_to_all_single", *SPECS["all_to_all_single"].agreed_fields(tensor.shape, tensor.dtype),
                       shown=(("shape", tuple(tensor.shape)), ("input_split_sizes", splits[2]),
                              ("output_split_sizes", splits[1])), splits=splits)


def _split_list(sizes) -> tuple[int, ...] | None:
    return None if sizes is None else tuple(int(size) for size in sizes)


#: a collective whose agreement is more than equal fields: its extractor, written here
_OWN = {"scatter": _scatter, "all_to_all_single": _all_to_all_single}

_SEND, _RECV = (SPECS[name].agreed_fields for name in ("send", "recv"))


def _send(tensor, dst, async_op=False):
    return [Call("send", "isend" if async_op else "send", _tensor(tensor), peer=dst)]


def _recv(shape, dtype, src, async_op=False):
    return [Call("recv", "irecv" if async_op else "recv", _RECV(shape, dtype), peer=src)]


def _isend(tensor, dst):
    return [Call("send", "isend", _tensor(tensor), peer=dst)]


def _irecv(shape, dtype, src):
    return [Call("recv", "irecv", _RECV(shape, dtype), peer=src)]


def _batch_isend_irecv(ops):
    return [_p2p_op(op) for op in ops]


def _p2p_op(op) -> Call:
    """One entry of ``batch_isend_irecv``: a :class:`simcomm.P2POp` (``op`` ``"isend"``/``"irecv"``,
    ``data`` a tensor or ``(size, dtype)``, ``peer``) or an object with ``op`` (a name or the
    function), ``peer`` and either ``tensor`` or ``shape`` and ``dtype`` (torch's ``P2POp`` fits)."""
    name = batch_op_name(op)
    peer = getattr(op, "peer")
    tensor = batch_op_tensor(op)
    data = getattr(op, "data", None)
    if "recv" in name:
        if isinstance(tensor, torch.Tensor):
            shape, dtype = tuple(tensor.shape), tensor.dtype
        elif data is not None:
            shape, dtype = tuple(data[0]), data[1]
        else:
            shape, dtype = tuple(op.shape), op.dtype
        return Call("recv", "irecv", _RECV(shape, dtype), peer=peer)
    if "send" in name:
        return Call("send", "isend", _tensor(tensor), peer=peer)
    raise TypeError(f"batch_isend_irecv: unknown op {name!r}")


def batch_op_name(op) -> str:
    """A batch op's kind as a string (``"isend"``, or the name of torch's function)."""
    name = getattr(op, "op", None)
    return str(getattr(name, "__name__", name))


def batch_op_tensor(op) -> torch.Tensor | None:
    """A batch op's tensor (``tensor``, else ``data`` when it is one)."""
    tensor = getattr(op, "tensor", None)
    data = getattr(op, "data", None)
    return data if tensor is None and isinstance(data, torch.Tensor) else tensor


#: primitive name -> function with its signature returning the calls to compare: every collective
#: of simcomm.specs (from its row, or its own above), then the point-to-point calls
EXTRACTORS: dict[str, Callable[..., list[Call]]] = {
    **{name: _OWN.get(name) or _from_row(spec) for name, spec in SPECS.items() if spec.kind == "collective"},
    "send": _send, "recv": _recv, "isend": _isend, "irecv": _irecv, "batch_isend_irecv": _batch_isend_irecv,
}
