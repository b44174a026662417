"""Waits without a collective on virtual ranks: ``time.sleep`` and a script's own c10d stores.

A process that sleeps, or waits for a key of a store, leaves the CPU to the
others; a rank thread holding the turn would keep it, so the rank it waits
for (the one that writes the polled file, sets the key, or creates the
store's server) would never run. On a rank's own thread, while its program
runs, these therefore hand the turn on (:meth:`simcomm.sim.scheduler.RunState.pause`):

* ``time.sleep(s)`` (the ``rank-sleep`` row of :mod:`simcomm.patches`): the
  rank lets the ranks that are ready run and returns once ``s`` seconds have
  passed; ``time.sleep(0)`` lets them run once.
* ``get``, ``wait`` and ``multi_get`` of torch's own stores (``TCPStore``,
  ``FileStore``, ``HashStore``, a ``PrefixStore`` over one; the
  ``rank-store-waits`` row): while a key is missing the rank polls it
  (``check``) every :data:`STORE_POLL_S` seconds, handing the turn on between
  polls, and raises torch's ``DistStoreError`` text after the store's timeout
  (or ``wait``'s own).
* ``TCPStore(...)``: a server (``is_master=True``) with ``wait_for_workers``
  waits, handing the turn on, until ``world_size - 1`` clients of this run
  have joined; a client waits, handing the turn on, until something listens on
  the port (a server a rank created, or one outside the run). Both raise
  torch's errors after the store's timeout.

A rank whose own thread is in ``time.sleep`` while a thread it started
communicates as the rank keeps the turn in a plain sleep instead (the two
threads would share the rank's place in the scheduler); a rank may so poll its
own thread (``while t.is_alive(): time.sleep(0.01)``).

Everywhere else (any other thread, outside a run, a rank's own
:class:`~simcomm.sim.store.RunStore`, which the scheduler already sees) each
call is torch's or Python's own. When every rank waits so that nothing can
change, the scheduler ends the run with a :class:`~simcomm.errors.DeadlockError`
(the rule: :meth:`~simcomm.sim.scheduler.RunState._idle_verdict_locked`).
"""
from __future__ import annotations

import datetime
import posix
import socket
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from .process_state import thread_owner

__all__ = ["install_waits", "STORE_POLL_S"]

#: how often a rank that waits for a store key (or for a TCPStore's server or clients) looks again
STORE_POLL_S = 0.02

_original_sleep = time.sleep
_Store = dist.Store
_original_get, _original_wait, _original_multi_get = _Store.get, _Store.wait, _Store.multi_get
_original_tcp_init = dist.TCPStore.__init__
#: the process whose ranks take turns (a child a rank forks, a DataLoader worker, sleeps and waits for real)
_PROCESS_ID = posix.getpid()
_installed = False


def _turn(store: Any = None) -> tuple[Any, int] | None:
    """``(run, rank)`` when the caller is a rank's own thread holding the turn in a live run (and
    ``store``, if given, is one of torch's, not the run's own), else None."""
    owner = thread_owner()
    if owner is None or posix.getpid() != _PROCESS_ID:     # a child a rank forked is a process of its own
        return None
    run, rank = owner
    if (run.closed or run.error is not None or run.thread_ids[rank] != threading.get_ident()
            or rank in run.blocked or rank in run.finished):
        return None
    while isinstance(store, dist.PrefixStore):     # c10d's groups wrap the run's own store so
        store = store.underlying_store
    if store is not None and type(store).__module__.startswith("simcomm"):
        return None
    return owner


def _sleep(seconds: Any) -> None:
    turn = _turn()
    if turn is None or isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds >= 0:
        return _original_sleep(seconds)     # also raises time.sleep's own errors
    run, rank = turn
    run.pause(rank, float(seconds), f"time.sleep({seconds:g})", sys._getframe(1))


_sleep.__doc__ = _original_sleep.__doc__


def _seconds(timeout: Any) -> float:
    return timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)


def _store_timeout(store: Any) -> float:
    try:
        return _seconds(store.timeout)
    except (AttributeError, RuntimeError, TypeError):
        return 300.0


