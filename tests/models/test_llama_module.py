"""The Llama-3-style model and its FSDP2 planning step (simcomm.models.llama) at toy sizes:
the code path of benchmarks/plan_llama3_8b.py, checked against one device."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils import flop_counter
from torch.utils.flop_counter import FlopCounterMode

import simcomm
from simcomm.models import llama
from simcomm.planning import fsdp2_step
from simcomm.sim.shape import trace_signature

TOY = llama.LLAMA3_8B.scaled(hidden=64, layers=2, heads=4, kv_heads=2, ffn=96, vocab=128)
BATCH, SEQ, WORLD = 2, 16, 2


def test_parameter_count_matches_the_module_and_the_8b_shape():
    assert llama.parameter_count(TOY) == sum(p.numel() for p in llama.Llama(TOY).parameters())
    assert llama.parameter_count(llama.LLAMA3_8B) == 8_030_261_248     # Llama 3.1 8B's published count


def test_grouped_query_attention_equals_full_attention_with_repeated_heads():
    """One device, float64: the model's attention against sdpa with explicitly repeated k/v heads
    and the rotary embedding done with complex numbers (an independent formulation)."""
    torch.manual_seed(0)
    attention = llama.Attention(TOY).double()
    x = torch.randn(BATCH, SEQ, TOY.hidden, dtype=torch.float64)
    cos, sin = llama.rope_tables(TOY, SEQ)
    got = attention(x, cos, sin)

    def rope(t):   # (b, s, h, hd) as complex pairs times e^{i angle}
        pairs = torch.view_as_complex(t.unflatten(-1, (-1, 2)).contiguous())
        angle = torch.complex(cos.double(), sin.double())        # e^{i angle}, (s, hd/2)
        return torch.view_as_real(pairs * angle[None, :, None, :]).flatten(-2)

    hd = TOY.head_dim
    q = rope(attention.wq(x).view(BATCH, SEQ, TOY.heads, hd))
    k = rope(attention.wk(x).view(BATCH, SEQ, TOY.kv_heads, hd))
    v = attention.wv(x).view(BATCH, SEQ, TOY.kv_heads, hd)
    groups = TOY.heads // TOY.kv_heads
    k = torch.stack([k[:, :, h // groups] for h in range(TOY.heads)], 2)   # (b, s, h, hd)
    v = torch.stack([v[:, :, h // groups] for h in range(TOY.heads)], 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(BATCH, SEQ, -1)
    torch.testing.assert_close(got, attention.wo(out), rtol=0, atol=1e-12)


def _one_device_step_flops(steps: int) -> int:
    """FlopCounterMode on one device: the same model, local batch, forward and backward, with
    torch's attention formulas registered for CPU's attention kernel (FlopCounterMode counts
    that kernel as zero; simcomm.sim.flops counts it with these formulas)."""
    aten = torch.ops.aten
    cpu_attention = {aten._scaled_dot_product_flash_attention_for_cpu: flop_counter.sdpa_flop.__wrapped__,
                     aten._scaled_dot_product_flash_attention_for_cpu_backward: flop_counter.sdpa_backward_flop.__wrapped__}
    torch.manual_seed(0)
    model = llama.Llama(TOY)
    with FlopCounterMode(display=False, custom_mapping=cpu_attention) as counter:
        for _ in range(steps):
            tokens = torch.randint(0, TOY.vocab, (BATCH, SEQ + 1))
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("checkpoint", [False, True])
def test_fsdp_step_shape_only_traces_as_real_values_and_counts_flop_counter_mode_flops(checkpoint):
    signatures, flops = [], []
    for tensors in ("real", "shape"):
        world = simcomm.World(WORLD, tensors=tensors, memory=True, count_flops=True)
        outs = world.run(fsdp2_step.fsdp_train_step, TOY, BATCH, SEQ, steps=1, checkpoint=checkpoint)
        assert outs[0]["loss"].shape == ()
        signatures.append(trace_signature(world.trace))
        flops.append(world.flops)
        reduce_ops = {e.args.get("op") for e in world.trace.events if e.op == "reduce_scatter"}
        assert reduce_ops == {"premul_sum"}        # gradient divide factor 1.0, as torchtitan
        end = world.memory.at("step 1")
        shard_bytes = sum(4 * math.ceil(p.numel() / WORLD) for p in llama.Llama(TOY).parameters())
        for snapshot in end:
            # fp32 shards (dim 0 padded to the world size) and a few bytes of FSDP2's own bookkeeping
            assert shard_bytes <= snapshot["parameters"] <= shard_bytes + 256
            assert snapshot["optimizer_state"] >= 2 * shard_bytes   # AdamW's two moments (+ step counters)
    assert signatures[0] == signatures[1]
    assert flops[0] == flops[1]
    forward_backward = _one_device_step_flops(1)
    if checkpoint:     # per-op selective AC recomputes every other matmul of each block
        assert forward_backward < flops[0][0] < 1.5 * forward_backward
    else:
        assert flops[0] == [forward_backward] * WORLD
