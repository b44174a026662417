"""The simulator's reductions: every floating-point sum in gloo's ring order, bit for bit.

:mod:`simcomm.collectives` is the reference math, plain stacked reductions
(torch's own order of additions). A floating-point sum rounds at every step, so
its value depends on the order in which the ranks' tensors are combined; the
simulator's transport (:mod:`simcomm.sim.transport`) reduces with the functions
here instead, so that virtual ranks get, bit for bit, what gloo processes get
(``real`` on CPU), for every world size, size and dtype. SUM, AVG and PRODUCT of
floating-point and complex tensors follow gloo's ring algorithms on CPU:

- gloo's ring cuts the flat buffer (a complex tensor's real view) into one chunk
  per rank; chunk ``c`` leaves rank ``c - 1`` and travels down the ring, each
  rank adding its part: ``((x[c-1] + x[c-2]) + x[c-3]) + ... + x[c]``, ranks mod
  the world size (two ranks: ``x0 + x1`` either way);
- :func:`all_reduce` and :func:`reduce_scatter` follow gloo's all-reduce
  (``dist.reduce_scatter_tensor`` on gloo all-reduces the whole buffer, its
  list form each entry by itself: ``separately``), :func:`reduce_to` gloo's
  reduce; the two cut buffers of over ``2 * world_size`` MiB into chunks of
  different lengths (``_ring_chunk``, 1 MiB segments);
- AVG is that sum divided by the world size (as gloo computes it, and as the
  transports do where a backend has no AVG); PREMUL_SUM reaches these functions
  premultiplied, as a SUM (:func:`simcomm.collectives.on_the_wire`).

Integer and bool reductions, MAX and MIN are exact in any order: they equal the
reference's bit for bit, and large ones accumulate in place (no ``(world, ...)``
stack). Shape-only ranks reduce *meta* tensors: alike ones reduce to what two do.
What is not claimed: NCCL on GPUs picks its algorithm (ring, tree, ...), protocol
and number of channels by size and topology, so its roundings are its own; the
simulator agrees with it, as with the single-device float64 reference, up to
rounding.

Like the reference, no function modifies its inputs, no output is a view of an
input, and the results are differentiable.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ReduceOp

from ..checks import BITWISE_OPS, PREMUL_SUM, check_avg_dtype, check_bitwise_dtype, check_same, reduce_op_name
from ..collectives import reduce as reduce_in_any_order, scatter

__all__ = ["reduce", "all_reduce", "reduce_scatter", "reduce_to", "ORDERS"]

#: the gloo collectives whose order a reduction can follow (:func:`reduce`'s ``order``)
ORDERS = ("all_reduce", "reduce")
#: gloo's ``kMaxSegmentSize`` (gloo/allreduce.h, gloo/reduce.h): the most bytes its ring moves at once
_GLOO_SEGMENT_BYTES = 1 << 20
_RING_REDUCTIONS = ("sum", "avg", "product")   # the reductions whose float result depends on the order
_LONG_CHUNK = 1 << 12           # elements from which the ring's chunks are summed one at a time
_STACK_AT_MOST = 1 << 22        # ranks x elements up to which short chunks are summed from one stack
_ACCUMULATE_FROM = 1 << 16      # elements per rank from which exact reductions accumulate in place


def reduce(inputs: Sequence[torch.Tensor], op: ReduceOp | str = "sum", *,
           order: str = "all_reduce") -> torch.Tensor:
    """Elementwise reduction of the ranks' tensors: one new tensor of the common shape and dtype,
    as :func:`simcomm.collectives.reduce`, but a floating-point SUM, AVG or PRODUCT combines every
    element in the order of gloo's ring ``order``: ``"all_reduce"``, gloo's ring all-reduce
    (:func:`all_reduce`, :func:`reduce_scatter`), or ``"reduce"``, gloo's ring reduce
    (:func:`reduce_to`); see the module's docstring. PREMUL_SUM arrives premultiplied, as SUM.
    """
    name = reduce_op_name(op)
    if order not in ORDERS:
        raise ValueError(f"reduce: order={order!r} is not one of {ORDERS}")
    if name == PREMUL_SUM:
        raise ValueError("reduce: PREMUL_SUM reaches gloo's order premultiplied, as a sum "
                         "(simcomm.collectives.on_the_wire)")
    if name == "avg":
        check_avg_dtype("reduce", inputs[0], name)
    check_bitwise_dtype("reduce", inputs[0], name)
    if len(inputs) == 1:
        return inputs[0].clone()
    if inputs[0].is_meta and _alike(inputs):
        # shape-only ranks: N alike meta tensors reduce to what two do; without a gradient the
        # result's metadata is learnt once per reduction and input metadata (torch's meta
        # kernels of elementwise math run in Python: about 0.1 ms for one add of two)
        first = inputs[0]
        if first.requires_grad:
            return _reduce(inputs[:2], name, order)
        key = (name, first.shape, first.stride(), first.dtype)
        known = _META_REDUCTIONS.get(key)
        if known is None:
            out = _reduce(inputs[:2], name, order)
            known = _META_REDUCTIONS[key] = (out.shape, out.stride(), out.dtype)
        return torch.empty_strided(known[0], known[1], dtype=known[2], device="meta")
    return _reduce(inputs, name, order)


def all_reduce(inputs: Sequence[torch.Tensor], op: ReduceOp | str = "sum") -> list[torch.Tensor]:
    """:func:`simcomm.collectives.all_reduce` in gloo's order: every rank gets the reduction."""
    check_same("all_reduce", inputs)
    return [reduce(inputs, op)] * len(inputs)


