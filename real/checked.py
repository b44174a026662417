"""Checked mode: every rank's call is compared with its peers' before any data moves.

Both the communicator's calls and the program's ``torch.distributed`` calls
are checked: on a real worker c10d's default group is a process group over
this transport (:mod:`real.checked_pg`), so ``dist.*``, DDP, FSDP2, DTensor
and the functional collectives reach the same primitives as ``comm.*``.

On real processes a mismatched collective is silent or slow: gloo returns
wrong data for a MAX on one rank and a SUM on another, a ``recv`` larger than
the ``send`` gets trailing garbage, one of another dtype gets raw bits, and
other mismatches end in a timeout. :class:`CheckedTransport` wraps a transport
(:class:`real.transport.DistTransport`) and, before each primitive runs,
compares what every rank of the group is about to do:

* a collective: its name, the tensor's shape and dtype, its root (``src``/``dst``)
  and reduction, and its other arguments (``dim``, ``groups`` ...); for
  ``all_to_all_single``, that what rank i sends to rank j is what j expects
  from i;
* a point-to-point pair: the shape and dtype of the n-th send from i to j and
  of the n-th recv on j from i.

A disagreement raises :class:`simcomm.CollectiveMismatchError` on every rank
involved, naming the ranks, their calls and their program lines, as the
simulator does; nothing has moved yet, so the process groups stay usable. A
rank waiting for a call that a peer never makes because its program returned
gets :class:`simcomm.DeadlockError` naming both, instead of a timeout; and
each rank notes what it is about to wait for (``w/<rank>``), so the parent
finds ranks that wait on each other (:func:`find_deadlock`) and raises
:class:`simcomm.DeadlockError` too.

How: each rank writes its call (pickled, with its program line) under a key
of a ``torch.distributed`` store and reads its peers' keys (a set and a
multi-get: about 0.1-0.2 ms on loopback, cheaper than an extra gloo
all-gather, which is what ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s
``ProcessGroupWrapper`` does: its fingerprint holds the op, shapes and dtypes
but not the root, the reduction, the program line or point-to-point calls).

The wrapper intercepts primitives by name through :data:`EXTRACTORS`, a table
of functions with the primitive's signature that return what to compare.
Names not in the table (``compute``, attributes, primitives added later) pass
through unchanged; a call whose arguments do not fit its extractor runs
unchecked. Consequences to know: a blocking ``send`` waits until its ``recv``
is posted (as on the simulator). An ``async_op=True`` collective, an
``isend``/``irecv`` and a ``batch_isend_irecv`` return at once: the check
completes on a thread of its own (with a store connection of its own), which
issues the call to the backend once the other ranks agree, so the program's
computation and its other groups go on as unchecked, and a mismatch moves no
data (both sides raise it in ``wait()``). A group's collectives, and a
channel's point-to-point calls, reach the backend in the program's order.
Such a call's input tensors are copied when the program makes the call, on its
own thread (:func:`_taken_now`): the program may change or free its tensor at
once, as with an unchecked call, and the backend still gets what it passed;
the copies count on the rank (:mod:`simcomm.memory`) until the program waits,
as an unchecked call's copy does.
"""
from __future__ import annotations

import contextlib
import copy
import pickle
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from simcomm import memory
from simcomm.checks import check_splits
from simcomm.errors import CollectiveMismatchError, DeadlockError
from simcomm.handles import Handle
from simcomm.reports import LOCAL_GROUP_NAMES, mismatch_message, program_location
from simcomm.trace import current_phase, issued_as

from .call_memory import RELEASE_WAIT_S
from .dist_work import issuing_deferred
from .groups import GroupCache

__all__ = ["Call", "Checker", "CheckedTransport", "EXTRACTORS", "describe", "find_deadlock"]


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
    return (("shape", tuple(tensor.shape)), ("dtype", tensor.dtype))


def _collective(op: str, *fields: tuple, shown: tuple = (), splits: tuple | None = None) -> list[Call]:
    return [Call("collective", op, tuple(fields), shown, splits=splits)]


# -- the table: one function per primitive, with the primitive's signature --------------

# ``into`` (a rank's own output buffer) is each rank's own: not compared

