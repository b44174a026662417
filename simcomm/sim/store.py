"""The c10d store of a run on virtual ranks: one key-value table shared by its rank threads.

c10d hands every process group a ``Store`` (a ``TCPStore`` on real processes)
and uses it for rendezvous; the "simcomm" backend needs none, but c10d's
*store barrier* does: with ``TORCH_DIST_INIT_BARRIER=1`` (set by PyTorch's
test base classes and some launchers) ``init_process_group`` and
``new_group`` end in ``_store_based_barrier``::

    store.add(key, 1)                 # this rank has created the group
    if store.add(key, 0) == world_size:
        store.set(key + ":last_worker", "1")
    store.wait([key + ":last_worker"], interval)    # until every rank has

c10d wraps this store in its ``PrefixStore``\\ s (``default_pg/``, a group's
name), whose C++ calls come back to the Python methods here.

A store call runs on the rank thread that makes it, under the scheduler's
lock. A call that must wait for a key (``get``, ``wait``, ``multi_get``)
blocks the rank *visibly to the scheduler*, as a collective does: the turn
passes on, a ``set``/``add``/``append``/``compare_set``/``multi_set`` of
another rank that supplies the keys wakes it, and if no rank is left to
supply them the run fails at once with a
:class:`~simcomm.errors.DeadlockError` naming the keys (a real store would
raise after its timeout, which therefore has no effect here). Values are
bytes, as c10d returns them; a ``str`` value is stored UTF-8 encoded.
``delete_key`` and ``num_keys`` answer when called on this object; through a
``PrefixStore`` torch does not forward them to a store written in Python
("Tried to call pure virtual function"), and c10d's own code never calls them.
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .process_state import thread_owner
from .scheduler import RunState
from .waits import Wait

__all__ = ["RunStore"]


class RunStore(dist.Store):
    """The store of one run's c10d groups (see the module docstring).

    Only the run's rank threads may call it; any other thread gets a
    ``RuntimeError`` naming the call (the ranks meet here, and a helper
    thread is none of them).
    """

    def __init__(self, state: RunState):
        super().__init__()
        self._state = state
        self._data: dict[str, bytes] = {}
        self._waiting: dict[int, tuple[str, ...]] = {}   # rank -> the keys it waits for

    # -- writes: change the table under the lock, wake the ranks whose keys are all there --

    def set(self, key: str, value: Any) -> None:
        self._under_lock("set", lambda: self._data.__setitem__(key, _as_bytes("set", "value", value)))

    def add(self, key: str, value: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"store.add({key!r}, {value!r}): value={value!r} must be an int")

        def change() -> int:
            old = self._data.get(key, b"0")
            try:
                total = int(old) + value
            except ValueError:
                raise ValueError(f"store.add({key!r}, {value}): the key holds {old!r}, "
                                 f"not an integer") from None
            self._data[key] = str(total).encode()
            return total
        return self._under_lock("add", change)

    def append(self, key: str, value: Any) -> None:
        def change() -> None:
            self._data[key] = self._data.get(key, b"") + _as_bytes("append", "value", value)
        self._under_lock("append", change)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        """c10d's rule: set ``desired_value`` if the key holds ``expected_value`` (or is
        absent and ``expected_value`` is empty); return the value the key now holds, or
        ``expected_value`` for an absent key that was not set."""
        expected = _as_bytes("compare_set", "expected_value", expected_value)
        desired = _as_bytes("compare_set", "desired_value", desired_value)

        def change() -> bytes:
            current = self._data.get(key)
            if (current is None and not expected) or current == expected:
                self._data[key] = desired
                return desired
            return expected if current is None else current
        return self._under_lock("compare_set", change)

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"store.multi_set: {len(keys)} keys and {len(values)} values "
                             f"(one value per key)")
        encoded = [_as_bytes("multi_set", "values", value) for value in values]
        self._under_lock("multi_set", lambda: self._data.update(zip(keys, encoded)))

    def delete_key(self, key: str) -> bool:
        return self._under_lock("delete_key", lambda: self._data.pop(key, None) is not None)

    # -- reads --

    def get(self, key: str) -> bytes:
        return self._wait_for("get", (key,))[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._wait_for("multi_get", tuple(keys))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._wait_for("wait", tuple(keys))

    def check(self, keys: Sequence[str]) -> bool:
        return self._under_lock("check", lambda: all(key in self._data for key in keys))

    def num_keys(self) -> int:
        return self._under_lock("num_keys", lambda: len(self._data))

    def has_extended_api(self) -> bool:
        return True

    # -- the scheduler --

    def _caller(self, op: str) -> int:
        """The rank whose thread calls ``op``."""
        ident = threading.get_ident()
        for rank, thread_id in enumerate(self._state.thread_ids):
            if thread_id == ident:
                return rank
        owner = thread_owner()          # a thread a rank started is the rank's
        if owner is not None and owner[0] is self._state:
            return owner[1]
        raise RuntimeError(
            f"store.{op} from thread {threading.current_thread().name!r}: the c10d store of a "
            f"World run is shared by its rank threads only; call it from a rank's program")

    def _under_lock(self, op: str, change: Callable[[], Any]) -> Any:
        state = self._state
        state.lock_for(self._caller(op), f"store.{op}")
        try:
            result = change()
            for rank, keys in list(self._waiting.items()):
                if all(key in self._data for key in keys):
                    del self._waiting[rank]
                    state.wake_locked(rank)
        finally:
            state.lock.release()
        return result

    def _wait_for(self, op: str, keys: tuple[str, ...]) -> list[bytes]:
        """The values of ``keys``, once every one is set; blocks the rank until then."""
        state, rank, frame = self._state, self._caller(op), sys._getframe(2)
        while True:
            state.lock_for(rank, f"store.{op}")
            if all(key in self._data for key in keys):
                values = [self._data[key] for key in keys]
                state.lock.release()
                return values
            self._waiting[rank] = keys
            missing = [key for key in keys if key not in self._data]
            state.release_and_wait(rank, Wait(
                f"store.{op} for key{'s' if len(missing) > 1 else ''} "
                f"{', '.join(map(repr, missing))}, which no rank has set", frame))


def _as_bytes(op: str, argument: str, value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    raise TypeError(f"store.{op}: {argument}={value!r} must be str or bytes")
