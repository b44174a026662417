"""torch.distributed on real workers through the run's transport: checked, traced, one sequence with ``comm.*``.

A worker's default process group is an ordinary gloo (or NCCL) group. For the
length of one run, :class:`run_process_groups` puts a
:class:`RealProcessGroup` in its place as c10d's default group: the same
Python process group the simulator's ``"simcomm"`` backend uses
(:class:`simcomm.c10d.process_group.SimcommProcessGroup`: one translation of
:mod:`simcomm.c10d.ops` per c10d call), over the run's own transport, the
one the program's ``comm`` holds (a :class:`real.checked.CheckedTransport`
around a :class:`real.transport.DistTransport` in checked mode). So every
c10d call, also those torch's C++ code issues (DDP's reducer, FSDP2, the
functional collectives, DTensor), is

* checked across ranks before any data moves, with the words and program
  lines of the communicator's own calls (:mod:`real.checked`);
* traced op by op, as the simulator traces it;
* one sequence with the communicator's calls: rank 0's ``dist.all_reduce``
  meets rank 1's ``comm.all_reduce``, ``dist.send`` meets ``comm.recv``.

The call chain::

    dist.all_reduce(t) -> RealProcessGroup.allreduce -> simcomm.c10d.ops.all_reduce
      -> CheckedTransport.all_reduce (compare) -> DistTransport.all_reduce -> gloo

``dist.new_group`` is answered by the default group (c10d delegates to it):
a checked ``subgroup`` of the world whose gloo group comes from the worker's
:class:`real.groups.GroupCache` (kept for the next run, so a run that
makes groups leaks nothing; each call of a run gets a group of its own).
What the program sees is unchanged: ``dist.get_backend()`` is ``"gloo"``,
group names and ranks are torch's (``group.name()`` is ``"simcomm"``, as on
virtual ranks). When the run ends every group it created
is removed from c10d's state and the gloo world is the default group again.

``ReduceOp.PREMUL_SUM`` (gloo has none) is emulated: the input times the
factor, then SUM. Calls the simulator's backend does not serve
(``recv_anysource``, coalescing managers, tags) raise the same
``NotImplementedError`` here.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
from torch.distributed import distributed_c10d as c10d

from simcomm.c10d import ops
from simcomm.c10d.ops import Issued
from simcomm.c10d.process_group import SimcommProcessGroup

from real.groups import hide_from_program

__all__ = ["RealProcessGroup", "run_process_groups"]

_PREMUL_SUM = dist.ReduceOp.RedOpType.PREMUL_SUM


def _premul_factor(opts) -> float | torch.Tensor | None:
    """The factor of a ``PREMUL_SUM`` in ``opts`` (None for any other reduction)."""
    if opts is None or opts.reduceOp.op != _PREMUL_SUM:
        return None
    return opts.reduceOp.factor


def _as_sum(opts):
    """A copy of ``opts`` (all-reduce, reduce-scatter or reduce options) reducing with SUM."""
    out = type(opts)()
    for name in ("asyncOp", "timeout", "rootRank", "rootTensor"):
        if hasattr(opts, name):
            setattr(out, name, getattr(opts, name))
    out.reduceOp = dist.ReduceOp.SUM
    return out


def _scaled(tensor: torch.Tensor, factor) -> torch.Tensor:
    """``factor * tensor`` in ``tensor``'s dtype, a new tensor (the factor may be a 0-d tensor)."""
    factor = factor.to(tensor.device) if isinstance(factor, torch.Tensor) else factor
    return (tensor.detach() * factor).to(tensor.dtype)