def reduce_scatter(inputs: Sequence[torch.Tensor], dim: int = -1, op: ReduceOp | str = "sum", *,
                   separately: bool = False) -> list[torch.Tensor]:
    """:func:`simcomm.collectives.reduce_scatter` in gloo's order: rank ``r`` keeps chunk ``r``
    along ``dim`` of the reduction.

    The sums follow gloo's ring all-reduce of the buffer a transport hands the backend: each
    rank's tensor with ``dim`` moved first, flat (``dist.reduce_scatter_tensor`` on gloo
    all-reduces that whole buffer and keeps chunk ``r``). ``separately``: each chunk is a buffer
    of its own, all-reduced by itself, as gloo runs ``dist.reduce_scatter``'s list form (one
    all-reduce per entry of the list); the result is the same but for the rounding.
    """
    check_same("reduce_scatter", inputs)
    world_size = len(inputs)
    dim = dim % max(inputs[0].dim(), 1)
    moved = inputs if dim == 0 else [t.movedim(dim, 0) for t in inputs]     # (d, *rest) each
    if separately:
        shards = [scatter(t, world_size, 0) for t in moved]             # shards[src][dst]: (d/P, *rest)
        return [reduce([shards[src][dst] for src in range(world_size)], op).movedim(0, dim)
                .contiguous() for dst in range(world_size)]
    reduced = reduce(moved, op)                                         # (d, *rest)
    return scatter(reduced if dim == 0 else reduced.movedim(0, dim), world_size, dim)


def reduce_to(inputs: Sequence[torch.Tensor], dst: int = 0, op: ReduceOp | str = "sum") -> list[torch.Tensor]:
    """:func:`simcomm.collectives.reduce_to` in gloo's ring reduce's order, whatever ``dst``:
    the reduction on rank ``dst``, zeros of the input's shape and dtype on the others."""
    check_same("reduce", inputs)
    reduced = reduce(inputs, op, order="reduce")
    zeros = torch.zeros_like(inputs[0])
    return [reduced if rank == dst else zeros for rank in range(len(inputs))]


#: (reduction, shape, strides, dtype) of alike meta inputs -> (shape, strides, dtype) of their reduction
_META_REDUCTIONS: dict[tuple, tuple] = {}


def _alike(inputs: Sequence[torch.Tensor]) -> bool:
    """Whether every tensor has the first one's shape, strides, dtype and device: a reduction's
    result then has the same metadata whatever their number (above one)."""
    first = inputs[0]
    shape, stride, dtype, device = first.shape, first.stride(), first.dtype, first.device
    return all(t is first or (t.shape == shape and t.stride() == stride and t.dtype == dtype
                              and t.device == device) for t in inputs)


