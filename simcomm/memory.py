"""Memory per rank: the bytes of tensor storage each rank holds, by label, with the peak.

A rank's memory is the storage of every live tensor *created on that rank*:
by its program, by autograd running its backward, or handed to it by a
collective (the output of an all-gather belongs to the rank that receives it,
not to the thread that computed it). Each storage is counted once, at its size
in bytes, however many tensors view it, and stops counting when it is freed.

>>> world = simcomm.World(4, memory=True)
>>> world.run(program)
>>> world.memory.peak                      # highest live bytes of each rank
>>> world.memory.at("after step 1")        # one Snapshot per rank: bytes by label at that mark

Inside a program, label what is created and mark points of interest:

>>> with memory.label("optimizer_state"):
...     m = torch.zeros_like(p)             # counted as optimizer_state
>>> memory.tag(p.grad, "gradients")        # relabel a tensor that exists already
>>> memory.mark("after step 1")            # snapshot: live bytes per label, peak since the last mark

Outside a tracked run these three calls do nothing, so a program may always call them.

**How.** :func:`track` pushes a ``TorchDispatchMode`` on the rank's thread (mode
stacks are thread-local, and autograd runs a CPU backward on the calling
thread with the caller's modes). Every aten op whose result does not alias its
inputs made new storage: it is registered to the rank with the label active on
the rank, and a weak reference to the storage subtracts it again when the
storage is freed. Ops that write their output (``resize_``, ``out=``) update
the size of a storage already counted. Storage made outside the dispatcher is
not seen: tensors from unpickling (a real worker's arguments) and a program's
arguments on both backends; :func:`tag` counts such a tensor explicitly.
(``torch.from_numpy`` goes through the dispatcher's ``lift_fresh`` like
``torch.tensor(data)`` and is counted.) Sparse tensors are not counted; meta tensors hold no bytes; fake tensors
(shape-only ranks, :mod:`simcomm.sim.shape`) count the bytes their storage would hold;
a tensor subclass that wraps tensors (DTensor) counts the tensors it wraps. Resizing a storage object directly
(``t.untyped_storage().resize_(0)``, FSDP2's way to free and re-allocate unsharded
parameters) bypasses the dispatcher; while any rank of the process is tracked,
``torch.UntypedStorage.resize_`` is routed through a wrapper that makes the count
follow the storage's new size (torch's own method is back once no rank is tracked).

The simulator's transport calls :func:`untracked` around the collective math it
runs for the whole group and :func:`received` on each rank's output, so the
output is counted once, on the rank that gets it, under that rank's active
label (``"communication"`` when none is active); a received message (``recv``,
or an ``irecv`` once waited on) counts on the receiver. An async call's copy of
its input (an ``isend``'s message, an ``async_op=True`` collective's input)
counts on the caller from the call until its handle's ``wait()``, as a real
backend's ``Work`` holds what it sends until then; its output from the wait.
Real workers count the same (:mod:`real.transport`, :mod:`real.checked`).

Cost: every aten op on a tracked rank goes through one Python call, so
tracking is off unless asked for (``World(n, memory=True)``);
``benchmarks/memory_overhead.py`` measures the slowdown.
"""
from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
)

__all__ = [
    "LABELS", "DEFAULT_LABEL", "COMMUNICATION",
    "label", "communicating", "tag", "mark", "track", "received", "untracked", "any_tracked", "current_bytes",
    "device_peak_bytes", "reset_device_peak", "live_by_label", "capacity", "set_capacity",
    "run_tracked",
    "Snapshot", "RankMemory", "MemoryReport",
]

#: the labels lessons use, in the order figures stack them (any other string is allowed too)
LABELS = ("parameters", "gradients", "optimizer_state", "activations", "communication", "inputs", "other")
#: what storage made with no label active is counted as
DEFAULT_LABEL = "other"
#: what a collective's output is counted as when the receiving rank has no label active
COMMUNICATION = "communication"

class _Local(threading.local):
    tracker: _Tracker | None = None   # the rank tracked on this thread (a class default: no exception to read it)


_local = _Local()
_lock = threading.RLock()        # guards _storages and the trackers' counters (frees may run on any thread)
_storages: dict[int, _StorageRef] = {}   # id(untyped storage) -> its record, while it lives
_active = 0                      # how many ranks are tracked now, in this process


