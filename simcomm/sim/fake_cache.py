"""One fake dispatch for every shape-only rank: a cache in front of each rank's ``FakeTensorMode``.

Every shape-only rank runs its program under a ``FakeTensorMode`` of its own
(:mod:`simcomm.sim.shape`). torch's fake mode already keeps a dispatch cache on
the class, shared by every mode, so the first rank to run an op on some
shapes computes the result's metadata and every other rank's mode builds its
own output from that entry. But reaching the entry costs a rank about 40 us
of Python per op even on a hit: torch's key is built from a full
``TensorMetadata`` of every tensor argument (some twenty fields, each a
Python call), behind the mode's logging and bookkeeping. Ranks of a group run
the same ops on the same shapes hundreds of times per rank, so at 16,384
ranks that lookup *is* the run.

:func:`dispatch` answers the same question with a cheaper key, in the rank's
dispatch mode that sits right above the fake mode
(:class:`~simcomm.sim.shape.FunctionalCollectives`), before torch's Python
code is entered at all:

* **the key** is the op, the default dtype and device, whether inference mode
  and a proxy (tracing) mode are on, and every argument in order: for a fake
  tensor of the asking rank's mode its shape, strides, storage offset, storage
  size in bytes, dtype, device, ``requires_grad`` and dispatch keys (which
  carry the conjugate and negative bits, inference tensors, layout and
  backend); for a number, string, dtype, device, layout or memory format its
  type and value; lists and tuples element by element with their type and
  length. Those are the fields of torch's own key, minus what they imply
  (memory format follows from shape and strides); an argument of any other
  kind (a tensor of another mode, a real tensor, a function) makes the call
  uncached here.
* **the entry** is torch's own cache entry (``FakeTensorMode.cache``): on a
  first sight of a key the op is dispatched to the fake mode as before, torch
  decides whether its result can be cached (its rules: no data-dependent or
  dynamic output shapes, no in-place views, builtin ops only, ...) and stores
  the entry, which is then filed under the cheap key too. Calls torch does not
  cache (its negative entry, a "bypass") are remembered as such and computed by
  the fake mode every time, as torch does after finding its negative entry
  (``FakeTensorMode._dispatch_impl``, skipping only the lookup that would find
  it again). So this cache holds nothing torch's does not, and answers exactly
  when torch would have answered from its own.
* **the output** is built from the entry as torch builds it on a hit: for an
  in-place op the asking rank's own argument; otherwise a new fake tensor of
  the asking rank's mode with its own meta storage and version counter (for a
  view op, a view of the asking rank's input's storage).

The queries torch's fake mode answers before its cache (``prim.device``,
``aten.size``, ``aten.stride``, ``aten.storage_offset``: autograd asks the
device of every tensor it meets) are answered by the same handlers, without
the fake mode's entry code (``prim.device`` on a fake tensor by the rank's dispatch mode
itself, :class:`~simcomm.sim.shape.FunctionalCollectives`, as its handler answers it).

``TORCH_FAKE_TENSOR_DISPATCH_CACHE=0`` (or a mode with ``cache_enabled``
false) turns this cache off with torch's. :func:`cache_info` counts hits,
misses and uncached calls; :func:`cache_clear` empties it.

Call chain on a rank thread: an aten op -> autograd -> ``FunctionalCollectives.__torch_dispatch__``
-> :func:`dispatch` -> (hit) a new fake tensor / (miss) ``FakeTensorMode.__torch_dispatch__``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._subclasses import fake_tensor as _fake
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["QUERIES", "dispatch", "dispatch_op", "empty", "cache_info", "cache_clear"]

#: cheap key -> torch's cache entry for it (a ``_DispatchCacheValidEntry``), an :class:`_UnsafeView`,
#: ``_COMPUTED`` or ``_UNCACHED``
_ENTRIES: dict[tuple, Any] = {}
_UNCACHED = object()
_COMPUTED = object()        # torch's cache has a negative entry: the fake mode computes it each time
_UNSAFE_VIEW = torch.ops.aten._unsafe_view.default
_COUNTS = {"hits": 0, "misses": 0, "uncached": 0, "computed": 0}

#: argument types keyed by their type and value (as torch's key does: 1 and 1.0 differ)
_PLAIN = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format})
_SEQUENCES = (list, tuple)
_PROXY = torch._C._TorchDispatchModeKey.PROXY
_get_dispatch_mode = torch._C._get_dispatch_mode
_dispatch_keys = torch._C._dispatch_keys
_get_default_device = torch._C._get_default_device
_get_default_dtype = torch.get_default_dtype
_inference = torch.is_inference_mode_enabled
_DisableTorchDispatch = torch._C._DisableTorchDispatch
_empty_strided = torch.empty_strided
_META = torch.device("meta")
#: the queries a fake mode answers before its cache, with its own handlers (op -> handler(args))
QUERIES = _fake._DISPATCH_META_HANDLERS


def _add(parts: list, values, mode: FakeTensorMode) -> bool:
    """Append the key of each of ``values`` to ``parts``; False when one cannot be keyed."""
    for value in values:
        kind = type(value)
        if kind is not FakeTensor and kind in _PLAIN:
            parts.append(kind)
            parts.append(value)
        elif kind is FakeTensor or isinstance(value, FakeTensor):     # most arguments: a fake tensor
            if value.fake_mode is not mode or value.constant is not None:
                return False
            try:
                parts.extend((value.shape, value.stride(), value.storage_offset(),
                              value.untyped_storage().nbytes(), value.dtype, value._fake_device,
                              value.requires_grad, _dispatch_keys(value).raw_repr()))
            except RuntimeError:   # sparse and other layouts without strides or storage
                return False
        elif kind in _SEQUENCES:
            parts.append((kind, len(value)))
            if not _add(parts, value, mode):
                return False
        else:
            return False
    return True


def _key(func, args, kwargs: dict, mode: FakeTensorMode) -> tuple | None:
    """The cheap key of one call (module docstring); ``None`` when an argument cannot be keyed."""
    parts = [func, _get_default_dtype(), _get_default_device(), _inference(), _get_dispatch_mode(_PROXY) is None]
    if not _add(parts, args, mode):
        return None
    if kwargs:
        parts.append(len(kwargs))
        for name, value in kwargs.items():
            parts.append(name)
            if not _add(parts, (value,), mode):
                return None
    return tuple(parts)


def _build(entry, func, args, mode: FakeTensorMode) -> Any:
    """The outputs of a hit for the rank of ``mode``, built from torch's ``entry`` as torch's
    ``_get_output_tensor_from_cache_entry`` builds them (a mode without a shape environment,
    so no symbolic sizes)."""
    if not entry.is_output_tuple:       # most ops: one output, not in place, no constant
        info = entry.output_infos[0]
        metadata = info.metadata
        if info.inplace_idx is None and metadata is not None:
            storage = args[info.view_idx].untyped_storage() if info.view_idx is not None else None
            return _fake_tensor(mode, _meta(metadata, storage), metadata.device)
    outputs = []
    for info in entry.output_infos:
        metadata = info.metadata
        if info.inplace_idx is not None:
            outputs.append(args[info.inplace_idx])   # in place: the asking rank's own argument
            continue
        if metadata is None:
            outputs.append(info.constant_value)      # None or a number
            continue
        # a view: on the asking rank's input storage
        storage = args[info.view_idx].untyped_storage() if info.view_idx is not None else None
        outputs.append(_fake_tensor(mode, _meta(metadata, storage), metadata.device))
    return tuple(outputs) if entry.is_output_tuple else outputs[0]


def _meta(metadata, storage: torch.UntypedStorage | None) -> torch.Tensor:
    """A meta tensor of ``metadata`` (torch's ``TensorMetadata``): on ``storage`` when given,
    with ``set_``, which makes it no view of what else lies there and gives it its own version."""
    with _DisableTorchDispatch():
        empty = _empty_strided(metadata.shape, metadata.stride, dtype=metadata.dtype,
                               layout=metadata.layout, device=_META, requires_grad=metadata.requires_grad)
        if metadata.is_conj:
            torch._C._set_conj(empty, True)
        if metadata.is_neg:
            torch._C._set_neg(empty, True)
        if storage is not None:
            empty.set_(storage, metadata.storage_offset, metadata.shape, metadata.stride)
    return empty


#: per device, the attributes ``FakeTensor.__new__`` gives a plain output (its device, empty
#: memos, no constant), learnt from one tensor it built; the mode is set per tensor
_TEMPLATES: dict[torch.device, dict] = {}


def _fake_tensor(mode: FakeTensorMode, elem: torch.Tensor, device: torch.device) -> FakeTensor:
    """``FakeTensor(mode, elem, device)`` for a meta ``elem`` and a normalized ``device``,
    without the constructor's argument handling: the same subclass wrapper
    (``Tensor._make_subclass`` with the fake device's dispatch keys), the same warning or refusal on
    ``data_ptr``, and the instance attributes the constructor sets, copied from a tensor it
    built (``tests/sim/test_fake_cache.py`` compares the two)."""
    template = _TEMPLATES.get(device)
    if template is None or _fake.FakeTensorConfig.debug:
        tensor = FakeTensor(mode, elem, device)
        if not _fake.FakeTensorConfig.debug:
            _TEMPLATES[device] = {name: value for name, value in vars(tensor).items() if name != "fake_mode"}
        return tensor
    tensor = torch.Tensor._make_subclass(FakeTensor, elem, elem.requires_grad, dispatch_device=True,
                                         device_for_backend_keys=device)
    if mode._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(tensor)
    else:
        torch._C._set_throw_on_mutable_data_ptr(tensor)
    attributes = template.copy()      # the new tensor's __dict__ is empty: replaced, not updated
    attributes["fake_mode"] = mode
    tensor.__dict__ = attributes
    return tensor


def empty(mode: FakeTensorMode, shape, stride, dtype: torch.dtype, device: torch.device) -> FakeTensor:
    """What ``torch.empty_strided(shape, stride, dtype=dtype, device=device)`` returns under
    ``mode`` (a new fake tensor of its own meta storage, no gradient), without the dispatch.
    For a ``device`` that needs no normalizing (one with its index, or the CPU) and no other
    dispatch mode set (``tests/sim/test_fake_cache.py`` compares the two)."""
    with _DisableTorchDispatch():
        elem = _empty_strided(shape, stride, dtype=dtype, device=_META)
    return _fake_tensor(mode, elem, device)


class _outside_fake_mode:
    """The fake mode unset from this thread's dispatch state for a block (as while its own
    ``__torch_dispatch__`` runs), set again after. :func:`dispatch` is called only while
    ``mode`` is the thread's fake mode."""

    __slots__ = ("mode", "previous")

    def __init__(self, mode: FakeTensorMode):
        self.mode = mode

    def __enter__(self) -> None:
        self.previous = torch._C._unset_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)

    def __exit__(self, *exc_info) -> None:
        if self.previous is not None:
            torch._C._set_dispatch_mode(self.previous)


