"""Checked mode's comparisons: each rank's :class:`~real.checked_calls.Call` against its peers'.

Each rank writes its call (pickled, with its program line) under a key of a
``torch.distributed`` store and reads its peers' keys (a set and a multi-get:
about 0.1-0.2 ms on loopback). :class:`Checker` keeps one process's books
(the step of each group, the count of each point-to-point channel) and raises
:class:`simcomm.CollectiveMismatchError` when the records disagree, or
:class:`simcomm.DeadlockError` when a peer's program returned instead;
:func:`find_deadlock` (run by the parent) finds ranks that wait on each other
from the waiting records (``w/<rank>``) they write before they wait.
"""
from __future__ import annotations

import contextlib
import copy
import pickle
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch.distributed as dist

from simcomm.checks import check_splits
from simcomm.errors import CollectiveMismatchError, DeadlockError
from simcomm.reports import LOCAL_GROUP_NAMES, mismatch_message

from .checked_calls import Call, describe, shape_dtype

__all__ = ["Checker", "find_deadlock", "group_key"]


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
        #: group key -> the last async collective issued on it (a :mod:`real.checked` deferred call,
        #: whose ``join()`` returns once it is issued)
        self.last_issue: dict = {}
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
        key = transport if isinstance(transport, str) else group_key(transport)
        work = self.last_issue.get(key)
        if work is not None:
            work.join()

    def add_group(self, transport) -> None:
        """Remember a group this rank belongs to (for :meth:`ended`)."""
        self._groups[group_key(transport)] = tuple(sorted(transport.ranks))

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
        key = group_key(transport)
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
        channel = (group_key(transport), src, dst, call.kind)
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
                f"  rank {send[0]} sends {shape_dtype(send[1])}{_via(send[1], 'send')} at {send[2]}\n"
                f"  rank {recv[0]} expects {shape_dtype(recv[1])}{_via(recv[1], 'recv')} at {recv[2]}")


@dataclass(frozen=True)
class _Meeting:
    """What :meth:`Checker.collective` reads of a transport, for a group not made yet."""

    ranks: tuple[int, ...]
    rank: int
    group_key: str


def group_key(transport) -> str:
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
        check_splits(first.op, [sends for sends, _ in resolved], [expects for _, expects in resolved])
    except ValueError as error:              # the same words as the simulator's check (group-local ranks)
        return f"  {error}\n"
    return None


def _collective_message(group: tuple[int, ...], step: int, records: list[tuple], problem: str) -> str:
    calls: dict[tuple[str, str], list[int]] = {}
    for rank, call, location in records:
        calls.setdefault((describe(call), location), []).append(rank)
    return mismatch_message(group, step, [(ranks, text, location) for (text, location), ranks in calls.items()],
                            problem)
