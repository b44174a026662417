"""Megatron-style tensor parallelism: a column- then row-parallel MLP, with its single-device reference.

A column-parallel linear layer (each rank holds ``ffn/P`` rows of ``w1``),
GELU, a row-parallel linear layer (each rank holds ``ffn/P`` columns of
``w2``) and an all-reduce of the partial sums. The reference (:func:`mlp`) is
the same math on one device without communication; tests, ``real.verify`` and
the lessons compare with it.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..communicator import Communicator

__all__ = ["make_mlp", "mlp", "shard_mlp", "tp_mlp", "split_params", "join_grads"]


def make_mlp(hidden: int, ffn: int, *, seed: int = 0, dtype: torch.dtype = torch.float64
             ) -> dict[str, torch.Tensor]:
    """Parameters of a ``hidden -> ffn -> hidden`` MLP: ``w1 (ffn, hidden)``, ``b1 (ffn,)``,
    ``w2 (hidden, ffn)``, ``b2 (hidden,)``, drawn from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(ffn, hidden, generator=gen, dtype=dtype) / math.sqrt(hidden),
        "b1": torch.randn(ffn, generator=gen, dtype=dtype) * 0.1,
        "w2": torch.randn(hidden, ffn, generator=gen, dtype=dtype) / math.sqrt(ffn),
        "b2": torch.randn(hidden, generator=gen, dtype=dtype) * 0.1,
    }


def mlp(x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The single-device MLP: ``gelu(x @ w1.T + b1) @ w2.T + b2``."""
    return F.gelu(x @ params["w1"].T + params["b1"]) @ params["w2"].T + params["b2"]


def shard_mlp(params: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s leaf parameters: rows of ``w1``/``b1``, columns of ``w2``, all of ``b2``."""
    ffn = params["w1"].shape[0]
    if ffn % world_size:
        raise ValueError(f"shard_mlp: ffn size {ffn} is not divisible by the world size {world_size}")
    shard = ffn // world_size
    rows = slice(rank * shard, (rank + 1) * shard)
    return {
        "w1": params["w1"][rows].clone().requires_grad_(),       # (ffn/P, hidden)
        "b1": params["b1"][rows].clone().requires_grad_(),       # (ffn/P,)
        "w2": params["w2"][:, rows].clone().requires_grad_(),    # (hidden, ffn/P)
        "b2": params["b2"].clone().requires_grad_(),             # (hidden,) replicated
    }


def tp_mlp(comm: Communicator, x: torch.Tensor, shards: dict[str, torch.Tensor], *,
           conjugate: bool = True) -> torch.Tensor:
    """The tensor-parallel MLP on this rank's ``shards``; ``x`` is replicated, so is the output.

    ``conjugate=True`` uses Megatron's pair (``copy_to_group`` in,
    ``reduce_from_group`` out): the right gradients when every rank computes
    the same replicated loss. ``conjugate=False`` uses the plain differentiable
    ``all_reduce``: the right gradients when the per-rank losses *sum* to the
    objective (and ``world_size`` times too large for a replicated loss).
    """
    if conjugate:
        x = comm.copy_to_group(x)
    hidden = F.gelu(x @ shards["w1"].T + shards["b1"])          # (batch, ffn/P)
    partial = hidden @ shards["w2"].T                            # (batch, hidden): this rank's share
    out = comm.reduce_from_group(partial) if conjugate else comm.all_reduce(partial)
    return out + shards["b2"]


def split_params(params: dict[str, torch.Tensor], rank: int, tp: int,
                 dim_of: Callable[[str], int | None]) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s tensor-parallel copy of each parameter: chunk ``rank`` of ``tp`` equal
    chunks along ``dim_of(name)`` (0: output rows, 1: input columns), or the whole tensor where
    ``dim_of`` gives ``None`` (replicated). Copies, never views of ``params``."""
    out = {}
    for name, p in params.items():
        dim = dim_of(name)
        out[name] = (p if dim is None else p.chunk(tp, dim)[rank]).clone()
    return out


def join_grads(grads: list[dict[str, torch.Tensor]], dim_of: Callable[[str], int | None]
               ) -> dict[str, torch.Tensor]:
    """The inverse of :func:`split_params` for gradients, ``grads`` in rank order: the shards
    concatenated along ``dim_of(name)``; a replicated parameter's gradients summed (each rank's
    is its part of the whole)."""
    full = {}
    for name in grads[0]:
        parts = [g[name] for g in grads]
        dim = dim_of(name)
        full[name] = sum(parts) if dim is None else torch.cat(parts, dim)
    return full
