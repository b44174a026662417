"""The small Llama: tensor + sequence + vocabulary parallel loss and gradients equal one device in float64."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.models import llama

CONFIG = llama.Config()


def _program(comm, ids, params, config):
    shards = {n: p.requires_grad_() for n, p in llama.shard_params(params, config, comm.rank, comm.world_size).items()}
    loss = llama.tp_loss(comm, ids, shards, config)
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in shards.items()}}


@pytest.mark.parametrize("tp", [1, 2])
def test_tensor_sequence_vocab_parallel_llama_equals_one_device(tp):
    params = llama.init_params(CONFIG, seed=0)
    ids = torch.randint(0, CONFIG.vocab, (17,), generator=torch.Generator().manual_seed(1))
    leaves = {n: p.clone().requires_grad_() for n, p in params.items()}
    reference = llama.loss(ids, leaves, CONFIG)
    reference.backward()
    outs = simcomm.World(tp).run(_program, ids, params, CONFIG)
    for out in outs:
        torch.testing.assert_close(out["loss"], reference.detach(), rtol=0, atol=1e-12)
    grads = llama.assemble_grads([o["grads"] for o in outs])
    assert set(grads) == set(leaves)
    for name, p in leaves.items():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-12, msg=name)


def test_reference_is_a_causal_language_model():
    params = llama.init_params(CONFIG, seed=0)
    ids = torch.randint(0, CONFIG.vocab, (9,), generator=torch.Generator().manual_seed(2))
    full = llama.logits(ids, params, CONFIG)
    changed = ids.clone()
    changed[-1] = (changed[-1] + 1) % CONFIG.vocab
    torch.testing.assert_close(llama.logits(changed, params, CONFIG)[:-1], full[:-1])   # no peeking ahead
    assert not torch.allclose(llama.logits(changed, params, CONFIG)[-1], full[-1])
    assert llama.loss(ids, params, CONFIG) > 0


def test_indivisible_sizes_are_named():
    params = llama.init_params(CONFIG, seed=0)
    ids = torch.arange(16) % CONFIG.vocab                        # 15 inputs: not divisible by 2
    with pytest.raises(simcomm.RankError, match="sequence length=15 is not divisible by the tensor-parallel size 2"):
        simcomm.World(2).run(_program, ids, params, CONFIG)
    with pytest.raises(ValueError, match="kv_heads=2 is not divisible by the tensor-parallel size 4"):
        llama.shard_params(params, CONFIG, 0, 4)


def _cp_program(comm, ids, params, config, tp):
    cp = comm.world_size // tp
    tensor = comm.subgroup([[c * tp + t for t in range(tp)] for c in range(cp)])
    context = comm.subgroup([[c * tp + t for c in range(cp)] for t in range(tp)])
    shards = {n: p.requires_grad_() for n, p in llama.shard_params(params, config, tensor.rank, tp).items()}
    part = llama.tp_loss(tensor, ids, shards, config, context)
    part.backward()
    with torch.no_grad():
        grads = {n: context.all_reduce(p.grad) for n, p in shards.items()}   # the chunks' parts summed
    return {"loss": context.all_reduce(part.detach()), "grads": grads, "t": tensor.rank}


@pytest.mark.parametrize("tp, cp", [(1, 2), (2, 2)])
def test_context_parallel_llama_equals_one_device(tp, cp):
    params = llama.init_params(CONFIG, seed=0)
    ids = torch.randint(0, CONFIG.vocab, (17,), generator=torch.Generator().manual_seed(1))
    leaves = {n: p.clone().requires_grad_() for n, p in params.items()}
    reference = llama.loss(ids, leaves, CONFIG)
    reference.backward()
    outs = simcomm.World(tp * cp).run(_cp_program, ids, params, CONFIG, tp)
    for out in outs:
        torch.testing.assert_close(out["loss"], reference.detach(), rtol=0, atol=1e-12)
    grads = llama.assemble_grads([outs[t]["grads"] for t in range(tp)])     # context rank 0's tensor group
    for name, p in leaves.items():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-12, msg=name)


def test_the_shared_blocks_against_independent_formulas():
    """rms_norm, rotate_pairs and share_kv_heads (used by this model and llama3_fsdp's) against the
    formulas written another way: complex rotation for RoPE, explicit indexing for grouped-query heads."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=gen)
    weight = torch.randn(8, dtype=torch.float64, generator=gen)
    expected = x / (x.pow(2).sum(-1, keepdim=True) / 8 + 1e-6).sqrt() * weight
    torch.testing.assert_close(llama.rms_norm(x, weight, 1e-6), expected, rtol=0, atol=1e-14)
    half = x.to(torch.bfloat16)                                           # normalised in float32, cast back
    assert llama.rms_norm(half, weight.to(torch.bfloat16), 1e-6).dtype == torch.bfloat16
    angle = torch.randn(5, 4, dtype=torch.float64, generator=gen)        # (s, d/2), against x (3, s, d)
    rotated = llama.rotate_pairs(x, angle.cos(), angle.sin())
    complex_x = torch.view_as_complex(x.reshape(3, 5, 4, 2))
    torch.testing.assert_close(rotated, torch.view_as_real(complex_x * torch.exp(1j * angle)).reshape(3, 5, 8),
                               rtol=0, atol=1e-14)
    k, v = torch.randn(2, 5, 2, 8, generator=gen), torch.randn(2, 5, 2, 8, generator=gen)   # 2 KV heads
    k4, v4 = llama.share_kv_heads(k, v, heads=4, kv_heads=2, dim=2)
    assert torch.equal(k4, k[:, :, [0, 0, 1, 1]]) and torch.equal(v4, v[:, :, [0, 0, 1, 1]])


def test_the_planning_model_takes_the_same_config():
    from simcomm.models import llama as llama3_fsdp

    assert isinstance(llama3_fsdp.LLAMA3_8B, llama.Config)
    assert llama3_fsdp.LLAMA3_8B.scaled(layers=2) == llama.Config(
        vocab=128256, hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=2, rope_base=500000.0, eps=1e-5)
