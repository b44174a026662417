"""The 3-D parallel transformer block step against the single-device float64 block: loss and
every gradient for every (tp, dp, pp) layout of 8 ranks and for odd world sizes; the mesh; the
collectives each axis issues; a layout that does not fit is a named error."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import simcomm
from simcomm.parallel.mesh import Layout
from simcomm.models.transformer import assemble_grads, block_step, layouts, make_block, shard_block

HEADS = 4


def reference_loss(x, w, p):
    """The block written out again with plain torch ops (pre-LN, causal attention, GELU MLP)."""
    b, s, hidden = x.shape
    hd = hidden // HEADS
    y = F.layer_norm(x, (hidden,), p["ln1_w"], p["ln1_b"])
    q, k, v = ((y @ p[n].T).view(b, s, HEADS, hd).permute(0, 2, 1, 3) for n in ("wq", "wk", "wv"))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    scores = scores + torch.full((s, s), float("-inf"), dtype=x.dtype).triu(1)
    attn = (scores.softmax(-1) @ v).permute(0, 2, 1, 3).reshape(b, s, hidden)
    h = x + attn @ p["wo"].T + p["bo"]
    z = F.layer_norm(h, (hidden,), p["ln2_w"], p["ln2_b"])
    out = h + F.gelu(z @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]
    return (out * w).sum()


def data(batch=4, seq=8, hidden=8, ffn=16, seed=0):
    gen = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64)
    return x, w, make_block(hidden, ffn, seed=seed)


def L(tp, dp, pp):
    """The test's shorthand, named at the one place it is spelled out."""
    return Layout(pp=pp, dp=dp, tp=tp)


def check(world_size, layout, batch=4, seq=8):
    layout = L(*layout)
    x, w, params = data(batch=batch, seq=seq)
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    expected = reference_loss(x, w, leaves)
    expected.backward()
    world = simcomm.World(world_size)
    outs = world.run(block_step, x, w, params, HEADS, layout)
    assert sum(o["loss"] for o in outs).item() == pytest.approx(expected.item(), abs=1e-11)
    grads = assemble_grads(outs, layout)
    for name, leaf in leaves.items():
        assert torch.allclose(grads[name], leaf.grad, atol=1e-11, rtol=0), name
    return world


def test_layouts_of_eight():
    assert layouts(8) == [L(1, 8, 1), L(2, 4, 1), L(4, 2, 1), L(8, 1, 1), L(1, 4, 2), L(2, 2, 2), L(4, 1, 2)]


@pytest.mark.parametrize("layout", [(2, 4, 1), (4, 2, 1), (1, 8, 1), (2, 2, 2), (4, 1, 2), (1, 4, 2)])
def test_block_step_equals_single_device_on_8_ranks(layout):
    check(8, layout, batch=8)


@pytest.mark.parametrize("world_size, layout", [(1, (1, 1, 1)), (3, (1, 3, 1)), (5, (1, 5, 1)), (6, (2, 3, 1)),
                                                (6, (1, 3, 2))])
def test_block_step_odd_world_sizes(world_size, layout):
    check(world_size, layout, batch=world_size if world_size > 1 else 2, seq=8)


def test_each_rank_holds_the_shards_of_its_mesh_coordinates():
    layout = Layout(pp=2, dp=2, tp=2)
    _, _, params = data()
    for rank in range(8):
        stage, _, t = layout.coordinates(rank)
        shards = shard_block(params, layout, rank)
        assert set(shards) == {"ln1_w", "ln1_b", "wq", "wk", "wv", "wo", "bo"} if stage == 0 else set(shards) == {
            "ln2_w", "ln2_b", "w1", "b1", "w2", "b2"}
        name = "wq" if stage == 0 else "w1"
        assert torch.equal(shards[name], params[name].chunk(2, dim=0)[t])


def test_a_layout_without_pp_or_with_a_tuple():
    check(4, (2, 2, 1), batch=4)
    x, w, params = data()
    check_2d = simcomm.World(4).run(block_step, x, w, params, HEADS, Layout(dp=2, tp=2))    # no pp dim: 1 stage
    assert [o["coords"] for o in check_2d] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    with pytest.raises(simcomm.RankError, match=r"block_step: layout=\(2, 2, 1\) must be a simcomm.parallel.mesh"):
        simcomm.World(4).run(block_step, x, w, params, HEADS, (2, 2, 1))
    with pytest.raises(simcomm.RankError, match="cp=2: this block has no context parallelism"):
        simcomm.World(4).run(block_step, x, w, params, HEADS, Layout(cp=2, tp=2))


def test_each_axis_issues_its_collectives_on_its_subgroup():
    world = check(8, (2, 2, 2), batch=8)
    rank0 = world.trace.filter(rank=0).events
    gathers = [e for e in rank0 if e.op == "all_gather"]
    assert gathers and all(e.group == (0, 1) for e in gathers)            # tp group
    reduces = [e for e in rank0 if e.op == "all_reduce"]
    assert {e.group for e in reduces} == {(0, 1), (0, 2)}                  # tp (LayerNorm, bias), dp (all)
    sends = [e for e in rank0 if e.op == "send"]
    assert len(sends) == 1 and sends[0].root == 4                          # stage 0 -> stage 1, same (d, t)
    assert {e.phase for e in world.trace.filter(op="reduce_scatter").events} == {"forward", "backward"}


def test_a_layout_that_does_not_fit_is_a_named_error():
    x, w, params = data(batch=4, seq=8)
    with pytest.raises(simcomm.RankError, match=r"dp=8|tp\*dp\*pp = 4 is not the world size 8"):
        simcomm.World(8).run(block_step, x, w, params, HEADS, L(1, 8, 1))
    with pytest.raises(simcomm.RankError, match="heads=4 is not divisible by tp=8"):
        simcomm.World(8).run(block_step, x, w, params, HEADS, L(8, 1, 1))