def _reduce(inputs: Sequence[torch.Tensor], name: str, order: str) -> torch.Tensor:
    """:func:`reduce` of two or more tensors by the canonical reduction ``name`` (no PREMUL_SUM)."""
    first = inputs[0]
    if name in _RING_REDUCTIONS and first.numel() and (first.is_floating_point() or first.is_complex()):
        return _ring_reduce(inputs, name, order)
    if name in BITWISE_OPS:     # BAND, BOR, BXOR: integers and bools, exact in any order
        return reduce_in_any_order(inputs, name)
    # integers and bools (exact in any order), MAX and MIN (exact), and empty tensors
    large = first.numel() >= _ACCUMULATE_FROM
    if large and not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return _reduce_accumulate(inputs, name)
    stacked = torch.stack(list(inputs))  # (world, *shape)
    if name == "sum":
        out = stacked.sum(0)
    elif name == "avg":
        return stacked.mean(0)
    elif name == "max":
        return stacked.amax(0)
    elif name == "min":
        return stacked.amin(0)
    else:
        out = stacked.prod(0)
    # integer and bool sums and products promote to int64: back to the input dtype, wrapping
    # as a fixed-width integer does (bool: nonzero count -> or, nonzero product -> and)
    return out if out.dtype == stacked.dtype else out.to(stacked.dtype)


def _combiners(name: str) -> tuple:
    """``(combine, combine_in_place)`` of a SUM, AVG (summed, then divided) or PRODUCT."""
    return (torch.mul, torch.Tensor.mul_) if name == "product" else (torch.add, torch.Tensor.add_)


