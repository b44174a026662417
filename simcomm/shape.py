"""Shape-only virtual ranks: the program runs on fake tensors, communication is traced and checked.

``World(n, tensors="shape")`` runs every rank's program under a
``FakeTensorMode`` of its own (``torch._subclasses.fake_tensor``): every
tensor the program creates, parameters included, is a *fake* tensor that has
a shape, a dtype, strides and a device but no data, and every op computes
only the metadata of its result. Collectives check and produce shapes and
dtypes and record the same trace as a real-valued run; the program's control
flow, subgroups, send/recv, handles and autograd run as they do with data.
Compute is skipped, so a step of a 1024-rank program costs what its
communication and its ops' shape propagation cost, not its FLOPs.

**One mode per rank.** A ``FakeTensorMode`` keeps a stack of its entries
(``enter_stack``) and the dispatch mode stack is per thread, so one mode
shared by rank threads that enter and leave it in turns would pop each
other's entries. Each rank thread enters a mode of its own for its whole
program (:func:`rank_mode`). A fake tensor belongs to its mode, and torch
refuses ops that mix modes; so a tensor never crosses ranks as it is:

* the collective math of :mod:`simcomm.collectives` runs on *meta* tensors
  (:func:`compute_on_meta`: each rank's fake input becomes a meta tensor with
  the same shape, dtype and strides; the math yields meta outputs), and
* each rank turns what it receives into a fake tensor of its own mode
  (:func:`own`), on its own thread, where the memory tracker counts it.

**What comes back.** ``World.run`` returns what each rank's program returned:
tensors in it are fake tensors (``.shape``, ``.dtype``, ``.device`` work;
reading values does not). :func:`shapes` turns them into
``torch.Size`` objects.

**Unsupported.** An op that needs values (``.item()``, ``.tolist()``,
``bool(t)``, ``torch.nonzero``, a data-dependent split) raises
:class:`ShapeOnlyError` naming the op and the rank (:func:`data_dependent_error`).
Such programs need the real-valued mode, or the value given as a Python
number.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensor, FakeTensorMode, UnsupportedFakeTensorException)
from torch.utils import _pytree as pytree

from .errors import SimcommError

__all__ = ["TENSOR_MODES", "ShapeOnlyError", "rank_mode", "fake_arguments", "compute_on_meta", "own",
           "shapes", "is_shape_only", "data_dependent_error"]

#: the values of ``World(..., tensors=)``
TENSOR_MODES = ("real", "shape")

#: torch's errors for an op whose result depends on values a fake tensor does not have
_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException)


class ShapeOnlyError(SimcommError):
    """A program run with ``tensors="shape"`` called an op that needs tensor values."""


def rank_mode() -> FakeTensorMode:
    """A fresh ``FakeTensorMode`` for one rank thread (see the module docstring)."""
    return FakeTensorMode(allow_non_fake_inputs=False)


def is_shape_only() -> bool:
    """Whether this thread runs inside a fake mode (a shape-only rank)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def fake_arguments(args: tuple, kwargs: dict, mode: FakeTensorMode, device: torch.device
                   ) -> tuple[tuple, dict]:
    """One rank's arguments with every tensor (and every module's parameters and buffers)
    turned into a fake tensor of ``mode`` on ``device``. The caller's objects are not modified;
    no data is copied (a fake tensor holds metadata only)."""
    import copy

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        fake = mode.from_tensor(tensor.detach() if tensor.requires_grad and not tensor.is_leaf else tensor,
                                static_shapes=True)
        if fake.device != device:
            with mode:
                fake = fake.to(device)
        if isinstance(tensor, torch.nn.Parameter) and not isinstance(fake, torch.nn.Parameter):
            fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
        return fake

    leaves, spec = pytree.tree_flatten((args, kwargs))
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            leaf = convert(leaf)
        elif isinstance(leaf, torch.nn.Module):
            # a module's structure is copied without its tensors' data: every tensor is swapped
            # for a fake one in the copy's own dicts
            memo: dict = {}
            for tensor in (*leaf.parameters(), *leaf.buffers()):
                memo[id(tensor)] = convert(tensor)
            leaf = copy.deepcopy(leaf, memo)
        out.append(leaf)
    return pytree.tree_unflatten(out, spec)


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _meta(value)
    if isinstance(value, tuple):
        return tuple(_to_meta(item) for item in value)
    if isinstance(value, list):
        return [_to_meta(item) for item in value]
    return value


@contextlib.contextmanager
def _no_fake_mode() -> Iterator[None]:
    mode = torch._C._unset_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    try:
        yield
    finally:
        if mode is not None:
            torch._C._set_dispatch_mode(mode)


def compute_on_meta(compute: Callable[[list], list], inputs: list) -> list:
    """Run a collective's math (``compute``, a list of per-rank inputs in, a list out) on meta
    tensors with the metadata of ``inputs`` (fake tensors of several ranks' modes): the
    outputs are meta tensors of the shapes and dtypes a real-valued run produces."""
    with _no_fake_mode(), torch.no_grad():
        return compute([_to_meta(entry) for entry in inputs])


def own(value: Any, device: torch.device) -> Any:
    """What a shape-only rank receives, as fake tensors of its own mode on ``device``.

    Meta tensors (a collective's outputs) and other ranks' fake tensors (a message
    in flight) are rebuilt from their metadata; anything else passes through.
    Called on the receiving rank's thread, inside its mode.
    """
    if isinstance(value, torch.Tensor):
        if value.is_meta or isinstance(value, FakeTensor):
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
        return value
    if isinstance(value, tuple):
        return tuple(own(item, device) for item in value)
    return value


def shapes(value: Any) -> Any:
    """``value`` with every tensor replaced by its ``torch.Size`` (lists, tuples, dicts kept)."""
    return pytree.tree_map(lambda leaf: leaf.shape if isinstance(leaf, torch.Tensor) else leaf, value)


def data_dependent_error(error: BaseException, rank: int) -> ShapeOnlyError | None:
    """A :class:`ShapeOnlyError` naming the op and the rank when ``error`` (or what caused it)
    is torch's refusal to compute a value from a fake tensor; ``None`` otherwise."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, _DATA_DEPENDENT):
            op = getattr(error, "func", None)
            name = str(op) if op is not None else type(error).__name__
            return ShapeOnlyError(
                f"rank {rank}: {name} needs tensor values, which a shape-only run "
                f"(World(..., tensors='shape')) does not have (e.g. .item(), .tolist(), bool(t), "
                f"nonzero, or split sizes read from a tensor); run this program with tensors='real', "
                f"or compute the value from shapes or Python numbers")
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None
