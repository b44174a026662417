"""Per-rank torch.distributed state: each virtual rank thread sees its own c10d world.

``torch.distributed`` keeps its process groups in one module-level object,
``torch.distributed.distributed_c10d._world``, and its C++ group registry
(``resolve_process_group``, used by the functional collectives) is
process-wide too. Virtual ranks are threads of one process, so both must
be per thread:

* :class:`_WorldSwitch` replaces ``_world`` once; every attribute access is
  forwarded to the calling rank thread's own :class:`_RankWorld`, or to
  the original object on any other thread (the main thread keeps its
  ordinary torch.distributed);
* ``_set_thread_isolation_mode(True)`` makes the C++ registry per thread
  while at least one rank thread has torch.distributed initialised.

The default group of a rank is created lazily, on the program's first use
of torch.distributed, so a program that never touches it pays only for a
thread-local assignment. Everything is torn down when the rank's program
ends (returns, raises or is aborted): nothing survives into the next run.
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..communicator import Communicator
from ..sim.rendezvous import Group
from ..sim.scheduler import RunState
from ..sim.transport import SimTransport

__all__ = ["rank_process_group", "BACKEND_NAME"]

BACKEND_NAME = "simcomm"

_local = threading.local()          # .rank: the _RankContext of a rank thread with a program running
_install_lock = threading.Lock()
_switch: _WorldSwitch | None = None
_active = 0                          # rank threads with torch.distributed initialised, all runs
_multithreading_ctx = None
_run_groups: weakref.WeakKeyDictionary[RunState, _RunGroups] = weakref.WeakKeyDictionary()


class _RankWorld(c10d._World):
    """The c10d state of one rank thread: the fields that ``_World`` keeps in module
    globals are this object's own."""

    def __init__(self) -> None:
        super().__init__()
        self._maps = {"pg_map": {}, "pg_names": {}, "pg_group_ranks": {}, "pg_backend_config": {},
                      "tags_to_pg": {}, "pg_to_tag": {}}
        self._count = 0

    pg_map = property(lambda self: self._maps["pg_map"])
    pg_names = property(lambda self: self._maps["pg_names"])
    pg_group_ranks = property(lambda self: self._maps["pg_group_ranks"])
    pg_backend_config = property(lambda self: self._maps["pg_backend_config"])
    tags_to_pg = property(lambda self: self._maps["tags_to_pg"])
    pg_to_tag = property(lambda self: self._maps["pg_to_tag"])

    @property
    def group_count(self) -> int:
        return self._count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._count = value


class _WorldSwitch:
    """Stands in for ``distributed_c10d._world``: forwards to the calling thread's world."""

    def __init__(self, original: Any):
        object.__setattr__(self, "_original", original)

    def _target(self, frame) -> Any:
        context = getattr(_local, "rank", None)
        if context is None or _from_module_body(frame):
            return self._original
        if context.world is None:
            context.initialize()
        return context.world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(sys._getframe(1)), name)

    # the attributes c10d reads on every call, as properties: no failed lookup first
    @property
    def default_pg(self) -> Any:
        return self._target(sys._getframe(1)).default_pg

    @default_pg.setter
    def default_pg(self, value: Any) -> None:
        self._target(sys._getframe(1)).default_pg = value

    @property
    def pg_map(self) -> Any:
        return self._target(sys._getframe(1)).pg_map

    @property
    def pg_group_ranks(self) -> Any:
        return self._target(sys._getframe(1)).pg_group_ranks

    @property
    def pg_names(self) -> Any:
        return self._target(sys._getframe(1)).pg_names

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target(sys._getframe(1)), name, value)


def _from_module_body(frame) -> bool:
    """Whether c10d's state is read by the top-level code of a module being imported,
    directly or through ``group.WORLD`` (torch evaluates ``group=group.WORLD`` default
    arguments at import time). Such a read gets the process's own state: a module
    imported on a rank thread must not capture that rank's group, nor start it mid-import."""
    return frame.f_code.co_name == "<module>" or (
        frame.f_back is not None and frame.f_back.f_code.co_name == "<module>")


class _NoStore(dist.Store):
    """The store of the default group. The "simcomm" backend needs none; a backend that
    does (``dist.new_group(backend="gloo")``) would block in it where the simulator cannot
    see, so every use raises instead."""

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError(
            f"only the {BACKEND_NAME!r} backend runs on virtual ranks: a process group of "
            f"another backend (e.g. new_group(backend='gloo')) cannot be created inside "
            f"World.run")

    set = get = add = wait = compare_set = check = delete_key = num_keys = _refuse
    set_timeout = append = multi_get = multi_set = _refuse


