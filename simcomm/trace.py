"""What every transport call did: one :class:`TraceEvent` per rank per call.

An event records the op, the group (global ranks), the rank, the step (the
call's position in the group's sequence of collectives, equal on every
member), the phase (``forward`` or ``backward``: the autograd rules mark their
backward calls), shapes, dtype, the bytes sent to and received from each peer,
and times. A blocking call has ``start`` (called) and ``end`` (returned); an
asynchronous one (``async_op=True``, ``isend``/``irecv``) has ``start`` (issued),
``end`` (its data moved) and ``waited`` (the program's ``wait()`` returned).
:meth:`Trace.to_chrome_trace` writes the JSON that Perfetto and
``chrome://tracing`` open.

Transports record through one :class:`Recorder` per run (simulator) or per
process (real), shared by all their groups; it builds a :class:`Record` per
call on the hot path, and :class:`Trace` turns records into events on first use.

Bytes per peer follow each op's *definition* as a direct exchange, not a
particular algorithm (ring, tree); each op's row of :data:`simcomm.specs.SPECS`
holds its rule (:meth:`~simcomm.specs.CollectiveSpec.peer_bytes`; the table is
in :mod:`simcomm.specs`), which the cost model reads too.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from .collector import FullCollectionsDeferred
from .specs import SPECS

_perf_counter = time.perf_counter

__all__ = ["TraceEvent", "Trace", "Record", "Recorder", "backward_phase", "current_phase", "issued_as", "peer_bytes"]

class _Local(threading.local):
    """Per thread: the phase of the transport calls made now, and ``issued`` (see :func:`issued_as`).
    Class-level defaults: reading an attribute a thread never set costs no exception."""

    phase = "forward"
    issued: tuple[str, float] | None = None


_local = _Local()


def current_phase() -> str:
    """``"backward"`` inside an autograd rule's backward on this thread, else ``"forward"``."""
    return _local.phase


@contextlib.contextmanager
def backward_phase() -> Iterator[None]:
    """Mark the transport calls made inside this block as backward-phase calls."""
    previous = _local.phase
    _local.phase = "backward"
    try:
        yield
    finally:
        _local.phase = previous


@contextlib.contextmanager
def issued_as(phase: str, at: float) -> Iterator[None]:
    """Record the transport calls made inside this block as issued at ``at`` (a
    ``time.perf_counter()`` value) in ``phase``: for a call another thread makes on behalf of
    the program, after checking it (real's checked asynchronous calls), so its record keeps the
    time and phase at which the program issued it."""
    previous = _local.issued
    _local.issued = (phase, at)
    try:
        yield
    finally:
        _local.issued = previous


def peer_bytes(op: str, nbytes: int, ranks: tuple[int, ...], rank: int, root: int | None = None,
               *, args: dict | None = None, out_nbytes: int | None = None, row_bytes: int | None = None
               ) -> tuple[dict[int, int], dict[int, int]]:
    """Bytes ``rank`` sends to and receives from each peer (global ranks) in one call.

    ``nbytes`` is the size of the rank's input (for ``recv``: of the received
    tensor); ``root`` is the global rank of the source/destination where the op
    has one, and the peer for ``send``/``recv``. ``out_nbytes`` is the size of
    the rank's output (``scatter``: what a non-source rank receives);
    ``args`` the call's arguments and ``row_bytes`` the bytes of one dim-0 row
    (the uneven all-to-all: bytes per peer from the split sizes).
    """
    spec = SPECS.get(op)
    if spec is None:
        return {}, {}
    return spec.peer_bytes(nbytes, ranks, rank, root, args=args, out_nbytes=out_nbytes, row_bytes=row_bytes)


