"""Activation bytes measured per rank against the stated accounting; the layer against one device."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.model.cost import modelled_timeline
from simcomm.models import transformer
from simcomm.planning import activations as act


def _data(s, b, h, layers, seed=5):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(s, b, h, dtype=torch.float64, generator=gen)
    weights = torch.randn(s, b, h, dtype=torch.float64, generator=gen)
    return x, weights, [act.make_layer(h, seed=i) for i in range(layers)]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("recompute", act.RECOMPUTE)
@pytest.mark.parametrize("size", [(32, 2, 32, 4), (64, 1, 64, 8)])
def test_measured_activation_bytes_equal_the_accounting(size, recompute, tp):
    s, b, h, heads = size
    layers = 2
    x, weights, stack = _data(s, b, h, layers)
    world = simcomm.World(tp, memory=True)
    world.run(act.activation_run, x, weights, stack, heads, recompute)
    expected = layers * act.expected_bytes(s, b, h, heads, tp, recompute)
    for snap in world.memory.at("after forward"):
        assert snap["activations"] == expected
    # the paper's formula differs only by the LayerNorm statistics (none with full recomputation)
    stats = 0 if recompute == "full" else layers * 8 * s * b / tp
    assert expected - layers * act.formula_bytes(s, b, h, heads, tp, recompute) == stats
    # backward frees the activations layer by layer: the last layer's backward ends first
    marks = [world.memory.at(f"backward, layer {i}")[0]["activations"] for i in reversed(range(layers))]
    assert marks == sorted(marks, reverse=True) and marks[-1] < expected


@pytest.mark.parametrize("recompute", act.RECOMPUTE)
def test_tensor_sequence_parallel_layer_equals_one_device_in_float64(recompute):
    s, b, h, heads, layers = 16, 2, 16, 4, 2
    x, weights, stack = _data(s, b, h, layers)
    leaves = [{n: p.clone().requires_grad_() for n, p in params.items()} for params in stack]
    reference = act.stack_loss(x, weights, leaves, heads)
    reference.backward()
    outs = simcomm.World(2).run(act.activation_run, x, weights, stack, heads, recompute, dtype=torch.float64)
    torch.testing.assert_close(sum(o["loss"] for o in outs), reference.detach(), rtol=0, atol=1e-10)
    grads = act.assemble_grads(outs, h)
    for index, params in enumerate(leaves):
        for name, p in params.items():
            torch.testing.assert_close(grads[index][name], p.grad, rtol=0, atol=1e-10, msg=name)


def test_dropout_is_applied_and_recomputed_identically():
    s, b, h, heads = 16, 1, 16, 2
    x, weights, stack = _data(s, b, h, 1)
    with_dropout = act.stack_loss(x, weights, stack, heads)
    without = act.stack_loss(x, weights, stack, heads, p=0.0)
    assert not torch.isclose(with_dropout, without)
    for mode in act.RECOMPUTE:
        assert act.stack_loss(x, weights, stack, heads, recompute=mode) == with_dropout
    keep = transformer.dropout_mask((1000, 100), seed=3)
    assert keep.dtype == torch.bool and abs(keep.float().mean().item() - (1 - act.DROPOUT)) < 0.01


def test_full_recomputation_costs_a_third_more_compute_on_the_modelled_timeline():
    s, b, h, heads = 32, 1, 32, 4
    x, weights, stack = _data(s, b, h, 2)
    compute = {}
    for mode in act.RECOMPUTE:
        world = simcomm.World(2)
        world.run(act.activation_run, x, weights, stack, heads, mode)
        compute[mode] = modelled_timeline(world.trace, "h100-nvswitch").ranks[0].compute
    flops = act.layer_flops(s, b, h, 2)
    assert compute["full"] / compute["none"] == pytest.approx(4 / 3)
    assert compute["selective"] / compute["none"] == pytest.approx(
        1 + flops["attention"] / (3 * (flops["matmuls"] + flops["attention"])))


def test_bad_arguments_name_the_function_and_value():
    with pytest.raises(ValueError, match=r"formula_bytes: recompute='some'"):
        act.formula_bytes(8, 1, 8, 2, recompute="some")
    x, weights, stack = _data(8, 1, 12, 1)
    with pytest.raises(simcomm.RankError, match="heads=3 must divide by tp=2"):
        simcomm.World(2).run(act.activation_run, x, weights, stack, 3)
