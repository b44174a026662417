"""The simulator's per-rank torch.distributed world: each virtual rank thread sees its own c10d world.

``torch.distributed`` keeps its process groups in one module-level object,
``torch.distributed.distributed_c10d._world``, and its C++ group registry
(``resolve_process_group``, used by the functional collectives) is
process-wide too. Virtual ranks are threads of one process, so both must
be per thread:

* ``_WorldSwitch`` replaces ``_world`` once; every attribute access is
  forwarded to the calling rank thread's own ``_RankWorld``, or to
  the original object on any other thread (the main thread keeps its
  ordinary torch.distributed);
* ``_set_thread_isolation_mode(True)`` makes the C++ registry per thread
  while at least one rank thread has torch.distributed initialised.

The default group of a rank is created lazily, on the program's first use
of torch.distributed, so a program that never touches it pays only for a
thread-local assignment. Everything is torn down when the rank's program
ends (returns, raises or is aborted): nothing survives into the next run.

A program's own ``dist.init_process_group(...)`` (every torchrun script has
one) joins the rank's world when its arguments agree with the run, and raises
naming what disagrees otherwise
(:func:`simcomm.c10d.init_join.install_init_join`; real workers install the same rule). Top-level code of a script run as ``__main__`` on a
rank thread gets the rank's state; only modules being imported get the
process's (``_from_module_body``).
"""
from __future__ import annotations

import functools
import sys
import threading
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..c10d.init_join import check_init_arguments, install_init_join, original_init_process_group
from ..c10d.process_group import BACKEND_NAME, register
from ..communicator import Communicator
from ..errors import Aborted, CollectiveMismatchError
from ..reports import local_group_mismatch
from .cuda_map import mesh_device_type
from .process_state import inherit_thread_local
from .rendezvous import Group
from .scheduler import RunState
from .store import RunStore
from .transport import SimTransport

__all__ = ["rank_process_group", "mesh_identity", "current_context"]

_local = threading.local()          # .rank: the _RankContext of a rank thread with a program running
inherit_thread_local(_local, "rank")   # and of the threads it starts
_install_lock = threading.Lock()
_switch: _WorldSwitch | None = None
_active = 0                          # rank threads with torch.distributed initialised, all runs
_multithreading_ctx = None
_run_groups: weakref.WeakKeyDictionary[RunState, _RunGroups] = weakref.WeakKeyDictionary()


class _RankWorld(c10d._World):
    """The c10d state of one rank thread: the fields that ``_World`` keeps in module
    globals (and behind properties) are plain attributes of this object, so c10d's
    reads on every call cost one attribute lookup."""

    # plain class attributes in place of _World's properties: the instance's own values win
    default_pg = pg_map = pg_names = pg_group_ranks = pg_backend_config = None
    tags_to_pg = pg_to_tag = pg_coalesce_state = comms = group_count = None

    def __init__(self) -> None:
        super().__init__()
        self.default_pg = None
        self.pg_map, self.pg_names, self.pg_group_ranks, self.pg_backend_config = {}, {}, {}, {}
        self.tags_to_pg, self.pg_to_tag = {}, {}
        self.pg_coalesce_state, self.comms = self._pg_coalesce_state, self._comms
        self.group_count = 0


def _forwarded(name: str) -> property:
    """``_WorldSwitch.<name>``: the calling rank's field, found without a failed lookup first.

    The common case, a rank thread with its world made and a caller that is not module
    code, is decided here on the spot; anything else goes to :meth:`_WorldSwitch._target`."""

    def get(switch: _WorldSwitch) -> Any:
        context = getattr(_local, "rank", None)
        if context is not None and context.world is not None:
            frame = sys._getframe(1)
            caller = frame.f_back
            if frame.f_code.co_name != "<module>" and (caller is None or caller.f_code.co_name != "<module>"):
                return getattr(context.world, name)    # what _target would find: not a module body
        return getattr(switch._target(sys._getframe(1)), name)

    return property(get, doc=f"The calling rank thread's ``{name}`` (the process's elsewhere).")


class _WorldSwitch:
    """Stands in for ``distributed_c10d._world``: forwards to the calling thread's world.

    Reads of the fields c10d uses on (nearly) every call are properties (:func:`_forwarded`); any
    other attribute goes through ``__getattr__``; every assignment through ``__setattr__``."""

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

    default_pg = _forwarded("default_pg")
    pg_map = _forwarded("pg_map")
    pg_names = _forwarded("pg_names")
    pg_group_ranks = _forwarded("pg_group_ranks")
    pg_backend_config = _forwarded("pg_backend_config")
    group_count = _forwarded("group_count")
    tags_to_pg = _forwarded("tags_to_pg")
    pg_to_tag = _forwarded("pg_to_tag")
    pg_coalesce_state = _forwarded("pg_coalesce_state")

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target(sys._getframe(1)), name, value)


