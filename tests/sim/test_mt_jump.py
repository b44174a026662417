"""Jumping a CPU generator ahead (simcomm.sim.mt_jump) gives the state drawing gives, and shape-only
ranks use it to follow a training loop's dropout masks past any count of outputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import simcomm
from simcomm.sim import mt_jump, shape_random


def _drawn_after(state: torch.Tensor, outputs: int) -> torch.Tensor:
    generator = torch.Generator()
    generator.set_state(state)
    torch.empty(outputs, dtype=torch.float32).uniform_(generator=generator)
    return generator.get_state()


@pytest.mark.parametrize("before", [0, 1, 5, 623, 624, 625, 624 * 3 + 100])
@pytest.mark.parametrize("outputs", [1, 2, 618, 619, 620, 623, 624, 625, 624 * 7, 624 * 7 + 1, 1_000_003, 37_000_017])
def test_a_jump_is_the_state_drawing_gives(before, outputs):
    generator = torch.Generator()
    generator.manual_seed(before * 7919 + outputs)
    if before:
        torch.empty(before, dtype=torch.float32).uniform_(generator=generator)
    start = generator.get_state()
    assert mt_jump.advance(generator, outputs)
    assert torch.equal(generator.get_state(), _drawn_after(start, outputs))
    # and the draws after it are the same
    other = torch.Generator()
    other.set_state(_drawn_after(start, outputs))
    assert torch.randint(0, 2 ** 31, (5,), generator=generator).tolist() == \
        torch.randint(0, 2 ** 31, (5,), generator=other).tolist()


def test_a_jump_keeps_the_cached_normal_samples():
    generator = torch.Generator()
    generator.manual_seed(3)
    torch.empty(3, dtype=torch.float64).normal_(generator=generator)     # leaves a double sample cached
    torch.empty(1, dtype=torch.float32).normal_(generator=generator)
    start = generator.get_state()
    assert mt_jump.advance(generator, 5_000_011)
    assert torch.equal(generator.get_state(), _drawn_after(start, 5_000_011))


def _training_then_seed() -> list:
    """A model's initialisation, a training loop's dropout masks (past the jump's threshold), then
    what a DataLoader draws for its base seed and a shuffle."""
    torch.manual_seed(11)
    torch.nn.Linear(64, 64)
    for _ in range(6):
        F.dropout(torch.empty(1_500_000), 0.1)                 # 3,000,000 outputs each
        torch.randn(1000, 1000)
    seed = torch.empty((), dtype=torch.int64).random_().item()
    return [seed, torch.randperm(10).tolist()]


def test_shape_only_dropout_past_the_follow_limit_is_jumped_over(monkeypatch):
    # the drawn outputs alone (24,000,000+) pass the lowered limit; jumped counts cost the threshold
    monkeypatch.setattr(shape_random, "FOLLOW_LIMIT", 10_000_000)
    shape = simcomm.World(2, tensors="shape").run(lambda comm: _training_then_seed())
    with torch.random.fork_rng():
        expected = _training_then_seed()
    assert shape == [expected, expected]


def test_where_a_jump_declines_the_outputs_are_drawn(monkeypatch):
    from collections import OrderedDict

    calls = []
    monkeypatch.setattr(shape_random, "_WORKED_OUT", OrderedDict())    # not worked out by another test
    monkeypatch.setattr(mt_jump, "advance", lambda generator, outputs: calls.append(outputs) or False)
    shape = simcomm.World(1, tensors="shape").run(lambda comm: _training_then_seed())
    with torch.random.fork_rng():
        expected = _training_then_seed()
    assert shape == [expected]          # a jump that declines: drawn for real, the same values
    assert calls and min(calls) >= mt_jump.JUMP_FROM
