"""One translation function per c10d operation: c10d's buffers in, transport calls, buffers out.

Every function takes the rank's :class:`~simcomm.transport.Transport` for the
group (the simulator's, or a real worker's), c10d's arguments as the
ProcessGroup received them (``src``/``dst``/``rootRank`` are group-local ranks) and ``async_op``. It *issues* the
transport primitives of the op (with ``async_op=True`` each returns a
:class:`~simcomm.handles.Handle` at once; without, each blocks until this
rank's part is done) and returns an :class:`Issued`: those calls, and the
function that writes their results into c10d's output buffers in place,
outside autograd, as a native backend does. The caller runs ``finish`` at
once for a blocking call, or in the Work's ``wait()`` for an asynchronous
one, so an output buffer changes only when the program waits, as on real
backends. Every primitive traces the call and checks it against the other
ranks when it is issued.

Inputs are detached (c10d collectives are not differentiable:
``torch.distributed.nn.functional`` and the functional collectives put their
own autograd rules around them) and never modified; an asynchronous
primitive copies its input when issued. ``finish`` returns the list of
output tensors that c10d's Work future holds.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed import ReduceOp

from .. import memory
from ..checks import BITWISE_OPS, check_avg_dtype, check_bitwise_dtype, check_premul_factor, reduce_op_and_factor
from ..buffers import set_versions, write_into
from ..transport import Transport


__all__ = ["Issued", "all_reduce", "all_gather_list", "all_gather_into_tensor", "reduce_scatter_list",
           "reduce_scatter_tensor", "all_to_all_single", "all_to_all_list", "broadcast", "reduce",
           "gather", "scatter", "barrier", "send", "recv"]


class Issued(NamedTuple):
    """What a translation issued: one entry per transport call (its result when blocking,
    its handle with ``async_op``), and ``finish(results)``, which writes the calls' results
    into c10d's buffers and returns the output tensors."""

    calls: list[Any]
    finish: Callable[[list[Any]], list[torch.Tensor]]


#: the reductions with no factor, most common first: ``opts.reduceOp == member`` is the
#: cheapest test torch offers (a ``RedOpType`` is slow to hash)
_PLAIN_REDUCTIONS = tuple((getattr(ReduceOp, name.upper()), name) for name in ("sum", "avg", "max", "min", "product"))


