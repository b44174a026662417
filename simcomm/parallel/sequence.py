"""Ulysses sequence parallelism: attention over the full sequence from sequence shards.

``all_to_all_4D`` turns sequence shards into head shards, each rank runs
ordinary attention on ``h/P`` heads, and a second all-to-all turns the output
back. The reference (:func:`attention`) is the same math on one device without
communication; tests, ``real.verify`` and the lessons compare with it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..communicator import Communicator

__all__ = ["attention", "ulysses_attention", "make_qkv"]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False) -> torch.Tensor:
    """Softmax attention on ``(batch, seq, heads, head_dim)`` tensors."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)  # (b, h, s, d)
    return out.transpose(1, 2)                                                       # (b, s, h, d)


def ulysses_attention(comm: Communicator, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      causal: bool = False) -> torch.Tensor:
    """Attention over the full sequence from sequence shards ``(b, s/P, h, d)``.

    Each of q, k, v is re-sharded to head shards ``(b, s, h/P, d)`` by an
    all-to-all, every rank attends over the whole sequence for its ``h/P``
    heads, and a second all-to-all returns sequence shards ``(b, s/P, h, d)``.
    """
    q, k, v = (comm.all_to_all_4D(t, scatter_dim=2, gather_dim=1) for t in (q, k, v))  # (b, s, h/P, d)
    out = attention(q, k, v, causal=causal)                                            # (b, s, h/P, d)
    return comm.all_to_all_4D(out, scatter_dim=1, gather_dim=2)                       # (b, s/P, h, d)


def make_qkv(batch: int, seq: int, heads: int, head_dim: int, *, seed: int = 0,
             dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded full-sequence q, k, v of shape ``(batch, seq, heads, head_dim)``."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, seq, heads, head_dim, generator=gen, dtype=dtype) for _ in range(3))
