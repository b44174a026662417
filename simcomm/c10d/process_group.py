"""The ``"simcomm"`` c10d backend: a ProcessGroup whose every call runs on the simulator.

c10d hands a backend output buffers to fill in place (``dist.all_reduce(t)``
overwrites ``t``). Each method of :class:`SimcommProcessGroup` is a thin
adapter around ONE translation function of :mod:`simcomm.c10d.ops`, which
issues the call on the rank's transport for the group (any
:class:`~simcomm.transport.Transport`: the simulator's on virtual ranks, a real worker's in
:mod:`real.checked_pg`). The simulator therefore traces the call, checks that every rank
issues the same one (CollectiveMismatchError) and sees every wait
(DeadlockError), exactly as for the communicator's own calls.

Blocking or not is decided as c10d decides it: a collective whose options say
``asyncOp=False`` (``dist.*`` without ``async_op=True``, which waits at once)
and ``dist.send``/``dist.recv`` block in the simulator and return a completed
``Work``; every other call (``async_op=True``, ``isend``/``irecv``,
``batch_isend_irecv``, calls from torch's C++ code such as DDP's reducer and
the functional collectives) is issued asynchronously and returns a
:class:`~simcomm.c10d.work.SimcommWork` backed by the simulator's handles.
"""
from __future__ import annotations

import inspect
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from collections.abc import Callable
from typing import Any

from ..reports import program_location
from ..trace import backward_phase
from ..transport import Transport
from . import ops
from .dispatch import dispatched, modes_active
from .work import SimcommWork, done

__all__ = ["SimcommProcessGroup", "register", "install_group_tags", "claim_cuda", "served_devices", "BACKEND_NAME"]

BACKEND_NAME = "simcomm"

#: torch's backend that communicates nothing (``dist.Backend.FAKE``)
FAKE_BACKEND = "fake"

#: the calling rank thread's group maker (``register``'s argument: the simulator's per-rank
#: context, with ``transport_for`` and ``agree_on_local_group``); None until registered
_rank_groups: Callable[[], Any] | None = None


def _current_groups() -> Any:
    """The calling rank thread's group maker (raises outside a run of virtual ranks)."""
    if _rank_groups is None:
        raise RuntimeError(f"the {BACKEND_NAME!r} torch.distributed backend only runs inside "
                           f"simcomm.World.run, on a rank thread")
    return _rank_groups()

#: the code of ``dist.send``/``dist.recv``: they issue ``isend``/``irecv`` and wait at once
_BLOCKING_P2P = frozenset(inspect.unwrap(function).__code__ for function in (c10d.send, c10d.recv))


def _async(opts) -> bool:
    """Whether the caller may go on before the call completes (c10d's ``asyncOp`` option;
    options built in C++ leave it at its default, True)."""
    return opts is None or opts.asyncOp


def _p2p_async(frame) -> bool:
    """Whether a send/recv reached the process group from ``dist.send``/``dist.recv`` (which
    call ``isend``/``irecv`` and wait at once: blocking) or from anywhere else (async).
    ``frame`` is the process group method's; those two are at most three callers up."""
    for _ in range(3):
        frame = frame.f_back
        if frame is None:
            return True
        if frame.f_code in _BLOCKING_P2P:
            return False
    return True