def _reduction(c10d_op: str, opts, transport: Transport, tensors: Sequence[torch.Tensor]
               ) -> tuple[str, float | torch.Tensor | None]:
    """The canonical reduction name of ``opts.reduceOp`` (:func:`simcomm.checks.reduce_op_and_factor`)
    and the transport's ``factor`` for it: ``f`` for ``PREMUL_SUM(f)`` (the factor
    ``torch.distributed._make_nccl_premul_sum`` stored, read from ``opts.reduceOp.factor``),
    None otherwise. RuntimeError for a bitwise op (BAND, BOR, BXOR) of floating-point tensors,
    as gloo refuses it; ValueError for a PREMUL_SUM of integers or with a bad factor, as NCCL refuses them."""
    red = opts.reduceOp
    for member, name in _PLAIN_REDUCTIONS:
        if red == member:
            return name, None
    try:
        name, factor = reduce_op_and_factor(c10d_op, red, transport.rank)
    except ValueError:
        if getattr(red, "op", red) == ReduceOp.PREMUL_SUM:
            raise
        raise NotImplementedError(
            f"{c10d_op} with reduce op {getattr(red, 'op', red)} is not supported by the 'simcomm' backend; "
            f"use SUM, AVG, MAX, MIN, PRODUCT, BAND, BOR, BXOR or PREMUL_SUM") from None
    if factor is None:
        if name in BITWISE_OPS:
            for tensor in tensors:
                check_bitwise_dtype(c10d_op, tensor, name, transport.rank)
        return name, None
    for tensor in tensors:
        check_avg_dtype(c10d_op, tensor, name, transport.rank)
        check_premul_factor(c10d_op, factor, transport.rank, tensor)
    return name, factor


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached and contiguous, in its own shape: what the ops that reduce or copy a
    tensor whole (all_reduce, broadcast, reduce) hand the transport, so the trace and a mismatch
    report name the shape the program passed (``()`` for a 0-d loss, as gloo takes it)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    return tensor.contiguous()


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as :func:`_own` gives it, with at least one dim (a 0-d tensor becomes ``(1,)``):
    for the ops that concatenate or split along dim 0 (gathers, scatters, all_to_all) and for
    point-to-point messages, which the simulator matches by shape."""
    tensor = _own(tensor)
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def _write(c10d_op: str, argument: str, out: torch.Tensor, value: torch.Tensor, rank: int,
           bumps: int = 0) -> None:
    """Copy ``value`` into c10d's output buffer ``out`` (same number of elements).

    The write is invisible to autograd, as a native backend's is: it goes through a
    detached alias and leaves ``out``'s version counter where it was, then moves it
    ``bumps`` times, as gloo's does for that op (measured: 0 for a buffer the backend
    fills itself, e.g. all_reduce, broadcast, reduce, scatter, all_to_all_single, recv;
    1 per tensor that gloo copies into with an aten op, e.g. the lists of all_gather,
    gather and all_to_all, reduce_scatter_tensor's output; 2 for all_gather_into_tensor).
    So a view or a saved tensor of the buffer taken before the call behaves as on gloo.
    ``value`` may be ``out`` itself: the transport wrote it already (its ``into``); only the
    version counter moves then.
    """
    if value is not out:
        if out.numel() != value.numel():
            raise ValueError(
                f"{c10d_op}: rank {rank}'s {argument} has {out.numel()} elements {tuple(out.shape)} "
                f"but the result has {value.numel()} {tuple(value.shape)}")
        write_into(out, value)
    if bumps:                       # as ``bumps`` calls of torch.autograd.graph.increment_version
        set_versions((out,), (out._version + bumps,))


def _check_numel(c10d_op: str, argument: str, tensor: torch.Tensor, expected: int, rank: int,
                 why: str) -> None:
    if tensor.numel() != expected:
        raise ValueError(f"{c10d_op}: rank {rank}'s {argument} has {tensor.numel()} elements "
                         f"{tuple(tensor.shape)}; it must have {expected} ({why})")


def _one_per_rank(c10d_op: str, argument: str, tensors: Sequence, transport: Transport) -> None:
    if len(tensors) != transport.world_size:
        raise ValueError(f"{c10d_op}: rank {transport.rank}'s {argument} has {len(tensors)} "
                         f"tensors; it must have one per rank ({transport.world_size})")


# -- reductions and gathers ------------------------------------------------------------------

def all_reduce(transport: Transport, tensors: list[torch.Tensor], opts, async_op: bool) -> Issued:
    """``dist.all_reduce`` (and its coalesced form): each tensor reduced in place."""
    name, factor = _reduction("all_reduce", opts, transport, tensors)
    calls = [transport.all_reduce(_own(tensor), name, async_op=async_op, factor=factor, into=tensor)
             for tensor in tensors]

    def finish(results: list) -> list[torch.Tensor]:
        for tensor, value in zip(tensors, results, strict=True):
            _write("all_reduce", "tensor", tensor, value, transport.rank)
        return list(tensors)

    return Issued(calls, finish)


def all_gather_into_tensor(transport: Transport, outputs: Sequence[torch.Tensor],
                           inputs: Sequence[torch.Tensor], async_op: bool) -> Issued:
    """``dist.all_gather_into_tensor``: ``output`` holds the ranks' inputs back to back."""
    for output, input_ in zip(outputs, inputs, strict=True):
        _check_numel("all_gather_into_tensor", "output_tensor", output,
                     input_.numel() * transport.world_size, transport.rank, "world size x input")
    # each result: (world * d0, ...), written into output
    calls = [transport.all_gather(_rows(input_), 0, async_op=async_op, into=output)
             for output, input_ in zip(outputs, inputs)]

    def finish(results: list) -> list[torch.Tensor]:
        for output, gathered in zip(outputs, results, strict=True):
            _write("all_gather_into_tensor", "output_tensor", output, gathered, transport.rank, bumps=2)
        return list(outputs)

    return Issued(calls, finish)