def _await_keys(turn: tuple[Any, int], store: Any, op: str, keys: list[str], timeout: float,
                frame: Any) -> None:
    """Poll ``store`` for ``keys``, handing the turn on between polls, until all are set; raise
    torch's ``DistStoreError`` after ``timeout`` seconds (``timeout <= 0``: none)."""
    if store.check(keys):
        return
    run, rank = turn
    what = (f"{type(store).__name__}.{op} for key{'s' if len(keys) > 1 else ''} "
            f"{', '.join(map(repr, keys))}")
    start = time.monotonic()
    while not store.check(keys):
        if timeout > 0 and time.monotonic() - start > timeout:
            raise dist.DistStoreError(f"wait timeout after {timeout * 1000:.0f}ms, keys: "
                                      f"{', '.join(keys)}")
        run.pause(rank, STORE_POLL_S, what, frame, store=True)
    run.store_wait_ended()


def _get(self: Any, key: Any) -> bytes:
    turn = _turn(self)
    if turn is not None and isinstance(key, str):
        _await_keys(turn, self, "get", [key], _store_timeout(self), sys._getframe(1))
    return _original_get(self, key)


def _wait(self: Any, keys: Any, *args: Any, **kwargs: Any) -> None:
    turn = _turn(self)
    if turn is not None and isinstance(keys, (list, tuple)) and all(isinstance(k, str) for k in keys):
        timeout = args[0] if args else kwargs.get("arg1", kwargs.get("timeout"))
        limit = _store_timeout(self) if timeout is None else _seconds(timeout)
        _await_keys(turn, self, "wait", list(keys), limit, sys._getframe(1))
    return _original_wait(self, keys, *args, **kwargs)


def _multi_get(self: Any, keys: Any) -> list[bytes]:
    turn = _turn(self)
    if turn is not None and isinstance(keys, (list, tuple)) and all(isinstance(k, str) for k in keys):
        _await_keys(turn, self, "multi_get", list(keys), _store_timeout(self), sys._getframe(1))
    return _original_multi_get(self, keys)


_get.__doc__, _wait.__doc__, _multi_get.__doc__ = (
    _original_get.__doc__, _original_wait.__doc__, _original_multi_get.__doc__)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def _tcp_init(self: Any, host_name: str, port: int, world_size: int | None = None, is_master: bool = False,
              timeout: datetime.timedelta = datetime.timedelta(seconds=300), wait_for_workers: bool = True,
              multi_tenant: bool = False, master_listen_fd: int | None = None, use_libuv: bool = True) -> None:
    options = dict(world_size=world_size, is_master=is_master, timeout=timeout,
                   wait_for_workers=wait_for_workers, multi_tenant=multi_tenant,
                   master_listen_fd=master_listen_fd, use_libuv=use_libuv)
    turn = _turn()
    if turn is None:
        _original_tcp_init(self, host_name, port, **options)
        return
    run, rank = turn
    frame = sys._getframe(1)
    limit = _seconds(timeout)
    servers = run.tcp_servers
    if is_master:
        _original_tcp_init(self, host_name, port, **{**options, "wait_for_workers": False})
        joined = servers[self.port] = [1, world_size]
        if not (wait_for_workers and world_size):
            return
        start = time.monotonic()
        while joined[0] < world_size:
            if time.monotonic() - start > limit:
                raise dist.DistStoreError(f"Timed out after {limit:.0f} seconds waiting for clients. "
                                          f"{joined[0]}/{world_size} clients joined.")
            run.pause(rank, STORE_POLL_S, f"TCPStore(is_master=True) for {world_size - joined[0]} "
                      f"of {world_size - 1} clients on port {self.port}", frame, store=True)
        run.store_wait_ended()
        return
    start = time.monotonic()
    waited = False
    while port not in servers and not _listening(host_name, port):
        if time.monotonic() - start > limit:
            raise dist.DistNetworkError(f"The client socket has timed out after {limit * 1000:.0f}ms while "
                                        f"trying to connect to ({host_name}, {port}).")
        waited = True
        run.pause(rank, STORE_POLL_S, f"TCPStore(is_master=False) for a server on port {port}", frame,
                  store=True)
    if waited:
        run.store_wait_ended()
    _original_tcp_init(self, host_name, port, **options)
    if wait_for_workers and world_size and port in servers:
        servers[port][0] += 1


_tcp_init.__doc__ = _original_tcp_init.__doc__


def install_waits() -> None:
    """Install the patches of this module (once per process; see the module docstring)."""
    global _installed
    if not _installed:
        time.sleep = _sleep                      # simcomm.patches: "rank-sleep"
        # simcomm.patches: "rank-store-waits"
        _Store.get, _Store.wait, _Store.multi_get = _get, _wait, _multi_get
        dist.TCPStore.__init__ = _tcp_init
        _installed = True
