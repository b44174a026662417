"""The :class:`~simcomm.transport.Transport` of one process in one ``torch.distributed`` group.

:class:`DistTransport` moves data with the ``torch.distributed`` collectives
(NCCL on GPUs, gloo on CPU); the argument checks and the autograd rules are
simcomm's own (:class:`simcomm.Communicator`, :mod:`simcomm.autograd`), so a
program behaves the same on real processes as on virtual ranks.

Every primitive honours the transport contract: the input is never modified
(it is copied to the transport's device first), the result is a new
contiguous tensor on that device, and the call blocks until this rank's part
is complete. With ``async_op=True`` it issues ``torch.distributed``'s own
asynchronous call instead and returns a :class:`~simcomm.handles.Handle`
around its ``Work`` (the input is copied at issue; ``wait()`` finishes the
result's layout). ``src``/``dst`` are group-local and translated to global ranks
here. Each call records a :class:`~simcomm.trace.TraceEvent` in simcomm's
format when tracing is on (for an async call, its data moved when the
``Work``'s future completed).

Reductions a backend lacks are emulated, never approximated: a backend without
``ReduceOp.AVG`` sums and divides; one without a ``reduce_scatter`` for an op
all-reduces and keeps this rank's chunk.
"""
from __future__ import annotations

import contextlib
import math
import pickle
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from simcomm import dtypes, memory
from simcomm.buffers import set_versions, write_into
from simcomm.checks import check_splits, to_reduce_op
from simcomm.collectives import on_the_wire
from simcomm.errors import CollectiveMismatchError
from simcomm.handles import Handle, P2POp
from simcomm.reports import local_group_mismatch
from simcomm.trace import Record, Recorder, Trace
from simcomm.transport import TransportBase

from .call_memory import communicating, output, references, wait_released
from .dist_base import DTYPES, all_gather_single, is_unsupported, reduce_scatter_single
from .dist_work import DistWork
from .groups import GroupCache

__all__ = ["DistTransport"]