def _from_module_body(frame) -> bool:
    """Whether c10d's state is read by the top-level code of a module *being imported*,
    directly or through ``group.WORLD`` (torch evaluates ``group=group.WORLD`` default
    arguments at import time). Such a read gets the process's own state: a module
    imported on a rank thread must not capture that rank's group, nor start it mid-import.

    A script's top level run as ``__main__`` (runpy, ``exec``) is module code too, but
    not an import: its reads (``dist.destroy_process_group()`` at the end of a torchrun
    script) are the rank's, as they are a process's on a real run. The import system
    runs a module's code from ``importlib._bootstrap``; that caller tells them apart."""
    for candidate in (frame, frame.f_back):
        if candidate is not None and candidate.f_code.co_name == "<module>":
            caller = candidate.f_back
            return caller is not None and "importlib._bootstrap" in caller.f_code.co_filename
    return False


class _RunGroups:
    """The simulator groups behind one run's c10d groups, shared by the rank threads."""

    def __init__(self, state: RunState) -> None:
        self.lock = threading.Lock()
        self.groups: dict[tuple, Group] = {}
        #: the store of every c10d group of the run (c10d's store barrier uses it)
        self.store = RunStore(state)

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
            groups = _run_groups[state] = _RunGroups(state)
        return groups


class _RankContext:
    """What one rank thread needs to build its process groups on first use."""

    __slots__ = ("transport", "world", "meetings", "backend")

    def __init__(self, transport: SimTransport):
        self.transport = transport
        self.world: _RankWorld | None = None
        #: the backend the program's init_process_group asked for (None: "simcomm" is the answer)
        self.backend: str | None = None
        #: where the members of each group made by its members only meet (agree_on_local_group)
        self.meetings: dict[tuple[int, ...], SimTransport] = {}

    @property
    def state(self) -> RunState:
        return self.transport.state

    def initialize(self) -> None:
        """Give this rank its own c10d world and create its default process group (the whole
        world, backend "simcomm"), unless the run's programs create it themselves
        (``RunState.explicit_init``: a torchrun script's ``init_process_group``)."""
        global _active, _multithreading_ctx
        self.world = _RankWorld()
        with _install_lock:
            if _active == 0:           # simcomm.patches: "c10d-thread-isolation"
                torch._C._distributed_c10d._set_thread_isolation_mode(True)
                if self.state.device.type != "cpu":
                    # backward must run on the rank thread that called it, as on one process
                    _multithreading_ctx = torch.autograd.set_multithreading_enabled(False)
            _active += 1
        if not self.state.explicit_init:
            self.create_default_group()

    def create_default_group(self) -> None:
        """The default group of this rank: at first use, and again if the program destroyed
        it and calls ``init_process_group`` once more (as a process may)."""
        # init_process_group also sets process-wide things (sys.excepthook with a rank
        # prefix, the module's _backend): keep them as they were for the rest of the process
        saved = (sys.excepthook, c10d._backend, c10d._default_pg_init_method)   # simcomm.patches: "c10d-init-globals"
        store = _groups_of(self.state).store
        # The run is the default group's rendezvous: every rank is in it from the start.
        # So c10d's store barrier at the end of init (TORCH_DIST_INIT_BARRIER=1) passes at
        # once, as on real processes that all called init_process_group, also on a rank
        # whose peers create their group later or never (it is created on first use).
        # c10d names the default group by its world's group count (_process_group_name).
        store.set(f"{c10d.STORE_BASED_BARRIER_PREFIX}:{c10d._world.group_count}:last_worker", "1")
        try:
            original_init_process_group(BACKEND_NAME, rank=self.transport.global_rank,
                                         world_size=len(self.state.world.ranks), store=store)
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

    def agree_on_local_group(self, global_ranks: list[int], name: str, location: str) -> None:
        """Meet the other members of a group they make by themselves
        (``use_local_synchronization=True``), as gloo's members meet in its store when the group
        is created: a member that never comes is a DeadlockError, members that named the group
        differently a CollectiveMismatchError on every member (:data:`~simcomm.reports.LOCAL_GROUP_NAMES`),
        in the words of real workers' checked mode. Not traced (workers trace no creation)."""
        ranks = tuple(global_ranks)
        meeting = self.meetings.get(ranks)
        if meeting is None:
            group = _groups_of(self.state).group((("creating", ranks),), ranks)
            meeting = self.meetings[ranks] = SimTransport(
                self.state, group, ranks.index(self.transport.global_rank), self.transport.pending, None)

        def compare(step: int, entries: list) -> list:
            text = local_group_mismatch(ranks, step, entries)
            if text is not None:
                self.state.abort(CollectiveMismatchError(text))
                raise Aborted from None
            return [None] * len(entries)

        meeting.meet("new_group", (name, location), compare, sys._getframe(1))

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
    """Register the backend, put the switch in place of ``_world`` and let
    ``init_process_group`` join a run: once, and again if other code (e.g. PyTorch's
    threaded process group) has replaced ``_world`` since."""
    global _switch
    with _install_lock:
        if c10d._world is not _switch:
            register(current_context)
            _switch = _WorldSwitch(c10d._world)
            c10d._world = _switch          # simcomm.patches: "c10d-world"
        _install_mesh_identity()
        _install_get_backend()
    install_init_join(thread_join=_join_on_rank_thread)


