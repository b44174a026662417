"""One row per transport primitive: every fact about an operation that is not its math or its wiring.

:data:`SPECS` holds a :class:`CollectiveSpec` per method of the
:class:`~simcomm.transport.Transport` protocol. The modules that used to write
these facts each for themselves read them here:

* :mod:`simcomm.ops`: the names a trace records and the cost model prices, and
  their other spellings (``name``, ``kind``, ``traced``, ``cost_name``, ``aliases``);
* :mod:`simcomm.sim.transport` and checked mode on real workers
  (:mod:`real.checked_calls`): what every rank of the group must pass alike
  (:meth:`CollectiveSpec.agreed_fields`), so the simulator's mismatch rule and checked
  mode's are one rule;
* :mod:`simcomm.trace` and :mod:`simcomm.model.cost`: the bytes a rank sends to and
  receives from each peer (:meth:`CollectiveSpec.peer_bytes`);
* :mod:`simcomm.model.cost`: the algorithms NCCL may run it with, nccl-tests'
  busbw factor and size convention;
* :mod:`simcomm.dtypes`: which dtypes and reductions the real backends refuse.

``dual`` names the operation its backward runs (the adjoint), for the reader.

Bytes per peer follow each op's *definition* as a direct exchange, not a
particular algorithm (ring, tree): with ``b`` bytes per rank on ``n`` ranks,

=================  =========================================================
all_gather         each rank sends its ``b`` to every other rank
reduce_scatter     each rank sends peer ``j`` the chunk ``j`` owns: ``b/n``
all_reduce         reduce-scatter then all-gather: ``2 b/n`` to every peer
all_to_all         ``b/n`` to every peer
broadcast          the source sends ``b`` to every other rank
gather             every other rank sends its ``b`` to the destination
reduce             every other rank sends its ``b`` to the destination
scatter            the source sends chunk ``j`` (``b/n``) to each other rank ``j``
all_to_all_single  ``input_split_sizes[j]`` rows to peer ``j``, ``output_split_sizes[j]``
                   rows from it (the event's args hold both lists)
send / recv        ``b`` from sender to receiver
barrier, subgroup  nothing
=================  =========================================================

A new collective gets its row here; docs/contributing.md lists the files its
math and its wiring go in.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["CollectiveSpec", "SPECS", "COST_SPECS", "EVERY_COLLECTIVE_REFUSES", "spec_of"]

#: ``(sent, received)``: bytes to and from each peer (global ranks)
PeerBytes = tuple[dict[int, int], dict[int, int]]


@dataclass(frozen=True)
class CollectiveSpec:
    """The facts about one transport primitive.

    * ``kind``: ``"collective"`` (every rank of the group makes the same call),
      ``"p2p"`` (one end of a message, or a batch of them) or ``"compute"`` (declared work);
    * ``traced``: a trace event carries this name as its ``op``;
    * ``cost_name``: the cost model's and nccl-tests' name (``send``/``recv``: ``send_recv``),
      ``aliases`` its other spellings;
    * ``tensor``: how the ranks' tensors must agree: ``"whole"`` (shape and dtype), ``"rows"``
      (dtype and the shape of one dim-0 row: uneven splits), ``"none"``; ``agreed``: the
      arguments every rank must pass alike, in the order mismatch messages and traces show them;
    * ``algorithms``: the algorithms the cost model runs it with (empty: not priced);
      ``busbw``: nccl-tests' bus-bandwidth factor on ``n`` ranks; ``nccl_size``: what nccl-tests'
      ``size`` counts: ``"buffer"`` (each rank's buffer), ``"output"`` (the whole output,
      ``n`` x the per-rank input), ``"input"`` (the whole input, split ``n`` ways);
    * ``dtype_checked``: the real backends' dtype tables apply (:mod:`simcomm.dtypes`), with
      :data:`EVERY_COLLECTIVE_REFUSES` and this op's own ``refuses`` (``(backend, dtype, why)``);
      ``reducing``: the error class torch raises for a complex reduction other than SUM/AVG
      (``None``: the op does not reduce);
    * ``dual``: the primitive its backward runs.
    """

    name: str
    kind: str
    traced: bool = True
    cost_name: str | None = None
    aliases: tuple[str, ...] = ()
    tensor: str = "whole"
    agreed: tuple[str, ...] = ()
    peers: Callable[..., PeerBytes] | None = None
    algorithms: tuple[str, ...] = ()
    busbw: Callable[[int], float] | None = None
    nccl_size: str | None = None
    dtype_checked: bool = False
    refuses: tuple[tuple[str, torch.dtype, str], ...] = ()
    reducing: type[Exception] | None = None
    dual: str | None = None

    @property
    def priced_as(self) -> str:
        """The name the cost model prices this op under."""
        return self.cost_name or self.name

    def agreed_fields(self, shape, dtype, *values, rows_label: str = "row_shape") -> tuple:
        """What every rank must pass alike, as ``(name, value)`` pairs: the tensor's (``shape`` and
        ``dtype``, per ``tensor``), then ``agreed`` paired with ``values`` in order.
        ``rows_label``: the name of a ``"rows"`` op's row shape (the simulator writes it
        ``shape[1:]``, checked mode ``row_shape``)."""
        tensor = self.tensor
        if tensor == "whole":
            return (("shape", tuple(shape)), ("dtype", dtype), *zip(self.agreed, values))
        if tensor == "rows":
            return (("dtype", dtype), (rows_label, tuple(shape[1:])), *zip(self.agreed, values))
        return tuple(zip(self.agreed, values))

    def peer_bytes(self, nbytes: int, ranks: tuple[int, ...], rank: int, root: int | None = None,
                   *, args: dict | None = None, out_nbytes: int | None = None, row_bytes: int | None = None
                   ) -> PeerBytes:
        """Bytes ``rank`` sends to and receives from each peer in one call (see
        :func:`simcomm.trace.peer_bytes` for the arguments); nothing for an op that moves no data."""
        if self.peers is None:
            return {}, {}
        return self.peers(nbytes, ranks, rank, root, args, out_nbytes, row_bytes)


# -- bytes per peer: one function per op, (nbytes, ranks, rank, root, args, out_nbytes, row_bytes) ------

def _others(ranks, rank):
    return [peer for peer in ranks if peer != rank]


def _to_root(nbytes, ranks, rank, root, args, out_nbytes, row_bytes) -> PeerBytes:
    """reduce, gather: every other rank sends its buffer to the root."""
    return ({}, dict.fromkeys(_others(ranks, rank), nbytes)) if rank == root else ({root: nbytes}, {})


def _scatter_bytes(nbytes, ranks, rank, root, args, out_nbytes, row_bytes) -> PeerBytes:
    if rank == root:
        return dict.fromkeys(_others(ranks, rank), nbytes // len(ranks)), {}
    return {}, {root: out_nbytes or 0}


def _uneven_bytes(nbytes, ranks, rank, root, args, out_nbytes, row_bytes) -> PeerBytes:
    world_size = len(ranks)
    sent_rows = (args or {}).get("input_split_sizes") or [0] * world_size
    received_rows = (args or {}).get("output_split_sizes") or [0] * world_size
    row = row_bytes or 0
    return ({peer: sent_rows[i] * row for i, peer in enumerate(ranks) if peer != rank},
            {peer: received_rows[i] * row for i, peer in enumerate(ranks) if peer != rank})


def _every_peer(nbytes, ranks, rank, root, args, out_nbytes, row_bytes) -> PeerBytes:
    """all_gather: the whole buffer to and from every peer."""
    peers = _others(ranks, rank)
    return dict.fromkeys(peers, nbytes), dict.fromkeys(peers, nbytes)


def _share(nbytes, ranks, rank, root, args, out_nbytes, row_bytes) -> PeerBytes:
    """reduce_scatter, all_to_all: ``b/n`` to and from every peer."""
    peers, share = _others(ranks, rank), nbytes // len(ranks)
    return dict.fromkeys(peers, share), dict.fromkeys(peers, share)


def _twice_share(nbytes, ranks, rank, root, args, out_nbytes, row_bytes) -> PeerBytes:
    """all_reduce: reduce-scatter then all-gather, ``2 b/n`` to and from every peer."""
    peers, share = _others(ranks, rank), 2 * nbytes // len(ranks)
    return dict.fromkeys(peers, share), dict.fromkeys(peers, share)


def _from_root(nbytes, ranks, rank, root, args, out_nbytes, row_bytes) -> PeerBytes:
    """broadcast: the root sends its buffer to every other rank."""
    return (dict.fromkeys(_others(ranks, rank), nbytes), {}) if rank == root else ({}, {root: nbytes})


def _sent(nbytes, ranks, rank, root, args, out_nbytes, row_bytes) -> PeerBytes:
    return {root: nbytes}, {}


def _received(nbytes, ranks, rank, root, args, out_nbytes, row_bytes) -> PeerBytes:
    return {}, {root: nbytes}


# -- nccl-tests' bus-bandwidth factors ------------------------------------------------------------

def _twice_ring(n: int) -> float:
    return 2 * (n - 1) / n


def _ring(n: int) -> float:
    return (n - 1) / n


def _one(n: int) -> float:
    return 1.0


_INT16 = torch.int16
#: what the real backends refuse in every collective that carries data (``dtype_checked``)
EVERY_COLLECTIVE_REFUSES: tuple[tuple[str, torch.dtype, str], ...] = (
    ("gloo", _INT16, "Invalid scalar type"),             # measured: benchmarks/gloo_dtypes.py
    ("nccl", _INT16, "Unsupported data type for NCCL process group"),   # ProcessGroupNCCL's dtype map
)


def _rows() -> tuple[CollectiveSpec, ...]:
    collective = dict(kind="collective", dtype_checked=True)
    return (
        CollectiveSpec("all_reduce", **collective, aliases=("allreduce",), agreed=("op",), peers=_twice_share,
                       algorithms=("ring", "tree", "nvls"), busbw=_twice_ring, nccl_size="buffer",
                       reducing=ValueError, dual="all_reduce"),
        CollectiveSpec("all_gather", **collective, aliases=("allgather",), agreed=("dim",), peers=_every_peer,
                       algorithms=("ring",), busbw=_ring, nccl_size="output", dual="reduce_scatter"),
        CollectiveSpec("reduce_scatter", **collective, aliases=("reducescatter",), agreed=("dim", "op"),
                       peers=_share, algorithms=("ring",), busbw=_ring, nccl_size="input",
                       reducing=RuntimeError, dual="all_gather"),
        CollectiveSpec("all_to_all", **collective, aliases=("alltoall", "all2all"),
                       agreed=("scatter_dim", "gather_dim"), peers=_share, algorithms=("direct",), busbw=_ring,
                       nccl_size="input", dual="all_to_all"),
        # the split sizes are agreed pairwise (what i sends j is what j expects from i), not alike
        CollectiveSpec("all_to_all_single", **collective,
                       aliases=("alltoallsingle", "all_to_all_v", "alltoallv"), tensor="rows",
                       peers=_uneven_bytes, algorithms=("direct",), busbw=_ring, nccl_size="input",
                       dual="all_to_all_single"),
        CollectiveSpec("broadcast", **collective, aliases=("bcast",), agreed=("src",), peers=_from_root,
                       algorithms=("ring",), busbw=_one, nccl_size="buffer", dual="reduce"),
        CollectiveSpec("reduce", **collective, agreed=("dst", "op"), peers=_to_root, algorithms=("ring",),
                       busbw=_one, nccl_size="buffer", reducing=RuntimeError, dual="broadcast"),
        CollectiveSpec("gather", **collective, agreed=("dst", "dim"), peers=_to_root, algorithms=("direct",),
                       busbw=_ring, nccl_size="output",
                       refuses=(("gloo", torch.complex64, "Invalid scalar type"),
                                ("gloo", torch.complex128, "Invalid scalar type")), dual="scatter"),
        # only the source has a tensor (the others may pass None); each rank's dim is checked
        # against the source's once its tensor arrives
        CollectiveSpec("scatter", **collective, tensor="none", agreed=("src",), peers=_scatter_bytes,
                       algorithms=("direct",), busbw=_ring, nccl_size="input", dual="gather"),
        CollectiveSpec("barrier", kind="collective", tensor="none"),
        CollectiveSpec("subgroup", kind="collective", tensor="none", agreed=("groups",)),
        CollectiveSpec("send", kind="p2p", cost_name="send_recv", aliases=("sendrecv", "send/recv"), peers=_sent,
                       algorithms=("p2p",), busbw=_one, nccl_size="buffer", dual="recv"),
        CollectiveSpec("recv", kind="p2p", cost_name="send_recv", peers=_received, algorithms=("p2p",),
                       busbw=_one, nccl_size="buffer", dual="send"),
        # traced as its sends and recvs
        CollectiveSpec("batch_isend_irecv", kind="p2p", traced=False, tensor="none"),
        CollectiveSpec("compute", kind="compute", tensor="none"),
    )


#: transport primitive name -> its row, in the order traces and the cost model list them
SPECS: dict[str, CollectiveSpec] = {spec.name: spec for spec in _rows()}
#: cost-model name -> the row it is priced from (``send_recv``: the send's)
COST_SPECS: dict[str, CollectiveSpec] = {}
for _spec in SPECS.values():
    if _spec.algorithms:
        COST_SPECS.setdefault(_spec.priced_as, _spec)
del _spec


def spec_of(name: str) -> CollectiveSpec | None:
    """The row of a primitive, or of a cost-model name (``send_recv``); ``None`` for other names."""
    return SPECS.get(name) or COST_SPECS.get(name)