class SimcommProcessGroup(dist.ProcessGroup):
    """One rank's c10d process group over a simulator group.

    ``rank()``/``size()`` are the group-local rank and size c10d expects;
    ``transport`` is the rank's simulator transport in this group.
    """

    def __init__(self, transport: Transport):
        super().__init__(transport.rank, transport.world_size)
        self.transport = transport
        self._name = ""
        self._desc = ""
        world_device = getattr(transport, "device", None)
        if world_device is not None and torch.device(world_device).type == "cuda":
            self._devices = [torch.device("cuda")]         # a World on a real GPU: as NCCL's groups
        else:
            self._devices = [torch.device(device) for device in served_devices()]

    @property
    def _device_types(self) -> list[torch.device]:
        """The device types the group serves: ``cpu``, and ``cuda`` where the backend claimed it
        when the group was made (:func:`served_devices`); ``cuda`` alone for a World on a real GPU
        (its tensors are CUDA tensors, as NCCL's groups serve).

        c10d answers this from the backends registered with a group (gloo's: cpu and cuda,
        NCCL's: cuda); this group is its own backend, so it answers itself. torch reads it for
        a group's default device (``_get_pg_default_device``: cpu wherever cpu is served, as
        for gloo), e.g. FSDP1's sharded state dict places its ShardedTensor shards there. On
        virtual GPUs that is cpu where NCCL's is cuda: a virtual GPU's tensors are CPU
        tensors, and ShardedTensor checks each shard's device against its placement."""
        return list(self._devices)

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def group_desc(self) -> str:
        return self._desc

    def getBackendName(self) -> str:
        return BACKEND_NAME

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"SimcommProcessGroup(rank={self.transport.rank}, ranks={list(self.transport.ranks)})"

    def shutdown(self) -> None:
        return None

    # -- new groups (c10d hands ``dist.new_group`` to a default group that implements it) --

    def new_group(self, ranks, timeout=None, pg_options=None, group_name=None, group_desc=None):
        """``dist.new_group(ranks)``: the process group of ``ranks`` (global), ``None`` off it.

        c10d calls this on the default group (the world). Unless the caller asked for
        ``use_local_synchronization=True`` (then only the members call, and c10d names the
        group by a hash of its ranks), every rank of the world must call it with the same
        ranks, as torch requires: the call is the world's collective ``subgroup`` with the
        parts ``(ranks, the other ranks)``, checked and traced like ``comm.subgroup``, so a
        rank that names other ranks, or never calls, is a CollectiveMismatchError or a
        DeadlockError on both backends, never a hang. The parts are compared as a partition,
        so ranks that each name their own part (``c10d._find_or_create_pg_by_ranks_and_tag``:
        ranks 0 and 1 ask for ``[0, 1]`` while ranks 2 and 3 ask for ``[2, 3]``) agree, as c10d
        lets them. Each call makes a group of its own, even with the same ranks as another (or
        as the world), except one given a ``pg_tag`` (``c10d._new_group_with_tag``) under which
        the rank already has a group of these ranks: that group is returned, as c10d returns
        it (the call is still the world's ``subgroup`` step, which the other ranks take too).
        """
        backend, tag = _new_group_call(sys._getframe(1))
        ranks = [int(rank) for rank in ranks]
        me = self.transport.global_rank
        name = "" if group_name is None else str(group_name)
        if backend is not None and backend.lower() == FAKE_BACKEND:
            return _fake_group(ranks, me, name, "undefined" if group_desc is None else str(group_desc),
                               timeout, pg_options)
        self._check_backend(backend)
        if name.isdigit():                       # world-synchronised: a collective of the world
            others = tuple(rank for rank in self.transport.ranks if rank not in ranks)
            local = {rank: index for index, rank in enumerate(self.transport.ranks)}
            parts = (tuple(local[rank] for rank in ranks),) + ((tuple(local[r] for r in others),) if others else ())
            if others and parts[1][0] < parts[0][0]:  # the same partition, whichever part a rank names
                parts = parts[::-1]
            # one copy of the partition for every rank that passes it (checks.PartitionTable)
            child = self.transport.subgroup(self.transport.partitions.check(
                "new_group", parts, self.transport.world_size, self.transport.rank))
            if me not in ranks:
                return None
            existing = _tagged_group(tag, ranks)
            if existing is not None:
                return existing
            group = self._wrap_subgroup(child)
        else:
            if me not in ranks:
                return None
            existing = _tagged_group(tag, ranks)
            if existing is not None:
                return existing
            group = self._local_subgroup(ranks, name, program_location(sys._getframe(1)))
        group._set_group_name(name)
        group._set_group_desc("" if group_desc is None else str(group_desc))
        return group

    def _check_backend(self, backend: str | None) -> None:
        """Refuse a ``new_group(backend=...)`` this process group cannot serve: on virtual
        ranks every group is a "simcomm" group (a gloo group would block in its store where
        the simulator cannot see), or a ``"fake"`` one (:func:`_fake_group`)."""
        if backend is not None and backend.lower() != BACKEND_NAME:
            raise NotImplementedError(
                f"only the {BACKEND_NAME!r} backend runs on virtual ranks: a process group of "
                f"another backend (e.g. new_group(backend={backend!r})) cannot be created inside "
                f"World.run")

    def _wrap_subgroup(self, transport) -> SimcommProcessGroup:
        """The process group over ``transport``, a subgroup transport of this group's."""
        return type(self)(transport)

    def _local_subgroup(self, ranks: list[int], name: str, location: str) -> SimcommProcessGroup:
        """The process group of ``ranks`` made by its members only (``use_local_synchronization``),
        once they have met and agree on its name."""
        context = _current_groups()
        context.agree_on_local_group(ranks, name, location)
        transport = context.transport_for(ranks, ranks.index(self.transport.global_rank), name)
        return type(self)(transport)

    def abort(self) -> None:
        return None

    def _submit(self, translate, *args, async_op: bool, route: tuple | None = None) -> dist.Work:
        """Issue a translation; for a blocking call the one completed Work
        (:func:`~simcomm.c10d.work.done`), a SimcommWork else.

        ``route`` (``(method, c10d's arguments)``): while a dispatch mode is active, the
        call goes through the dispatcher's c10d op of that C++ ``ProcessGroup`` method
        (:mod:`simcomm.c10d.dispatch`), so the mode sees it as on a native backend.

        A call made while autograd's engine runs a backward pass on this thread (a
        node, a hook, or a callback queued for the end of the pass, as FSDP's gradient
        reduce-scatter and DDP's all-reduce are) is traced as backward.
        """
        if route is not None and modes_active() and not _shape_only(self.transport):
            method, c10d_args = route   # through the dispatcher's c10d op (simcomm.c10d.dispatch)
            return dispatched(self, method, tuple(arg for arg in c10d_args if arg is not None),
                              lambda: self._submit(translate, *args, async_op=async_op))
        if torch._C._current_graph_task_id() != -1:
            with backward_phase():
                issued = translate(self.transport, *args, async_op)
        else:
            issued = translate(self.transport, *args, async_op)
        if async_op:
            return SimcommWork(issued, translate.__name__)
        issued.finish(issued.calls)
        return done()

    # -- collectives (c10d's Python names and the C++ names call the same translation) --
    # ``route``: the method of a C++ ProcessGroup that dispatches the same c10d op, and its arguments

    def allreduce(self, tensors, opts=None):
        return self._submit(ops.all_reduce, tensors, opts, async_op=_async(opts),
                            route=("allreduce", (tensors, opts)))

    def allreduce_coalesced(self, tensors, opts=None):
        return self._submit(ops.all_reduce, tensors, opts, async_op=_async(opts),
                            route=("allreduce_coalesced", (tensors, opts)))

    def allgather(self, output_lists, input_tensors, opts=None):
        return self._submit(ops.all_gather_list, output_lists, input_tensors, async_op=_async(opts),
                            route=("allgather", (output_lists, input_tensors, opts)))

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        return self._submit(ops.all_gather_list, output_lists, input_tensors, async_op=_async(opts),
                            route=("allgather_coalesced", (output_lists, input_tensors, opts)))

    def all_gather_single(self, output, input_, opts=None):
        return self._submit(ops.all_gather_into_tensor, [output], [input_], async_op=_async(opts),
                            route=("_allgather_base", (output, input_, opts)))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._submit(ops.all_gather_into_tensor, outputs, inputs, async_op=_async(opts),
                            route=("allgather_into_tensor_coalesced", (outputs, inputs, opts)))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self._submit(ops.reduce_scatter_list, outputs, input_lists, opts, async_op=_async(opts),
                            route=("reduce_scatter", (outputs, input_lists, opts)))

    def reduce_scatter_single(self, output, input_, opts=None):
        return self._submit(ops.reduce_scatter_tensor, [output], [input_], opts, async_op=_async(opts),
                            route=("_reduce_scatter_base", (output, input_, opts)))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return self._submit(ops.reduce_scatter_tensor, outputs, inputs, opts, async_op=_async(opts),
                            route=("reduce_scatter_tensor_coalesced", (outputs, inputs, opts)))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input_, output_split_sizes, input_split_sizes, opts=None):
        rank = self.transport.rank
        output_split_sizes = _sizes(output_split_sizes, "output_split_sizes", rank)
        input_split_sizes = _sizes(input_split_sizes, "input_split_sizes", rank)
        return self._submit(ops.all_to_all_single, output, input_, output_split_sizes,
                            input_split_sizes, async_op=_async(opts),
                            route=("alltoall_base", (output, input_, output_split_sizes, input_split_sizes, opts)))

    alltoall_base = all_to_all_single

    def alltoall(self, output_list, input_list, opts=None):
        return self._submit(ops.all_to_all_list, output_list, input_list, async_op=_async(opts),
                            route=("alltoall", (output_list, input_list, opts)))

    def broadcast(self, tensors, opts=None):
        return self._submit(ops.broadcast, tensors, opts.rootRank, async_op=_async(opts),
                            route=("broadcast", (tensors, opts)))

    def reduce(self, tensors, opts=None):
        return self._submit(ops.reduce, tensors, opts, async_op=_async(opts), route=("reduce", (tensors, opts)))

    def gather(self, output_lists, input_tensors, opts=None):
        return self._submit(ops.gather, output_lists, input_tensors, opts.rootRank, async_op=_async(opts),
                            route=("gather", (output_lists, input_tensors, opts)))

    def scatter(self, outputs, input_lists, opts=None):
        return self._submit(ops.scatter, outputs, input_lists, opts.rootRank, async_op=_async(opts),
                            route=("scatter", (outputs, input_lists, opts)))

    def barrier(self, opts=None):
        return self._submit(ops.barrier, async_op=_async(opts), route=("barrier", (opts,)))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        self._submit(ops.barrier, async_op=False)

    # -- point to point --

    def send(self, tensors, dst, tag=0):
        return self._submit(ops.send, tensors, dst, tag, async_op=_p2p_async(sys._getframe()),
                            route=("send", (tensors, dst, tag)))

    def recv(self, tensors, src, tag=0):
        return self._submit(ops.recv, tensors, src, tag, async_op=_p2p_async(sys._getframe()),
                            route=("recv", (tensors, src, tag)))

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError(
            f"recv_anysource (dist.recv without src) is not supported by the {BACKEND_NAME!r} "
            f"backend; pass src=")

    # -- the rest of ProcessGroup's surface --

    def _start_coalescing(self, device):
        raise NotImplementedError(f"coalescing (dist._coalescing_manager) is not supported by the "
                                  f"{BACKEND_NAME!r} backend")

    def _end_coalescing(self, device):
        raise NotImplementedError(f"coalescing (dist._coalescing_manager) is not supported by the "
                                  f"{BACKEND_NAME!r} backend")

    def split_group(self, *args, **kwargs):
        raise NotImplementedError(f"split_group is not supported by the {BACKEND_NAME!r} backend; "
                                  f"use dist.new_group")

    def merge_remote_group(self, *args, **kwargs):
        raise NotImplementedError(f"merge_remote_group is not supported by the {BACKEND_NAME!r} backend")