def _all_reduce(tensor, op, async_op=False, factor=None, into=None):
    # PREMUL_SUM's factor is each rank's own (the ranks may differ): not compared
    return _collective("all_reduce", *_tensor(tensor), ("op", str(op)))


def _all_gather(tensor, dim, async_op=False, into=None):
    return _collective("all_gather", *_tensor(tensor), ("dim", dim))


def _reduce_scatter(tensor, dim, op, async_op=False, factor=None, into=None, separately=False):
    return _collective("reduce_scatter", *_tensor(tensor), ("dim", dim), ("op", str(op)))


def _all_to_all(tensor, scatter_dim, gather_dim, async_op=False):
    return _collective("all_to_all", *_tensor(tensor), ("scatter_dim", scatter_dim), ("gather_dim", gather_dim))


def _gather(tensor, dst, dim, async_op=False):
    return _collective("gather", *_tensor(tensor), ("dst", dst), ("dim", dim))


def _broadcast(tensor, src, async_op=False, into=None):
    return _collective("broadcast", *_tensor(tensor), ("src", src))


def _reduce(tensor, dst, op, async_op=False, factor=None):
    return _collective("reduce", *_tensor(tensor), ("dst", dst), ("op", str(op)))


def _scatter(tensor, src, dim, requires_grad=False, async_op=False):
    # only the source's tensor matters (the others may pass None), and only the source knows
    # its rank count to normalise a negative dim: both shown, not compared (the transport
    # checks each rank's dim against the source's once the header arrives)
    return _collective("scatter", ("src", src),
                       shown=(("dim", dim), *(_tensor(tensor) if isinstance(tensor, torch.Tensor) else ())))


def _all_to_all_single(tensor, output_split_sizes, input_split_sizes, async_op=False):
    rows = tensor.shape[0] if tensor.dim() else 0
    splits = (rows, _split_list(output_split_sizes), _split_list(input_split_sizes))
    return _collective("all_to_all_single", ("dtype", tensor.dtype), ("row_shape", tuple(tensor.shape[1:])),
                       shown=(("shape", tuple(tensor.shape)), ("input_split_sizes", splits[2]),
                              ("output_split_sizes", splits[1])), splits=splits)


def _split_list(sizes) -> tuple[int, ...] | None:
    return None if sizes is None else tuple(int(size) for size in sizes)


def _barrier(async_op=False):
    return _collective("barrier")


def _subgroup(groups):
    return _collective("subgroup", ("groups", tuple(tuple(part) for part in groups)))


def _send(tensor, dst, async_op=False):
    return [Call("send", "isend" if async_op else "send", _tensor(tensor), peer=dst)]


def _recv(shape, dtype, src, async_op=False):
    return [Call("recv", "irecv" if async_op else "recv", (("shape", tuple(shape)), ("dtype", dtype)), peer=src)]


def _isend(tensor, dst):
    return [Call("send", "isend", _tensor(tensor), peer=dst)]


def _irecv(shape, dtype, src):
    return [Call("recv", "irecv", (("shape", tuple(shape)), ("dtype", dtype)), peer=src)]


def _batch_isend_irecv(ops):
    return [_p2p_op(op) for op in ops]


def _p2p_op(op) -> Call:
    """One entry of ``batch_isend_irecv``: a :class:`simcomm.P2POp` (``op`` ``"isend"``/``"irecv"``,
    ``data`` a tensor or ``(size, dtype)``, ``peer``) or an object with ``op`` (a name or the
    function), ``peer`` and either ``tensor`` or ``shape`` and ``dtype`` (torch's ``P2POp`` fits)."""
    name = _op_name(op)
    peer = getattr(op, "peer")
    tensor = _op_tensor(op)
    data = getattr(op, "data", None)
    if "recv" in name:
        if isinstance(tensor, torch.Tensor):
            shape, dtype = tuple(tensor.shape), tensor.dtype
        elif data is not None:
            shape, dtype = tuple(data[0]), data[1]
        else:
            shape, dtype = tuple(op.shape), op.dtype
        return Call("recv", "irecv", (("shape", shape), ("dtype", dtype)), peer=peer)
    if "send" in name:
        return Call("send", "isend", _tensor(tensor), peer=peer)
    raise TypeError(f"batch_isend_irecv: unknown op {name!r}")


