"""Ring attention against single-device float64 attention: outputs and gradients, causal or not,
contiguous and zig-zag layouts, odd world sizes; the LSE merge; work per rank from the trace."""
from __future__ import annotations

import math

import pytest
import torch

import simcomm
from simcomm.parallel.context import (
    LAYOUTS,
    all_gather_kv_attention,
    block_attention,
    chunk_ids,
    lse_merge,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)


def reference_attention(q, k, v, causal):
    """Plain softmax attention on (b, s, h, d), written without any simcomm code."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s = q.shape[1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def qkvw(world_size, per_rank=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, per_rank * world_size, 3, 5, generator=gen, dtype=torch.float64) for _ in range(4)]


def _ring_program(comm, q, k, v, w, causal, layout):
    q, k, v = (shard_sequence(t, comm.rank, comm.world_size, layout).requires_grad_() for t in (q, k, v))
    out = ring_attention(comm, q, k, v, causal=causal, layout=layout)
    (out * shard_sequence(w, comm.rank, comm.world_size, layout)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _reference(q, k, v, w, causal):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = reference_attention(*leaves, causal)
    (out * w).sum().backward()
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_ring_attention_equals_single_device_attention(world_size, layout, causal):
    q, k, v, w = qkvw(world_size, seed=world_size)
    outs = simcomm.World(world_size).run(_ring_program, q, k, v, w, causal, layout)
    expected = _reference(q, k, v, w, causal)
    for index, name in enumerate(["out", "dq", "dk", "dv"]):
        got = unshard_sequence([out[index] for out in outs], layout)
        assert torch.allclose(got, expected[index], atol=1e-12, rtol=0), (name, (got - expected[index]).abs().max())


def test_lse_merge_of_two_blocks_is_attention_over_both():
    q, k, v, _ = qkvw(1, per_rank=6)
    out1, lse1 = block_attention(q, k[:, :2], v[:, :2])
    out2, lse2 = block_attention(q, k[:, 2:], v[:, 2:])
    out, lse = lse_merge(out1, lse1, out2, lse2)
    assert torch.allclose(out, reference_attention(q, k, v, False), atol=1e-13)
    scores = torch.einsum("bqhd,bkhd->bqhk", q, k) / math.sqrt(q.shape[-1])
    assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-13)
    empty = torch.full_like(lse1, float("-inf"))
    same, same_lse = lse_merge(torch.zeros_like(out2), empty, out2, lse2)   # an empty first block
    assert torch.equal(same, out2) and torch.equal(same_lse, lse2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_and_unshard_are_inverse(layout):
    x = torch.arange(24.).view(1, 24, 1, 1)
    shards = [shard_sequence(x, r, 3, layout) for r in range(3)]
    assert torch.equal(unshard_sequence(shards, layout), x)
    if layout == "zigzag":
        assert chunk_ids(0, 3, layout) == [0, 5] and shards[0].flatten().tolist() == [0, 1, 2, 3, 20, 21, 22, 23]


def _work(world_size, layout):
    q, k, v, w = qkvw(world_size)
    world = simcomm.World(world_size)
    world.run(_ring_program, q, k, v, w, True, layout)
    return [sum(e.args["flops"] for e in world.trace.filter(op="compute", rank=r, phase="forward").events)
            for r in range(world_size)]


def test_causal_work_per_rank_contiguous_is_uneven_zigzag_is_even():
    contiguous = _work(4, "contiguous")
    assert [f / contiguous[0] for f in contiguous] == [1, 2, 3, 4]       # rank r computes r + 1 blocks
    zigzag = _work(4, "zigzag")
    assert len(set(zigzag)) == 1 and sum(zigzag) == pytest.approx(sum(contiguous) * 9 / 10)
    # zig-zag: 2P + 1 = 9 quarter-size chunk pairs per rank; contiguous: P (P + 1) / 2 = 10 blocks in all


def test_kv_travel_the_ring_forward_and_backward():
    q, k, v, w = qkvw(3)
    world = simcomm.World(3)
    world.run(_ring_program, q, k, v, w, False, "contiguous")
    sends = world.trace.filter(op="send", rank=0)
    forward = [e for e in sends.events if e.phase == "forward"]
    backward = [e for e in sends.events if e.phase == "backward"]
    assert len(forward) == 2 and all(e.root == 1 for e in forward)
    assert len(backward) == 3                          # k, v, dk, dv twice; dk, dv home once more
    assert backward[0].nbytes == 2 * forward[0].nbytes and backward[-1].nbytes == forward[0].nbytes


@pytest.mark.parametrize("causal", [False, True])
def test_all_gather_kv_attention_equals_single_device(causal):
    q, k, v, w = qkvw(3)

    def program(comm):
        mine = [shard_sequence(t, comm.rank, 3).requires_grad_() for t in (q, k, v)]
        out = all_gather_kv_attention(comm, *mine, causal=causal)
        (out * shard_sequence(w, comm.rank, 3)).sum().backward()
        return [out.detach()] + [t.grad for t in mine]

    outs = simcomm.World(3).run(program)
    for index, expected in enumerate(_reference(q, k, v, w, causal)):
        assert torch.allclose(unshard_sequence([o[index] for o in outs]), expected, atol=1e-12)


def test_bad_layout_and_odd_zigzag_shard_are_named_errors():
    q = torch.zeros(1, 3, 1, 2)
    with pytest.raises(ValueError, match="layout='ring'"):
        shard_sequence(q, 0, 2, "ring")
    with pytest.raises(ValueError, match="not divisible by the 4 chunks"):
        shard_sequence(q, 0, 2, "zigzag")

    def program(comm):
        return ring_attention(comm, q, q, q, layout="zigzag")

    with pytest.raises(simcomm.RankError, match="even shard length"):
        simcomm.World(2).run(program)
