"""Vocabulary parallelism (Megatron): the embedding and the cross-entropy split by vocabulary rows.

With a vocabulary of ``V`` on ``t`` tensor-parallel ranks, rank ``r`` holds rows
``[r V/t, (r+1) V/t)`` of the embedding and of the output layer
(:func:`vocab_range`). Neither the embedding table nor the logits are ever
gathered:

* :func:`vocab_parallel_embedding`: each rank looks up the ids in its range
  (zeros for the others) and the partial embeddings are summed over the ranks
  (``comm.reduce_from_group``: all-reduce forward, identity backward, the
  Megatron pair for a replicated result); the gradient of each rank's table
  is local.
* :func:`vocab_parallel_cross_entropy`: from each rank's logits shard
  ``(tokens, V/t)``, three all-reduces of one number per token (the max, the
  sum of exponentials, the target's logit, which only its owner has) give the
  loss ``log sum exp - target logit`` on every rank. Backward needs no
  communication: the gradient of a shard is ``softmax(shard) - onehot(shard)``
  times the incoming gradient.

Call chain: ``vocab_parallel_cross_entropy -> _VocabCrossEntropy.forward ->
comm.all_reduce (MAX, SUM, SUM)``; backward is local.
"""
from __future__ import annotations

import torch

from ..communicator import Communicator

__all__ = ["vocab_range", "vocab_parallel_embedding", "vocab_parallel_cross_entropy"]


def vocab_range(vocab: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, end)`` of the vocabulary rows rank ``rank`` of ``world_size`` holds."""
    if vocab % world_size:
        raise ValueError(f"vocab_range: vocab={vocab} is not divisible by the tensor-parallel size {world_size}")
    per = vocab // world_size
    return rank * per, (rank + 1) * per


def _local_ids(comm: Communicator, ids: torch.Tensor, rows: int, where: str) -> tuple[torch.Tensor, torch.Tensor]:
    start = comm.rank * rows
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{where}: rank {comm.rank}: ids must be an integer tensor, got {ids.dtype}")
    vocab = rows * comm.world_size
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{where}: rank {comm.rank}: ids must lie in [0, {vocab}); got "
                         f"min {int(ids.min())}, max {int(ids.max())}")
    outside = (ids < start) | (ids >= start + rows)
    return (ids - start).masked_fill(outside, 0), outside


def vocab_parallel_embedding(comm: Communicator, ids: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``embedding(ids, full_table)`` from this rank's rows ``shard`` ``(V/t, h)`` of the table; the
    result ``(*ids.shape, h)`` is the same on every rank. Collective over ``comm`` (one
    all-reduce forward; backward local). ``ids`` and ``shard`` are not modified."""
    local, outside = _local_ids(comm, ids, shard.shape[0], "vocab_parallel_embedding")
    partial = torch.nn.functional.embedding(local, shard) * (~outside).unsqueeze(-1)   # (*ids, h)
    return comm.reduce_from_group(partial)


class _VocabCrossEntropy(torch.autograd.Function):
    """Cross-entropy from vocabulary shards; forward all-reduces per-token numbers, backward is local."""

    @staticmethod
    def forward(ctx, comm, logits, target):
        local, outside = _local_ids(comm, target, logits.shape[-1], "vocab_parallel_cross_entropy")
        top = comm.all_reduce(logits.max(dim=-1).values, "max")                  # (tokens,)
        shifted = logits - top.unsqueeze(-1)                                      # (tokens, V/t)
        exp = shifted.exp()
        total = comm.all_reduce(exp.sum(dim=-1))                                  # (tokens,)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0)
        picked = comm.all_reduce(picked)                                          # the target's logit
        ctx.save_for_backward(exp / total.unsqueeze(-1), local, outside)
        return total.log() - picked

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()                                             # (tokens, V/t)
        hit = (~outside).to(softmax.dtype)
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))     # minus the one-hot
        return None, grad_logits * grad.unsqueeze(-1), None


def vocab_parallel_cross_entropy(comm: Communicator, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy ``(tokens,)`` of the full logits, from this rank's shard ``(tokens, V/t)``
    (vocabulary rows :func:`vocab_range`) and the ``target`` ids ``(tokens,)``; the same on every
    rank. Collective over ``comm`` in forward (three all-reduces of ``tokens`` numbers); the
    backward gives each rank the gradient of its own shard, with no communication. Inputs are
    not modified."""
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"vocab_parallel_cross_entropy: rank {comm.rank}: logits must be (tokens, V/t) and "
                         f"target (tokens,); got {tuple(logits.shape)} and {tuple(target.shape)}")
    return _VocabCrossEntropy.apply(comm, logits, target)