def all_gather_list(transport: Transport, output_lists: Sequence[Sequence[torch.Tensor]],
                    inputs: Sequence[torch.Tensor], async_op: bool) -> Issued:
    """``dist.all_gather``: ``output_list[r]`` gets rank ``r``'s tensor."""
    for outputs in output_lists:
        _one_per_rank("all_gather", "tensor_list", outputs, transport)
    calls = [transport.all_gather(_rows(input_), 0, async_op=async_op) for input_ in inputs]

    def finish(results: list) -> list[torch.Tensor]:
        written = []
        for outputs, gathered in zip(output_lists, results, strict=True):
            per_rank = gathered.reshape(transport.world_size, -1)  # (world, numel)
            for rank, output in enumerate(outputs):
                _write("all_gather", f"tensor_list[{rank}]", output, per_rank[rank], transport.rank, bumps=1)
            written.extend(outputs)
        return written

    return Issued(calls, finish)


def reduce_scatter_tensor(transport: Transport, outputs: Sequence[torch.Tensor],
                          inputs: Sequence[torch.Tensor], opts, async_op: bool) -> Issued:
    """``dist.reduce_scatter_tensor``: rank ``r`` gets block ``r`` of the reduced input."""
    name, factor = _reduction("reduce_scatter_tensor", opts, transport, inputs)
    calls = []
    for output, input_ in zip(outputs, inputs, strict=True):
        _check_numel("reduce_scatter_tensor", "input", input_, output.numel() * transport.world_size,
                     transport.rank, "world size x output")
        rows = _rows(input_)
        if rows.shape[0] % transport.world_size:
            rows = rows.reshape(-1)  # blocks of a flat buffer: (world * numel(output),)
        calls.append(transport.reduce_scatter(rows, 0, name, async_op=async_op, factor=factor, into=output))

    def finish(results: list) -> list[torch.Tensor]:
        for output, value in zip(outputs, results, strict=True):
            _write("reduce_scatter_tensor", "output", output, value, transport.rank, bumps=1)
        return list(outputs)

    return Issued(calls, finish)


def reduce_scatter_list(transport: Transport, outputs: Sequence[torch.Tensor],
                        input_lists: Sequence[Sequence[torch.Tensor]], opts, async_op: bool) -> Issued:
    """``dist.reduce_scatter``: rank ``r`` gets the reduction of every rank's ``input_list[r]``,
    each entry reduced by itself (gloo all-reduces each one: the order of its sums)."""
    name, factor = _reduction("reduce_scatter", opts, transport, [t for inputs in input_lists for t in inputs])
    calls = []
    for inputs in input_lists:
        _one_per_rank("reduce_scatter", "input_list", inputs, transport)
        stacked = torch.stack([_rows(t) for t in inputs])  # (world, *shape)
        calls.append(transport.reduce_scatter(stacked, 0, name, async_op=async_op, factor=factor, separately=True))

    def finish(results: list) -> list[torch.Tensor]:
        for output, value in zip(outputs, results, strict=True):
            _write("reduce_scatter", "output", output, value, transport.rank, bumps=1)
        return list(outputs)

    return Issued(calls, finish)


def broadcast(transport: Transport, tensors: list[torch.Tensor], root: int, async_op: bool) -> Issued:
    """``dist.broadcast``: every rank's tensor becomes the root's, in place."""
    # the root's tensor is not written: a blocking call sends it as it is (the copy into it writes
    # the values it holds); an async one would write there at the wait what it held at the issue
    into = transport.rank != root or not async_op
    calls = [transport.broadcast(_own(tensor), root, async_op=async_op, into=tensor if into else None)
             for tensor in tensors]

    def finish(results: list) -> list[torch.Tensor]:
        if transport.rank != root:
            for tensor, value in zip(tensors, results, strict=True):
                _write("broadcast", "tensor", tensor, value, transport.rank)
        return list(tensors)

    return Issued(calls, finish)


