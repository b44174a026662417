"""A 3-D parallel transformer training step: tensor x pipeline x data parallelism.

``step(comm, layout, block)`` is one SPMD training step of a stack of
pre-norm transformer blocks (the cluster form of :mod:`simcomm.models.transformer`:
:class:`~simcomm.models.transformer.Block` sizes, :func:`~simcomm.models.transformer.tp_block`)
on the ``pp * dp * tp`` ranks of a
:class:`simcomm.parallel.mesh.Layout` ``Layout(pp=..., dp=..., tp=...)``:

* **tensor parallel** (Megatron): inside each block, attention heads and the
  MLP's hidden units are split over the ``tp`` ranks of a tensor group; the
  input is ``copy_to_group``-ed, the attention projection and the second MLP
  layer end in ``reduce_from_group`` (an all-reduce forward, identity backward).
* **pipeline parallel**: the ``pp`` stages hold ``layers`` blocks each;
  activations go forward stage by stage with send/recv, gradients come back
  the same way (GPipe: all micro-batches forward, then all backward).
* **data parallel**: the ``dp`` replicas of every stage all-reduce (average)
  their gradients, one asynchronous all-reduce per block, issued as soon as
  the block's last backward is done (it overlaps the backward of the blocks
  before it) and waited at the end.

Ranks are numbered as the project's one mesh numbers them (``init_device_mesh``'s
row-major order over ``("pp", "dp", "tp")``): ``rank = (p * dp + d) * tp + t``,
so a tensor group is ``tp`` consecutive ranks (one NVLink node for ``tp = 8``),
data-parallel peers are ``tp`` apart and pipeline peers ``dp * tp``. The
program declares its compute (``comm.compute(flops=...)``) for the modelled
timeline. Meant for shape-only runs (``World(n, tensors="shape")``) at cluster
scale; with real tensors it runs too (small sizes).

It models a different thing from the checked block of :mod:`simcomm.models.transformer` (lesson
12's block, checked against one device in float64, with sequence parallelism
and a pipeline cut between the two sublayers): here whole blocks per stage,
Megatron tensor parallelism without sequence parallelism, many micro-batches
and overlapped data-parallel all-reduces, with random bf16 weights and no
reference values; what it is for is the trace and the memory at scale.
"""
from __future__ import annotations

import functools

import torch

from ..communicator import Communicator
from ..models.transformer import Block, block_flops, block_parameters, tp_block
from ..parallel.mesh import Layout

__all__ = ["partition", "step"]


@functools.lru_cache(maxsize=64)
def partition(layout: Layout, dim: str) -> tuple[tuple[int, ...], ...]:
    """``layout.groups(dim)`` as tuples, computed once per process for every rank that asks
    (``Layout.groups`` walks every rank: ``O(world size)`` for each rank that calls it, so
    ``O(world size**2)`` for a run if each rank built its own). A ``Layout`` is immutable and
    the tuples cannot change, so every rank can pass the same object to ``comm.subgroup``, as a
    process computes its partition once."""
    return tuple(tuple(group) for group in layout.groups(dim))


def step(comm: Communicator, layout: Layout, block: Block = Block()) -> dict[str, torch.Size]:
    """One training step of the 3-D parallel stack (module docstring) on ``layout`` (a
    :class:`~simcomm.parallel.mesh.Layout` of pp, dp and tp); returns this rank's gradient shapes by
    parameter name. Collective over the whole world; blocks."""
    if not isinstance(layout, Layout):
        raise TypeError(f"cluster_step.step: rank {comm.rank}: layout={layout!r} must be a "
                        "simcomm.parallel.mesh.Layout with its sizes by name, e.g. Layout(pp=4, dp=32, tp=8)")
    if layout.cp != 1:
        raise ValueError(f"cluster_step.step: rank {comm.rank}: layout {layout!r} has cp={layout.cp}; this "
                         "step has no context parallelism")
    if comm.world_size != layout.world_size:
        raise ValueError(f"cluster_step.step: rank {comm.rank} runs on {comm.world_size} ranks but "
                         f"layout {layout} needs {layout.world_size}")
    if block.heads % layout.tp or block.hidden % block.heads:
        raise ValueError(f"cluster_step.step: heads={block.heads} must divide by tp={layout.tp} and "
                         f"hidden={block.hidden} by heads")
    tensor = comm.subgroup(partition(layout, "tp"))
    pipeline = comm.subgroup(partition(layout, "pp"))
    data = comm.subgroup(partition(layout, "dp"))
    stage = layout.coordinate(comm.rank, "pp")
    first, last = stage == 0, stage == layout.pp - 1
    stack = [block_parameters(block, layout.tp) for _ in range(block.layers)]
    shape = (block.micro_batch, block.seq, block.hidden)
    flops = block_flops(block, layout.tp)
    runs = []                                             # per micro-batch: (input, output) of each block
    for _ in range(block.micro_batches):                  # forward, stage by stage
        if first:
            x = torch.randn(shape, dtype=block.dtype)
        else:
            x = pipeline.recv(shape, block.dtype, stage - 1)
        pairs = []
        for index, params in enumerate(stack):
            # each block's input is a leaf, so backward can run block by block
            inp = x.detach().requires_grad_() if (index or not first) else x
            x = tp_block(tensor, inp, params, block)
            comm.compute(flops=flops)
            pairs.append((inp, x))
        if not last:
            pipeline.send(x.detach(), stage + 1)
        runs.append(pairs)
    handles = []
    for count, pairs in enumerate(reversed(runs)):        # backward, last stage first
        final = count == block.micro_batches - 1          # the step's gradients are complete after it
        grad = None if last else pipeline.recv(shape, block.dtype, stage + 1)
        for index in reversed(range(len(pairs))):
            inp, out = pairs[index]
            if grad is None:
                out.float().pow(2).mean().backward()
            else:
                out.backward(grad)
            comm.compute(flops=2 * flops)
            if final:   # data parallel: average this block's gradients while the blocks before it run
                bucket = torch.cat([p.grad.reshape(-1) for p in stack[index].values()])
                handles.append(data.all_reduce(bucket, "avg", async_op=True))
            grad = inp.grad
        if not first:
            pipeline.send(grad, stage - 1)
    for handle in handles:
        handle.wait()
    return {name: p.grad.shape for name, p in stack[0].items()}