def _import_lazy_torch_modules() -> None:
    """Import what torch imports on first use, before a tracked program runs.

    Many torch functions (``torch.Generator.manual_seed``, optimizers' ``step``, checkpointing)
    import ``torch._dynamo`` on their first call. That import leaves a reference cycle holding
    the calling frames, and with them the program's locals, until Python's collector happens
    to run. A process that has not made the import yet (a fresh real worker) would count those
    tensors alive at marks and at the end where a process that made it (the notebook running a
    World) frees them at once; the collector runs at different moments in one process of N
    threads and in N processes. Made here, the import costs about 1.5 s once per process."""
    if "torch._dynamo" not in sys.modules:
        import torch._dynamo  # noqa: F401


# -- one rank's counters -----------------------------------------------------------------------

class _Tracker:
    """Live bytes of one rank by label, the peak, the marks."""

    def __init__(self, rank: int):
        self.rank = rank
        self.labels: list[str | None] = [None]     # label stack; None: no label active
        self.paused = 0
        self.live: dict[str, int] = {}
        self.current = 0
        self.peak = 0
        self.peak_live: dict[str, int] = {}
        self.window_peak = 0                        # peak since the last mark
        self.marks: list[Snapshot] = []
        self.device_peak = 0                        # peak since reset_device_peak (torch.cuda's statistic)
        #: bytes the rank's device holds (a virtual GPU's); None: no limit
        self.capacity: int | None = None
        #: what an allocation past ``capacity`` raises: ``over_capacity(tracker, requested_bytes)``
        self.over_capacity: Callable[[_Tracker, int], BaseException] | None = None

    def add(self, label: str, nbytes: int) -> None:
        live = self.live
        live[label] = live.get(label, 0) + nbytes
        self.current += nbytes
        if self.current > self.device_peak:
            self.device_peak = self.current
        if self.current > self.window_peak:
            self.window_peak = self.current
            if self.current > self.peak:
                self.peak = self.current
                self.peak_live = dict(live)

    def sub(self, label: str, nbytes: int) -> None:
        self.live[label] -= nbytes
        self.current -= nbytes

    def snapshot(self, name: str) -> Snapshot:
        snap = Snapshot(name, {k: v for k, v in self.live.items() if v}, self.current, self.window_peak)
        self.window_peak = self.current
        return snap


class _StorageRef(weakref.ref):
    """A weak reference to one counted storage, with what it is counted as."""

    __slots__ = ("key", "tracker", "label", "nbytes")


def _on_free(ref: _StorageRef) -> None:
    with _lock:
        if _storages.get(ref.key) is ref:
            del _storages[ref.key]
            ref.tracker.sub(ref.label, ref.nbytes)


def _register(storage: torch.UntypedStorage, tracker: _Tracker, label: str) -> None:
    ref = _StorageRef(storage, _on_free)
    ref.key, ref.tracker, ref.label, ref.nbytes = id(storage), tracker, label, storage.nbytes()
    with _lock:
        _storages[ref.key] = ref
        tracker.add(label, ref.nbytes)


def _claim(storage: torch.UntypedStorage, tracker: _Tracker, label: str) -> None:
    """Count ``storage`` on ``tracker`` under ``label``, moving it from wherever it was counted."""
    with _lock:
        ref = _storages.get(id(storage))
        if ref is None:
            _register(storage, tracker, label)
        elif ref.tracker is not tracker or ref.label != label:
            ref.tracker.sub(ref.label, ref.nbytes)
            ref.tracker, ref.label = tracker, label
            tracker.add(label, ref.nbytes)


# -- the dispatch mode -------------------------------------------------------------------------

_FRESH, _VIEW, _WRITES = 0, 1, 2
_KINDS: dict[Any, int] = {}                 # aten overload -> how its results relate to its inputs
_LIFT = {torch.ops.aten.lift_fresh.default}  # torch.tensor(data): storage made before the dispatcher
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _kind(func) -> int:
    kind = _KINDS.get(func)
    if kind is None:
        infos = [ret.alias_info for ret in func._schema.returns]
        if all(info is None for info in infos):
            kind = _FRESH
        elif any(info is not None and info.is_write for info in infos):
            kind = _WRITES
        else:
            kind = _VIEW
        _KINDS[func] = kind
    return kind