def reduce(transport: Transport, tensors: list[torch.Tensor], opts, async_op: bool) -> Issued:
    """``dist.reduce``: the root's tensor becomes the reduction; the others' stay as they are
    (traced as ``reduce``: every other rank sends its bytes to the root)."""
    (name, factor), root = _reduction("reduce", opts, transport, tensors), opts.rootRank
    calls = [transport.reduce(_own(tensor), root, name, async_op=async_op, factor=factor) for tensor in tensors]

    def finish(results: list) -> list[torch.Tensor]:
        if transport.rank == root:
            for tensor, value in zip(tensors, results, strict=True):
                _write("reduce", "tensor", tensor, value, transport.rank)
        return list(tensors)

    return Issued(calls, finish)


def gather(transport: Transport, output_lists: Sequence[Sequence[torch.Tensor]],
           inputs: Sequence[torch.Tensor], root: int, async_op: bool) -> Issued:
    """``dist.gather``: the root's ``gather_list[r]`` gets rank ``r``'s tensor."""
    if transport.rank == root:
        for outputs in output_lists:
            _one_per_rank("gather", "gather_list", outputs, transport)
    calls = [transport.gather(_rows(input_), root, 0, async_op=async_op) for input_ in inputs]

    def finish(results: list) -> list[torch.Tensor]:
        if transport.rank != root:
            return []
        written = []
        for outputs, gathered in zip(output_lists, results, strict=True):
            per_rank = gathered.reshape(transport.world_size, -1)  # (world, numel)
            for rank, output in enumerate(outputs):
                _write("gather", f"gather_list[{rank}]", output, per_rank[rank], transport.rank, bumps=1)
            written.extend(outputs)
        return written

    return Issued(calls, finish)


def scatter(transport: Transport, outputs: Sequence[torch.Tensor],
            input_lists: Sequence[Sequence[torch.Tensor]], root: int, async_op: bool) -> Issued:
    """``dist.scatter``: rank ``r``'s tensor becomes the root's ``scatter_list[r]`` (traced
    as ``scatter``: the root sends each other rank its one piece)."""
    calls = []
    for index in range(len(outputs)):
        stacked = None
        if transport.rank == root:
            pieces = input_lists[index]
            _one_per_rank("scatter", "scatter_list", pieces, transport)
            stacked = torch.stack([_rows(t) for t in pieces])  # (world, *shape)
        calls.append(transport.scatter(stacked, root, 0, async_op=async_op))

    def finish(results: list) -> list[torch.Tensor]:
        for output, (chunk, _) in zip(outputs, results, strict=True):
            _write("scatter", "tensor", output, chunk, transport.rank)   # chunk: (1, *shape)
        return list(outputs)

    return Issued(calls, finish)


# -- all-to-all ---------------------------------------------------------------------------