def _sizes(split_sizes, argument: str, rank: int) -> list:
    """``dist.all_to_all_single``'s split sizes as a list (none: ``[]``). A tensor is refused as
    torch's C++ ProcessGroup refuses it on gloo and NCCL (its binding takes a sequence of ints, and
    raises TypeError "incompatible function arguments"); PyTorch's threaded test group, a Python
    group, takes one."""
    if split_sizes is None:
        return []
    if isinstance(split_sizes, torch.Tensor):
        raise TypeError(f"all_to_all_single: rank {rank}'s {argument} is a tensor ({split_sizes!r}); "
                        f"torch's process groups (gloo, NCCL) take a sequence of ints: pass "
                        f"{argument}.tolist()")
    return list(split_sizes)


def _shape_only(transport) -> bool:
    """Whether ``transport`` belongs to a shape-only run of virtual ranks (real workers' are never)."""
    state = getattr(transport, "state", None)
    return state is not None and state.shape_only


def _new_group_call(frame) -> tuple[str | None, str | None]:
    """The backend name ``dist.new_group`` resolved and the ``pg_tag`` it was given (c10d's
    ``_new_group_with_tag`` holds them in its locals ``backend`` and ``pg_tag``; c10d passes
    neither on to ``new_group``), each None where there is none."""
    while frame is not None and frame.f_code.co_name != "_new_group_with_tag":
        frame = frame.f_back
    if frame is None:
        return None, None
    values = frame.f_locals
    backend, tag = values.get("backend"), values.get("pg_tag")
    return (None if backend is None else str(backend)), (None if tag in (None, "") else str(tag))


