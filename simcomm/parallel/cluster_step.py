"""A 3-D parallel transformer training step: tensor x pipeline x data parallelism.

``step(comm, layout, block)`` is one SPMD training step of a stack of
pre-norm transformer blocks on ``tp * pp * dp`` ranks:

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

Ranks are numbered tensor-innermost: ``rank = (d * pp + p) * tp + t``, so a
tensor group is ``tp`` consecutive ranks (one NVLink node for ``tp = 8``) and
data-parallel peers are ``tp * pp`` apart. The program declares its compute
(``comm.compute(flops=...)``) for the modelled timeline. Meant for shape-only
runs (``World(n, tensors="shape")``) at cluster scale; with real tensors it
runs too (small sizes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..communicator import Communicator

__all__ = ["Layout", "Block", "step", "groups"]


@dataclass(frozen=True)
class Layout:
    """How many ranks each dimension has; ``world_size = tp * pp * dp``."""

    tp: int = 8
    pp: int = 4
    dp: int = 32

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(d, p, t)`` of a global rank."""
        d, rest = divmod(rank, self.tp * self.pp)
        p, t = divmod(rest, self.tp)
        return d, p, t


@dataclass(frozen=True)
class Block:
    """Sizes of the model and the batch: GPT-2 medium's block by default."""

    hidden: int = 1024
    heads: int = 16
    seq: int = 1024
    micro_batch: int = 1
    micro_batches: int = 1
    layers: int = 1                # blocks per pipeline stage
    dtype: torch.dtype = torch.bfloat16


def groups(layout: Layout) -> dict[str, list[list[int]]]:
    """The partitions of the world into tensor, pipeline and data groups (global ranks)."""
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    rank = lambda d, p, t: (d * pp + p) * tp + t  # noqa: E731
    return {
        "tensor": [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
        "pipeline": [[rank(d, p, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "data": [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
    }


def _parameters(block: Block, tp: int) -> dict[str, torch.Tensor]:
    h, ffn = block.hidden, 4 * block.hidden
    scale = 0.02
    shapes = {"ln1": (h,), "qkv": (3 * h // tp, h), "proj": (h, h // tp),
              "ln2": (h,), "fc1": (ffn // tp, h), "fc2": (h, ffn // tp)}
    return {name: (torch.randn(shape, dtype=block.dtype) * scale).requires_grad_()
            for name, shape in shapes.items()}


def _block(tensor: Communicator, x: torch.Tensor, params: dict[str, torch.Tensor], block: Block
           ) -> torch.Tensor:
    """One pre-norm transformer block, tensor-parallel over ``tensor``; ``x`` is ``(b, s, h)``."""
    b, s, h = x.shape
    heads = block.heads // tensor.world_size
    head_dim = h // block.heads
    y = tensor.copy_to_group(F.layer_norm(x, (h,), params["ln1"]))
    qkv = (y @ params["qkv"].T).view(b, s, 3, heads, head_dim)          # (b, s, 3, heads/tp, d)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)                        # each (b, heads/tp, s, d)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)      # (b, heads/tp, s, d)
    attn = attn.transpose(1, 2).reshape(b, s, heads * head_dim)         # (b, s, h/tp)
    x = x + tensor.reduce_from_group(attn @ params["proj"].T)           # (b, s, h)
    y = tensor.copy_to_group(F.layer_norm(x, (h,), params["ln2"]))
    y = F.gelu(y @ params["fc1"].T)                                      # (b, s, 4h/tp)
    return x + tensor.reduce_from_group(y @ params["fc2"].T)            # (b, s, h)


def _flops(block: Block, tp: int) -> float:
    """Forward flops of one block on one tensor-parallel rank for one micro-batch."""
    tokens, h = block.micro_batch * block.seq, block.hidden
    matmuls = 2 * tokens * (3 * h * h + h * h + 8 * h * h) / tp
    attention = 4 * block.micro_batch * block.seq ** 2 * h / tp
    return matmuls + attention


def step(comm: Communicator, layout: Layout = Layout(), block: Block = Block()) -> dict[str, torch.Size]:
    """One training step of the 3-D parallel stack (module docstring); returns this rank's
    gradient shapes by parameter name. Collective over the whole world; blocks."""
    if comm.world_size != layout.world_size:
        raise ValueError(f"cluster_step.step: rank {comm.rank} runs on {comm.world_size} ranks but "
                         f"layout {layout} needs {layout.world_size}")
    if block.heads % layout.tp or block.hidden % block.heads:
        raise ValueError(f"cluster_step.step: heads={block.heads} must divide by tp={layout.tp} and "
                         f"hidden={block.hidden} by heads")
    parts = groups(layout)
    tensor = comm.subgroup(parts["tensor"])
    pipeline = comm.subgroup(parts["pipeline"])
    data = comm.subgroup(parts["data"])
    _, stage, _ = layout.coordinates(comm.rank)
    first, last = stage == 0, stage == layout.pp - 1
    stack = [_parameters(block, layout.tp) for _ in range(block.layers)]
    shape = (block.micro_batch, block.seq, block.hidden)
    flops = _flops(block, layout.tp)
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
            x = _block(tensor, inp, params, block)
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
