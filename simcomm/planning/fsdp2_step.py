"""One FSDP2 training step of the Llama (:class:`simcomm.models.llama.Llama`), for planning a real model shape-only.

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
:func:`flops_per_token` is the FLOP count torchtitan reports MFU with.
Run shape-only (``World(n, tensors="shape")``) on :data:`simcomm.models.llama.LLAMA3_8B`,
it estimates the memory per GPU of a real FSDP2 step (``benchmarks/plan_llama3_8b.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import memory
from ..models.llama import Config, Llama, parameter_count

__all__ = ["fsdp_train_step", "flops_per_token"]


def flops_per_token(config: Config, seq_len: int) -> float:
    """Training FLOPs per token as torchtitan counts them for MFU: ``6 * (parameters without the
    embedding) + 12 * layers * heads * head_dim * seq_len`` (attention's two matmuls, forward and
    backward, without a causal discount)."""
    dense = parameter_count(config) - config.vocab * config.hidden
    return 6 * dense + 12 * config.layers * config.heads * config.head_dim * seq_len


def fsdp_train_step(comm, config: Config, batch_size: int, seq_len: int, steps: int = 2,
                    checkpoint: bool = True, lr: float = 3e-4) -> dict:
    """``steps`` AdamW steps of :class:`~simcomm.models.llama.Llama` under FSDP2 on every rank (collective; blocks).

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

