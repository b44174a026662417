"""The ``"simcomm"`` c10d backend: a ProcessGroup whose every call runs on the simulator.

c10d hands a backend output buffers to fill in place (``dist.all_reduce(t)``
overwrites ``t``). Each method of :class:`SimcommProcessGroup` is a thin
adapter around ONE translation function of :mod:`simcomm.c10d.ops`, which
calls the rank's :class:`~simcomm.sim.SimTransport` for the group and
writes the result into the buffers. The simulator therefore traces the call,
checks that every rank issues the same one (CollectiveMismatchError) and sees
every wait (DeadlockError), exactly as for the communicator's own calls.

Each call completes before it returns, also with ``async_op=True``: the
returned ``Work`` is already done and its future holds the output tensors.
"""
from __future__ import annotations


import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from ..sim import SimTransport
from ..trace import backward_phase
from . import ops
from .world import BACKEND_NAME, current_context

__all__ = ["SimcommProcessGroup", "register"]


def _done(outputs: list[torch.Tensor]) -> dist.Work:
    future: Future = Future()
    future.set_result(outputs)
    return _create_work_from_future(future)


def _run(translate, *args) -> list[torch.Tensor]:
    """Call a translation; a call made while autograd's engine runs a backward pass on
    this thread (a node, a hook, or a callback queued for the end of the pass, as FSDP's
    gradient reduce-scatter and DDP's all-reduce are) is traced as backward."""
    if torch._C._current_graph_task_id() != -1:
        with backward_phase():
            return translate(*args)
    return translate(*args)


class SimcommProcessGroup(dist.ProcessGroup):
    """One rank's c10d process group over a simulator group.

    ``rank()``/``size()`` are the group-local rank and size c10d expects;
    ``transport`` is the rank's simulator transport in this group.
    """

    def __init__(self, transport: SimTransport):
        super().__init__(transport.rank, transport.world_size)
        self.transport = transport
        self._name = ""
        self._desc = ""

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

    def abort(self) -> None:
        return None

    # -- collectives (c10d's Python names and the C++ names call the same translation) --

    def allreduce(self, tensors, opts=None):
        return _done(_run(ops.all_reduce, self.transport, tensors, opts))

    def allreduce_coalesced(self, tensors, opts=None):
        return _done(_run(ops.all_reduce, self.transport, tensors, opts))

    def allgather(self, output_lists, input_tensors, opts=None):
        return _done(_run(ops.all_gather_list, self.transport, output_lists, input_tensors))

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        return _done(_run(ops.all_gather_list, self.transport, output_lists, input_tensors))

    def all_gather_single(self, output, input_, opts=None):
        return _done(_run(ops.all_gather_into_tensor, self.transport, [output], [input_]))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return _done(_run(ops.all_gather_into_tensor, self.transport, outputs, inputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return _done(_run(ops.reduce_scatter_list, self.transport, outputs, input_lists, opts))

    def reduce_scatter_single(self, output, input_, opts=None):
        return _done(_run(ops.reduce_scatter_tensor, self.transport, [output], [input_], opts))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return _done(_run(ops.reduce_scatter_tensor, self.transport, outputs, inputs, opts))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def all_to_all_single(self, output, input_, output_split_sizes, input_split_sizes, opts=None):
        return _done(_run(ops.all_to_all_single, self.transport, output, input_,
                          list(output_split_sizes or []), list(input_split_sizes or [])))

    alltoall_base = all_to_all_single

    def alltoall(self, output_list, input_list, opts=None):
        return _done(_run(ops.all_to_all_list, self.transport, output_list, input_list))

    def broadcast(self, tensors, opts=None):
        return _done(_run(ops.broadcast, self.transport, tensors, opts.rootRank))

    def reduce(self, tensors, opts=None):
        return _done(_run(ops.reduce, self.transport, tensors, opts))

    def gather(self, output_lists, input_tensors, opts=None):
        return _done(_run(ops.gather, self.transport, output_lists, input_tensors, opts.rootRank))

    def scatter(self, outputs, input_lists, opts=None):
        return _done(_run(ops.scatter, self.transport, outputs, input_lists, opts.rootRank))

    def barrier(self, opts=None):
        _run(ops.barrier, self.transport)
        return _done([])

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        _run(ops.barrier, self.transport)

    # -- point to point --

    def send(self, tensors, dst, tag=0):
        return _done(_run(ops.send, self.transport, tensors, dst, tag))

    def recv(self, tensors, src, tag=0):
        return _done(_run(ops.recv, self.transport, tensors, src, tag))

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


def _create(backend_options, _pg_options) -> SimcommProcessGroup:
    """c10d's backend constructor (extended API: it gets the group's global ranks)."""
    context = current_context()
    transport = context.transport_for(list(backend_options.global_ranks_in_group),
                                      backend_options.group_rank, backend_options.group_id)
    return SimcommProcessGroup(transport)


def register() -> None:
    """Make ``"simcomm"`` a torch.distributed backend name (once per process)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