def _op_name(op) -> str:
    """A batch op's kind as a string (``"isend"``, or the name of torch's function)."""
    name = getattr(op, "op", None)
    return str(getattr(name, "__name__", name))


def _op_tensor(op) -> torch.Tensor | None:
    """A batch op's tensor (``tensor``, else ``data`` when it is one)."""
    tensor = getattr(op, "tensor", None)
    data = getattr(op, "data", None)
    return data if tensor is None and isinstance(data, torch.Tensor) else tensor


#: primitive name -> function with its signature returning the calls to compare
EXTRACTORS: dict[str, Callable[..., list[Call]]] = {
    "all_reduce": _all_reduce, "all_gather": _all_gather, "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all, "gather": _gather, "broadcast": _broadcast, "reduce": _reduce,
    "scatter": _scatter, "all_to_all_single": _all_to_all_single, "barrier": _barrier,
    "subgroup": _subgroup, "send": _send, "recv": _recv, "isend": _isend, "irecv": _irecv,
    "batch_isend_irecv": _batch_isend_irecv,
}


# -- comparing ------------------------------------------------------------------------------

@dataclass
class _Posted:
    """A point-to-point check written to the store, waiting for its partner's record."""

    partner_key: str
    record: tuple                  # (global rank, Call, location) of this side
    group: tuple[int, ...]
    peer: int                      # global rank of the other side
    channel: str = ""              # the (group, sender, receiver) channel: its calls keep their order


@dataclass
class _Step:
    """A collective's record written to the store, waiting for the other ranks' records."""

    group: tuple[int, ...]         # global ranks, group order
    step: int
    keys: list[str]                # every rank's record key, group order
    record: tuple                  # (global rank, Call, location) of this rank


_ENDED = "ended"