def _see(tracker: _Tracker, tensor: torch.Tensor, kind: int, func) -> None:
    if type(tensor) not in _PLAIN:
        if is_traceable_wrapper_subclass(tensor):        # e.g. DTensor: count the tensors it wraps
            for name in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):          # FSDP2's flattened attributes include a DeviceMesh
                    _see(tracker, inner, kind, func)
            return
    if tensor.layout != torch.strided or tensor.device.type == "meta":   # sparse: not counted; meta: no bytes
        return
    storage = tensor.untyped_storage()
    ref = _storages.get(id(storage))
    if ref is None:
        if kind == _FRESH or func in _LIFT:
            _register(storage, tracker, tracker.labels[-1] or DEFAULT_LABEL)
    elif kind == _WRITES and ref.nbytes != storage.nbytes():
        with _lock:                           # resize_ / out= grew or shrank a counted storage
            ref.tracker.sub(ref.label, ref.nbytes)
            ref.nbytes = storage.nbytes()
            ref.tracker.add(ref.label, ref.nbytes)


_RESIZE_STORAGE = torch.UntypedStorage.resize_      # the C method; see _install_storage_resize


def _resize_storage(storage: torch.UntypedStorage, size: int) -> Any:
    """``UntypedStorage.resize_`` while some rank is tracked: the same call, then the counted
    size follows the storage (FSDP2 frees and re-allocates unsharded parameters this way,
    outside the dispatcher)."""
    result = _RESIZE_STORAGE(storage, size)
    tracker = _tracker()
    before = tracker.current if tracker is not None else 0
    _storage_resized(storage)
    if (tracker is not None and tracker.capacity is not None and tracker.current > tracker.capacity
            and tracker.current > before and not tracker.paused):
        raise _over_capacity(tracker, tracker.current - before)
    return result


def _storage_resized(storage: torch.UntypedStorage) -> None:
    ref = _storages.get(id(storage))
    if ref is None:
        tracker = _tracker()
        if tracker is not None and not tracker.paused and storage.nbytes() and storage.device.type != "meta":
            _register(storage, tracker, tracker.labels[-1] or DEFAULT_LABEL)   # grown from nothing here
        return
    with _lock:
        nbytes = storage.nbytes()
        if ref.nbytes != nbytes:
            ref.tracker.sub(ref.label, ref.nbytes)
            ref.nbytes = nbytes
            ref.tracker.add(ref.label, nbytes)


def _install_storage_resize(on: bool) -> None:
    """Route ``UntypedStorage.resize_`` through :func:`_resize_storage` while any rank of this
    process is tracked (``on``), and back to torch's own method when none is; under ``_lock``
    (simcomm.patches: "storage-resize")."""
    if on:
        torch.UntypedStorage.resize_ = _resize_storage
    elif torch.UntypedStorage.__dict__.get("resize_") is _resize_storage:
        del torch.UntypedStorage.resize_


class _TrackingMode(TorchDispatchMode):
    """Counts the storage every op on this rank creates (see the module docstring)."""

    def __init__(self, tracker: _Tracker):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tracker = self.tracker
        if tracker.paused:
            return out
        kind = _kind(func)
        before = tracker.current
        if isinstance(out, torch.Tensor):
            _see(tracker, out, kind, func)
        elif isinstance(out, (tuple, list)):
            for item in out:
                if isinstance(item, torch.Tensor):
                    _see(tracker, item, kind, func)
        if tracker.capacity is not None and tracker.current > tracker.capacity and tracker.current > before:
            error = _over_capacity(tracker, tracker.current - before)
            out = item = None     # noqa: F841 - the output is dropped (its bytes stop counting), as if never made
            raise error
        return out


def _over_capacity(tracker: _Tracker, requested: int) -> BaseException:
    """What an allocation of ``requested`` bytes that took ``tracker`` past its capacity raises."""
    if tracker.over_capacity is not None:
        return tracker.over_capacity(tracker, requested)
    return torch.OutOfMemoryError(
        f"out of memory: rank {tracker.rank} tried to allocate {requested} bytes, holding {tracker.current} "
        f"of its capacity of {tracker.capacity} bytes")


# -- what programs call ------------------------------------------------------------------------

def _tracker() -> _Tracker | None:
    """The tracker of the rank running here: this thread's, else the one whose mode is active
    (autograd's device threads inherit the rank's dispatch modes, not its Python thread-locals)."""
    tracker = _local.tracker
    if tracker is None and _active:
        for mode in reversed(_get_current_dispatch_mode_stack()):
            if isinstance(mode, _TrackingMode):
                return mode.tracker
    return tracker