def _even_splits(c10d_op: str, argument: str, size: int, world_size: int, rank: int) -> list[int]:
    if size % world_size:
        raise ValueError(f"{c10d_op}: rank {rank}'s {argument} has {size} rows, not divisible by "
                         f"the world size {world_size}; pass split sizes")
    return [size // world_size] * world_size


def all_to_all_single(transport: Transport, output: torch.Tensor, input_: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      async_op: bool) -> Issued:
    """``dist.all_to_all_single``: rows ``input_split_sizes[j]`` of the input go to rank ``j``;
    the output holds what rank ``i`` sent, in rank order (dim 0, torch's semantics). Empty
    split lists mean equal splits. Traced as ``all_to_all_single`` with both split lists."""
    world, rank = transport.world_size, transport.rank
    inp = _rows(input_)
    row_numel = math.prod(inp.shape[1:])  # elements of one dim-0 row
    if row_numel == 0:
        out_rows = output.shape[0] if output.dim() else 0
    elif output.numel() % row_numel:
        raise ValueError(f"all_to_all_single: rank {rank}'s output has {output.numel()} elements "
                         f"{tuple(output.shape)}, not a whole number of the input's rows of "
                         f"{row_numel} elements {tuple(inp.shape[1:])}")
    else:
        out_rows = output.numel() // row_numel
    input_split_sizes = list(input_split_sizes) or _even_splits(
        "all_to_all_single", "input", inp.shape[0], world, rank)
    output_split_sizes = list(output_split_sizes) or _even_splits(
        "all_to_all_single", "output", out_rows, world, rank)
    for argument, splits, size in (("input_split_sizes", input_split_sizes, inp.shape[0]),
                                   ("output_split_sizes", output_split_sizes, out_rows)):
        if len(splits) != world or sum(splits) != size or min(splits) < 0:
            raise ValueError(f"all_to_all_single: rank {rank}'s {argument}={list(splits)} must be "
                             f"{world} non-negative sizes summing to {size}")
    calls = [transport.all_to_all_single(inp, output_split_sizes, input_split_sizes, async_op=async_op)]

    def finish(results: list) -> list[torch.Tensor]:
        _write("all_to_all_single", "output", output, results[0], rank)
        return [output]

    return Issued(calls, finish)


def all_to_all_list(transport: Transport, outputs: Sequence[torch.Tensor],
                    inputs: Sequence[torch.Tensor], async_op: bool) -> Issued:
    """``dist.all_to_all``: ``inputs[j]`` goes to rank ``j``; ``outputs[i]`` comes from rank ``i``
    (one flat ``all_to_all_single`` of the concatenated inputs)."""
    world = transport.world_size
    if len(inputs) != world or len(outputs) != world:
        raise ValueError(f"all_to_all: rank {transport.rank} passed {len(outputs)} outputs and "
                         f"{len(inputs)} inputs; it must pass {world} of each")
    dtype = inputs[0].dtype
    flat_in = torch.cat([t.detach().reshape(-1).to(dtype) for t in inputs])  # (sum of numels,)
    out_sizes = [t.numel() for t in outputs]
    flat_out = torch.empty(sum(out_sizes), dtype=dtype, device=flat_in.device)
    single = all_to_all_single(transport, flat_out, flat_in, out_sizes, [t.numel() for t in inputs],
                               async_op)

    def finish(results: list) -> list[torch.Tensor]:
        single.finish(results)
        for output, piece in zip(outputs, flat_out.split(out_sizes), strict=True):
            _write("all_to_all", "output_tensor_list", output, piece, transport.rank, bumps=1)
        return list(outputs)

    return Issued(single.calls, finish)


# -- control and point to point ---------------------------------------------------------------

def barrier(transport: Transport, async_op: bool) -> Issued:
    """``dist.barrier``: complete once every rank of the group has called it."""
    return Issued([transport.barrier(async_op=async_op)], lambda results: [])


def _no_tag(c10d_op: str, tag: int) -> None:
    if tag:
        raise NotImplementedError(f"{c10d_op} with tag={tag} is not supported by the 'simcomm' "
                                  f"backend: messages between two ranks match in order")


def send(transport: Transport, tensors: list[torch.Tensor], dst: int, tag: int,
         async_op: bool) -> Issued:
    """``dist.send``/``isend``: complete once rank ``dst`` has received the data (an
    ``isend`` copies the tensor when issued). The copy counts on no rank (:mod:`simcomm.memory`):
    torch's ``isend`` sends the program's tensor itself, which its ``Work`` holds until the wait."""
    _no_tag("send", tag)
    with memory.untracked():
        calls = [transport.send(_rows(tensor), dst, async_op=async_op) for tensor in tensors]
    return Issued(calls, lambda results: list(tensors))


def recv(transport: Transport, tensors: list[torch.Tensor], src: int, tag: int,
         async_op: bool) -> Issued:
    """``dist.recv``/``irecv``: fill the tensor with what rank ``src`` sends (same shape and
    dtype); an ``irecv``'s buffer is written when its Work is waited on."""
    _no_tag("recv", tag)
    calls = [transport.recv(_rows(tensor).shape, tensor.dtype, src, async_op=async_op) for tensor in tensors]

    def finish(results: list) -> list[torch.Tensor]:
        for tensor, value in zip(tensors, results, strict=True):
            _write("recv", "tensor", tensor, value, transport.rank)
        return list(tensors)

    return Issued(calls, finish)