_original_get_backend = c10d.get_backend


@functools.wraps(_original_get_backend)
def _get_backend(group=None):
    """torch's ``get_backend``; on a rank whose program asked ``init_process_group`` for a
    backend (``RunState.explicit_init``), the simulator's groups answer with that name, as the
    program's groups would on real processes."""
    answer = _original_get_backend(group)
    context = getattr(_local, "rank", None)
    if context is not None and context.backend is not None and answer == BACKEND_NAME:
        return dist.Backend(context.backend)
    return answer


def _install_get_backend() -> None:
    """Put :func:`_get_backend` in torch's place (once per process; called with ``_install_lock``)."""
    if c10d.get_backend is not _get_backend:
        c10d.get_backend = dist.get_backend = _get_backend   # simcomm.patches: "get-backend"


# -- each rank's DeviceMeshes are its own --------------------------------------------------------

_mesh_identity_installed = False


def mesh_identity(rank: int) -> int:
    """What a ``DeviceMesh`` made on virtual rank ``rank`` holds in ``_thread_id``: negative,
    so it is never a thread's id (PyTorch's threaded process group puts those there), and
    below -1 (``hash(-1) == hash(-2)`` in CPython: ranks 0 and 1 would hash alike)."""
    return -2 - rank


def _install_mesh_identity() -> None:
    """Make ``DeviceMesh`` objects of different virtual ranks unequal (and hash apart); on a rank
    with virtual GPUs a ``"cuda"`` mesh is made on the World's device (:func:`simcomm.sim.cuda_map.mesh_device_type`).

    A mesh compares and hashes by its ranks, layout, device type, dim names and
    ``_thread_id``, and torch sets ``_thread_id`` only when the default group's
    backend is named "threaded". Process-wide caches keyed on meshes (DTensor's
    sharding propagation, ``redistribute``'s transform infos and planners) would
    otherwise hand one rank's rank-dependent answer (its shard's shape, its
    coordinate) to every other rank. So every mesh made on a rank thread gets
    that rank's :func:`mesh_identity` in ``_thread_id``, as one process per rank
    keeps its caches to itself. Meshes made elsewhere are unchanged. Once per
    process; called with ``_install_lock`` held.
    """
    global _mesh_identity_installed
    if _mesh_identity_installed:
        return
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:   # noqa: N807 - DeviceMesh's own
        if args:                            # virtual GPUs: a "cuda" mesh is on the World's device
            args = (mesh_device_type(args[0]), *args[1:])
        elif "device_type" in kwargs:
            kwargs = {**kwargs, "device_type": mesh_device_type(kwargs["device_type"])}
        original(self, *args, **kwargs)
        context = getattr(_local, "rank", None)
        if context is not None and getattr(self, "_thread_id", None) is None:
            self._thread_id = mesh_identity(context.transport.global_rank)
            self._hash = None   # computed lazily from _thread_id too

    DeviceMesh.__init__ = __init__          # simcomm.patches: "mesh-identity"
    _mesh_identity_installed = True


# -- init_process_group inside a run ------------------------------------------------------------

def _join_on_rank_thread(backend: Any, world_size: int, rank: int, init_method: Any,
                         timeout: Any = None) -> bool:
    """A program's ``init_process_group`` on a virtual rank's thread joins the rank's world
    (:func:`simcomm.c10d.init_join.install_init_join`): True when the caller is a rank thread.

    With ``RunState.explicit_init`` (``python -m simcomm.run``) the call creates the rank's
    default group, as torch's does: a second call raises torch's ``ValueError``, and
    ``dist.get_backend()`` answers ``backend``. ``timeout`` (a ``timedelta``) is the time the
    rank may wait in one call of its groups before it raises, as gloo's does
    (:meth:`~simcomm.sim.scheduler.RunState.note_group_timeout`)."""
    context = getattr(_local, "rank", None)
    if context is None:
        return False
    state = context.state
    check_init_arguments(backend, world_size, rank, init_method, context.transport.global_rank,
                         len(state.world.ranks), nccl=dist.is_nccl_available()
                         or state.device.type == "cuda" or state.shape_only
                         or getattr(state, "map_cuda", False))   # virtual GPUs: "nccl" joins as "gloo"
    if context.world is None:
        context.initialize()
    elif state.explicit_init and context.world.default_pg is not None:
        raise ValueError("trying to initialize the default process group twice!")   # torch's words
    if context.world.default_pg is None:
        context.create_default_group()
        if state.explicit_init:
            # dist.get_backend() answers the backend the program asked for, as torch's does
            # (monitored_barrier and other backend checks read it); the group is the simulator's
            # (a torch without NCCL, virtual GPUs: "nccl" answers "gloo", or torch's checks of it
            # would reach for NCCL's own functions)
            name = str(dist.Backend(backend or "undefined"))
            if not dist.is_nccl_available():
                name = name.replace("nccl", "gloo")
            context.backend = name
    if timeout is not None:
        state.note_group_timeout(context.transport.global_rank, timeout)
    return True


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