class Checker:
    """The comparisons of one process (global rank ``rank`` of ``world_size``) in one run, through
    ``store`` (any ``torch.distributed`` Store with ``set``/``get``/``multi_get`` that blocks
    until a key exists; its timeout bounds every wait). Keys are unique within the run, so a
    fresh store per run leaves nothing behind.

    When the program returns, :meth:`ended` writes a marker in place of every call this rank
    could be awaited for next, so a peer waiting for a collective or a send/recv this rank never
    makes gets :class:`DeadlockError` at once instead of a timeout.
    """

    def __init__(self, store, rank: int, world_size: int):
        self.store = store
        self.rank = rank
        world = tuple(range(world_size))
        self._groups: dict[str, tuple[int, ...]] = {".".join(map(str, world)): world}
        self._steps: Counter[tuple] = Counter()
        self._channels: Counter[tuple] = Counter()
        self._waits = 0
        #: group key -> the last async collective issued on it (see _Deferred)
        self.last_issue: dict[str, _Deferred] = {}
        self._spare_clients: list = []
        self._clients_lock = threading.Lock()

    @contextlib.contextmanager
    def own_client(self) -> Iterator[Checker]:
        """A checker sharing this one's books but with a store connection of its own, for the
        thread of a deferred check (a store client serves one blocking wait at a time)."""
        with self._clients_lock:
            client = self._spare_clients.pop() if self._spare_clients else None
        if client is None and not isinstance(self.store, dist.TCPStore):
            client = self.store                  # an in-process store serves several waits at once
        elif client is None:
            client = dist.TCPStore(self.store.host, self.store.port, None, is_master=False,
                                   timeout=self.store.timeout)
        view = copy.copy(self)
        view.store = client
        try:
            yield view
        finally:
            with self._clients_lock:
                self._spare_clients.append(client)

    def after_issued(self, transport) -> None:
        """Block until the async collectives this rank issued earlier on ``transport``'s group
        are issued to the backend (a later collective of the group must not overtake them)."""
        key = transport if isinstance(transport, str) else _group_key(transport)
        work = self.last_issue.get(key)
        if work is not None:
            work.join()

    def add_group(self, transport) -> None:
        """Remember a group this rank belongs to (for :meth:`ended`)."""
        self._groups[_group_key(transport)] = tuple(sorted(transport.ranks))

    def ended(self, location: str = "") -> None:
        """This rank's program returned: answer every wait a peer could still enter for it."""
        keys = []
        for name, group in self._groups.items():
            keys.append(f"c/{name}/{self._steps[name]}/{self.rank}")
            for peer in group:
                if peer != self.rank:
                    send, recv = (name, self.rank, peer, "send"), (name, peer, self.rank, "recv")
                    keys.append(f"p/{name}/{self.rank}>{peer}/{self._channels[send]}/send")
                    keys.append(f"p/{name}/{peer}>{self.rank}/{self._channels[recv]}/recv")
        marker = pickle.dumps((self.rank, _ENDED, location))
        self.store.multi_set(keys, [marker] * len(keys))

    def agree_on_local_group(self, ranks: Sequence[int], me: int, name: str, location: str) -> None:
        """Compare the name torch gave a group its members make by themselves
        (``use_local_synchronization=True``) on every member before it is made, as the simulator's
        members meet to make it (each virtual rank's ``agree_on_local_group``):
        members that named it differently would make two groups and wait in them forever."""
        ranks = tuple(ranks)
        meeting = _Meeting(ranks, ranks.index(me), "creating/" + ".".join(map(str, sorted(ranks))))
        self.collective(meeting, Call("collective", "new_group", (("name", name[:8]),),
                                      (("ranks", list(ranks)), ("use_local_synchronization", True))), location)

    def collective(self, transport, call: Call, location: str) -> None:
        """Compare ``call`` with the same step's call on every rank of ``transport``'s group; raise
        :class:`CollectiveMismatchError` (on every rank) when they disagree. Blocks until all arrive."""
        self.compare(self.post_collective(transport, call, location, announce=True))

    def post_collective(self, transport, call: Call, location: str, announce: bool = False) -> _Step:
        """Write this rank's record of its next collective on ``transport``'s group (``announce``:
        and its waiting record: :meth:`compare` follows at once); :meth:`compare` completes it."""
        group = tuple(transport.ranks)
        key = _group_key(transport)
        step = self._steps[key]
        self._steps[key] += 1
        prefix = f"c/{key}/{step}/"
        me = group[transport.rank]
        posted = _Step(group, step, [prefix + str(rank) for rank in group], (me, call, location))
        if announce:
            self.store.multi_set([prefix + str(me), f"w/{me}"], [pickle.dumps(posted.record),
                                                                  self.waiting_record(posted)])
        else:
            self.store.set(prefix + str(me), pickle.dumps(posted.record))
        return posted

    def waiting_record(self, posted: _Step) -> bytes:
        """The waiting record (``w/<rank>``) of a rank about to wait for ``posted``'s peers."""
        me, call, location = posted.record
        return self._waiting([(k, r) for k, r in zip(posted.keys, posted.group) if r != me], call, location)

    def announce(self, posted: _Step) -> None:
        """Write the waiting record: this rank now waits for ``posted``'s peers."""
        self.store.set(f"w/{posted.record[0]}", self.waiting_record(posted))

    def compare(self, posted: _Step) -> None:
        """Wait for every rank's record of ``posted``'s step; raise :class:`CollectiveMismatchError`
        (on every rank) when they disagree."""
        me, call, location = posted.record
        records = [pickle.loads(blob) for blob in self.store.multi_get(posted.keys)]
        _raise_if_ended(records, posted.group, me, call, location)
        problem = _collective_problem(records)
        if problem is not None:
            raise CollectiveMismatchError(_collective_message(posted.group, posted.step, records, problem))

    def _waiting(self, awaited: list[tuple[str, int]], call: Call, location: str) -> bytes:
        """This rank's waiting record (``w/<rank>``): which keys of which ranks it is about to wait
        for, in which call; :func:`find_deadlock` reads them."""
        self._waits += 1
        return pickle.dumps((self._waits, awaited, describe(call), location))

    def post(self, transport, call: Call, location: str, blocking: bool = False) -> _Posted:
        """Write this side of a send/recv pair; :meth:`finish` compares it with the other side.
        ``blocking``: :meth:`finish` follows at once (the waiting record is written now)."""
        group = tuple(transport.ranks)
        me, peer = group[transport.rank], group[call.peer]
        src, dst = (me, peer) if call.kind == "send" else (peer, me)
        channel = (_group_key(transport), src, dst, call.kind)
        number = self._channels[channel]
        self._channels[channel] += 1
        base = f"p/{channel[0]}/{src}>{dst}/{number}/"
        record = (me, call, location)
        posted = _Posted(base + ("recv" if call.kind == "send" else "send"), record, group, peer,
                         f"p/{channel[0]}/{src}>{dst}")
        if blocking:
            self.store.multi_set([base + call.kind, f"w/{me}"],
                                 [pickle.dumps(record), self._waiting([(posted.partner_key, peer)], call, location)])
        else:
            self.store.set(base + call.kind, pickle.dumps(record))
        return posted

    def announce_pair(self, posted: _Posted) -> None:
        """Write the waiting record: this rank now waits for the other side of ``posted``."""
        self.store.set(f"w/{posted.record[0]}",
                       self._waiting([(posted.partner_key, posted.peer)], posted.record[1], posted.record[2]))

    def finish(self, posted: _Posted, announce: bool = False) -> None:
        """Wait for the other side of the pair; raise :class:`CollectiveMismatchError` when the
        shapes or dtypes differ. ``announce``: write the waiting record first (a handle's wait)."""
        if announce:
            self.store.set(f"w/{posted.record[0]}",
                           self._waiting([(posted.partner_key, posted.peer)], posted.record[1], posted.record[2]))
        other = pickle.loads(self.store.get(posted.partner_key))
        mine = posted.record
        _raise_if_ended([mine, other], posted.group, mine[0], mine[1], mine[2])
        if mine[1].compared != other[1].compared:
            send, recv = (mine, other) if mine[1].kind == "send" else (other, mine)
            raise CollectiveMismatchError(
                f"send/recv mismatch in group {list(posted.group)}:\n"
                f"  rank {send[0]} sends {_shape_dtype(send[1])}{_via(send[1], 'send')} at {send[2]}\n"
                f"  rank {recv[0]} expects {_shape_dtype(recv[1])}{_via(recv[1], 'recv')} at {recv[2]}")