class _UnsafeView:
    """The entry of an ``aten._unsafe_view``: the metadata (torch's ``TensorMetadata``) of what
    torch's fake mode returns for the key, a tensor on its input's storage that is not a view of
    it (no base, its own version counter). torch keeps a negative entry for the op ("unsafe
    view") and computes it each time."""

    __slots__ = ("metadata",)

    def __init__(self, metadata):
        self.metadata = metadata


def _aliases_its_input(output: Any, tensor: Any) -> bool:
    """Whether ``output`` is a fake tensor on ``tensor``'s storage and not a view of it (what the
    fake mode's ``_unsafe_view`` returns), so that :func:`_meta` on that storage rebuilds it."""
    return (isinstance(output, FakeTensor) and isinstance(tensor, FakeTensor) and not output._is_view()
            and output.untyped_storage()._cdata == tensor.untyped_storage()._cdata)


def _learn(key: tuple, func, args, kwargs: dict, mode: FakeTensorMode) -> Any:
    """A first sight of ``key``: dispatch to the fake mode and file torch's entry under ``key``."""
    torch_key = None
    try:
        torch_key = mode._cache_key(_fake._CacheKeyState(mode.shape_env), func, args, kwargs)
    except _fake._BypassDispatchCache:
        bypass = True                # torch cannot even key this call: it computes it every time
    else:
        bypass = False
    output = func(*args, **kwargs)
    entry = FakeTensorMode.cache.get(torch_key) if torch_key is not None else None
    if func is _UNSAFE_VIEW and _aliases_its_input(output, args[0]):
        _ENTRIES[key] = _UnsafeView(_fake.extract_tensor_metadata(output))
        _COUNTS["misses"] += 1
    elif isinstance(entry, _fake._DispatchCacheValidEntry):
        _ENTRIES[key] = entry
        _COUNTS["misses"] += 1
    else:
        # torch's negative entry (an op or output it does not cache), or no key at all: such a
        # call is computed by the fake mode each time, and may skip its cache lookup; anything
        # else (an op the fake mode answers before its cache) takes the whole way each time
        negative = bypass or isinstance(entry, _fake._DispatchCacheBypassEntry)
        _ENTRIES[key] = _COMPUTED if negative and func not in _fake._DISPATCH_HANDLE_DIRECTLY else _UNCACHED
        _COUNTS["uncached"] += 1
    return output


