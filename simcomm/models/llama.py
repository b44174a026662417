"""The Llama of the project: one :class:`Config`, one set of blocks, in two forms.

The architecture (Llama 3, as torchtitan trains it; written here from the
architecture, not copied): token embedding, ``layers`` decoder layers of
RMSNorm -> grouped-query attention with rotary position embeddings -> residual
-> RMSNorm -> SwiGLU feed-forward -> residual, a final RMSNorm and an untied
output projection. Its sizes are one :class:`Config` (the lesson's small Llama
by default; :data:`LLAMA3_8B`, :data:`LLAMA3_70B` and :data:`LLAMA3_405B` are
the Llama 3 paper's shapes) and its building blocks are one set
(:func:`rms_norm`, :func:`rotate_pairs`, :func:`share_kv_heads`). Two forms
use them, and compute differently on purpose:

==============================  =====================================================================
form                            what it is for
==============================  =====================================================================
functional (a ``params`` dict)  :func:`loss` on one device and :func:`tp_loss`: tensor + sequence +
                                vocabulary (+ context) parallel, written with the communicator;
                                angles in float64, attention written out (lesson 14,
                                :mod:`simcomm.models.llama_training`)
module (:class:`Llama`)         an ``nn.Module`` with ``scaled_dot_product_attention`` and float32
                                RoPE tables, for ``torch.distributed`` wrappers (FSDP2:
                                :mod:`simcomm.planning.fsdp2_step`)
==============================  =====================================================================

The functional form:

:func:`loss` is the single-device reference: token ids ``(s,)`` in, the mean
next-token cross-entropy out. :func:`tp_loss` is the same model on ``t`` ranks
of a tensor group, Megatron-style:

* the **embedding** and the **output layer** are vocabulary-parallel
  (:mod:`simcomm.parallel.vocab`): the embedding's partial sums are
  reduce-scattered straight into sequence shards, and the cross-entropy works
  on the logits shard ``(s, V/t)``, never gathering the logits;
* between the sublayers the residual stream is **sequence parallel**
  ``(s/t, h)``: RMSNorm on the shard, an all-gather (backward: reduce-scatter)
  into each sublayer, a reduce-scatter (backward: all-gather) out of it;
* inside, attention heads and KV heads (grouped-query attention: ``heads /
  kv_heads`` query heads share one KV head) and the SwiGLU hidden units are
  split over the ranks (:func:`shard_params`).

The loss is the same on every rank (replicated); each rank's gradients are
those of its shards, and the replicated RMSNorm weights get the part of their
gradient from this rank's sequence shard (:func:`assemble_grads` sums them).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..communicator import Communicator
from ..parallel.tensor import join_grads, split_params
from ..parallel.vocab import vocab_parallel_cross_entropy, vocab_range

__all__ = ["Config", "LLAMA3_8B", "LLAMA3_70B", "LLAMA3_405B", "parameter_count", "init_params", "loss", "logits",
           "shard_params", "tp_loss", "embed", "block", "head",
           "layer_names", "assemble_grads", "context_chunk", "REPLICATED", "rms_norm", "rotate_pairs",
           "share_kv_heads", "Llama", "TransformerBlock", "Attention", "FeedForward", "RMSNorm", "rope_tables",
           "apply_rope"]


@dataclass(frozen=True)
class Config:
    """Sizes of the model: the lesson's small Llama by default; :data:`LLAMA3_8B` and the larger
    shapes for planning (:mod:`simcomm.planning`). ``name`` is a label only (not compared)."""

    vocab: int = 64
    hidden: int = 32
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 64
    layers: int = 2
    rope_base: float = 10000.0
    eps: float = 1e-6
    name: str = field(default="", compare=False, repr=False)

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def layer_parameters(self) -> int:
        """Parameters of one decoder layer: q and o ``(h, h)``, k and v ``(kv, h)``, SwiGLU, two norms."""
        h, kv = self.hidden, self.hidden * self.kv_heads // self.heads
        return h * h + 2 * h * kv + h * h + 3 * h * self.ffn + 2 * h

    @property
    def parameters(self) -> int:
        """Parameters of the model (embedding and output counted separately: they are not tied)."""
        return self.layers * self.layer_parameters + 2 * self.vocab * self.hidden + self.hidden

    def scaled(self, **changes: Any) -> Config:
        """A copy with ``changes`` (field names as above)."""
        return replace(self, **changes)


#: Llama 3 8B (the Llama 3 paper, Table 3; Meta's published configuration, torchtitan's ``llama3_8b``)
LLAMA3_8B = Config(vocab=128256, hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=32, rope_base=500000.0,
                   eps=1e-5, name="Llama 3 8B")
#: Llama 3 70B (the Llama 3 paper, Table 3)
LLAMA3_70B = Config(vocab=128256, hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=80, rope_base=500000.0,
                    eps=1e-5, name="Llama 3 70B")
#: Llama 3 405B (the Llama 3 paper, Table 3)
LLAMA3_405B = Config(vocab=128256, hidden=16384, heads=128, kv_heads=8, ffn=53248, layers=126, rope_base=500000.0,
                     eps=1e-5, name="Llama 3 405B")


def parameter_count(config: Config) -> int:
    """Number of parameters (:attr:`Config.parameters`)."""
    return config.parameters


def layer_names(layer: int) -> list[str]:
    """The names of decoder layer ``layer``'s parameters."""
    return _names(layer)