def _reduce_accumulate(inputs: Sequence[torch.Tensor], name: str) -> torch.Tensor:
    """Fold the inputs into one new tensor in place, in rank order (integers, bools, MAX, MIN:
    exact in any order): every input is read once and no ``(world, ...)`` stack is allocated
    (for large tensors the stack's copy costs more than the reduction). Not differentiable."""
    if name in ("max", "min"):
        combine = torch.maximum if name == "max" else torch.minimum
        out = combine(inputs[0], inputs[1])
        for tensor in inputs[2:]:
            combine(out, tensor, out=out)
        return out
    combine, combine_ = _combiners(name)
    out = combine(inputs[0], inputs[1])
    for tensor in inputs[2:]:
        combine_(out, tensor)
    return out


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _ring_chunk(numel: int, element_size: int, world_size: int, order: str) -> int:
    """Elements in each rank's chunk of a flat buffer of ``numel`` elements of ``element_size``
    bytes (``numel > 0``, ``world_size > 1``), as gloo's ring ``order`` cuts it (``"all_reduce"``
    or ``"reduce"``).

    Both cut the buffer into segments, a multiple of ``world_size`` of them and at least two per
    rank, and give rank ``c`` the ``c``-th run of ``segments / world_size``; the last chunks are
    short or empty. They size a segment differently once the buffer is over ``2 * world_size``
    MiB: the all-reduce (gloo/allreduce.cc) first counts the segments, as many as segments of at
    most 1 MiB need, then shares the elements out, ``ceil(numel / segments)`` to each; the
    reduce (gloo/reduce.cc) first sizes a segment, ``min(ceil(numel / (2 * world_size)), 1 MiB)``,
    then counts the segments it takes.
    """
    cap = max(1, _GLOO_SEGMENT_BYTES // element_size)          # elements in a 1 MiB segment
    if order == "all_reduce":
        segments = max(_ceil_div(numel, cap), 2 * world_size)
        segments = _ceil_div(segments, world_size) * world_size
        segment = _ceil_div(numel, segments)
    else:
        segment = min(_ceil_div(numel, 2 * world_size), cap)
        segments = max(_ceil_div(numel, segment), 2 * world_size)
        segments = _ceil_div(segments, world_size) * world_size
    return segments // world_size * segment


def _ring_reduce(inputs: Sequence[torch.Tensor], name: str, order: str) -> torch.Tensor:
    """SUM, AVG or PRODUCT of floating-point or complex tensors, every element combined in the
    order of gloo's ring ``order``, so that every rounding is gloo's.

    The ring cuts the flat buffer (for SUM and AVG of a complex tensor, its real view, which is
    what torch.distributed hands gloo) into one chunk per rank (``_ring_chunk``). Chunk ``c``
    leaves rank ``c - 1``, travels down the ring, each rank adding its own part to what it
    received, and is complete on rank ``c``: ``((x[c-1] + x[c-2]) + x[c-3]) + ... + x[c]``
    (ranks mod the world size). AVG is that sum divided by the world size, as gloo computes it.
    Two ranks need no order: ``x0 + x1`` is ``x1 + x0``.
    A new contiguous tensor of the inputs' shape; differentiable.
    """
    world, first = len(inputs), inputs[0]
    as_real = first.is_complex() and name != "product"
    flat = (lambda t: torch.view_as_real(t).reshape(-1)) if as_real else (lambda t: t.reshape(-1))
    numel, element_size = first.numel() * (1 + as_real), first.element_size() // (1 + as_real)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    chunk = _ring_chunk(numel, element_size, world, order) if world > 2 else numel
    if world == 2:
        out = flat(first) * flat(inputs[1]) if name == "product" else flat(first) + flat(inputs[1])
    elif chunk >= _LONG_CHUNK or world * numel > _STACK_AT_MOST:
        check_same("reduce", inputs)            # views of unlike tensors would not fail as a stack does
        out = _fold_by_chunk([flat(t) for t in inputs], name, chunk, grad)
    else:
        stacked = torch.stack(list(inputs))                                  # (world, *shape)
        out = _fold_stacked(torch.view_as_real(stacked) if as_real else stacked, name, chunk, grad)
    if as_real:
        out = torch.view_as_complex(out.view(*first.shape, 2))      # (*shape, 2) -> (*shape) complex
    out = out.view(first.shape)
    return out / world if name == "avg" else out


def _fold_by_chunk(flats: Sequence[torch.Tensor], name: str, chunk: int, grad: bool) -> torch.Tensor:
    """The ring's folds one chunk at a time, on views of the flat inputs: no ``(world, numel)``
    stack; without a gradient, in place in the output. ``world * (world - 1)`` operations at most,
    each on ``chunk`` elements."""
    world, numel = len(flats), flats[0].numel()
    combine, combine_ = _combiners(name)
    out = None if grad else torch.empty_like(flats[0], memory_format=torch.contiguous_format)
    pieces = []
    for start in range(0, numel, chunk):
        owner, length = start // chunk, min(chunk, numel - start)     # chunk ``owner`` ends on rank owner
        parts = [flats[(owner - 1 - step) % world].narrow(0, start, length) for step in range(world)]
        if grad:
            piece = combine(parts[0], parts[1])
            for part in parts[2:]:
                piece = combine(piece, part)
            pieces.append(piece)
        else:
            piece = out.narrow(0, start, length)
            combine(parts[0], parts[1], out=piece)
            for part in parts[2:]:
                combine_(piece, part)
    if not grad:
        return out
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _fold_stacked(stacked: torch.Tensor, name: str, chunk: int, grad: bool) -> torch.Tensor:
    """The ring's folds of short chunks, from the ranks' inputs stacked ``(world, ...)``
    (contiguous): every chunk's parts put in ring order by one index, then ``world - 1``
    operations, each on every chunk at once. Returns the flat result, ``numel`` long."""
    world = stacked.shape[0]
    numel = stacked.numel() // world
    chunks = _ceil_div(numel, chunk)                        # the chunks that hold elements
    if chunks * chunk > numel:                              # the last chunk short: padded, the pad dropped after
        stacked = torch.nn.functional.pad(stacked.view(world, numel), (0, chunks * chunk - numel))
    stacked = stacked.view(world * chunks, chunk)           # (rank * chunk, element)
    ordered = stacked.index_select(0, _ring_order(world, chunks, stacked.device))
    steps = ordered.view(world, chunks * chunk)             # (step, chunk * element): row k, step k's parts
    combine, combine_ = _combiners(name)
    out = combine(steps[0], steps[1])                       # (chunks * chunk,)
    for step in range(2, world):
        out = combine(out, steps[step]) if grad else combine_(out, steps[step])
    return out[:numel].clone() if chunks * chunk > numel else out    # its own storage, numel long


#: (world, chunks, device) -> the index of :func:`_fold_stacked`
_RING_ORDERS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _ring_order(world: int, chunks: int, device: torch.device) -> torch.Tensor:
    """The rows of a ``(rank * chunk, element)`` stack in ring order, ``(step, chunk)`` flat:
    the ``k``-th part added to chunk ``c`` is rank ``(c - 1 - k) mod world``'s."""
    known = _RING_ORDERS.get((world, chunks, device))
    if known is None:
        columns = torch.arange(chunks, device=device)
        ranks = (columns - 1 - torch.arange(world, device=device)[:, None]) % world   # (step, chunk)
        known = _RING_ORDERS[(world, chunks, device)] = (ranks * chunks + columns).reshape(-1)
    return known