@contextlib.contextmanager
def label(name: str) -> Iterator[None]:
    """Count storage created inside the block (on this rank) as ``name``.

    Labels nest; the innermost wins. Collective outputs received inside the
    block count as ``name`` too. Does nothing on a rank that is not tracked.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"memory.label: name={name!r} must be a non-empty string")
    tracker = _tracker()
    if tracker is None:
        yield
        return
    tracker.labels.append(name)
    try:
        yield
    finally:
        tracker.labels.pop()


@contextlib.contextmanager
def communicating() -> Iterator[None]:
    """Around a transport call that allocates its output on the calling rank (a real worker's
    transport): storage created inside with no label active counts as :data:`COMMUNICATION`, the
    label the simulator gives a collective's output (:func:`received`), from the moment it is made;
    an active label stays in force. Does nothing on a rank that is not tracked."""
    tracker = _tracker()
    if tracker is None or tracker.labels[-1] is not None:
        yield
        return
    tracker.labels.append(COMMUNICATION)
    try:
        yield
    finally:
        tracker.labels.pop()


def tag(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Count ``tensor``'s storage as ``name`` on this rank from now on; return ``tensor``.

    The tensor is not modified. Storage not yet counted (a program argument)
    starts counting here. Raises ``ValueError`` when another rank holds the
    storage. Does nothing on a rank that is not tracked.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"memory.tag: tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"memory.tag: name={name!r} must be a non-empty string")
    tracker = _tracker()
    if tracker is None:
        return tensor
    storage = tensor.untyped_storage()
    ref = _storages.get(id(storage))
    if ref is not None and ref.tracker is not tracker:
        raise ValueError(f"memory.tag: rank {tracker.rank} tags a tensor {tuple(tensor.shape)} as {name!r}, "
                         f"but its storage is held by rank {ref.tracker.rank}")
    _claim(storage, tracker, name)
    return tensor


def mark(name: str) -> None:
    """Record this rank's live bytes by label now, and its peak since the previous mark.

    Does nothing on a rank that is not tracked.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"memory.mark: name={name!r} must be a non-empty string")
    tracker = _tracker()
    if tracker is not None:
        with _lock:
            tracker.marks.append(tracker.snapshot(name))


def current_bytes() -> int | None:
    """This rank's live bytes now (``None`` when the rank is not tracked)."""
    tracker = _tracker()
    return None if tracker is None else tracker.current


def device_peak_bytes() -> int | None:
    """This rank's highest live bytes since the last :func:`reset_device_peak` (or its start):
    what ``torch.cuda.max_memory_allocated`` answers on a virtual GPU. ``None`` when untracked."""
    tracker = _tracker()
    return None if tracker is None else tracker.device_peak


def reset_device_peak() -> None:
    """Start :func:`device_peak_bytes` again from the live bytes now (``torch.cuda.reset_peak_memory_stats``)."""
    tracker = _tracker()
    if tracker is not None:
        tracker.device_peak = tracker.current


def live_by_label() -> dict[str, int]:
    """This rank's live bytes by label now (empty when the rank is not tracked)."""
    tracker = _tracker()
    return {} if tracker is None else {k: v for k, v in tracker.live.items() if v}


def capacity() -> int | None:
    """The capacity in bytes this rank was tracked with (:func:`track`), ``None`` when none."""
    tracker = _tracker()
    return None if tracker is None else tracker.capacity


def set_capacity(nbytes: int | None) -> None:
    """Change this rank's capacity (``torch.cuda.set_per_process_memory_fraction`` on a virtual
    GPU); nothing on a rank that is not tracked."""
    tracker = _tracker()
    if tracker is not None:
        tracker.capacity = nbytes


# -- what transports call ----------------------------------------------------------------------

class _Paused:
    __slots__ = ("tracker",)

    def __init__(self, tracker: _Tracker):
        self.tracker = tracker

    def __enter__(self) -> None:
        self.tracker.paused += 1

    def __exit__(self, *exc_info) -> None:
        self.tracker.paused -= 1


_NOTHING = contextlib.nullcontext()


def untracked() -> contextlib.AbstractContextManager:
    """Storage created on this thread inside ``with untracked():`` is not counted on this rank.

    The simulator runs a collective's math for the whole group on one rank's
    thread inside this block; :func:`received` then counts each output on
    the rank that gets it. Costs one thread-local lookup when nothing is tracked.
    """
    tracker = _local.tracker if not _active else _tracker()   # nothing tracked: one lookup
    return _NOTHING if tracker is None else _Paused(tracker)


