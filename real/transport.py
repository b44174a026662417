"""The :class:`~simcomm.transport.Transport` of one process in one ``torch.distributed`` group.

:class:`DistTransport` moves data with the ``torch.distributed`` collectives
(NCCL on GPUs, gloo on CPU); the argument checks and the autograd rules are
simcomm's own (:class:`simcomm.Communicator`, :mod:`simcomm.autograd`), so a
program behaves the same on real processes as on virtual ranks.

Every primitive honours the transport contract: the input is never modified
(it is copied to the transport's device first), the result is a new
contiguous tensor on that device, and the call blocks until this rank's part
is complete. ``src``/``dst`` are group-local and translated to global ranks
here. Each call records a :class:`~simcomm.trace.TraceEvent` in simcomm's
format when tracing is on.

Reductions a backend lacks are emulated, never approximated: a backend without
``ReduceOp.AVG`` sums and divides; one without a ``reduce_scatter`` for an op
all-reduces and keeps this rank's chunk.
"""
from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from simcomm.collectives import check_splits, to_reduce_op
from simcomm.trace import Trace
from simcomm.transport import TransportBase

__all__ = ["DistTransport", "GroupCache", "books_agree"]

# The names torch gives its single-tensor collectives changed over releases.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

#: every dtype this torch knows, in a fixed order: a scatter header names one by its index
_DTYPES = tuple(dict.fromkeys(value for _, value in sorted(vars(torch).items(), key=lambda item: item[0])
                              if isinstance(value, torch.dtype)))

#: phrases in the error a backend raises for an op or reduction it does not implement
_UNSUPPORTED = ("not supported", "unsupported", "does not support", "cannot use", "not implemented")


def _is_unsupported(error: BaseException) -> bool:
    text = str(error).lower()
    return any(phrase in text for phrase in _UNSUPPORTED)


class GroupCache:
    """The process groups one process has created, by their global ranks.

    ``torch.distributed`` names a group created with
    ``use_local_synchronization=True`` after its ranks, so creating the same
    set of ranks twice would collide in the rendezvous store. The cache makes
    every set of ranks a single process group for the life of the process
    (reused across :meth:`DistTransport.subgroup` calls and across runs of a
    :class:`real.Cluster`). It also remembers which (op, reduction) pairs the
    backend turned down, so the fallback is chosen once.

    And it keeps the books a :class:`real.Cluster` needs to reuse its workers
    after a program raised: how many collectives this process completed on
    each group, how many tensors it sent to and received from each peer, and
    whether a call into the backend ever failed (``broken``). When every rank
    raised and the books of all ranks agree, no message is half delivered and
    the process groups can serve the next run.
    """

    def __init__(self, world_group: dist.ProcessGroup | None = None):
        self.world_group = world_group if world_group is not None else dist.group.WORLD
        self._groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self.unsupported: set[tuple[str, str]] = set()
        self.calls: Counter[tuple] = Counter()
        self.broken = False

    @contextlib.contextmanager
    def calling(self, key: tuple) -> Iterator[None]:
        """Count one completed backend call under ``key``; a call that raises marks the cache broken."""
        try:
            yield
        except BaseException:
            self.broken = True
            raise
        self.calls[key] += 1

    def books(self) -> tuple[bool, dict[tuple, int]]:
        """``(broken, calls)``: what :func:`books_agree` compares across ranks."""
        return self.broken, dict(self.calls)

    def group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup:
        """The process group of exactly ``ranks`` (global, any order); created on first use.

        Only the members call this (local synchronization), so a subgroup of a
        subgroup needs no cooperation from the rest of the world.
        """
        key = tuple(sorted(ranks))
        if key == tuple(range(dist.get_world_size())):
            return self.world_group
        group = self._groups.get(key)
        if group is None:
            group = dist.new_group(list(key), use_local_synchronization=True)
            self._groups[key] = group
        return group


def books_agree(books: dict[int, tuple[bool, dict[tuple, int]]]) -> bool:
    """Whether the ranks' :meth:`GroupCache.books` show no half-finished communication.

    ``books`` maps every global rank to its books. True when no call failed,
    every member of each group completed as many collectives on it as the
    others, and every rank received from each peer as many tensors as that
    peer sent it.
    """
    if any(broken for broken, _ in books.values()):
        return False
    for rank, (_, calls) in books.items():
        for (group, kind, peer), count in calls.items():
            if kind == "collective":
                if any(books[member][1].get((group, kind, None), 0) != count for member in group):
                    return False
            elif kind == "send":
                if books[peer][1].get((group, "recv", rank), 0) != count:
                    return False
            elif kind == "recv":
                if books[peer][1].get((group, "send", rank), 0) != count:
                    return False
    return True


