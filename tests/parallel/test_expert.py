"""Expert-parallel MoE against a single-device float64 MoE written here with plain loops:
output and every gradient (router and bias included), odd world sizes, capacity drops,
zero tokens routed to an expert."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import simcomm
from simcomm.parallel.expert import expert_parallel_moe, make_moe, moe, shard_experts


def loop_moe(x, params, top_k, capacity_factor, groups):
    """Token by token: softmax router, top-k, the first ``cap`` assignments per expert kept per group."""
    num_experts = params["router"].shape[0]
    rows = []
    per_group = x.shape[0] // groups
    for g in range(groups):
        taken = [0] * num_experts
        cap = math.inf if capacity_factor is None else math.ceil(capacity_factor * per_group * top_k / num_experts)
        for t in range(g * per_group, (g + 1) * per_group):
            probs = torch.softmax(x[t] @ params["router"].T + params["bias"], -1)
            gates, ids = probs.topk(top_k)
            row = torch.zeros_like(x[t])
            for w1, w2 in zip(params.get("shared_w1", ()), params.get("shared_w2", ())):   # every token
                row = row + F.gelu(x[t] @ w1.T) @ w2.T
            for gate, e in zip(gates, ids.tolist()):
                if taken[e] < cap:
                    taken[e] += 1
                    row = row + gate * (F.gelu(x[t] @ params["w1"][e].T) @ params["w2"][e].T)
            rows.append(row)
    return torch.stack(rows)


def setup(world_size, experts_per_rank=2, tokens=6, hidden=4, ffn=6, seed=0, shared_experts=0):
    params = make_moe(hidden, ffn, experts_per_rank * world_size, seed=seed, shared_experts=shared_experts)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(world_size * tokens, hidden, generator=gen, dtype=torch.float64)
    w = torch.randn(world_size * tokens, hidden, generator=gen, dtype=torch.float64)
    return params, x, w


def _program(comm, x, w, params, top_k, capacity_factor):
    tokens = x.shape[0] // comm.world_size
    mine = slice(comm.rank * tokens, (comm.rank + 1) * tokens)
    xr = x[mine].clone().requires_grad_()
    shards = shard_experts(params, comm.rank, comm.world_size)
    out, stats = expert_parallel_moe(comm, xr, shards, top_k, capacity_factor=capacity_factor)
    (out * w[mine]).sum().backward()
    return out.detach(), xr.grad, {k: v.grad for k, v in shards.items()}, stats


def _reference(x, w, params, top_k, capacity_factor, groups):
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    xr = x.clone().requires_grad_()
    out = loop_moe(xr, leaves, top_k, capacity_factor, groups)
    (out * w).sum().backward()
    return out.detach(), xr.grad, {k: v.grad for k, v in leaves.items()}


def _check(outs, expected):
    out, x_grad, grads = expected
    assert torch.allclose(torch.cat([o[0] for o in outs]), out, atol=1e-12)
    assert torch.allclose(torch.cat([o[1] for o in outs]), x_grad, atol=1e-12)
    for name in ("router", "bias"):          # replicated: each rank's share from its tokens; they sum
        assert torch.allclose(sum(o[2][name] for o in outs), grads[name], atol=1e-12), name
    for name in ("w1", "w2"):                # sharded: concatenate the experts
        assert torch.allclose(torch.cat([o[2][name] for o in outs]), grads[name], atol=1e-12), name
    for name in ("shared_w1", "shared_w2"):  # replicated on every rank: each rank's share from its tokens
        if name in grads:
            assert torch.allclose(sum(o[2][name] for o in outs), grads[name], atol=1e-12), name


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_expert_parallel_moe_equals_single_device(world_size, top_k, capacity_factor):
    params, x, w = setup(world_size, seed=world_size)
    outs = simcomm.World(world_size).run(_program, x, w, params, top_k, capacity_factor)
    _check(outs, _reference(x, w, params, top_k, capacity_factor, world_size))
    assert torch.allclose(moe(x, params, top_k, capacity_factor=capacity_factor, groups=world_size),
                          _reference(x, w, params, top_k, capacity_factor, world_size)[0], atol=1e-12)


def test_zero_tokens_routed_to_an_expert_and_to_a_rank():
    params, x, w = setup(3, seed=5)
    params["bias"] = torch.tensor([0., 0., 50., 0., 0., 40.], dtype=torch.float64)   # experts 2 and 5 take all
    world = simcomm.World(3)
    outs = world.run(_program, x, w, params, 2, None)
    _check(outs, _reference(x, w, params, 2, None, 3))
    for out in outs:
        stats = out[3]
        assert stats["per_expert"][0] == 0 and stats["sent"][0] == 0
    assert [o[3]["received"] for o in outs][0] == [0, 0, 0]              # rank 0 holds experts 0, 1: no rows
    assert torch.count_nonzero(outs[0][2]["w1"]) == 0                     # ...so their gradients are zero
    splits = [e.args["input_split_sizes"] for e in world.trace.filter(op="all_to_all_single", rank=1).events]
    assert [0, 6, 6] in splits                                             # the uneven dispatch, zeros included


def test_capacity_drops_and_counts():
    params, x, w = setup(2, seed=3)
    params["bias"] = torch.tensor([5., 0., 0., 0.], dtype=torch.float64)   # everyone wants expert 0
    outs = simcomm.World(2).run(_program, x, w, params, 1, 1.0)
    capacity = math.ceil(1.0 * 6 * 1 / 4)                                   # 2 per expert per rank
    for out in outs:
        stats = out[3]
        assert max(stats["per_expert"]) <= capacity
        assert stats["dropped"] == 6 - sum(stats["per_expert"]) > 0
    _check(outs, _reference(x, w, params, 1, 1.0, 2))


def test_wrong_router_size_and_indivisible_experts_are_named_errors():
    params = make_moe(4, 6, 3)
    with pytest.raises(ValueError, match="3 experts are not divisible by the world size 2"):
        shard_experts(params, 0, 2)
    with pytest.raises(ValueError, match="top_k=4"):
        moe(torch.zeros(2, 4, dtype=torch.float64), params, 4)


def test_load_balancing_loss_is_one_when_uniform_and_e_when_collapsed():
    from simcomm.parallel.expert import load_balancing_loss

    x = torch.randn(12, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    uniform = load_balancing_loss(x, torch.zeros(8, 4, dtype=torch.float64), torch.zeros(8, dtype=torch.float64), 2)
    assert uniform.item() == pytest.approx(1.0, abs=1e-12)
    bias = torch.zeros(8, dtype=torch.float64).index_fill(0, torch.tensor([0]), 60.0)
    collapsed = load_balancing_loss(x, torch.zeros(8, 4, dtype=torch.float64), bias, 1)
    assert collapsed.item() == pytest.approx(8.0, rel=1e-12)
    router = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    loss = load_balancing_loss(x, router, torch.zeros(8, dtype=torch.float64), 2)
    probs = torch.softmax(x @ router.T, dim=-1)                       # the formula written out, float64
    counts = torch.bincount(probs.topk(2, dim=-1).indices.flatten(), minlength=8).double()
    assert loss.item() == pytest.approx((8 * (counts / 24) * probs.mean(0)).sum().item(), rel=1e-12)
    loss.backward()
    assert router.grad is not None and router.grad.abs().sum() > 0


@pytest.mark.parametrize("world_size, shared_experts", [(1, 1), (2, 1), (4, 1), (3, 2)])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_shared_experts_beside_routed_ones_equal_single_device(world_size, shared_experts, capacity_factor):
    params, x, w = setup(world_size, seed=10 + world_size, shared_experts=shared_experts)
    assert params["shared_w1"].shape == (shared_experts, 6, 4)
    routed_only = {k: v for k, v in params.items() if not k.startswith("shared")}
    assert torch.equal(make_moe(4, 6, 2 * world_size, seed=10 + world_size)["w2"], routed_only["w2"])
    outs = simcomm.World(world_size).run(_program, x, w, params, 2, capacity_factor)
    expected = _reference(x, w, params, 2, capacity_factor, world_size)
    _check(outs, expected)
    assert {"shared_w1", "shared_w2"} <= set(expected[2])
    # the shared expert adds what the routed layer alone does not: every token's output changes
    routed = torch.cat([o[0] for o in simcomm.World(world_size).run(_program, x, w, routed_only, 2,
                                                                      capacity_factor)])
    assert (torch.cat([o[0] for o in outs]) - routed).abs().amax(dim=1).min() > 1e-6


def test_shared_expert_sends_nothing_more():
    params, x, w = setup(2, shared_experts=1)
    world = simcomm.World(2)
    world.run(_program, x, w, params, 2, None)
    with_shared = [(e.op, e.phase, sum(e.sent.values())) for e in world.trace.events if e.op != "compute"]
    world.run(_program, x, w, {k: v for k, v in params.items() if not k.startswith("shared")}, 2, None)
    assert with_shared == [(e.op, e.phase, sum(e.sent.values())) for e in world.trace.events if e.op != "compute"]


def test_make_moe_rejects_a_negative_number_of_shared_experts():
    with pytest.raises(ValueError, match="shared_experts=-1 must be >= 0"):
        make_moe(4, 6, 4, shared_experts=-1)


def _router_training_data(world_size=4, tokens=16, hidden=8, ffn=8, num_experts=8, favoured_bias=2.0):
    from simcomm.parallel.expert import make_moe as make

    params = make(hidden, ffn, num_experts, seed=0, shared_experts=1)
    params["bias"][0] = favoured_bias
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(world_size * tokens, hidden, dtype=torch.float64, generator=gen)
    return params, x, torch.randn(world_size * tokens, hidden, dtype=torch.float64, generator=gen)


@pytest.mark.parametrize("aux_weight, capacity_factor", [(0.0, None), (1.0, None), (1.0, 1.25)])
def test_router_training_equals_single_device_step_by_step(aux_weight, capacity_factor):
    from simcomm.parallel.expert import train_router, train_router_reference

    params, x, target = _router_training_data()
    kwargs = dict(steps=6, lr=2.0, aux_weight=aux_weight, capacity_factor=capacity_factor)
    outs = simcomm.World(4).run(train_router, x, target, params, 2, **kwargs)
    ref = train_router_reference(x, target, params, 2, groups=4, **kwargs)
    for out in outs:                                   # every rank holds the same router
        assert out["per_expert"] == ref["per_expert"]
        assert max(abs(a - b) for a, b in zip(out["aux"], ref["aux"], strict=True)) < 1e-12
        assert torch.allclose(out["router"], ref["router"], atol=1e-12, rtol=0)
        assert torch.allclose(out["bias"], ref["bias"], atol=1e-12, rtol=0)
    assert not torch.equal(ref["router"], params["router"])


def test_the_load_balancing_loss_spreads_the_tokens_of_a_favoured_expert():
    from simcomm.parallel.expert import load_imbalance, train_router_reference

    params, x, target = _router_training_data(tokens=32)
    runs = {weight: train_router_reference(x, target, params, 2, steps=20, lr=2.0, aux_weight=weight, groups=4)
            for weight in (0.0, 1.0)}
    before = load_imbalance(runs[0.0]["per_expert"][0])
    assert before > 3.0                                # expert 0 takes over 3x its share
    assert load_imbalance(runs[1.0]["per_expert"][-1]) < 1.5 < load_imbalance(runs[0.0]["per_expert"][-1])
    assert runs[1.0]["aux"][-1] < runs[0.0]["aux"][-1]
    assert load_imbalance([4, 4, 4, 4]) == 1.0 and load_imbalance([8, 0, 0, 0]) == 4.0