def _tagged_group(tag: str | None, ranks: list[int]) -> dist.ProcessGroup | None:
    """The group of ``ranks`` this rank already has under ``tag`` (c10d's lookup), if a tag was
    given: c10d returns it for a second ``_new_group_with_tag(ranks, pg_tag=tag)`` rather than
    make another (``_new_process_group_helper``), for the groups it makes itself."""
    if tag is None:
        return None
    return c10d._find_pg_by_ranks_and_tag(tag, ranks)


def _fake_group(ranks: list[int], me: int, name: str, desc: str, timeout, pg_options) -> dist.ProcessGroup | None:
    """``dist.new_group(ranks, backend="fake")`` on a virtual rank: torch's own fake group,
    made as c10d makes it for a default group of gloo or NCCL, or None off ``ranks``.

    A fake group communicates nothing: each rank's collectives complete at once on its own
    tensors (torch's ``FakeProcessGroup``: ``all_reduce`` and ``broadcast`` leave the tensor
    as it is, ``all_gather`` copies the rank's input into every output, ``reduce_scatter``
    keeps the rank's own chunk, ``send``/``recv`` do nothing). DeviceMesh makes one for a
    mesh dimension given ``backend_override="fake"``. So, as on real processes, the group is
    made by each rank on its own (no rank waits for another, nothing is traced), and its
    collectives are torch's, unchanged. torch knows the name ``"fake"`` once
    ``torch.testing._internal.distributed.fake_pg`` is imported (``torch.distributed.fsdp``
    imports it); before that c10d's own error is raised, as for gloo.
    """
    if FAKE_BACKEND.upper() not in dist.Backend._plugins:
        raise AssertionError(f"Unknown c10d backend type {FAKE_BACKEND.upper()}")   # c10d's words
    if me not in ranks:
        return None
    group_rank = ranks.index(me)
    store = dist.PrefixStore(f"{name}/", dist.HashStore())   # the fake backend never reads it
    pg = dist.ProcessGroup(store, group_rank, len(ranks))
    pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    options = c10d._DistributedBackendOptions()
    options.store = store
    options.group_rank = group_rank
    options.group_size = len(ranks)
    options.timeout = timeout if timeout is not None else c10d.default_pg_timeout
    options.group_id = name
    options.global_ranks_in_group = ranks
    backend = dist.Backend._plugins[FAKE_BACKEND.upper()].creator_fn(options, pg_options)
    for device in c10d.BackendConfig(dist.Backend(FAKE_BACKEND)).get_device_backend_map():
        pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_group_name(name)
    pg._set_group_desc(desc)
    return pg