class _RunGroups:
    """The simulator groups behind one run's c10d groups, shared by the rank threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.groups: dict[tuple, Group] = {}
        self.store = _NoStore()

    def group(self, key: tuple, ranks: tuple[int, ...]) -> Group:
        with self.lock:
            group = self.groups.get(key)
            if group is None:
                group = self.groups[key] = Group(("c10d", *key), ranks)
            return group


def _groups_of(state: RunState) -> _RunGroups:
    with _install_lock:
        groups = _run_groups.get(state)
        if groups is None:
            groups = _run_groups[state] = _RunGroups()
        return groups


class _RankContext:
    """What one rank thread needs to build its process groups on first use."""

    __slots__ = ("transport", "world")

    def __init__(self, transport: SimTransport):
        self.transport = transport
        self.world: _RankWorld | None = None

    @property
    def state(self) -> RunState:
        return self.transport.state

    def initialize(self) -> None:
        """Create this rank's default process group (the whole world, backend "simcomm")."""
        global _active, _multithreading_ctx
        self.world = _RankWorld()
        with _install_lock:
            if _active == 0:
                torch._C._distributed_c10d._set_thread_isolation_mode(True)
                if self.state.device.type != "cpu":
                    # backward must run on the rank thread that called it, as on one process
                    _multithreading_ctx = torch.autograd.set_multithreading_enabled(False)
            _active += 1
        # init_process_group also sets process-wide things (sys.excepthook with a rank
        # prefix, the module's _backend): keep them as they were for the rest of the process
        saved = (sys.excepthook, c10d._backend, c10d._default_pg_init_method)
        try:
            dist.init_process_group(BACKEND_NAME, rank=self.transport.global_rank,
                                    world_size=len(self.state.world.ranks),
                                    store=_groups_of(self.state).store)
        finally:
            sys.excepthook, c10d._backend, c10d._default_pg_init_method = saved

    def transport_for(self, global_ranks: list[int], group_rank: int, group_name: str) -> SimTransport:
        """The simulator transport of this rank in the c10d group of ``global_ranks``
        (``[]``: the default group, which shares the communicator's transport, so
        ``comm.*`` and ``dist.*`` calls on the world are one sequence as on real processes)."""
        if not global_ranks:
            return self.transport
        ranks = tuple(global_ranks)
        group = _groups_of(self.state).group((group_name, ranks), ranks)
        # the rank's pending handles and trace recorder are shared by all its groups: a Work
        # of any group never waited on is reported when the program returns
        return SimTransport(self.state, group, group_rank, self.transport.pending,
                            self.transport.recorder)

    def close(self) -> None:
        global _active, _multithreading_ctx
        if self.world is None:
            return
        try:
            if self.world.default_pg is not None:
                dist.destroy_process_group()
        finally:
            with _install_lock:
                _active -= 1
                if _active == 0:
                    torch._C._distributed_c10d._set_thread_isolation_mode(False)
                    if _multithreading_ctx is not None:
                        _multithreading_ctx.__exit__(None, None, None)
                        _multithreading_ctx = None


def current_context() -> _RankContext:
    """The calling rank thread's context (raises outside a World run)."""
    context = getattr(_local, "rank", None)
    if context is None:
        raise RuntimeError(f"the {BACKEND_NAME!r} torch.distributed backend only runs inside "
                           f"simcomm.World.run, on a rank thread")
    return context


def _install() -> None:
    """Register the backend and put the switch in place of ``_world``: once, and again
    if other code (e.g. PyTorch's threaded process group) has replaced it since."""
    global _switch
    with _install_lock:
        if c10d._world is not _switch:
            from .process_group import register
            register()
            _switch = _WorldSwitch(c10d._world)
            c10d._world = _switch


class rank_process_group:  # noqa: N801 - used as a function: ``with rank_process_group(comm):``
    """torch.distributed for the rank running ``comm``'s program, for the length of the block.

    Inside the block ``dist.is_initialized()`` is true on this thread, the
    default group is the world (backend ``"simcomm"``), and every c10d call
    runs on the simulator. The group is created on first use, so a program
    that never touches torch.distributed pays only for this object; on exit
    (also after an error or an abort) every process group of this rank is
    destroyed.
    """

    __slots__ = ("_context",)

    def __init__(self, comm: Communicator):
        if c10d._world is not _switch:
            _install()
        self._context = _RankContext(comm.transport)

    def __enter__(self) -> None:
        _local.rank = self._context

    def __exit__(self, *exc_info) -> None:
        try:
            self._context.close()
        finally:
            _local.rank = None
