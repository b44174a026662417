"""FSDP (ZeRO-3) for the small Llama's tensor-parallel shards, written with the communicator.

Each rank of a *shard group* (the data-parallel ranks that FSDP shards over)
keeps one flat piece of every parameter it would otherwise hold whole: the
parameter (already a tensor-parallel shard) is flattened, padded with zeros to
a multiple of the group size, and cut into equal pieces (:func:`piece`); Adam
then runs on the pieces, so the optimizer state is sharded too.

:func:`unshard` rebuilds the parameters for one forward: an ``all_gather`` of
the pieces (dim 0), the padding cut off, the shape restored. The
communicator's ``all_gather`` is differentiable and its backward is the
reduce-scatter (sum) of the gradients: exactly FSDP's gradient reduce-scatter,
so each piece's ``.grad`` arrives summed over the shard group. The padding's
gradient is zero, so Adam leaves it zero.

As FSDP2 does, the pieces of a stage's parameters are concatenated and
gathered with one all-gather (the piece of parameter ``i`` is column block
``i`` of the ``(shards, sum of piece sizes)`` result), so a step sends one
gather per stage and micro-batch, not one per parameter;
:func:`all_reduce_bucket` is the same bucketing for gradient all-reduces.

Call chain: ``unshard -> torch.cat -> Communicator.all_gather`` (backward:
``reduce_scatter``, then the split into the pieces); :func:`gather_piece` is
the gather of one tensor without autograd, for checkpoints.

This is the mechanism of ``torch.distributed.fsdp.fully_shard`` (FSDP2:
``Shard(0)`` pieces, all-gather before forward, reduce-scatter after
backward) without its module hooks, so it composes with the hand-written
tensor, context and pipeline parallelism of :mod:`simcomm.models.llama`.
"""
from __future__ import annotations

import torch

from ..communicator import Communicator
from .zero import padded

__all__ = ["piece_numel", "piece", "unshard", "all_reduce_bucket", "gather_piece"]


def piece_numel(numel: int, shards: int) -> int:
    """Elements per piece when ``numel`` elements are split over ``shards`` ranks (padded up)."""
    if shards < 1:
        raise ValueError(f"llama_fsdp.piece_numel: shards={shards} must be >= 1")
    return padded(numel, shards) // shards


def piece(tensor: torch.Tensor, rank: int, shards: int) -> torch.Tensor:
    """Piece ``rank`` of ``shards`` of ``tensor`` flattened and zero-padded (a copy, ``(piece_numel,)``)."""
    if not 0 <= rank < shards:
        raise ValueError(f"llama_fsdp.piece: rank={rank} is not in [0, {shards})")
    per = piece_numel(tensor.numel(), shards)
    flat = torch.nn.functional.pad(tensor.detach().flatten(), (0, padded(tensor.numel(), shards) - tensor.numel()))
    return flat[rank * per:(rank + 1) * per].clone()                                   # (padded / shards,)


def unshard(group: Communicator, pieces: dict[str, torch.Tensor],
            shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The whole parameters ``{name: (shape)}`` from this rank's ``pieces``, with **one**
    differentiable all-gather over ``group`` of all the pieces concatenated (as FSDP2 gathers a
    module's parameters); backward: one reduce-scatter of the gradients, summed over the group,
    split back into the pieces' ``.grad``. Collective over ``group``; blocks. The pieces are not
    modified."""
    names = list(pieces)
    if group.world_size == 1:
        return {name: pieces[name].view(shapes[name]) for name in names}
    sizes = [pieces[name].numel() for name in names]
    gathered = group.all_gather(torch.cat([pieces[name] for name in names]), dim=0)    # (shards * sum(sizes),)
    columns = gathered.view(group.world_size, -1).split(sizes, dim=1)                  # each (shards, piece)
    return {name: column.reshape(-1)[:shapes[name].numel()].view(shapes[name])        # padding cut off
            for name, column in zip(names, columns)}


def all_reduce_bucket(group: Communicator, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``group.all_reduce`` (sum) of each of ``tensors`` with **one** all-reduce of them flattened and
    concatenated (DDP's gradient bucket); new tensors, in the same order and shapes. Collective over
    ``group``; blocks."""
    if group.world_size == 1 or not tensors:
        return list(tensors)
    summed = group.all_reduce(torch.cat([t.reshape(-1) for t in tensors]))
    return [part.view(t.shape) for part, t in zip(summed.split([t.numel() for t in tensors]), tensors)]


def gather_piece(group: Communicator, flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The whole tensor ``shape`` from every rank's piece ``flat``, without autograd. Collective over ``group``."""
    with torch.no_grad():
        flat = flat.detach().flatten()
        gathered = group.all_gather(flat, dim=0) if group.world_size > 1 else flat
        return gathered[:shape.numel()].view(shape).clone()