def _create(backend_options, _pg_options) -> SimcommProcessGroup:
    """c10d's backend constructor (extended API: it gets the group's global ranks)."""
    context = _current_groups()
    transport = context.transport_for(list(backend_options.global_ranks_in_group),
                                      backend_options.group_rank, backend_options.group_id)
    return SimcommProcessGroup(transport)


_torch_register_pg_in_world = getattr(c10d, "_register_pg_in_world", None)


def _register_pg_in_world(pg, *args, **kwargs):
    """c10d's ``_register_pg_in_world``, tagging a group that a simcomm default group made as c10d
    tags one it makes itself with a backend (gloo, NCCL).

    c10d hands ``new_group`` to a default group that implements it, and then registers the
    result under its own name's tag only, ignoring the ``pg_tag`` the caller gave; a group c10d
    makes itself also joins the default tag ``""`` (or, given a ``pg_tag``, ``"user:<tag>"``
    alone). A program can tell: the functional collectives find the group for a list of ranks
    under the default tag (``funcol.all_reduce(t, "sum", group=[0, 1])``).
    """
    if _made_by_simcomm_default(pg) and not ({"pg_tag", "user_tag", "add_to_default_tag"} & kwargs.keys()):
        caller = sys._getframe(1)
        if caller.f_code.co_name == "_new_group_with_tag":
            if pg in c10d._world.pg_map:      # the tagged group new_group returned again: c10d
                return None                   # registers it once (it keeps its name)
            tag = caller.f_locals.get("pg_tag")
            if tag in (None, ""):
                kwargs["add_to_default_tag"] = True
            else:
                kwargs["pg_tag"] = f"user:{tag}"
    return _torch_register_pg_in_world(pg, *args, **kwargs)