class RealProcessGroup(SimcommProcessGroup):
    """The c10d process group of one real worker over a run's transport.

    ``transport`` is the run's transport of this group (checked or not);
    ``backend`` the name of the backend that moves the data (``"gloo"`` or
    ``"nccl"``: what ``dist.get_backend(group)`` answers). The process group's
    own ``name()`` is ``"simcomm"``, as on virtual ranks: torch's C++ code
    (DDP's logger) asks a group named ``"gloo"`` for its gloo backend object,
    which a Python process group does not have.
    """

    def __init__(self, transport, backend: str, data_group: dist.ProcessGroup | None = None):
        super().__init__(transport)
        self._backend = backend
        self._data_group = data_group if data_group is not None else transport.group

    @property
    def data_group(self) -> dist.ProcessGroup:
        """The backend's own process group that moves this group's data (a
        :class:`real.transport.DistTransport` made from this group uses it)."""
        return self._data_group

    def __repr__(self) -> str:
        return f"RealProcessGroup(rank={self.rank()}, size={self.size()}, {self._backend})"

    # -- groups --

    def _check_backend(self, backend: str | None) -> None:
        return None                  # every group of a worker is served by the world's backend

    def _wrap_subgroup(self, transport) -> RealProcessGroup:
        return RealProcessGroup(transport, self._backend)

    def _local_subgroup(self, ranks: list[int], name: str, location: str) -> RealProcessGroup:
        checker = getattr(self.transport, "checker", None)   # the names agree first
        if checker is not None:
            checker.agree_on_local_group(ranks, self.transport.ranks[self.transport.rank], name, location)
        else:
            self.transport.agree_on_local_group(ranks, name, location)
        local = {rank: index for index, rank in enumerate(self.transport.ranks)}
        return RealProcessGroup(self.transport.local_subgroup(tuple(local[rank] for rank in ranks)),
                                self._backend)

    # -- PREMUL_SUM: the input times the factor, then SUM --------------------------------

    def allreduce(self, tensors, opts=None):
        factor = _premul_factor(opts)
        if factor is not None:
            for tensor in tensors:    # the buffer is overwritten by the result anyway
                tensor.detach().copy_(_scaled(tensor, factor))
            opts = _as_sum(opts)
        return super().allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce_scatter_single(self, output, input_, opts=None):
        factor = _premul_factor(opts)
        if factor is not None:
            input_, opts = _scaled(input_, factor), _as_sum(opts)
        return super().reduce_scatter_single(output, input_, opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        factor = _premul_factor(opts)
        if factor is not None:
            inputs, opts = [_scaled(tensor, factor) for tensor in inputs], _as_sum(opts)
        return super().reduce_scatter_single_coalesced(outputs, inputs, opts)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        factor = _premul_factor(opts)
        if factor is not None:
            input_lists = [[_scaled(tensor, factor) for tensor in inputs] for inputs in input_lists]
            opts = _as_sum(opts)
        return super().reduce_scatter(outputs, input_lists, opts)

    def reduce(self, tensors, opts=None):
        factor = _premul_factor(opts)
        if factor is None:
            return super().reduce(tensors, opts)
        scaled = [_scaled(tensor, factor) for tensor in tensors]

        def premul_reduce(transport, _tensors, sum_opts, async_op: bool) -> Issued:
            issued = ops.reduce(transport, scaled, sum_opts, async_op)

            def finish(results: list) -> list[torch.Tensor]:
                issued.finish(results)
                if transport.rank == sum_opts.rootRank:   # only the root's tensor becomes the result
                    for tensor, value in zip(tensors, scaled, strict=True):
                        tensor.detach().copy_(value)
                return list(tensors)

            return Issued(issued.calls, finish)

        return self._submit(premul_reduce, tensors, _as_sum(opts), async_op=opts.asyncOp,
                            route=("reduce", (tensors, opts)))


#: the worker's default group once a run has installed it (it stays: see run_process_groups)
_installed: RealProcessGroup | None = None


def _install(transport) -> RealProcessGroup:
    """Make a :class:`RealProcessGroup` over ``transport`` c10d's default group, in place of the
    worker's own (which stays in the c10d tables its data moves through, hidden from the
    program's: :func:`real.groups.hide_from_program`)."""
    global _installed
    world = c10d._world
    original = world.default_pg
    if original is None:
        raise RuntimeError("run_process_groups: torch.distributed is not initialised in this worker")
    name = world.pg_names[original]
    group = RealProcessGroup(transport, str(world.pg_map[original][0]).lower(), data_group=original)
    group._set_group_name(name)
    group._set_group_desc("default_pg")
    world.pg_map[group] = world.pg_map[original]
    world.pg_names[group] = name
    world.pg_group_ranks[group] = dict(world.pg_group_ranks[original])
    world.pg_backend_config[group] = world.pg_backend_config[original]
    tag = world.pg_to_tag.get(original)
    if tag is not None:
        world.pg_to_tag[group] = tag
    for tagged in world.tags_to_pg.values():        # its own tag and the default one, ""
        if original in tagged:
            tagged.append(group)
    _unregister_process_group(name)
    _register_process_group(name, group)         # the functional collectives find groups by name
    world.default_pg = group
    hide_from_program(original)
    _installed = group
    return group


@contextlib.contextmanager
def run_process_groups(transport) -> Iterator[RealProcessGroup]:
    """c10d's default group is a :class:`RealProcessGroup` over ``transport`` (the run's world
    transport, the one ``comm`` holds) for the length of the block; afterwards every group the
    block created is gone from c10d's state. When the block ends normally, an async call
    (handle, Work) the run issued and never waited on is an
    :class:`~simcomm.errors.UnwaitedHandleError`, as on virtual ranks: wait what the program
    returned first (:func:`simcomm.c10d.work.wait_returned`: a returned tensor is used).

    The default group stays the same object from the first run on, its transport replaced by
    each run's: torch evaluates ``group=group.WORLD`` default arguments when a module is
    imported, so a module a run imports keeps the group it saw. Between runs it serves no
    calls. Needs an initialised default group (the worker's).
    """
    world = c10d._world
    group = _installed
    if group is None or world.default_pg is not group:
        group = _install(transport)
    group.transport = transport
    before = set(world.pg_map)
    count = world.group_count
    transport.cache.begin_run()
    try:
        yield group
        transport.cache.check_all_waited(transport.global_rank)   # the program returned normally (maybe after destroying the group)
    finally:
        for made in [pg for pg in world.pg_map if pg not in before and isinstance(pg, RealProcessGroup)]:
            _forget(world, made)
        world.group_count = count
        group.transport = None


def _forget(world, group) -> None:
    """Remove ``group`` from c10d's tables (its data moves through groups the worker keeps)."""
    name = world.pg_names.pop(group, None)
    for table in (world.pg_map, world.pg_group_ranks, world.pg_backend_config, world.pg_coalesce_state):
        table.pop(group, None)
    tag = world.pg_to_tag.pop(group, None)
    if tag is not None and group in world.tags_to_pg.get(tag, []):
        world.tags_to_pg[tag].remove(group)
        if not world.tags_to_pg[tag]:
            del world.tags_to_pg[tag]
    for default_tagged in (world.tags_to_pg.get("", []),):
        if group in default_tagged:
            default_tagged.remove(group)
    if name is not None:
        with contextlib.suppress(Exception):
            _unregister_process_group(name)
