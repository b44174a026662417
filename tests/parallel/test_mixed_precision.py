"""Mixed precision: bytes per rank measured against (2 + 2 + 12) psi and its ZeRO forms; the loss
against the float64 single-device run within the stated bf16 tolerance; fp16 loss scaling."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.parallel import mixed_precision as mp
from simcomm.parallel.zero import MLP

PSI = MLP().numel


@pytest.mark.parametrize("gradients", mp.GRADIENTS)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bytes_per_rank_equal_the_model_state_formula(stage, gradients):
    world = simcomm.World(4, memory=True)
    outs = world.run(mp.train, stage, gradients=gradients, steps=2, micro_batches=2)
    expected = mp.expected_bytes(stage, PSI, 4, gradients)
    for snap in world.memory.at("after step 2"):
        assert {label: snap[label] for label in expected} == expected
    reference = mp.reference_losses(steps=2)
    for out in outs:
        assert ((out["losses"] - reference).abs() / reference).max() < mp.BF16_TOLERANCE


def test_sixteen_psi_and_eighteen_psi_unsharded():
    assert sum(mp.expected_bytes(0, 10, 4).values()) == 16 * 10
    assert sum(mp.expected_bytes(0, 10, 4, "fp32 main_grad").values()) == 18 * 10
    assert sum(mp.expected_bytes(3, 10, 4).values()) == 16 * 10 / 4


def test_bf16_is_not_float64_but_close_and_fp32_main_grad_is_closer_with_many_micro_batches():
    reference = mp.reference_losses(steps=4)
    errors = {}
    for gradients in mp.GRADIENTS:
        losses = simcomm.World(2).run(mp.train, 0, gradients=gradients, steps=4, micro_batches=4)[0]["losses"]
        errors[gradients] = ((losses - reference).abs() / reference).max().item()
    assert 0 < errors["fp32 main_grad"] < errors["16-bit"] < mp.BF16_TOLERANCE


def test_fp16_loss_scaling_skips_overflowing_steps_on_every_rank_and_halves_the_scale():
    outs = simcomm.World(2).run(mp.train, 1, dtype=torch.float16, loss_scale=2.0 ** 24, growth_interval=2,
                                steps=9)
    history = outs[0]["history"]
    assert all(out["history"] == history for out in outs)
    overflowed = [step for step, _, over in history if over]
    assert overflowed[:3] == [1, 2, 3]
    for (_, scale, over), (_, next_scale, _) in zip(history, history[1:]):
        assert next_scale in ((scale / 2,) if over else (scale, 2 * scale))
    reference = mp.reference_losses(steps=9)
    losses = outs[0]["losses"]
    good = 0
    for index, (_, _, over) in enumerate(history):     # a skipped step leaves the model unchanged
        assert abs(losses[index] - reference[good]) / reference[good] < 1e-2
        good += not over
    assert good >= 2


def test_bad_arguments_say_what_to_change():
    with pytest.raises(simcomm.RankError, match="float16 needs loss_scale"):
        simcomm.World(2).run(mp.train, 0, dtype=torch.float16)
    with pytest.raises(ValueError, match="stage=5"):
        mp.expected_bytes(5, 10, 2)
    with pytest.raises(ValueError, match="gradients='fp8'"):
        mp.expected_bytes(0, 10, 2, "fp8")
    with pytest.raises(simcomm.RankError, match="batch_size=6 .* not divisible by world size x micro_batches"):
        simcomm.World(2).run(mp.train, 0, batch_size=6, micro_batches=2)
