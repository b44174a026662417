"""One translation function per c10d operation: c10d's buffers in, simulator calls, buffers out.

Every function takes the rank's :class:`~simcomm.sim.SimTransport` for the
group and c10d's arguments as the ProcessGroup received them (``src``/``dst``/
``rootRank`` are group-local ranks), calls transport primitives (which block
until this rank's part is done, trace the call and check it against the
other ranks), and writes the results into c10d's output buffers in place,
outside autograd, as a native backend does. Inputs are detached: c10d
collectives are not differentiable (``torch.distributed.nn.functional`` and
the functional collectives put their own autograd rules around them).
Each returns the list of output tensors that c10d's Work future holds.

Where the simulator has no primitive of its own yet, the op is built
exactly from existing ones (the trace then shows those primitives); each
such place says which primitive to switch to.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed import ReduceOp

from ..sim import SimTransport

__all__ = ["all_reduce", "all_gather_list", "all_gather_into_tensor", "reduce_scatter_list",
           "reduce_scatter_tensor", "all_to_all_single", "all_to_all_list", "broadcast", "reduce",
           "gather", "scatter", "barrier", "send", "recv"]


_REDUCE_NAMES = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MAX: "max", ReduceOp.MIN: "min",
                 ReduceOp.PRODUCT: "product"}


def _op_name(c10d_op: str, opts) -> str:
    """The canonical reduction name of ``opts.reduceOp``; NotImplementedError for the
    ones the simulator's math has no rule for (bitwise ops, PREMUL_SUM)."""
    red = opts.reduceOp.op
    name = _REDUCE_NAMES.get(red)
    if name is None:
        raise NotImplementedError(
            f"{c10d_op} with reduce op {red} is not supported by the 'simcomm' backend; "
            f"use SUM, AVG, MAX, MIN or PRODUCT")
    return name


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` detached and contiguous, with at least one dim (a 0-d tensor becomes ``(1,)``)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    tensor = tensor.contiguous()
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def _write(c10d_op: str, argument: str, out: torch.Tensor, value: torch.Tensor, rank: int) -> None:
    """Copy ``value`` into c10d's output buffer ``out`` (same number of elements)."""
    if out.numel() != value.numel():
        raise ValueError(
            f"{c10d_op}: rank {rank}'s {argument} has {out.numel()} elements {tuple(out.shape)} "
            f"but the result has {value.numel()} {tuple(value.shape)}")
    # through a detached alias the write is invisible to autograd, as a native backend's is
    (out.detach() if out.requires_grad else out).copy_(
        value if value.shape == out.shape else value.reshape(out.shape))


def _check_numel(c10d_op: str, argument: str, tensor: torch.Tensor, expected: int, rank: int,
                 why: str) -> None:
    if tensor.numel() != expected:
        raise ValueError(f"{c10d_op}: rank {rank}'s {argument} has {tensor.numel()} elements "
                         f"{tuple(tensor.shape)}; it must have {expected} ({why})")


# -- reductions and gathers ------------------------------------------------------------------

def all_reduce(transport: SimTransport, tensors: list[torch.Tensor], opts) -> list[torch.Tensor]:
    """``dist.all_reduce`` (and its coalesced form): each tensor reduced in place."""
    name = _op_name("all_reduce", opts)
    for tensor in tensors:
        _write("all_reduce", "tensor", tensor, transport.all_reduce(_rows(tensor), name), transport.rank)
    return list(tensors)


def all_gather_into_tensor(transport: SimTransport, outputs: Sequence[torch.Tensor],
                           inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``dist.all_gather_into_tensor``: ``output`` holds the ranks' inputs back to back."""
    for output, input_ in zip(outputs, inputs, strict=True):
        _check_numel("all_gather_into_tensor", "output_tensor", output,
                     input_.numel() * transport.world_size, transport.rank, "world size x input")
        gathered = transport.all_gather(_rows(input_), 0)  # (world * d0, ...)
        _write("all_gather_into_tensor", "output_tensor", output, gathered, transport.rank)
    return list(outputs)


def all_gather_list(transport: SimTransport, output_lists: Sequence[Sequence[torch.Tensor]],
                    inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``dist.all_gather``: ``output_list[r]`` gets rank ``r``'s tensor."""
    written = []
    for outputs, input_ in zip(output_lists, inputs, strict=True):
        if len(outputs) != transport.world_size:
            raise ValueError(f"all_gather: rank {transport.rank}'s tensor_list has {len(outputs)} "
                             f"tensors; it must have one per rank ({transport.world_size})")
        gathered = transport.all_gather(_rows(input_), 0)
        per_rank = gathered.reshape(transport.world_size, -1)  # (world, numel)
        for rank, output in enumerate(outputs):
            _write("all_gather", f"tensor_list[{rank}]", output, per_rank[rank], transport.rank)
        written.extend(outputs)
    return written


def reduce_scatter_tensor(transport: SimTransport, outputs: Sequence[torch.Tensor],
                          inputs: Sequence[torch.Tensor], opts) -> list[torch.Tensor]:
    """``dist.reduce_scatter_tensor``: rank ``r`` gets block ``r`` of the reduced input."""
    name = _op_name("reduce_scatter_tensor", opts)
    for output, input_ in zip(outputs, inputs, strict=True):
        _check_numel("reduce_scatter_tensor", "input", input_, output.numel() * transport.world_size,
                     transport.rank, "world size x output")
        rows = _rows(input_)
        if rows.shape[0] % transport.world_size:
            rows = rows.reshape(-1)  # blocks of a flat buffer: (world * numel(output),)
        _write("reduce_scatter_tensor", "output", output,
               transport.reduce_scatter(rows, 0, name), transport.rank)
    return list(outputs)


def reduce_scatter_list(transport: SimTransport, outputs: Sequence[torch.Tensor],
                        input_lists: Sequence[Sequence[torch.Tensor]], opts) -> list[torch.Tensor]:
    """``dist.reduce_scatter``: rank ``r`` gets the reduction of every rank's ``input_list[r]``."""
    name = _op_name("reduce_scatter", opts)
    for output, inputs in zip(outputs, input_lists, strict=True):
        if len(inputs) != transport.world_size:
            raise ValueError(f"reduce_scatter: rank {transport.rank}'s input_list has {len(inputs)} "
                             f"tensors; it must have one per rank ({transport.world_size})")
        stacked = torch.stack([_rows(t) for t in inputs])  # (world, *shape)
        _write("reduce_scatter", "output", output, transport.reduce_scatter(stacked, 0, name),
               transport.rank)
    return list(outputs)


def broadcast(transport: SimTransport, tensors: list[torch.Tensor], root: int) -> list[torch.Tensor]:
    """``dist.broadcast``: every rank's tensor becomes the root's, in place."""
    for tensor in tensors:
        out = transport.broadcast(_rows(tensor), root)
        if transport.rank != root:
            _write("broadcast", "tensor", tensor, out, transport.rank)
    return list(tensors)


def reduce(transport: SimTransport, tensors: list[torch.Tensor], opts) -> list[torch.Tensor]:
    """``dist.reduce``: the root's tensor becomes the reduction; the others' stay as they are."""
    name = _op_name("reduce", opts)
    for tensor in tensors:
        # switch to transport.reduce once it exists (traced as "reduce" with the root's bytes)
        out = transport.all_reduce(_rows(tensor), name)
        if transport.rank == opts.rootRank:
            _write("reduce", "tensor", tensor, out, transport.rank)
    return list(tensors)


def gather(transport: SimTransport, output_lists: Sequence[Sequence[torch.Tensor]],
           inputs: Sequence[torch.Tensor], root: int) -> list[torch.Tensor]:
    """``dist.gather``: the root's ``gather_list[r]`` gets rank ``r``'s tensor."""
    written = []
    for index, input_ in enumerate(inputs):
        gathered = transport.gather(_rows(input_), root, 0)
        if transport.rank == root:
            outputs = output_lists[index]
            if len(outputs) != transport.world_size:
                raise ValueError(f"gather: rank {transport.rank}'s gather_list has {len(outputs)} "
                                 f"tensors; it must have one per rank ({transport.world_size})")
            per_rank = gathered.reshape(transport.world_size, -1)  # (world, numel)
            for rank, output in enumerate(outputs):
                _write("gather", f"gather_list[{rank}]", output, per_rank[rank], transport.rank)
            written.extend(outputs)
    return written


def scatter(transport: SimTransport, outputs: Sequence[torch.Tensor],
            input_lists: Sequence[Sequence[torch.Tensor]], root: int) -> list[torch.Tensor]:
    """``dist.scatter``: rank ``r``'s tensor becomes the root's ``scatter_list[r]``."""
    for index, output in enumerate(outputs):
        if transport.rank == root:
            pieces = input_lists[index]
            if len(pieces) != transport.world_size:
                raise ValueError(f"scatter: rank {transport.rank}'s scatter_list has {len(pieces)} "
                                 f"tensors; it must have one per rank ({transport.world_size})")
            stacked = torch.stack([_rows(t) for t in pieces])  # (world, *shape)
        else:
            stacked = torch.zeros((transport.world_size, *_rows(output).shape), dtype=output.dtype,
                                  device=output.device)
        # switch to transport.scatter once it exists (traced as "scatter": one chunk per peer)
        everything = transport.broadcast(stacked, root)
        _write("scatter", "tensor", output, everything[transport.rank], transport.rank)
    return list(outputs)


# -- all-to-all ---------------------------------------------------------------------------

def _even_splits(c10d_op: str, argument: str, size: int, world_size: int, rank: int) -> list[int]:
    if size % world_size:
        raise ValueError(f"{c10d_op}: rank {rank}'s {argument} has {size} rows, not divisible by "
                         f"the world size {world_size}; pass split sizes")
    return [size // world_size] * world_size


def all_to_all_single(transport: SimTransport, output: torch.Tensor, input_: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int]) -> list[torch.Tensor]:
    """``dist.all_to_all_single``: rows ``input_split_sizes[j]`` of the input go to rank ``j``;
    the output holds what rank ``i`` sent, in rank order (dim 0, torch's semantics)."""
    world, rank = transport.world_size, transport.rank
    inp = _rows(input_)
    if not input_split_sizes and not output_split_sizes:
        _even_splits("all_to_all_single", "input", inp.shape[0], world, rank)
        _write("all_to_all_single", "output", output, transport.all_to_all(inp, 0, 0), rank)
        return [output]
    out_rows = output.reshape(-1, *inp.shape[1:]) if output.numel() else output
    input_split_sizes = input_split_sizes or _even_splits("all_to_all_single", "input", inp.shape[0],
                                                          world, rank)
    output_split_sizes = output_split_sizes or _even_splits("all_to_all_single", "output",
                                                            out_rows.shape[0], world, rank)
    for argument, splits, size in (("input_split_sizes", input_split_sizes, inp.shape[0]),
                                   ("output_split_sizes", output_split_sizes, out_rows.shape[0])):
        if len(splits) != world or sum(splits) != size or min(splits) < 0:
            raise ValueError(f"all_to_all_single: rank {rank}'s {argument}={list(splits)} must be "
                             f"{world} non-negative sizes summing to {size}")
    # switch to transport.all_to_all_single once it exists: until then the rows are padded
    # to the largest split of any rank (found with a small all_reduce) and sent evenly.
    longest = transport.all_reduce(torch.tensor([max(*input_split_sizes, *output_split_sizes)]), "max")
    pad = int(longest.item())
    if pad == 0:
        return [output]
    padded = inp.new_zeros((world * pad, *inp.shape[1:]))  # (world * pad, ...)
    for peer, piece in enumerate(inp.split(input_split_sizes, 0)):
        padded[peer * pad: peer * pad + piece.shape[0]] = piece
    received = transport.all_to_all(padded, 0, 0).split(pad, 0)  # world x (pad, ...)
    result = torch.cat([received[peer][:size] for peer, size in enumerate(output_split_sizes)])
    _write("all_to_all_single", "output", output, result, rank)
    return [output]


def all_to_all_list(transport: SimTransport, outputs: Sequence[torch.Tensor],
                    inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``dist.all_to_all``: ``inputs[j]`` goes to rank ``j``; ``outputs[i]`` comes from rank ``i``."""
    world = transport.world_size
    if len(inputs) != world or len(outputs) != world:
        raise ValueError(f"all_to_all: rank {transport.rank} passed {len(outputs)} outputs and "
                         f"{len(inputs)} inputs; it must pass {world} of each")
    dtype = inputs[0].dtype
    flat_in = torch.cat([t.detach().reshape(-1).to(dtype) for t in inputs])
    flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=dtype, device=flat_in.device)
    all_to_all_single(transport, flat_out, flat_in, [t.numel() for t in outputs],
                      [t.numel() for t in inputs])
    for output, piece in zip(outputs, flat_out.split([t.numel() for t in outputs]), strict=True):
        _write("all_to_all", "output_tensor_list", output, piece, transport.rank)
    return list(outputs)


# -- control and point to point ---------------------------------------------------------------

def barrier(transport: SimTransport) -> list[torch.Tensor]:
    """``dist.barrier``: returns once every rank of the group has called it."""
    transport.barrier()
    return []


def _no_tag(c10d_op: str, tag: int) -> None:
    if tag:
        raise NotImplementedError(f"{c10d_op} with tag={tag} is not supported by the 'simcomm' "
                                  f"backend: messages between two ranks match in order")


def send(transport: SimTransport, tensors: list[torch.Tensor], dst: int, tag: int) -> list[torch.Tensor]:
    """``dist.send``: blocks until rank ``dst`` has received the data."""
    _no_tag("send", tag)
    for tensor in tensors:
        transport.send(_rows(tensor), dst)
    return list(tensors)


def recv(transport: SimTransport, tensors: list[torch.Tensor], src: int, tag: int) -> list[torch.Tensor]:
    """``dist.recv``: fills the tensor with what rank ``src`` sends (same shape and dtype)."""
    _no_tag("recv", tag)
    for tensor in tensors:
        _write("recv", "tensor", tensor, transport.recv(_rows(tensor).shape, tensor.dtype, src),
               transport.rank)
    return list(tensors)
