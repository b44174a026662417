"""ZeRO stages 0-3 (simcomm.parallel.zero): every step equals single-device Adam in float64, and the
measured bytes per rank match the ZeRO paper's accounting."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import simcomm
from simcomm.parallel import zero

MLP = zero.MLP((6, 10, 8, 3))      # layer sizes 70, 88, 27: padding needed for 3 and 4 ranks
BATCH = 12
LR = 1e-2


def reference(mlp: zero.MLP, steps: int) -> list[torch.Tensor]:
    """``steps`` of torch.optim.Adam on the whole batch, float64, one device: flat vector per layer."""
    weights, biases = [], []
    for flat, fan_in, fan_out in zip(mlp.init(0), mlp.sizes, mlp.sizes[1:]):
        flat = flat.double()
        weights.append(flat[:fan_out * fan_in].reshape(fan_out, fan_in).clone().requires_grad_())
        biases.append(flat[fan_out * fan_in:].clone().requires_grad_())
    x, y = (t.double() for t in zero.make_batch(mlp, BATCH, seed=1))
    optimizer = torch.optim.Adam([*weights, *biases], lr=LR)
    for _ in range(steps):
        optimizer.zero_grad()
        h = x
        for i, (w, b) in enumerate(zip(weights, biases)):
            h = F.linear(h, w, b)
            h = torch.tanh(h) if i < len(weights) - 1 else h
        F.mse_loss(h, y).backward()
        optimizer.step()
    return [torch.cat([w.detach().flatten(), b.detach()]) for w, b in zip(weights, biases)]


def assemble(stage: int, outs: list[list[torch.Tensor]], mlp: zero.MLP) -> list[torch.Tensor]:
    """The model from the ranks' results: rank 0's full vectors (stages 0-2; every rank must agree)
    or the ranks' shards concatenated (stage 3), cut to each layer's size."""
    if stage < 3:
        for rank, layers in enumerate(outs):
            for full, mine in zip(outs[0], layers):
                assert torch.equal(full, mine), f"stage {stage}: rank {rank}'s parameters differ from rank 0's"
        layers = outs[0]
    else:
        layers = [torch.cat([rank_layers[i] for rank_layers in outs]) for i in range(len(outs[0]))]
    return [flat[:numel] for flat, numel in zip(layers, mlp.layer_numels)]


@pytest.mark.parametrize("stage", zero.STAGES)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("steps", [1, 2])
def test_each_step_equals_single_device_adam(stage, world_size, steps):
    outs = simcomm.World(world_size).run(zero.train, stage, MLP, steps=steps, batch_size=BATCH, lr=LR)
    got = assemble(stage, outs, MLP)
    want = reference(MLP, steps)
    initial = [p.double() for p in MLP.init(0)]
    for layer, (g, w, p0) in enumerate(zip(got, want, initial)):
        assert g.dtype == torch.float32
        assert not torch.allclose(w, p0), "the reference did not move: the test could not fail"
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6, msg=lambda m: f"stage {stage}, "
                                   f"world {world_size}, step {steps}, layer {layer}: {m}")


def test_stages_move_what_the_paper_says():
    """Stage 0 all-reduces gradients; 1 and 2 reduce-scatter them; 3 all-gathers parameters in
    forward and reduce-scatters gradients in backward; 1-3 all-gather updated shards (3: next forward)."""
    ops = {}
    for stage in zero.STAGES:
        world = simcomm.World(2)
        world.run(zero.train, stage, MLP, steps=1, batch_size=BATCH)
        ops[stage] = sorted({(e.op, e.phase) for e in world.trace.events if e.op != "compute"})
    assert ops[0] == [("all_reduce", "forward")]
    assert ops[1] == [("all_gather", "forward"), ("reduce_scatter", "forward")]
    assert ops[2] == [("all_gather", "forward"), ("reduce_scatter", "forward")]
    assert ops[3] == [("all_gather", "forward"), ("reduce_scatter", "backward")]


PSI_MLP = zero.MLP((16, 64, 64, 8))   # psi = 5768, each layer divisible by 4: no padding


@pytest.mark.parametrize("stage", zero.STAGES)
def test_measured_bytes_match_the_zero_formulas(stage):
    """Steady state: the mark after the optimizer step, gathered parameters freed."""
    world_size = 4
    world = simcomm.World(world_size, memory=True)
    world.run(zero.train, stage, PSI_MLP, steps=2, batch_size=8)
    expected = zero.expected_bytes(stage, PSI_MLP.numel, world_size)
    for snap in world.memory.at("after step 2"):
        for name, want in expected.items():
            assert abs(snap[name] - want) <= 0.05 * want, (stage, name, snap[name], want)
        # nothing else is held: no gathered parameters, activations or communication buffers
        assert snap.total == sum(snap[name] for name in expected) + snap["inputs"], snap
        assert snap["inputs"] == 8 // world_size * (16 + 8) * 4


def test_memory_falls_with_each_stage():
    totals, peaks = [], []
    for stage in zero.STAGES:
        world = simcomm.World(4, memory=True)
        world.run(zero.train, stage, PSI_MLP, steps=2, batch_size=8)
        totals.append(world.memory.at("after step 2")[0].total)
        peaks.append(world.memory.peak[0])
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == 4, totals
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, peaks


def test_bad_arguments_are_named():
    with pytest.raises(simcomm.RankError) as info:
        simcomm.World(3).run(zero.train, 0, MLP, batch_size=8)
    assert "batch_size=8" in str(info.value.__cause__) and "world size 3" in str(info.value.__cause__)
    with pytest.raises(ValueError, match="stage=5"):
        zero.step_stage(5)


VARIANTS = [(stage, variant) for stage in (2, 3) for variant in zero.VARIANTS[stage][1:]]


@pytest.mark.parametrize("stage, variant", VARIANTS)
@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_each_variant_equals_single_device_adam(stage, variant, world_size):
    outs = simcomm.World(world_size).run(zero.train, stage, MLP, steps=2, batch_size=BATCH, lr=LR, variant=variant)
    for layer, (g, w) in enumerate(zip(assemble(stage, outs, MLP), reference(MLP, 2))):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"stage {stage} {variant}, world {world_size}, layer {layer}: {m}")


def _ops(stage, variant):
    world = simcomm.World(2)
    world.run(zero.train, stage, MLP, steps=1, batch_size=BATCH, variant=variant)
    return [(e.op, e.phase) for e in world.trace.events if e.rank == 0 and e.op != "compute"]


def test_zero2_in_backward_reduce_scatters_each_layer_during_backward():
    ops = _ops(2, "in_backward")
    layers = len(MLP.layer_numels)
    assert ops[:layers] == [("reduce_scatter", "backward")] * layers       # before any update's all-gather
    assert ops[layers:] == [("all_gather", "forward")] * layers


def test_fsdp_regathers_in_backward_and_keeps_activations_instead_of_recomputing():
    layers = len(MLP.layer_numels)
    fsdp_ops = _ops(3, "fsdp")
    assert fsdp_ops[:layers] == [("all_gather", "forward")] * layers
    backward = fsdp_ops[layers:]
    assert {op for op in backward} == {("all_gather", "backward"), ("reduce_scatter", "backward")}
    # every layer but the first is re-gathered (the first layer's weight is not needed: its input needs
    # no gradient); the checkpointing way re-runs every layer's forward, gathering each one again
    assert backward.count(("all_gather", "backward")) == layers - 1
    assert _ops(3, "checkpoint").count(("all_gather", "forward")) == 2 * layers


def test_zero2_in_backward_never_holds_the_whole_gradient():
    deep = zero.MLP((16,) + (64,) * 8 + (8,))
    peaks = {}
    for variant in zero.VARIANTS[2]:
        world = simcomm.World(4, memory=True)
        world.run(zero.train, 2, deep, steps=1, batch_size=8, variant=variant)
        peaks[variant] = world.memory.at("peak")[0]
    full_gradient = deep.numel * 4
    assert peaks["after_backward"]["gradients"] >= full_gradient
    assert peaks["in_backward"].bytes.get("gradients", 0) < full_gradient / 2
    assert peaks["in_backward"].total < 0.85 * peaks["after_backward"].total


def test_an_unknown_variant_is_named():
    with pytest.raises(ValueError, match="variant='fsdp' for stage 2"):
        zero.step_stage(2, "fsdp")