@dataclass(frozen=True)
class _Meeting:
    """What :meth:`Checker.collective` reads of a transport, for a group not made yet."""

    ranks: tuple[int, ...]
    rank: int
    group_key: str


def _group_key(transport) -> str:
    """The name of ``transport``'s group in the store's keys (two groups may share their ranks)."""
    key = getattr(transport, "group_key", None)
    return key if isinstance(key, str) else ".".join(map(str, sorted(transport.ranks)))


def find_deadlock(store, ranks: Sequence[int]) -> str | None:
    """The deadlock message when every one of ``ranks`` (the ranks still running) waits in a check
    for keys nobody has written, twice in a row with the same waiting records, else None.

    Keys are only ever added, and only by a rank that is not waiting, so ranks that stay waiting
    on missing keys across both looks can never be released. A rank that has never waited in a
    check, or whose last wait is satisfied, is running: no deadlock is claimed.
    """
    seen = None
    for _ in range(2):
        looks = []
        for rank in ranks:
            if not store.check([f"w/{rank}"]):
                return None
            blob = store.get(f"w/{rank}")
            _, awaited, text, location = pickle.loads(blob)
            missing = sorted({owner for key, owner in awaited if not store.check([key])})
            if not missing:
                return None
            looks.append((blob, rank, missing, text, location))
        if seen is not None and [look[0] for look in looks] != [look[0] for look in seen]:
            return None
        seen = looks
    lines = [f"  rank {rank} waits in {text} at {location} for rank{'s' if len(missing) > 1 else ''} "
             f"{missing if len(missing) > 1 else missing[0]}" for _, rank, missing, text, location in seen]
    return (f"deadlock: every running rank waits for another ({list(ranks)}):\n" + "\n".join(lines) +
            "\na blocking send waits until its recv is posted: order them (e.g. even ranks send "
            "first) or use isend/irecv")