class DistTransport(TransportBase):
    """Raw collectives of this process within ``group`` (a ``torch.distributed`` ProcessGroup).

    ``device`` is where every result lives (default: ``cuda:<current device>``
    for an NCCL group, else the CPU). Tracing: ``recorder`` (shared with the
    subgroups made from this transport), or one made from ``events`` (the list
    records are kept in; ``None`` and no recorder: no tracing) and
    ``clock_zero`` (the ``time.perf_counter()`` value times count from).
    """

    #: the tensors of the async call being issued and their counts, for its handle (_released)
    _held: list[tuple[Any, int]] | None = None

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 *, events: list | None = None, clock_zero: float | None = None,
                 cache: GroupCache | None = None, recorder: Recorder | None = None,
                 group_key: str | None = None):
        group = group if group is not None else dist.group.WORLD
        # a run's c10d group (real.checked_pg) moves its data through the backend's own group
        group = getattr(group, "data_group", group)
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("DistTransport: this process is not a member of the given group "
                             "(or torch.distributed is not initialized)")
        self.group = group
        self.backend = str(dist.get_backend(group)).lower()
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                      else torch.device("cpu"))
        ranks = dist.get_process_group_ranks(group)
        if recorder is None and events is not None:
            recorder = Recorder(events, clock_zero)
        super().__init__(dist.get_rank(group), ranks, torch.device(device), recorder)
        self._cache = cache if cache is not None else GroupCache()
        #: names this group among the process's groups (two groups may have the same ranks)
        self.group_key = group_key if group_key is not None else ".".join(map(str, ranks))

    @property
    def cache(self) -> GroupCache:
        """The process groups (and books) this transport and its subgroups share."""
        return self._cache

    def __repr__(self) -> str:
        return (f"DistTransport(rank={self.rank}, ranks={list(self.ranks)}, backend={self.backend}, "
                f"device={self.device})")

    @property
    def events(self) -> list | None:
        """The raw trace records so far, shared with the subgroups made from this transport
        (``None`` when tracing is off); :attr:`trace` turns them into a :class:`~simcomm.trace.Trace`."""
        return self._recorder.events if self._recorder is not None else None

    @property
    def trace(self) -> Trace:
        """What this process has recorded so far, as a :class:`~simcomm.trace.Trace`."""
        return Trace(list(self.events or []))

    # -- helpers --

    def _begin(self, op: str, step: int, tensor: torch.Tensor | None, root: int | None = None,
               nbytes: int | None = None, args: dict | None = None, async_op: bool = False
               ) -> Record | None:
        # what the backend refuses, refused first in the simulator's words (simcomm.dtypes)
        dtypes.check(op, None if tensor is None else tensor.dtype, (args or {}).get("op"), self.device,
                     self.rank)
        if async_op:      # what an unwaited handle of this call is called (see describe_last)
            self._last_call = (op, step, root, None if tensor is None else (tuple(tensor.shape), tensor.dtype))
        return super()._begin(op, step, tensor, root, nbytes, args, async_op)

    def describe_last(self) -> str:
        """The last async call of this transport, as the simulator names an unwaited handle."""
        op, step, peer, tensor = getattr(self, "_last_call", ("call", 0, None, None))
        if op in ("send", "recv"):
            what = f"isend to rank {self.ranks[peer]}" if op == "send" else f"irecv from rank {self.ranks[peer]}"
            return what + ("" if tensor is None else f" ({str(tensor[1]).removeprefix('torch.')} {tensor[0]})")
        return f"{op}(step {step}, group {list(self.ranks)})"

    def _calling(self, kind: str = "collective", peer: int | None = None):
        """Count this call in the books of :class:`~real.groups.GroupCache` (key: group, kind, global peer)."""
        return self._cache.calling((tuple(sorted(self.ranks)), kind, peer))

    @contextlib.contextmanager
    def _released(self, async_op: bool, *tensors: torch.Tensor | None) -> Iterator[None]:
        """Around a blocking call that hands ``tensors`` to the backend: on exit, wait (at most
        :data:`~real.call_memory.RELEASE_WAIT_S`) until the backend's worker thread has dropped its references to
        them. gloo's worker holds each call's tensors until a moment after the call completes; a
        tensor the program frees right after the call would otherwise die on that thread, later, and
        the memory count (``Cluster(memory=True)``) would see it alive at the program's next
        allocation where the simulator frees it at once. An async call's handle waits the same way
        once the call is done. Only while this rank's memory is tracked. What the backend allocates
        for an async call at its issue counts on no rank (gloo's all-gather gathers into a buffer
        of its own before it fills the output): the simulator has no such buffer."""
        if async_op:     # the handle made next waits for them after its wait (DistWork.wait); a
            self._held = references(tensors)   # checked call is issued on a thread that is not tracked
            try:
                with memory.untracked():
                    yield
            except BaseException:
                self._held = None
                raise
            return
        if memory.current_bytes() is None:
            yield
            return
        held = references(tensors)
        yield
        wait_released(held)

    @staticmethod
    def _buffers(async_op: bool) -> contextlib.AbstractContextManager:
        """Around the allocation of the buffers an async call's backend writes its output into:
        untracked, so that output counts on this rank from the wait (:meth:`real.dist_work.DistWork.wait`), as
        the simulator counts an async call's output; a blocking call's count from their allocation."""
        return memory.untracked() if async_op else contextlib.nullcontext()

    def _local_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A private contiguous copy of ``tensor`` on this transport's device (the input stays untouched)."""
        return tensor.detach().to(self.device, copy=True).contiguous()

    def _on_device(self, tensor: torch.Tensor, async_op: bool = False) -> torch.Tensor:
        """``tensor`` on this transport's device, contiguous; a copy only where needed (read-only
        use), always one for an async call (the program may change its tensor before the wait)."""
        if async_op:
            return self._local_copy(tensor)
        return tensor.detach().to(self.device).contiguous()

    def _check_avg(self, op: str, tensor: torch.Tensor, reduction: str) -> None:
        if reduction == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
            raise ValueError(f"{op}: ReduceOp.AVG on rank {self.rank} needs a floating-point dtype, "
                             f"got {tensor.dtype}")

    def _native(self, op: str, reduction: str, call) -> bool:
        """Run ``call()``; return False (and remember) if the backend does not implement it."""
        if (op, reduction) in self._cache.unsupported:
            return False
        try:
            call()
            return True
        except (RuntimeError, ValueError, NotImplementedError) as error:
            if not is_unsupported(error):
                raise
            self._cache.unsupported.add((op, reduction))
            return False

    def _done(self, record: Record | None, work: dist.Work | None, result: Callable[[], Any],
              into: torch.Tensor | None = None) -> Any:
        """A blocking call (``work`` is ``None``) has completed: its output (written into
        ``into`` when given, :func:`~real.call_memory.output`). An async one: a handle, which writes it at the wait."""
        if work is None:
            out = output(result(), into)
            self._end(record, out)
            return out
        held, self._held = self._held, None
        return Handle(DistWork(self, record, work, result, held, into))

    @staticmethod
    def _written_in_place(into: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The result of a call whose backend wrote ``into`` in place: ``into``, its version
        counter back where it was before the call (a backend that copies into its output with
        aten ops moves it; the c10d adapter moves it as the native backend does)."""
        version = into._version

        def result() -> torch.Tensor:
            set_versions((into,), (version,))
            return into
        return result

    def _backend_buffer(self, into: torch.Tensor | None, numel: int, dtype: torch.dtype,
                        async_op: bool) -> torch.Tensor | None:
        """``into`` as the backend's own buffer for a blocking call: a detached alias, which the
        backend writes in place as it writes c10d's tensor on a native backend (no copy, no
        version bump); ``None`` where it cannot serve (async: the output is written at the
        wait; not contiguous, another device or dtype, another size)."""
        if (into is None or async_op or into.numel() != numel or into.dtype != dtype
                or into.device != self.device or not into.is_contiguous()):
            return None
        return into.detach()

    # -- collectives --

    def _all_reduce_into(self, out: torch.Tensor, reduction: str, async_op: bool = False
                         ) -> tuple[dist.Work | None, bool]:
        """In-place all-reduce of the private buffer ``out``: ``(work, divide)``, where
        ``divide`` says the caller must still divide ``out`` by the world size (AVG emulated)."""
        if reduction == "avg":
            works = []
            if self._native("all_reduce", "avg", lambda: works.append(
                    dist.all_reduce(out, to_reduce_op("avg"), group=self.group, async_op=async_op))):
                return works[0], False
            return dist.all_reduce(out, to_reduce_op("sum"), group=self.group, async_op=async_op), True
        return dist.all_reduce(out, to_reduce_op(reduction), group=self.group, async_op=async_op), False

    @communicating
    def all_reduce(self, tensor: torch.Tensor, op: str, async_op: bool = False, *,
                   factor: float | torch.Tensor | None = None, into: torch.Tensor | None = None) -> Any:
        self._check_avg("all_reduce", tensor, op)
        record = self._begin("all_reduce", self._next_step(), tensor, args={"op": op}, async_op=async_op)
        tensor, op = on_the_wire(tensor, op, factor)   # PREMUL_SUM (gloo has none): premultiplied, then SUM
        buffer = self._backend_buffer(into, tensor.numel(), tensor.dtype, async_op)
        if buffer is None:
            out = self._local_copy(tensor)
        else:                        # reduced in place, as a native backend does
            out, written = buffer.view(tensor.shape), self._written_in_place(into)
            if out.data_ptr() != tensor.data_ptr():
                write_into(out, tensor)
        with self._calling(), self._released(async_op, out):
            work, divide = self._all_reduce_into(out, op, async_op)
        if buffer is not None:
            if divide:
                out.div_(self.world_size)
            return self._done(record, work, written, into)
        return self._done(record, work, lambda: out.div_(self.world_size) if divide else out, into)

    @communicating
    def all_gather(self, tensor: torch.Tensor, dim: int, async_op: bool = False, *,
                   into: torch.Tensor | None = None) -> Any:
        record = self._begin("all_gather", self._next_step(), tensor, args={"dim": dim}, async_op=async_op)
        moved = self._on_device(tensor.movedim(dim, 0), async_op)   # (d, *rest): dim first
        shape = (self.world_size * moved.shape[0], *moved.shape[1:])   # (P*d, *rest)
        buffer = self._backend_buffer(into, self.world_size * moved.numel(), moved.dtype, async_op)
        in_place = buffer is not None and dim % max(tensor.dim(), 1) == 0   # the blocks are into's rows
        with self._buffers(async_op):
            flat = buffer.view(shape) if in_place else moved.new_empty(shape)
        written = self._written_in_place(into) if in_place else None
        with self._calling(), self._released(async_op, flat, moved):   # rank r's block at rows r*d:(r+1)*d
            work = all_gather_single(flat, moved, group=self.group, async_op=async_op)
        if in_place:
            return self._done(record, work, written, into)
        return self._done(record, work, lambda: flat.movedim(0, dim).contiguous(), into)  # concat along dim

    @communicating
    def reduce_scatter(self, tensor: torch.Tensor, dim: int, op: str, async_op: bool = False, *,
                       factor: float | torch.Tensor | None = None, into: torch.Tensor | None = None,
                       separately: bool = False) -> Any:
        """``separately``: the backend's list form, each rank's chunk an entry of its own (gloo
        all-reduces each entry by itself, so its sums round as the simulator's ``separately``);
        AVG, where the list form lacks it, is its SUM, then a division."""
        if separately:
            return self._reduce_scatter_list(tensor, dim, op, async_op, factor, into)
        self._check_avg("reduce_scatter", tensor, op)
        record = self._begin("reduce_scatter", self._next_step(), tensor, args={"dim": dim, "op": op},
                             async_op=async_op)
        tensor, op = on_the_wire(tensor, op, factor)   # PREMUL_SUM (gloo has none): premultiplied, then SUM
        moved = self._on_device(tensor.movedim(dim, 0), async_op)   # (d, *rest): dim first
        shard = moved.shape[0] // self.world_size
        shape = (shard, *moved.shape[1:])                        # (d/P, *rest)
        buffer = self._backend_buffer(into, math.prod(shape), moved.dtype, async_op)
        in_place = buffer is not None and dim % max(tensor.dim(), 1) == 0   # the chunks are rows
        with self._buffers(async_op):
            out = buffer.view(shape) if in_place else moved.new_empty(shape)
        written = self._written_in_place(into) if in_place else None
        works: list = []

        def native() -> None:
            works.append(reduce_scatter_single(out, moved, to_reduce_op(op), group=self.group,
                                                async_op=async_op))

        with self._calling(), self._released(async_op, out, moved):
            if self._native("reduce_scatter", op, native):
                work = works[0]
                result = written if in_place else (lambda: out.movedim(0, dim).contiguous())  # chunk r
            else:
                with self._buffers(async_op):
                    full = moved.clone()                         # (d, *rest)
                work, divide = self._all_reduce_into(full, op, async_op)

                def result() -> torch.Tensor:
                    chunk = full.narrow(0, self.rank * shard, shard)   # (d/P, *rest): this rank's
                    chunk = chunk / self.world_size if divide else chunk
                    return chunk.movedim(0, dim).contiguous()    # chunk r along dim
        return self._done(record, work, result, into)

    def _reduce_scatter_list(self, tensor: torch.Tensor, dim: int, op: str, async_op: bool,
                             factor: float | torch.Tensor | None, into: torch.Tensor | None) -> Any:
        """:meth:`reduce_scatter` with ``separately``: ``dist.reduce_scatter`` of the chunks."""
        self._check_avg("reduce_scatter", tensor, op)
        record = self._begin("reduce_scatter", self._next_step(), tensor, args={"dim": dim, "op": op},
                             async_op=async_op)
        tensor, op = on_the_wire(tensor, op, factor)   # PREMUL_SUM (gloo has none): premultiplied, then SUM
        moved = self._on_device(tensor.movedim(dim, 0), async_op)   # (d, *rest): dim first
        entries = list(moved.chunk(self.world_size))                 # P x (d/P, *rest): entry r for rank r
        with self._buffers(async_op):
            out = torch.empty_like(entries[0])                       # (d/P, *rest)
        works: list = []

        def call(reduction: str) -> None:
            works.append(dist.reduce_scatter(out, entries, to_reduce_op(reduction), group=self.group,
                                             async_op=async_op))

        with self._calling(), self._released(async_op, out, moved):
            divide = not self._native("reduce_scatter_list", op, lambda: call(op))
            if divide and op != "avg":
                raise NotImplementedError(f"reduce_scatter: the backend's list form on rank {self.rank} "
                                          f"has no ReduceOp.{op.upper()}")
            if divide:
                call("sum")                                          # AVG: SUM, then a division
        work = works[0]

        def result() -> torch.Tensor:
            chunk = out / self.world_size if divide else out
            return chunk.movedim(0, dim).contiguous()                # chunk r along dim
        return self._done(record, work, result, into)

    @communicating
    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int, async_op: bool = False
                   ) -> Any:
        record = self._begin("all_to_all", self._next_step(), tensor,
                             args={"scatter_dim": scatter_dim, "gather_dim": gather_dim}, async_op=async_op)
        world = self.world_size
        moved = self._on_device(tensor.movedim(scatter_dim, 0), async_op)  # (S, *rest): chunk j to rank j
        with self._buffers(async_op):
            received = torch.empty_like(moved)                   # (S, *rest): chunk i came from rank i
        with self._calling(), self._released(async_op, received, moved):
            work = dist.all_to_all_single(received, moved, group=self.group, async_op=async_op)

        def result() -> torch.Tensor:
            shard = moved.shape[0] // world
            pieces = received.reshape(world, shard, *moved.shape[1:])  # (P, S/P, *rest)
            pieces = pieces.movedim(1, scatter_dim + 1)          # (P, *shape with S/P at scatter_dim)
            pieces = pieces.movedim(0, gather_dim)               # (..., P, G, ...): P just before gather_dim
            return pieces.flatten(gather_dim, gather_dim + 1).contiguous()  # (..., P*G, ...): rank order
        return self._done(record, work, result)

    @communicating
    def gather(self, tensor: torch.Tensor, dst: int, dim: int, async_op: bool = False) -> Any:
        record = self._begin("gather", self._next_step(), tensor, root=dst, args={"dst": dst, "dim": dim},
                             async_op=async_op)
        local = self._on_device(tensor, async_op)
        with self._buffers(async_op):
            parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == dst else None
        with self._calling(), self._released(async_op, local, *(parts or [])):
            work = dist.gather(local, parts, dst=self.ranks[dst], group=self.group, async_op=async_op)
        # (.., P*d at dim, ..) on dst
        return self._done(record, work, lambda: torch.cat(parts, dim) if parts is not None else None)

    @communicating
    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False, *,
                  into: torch.Tensor | None = None) -> Any:
        record = self._begin("broadcast", self._next_step(), tensor, root=src, args={"src": src},
                             async_op=async_op)
        buffer = self._backend_buffer(into, tensor.numel(), tensor.dtype, async_op)
        if buffer is None:
            out, result = self._local_copy(tensor), None
        else:                        # received in place
            out, result = buffer.view(tensor.shape), self._written_in_place(into)
            if self.rank == src and out.data_ptr() != tensor.data_ptr():
                write_into(out, tensor)
        with self._calling(), self._released(async_op, out):
            work = dist.broadcast(out, src=self.ranks[src], group=self.group, async_op=async_op)
        return self._done(record, work, result or (lambda: out), into)

    def barrier(self, async_op: bool = False) -> Handle | None:
        record = self._begin("barrier", self._next_step(), None, args={}, async_op=async_op)
        # untracked: torch's barrier allocates a 1-byte tensor of its own, which no simulator call makes
        with self._calling(), memory.untracked():
            if self.backend == "nccl" and self.device.type == "cuda":
                work = dist.barrier(group=self.group, async_op=async_op, device_ids=[self.device.index])
            else:
                work = dist.barrier(group=self.group, async_op=async_op)
        return self._done(record, work, lambda: None)

    def subgroup(self, groups: tuple[tuple[int, ...], ...]) -> DistTransport:
        """This process's part of ``groups`` (group-local ranks) as a transport of its own.

        Only the members of each part create its process group, so the call
        does not synchronize the parts with each other.
        """
        record = self._begin("subgroup", self._next_step(), None, args={"groups": groups})
        part = next(part for part in groups if self.rank in part)
        child = self.local_subgroup(part)
        self._end(record, None)
        return child

    def agree_on_local_group(self, ranks: Sequence[int], name: str, location: str) -> None:
        """The members ``ranks`` (global) of a group made by its members only
        (``new_group(..., use_local_synchronization=True)``) compare the name torch gave it, in
        the world's store, before it is made; a :class:`CollectiveMismatchError` on every member
        when they named it differently, as on virtual ranks (checked mode compares in its own
        store: :meth:`real.checked_store.Checker.agree_on_local_group`). gloo's own members would wait
        for each other under different names forever."""
        key = tuple(sorted(ranks))
        step = self._cache.local_groups[key]
        self._cache.local_groups[key] += 1
        world = self._cache.world_group
        store = c10d._world.pg_map[world][1]
        prefix = f"simcomm-local-group/{'.'.join(map(str, key))}/{step}/"
        store.set(prefix + str(dist.get_rank(world)), pickle.dumps((name, location)))
        entries = [pickle.loads(store.get(prefix + str(rank))) for rank in ranks]
        text = local_group_mismatch(ranks, step, entries)
        if text is not None:
            raise CollectiveMismatchError(text)

    def local_subgroup(self, part: Sequence[int]) -> DistTransport:
        """The transport of the group of ``part`` (group-local ranks, this rank among them),
        made by its members only: not a collective of this group, not traced."""
        group, name = self._cache.group(tuple(self.ranks[r] for r in part))
        return DistTransport(group, self.device, recorder=self._recorder, cache=self._cache, group_key=name)

    # -- point to point --

    def send(self, tensor: torch.Tensor, dst: int, async_op: bool = False) -> Handle | None:
        """Blocks until the backend has taken the data (gloo may return before the recv is posted).
        ``async_op``: an ``isend`` of a copy of ``tensor`` taken now."""
        record = self._p2p_begin("send", dst, tensor, async_op=async_op)
        data = self._on_device(tensor, async_op)
        with self._calling("send", self.ranks[dst]), self._released(async_op, data):
            if async_op:
                work = dist.isend(data, dst=self.ranks[dst], group=self.group)
            else:
                work = dist.send(data, dst=self.ranks[dst], group=self.group)
        return self._done(record, work, lambda: None)

    @communicating
    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int, async_op: bool = False) -> Any:
        """An ``irecv``'s buffer counts on this rank once waited on, as in the simulator, which
        has no buffer before the message arrives (:mod:`simcomm.memory`)."""
        with memory.untracked() if async_op else contextlib.nullcontext():
            out = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        record = self._p2p_begin("recv", src, None, out.numel() * out.element_size(), async_op)
        with self._calling("recv", self.ranks[src]), self._released(async_op, out):
            if async_op:
                work = dist.irecv(out, src=self.ranks[src], group=self.group)
            else:
                dist.recv(out, src=self.ranks[src], group=self.group)
                work = None
        return self._done(record, work, lambda: out)

    def batch_isend_irecv(self, ops: Sequence[P2POp]) -> list[Handle]:
        """``torch.distributed.batch_isend_irecv`` of ``ops``: one handle per op, in order."""
        torch_ops, finishes = [], []
        for op in ops:
            global_peer = self.ranks[op.peer]
            if op.op == "isend":
                record = self._p2p_begin("send", op.peer, op.data, async_op=True)
                buffer = self._local_copy(op.data)
                torch_ops.append(dist.P2POp(dist.isend, buffer, global_peer, self.group))
                finishes.append((record, lambda: None, ("send", global_peer), references([buffer])))
            else:
                shape, dtype = op.data
                with memory.untracked():         # counted once waited on, as recv's
                    buffer = torch.empty(tuple(shape), dtype=dtype, device=self.device)
                record = self._p2p_begin("recv", op.peer, None, buffer.numel() * buffer.element_size(),
                                         async_op=True)
                torch_ops.append(dist.P2POp(dist.irecv, buffer, global_peer, self.group))
                finishes.append((record, lambda buffer=buffer: buffer, ("recv", global_peer),
                                 references([buffer])))
        try:
            works = dist.batch_isend_irecv(torch_ops)
        except BaseException:
            self._cache.broken = True
            raise
        for _, _, (kind, peer), _ in finishes:
            self._cache.calls[(tuple(sorted(self.ranks)), kind, peer)] += 1
        if len(works) != len(finishes):      # a coalescing backend (NCCL): one work for the batch
            works = [works[-1]] * len(finishes)
        # each handle frees its op's buffer at its wait (DistWork.wait), as the simulator's does
        return [Handle(DistWork(self, record, work, result, held))
                for (record, result, _, held), work in zip(finishes, works)]

    # -- rooted and uneven collectives --

    @communicating
    def reduce(self, tensor: torch.Tensor, dst: int, op: str, async_op: bool = False, *,
               factor: float | torch.Tensor | None = None) -> Any:
        """The reduction on ``dst``; zeros of the input's shape and dtype on the other ranks
        (the backend leaves partial sums there; simcomm defines them as zeros on both backends)."""
        self._check_avg("reduce", tensor, op)
        record = self._begin("reduce", self._next_step(), tensor, root=dst, args={"dst": dst, "op": op},
                             async_op=async_op)
        tensor, op = on_the_wire(tensor, op, factor)   # PREMUL_SUM (gloo has none): premultiplied, then SUM
        out = self._local_copy(tensor)
        with self._calling(), self._released(async_op, out):
            # AVG as SUM, then divide on dst: a reduce with AVG is not on every backend
            work = dist.reduce(out, dst=self.ranks[dst], op=to_reduce_op("sum" if op == "avg" else op),
                               group=self.group, async_op=async_op)

        def result() -> torch.Tensor:
            if self.rank != dst:
                return out.zero_()
            return out.div_(self.world_size) if op == "avg" else out
        return self._done(record, work, result)

    @communicating
    def scatter(self, tensor: torch.Tensor | None, src: int, dim: int, requires_grad: bool = False,
                async_op: bool = False) -> Any:
        """``(chunk r of src's tensor along dim, whether src said requires_grad)``; ``tensor`` is
        ``None`` off ``src``. ``src`` first broadcasts a small header (dtype, shape, dim, flag),
        so the other ranks need not know the shape; a rank whose ``dim`` does not name src's dim
        raises after the data has moved (no rank is left waiting)."""
        # off src the dtype is known once the header arrives; it is added to args then (for the bytes)
        dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else None
        args = {"src": src, "dim": dim, "dtype": dtype}
        record = self._begin("scatter", self._next_step(), tensor, root=src, args=args, async_op=async_op)
        root = self.ranks[src]
        is_src = self.rank == src
        with self._calling():
            header = torch.zeros(4, dtype=torch.int64, device=self.device)   # ndim, dtype, dim, flag
            if is_src:
                header.copy_(torch.tensor([tensor.dim(), DTYPES.index(tensor.dtype), dim,
                                           int(requires_grad)]))
            dist.broadcast(header, src=root, group=self.group)
            ndim, dtype_index, source_dim, flag = header.tolist()
            shape = tensor.new_tensor(tensor.shape, dtype=torch.int64, device=self.device) if is_src else \
                torch.zeros(ndim, dtype=torch.int64, device=self.device)
            dist.broadcast(shape, src=root, group=self.group)
            full = shape.tolist()
            shard = full[source_dim] // self.world_size
            with self._buffers(async_op):
                out = torch.empty((*full[:source_dim], shard, *full[source_dim + 1:]),
                                  dtype=DTYPES[dtype_index], device=self.device)
            chunks = None
            if is_src:
                local = self._on_device(tensor)
                chunks = [local.narrow(source_dim, r * shard, shard).contiguous()
                          for r in range(self.world_size)]
            work = dist.scatter(out, chunks, src=root, group=self.group, async_op=async_op)
        if not -ndim <= dim < ndim or dim % ndim != source_dim:
            if work is not None:
                work.wait()
            raise ValueError(f"scatter: dim={dim} on rank {self.rank} does not name the dim dim={source_dim} "
                             f"of the source rank {src}'s {ndim}-D tensor {tuple(full)}")
        args["dtype"] = str(out.dtype).removeprefix("torch.")
        return self._done(record, work, lambda: (out, bool(flag)))

    @communicating
    def all_to_all_single(self, tensor: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int], async_op: bool = False) -> Any:
        """Uneven all-to-all along dim 0. The ranks first all-gather their split lists (and row
        sizes), so every rank finds a disagreement and raises the same error before any data moves."""
        outputs, inputs_ = [int(s) for s in output_split_sizes], [int(s) for s in input_split_sizes]
        record = self._begin("all_to_all_single", self._next_step(), tensor,
                             args={"input_split_sizes": inputs_, "output_split_sizes": outputs},
                             async_op=async_op)
        world = self.world_size
        local = self._on_device(tensor, async_op)
        row = [local.shape[1:].numel(), DTYPES.index(local.dtype)]   # elements per row, dtype
        with self._calling():
            mine = torch.tensor(inputs_ + outputs + row, dtype=torch.int64, device=self.device)
            table = mine.new_empty(world * mine.numel())
            all_gather_single(table, mine, group=self.group)
        table = table.reshape(world, 2 * world + 2).tolist()   # (P, 2P + 2): rank r's inputs, outputs, row, dtype
        for rank, entry in enumerate(table):
            if entry[2 * world:] != table[self.rank][2 * world:]:
                raise ValueError(
                    f"all_to_all_single: rank {rank} has {DTYPES[entry[-1]]} rows of {entry[-2]} elements but "
                    f"rank {self.rank} has {local.dtype} {tuple(local.shape)}; every rank must pass the same "
                    f"dtype and the same sizes after dim 0")
        check_splits("all_to_all_single", [entry[:world] for entry in table],
                     [entry[world:2 * world] for entry in table])
        with self._buffers(async_op):
            out = local.new_empty((sum(outputs), *local.shape[1:]))    # (rows received, *rest)
        with self._calling(), self._released(async_op, out, local):
            work = dist.all_to_all_single(out, local, outputs, inputs_, group=self.group, async_op=async_op)
        return self._done(record, work, lambda: out)