def _itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as in :attr:`TraceEvent.dtype` (``"float32"``)."""
    import torch

    return getattr(torch, dtype).itemsize


class Record:
    """What a transport keeps of one call while it runs: raw fields, converted by
    :meth:`TraceEvent.from_record` only when the trace is read.

    ``shape``/``dtype`` are the input's (``torch.Size``/``torch.dtype`` or ``None``),
    ``nbytes`` ``None`` means ``numel * itemsize`` of the input, ``root`` is a global
    rank, ``args`` the call's arguments, a dict or a tuple of ``(name, value)`` pairs.
    A finished call's record is kept as :meth:`kept`'s tuple.
    """

    __slots__ = ("op", "group", "rank", "step", "phase", "shape", "dtype", "nbytes", "start",
                 "root", "args", "end", "out_shape", "async_op", "waited")

    def __init__(self, op: str, group: tuple[int, ...], rank: int, step: int, phase: str,
                 shape, dtype, nbytes: int | None, start: float, root: int | None, args: dict | tuple | None,
                 async_op: bool = False):
        self.op = op
        self.group = group
        self.rank = rank
        self.step = step
        self.phase = phase
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes
        self.start = start
        self.root = root
        self.args = args
        self.async_op = async_op
        self.end = 0.0
        self.out_shape = None
        self.waited: float | None = None

    def kept(self) -> tuple:
        """The record as the trace keeps it once the call is done: a tuple of the fields in
        ``__slots__`` order, shapes as plain tuples. The garbage collector stops tracking a
        tuple of plain values, so a trace of many calls costs no collections of the whole heap
        (a ``Record`` per call kept alive would trigger them: about 8 us per call with torch
        loaded). ``(name, value)`` pairs of ``args`` are kept flat, ``(name, value, name, ...)``:
        the collector untracks a tuple only once the tuples in it are untracked, one level per
        collection, and a record nested three deep would reach the oldest generation first. A
        dict ``args`` is kept as the same dict (a transport may still fill it in)."""
        shape, out_shape, args = self.shape, self.out_shape, self.args
        if type(args) is tuple and args:    # a new flat tuple (one pair's own object may be older)
            args = (*args[0],) if len(args) == 1 else sum(args, ())
        return (self.op, self.group, self.rank, self.step, self.phase,
                None if shape is None else tuple(shape), self.dtype, self.nbytes, self.start, self.root,
                args, self.end, None if out_shape is None else tuple(out_shape), self.async_op,
                self.waited)

    def __getstate__(self):
        return tuple(getattr(self, name) for name in self.__slots__)

    def __setstate__(self, state) -> None:
        for name, value in zip(self.__slots__, state):
            setattr(self, name, value)


def _output_shape(out) -> tuple | None:
    """The shape a trace records for a call's output: a tensor's, the first entry's for a
    ``(tensor, flag)`` pair (a transport's scatter), ``None`` for anything else."""
    if isinstance(out, tuple) and out:
        out = out[0]
    return getattr(out, "shape", None)


class Recorder:
    """Builds the trace records of one run (simulator) or one process (real).

    Shared by every transport of the run, subgroups included, on both backends.
    ``events`` is the list finished records are kept in (:meth:`Record.kept` tuples, in completion order); times are
    seconds since ``clock_zero`` (a ``time.perf_counter()`` value).

    A blocking call: :meth:`begin`, then :meth:`end` when it returns. An
    asynchronous call: :meth:`begin` when issued, :meth:`moved` when its data
    moved, :meth:`waited` when the program's wait returned (the record is kept then).
    """

    __slots__ = ("events", "clock_zero")

    def __init__(self, events: list | None = None, clock_zero: float | None = None):
        self.events: list = [] if events is None else events
        self.clock_zero = time.perf_counter() if clock_zero is None else clock_zero

    def now(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.clock_zero

    def begin(self, op: str, group: tuple[int, ...], rank: int, step: int, tensor, root: int | None,
              nbytes: int | None, args: dict | tuple | None, async_op: bool = False) -> Record:
        """A new record of a call starting (or issued) now; ``root`` is a global rank."""
        local = _local
        issued = local.issued
        if issued is None:
            phase, start = local.phase, _perf_counter() - self.clock_zero
        else:
            phase, start = issued[0], issued[1] - self.clock_zero
        if tensor is None:
            return Record(op, group, rank, step, phase, None, None, nbytes, start, root, args, async_op)
        return Record(op, group, rank, step, phase, tensor.shape, tensor.dtype, nbytes, start, root, args,
                      async_op)

    def end(self, record: Record, out) -> None:
        """A blocking call returned with ``out`` (see ``_output_shape``): keep its record."""
        record.end = _perf_counter() - self.clock_zero
        record.out_shape = _output_shape(out)
        self.events.append(record.kept())

    def moved(self, record: Record, out, at: float | None = None) -> None:
        """An asynchronous call's data moved (now, or at ``at`` seconds since the start)."""
        record.end = self.now() if at is None else at
        record.out_shape = _output_shape(out)

    def waited(self, record: Record) -> None:
        """The program's wait on an asynchronous call returned: keep its record."""
        record.waited = max(self.now(), record.end)
        self.events.append(record.kept())


@dataclass
class TraceEvent:
    """One transport call on one rank. Times are seconds since the run started."""

    op: str
    group: tuple[int, ...]
    rank: int
    step: int
    phase: str
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int
    start: float
    end: float = 0.0
    out_shape: tuple[int, ...] | None = None
    root: int | None = None
    args: dict = field(default_factory=dict)
    #: modelled duration on a topology, filled by :func:`simcomm.model.cost.annotate` (seconds)
    modelled: float | None = None
    #: issued with ``async_op=True`` (or ``isend``/``irecv``): ``start`` is when it was issued,
    #: ``end`` when its data moved
    async_op: bool = False
    #: when the program's ``wait()`` on the call's handle returned; ``None`` for a blocking call
    waited: float | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @classmethod
    def from_record(cls, record: Record | tuple) -> TraceEvent:
        """Build an event from the :class:`Record` a transport kept on its hot path (or the
        tuple :meth:`Record.kept` made of it, read as it is: a trace's events are built from
        one such tuple each)."""
        kept = type(record) is tuple
        (op, group, rank, step, phase, shape, dtype, nbytes, start, root, args, end, out_shape, async_op,
         waited) = record if kept else record.__getstate__()
        if not args:
            args = {}
        elif type(args) is tuple:       # kept: (name, value, name, ...); a Record's: pairs
            args = dict(zip(args[::2], args[1::2])) if kept else dict(args)
        else:
            args = dict(args)
        if nbytes is None:
            nbytes = math.prod(shape) * dtype.itemsize if shape is not None else 0
        return cls(op=op, group=group, rank=rank, step=step, phase=phase,
                   shape=tuple(shape) if shape is not None else None,
                   dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
                   nbytes=nbytes, start=start, end=end,
                   out_shape=tuple(out_shape) if out_shape is not None else None,
                   root=root, args=args, async_op=async_op, waited=waited)

    def _peer_bytes(self) -> tuple[dict[int, int], dict[int, int]]:
        dtype = self.dtype if self.dtype is not None else self.args.get("dtype")   # scatter off src
        itemsize = _itemsize(dtype) if dtype is not None else 0
        out_nbytes = math.prod(self.out_shape) * itemsize if self.out_shape is not None else None
        shape = self.shape if self.shape is not None else self.out_shape
        row_bytes = math.prod(shape[1:]) * itemsize if shape else None
        return peer_bytes(self.op, self.nbytes, self.group, self.rank, self.root, args=self.args,
                          out_nbytes=out_nbytes, row_bytes=row_bytes)

    @property
    def sent(self) -> dict[int, int]:
        """Bytes sent to each peer (global rank)."""
        return self._peer_bytes()[0]

    @property
    def received(self) -> dict[int, int]:
        """Bytes received from each peer (global rank)."""
        return self._peer_bytes()[1]


class Trace:
    """The events of one run, ordered by start time, with summaries and export."""

    def __init__(self, events: list[TraceEvent | Record | tuple] | None = None, backend: str | None = None):
        # transports keep Records (cheap on the hot path); events are built on first use
        self._items = list(events or [])
        #: what recorded it: ``"simcomm"`` (virtual ranks), ``"gloo"``/``"nccl"`` (real processes)
        self.backend = backend
        self._events: list[TraceEvent] | None = None

    @property
    def events(self) -> list[TraceEvent]:
        """The events, ordered by start time (then rank)."""
        if self._events is None:
            with FullCollectionsDeferred():     # every event built stays alive
                events = [item if isinstance(item, TraceEvent) else TraceEvent.from_record(item)
                          for item in self._items]
                self._events = sorted(events, key=lambda e: (e.start, e.rank))
            self._items = []
        return self._events

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events)

    def __repr__(self) -> str:
        counts = Counter(f"{e.op}/{e.phase}" for e in self.events)
        return f"Trace({len(self.events)} events: {dict(counts)})"

    def filter(self, *, op: str | None = None, phase: str | None = None, rank: int | None = None
               ) -> Trace:
        """The events matching every given field."""
        return Trace([e for e in self.events
                      if (op is None or e.op == op) and (phase is None or e.phase == phase)
                      and (rank is None or e.rank == rank)], backend=self.backend)

    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    def ops(self) -> list[tuple[int, str, str]]:
        """The sequence of (step, op, phase) one rank saw: rank 0, or the lowest traced rank."""
        if not self.events:
            return []
        first = self.ranks[0]
        return [(e.step, e.op, e.phase) for e in self.events if e.rank == first]

    def comm_matrix(self, op: str | None = None) -> list[list[int]]:
        """``matrix[i][j]``: bytes rank ``i`` sent to rank ``j``, summed over the trace."""
        size = max((max(e.group) for e in self.events), default=-1) + 1
        matrix = [[0] * size for _ in range(size)]
        for event in self.events:
            if op is not None and event.op != op:
                continue
            for peer, nbytes in event.sent.items():
                matrix[event.rank][peer] += nbytes
        return matrix

    def bytes_by_op(self) -> dict[str, int]:
        """Total bytes sent, per op."""
        totals: Counter[str] = Counter()
        for event in self.events:
            totals[event.op] += sum(event.sent.values())
        return dict(totals)

    def to_chrome_trace(self, path: str | os.PathLike | None = None) -> dict:
        """The trace as Chrome trace JSON (complete ``"X"`` events, one track per rank).

        An asynchronous call is an ``"X"`` event from its issue to when its data
        moved (``args.async_op`` true, ``args.waited_us``), plus an instant event
        ``"wait <op>"`` where the program's ``wait()`` returned.

        Writes it to ``path`` when given; returns the JSON object either way.
        """
        events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "simcomm"}}]
        for rank in self.ranks:
            events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": rank,
                           "args": {"name": f"rank {rank}"}})
        for e in self.events:
            args = {"step": e.step, "group": list(e.group), "shape": e.shape,
                    "out_shape": e.out_shape, "dtype": e.dtype, "bytes": e.nbytes,
                    "sent": {str(k): v for k, v in e.sent.items()},
                    "received": {str(k): v for k, v in e.received.items()},
                    **({"modelled_us": e.modelled * 1e6} if e.modelled is not None else {}),
                    **e.args}
            if e.async_op:
                args["async_op"] = True
                args["waited_us"] = e.waited * 1e6 if e.waited is not None else None
            events.append({
                "name": e.op, "cat": e.phase, "ph": "X", "pid": 0, "tid": e.rank,
                "ts": e.start * 1e6, "dur": max(e.duration, 0.0) * 1e6, "args": args})
            if e.async_op and e.waited is not None:
                # an async call spans issue..data moved; the program's wait() is an instant marker
                events.append({"name": f"wait {e.op}", "cat": e.phase, "ph": "i", "s": "t",
                               "pid": 0, "tid": e.rank, "ts": e.waited * 1e6,
                               "args": {"step": e.step, "issued_us": e.start * 1e6}})
        data = {"traceEvents": events, "displayTimeUnit": "ms"}
        if path is not None:
            with open(path, "w") as f:
                json.dump(data, f)
        return data