def _raise_if_ended(records: list[tuple], group: tuple[int, ...], me: int, call: Call, location: str) -> None:
    ended = sorted(rank for rank, what, _ in records if what == _ENDED)
    if ended:
        raise DeadlockError(
            f"rank{'s' if len(ended) > 1 else ''} {ended if len(ended) > 1 else ended[0]} of group "
            f"{list(group)} returned from the program while rank {me} waits in {describe(call)} at "
            f"{location}: a collective or send/recv that one rank makes and another never does")


def _via(call: Call, blocking: str) -> str:
    return "" if call.op == blocking else f" with {call.op}"


def _shape_dtype(call: Call) -> str:
    fields = dict(call.compared)
    return f"{_short(fields['dtype'])} {fields['shape']}"


def _collective_problem(records: list[tuple]) -> str | None:
    """Why the ranks' records disagree (``""`` for a plain difference), or None."""
    first = records[0][1]
    if any((call.op, call.compared) != (first.op, first.compared) for _, call, _ in records):
        return LOCAL_GROUP_NAMES if all(call.op == "new_group" for _, call, _ in records) else ""
    if first.splits is None:
        return None
    world = len(records)
    resolved = []
    for _, call, _ in records:
        rows, output_splits, input_splits = call.splits
        even = tuple([rows // world] * world)
        resolved.append((input_splits if input_splits is not None else even,
                         output_splits if output_splits is not None else even))
    if any(len(sends) != world or len(expects) != world for sends, expects in resolved):
        return None                          # the transport names a list of the wrong length
    try:
        check_splits("all_to_all_single", [sends for sends, _ in resolved], [expects for _, expects in resolved])
    except ValueError as error:              # the same words as the simulator's check (group-local ranks)
        return f"  {error}\n"
    return None


def _collective_message(group: tuple[int, ...], step: int, records: list[tuple], problem: str) -> str:
    calls: dict[tuple[str, str], list[int]] = {}
    for rank, call, location in records:
        calls.setdefault((describe(call), location), []).append(rank)
    return mismatch_message(group, step, [(ranks, text, location) for (text, location), ranks in calls.items()],
                            problem)


# -- the wrapper ----------------------------------------------------------------------------

class CheckedTransport:
    """``inner`` (a transport), with every primitive named in :data:`EXTRACTORS` checked first.

    Everything else (attributes, ``compute``, unknown primitives) is ``inner``'s,
    unchanged. ``subgroup`` returns a checked transport of the subgroup.
    """

    def __init__(self, inner, checker: Checker):
        self._inner = inner
        self._checker = checker

    def __repr__(self) -> str:
        return f"CheckedTransport({self._inner!r})"

    @property
    def inner(self):
        """The transport that moves the data."""
        return self._inner

    def local_subgroup(self, part):
        """The inner transport's :meth:`~real.transport.DistTransport.local_subgroup`, checked."""
        out = self._inner.local_subgroup(part)
        self._checker.add_group(out)
        return CheckedTransport(out, self._checker)

    def __getattr__(self, name: str):
        if name in ("_inner", "_checker"):       # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        value = getattr(self._inner, name)
        extractor = EXTRACTORS.get(name)
        if extractor is None or not callable(value):
            return value

        def checked(*args, **kwargs):
            return self._call(name, value, extractor, args, kwargs)

        return checked

    def _call(self, name: str, method, extractor, args: tuple, kwargs: dict):
        try:
            calls = extractor(*args, **kwargs)
        except (TypeError, AttributeError):
            calls = None                         # a signature the table does not know: unchecked
        inner = self._inner
        if not calls or inner.world_size == 1:
            return method(*args, **kwargs)
        location = program_location(sys._getframe(2))
        if calls[0].kind == "collective":
            if kwargs.get("async_op", False):
                return self._deferred(name, method, args, kwargs, calls[0], location)
            self._checker.after_issued(inner)      # the group's earlier async calls go first
            self._checker.collective(inner, calls[0], location)
            out = method(*args, **kwargs)
            if name != "subgroup":
                return out
            self._checker.add_group(out)
            return CheckedTransport(out, self._checker)
        blocking = name in ("send", "recv") and not kwargs.get("async_op", False)
        posted = [self._checker.post(inner, call, location, blocking) if call.peer != inner.rank else None
                  for call in calls]
        checked = [item for item in posted if item is not None]
        if blocking:                             # both sides agree before data moves
            for item in checked:
                self._checker.after_issued(item.channel)   # the channel's earlier isend/irecv first
                self._checker.finish(item)
            return method(*args, **kwargs)
        # isend/irecv/batch: checked on a thread, issued once the other sides agree, so a
        # mismatched pair moves nothing and leaves both processes fit for the next run
        checker = self._checker
        previous = [checker.last_issue[item.channel] for item in checked if item.channel in checker.last_issue]
        args, kwargs, kept = _taken_now(inner, name, args, kwargs)

        def check(view: Checker) -> None:
            for item in checked:
                view.finish(item)

        work = _Deferred(checker, check, previous, lambda: method(*args, **kwargs),
                         lambda: checker.announce_pair(checked[0]) if checked else None,
                         _pending_of(inner), (" + ".join(describe(call) for call in calls), location), kept)
        for item in checked:
            checker.last_issue[item.channel] = work
        if name == "batch_isend_irecv":
            return [Handle(_Part(work, index)) for index in range(len(calls))]
        return Handle(work)


class _Deferred:
    """An async call whose check completes on a thread of its own, which then issues it.

    The program goes on at once, as with an unchecked ``async_op=True`` call: a rank may
    issue async collectives of two groups in an order another rank does not, and the data
    still moves only once every rank of the group has issued the same call (for
    ``isend``/``irecv``: once the other side has posted a matching call). Calls of one group
    (of one point-to-point channel) keep the program's order: each is issued after the
    ones ``previous`` names.

    ``check(checker)`` runs on the thread with a checker of its own store connection;
    ``issue()`` then makes the call; ``announce()`` writes the waiting record when the
    program waits before the call is issued. ``kept``: the copies :func:`_taken_now` made of the
    call's inputs (one entry per op of a batch), held until the program waits on the call, so
    they are freed at that wait, as an unchecked call's are, and not whenever the thread
    happens to issue the call.
    """

    def __init__(self, checker: Checker, check, previous: Sequence[_Deferred], issue, announce,
                 pending: dict | None = None, what: tuple[str, str] | None = None,
                 kept: list | None = None):
        self._checker, self._check = checker, check
        self.kept = kept if kept is not None else []   # the call's copies of its inputs, until the wait
        self._pending = pending
        if pending is not None:              # unwaited until the program waits (GroupCache.pending)
            pending[id(self)] = what
        self._previous, self._issue, self._announce = list(previous), issue, announce
        self.issued = threading.Event()
        self._issued_as = (current_phase(), time.perf_counter())   # traced as the program issued it
        self.handle = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="simcomm-checked-call", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for earlier in self._previous:
                earlier.issued.wait()
            with self._checker.own_client() as checker:
                self._check(checker)
            with issuing_deferred(), issued_as(*self._issued_as):
                self.handle = self._issue()
        except BaseException as error:     # raised again by wait()
            self._error = error
        finally:
            # the call's arguments (a send's tensor) are the backend's now: this object, which the
            # checker keeps as the channel's last issue, must not keep them alive
            self._previous, self._issue, self._check = [], None, None
            self.issued.set()

    def join(self) -> None:
        """Block until the call is issued (or its check failed: raise that)."""
        if self._pending is not None:
            self._pending.pop(id(self), None)
        if not self.issued.is_set():
            self._announce()                 # the parent sees what this rank waits for
            self.issued.wait()
        if self._error is not None:
            raise self._error.with_traceback(self._error.__traceback__)

    def wait(self):
        self.join()
        self.kept = []           # the input copies are freed before the output counts, as unchecked
        output = self.handle.wait()
        self.handle = None       # the checker keeps this object as the group's last issue: not its output
        self.finished()
        return output

    def finished(self) -> None:
        """Wait (at most :data:`real.call_memory.RELEASE_WAIT_S`) until the issuing thread is gone:
        it has issued the call and only exits, but what it held (the call's output among it) is
        let go only as it exits, on that thread; the memory count would see it alive a moment
        after the program freed it (``Cluster(memory=True)``)."""
        self._thread.join(RELEASE_WAIT_S)

    def is_completed(self) -> bool:
        return self.issued.is_set() and (self._error is not None or self.handle is None
                                         or self.handle.is_completed())


def _pending_of(transport) -> dict | None:
    """The registry of unwaited calls of ``transport``'s process (None for a transport without one)."""
    cache = getattr(transport, "cache", None)
    return cache.pending if isinstance(cache, GroupCache) else None


class _Part:
    """The handle of one op of a deferred ``batch_isend_irecv``."""

    def __init__(self, work: _Deferred, index: int):
        self._work, self._index = work, index

    def wait(self):
        self._work.join()
        self._work.kept[self._index] = None      # as _Deferred.wait
        handles = self._work.handle
        output = handles[self._index].wait()
        handles[self._index] = None    # as _Deferred.wait: the checker keeps the batch, not its output
        self._work.finished()
        return output

    def is_completed(self) -> bool:
        if not self._work.issued.is_set() or self._work._error is not None:
            return self._work.issued.is_set()
        handle = self._work.handle[self._index]
        return handle is None or handle.is_completed()


def _taken_now(inner, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict, list]:
    """``args`` and ``kwargs`` of an async call with each input tensor replaced by a private copy
    made now, on the program's thread, and the copies (one entry per op of a batch, ``None`` for
    an ``irecv``). The call reaches the backend later, from the thread of its check, and must move
    what the program passed, not what its tensor holds by then: the program may change its
    tensor at once (``comm.isend``, an ``async_op=True`` collective). A copy is made as the
    unchecked call makes its own (``inner._local_copy``), under the same label: a collective's
    under :func:`simcomm.memory.communicating`, a send's under the program's label."""
    local_copy = getattr(inner, "_local_copy", None) or (lambda tensor: tensor.detach().clone())
    if name == "batch_isend_irecv":
        ops = list(kwargs.pop("ops") if "ops" in kwargs else args[0])
        kept: list = []
        for index, op in enumerate(ops):
            tensor = _op_tensor(op) if "send" in _op_name(op) else None
            kept.append(None if tensor is None else local_copy(tensor))
            if tensor is not None:
                ops[index] = _with_tensor(op, kept[-1])
        return (ops,), kwargs, kept
    in_kwargs = "tensor" in kwargs
    tensor = kwargs["tensor"] if in_kwargs else (args[0] if args else None)
    if not isinstance(tensor, torch.Tensor):      # a recv, a barrier, a scatter off its source
        return args, kwargs, []
    with memory.communicating() if name != "send" else contextlib.nullcontext():
        private = local_copy(tensor)
    if in_kwargs:
        kwargs = {**kwargs, "tensor": private}
    else:
        args = (private, *args[1:])
    return args, kwargs, [private]


def _with_tensor(op, tensor: torch.Tensor):
    """The batch op ``op`` sending ``tensor`` instead (a :class:`simcomm.P2POp`, or an object
    with ``tensor`` or ``data``)."""
    field = "tensor" if isinstance(getattr(op, "tensor", None), torch.Tensor) else "data"
    if hasattr(op, "_replace"):
        return op._replace(**{field: tensor})
    op = copy.copy(op)
    setattr(op, field, tensor)
    return op


def _deferred(self, name: str, method, args: tuple, kwargs: dict, call: Call, location: str) -> Handle:
    checker, inner = self._checker, self._inner
    posted = checker.post_collective(inner, call, location)
    key = _group_key(inner)
    previous = [checker.last_issue[key]] if key in checker.last_issue else []
    args, kwargs, kept = _taken_now(inner, name, args, kwargs)
    work = _Deferred(checker, lambda view: view.compare(posted), previous, lambda: method(*args, **kwargs),
                     lambda: checker.announce(posted), _pending_of(inner), (describe(call), location), kept)
    checker.last_issue[key] = work
    return Handle(work)


CheckedTransport._deferred = _deferred