def dispatch(func, types, args: tuple, kwargs: dict, mode: FakeTensorMode) -> Any:
    """``func(*args, **kwargs)`` on the rank whose fake mode is ``mode``, answered from the
    shared cache when torch's fake mode would have answered from its own (module docstring).
    Called from the rank's dispatch mode above ``mode``, while ``mode`` is the thread's fake
    mode; the result is what the fake mode would return."""
    handler = QUERIES.get(func)
    if handler is not None:
        return handler(args)
    return dispatch_op(func, types, args, kwargs, mode)


def dispatch_op(func, types, args: tuple, kwargs: dict, mode: FakeTensorMode) -> Any:
    """:func:`dispatch` for an op that is none of :data:`QUERIES` (the caller answered those)."""
    if not mode.cache_enabled or mode.cache_crosscheck_enabled:
        return func(*args, **kwargs)
    key = _key(func, args, kwargs, mode)
    if key is None:
        _COUNTS["uncached"] += 1
        return func(*args, **kwargs)
    entry = _ENTRIES.get(key)
    if entry is None:
        return _learn(key, func, args, kwargs, mode)
    if entry is _COMPUTED:
        # what the fake mode does after finding torch's negative entry (its __torch_dispatch__
        # runs with the fake mode unset, as here): without building torch's key again first
        _COUNTS["computed"] += 1
        with _outside_fake_mode(mode):
            return mode._dispatch_impl(func, types, args, kwargs)
    if entry is _UNCACHED:
        _COUNTS["uncached"] += 1
        return func(*args, **kwargs)
    _COUNTS["hits"] += 1
    if type(entry) is _UnsafeView:      # on this rank's own input's storage
        metadata = entry.metadata
        return _fake_tensor(mode, _meta(metadata, args[0].untyped_storage()), metadata.device)
    return _build(entry, func, args, mode)


def cache_info() -> dict[str, int]:
    """This process's counts since it started or since :func:`cache_clear`: ``hits`` (answered
    here), ``misses`` (first sights, answered by the fake mode and filed), ``uncached``
    (answered by the fake mode: ops or arguments torch does not cache), ``computed`` (ops
    torch's cache holds a negative entry for, computed by the fake mode without its cache
    lookup) and ``entries``."""
    return {**_COUNTS, "entries": len(_ENTRIES)}


def cache_clear() -> None:
    """Empty the cache and its counts (torch's own ``FakeTensorMode.cache_clear()`` is separate)."""
    _ENTRIES.clear()
    for name in _COUNTS:
        _COUNTS[name] = 0