class DistTransport(TransportBase):
    """Raw collectives of this process within ``group`` (a ``torch.distributed`` ProcessGroup).

    ``device`` is where every result lives (default: ``cuda:<current device>``
    for an NCCL group, else the CPU). ``events`` is the list trace records are
    appended to in :class:`~simcomm.transport.TransportBase`'s format (``None``:
    no tracing); ``clock_zero`` the ``time.perf_counter()`` value times count from.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
                 *, events: list | None = None, clock_zero: float | None = None,
                 cache: GroupCache | None = None):
        group = group if group is not None else dist.group.WORLD
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("DistTransport: this process is not a member of the given group "
                             "(or torch.distributed is not initialized)")
        self.group = group
        self.backend = str(dist.get_backend(group)).lower()
        if device is None:
            device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                      else torch.device("cpu"))
        ranks = dist.get_process_group_ranks(group)
        super().__init__(dist.get_rank(group), ranks, torch.device(device), events,
                         time.perf_counter() if clock_zero is None else clock_zero)
        self._cache = cache if cache is not None else GroupCache()
        self._p2p_steps: dict[tuple[int, int], int] = {}

    def __repr__(self) -> str:
        return (f"DistTransport(rank={self.rank}, ranks={list(self.ranks)}, backend={self.backend}, "
                f"device={self.device})")

    @property
    def events(self) -> list | None:
        """The raw trace records so far, shared with the subgroups made from this transport
        (``None`` when tracing is off); :attr:`trace` turns them into a :class:`~simcomm.trace.Trace`."""
        return self._events

    @property
    def trace(self) -> Trace:
        """What this process has recorded so far, as a :class:`~simcomm.trace.Trace`."""
        return Trace(list(self._events or []))

    # -- helpers --

    def _calling(self, kind: str = "collective", peer: int | None = None):
        """Count this call in the books of :class:`GroupCache` (key: group, kind, global peer)."""
        return self._cache.calling((tuple(sorted(self.ranks)), kind, peer))

    def _local_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A private contiguous copy of ``tensor`` on this transport's device (the input stays untouched)."""
        return tensor.detach().to(self.device, copy=True).contiguous()

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on this transport's device, contiguous; a copy only where needed (read-only use)."""
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
            if not _is_unsupported(error):
                raise
            self._cache.unsupported.add((op, reduction))
            return False

    # -- collectives --

    def _all_reduce_into(self, out: torch.Tensor, reduction: str) -> None:
        """In-place all-reduce of the private buffer ``out``."""
        if reduction == "avg":
            if self._native("all_reduce", "avg",
                            lambda: dist.all_reduce(out, to_reduce_op("avg"), group=self.group)):
                return
            dist.all_reduce(out, to_reduce_op("sum"), group=self.group)
            out.div_(self.world_size)
            return
        dist.all_reduce(out, to_reduce_op(reduction), group=self.group)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        self._check_avg("all_reduce", tensor, op)
        event = self._begin("all_reduce", self._next_step(), tensor, args={"op": op})
        out = self._local_copy(tensor)
        with self._calling():
            self._all_reduce_into(out, op)
        self._end(event, out)
        return out

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        event = self._begin("all_gather", self._next_step(), tensor, args={"dim": dim})
        moved = self._on_device(tensor.movedim(dim, 0))          # (d, *rest): dim first
        flat = moved.new_empty((self.world_size * moved.shape[0], *moved.shape[1:]))  # (P*d, *rest)
        with self._calling():
            _all_gather_single(flat, moved, group=self.group)    # rank r's block at rows r*d:(r+1)*d
        out = flat.movedim(0, dim).contiguous()                  # concatenated along dim
        self._end(event, out)
        return out

    def reduce_scatter(self, tensor: torch.Tensor, dim: int, op: str) -> torch.Tensor:
        self._check_avg("reduce_scatter", tensor, op)
        event = self._begin("reduce_scatter", self._next_step(), tensor, args={"dim": dim, "op": op})
        moved = self._on_device(tensor.movedim(dim, 0))          # (d, *rest): dim first
        shard = moved.shape[0] // self.world_size
        out = moved.new_empty((shard, *moved.shape[1:]))         # (d/P, *rest)

        def native() -> None:
            _reduce_scatter_single(out, moved, to_reduce_op(op), group=self.group)

        with self._calling():
            if not self._native("reduce_scatter", op, native):
                full = moved.clone()                             # (d, *rest)
                self._all_reduce_into(full, op)
                out = full.narrow(0, self.rank * shard, shard)   # (d/P, *rest): this rank's chunk
        out = out.movedim(0, dim).contiguous()                   # chunk r along dim
        self._end(event, out)
        return out

    def all_to_all(self, tensor: torch.Tensor, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        event = self._begin("all_to_all", self._next_step(), tensor,
                            args={"scatter_dim": scatter_dim, "gather_dim": gather_dim})
        world = self.world_size
        moved = self._on_device(tensor.movedim(scatter_dim, 0))  # (S, *rest): chunk j of S goes to rank j
        received = torch.empty_like(moved)                       # (S, *rest): chunk i came from rank i
        with self._calling():
            dist.all_to_all_single(received, moved, group=self.group)
        shard = moved.shape[0] // world
        pieces = received.reshape(world, shard, *moved.shape[1:])  # (P, S/P, *rest)
        pieces = pieces.movedim(1, scatter_dim + 1)              # (P, *shape with S/P at scatter_dim)
        pieces = pieces.movedim(0, gather_dim)                   # (..., P, G, ...): P just before gather_dim
        out = pieces.flatten(gather_dim, gather_dim + 1).contiguous()  # (..., P*G, ...): concat in rank order
        self._end(event, out)
        return out

    def gather(self, tensor: torch.Tensor, dst: int, dim: int) -> torch.Tensor | None:
        event = self._begin("gather", self._next_step(), tensor, root=dst, args={"dst": dst, "dim": dim})
        local = self._on_device(tensor)
        parts = [torch.empty_like(local) for _ in range(self.world_size)] if self.rank == dst else None
        with self._calling():
            dist.gather(local, parts, dst=self.ranks[dst], group=self.group)
        out = torch.cat(parts, dim) if parts is not None else None   # (.., P*d at dim, ..) on dst
        self._end(event, out)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        event = self._begin("broadcast", self._next_step(), tensor, root=src, args={"src": src})
        out = self._local_copy(tensor)
        with self._calling():
            dist.broadcast(out, src=self.ranks[src], group=self.group)
        self._end(event, out)
        return out

    def barrier(self) -> None:
        event = self._begin("barrier", self._next_step(), None)
        with self._calling():
            if self.backend == "nccl" and self.device.type == "cuda":
                dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.group)
        self._end(event, None)

    def subgroup(self, groups: tuple[tuple[int, ...], ...]) -> DistTransport:
        """This process's part of ``groups`` (group-local ranks) as a transport of its own.

        Only the members of each part create its process group, so the call
        does not synchronize the parts with each other.
        """
        event = self._begin("subgroup", self._next_step(), None, args={"groups": groups})
        part = next(part for part in groups if self.rank in part)
        group = self._cache.group(tuple(self.ranks[r] for r in part))
        child = DistTransport(group, self.device, events=self._events, clock_zero=self._clock_zero,
                              cache=self._cache)
        self._end(event, None)
        return child

    # -- point to point --

    def _p2p_event(self, op: str, peer: int, tensor: torch.Tensor | None, nbytes: int | None = None):
        key = (self.rank, peer) if op == "send" else (peer, self.rank)
        step = self._p2p_steps.get(key, 0)
        self._p2p_steps[key] = step + 1
        return self._begin(op, step, tensor, peer, nbytes=nbytes)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Blocks until the backend has taken the data (gloo may return before the recv is posted)."""
        event = self._p2p_event("send", dst, tensor)
        with self._calling("send", self.ranks[dst]):
            dist.send(self._on_device(tensor), dst=self.ranks[dst], group=self.group)
        self._end(event, None)

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int) -> torch.Tensor:
        out = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        event = self._p2p_event("recv", src, None, out.numel() * out.element_size())
        with self._calling("recv", self.ranks[src]):
            dist.recv(out, src=self.ranks[src], group=self.group)
        self._end(event, out)
        return out

    # -- rooted and uneven collectives --

    def reduce(self, tensor: torch.Tensor, dst: int, op: str) -> torch.Tensor:
        """The reduction on ``dst``; zeros of the input's shape and dtype on the other ranks
        (the backend leaves partial sums there; simcomm defines them as zeros on both backends)."""
        self._check_avg("reduce", tensor, op)
        event = self._begin("reduce", self._next_step(), tensor, root=dst, args={"dst": dst, "op": op})
        out = self._local_copy(tensor)
        with self._calling():
            # AVG as SUM, then divide on dst: a reduce with AVG is not on every backend
            dist.reduce(out, dst=self.ranks[dst], op=to_reduce_op("sum" if op == "avg" else op),
                        group=self.group)
        if self.rank != dst:
            out.zero_()
        elif op == "avg":
            out.div_(self.world_size)
        self._end(event, out)
        return out

    def scatter(self, tensor: torch.Tensor | None, src: int, dim: int, requires_grad: bool = False
                ) -> tuple[torch.Tensor, bool]:
        """``(chunk r of src's tensor along dim, whether src said requires_grad)``; ``tensor`` is
        ``None`` off ``src``. ``src`` first broadcasts a small header (dtype, shape, dim, flag),
        so the other ranks need not know the shape; a rank whose ``dim`` does not name src's dim
        raises after the data has moved (no rank is left waiting)."""
        # off src the dtype is known once the header arrives; it is added to args then (for the bytes)
        dtype = str(tensor.dtype).removeprefix("torch.") if tensor is not None else None
        args = {"src": src, "dim": dim, "dtype": dtype}
        event = self._begin("scatter", self._next_step(), tensor, root=src, args=args)
        root = self.ranks[src]
        is_src = self.rank == src
        with self._calling():
            header = torch.zeros(4, dtype=torch.int64, device=self.device)   # ndim, dtype, dim, flag
            if is_src:
                header.copy_(torch.tensor([tensor.dim(), _DTYPES.index(tensor.dtype), dim,
                                           int(requires_grad)]))
            dist.broadcast(header, src=root, group=self.group)
            ndim, dtype_index, source_dim, flag = header.tolist()
            shape = tensor.new_tensor(tensor.shape, dtype=torch.int64, device=self.device) if is_src else \
                torch.zeros(ndim, dtype=torch.int64, device=self.device)
            dist.broadcast(shape, src=root, group=self.group)
            full = shape.tolist()
            shard = full[source_dim] // self.world_size
            out = torch.empty((*full[:source_dim], shard, *full[source_dim + 1:]),
                              dtype=_DTYPES[dtype_index], device=self.device)
            chunks = None
            if is_src:
                local = self._on_device(tensor)
                chunks = [local.narrow(source_dim, r * shard, shard).contiguous()
                          for r in range(self.world_size)]
            dist.scatter(out, chunks, src=root, group=self.group)
        if not -ndim <= dim < ndim or dim % ndim != source_dim:
            raise ValueError(f"scatter: dim={dim} on rank {self.rank} does not name the dim dim={source_dim} "
                             f"of the source rank {src}'s {ndim}-D tensor {tuple(full)}")
        args["dtype"] = str(out.dtype).removeprefix("torch.")
        self._end(event, out)
        return out, bool(flag)

    def all_to_all_single(self, tensor: torch.Tensor, output_split_sizes: Sequence[int],
                          input_split_sizes: Sequence[int]) -> torch.Tensor:
        """Uneven all-to-all along dim 0. The ranks first all-gather their split lists (and row
        sizes), so every rank finds a disagreement and raises the same error before any data moves."""
        outputs, inputs_ = [int(s) for s in output_split_sizes], [int(s) for s in input_split_sizes]
        event = self._begin("all_to_all_single", self._next_step(), tensor,
                            args={"input_split_sizes": inputs_, "output_split_sizes": outputs})
        world = self.world_size
        local = self._on_device(tensor)
        row = [local.shape[1:].numel(), _DTYPES.index(local.dtype)]   # elements per row, dtype
        with self._calling():
            mine = torch.tensor(inputs_ + outputs + row, dtype=torch.int64, device=self.device)
            table = mine.new_empty(world * mine.numel())
            _all_gather_single(table, mine, group=self.group)
        table = table.reshape(world, 2 * world + 2).tolist()   # (P, 2P + 2): rank r's inputs, outputs, row, dtype
        for rank, entry in enumerate(table):
            if entry[2 * world:] != table[self.rank][2 * world:]:
                raise ValueError(
                    f"all_to_all_single: rank {rank} has {_DTYPES[entry[-1]]} rows of {entry[-2]} elements but "
                    f"rank {self.rank} has {local.dtype} {tuple(local.shape)}; every rank must pass the same "
                    f"dtype and the same sizes after dim 0")
        check_splits("all_to_all_single", [entry[:world] for entry in table],
                     [entry[world:2 * world] for entry in table])
        out = local.new_empty((sum(outputs), *local.shape[1:]))    # (rows received, *rest)
        with self._calling():
            dist.all_to_all_single(out, local, outputs, inputs_, group=self.group)
        self._end(event, out)
        return out
