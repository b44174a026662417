"""A Llama-3-style decoder and one FSDP2 training step of it, for planning a real model shape-only.

The model follows the Llama 3 architecture as torchtitan trains it (written here
from the architecture, not copied): token embedding, ``layers`` blocks of
RMSNorm -> grouped-query attention with rotary position embeddings -> residual ->
RMSNorm -> SwiGLU feed-forward -> residual, a final RMSNorm and an untied output
projection. Its sizes are the lesson model's :class:`simcomm.parallel.llama.Config`
(one config for both; its blocks too: :func:`~simcomm.parallel.llama.rms_norm`,
:func:`~simcomm.parallel.llama.rotate_pairs`, :func:`~simcomm.parallel.llama.share_kv_heads`).
:data:`LLAMA3_8B` is Llama 3.1 8B's shape (hidden 4096, 32 layers,
32 query heads over 8 key/value heads, feed-forward 14336, vocabulary 128256,
RoPE theta 500000).

:func:`fsdp_train_step` is the training program, ``program(comm, config, ...)``
for ``World.run``, in the way torchtitan applies FSDP2 to it: ``fully_shard`` on
every block, on the final norm and output together, and on the root (which
holds the embedding); fp32 parameters with ``MixedPrecisionPolicy(param_dtype=
bfloat16, reduce_dtype=float32)``; every FSDP module's gradient divide factor
set to 1.0, so FSDP2 reduce-scatters with ``PREMUL_SUM(1.0)`` and the loss is
divided by the global number of tokens instead; selective activation
checkpointing *per op* (torchtitan's ``selective_ac_option="op"``): in each
block, the outputs of attention and of every other matmul are saved, the rest
is recomputed in the backward; AdamW. It labels its memory for
:mod:`simcomm.memory` (``parameters``, ``gradients``, ``optimizer_state``,
``activations``; see the function) and marks each backward and each step.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import memory
from .llama import Config, rms_norm, rotate_pairs, share_kv_heads

__all__ = ["LLAMA3_8B", "Llama", "TransformerBlock", "fsdp_train_step", "flops_per_token",
           "parameter_count"]


#: Llama 3.1 8B (Meta's published configuration; torchtitan's ``llama3_8b``)
LLAMA3_8B = Config(vocab=128256, hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=32, rope_base=500000.0,
                   eps=1e-5)


def parameter_count(config: Config) -> int:
    """Number of parameters (embedding and output counted separately: they are not tied)."""
    d, kv = config.hidden, config.kv_heads * config.head_dim
    attention = d * d * 2 + d * kv * 2                 # wq, wo: (d, d); wk, wv: (kv, d)
    ffn = 3 * d * config.ffn                       # w1, w3: (ffn, d); w2: (d, ffn)
    block = attention + ffn + 2 * d                    # two RMSNorm weights
    return config.layers * block + 2 * config.vocab * d + d


def flops_per_token(config: Config, seq_len: int) -> float:
    """Training FLOPs per token as torchtitan counts them for MFU: ``6 * (parameters without the
    embedding) + 12 * layers * heads * head_dim * seq_len`` (attention's two matmuls, forward and
    backward, without a causal discount)."""
    dense = parameter_count(config) - config.vocab * config.hidden
    return 6 * dense + 12 * config.layers * config.heads * config.head_dim * seq_len


class RMSNorm(nn.Module):
    """:func:`simcomm.parallel.llama.rms_norm` with its weight (bf16 is normalised in fp32)."""

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
    """Rotate each consecutive pair of ``x``'s last dim (:func:`simcomm.parallel.llama.rotate_pairs`);
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
    selective activation checkpointing (:func:`_selective_policy`)."""

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


def fsdp_train_step(comm, config: Config, batch_size: int, seq_len: int, steps: int = 2,
                    checkpoint: bool = True, lr: float = 3e-4) -> dict:
    """``steps`` AdamW steps of :class:`Llama` under FSDP2 on every rank (collective; blocks).

    Each rank draws its own ``(batch_size, seq_len)`` tokens (on shape-only ranks they are fake).
    Memory labels: the sharded fp32 parameters as ``parameters`` (created under it; the full
    tensors ``fully_shard`` frees are counted there too while they live); AdamW's moments as
    ``optimizer_state``; everything forward and backward create as ``activations`` (this
    includes FSDP2's all-gathered bf16 parameters, its reduce-scatter buffers and the logits);
    the sharded gradients are relabelled ``gradients`` after each backward. Marks: ``"step N
    backward"`` after each backward (gradients tagged), ``"step N"`` after each optimizer step. Returns ``{"loss": last loss (a tensor), "steps": steps}``.
    """
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    with memory.label("parameters"):
        model = Llama(config, checkpoint=checkpoint)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard([model.norm, model.output], mp_policy=policy, reshard_after_forward=False)
        fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)    # torchtitan: PREMUL_SUM(1.0), loss / global tokens
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=False, foreach=True)
    global_tokens = batch_size * seq_len * dist.get_world_size()
    loss = None
    for step in range(1, steps + 1):
        with memory.label("activations"):
            tokens = torch.randint(0, config.vocab, (batch_size, seq_len + 1))
            inputs, labels = tokens[:, :-1], tokens[:, 1:]                  # (b, s) each
            logits = model(inputs)                                          # (b, s, vocab) bf16
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1),
                                   reduction="sum") / global_tokens
            del logits
            loss.backward()
        for parameter in model.parameters():
            if parameter.grad is not None:
                memory.tag(parameter.grad.to_local(), "gradients")
        memory.mark(f"step {step} backward")
        with memory.label("optimizer_state"):
            optimizer.step()
        optimizer.zero_grad()
        memory.mark(f"step {step}")
    return {"loss": loss.detach(), "steps": steps}