def any_tracked() -> bool:
    """Whether any rank of this process is tracked now (a transport then gives each receiver a
    storage of its own, which counts on it alone)."""
    return _active > 0


def received(output: Any) -> Any:
    """Count a communication output on the rank calling this; return the tensor to hand it.

    A tensor whose storage is exactly its own is counted here (moved from
    another rank if it was counted there: a message in flight); a tensor that
    views part of a larger storage (a chunk of a reduction every rank shares)
    is replaced by a private copy, so each rank holds and is counted for its
    own bytes only. The label is the rank's active label, else
    ``"communication"``. Anything that is not a tensor, or a rank that is not
    tracked, passes through unchanged.
    """
    tracker = _local.tracker if not _active else _tracker()   # nothing tracked: one lookup
    if tracker is None or not isinstance(output, torch.Tensor):
        return output
    storage = output.untyped_storage()
    if output.storage_offset() != 0 or storage.nbytes() != output.numel() * output.element_size():
        output = output.clone()
        storage = output.untyped_storage()
    _claim(storage, tracker, tracker.labels[-1] or COMMUNICATION)
    return output


# -- tracking a rank ---------------------------------------------------------------------------

@contextlib.contextmanager
def track(rank: int, reports: list | None, device: torch.device | str | None = None, *,
          capacity: int | None = None,
          over_capacity: Callable[[_Tracker, int], BaseException] | None = None) -> Iterator[None]:
    """Track the memory of ``rank`` on this thread inside the block; on exit put its
    :class:`RankMemory` in ``reports[rank]``.

    ``reports=None`` tracks nothing (costs nothing). On a CUDA ``device`` the
    report also holds ``torch.cuda.max_memory_allocated`` for the block (the
    allocator's statistic covers the whole process: on a real worker that is one
    rank; a ``World``'s ranks share the process, so it passes no device).
    Storage still alive at exit stops being counted anywhere.

    ``capacity``: the bytes the rank's device holds (a virtual GPU's,
    :mod:`simcomm.sim.cuda_map`): an op whose new storage takes the rank past it raises
    ``over_capacity(tracker, requested_bytes)`` (default ``torch.OutOfMemoryError``) after it ran,
    and its output is dropped, as an allocation a GPU cannot serve fails.
    """
    if reports is None:
        yield
        return
    _import_lazy_torch_modules()
    device = torch.device(device) if device is not None else None
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    tracker = _Tracker(rank)
    tracker.capacity, tracker.over_capacity = capacity, over_capacity
    previous = _local.tracker
    _local.tracker = tracker
    global _active
    with _lock:
        _active += 1
        if _active == 1:
            _install_storage_resize(True)
    try:
        with _TrackingMode(tracker):
            yield
    finally:
        _local.tracker = previous
        with _lock:
            _active -= 1
            if _active == 0:
                _install_storage_resize(False)
        with _lock:
            for key in [key for key, ref in _storages.items() if ref.tracker is tracker]:
                del _storages[key]
            reports[rank] = RankMemory(
                rank=rank, peak=tracker.peak, peak_bytes=dict(tracker.peak_live), current=tracker.current,
                current_bytes={k: v for k, v in tracker.live.items() if v}, marks=tuple(tracker.marks),
                device_peak=torch.cuda.max_memory_allocated(device) if cuda else None)


def run_tracked(rank: int, program: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, *,
                device: torch.device | str | None = None) -> tuple[Any, dict]:
    """``program(*args, **kwargs)`` with this thread tracked as ``rank``: ``(result, report)``.

    ``report`` is :meth:`RankMemory.to_dict` (plain, picklable data); a real
    worker sends it to the parent, which rebuilds the run's report with
    :meth:`MemoryReport.from_dicts`. On a CUDA ``device`` it includes
    ``torch.cuda.max_memory_allocated``. Exceptions of ``program`` propagate.
    """
    reports: list = [None] * (rank + 1)
    with track(rank, reports, device):
        result = program(*args, **(kwargs or {}))
    return result, reports[rank].to_dict()


# -- reports -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Snapshot:
    """One rank at one mark: live bytes by label, their total, the peak since the previous mark."""

    name: str
    bytes: dict[str, int]
    total: int
    peak: int

    def __getitem__(self, label: str) -> int:
        """Live bytes under ``label`` (0 when none)."""
        return self.bytes.get(label, 0)


