"""``DistributedDataParallel`` on shape-only ranks (``World(..., tensors='shape')``).

torch's DDP does its work in C++ that reads tensor data (the check of parameter shapes
across ranks, the broadcast of module states, the reducer's gradient buckets), and a
shape-only rank's tensors are fake. On such a rank ``DistributedDataParallel(module, ...)``
makes a :class:`ShapeOnlyDDP` (a subclass, same constructor) that does the same in Python
and issues the same collectives, in the same order, with the same sizes and dtypes:

* at construction: an all_gather of the parameter count, a broadcast of every parameter's
  sizes and strides (int64) from rank 0, then the module's parameters and buffers broadcast
  from rank 0 in 250 MiB buckets per dtype (``_broadcast_coalesced``);
* each forward with grad enabled: once, after the first backward that reduced gradients, the
  rebuild of the buckets in the order the gradients became ready (two int32 broadcasts from
  rank 0), then the buffers broadcast from rank 0 (``broadcast_buffers=True``);
* each backward outside ``no_sync()``: the gradients, divided by the world size, all-reduced
  (sum) one bucket at a time as its gradients become ready. Before the rebuild all
  parameters share one bucket per dtype; after it, the first bucket holds up to
  ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (or ``bucket_cap_mb`` when given), the next ones up
  to ``bucket_cap_mb`` (25 MiB by default).

Each bucket's flat gradient buffer is allocated at construction and again at the rebuild, and
kept, as the reducer's are (a rank's memory accounting sees them); with
``gradient_as_bucket_view=True`` the gradients become views into them after the first reduction.

A different model on another rank is a ``RuntimeError`` naming the rank and the parameter,
as torch's. ``find_unused_parameters=True``, ``static_graph=True``, ``mixed_precision``,
``bucket_cap_mb`` as a list, delayed all-reduce and communication hooks are refused with a
:class:`~simcomm.errors.ShapeOnlyError`. Elsewhere (real values) ``DistributedDataParallel``
is torch's own: :func:`install_shape_ddp` changes only which class a shape-only rank gets.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel

from ..errors import ShapeOnlyError
from .dist_world import current_context

__all__ = ["ShapeOnlyDDP", "install_shape_ddp"]

_BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024      # torch's DDP.broadcast_bucket_size
_MB = 1024 * 1024

# what each rank put on the table for a collective, to read what the others sent (fake tensors
# carry no values): run -> {(group ranks, label, sequence): {group rank: value}}
_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tables_lock = threading.Lock()


def _table(key: tuple) -> dict:
    state = current_context().state
    with _tables_lock:
        return _tables.setdefault(state, {}).setdefault(key, {})


def _is_fake_module(module: Any) -> bool:
    from .shape import is_fake
    for tensor in [*module.parameters(), *module.buffers()]:
        return is_fake(tensor)
    return False


def _refuse(rank: int, what: str) -> ShapeOnlyError:
    return ShapeOnlyError(
        f"rank {rank}: DistributedDataParallel({what}) is not simulated on shape-only ranks "
        f"(World(..., tensors='shape')): DDP there runs in Python and does the default "
        f"(find_unused_parameters=False, one bucket per ~25 MiB, no hooks); run with tensors='real', "
        f"or leave {what} out")


class ShapeOnlyDDP(DistributedDataParallel):
    """DDP's collectives and bookkeeping in Python, for a module with fake tensors (module doc)."""

    def __init__(self, module: torch.nn.Module, device_ids: Any = None, output_device: Any = None,
                 dim: int = 0, broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: Any = None, bucket_cap_mb: Any = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None,
                 mixed_precision: Any = None, device_mesh: Any = None,
                 skip_all_reduce_unused_params: bool = False, bucket_cap_mb_list: Any = None,
                 batched_grad_copy: bool = False, forward_sync_buffers: bool | None = None) -> None:
        torch.nn.Module.__init__(self)
        if device_mesh is not None:
            process_group = device_mesh.get_group(mesh_dim=0)
        self.process_group = process_group if process_group is not None else c10d._get_default_group()
        rank = dist.get_rank()
        for name, value in (("find_unused_parameters=True", find_unused_parameters),
                            ("static_graph=True", static_graph),
                            ("mixed_precision=...", mixed_precision is not None),
                            ("delay_all_reduce_named_params=...", delay_all_reduce_named_params is not None),
                            ("bucket_cap_mb_list=...", bucket_cap_mb_list is not None),
                            ("bucket_cap_mb=[...]", isinstance(bucket_cap_mb, (list, tuple)))):
            if value:
                raise _refuse(rank, name)
        self._check_devices(device_ids, output_device)
        self.module = module
        self.dim = dim
        self.device_ids, self.output_device = None, None
        if broadcast_buffers is not None:
            warnings.warn("DistributedDataParallel's `broadcast_buffers` is deprecated: use "
                          "`forward_sync_buffers` (which leaves the sync at construction on)",
                          FutureWarning, stacklevel=3)
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_sync_buffers = forward_sync_buffers, True
        else:
            self.forward_sync_buffers = init_sync_buffers = broadcast_buffers is not False
        self.find_unused_parameters = False
        self.static_graph = False
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.broadcast_bucket_size = _BROADCAST_BUCKET_BYTES
        default_cap = bucket_cap_mb is None
        self.bucket_bytes_cap = int((25 if default_cap else bucket_cap_mb) * _MB)
        self._first_bucket_bytes = dist._DEFAULT_FIRST_BUCKET_BYTES if default_cap else self.bucket_bytes_cap
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self.parameters_to_ignore = ignored
        self._module_states = [t.detach() for name, t in module.named_parameters() if name not in ignored]
        self._ddp_params: list[torch.nn.Parameter] = []
        seen: set[int] = set()
        for name, parameter in module.named_parameters():
            if name not in ignored and parameter.requires_grad and id(parameter) not in seen:
                seen.add(id(parameter))
                self._ddp_params.append(parameter)
                self._names = getattr(self, "_names", []) + [name]
        if not self._ddp_params:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have "
                               "any parameter that requires a gradient.")
        self._group_ranks = tuple(dist.get_process_group_ranks(self.process_group))
        self._sequence = 0
        if init_sync:
            self._verify_shapes()
            states = self._module_states + (self._buffers_of() if init_sync_buffers else [])
            self._broadcast_coalesced(states, self.broadcast_bucket_size)
        # before the rebuild: one bucket per dtype, in reverse parameter order
        buckets, _ = dist._compute_bucket_assignment_by_size(
            self._ddp_params, [2 ** 63 - 1], [False] * len(self._ddp_params))
        self._buckets = [list(bucket) for bucket in reversed(buckets)]
        self._bucket_buffers = self._allocate(self._buckets)
        self._rebuilt = False
        self._ready_order: list[int] | None = None     # the first reducing backward's ready order
        self._backward: dict | None = None               # the backward in progress
        self._pending: set[int] = set()                  # parameters a reducing backward awaits
        self._hooks = [parameter.register_post_accumulate_grad_hook(self._make_hook(index))
                       for index, parameter in enumerate(self._ddp_params)]

    # -- construction ----------------------------------------------------------------------

    @staticmethod
    def _check_devices(device_ids: Any, output_device: Any) -> None:
        from . import cuda_map
        if getattr(cuda_map._local, "mapped", None) is None:
            return
        count = torch.cuda.device_count()
        for value in [*(device_ids or ()), *([output_device] if output_device is not None else [])]:
            index = cuda_map._ordinal(value)
            if index is not None:
                cuda_map._check_ordinal(index, count)

    def _buffers_of(self) -> list[torch.Tensor]:
        ignored = self.parameters_to_ignore
        return [b.detach() for name, b in self.module.named_buffers() if name not in ignored]

    def _next_key(self, label: str) -> tuple:
        self._sequence += 1
        return (self._group_ranks, id(type(self)), label, self._sequence)

    def _verify_shapes(self) -> None:
        """torch's ``_verify_param_shape_across_processes``: all_gather of the parameter count,
        then rank 0's sizes and strides broadcast and compared with this rank's."""
        group, params = self.process_group, self._ddp_params
        group_rank = dist.get_rank(group)
        table = _table(self._next_key("verify"))
        table[group_rank] = [(tuple(p.shape), tuple(p.stride())) for p in params]
        count = torch.tensor([len(params)], dtype=torch.int64)
        outputs = [torch.empty_like(count) for _ in self._group_ranks]
        dist.all_gather(outputs, count, group=group, async_op=True).wait()
        counts = {r: len(table[r]) for r in sorted(table)}
        for other, n in counts.items():
            if n != len(params):
                raise RuntimeError(
                    f"DDP expects same model across all ranks, but Rank {group_rank} has "
                    f"{len(params)} params, while rank {other} has inconsistent {n} params.")
        metadata = torch.empty(sum(2 * p.dim() for p in params), dtype=torch.int64)
        dist.broadcast(metadata, group=group, group_src=0, async_op=True).wait()
        for index, (mine, theirs) in enumerate(zip(table[group_rank], table[0])):
            if mine[0] != theirs[0]:
                raise RuntimeError(
                    f"DDP expects same model across all ranks, but Rank {group_rank} has parameter "
                    f"{index} ({self._names[index]}) of shape {list(mine[0])} while rank 0 has "
                    f"{list(theirs[0])}")
            if mine[1] != theirs[1]:
                raise RuntimeError(
                    f"DDP expects same model across all ranks, but Rank {group_rank} has parameter "
                    f"{index} ({self._names[index]}) with strides {list(mine[1])} while rank 0 has "
                    f"{list(theirs[1])}")

    def _broadcast_coalesced(self, tensors: list[torch.Tensor], bucket_bytes: int) -> None:
        """torch's ``_broadcast_coalesced`` from group rank 0: buckets of up to ``bucket_bytes``
        per dtype, each flattened and broadcast, at most two in flight."""
        if not tensors:
            return
        buckets, _ = dist._compute_bucket_assignment_by_size(tensors, [bucket_bytes])
        in_flight: list = []

        def finish(entry) -> None:
            work, flat, members = entry
            work.wait()
            offset = 0
            with torch.no_grad():
                for tensor in members:
                    tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()

        for bucket in buckets:
            if len(in_flight) >= 2:
                finish(in_flight.pop(0))
            members = [tensors[i] for i in bucket]
            flat = torch.cat([t.reshape(-1) for t in members])
            work = dist.broadcast(flat, group=self.process_group, group_src=0, async_op=True)
            in_flight.append((work, flat, members))
        while in_flight:
            finish(in_flight.pop(0))

    # -- forward ---------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._pending:
            names = ", ".join(self._names[i] for i in sorted(self._pending))
            raise RuntimeError(
                f"Expected to have finished reduction in the prior iteration before starting a new "
                f"one (rank {dist.get_rank()}): parameters that got no gradient: {names}; "
                f"find_unused_parameters=True is not simulated on shape-only ranks")
        syncing = torch.is_grad_enabled() and self.require_backward_grad_sync
        if syncing:
            self._pending = set(range(len(self._ddp_params)))
            self._backward = {"launched": 0, "ready": set(), "works": [], "queued": False}
        else:
            self._pending = set()
            self._backward = None
        if torch.is_grad_enabled() and not self._rebuilt and self._ready_order:
            self._rebuild()
        if self.require_forward_param_sync and self.forward_sync_buffers:
            buffers = self._buffers_of()
            if buffers:
                with torch.no_grad():
                    self._broadcast_coalesced(buffers, self.broadcast_bucket_size)
        output = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = syncing      # torch's _post_forward
        return output

    def _rebuild(self) -> None:
        """The reducer's bucket rebuild: buckets in the gradients' ready order, rank 0's chosen
        (its indices broadcast as int32: all indices and the bucket count, then the sizes)."""
        order = self._ready_order
        buckets, _ = dist._compute_bucket_assignment_by_size(
            [self._ddp_params[i] for i in order], [self._first_bucket_bytes, self.bucket_bytes_cap],
            [False] * len(order), order)
        table = _table(self._next_key("rebuild"))
        table[dist.get_rank(self.process_group)] = [list(b) for b in buckets]
        indices = torch.empty(sum(len(b) for b in buckets) + 1, dtype=torch.int32)
        dist.broadcast(indices, group=self.process_group, group_src=0, async_op=True).wait()
        chosen = table[0]
        sizes = torch.empty(len(chosen), dtype=torch.int32)
        dist.broadcast(sizes, group=self.process_group, group_src=0, async_op=True).wait()
        self._buckets = chosen
        self._bucket_buffers = self._allocate(chosen)
        self._rebuilt = True

    # -- backward --------------------------------------------------------------------------

    def _allocate(self, buckets: list[list[int]]) -> list[torch.Tensor]:
        """The reducer's flat gradient buffer of each bucket, kept for the model's life (as
        torch's, whose memory a rank's accounting sees)."""
        with torch.no_grad():
            return [torch.empty(sum(self._ddp_params[i].numel() for i in bucket),
                                dtype=self._ddp_params[bucket[0]].dtype,
                                device=self._ddp_params[bucket[0]].device) for bucket in buckets]

    def _make_hook(self, index: int):
        def hook(parameter: torch.Tensor) -> None:
            self._ready(index)
        return hook

    def _ready(self, index: int) -> None:
        backward = self._backward
        if backward is None or index not in self._pending:
            return
        if self._ready_order is None:
            backward.setdefault("order", []).append(index)
        if not backward["queued"]:
            backward["queued"] = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._pending.discard(index)
        backward["ready"].add(index)
        world = dist.get_world_size(self.process_group)
        while backward["launched"] < len(self._buckets):
            bucket = self._buckets[backward["launched"]]
            if not all(i in backward["ready"] for i in bucket):
                break
            flat = self._bucket_buffers[backward["launched"]]
            offset = 0
            with torch.no_grad():
                for i in bucket:
                    grad = self._ddp_params[i].grad
                    flat[offset:offset + grad.numel()].copy_(grad.reshape(-1))
                    if self.gradient_as_bucket_view:     # torch's: the gradient becomes a view
                        self._ddp_params[i].grad = flat[offset:offset + grad.numel()].view_as(grad)
                    offset += grad.numel()
                flat.div_(world)
            work = dist.all_reduce(flat, group=self.process_group, async_op=True)
            backward["works"].append((work, flat, bucket))
            backward["launched"] += 1

    def _finish_backward(self) -> None:
        backward = self._backward
        if backward is None:
            return
        for work, flat, bucket in backward["works"]:
            work.wait()
            offset = 0
            for i in bucket:
                grad = self._ddp_params[i].grad
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        if self._ready_order is None and not self._pending:
            self._ready_order = backward.get("order", [])
        if not self._pending:
            self._backward = None

    # -- the rest of DDP's surface ---------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        raise _refuse(dist.get_rank(), "register_comm_hook")

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        raise _refuse(dist.get_rank(), "_register_builtin_comm_hook")

    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise _refuse(dist.get_rank(), "join()")

    def __getstate__(self) -> Any:
        raise _refuse(dist.get_rank(), "pickling")


_torch_ddp_new: Any = None


def _ddp_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    module = args[0] if args else kwargs.get("module")
    if cls is DistributedDataParallel and isinstance(module, torch.nn.Module) and _is_fake_module(module):
        cls = ShapeOnlyDDP
    return object.__new__(cls)


def install_shape_ddp() -> None:
    """Give ``DistributedDataParallel`` a ``__new__`` that makes a :class:`ShapeOnlyDDP` for a
    module with fake tensors (once per process; torch's class otherwise)."""
    global _torch_ddp_new
    if _torch_ddp_new is None:
        _torch_ddp_new = DistributedDataParallel.__dict__.get("__new__", object.__new__)
        DistributedDataParallel.__new__ = _ddp_new      # simcomm.patches: "shape-only-ddp"