def _made_by_simcomm_default(pg) -> bool:
    """Whether ``pg`` is a group a simcomm default group made: a SimcommProcessGroup, or a fake
    group (:func:`_fake_group`) that c10d registers after the default group's ``new_group``."""
    if isinstance(pg, SimcommProcessGroup):
        return True
    default = c10d.GroupMember.WORLD
    return isinstance(default, SimcommProcessGroup) and pg is not default


def install_group_tags() -> None:
    """Put ``_register_pg_in_world`` in c10d's place (once per process)."""
    if _torch_register_pg_in_world is not None and c10d._register_pg_in_world is not _register_pg_in_world:
        c10d._register_pg_in_world = _register_pg_in_world   # simcomm.patches: "group-tags"


def register(rank_groups: Callable[[], Any]) -> None:
    """Make ``"simcomm"`` a torch.distributed backend name (once per process).

    ``rank_groups()``: the calling rank thread's group maker, which makes the transport of
    each group (``transport_for(global_ranks, group_rank, group_name)``) and lets the members
    of a group made by its members only meet (``agree_on_local_group(ranks, name, location)``);
    it raises outside a run."""
    global _rank_groups
    _rank_groups = rank_groups
    if BACKEND_NAME.upper() not in dist.Backend._plugins:    # simcomm.patches: "backend-name"
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=served_devices())


# -- the devices the backend claims ---------------------------------------------------------------

#: torch's own ``torch.cuda.is_available`` (taken at import, before any run could answer for
#: virtual GPUs): whether this process has real GPUs
_real_cuda_available = torch.cuda.is_available
#: how many virtual-GPU runs claim cuda now (:func:`claim_cuda`)
_cuda_claims = 0
_claims_lock = threading.Lock()


def served_devices() -> list[str]:
    """The device types the ``"simcomm"`` backend claims now: ``"cpu"``, and ``"cuda"`` where this
    process has real GPUs (torch's ``torch.cuda.is_available()``) or a run of virtual GPUs has
    claimed it (:func:`claim_cuda`).

    c10d keeps a backend's devices in ``Backend.backend_capability[name]`` (set by
    ``Backend.register_backend(..., devices=)``); ``BackendConfig`` reads it when a group is
    created (``dist.get_backend_config()`` answers ``"cpu:simcomm"`` or
    ``"cpu:simcomm,cuda:simcomm"``) and ``ShardedTensor`` reads it to choose the device of its
    collectives' buffers (the first device other than cpu that a backend not named gloo or
    nccl claims, else cpu), which DCP's ``gather`` of a ShardedTensor uses. So a backend that
    claimed cuda on a machine without GPUs made ShardedTensor ask for cuda ("Torch not compiled
    with CUDA enabled") where gloo's answer is cpu. ``register_backend`` also fills
    ``Backend.default_device_backend_map`` only for device types nobody has (cpu stays gloo's,
    cuda nccl's), so the backend never becomes the default of a device type: the capability is
    all it claims."""
    return ["cpu", "cuda"] if _real_cuda_available() or _cuda_claims > 0 else ["cpu"]


def claim_cuda(claim: bool) -> list[str]:
    """Claim (``True``) or give back (``False``) the ``"cuda"`` device type for the ``"simcomm"``
    backend, for the length of a run of virtual GPUs; returns :func:`served_devices` after.

    A run that gives its ranks virtual GPUs calls ``claim_cuda(True)`` before its ranks create
    their groups and ``claim_cuda(False)`` when it ends (also after an error): claims nest, and
    cuda stays claimed while one is held (and always where real GPUs exist). Groups created
    while cuda is claimed keep ``cuda:simcomm`` in their backend config, as a group keeps the
    config it was made with. Process-wide (``simcomm.patches``: ``"backend-devices"``); before
    the backend is registered the claim only decides what it registers with. Giving back a
    claim that was not made raises ``ValueError``.
    """
    global _cuda_claims
    with _claims_lock:
        if not claim and _cuda_claims == 0:
            raise ValueError("claim_cuda(False): no claim of cuda is held (each claim_cuda(True) "
                             "is given back once)")
        _cuda_claims += 1 if claim else -1
        devices = served_devices()
        if BACKEND_NAME.upper() in dist.Backend._plugins:
            dist.Backend.backend_capability[BACKEND_NAME] = devices   # simcomm.patches: "backend-devices"
    return devices


