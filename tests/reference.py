"""Single-device definitions of every collective, written independently of simcomm.

Each function takes the list of every rank's input (float64, possibly requiring
grad) and returns the list of every rank's output, using plain torch ops only,
so autograd through them on one device is the oracle for both the forward
values and the gradients of the distributed rules.
"""
from __future__ import annotations

import torch


def all_reduce(xs, op="sum"):
    stacked = torch.stack(xs)  # (world, *shape)
    out = {"sum": lambda: stacked.sum(0), "avg": lambda: stacked.mean(0),
           "max": lambda: stacked.amax(0), "min": lambda: stacked.amin(0),
           "product": lambda: stacked.prod(0)}[op]()
    return [out] * len(xs)


def all_gather(xs, dim=-1):
    return [torch.cat(xs, dim)] * len(xs)


def reduce_scatter(xs, dim=-1, op="sum"):
    full = all_reduce(xs, op)[0]
    return list(full.chunk(len(xs), dim))


def slice_(x, world_size, dim=-1):
    """``x`` is the one replicated tensor; rank r gets chunk r."""
    return list(x.chunk(world_size, dim))


def all_to_all_4d(xs, scatter_dim=2, gather_dim=1):
    """Sequence shards -> head shards (2, 1) or back (1, 2), through the full tensor."""
    if (scatter_dim, gather_dim) == (2, 1):
        full = torch.cat(xs, 1)                     # (b, s, h, d) from (b, s/P, h, d) shards
        return list(full.chunk(len(xs), 2))         # (b, s, h/P, d) head shards
    full = torch.cat(xs, 2)                         # (b, s, h, d) from (b, s, h/P, d) shards
    return list(full.chunk(len(xs), 1))             # (b, s/P, h, d) sequence shards


def broadcast(xs, src=0):
    return [xs[src]] * len(xs)


def gather(xs, dst=0, dim=-1):
    return [torch.cat(xs, dim) if r == dst else None for r in range(len(xs))]


def reduce(xs, dst=0, op="sum"):
    """``dst`` gets the reduction; the others get zeros (constants: no gradient flows from them)."""
    reduced = all_reduce(xs, op)[0]
    return [reduced if r == dst else torch.zeros_like(xs[r]).detach() for r in range(len(xs))]


def scatter(xs, src=0, dim=-1):
    """Rank r gets chunk r of ``xs[src]``; the other entries of ``xs`` are unused."""
    return list(xs[src].tensor_split(len(xs), dim))


def gather_with_grad(xs, dst=0, dim=-1):
    """``dst`` gets the concatenation; the others an empty slice of their input (what the
    differentiable gather returns there: no value, but a path for the backward)."""
    return [torch.cat(xs, dim) if r == dst else xs[r].narrow(dim, 0, 0) for r in range(len(xs))]


def all_to_all_single(xs, output_split_sizes, input_split_sizes):
    """Rank i sends ``input_split_sizes[i][j]`` rows to rank j; rank j concatenates in rank order."""
    world_size = len(xs)
    for i in range(world_size):
        for j in range(world_size):
            assert input_split_sizes[i][j] == output_split_sizes[j][i]
    pieces = [x.split(list(splits), 0) for x, splits in zip(xs, input_split_sizes)]
    return [torch.cat([pieces[i][j] for i in range(world_size)], 0) for j in range(world_size)]