def _names(layer: int) -> list[str]:
    return [f"{layer}.{n}" for n in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")]


#: parameter name endings every tensor-parallel rank holds whole
REPLICATED = ("attn_norm", "mlp_norm", "final_norm")


def init_params(config: Config, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """The parameters, from a generator of their own: ``embed`` ``(V, h)``, per layer the norms and
    projections (``wq (h, h)``, ``wk, wv (kv_heads * d, h)``, ``wo (h, h)``, SwiGLU ``(ffn, h)``,
    ``(h, ffn)``), ``final_norm`` and ``output`` ``(V, h)``."""
    gen = torch.Generator().manual_seed(seed)
    h, kv, f = config.hidden, config.kv_heads * config.head_dim, config.ffn

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    params = {"embed": randn(config.vocab, h, scale=1.0)}
    for layer in range(config.layers):
        norm1, wq, wk, wv, wo, norm2, gate, up, down = _names(layer)
        params.update({norm1: 1 + randn(h, scale=0.1), wq: randn(h, h, scale=h ** -0.5),
                       wk: randn(kv, h, scale=h ** -0.5), wv: randn(kv, h, scale=h ** -0.5),
                       wo: randn(h, h, scale=h ** -0.5), norm2: 1 + randn(h, scale=0.1),
                       gate: randn(f, h, scale=h ** -0.5), up: randn(f, h, scale=h ** -0.5),
                       down: randn(h, f, scale=f ** -0.5)})
    params["final_norm"] = 1 + randn(h, scale=0.1)
    params["output"] = randn(config.vocab, h, scale=h ** -0.5)
    return params


# -- the building blocks (of both forms) ------------------------------------------------------------------------

def _at_least_float32(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * weight``, normalised in at least
    float32 (a bfloat16 ``x`` is widened, the result cast back before the weight; float32 and float64
    stay as they are). No communication; ``x`` is not modified."""
    wide = x.to(_at_least_float32(x))
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return normed.type_as(x) * weight


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding: rotate each pair ``(x[..., 2i], x[..., 2i+1])`` by the angle whose
    ``cos``/``sin`` broadcast against ``x[..., ::2]`` (``(..., d/2)``), in at least float32, cast back
    to ``x``'s dtype. A new tensor of ``x``'s shape."""
    pairs = x.to(_at_least_float32(x)).unflatten(-1, (-1, 2))                          # (..., d/2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]                                             # (..., d/2) each
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)      # (..., d/2, 2)
    return rotated.flatten(-2).type_as(x)                                                # (..., d)


def share_kv_heads(k: torch.Tensor, v: torch.Tensor, heads: int, kv_heads: int, dim: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: each of the ``kv_heads`` key/value heads (along ``dim``) repeated for
    the ``heads / kv_heads`` query heads that share it (``repeat_interleave``; new tensors)."""
    group = heads // kv_heads
    return k.repeat_interleave(group, dim=dim), v.repeat_interleave(group, dim=dim)


def _rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x`` ``(s, heads, d)`` by ``position * base^(-2i/d)``
    (the angles in float64)."""
    d = x.shape[-1]
    freqs = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)                   # (d/2,)
    angle = positions.to(torch.float64)[:, None] * freqs[None, :]                        # (s, d/2)
    cos, sin = angle.cos().to(x.dtype)[:, None, :], angle.sin().to(x.dtype)[:, None, :]  # (s, 1, d/2)
    return rotate_pairs(x, cos, sin)                                                     # (s, heads, d)


def _attention(y, wq, wk, wv, wo, config: Config, positions, context: Communicator | None = None):
    """Causal grouped-query attention of ``y`` ``(s, h)`` (tokens at ``positions``) with this rank's
    heads; ``(s, h)`` partial sums of the output projection. With a ``context`` group the keys and
    values of every chunk of the sequence are all-gathered (backward: reduce-scatter), as the
    Llama 3 paper's context parallelism does."""
    s, d = y.shape[0], config.head_dim
    q = _rope((y @ wq.T).view(s, -1, d), positions, config.rope_base)                   # (s, heads', d)
    k = _rope((y @ wk.T).view(s, -1, d), positions, config.rope_base)                   # (s, kv', d)
    v = (y @ wv.T).view(s, -1, d)                                                        # (s, kv', d)
    keys = positions
    if context is not None and context.world_size > 1:
        k, v = context.all_gather(k, dim=0), context.all_gather(v, dim=0)               # (s * cp, kv', d)
        keys = torch.arange(k.shape[0])
    k, v = share_kv_heads(k, v, config.heads, config.kv_heads, dim=1)                    # (keys, heads', d)
    scores = torch.einsum("qhd,khd->hqk", q, k) * d ** -0.5                              # (heads', s, keys)
    causal = keys[None, :] > positions[:, None]                                          # (s, keys)
    probs = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(s, -1)                         # (s, heads' * d)
    return out @ wo.T                                                                    # (s, h)


def _mlp(y, gate, up, down):
    return (F.silu(y @ gate.T) * (y @ up.T)) @ down.T                                    # (s, h)


def logits(ids: torch.Tensor, params: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    """The single-device model: ids ``(s,)`` -> logits ``(s, V)``."""
    positions = torch.arange(ids.shape[0])
    x = F.embedding(ids, params["embed"])                                                # (s, h)
    for layer in range(config.layers):
        norm1, wq, wk, wv, wo, norm2, gate, up, down = (params[n] for n in _names(layer))
        x = x + _attention(rms_norm(x, norm1, config.eps), wq, wk, wv, wo, config, positions)
        x = x + _mlp(rms_norm(x, norm2, config.eps), gate, up, down)
    return rms_norm(x, params["final_norm"], config.eps) @ params["output"].T           # (s, V)


def loss(ids: torch.Tensor, params: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    """Mean cross-entropy of predicting ``ids[1:]`` from ``ids[:-1]`` (the reference)."""
    return F.cross_entropy(logits(ids[:-1], params, config), ids[1:])


def _check(config: Config, tp: int, seq: int, where: str) -> None:
    for name, value in (("heads", config.heads), ("kv_heads", config.kv_heads), ("ffn", config.ffn),
                        ("vocab", config.vocab), ("sequence length", seq)):
        if value % tp:
            raise ValueError(f"{where}: {name}={value} is not divisible by the tensor-parallel size {tp}")


def shard_params(params: dict[str, torch.Tensor], config: Config, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s shards (copies): vocabulary rows of ``embed`` and ``output``; query heads of
    ``wq``, KV heads of ``wk``/``wv`` (rows), the matching columns of ``wo``; SwiGLU units (rows of
    gate/up, columns of down); the norms whole."""
    _check(config, tp, tp, "llama.shard_params")
    return split_params(params, rank, tp, _split_dim)


def _split_dim(name: str) -> int | None:
    """The dimension :func:`shard_params` splits parameter ``name`` along (``None``: whole)."""
    kind = name.split(".")[-1]
    if kind in REPLICATED:
        return None
    return 1 if kind in ("wo", "w_down") else 0


def tp_loss(comm: Communicator, ids: torch.Tensor, shards: dict[str, torch.Tensor], config: Config,
            context: Communicator | None = None) -> torch.Tensor:
    """:func:`loss` with tensor + sequence + vocabulary parallelism over ``comm`` (module docstring);
    ``ids`` ``(s + 1,)`` whole on every rank, ``shards`` this rank's :func:`shard_params`. The result
    is the same on every rank of ``comm``. Collective over ``comm`` in forward and backward.

    With a ``context`` group of ``cp`` ranks (context parallelism), context rank ``c`` takes tokens
    ``[c s/cp, (c+1) s/cp)`` of the inputs (no load balancing) and returns its chunk's part of the
    loss, ``sum(token losses) / s``: the parts of the ``cp`` ranks add up to :func:`loss`."""
    inputs, targets, positions = context_chunk(ids, context, "llama.tp_loss")
    cp = 1 if context is None else context.world_size
    s, tp = inputs.shape[0], comm.world_size
    _check(config, tp, s, "llama.tp_loss")
    x = embed(comm, inputs, shards, config)                                              # (s/t, h)
    for layer in range(config.layers):
        x = block(comm, x, shards, config, layer, positions, context)
    return head(comm, x, targets, shards, config, s * cp)


def context_chunk(ids: torch.Tensor, context: Communicator | None,
                  where: str = "llama.context_chunk") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(inputs, targets, positions)`` of this context rank's chunk of the sequence ``ids`` ``(s + 1,)``:
    context rank ``c`` of ``cp`` takes tokens ``[c s/cp, (c+1) s/cp)`` (the whole sequence without a
    ``context`` group). No communication."""
    inputs, targets = ids[:-1], ids[1:]
    positions = torch.arange(inputs.shape[0])
    cp = 1 if context is None else context.world_size
    if cp > 1:
        if inputs.shape[0] % cp:
            raise ValueError(f"{where}: rank {context.rank}: sequence length={inputs.shape[0]} is not "
                             f"divisible by the context-parallel size {cp}")
        chunk = inputs.shape[0] // cp
        mine = slice(context.rank * chunk, (context.rank + 1) * chunk)
        inputs, targets, positions = inputs[mine], targets[mine], positions[mine]
    return inputs, targets, positions


def embed(comm: Communicator, inputs: torch.Tensor, shards: dict[str, torch.Tensor], config: Config) -> torch.Tensor:
    """The vocabulary-parallel embedding of ``inputs`` ``(s,)``, reduce-scattered into this rank's
    sequence shard ``(s/t, h)``. Collective over the tensor group ``comm``."""
    tp = comm.world_size
    start, _ = vocab_range(config.vocab, comm.rank, tp)
    local = inputs - start
    mine = (local >= 0) & (local < config.vocab // tp)
    partial = F.embedding(local.clamp(0, config.vocab // tp - 1), shards["embed"]) * mine.unsqueeze(-1)  # (s, h)
    return comm.reduce_scatter(partial, dim=0)                                           # (s/t, h) summed


def block(comm: Communicator, x: torch.Tensor, shards: dict[str, torch.Tensor], config: Config, layer: int,
          positions: torch.Tensor, context: Communicator | None = None) -> torch.Tensor:
    """Decoder layer ``layer`` on the sequence shard ``x`` ``(s/t, h)`` of the tokens at ``positions``;
    returns ``(s/t, h)``. Collective over ``comm`` (and ``context``)."""
    norm1, wq, wk, wv, wo, norm2, gate, up, down = (shards[n] for n in _names(layer))
    y = comm.all_gather(rms_norm(x, norm1, config.eps), dim=0)                          # (s, h)
    x = x + comm.reduce_scatter(_attention(y, wq, wk, wv, wo, config, positions, context), dim=0)
    y = comm.all_gather(rms_norm(x, norm2, config.eps), dim=0)                          # (s, h)
    return x + comm.reduce_scatter(_mlp(y, gate, up, down), dim=0)                       # (s/t, h)


def head(comm: Communicator, x: torch.Tensor, targets: torch.Tensor, shards: dict[str, torch.Tensor],
         config: Config, denominator: int) -> torch.Tensor:
    """Final norm, vocabulary-parallel output layer and cross-entropy of the shard ``x``:
    ``sum(token losses) / denominator``, the same on every rank of ``comm``."""
    y = comm.all_gather(rms_norm(x, shards["final_norm"], config.eps), dim=0)           # (s, h)
    token_losses = vocab_parallel_cross_entropy(comm, y @ shards["output"].T, targets)  # logits (s, V/t)
    return token_losses.sum() / denominator


def assemble_grads(grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full gradients from each rank's shard gradients (in rank order): shards concatenated
    as :func:`shard_params` split them, the replicated norms' parts summed."""
    return join_grads(grads, _split_dim)


# -- the module form ------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """:func:`rms_norm` with its weight (bf16 is normalised in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(config: Config, seq_len: int, device: torch.device | str | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``(seq, head_dim / 2)``: the rotation angle of every position and pair."""
    half = config.head_dim // 2
    inv_freq = 1.0 / config.rope_base ** (torch.arange(half, device=device, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)  # (s, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each consecutive pair of ``x``'s last dim (:func:`rotate_pairs`);
    ``x`` is ``(b, s, h, head_dim)``, ``cos``/``sin`` :func:`rope_tables`."""
    return rotate_pairs(x, cos[None, :, None, :], sin[None, :, None, :])   # tables (1, s, 1, hd/2) -> (b, s, h, hd)


class Attention(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.wq = nn.Linear(config.hidden, config.heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.heads * config.head_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)       # (b, s, h, hd)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)    # (b, s, kv, hd)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)    # (b, s, kv, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k, v = share_kv_heads(k, v, self.n_heads, self.n_kv_heads, dim=2)   # (b, s, h, hd) each
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))             # (b, h, s, hd)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, s, hd)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))        # (b, s, d)


class FeedForward(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden, config.ffn, bias=False)
        self.w3 = nn.Linear(config.hidden, config.ffn, bias=False)
        self.w2 = nn.Linear(config.ffn, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))             # SwiGLU: (b, s, d)


class TransformerBlock(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden, config.eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden, config.eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """``tokens (b, s) -> logits (b, s, vocab)``. ``checkpoint``: each block under per-op
    selective activation checkpointing (``_selective_contexts``)."""

    def __init__(self, config: Config, checkpoint: bool = False):
        super().__init__()
        self.config = config
        self.checkpoint = checkpoint
        self.tok_embeddings = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.eps)
        self.output = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(self.config, tokens.shape[1], tokens.device)
        h = self.tok_embeddings(tokens)                             # (b, s, d)
        for layer in self.layers:
            if self.checkpoint:
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, use_reentrant=False,
                                                      context_fn=_selective_contexts)
            else:
                h = layer(h, cos, sin)
        return self.output(self.norm(h))                            # (b, s, vocab)


_ALWAYS_SAVED = {torch.ops.aten._scaled_dot_product_flash_attention.default,
                 torch.ops.aten._scaled_dot_product_efficient_attention.default,
                 torch.ops.aten._scaled_dot_product_cudnn_attention.default,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                 torch.ops.aten.max.default}


def _selective_contexts():
    """Per-op selective checkpointing as torchtitan's ``selective_ac_option="op"`` decides:
    save attention's output and every other matmul's (the 1st, 3rd, ... of the block, counted in
    the forward), recompute the rest. A fresh counter per block call."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        if func in _ALWAYS_SAVED:
            return CheckpointPolicy.MUST_SAVE
        if func == torch.ops.aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 1:      # odd-numbered matmuls are saved
                return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
