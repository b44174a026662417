"""Shipping a program to the workers by value, with its file names and line numbers intact, and
bringing large tensors back through shared memory.

cloudpickle serializes functions defined in ``__main__`` or a notebook cell by
value, but renames their code's file to ``<dynamic-code>``, so a worker's
traceback could not point at the program's lines. Workers run the same Python as
this interpreter (forked from its forkserver), so code objects can travel as :mod:`marshal` data
instead, which keeps ``co_filename`` and the line table.

Large results (:func:`dumps_shared` / :func:`loads_shared`): a tensor's storage of at least
:data:`SHARE_MIN_BYTES` is not copied into the pickle; it is copied once into an anonymous
shared-memory file (``memfd_create``) whose descriptor travels beside the pickle
(:mod:`real.messages`), and the receiver maps that file: its tensors' storages are the mapped
pages themselves, so a result costs one copy, made at memory speed (the worker's), instead of
several pickled copies through a pipe. This is what :mod:`torch.multiprocessing` does for
tensors sent between processes, done here with public APIs and without its shared-memory
manager: the file has no name, so nothing is left behind whoever dies. Views keep sharing
their storage; the large storages of one result share one mapping, unmapped when the last
tensor using it is freed. Such a storage cannot be resized (as one received from
:mod:`torch.multiprocessing`); everything else about the tensors is as pickling makes them.
Where ``os.memfd_create`` is missing (not Linux), every storage is pickled.
"""
from __future__ import annotations

import io
import marshal
import mmap
import os
import pickle
import types
import warnings
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch

__all__ = ["dumps", "loads", "dumps_shared", "loads_shared", "map_shared", "SharedStorages", "SHARE_MIN_BYTES"]

#: storages at least this large travel through shared memory in :func:`dumps_shared`
SHARE_MIN_BYTES = 1 << 20
_ALIGN = mmap.PAGESIZE
#: map every page at once (Linux): far cheaper than one page fault per 4 KiB while copying/reading
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
_PERSISTENT_TAG = "simcomm-shared-storage"


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


@dataclass(frozen=True)
class SharedStorages:
    """Where :func:`dumps_shared` put the large storages: ``(offset, nbytes)`` of storage ``i`` in
    a shared-memory file of ``size`` bytes (the file's descriptor travels separately)."""

    size: int
    layout: tuple[tuple[int, int], ...]


class _SharingPickler(_Pickler):
    """:class:`_Pickler` that leaves large CPU storages out of the pickle, collecting them instead."""

    def __init__(self, file: io.BytesIO, min_bytes: int):
        super().__init__(file, protocol=cloudpickle.DEFAULT_PROTOCOL)
        self.min_bytes = min_bytes
        self.storages: list[torch.UntypedStorage] = []
        self._index: dict[int, int] = {}              # data pointer -> index in self.storages

    def persistent_id(self, obj: Any):
        if isinstance(obj, torch.storage.TypedStorage):
            with warnings.catch_warnings():           # TypedStorage's deprecation notice
                warnings.simplefilter("ignore", UserWarning)
                untyped, dtype = obj.untyped(), obj.dtype
        elif isinstance(obj, torch.UntypedStorage):
            untyped, dtype = obj, None
        else:
            return None
        if untyped.device.type != "cpu" or untyped.nbytes() < self.min_bytes:
            return None
        key = untyped.data_ptr()
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self.storages)
            self.storages.append(untyped)
        return (_PERSISTENT_TAG, index, dtype)


def _aligned(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def dumps_shared(obj: Any, min_bytes: int = SHARE_MIN_BYTES) -> tuple[bytes, int | None, SharedStorages | None]:
    """:func:`dumps` ``obj``, its CPU storages of at least ``min_bytes`` copied into shared memory.

    Returns ``(blob, fd, shared)``: ``fd`` is the shared-memory file's descriptor (the caller
    sends it with the blob and then closes it) and ``shared`` its layout, or ``(blob, None,
    None)`` when no storage was large enough (or the platform has no ``memfd_create``).
    """
    buffer = io.BytesIO()
    if not hasattr(os, "memfd_create"):
        _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
        return buffer.getvalue(), None, None
    pickler = _SharingPickler(buffer, min_bytes)
    pickler.dump(obj)
    blob = buffer.getvalue()
    if not pickler.storages:
        return blob, None, None
    layout, size = [], 0
    for storage in pickler.storages:
        layout.append((size, storage.nbytes()))
        size += _aligned(storage.nbytes())
    fd = os.memfd_create("simcomm-result", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, flags=_MAP_FLAGS) as mapping:
            target = torch.frombuffer(mapping, dtype=torch.uint8)    # (size,) over the mapped pages
            for storage, (offset, nbytes) in zip(pickler.storages, layout):
                source = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (nbytes,), (1,))
                target[offset:offset + nbytes].copy_(source)
            del target, source                                       # before the mapping closes
    except BaseException:
        os.close(fd)
        raise
    return blob, fd, SharedStorages(size, tuple(layout))


class _SharedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, mapping: mmap.mmap, shared: SharedStorages):
        super().__init__(file)
        self.mapping, self.shared = mapping, shared
        self._storages: dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid: Any):
        if not (isinstance(pid, tuple) and len(pid) == 3 and pid[0] == _PERSISTENT_TAG):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        _, index, dtype = pid
        untyped = self._storages.get(index)
        if untyped is None:
            offset, nbytes = self.shared.layout[index]
            # a storage of exactly nbytes over the mapped pages; it holds the mapping alive
            view = torch.frombuffer(self.mapping, dtype=torch.uint8, count=nbytes, offset=offset)
            untyped = self._storages[index] = view.untyped_storage()
        if dtype is None:
            return untyped
        return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def map_shared(fd: int, shared: SharedStorages) -> mmap.mmap:
    """Map the shared-memory file ``fd`` (which the caller may close afterwards)."""
    return mmap.mmap(fd, shared.size, flags=_MAP_FLAGS)


def loads_shared(blob: bytes, mapping: mmap.mmap | None, shared: SharedStorages | None) -> Any:
    """The object :func:`dumps_shared` made ``blob`` of; ``mapping`` is :func:`map_shared` of its file."""
    if shared is None:
        return loads(blob)
    if mapping is None:
        raise ValueError("loads_shared: the blob refers to shared storages but no mapping was given")
    return _SharedUnpickler(io.BytesIO(blob), mapping, shared).load()