@dataclass(frozen=True)
class RankMemory:
    """What one rank held during a run (bytes)."""

    rank: int
    peak: int                         # highest live total
    peak_bytes: dict[str, int]        # by label, at the moment of the peak
    current: int                      # live at the end of the program
    current_bytes: dict[str, int]
    marks: tuple[Snapshot, ...] = ()
    device_peak: int | None = None    # torch.cuda.max_memory_allocated on a CUDA device, else None

    def at(self, mark: str) -> Snapshot:
        """The snapshot named ``mark`` (the first of that name); ``"peak"`` and ``"end"``
        give the peak and the end of the program when no mark has those names."""
        for snap in self.marks:
            if snap.name == mark:
                return snap
        if mark == "peak":
            return Snapshot("peak", dict(self.peak_bytes), self.peak, self.peak)
        if mark == "end":
            return Snapshot("end", dict(self.current_bytes), self.current, self.peak)
        raise KeyError(f"memory: rank {self.rank} has no mark {mark!r}; "
                       f"its marks are {[s.name for s in self.marks]} (and 'peak', 'end')")

    def to_dict(self) -> dict:
        """Plain data (ints, strings, dicts, lists) for pickling between processes."""
        return {"rank": self.rank, "peak": self.peak, "peak_bytes": dict(self.peak_bytes),
                "current": self.current, "current_bytes": dict(self.current_bytes),
                "marks": [[s.name, dict(s.bytes), s.total, s.peak] for s in self.marks],
                "device_peak": self.device_peak}

    @classmethod
    def from_dict(cls, data: dict) -> RankMemory:
        return cls(rank=data["rank"], peak=data["peak"], peak_bytes=dict(data["peak_bytes"]),
                   current=data["current"], current_bytes=dict(data["current_bytes"]),
                   marks=tuple(Snapshot(name, dict(by), total, peak) for name, by, total, peak in data["marks"]),
                   device_peak=data.get("device_peak"))


@dataclass
class MemoryReport:
    """Every rank's :class:`RankMemory` of one run, in rank order."""

    ranks: list[RankMemory] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, rank: int) -> RankMemory:
        return self.ranks[rank]

    @property
    def peak(self) -> list[int]:
        """Each rank's highest live bytes."""
        return [r.peak for r in self.ranks]

    @property
    def current(self) -> list[int]:
        """Each rank's live bytes when its program returned."""
        return [r.current for r in self.ranks]

    @property
    def device_peak(self) -> list[int | None]:
        """Each rank's ``torch.cuda.max_memory_allocated`` (``None`` off CUDA)."""
        return [r.device_peak for r in self.ranks]

    @property
    def marks(self) -> list[str]:
        """The mark names, in the order ranks made them (first appearance on any rank)."""
        names: dict[str, None] = {}
        for r in self.ranks:
            names.update((s.name, None) for s in r.marks)
        return list(names)

    @property
    def labels(self) -> list[str]:
        """Every label any rank counted bytes under: :data:`LABELS` order first, then the rest."""
        seen: dict[str, None] = {}
        for r in self.ranks:
            for by in (r.peak_bytes, r.current_bytes, *(s.bytes for s in r.marks)):
                seen.update((name, None) for name in by)
        return [name for name in LABELS if name in seen] + [name for name in seen if name not in LABELS]

    def at(self, mark: str) -> list[Snapshot]:
        """One :class:`Snapshot` per rank at ``mark`` (see :meth:`RankMemory.at`)."""
        return [r.at(mark) for r in self.ranks]

    def to_dicts(self) -> list[dict]:
        return [r.to_dict() for r in self.ranks]

    @classmethod
    def from_dicts(cls, data: list[dict]) -> MemoryReport:
        """Rebuild a report from the :meth:`RankMemory.to_dict` of each rank (any order)."""
        return cls(sorted((RankMemory.from_dict(d) for d in data), key=lambda r: r.rank))

    def table(self, mark: str) -> str:
        """A plain-text table: one row per rank, bytes per label at ``mark``, and the peak."""
        snaps = self.at(mark)
        labels = self.labels
        head = ["rank", *labels, "total", "peak"]
        rows = [[str(r.rank), *(str(s[name]) for name in labels), str(s.total), str(r.peak)]
                for r, s in zip(self.ranks, snaps)]
        widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
        return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [head, *rows])
