"""Random bookkeeping on shape-only ranks: a shuffle's or a split's indices drawn from a generator
whose state is known (seeded by the program, or the rank's default generator before any random op
without a followed consumption drew from it) have values, the same as the same computation without
simcomm; a draw from a generator whose state is unknown still stops with the named error (draws
without values whose consumption is followed: tests/sim/test_shape_generator_state.py)."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, RandomSampler, random_split

import simcomm
from simcomm.errors import RankError, ShapeOnlyError

N = 1_000_000          # a dataset's length: a million indices drawn and read with .tolist()


def _bookkeeping(rank: int) -> dict:
    """What a training script computes before its model: seeded, split, shuffled, sampled."""
    torch.manual_seed(10 + rank)
    g = torch.Generator().manual_seed(7 + rank)
    out = {"perm": torch.randperm(N, generator=g).tolist()}
    train, test = random_split(range(N), [N - 1000, 1000])            # the default generator
    out["split"] = (list(train.indices), list(test.indices))
    out["randint"] = torch.randint(0, 50_000, (8,), generator=g).tolist()
    out["sampler"] = list(RandomSampler(range(1000)))                 # seeds itself from the default
    sampler = DistributedSampler(range(5000), num_replicas=2, rank=rank, seed=3)
    sampler.set_epoch(1)
    out["distributed"] = list(sampler)
    out["reseeded"] = None
    return out


def test_seeded_index_draws_on_shape_only_ranks_equal_the_same_computation_without_simcomm():
    def program(comm):
        out = _bookkeeping(comm.rank)
        torch.multinomial(torch.ones(8), 3)   # a draw that leaves the default generator unknown
        torch.manual_seed(99)                 # a new state: known again
        out["reseeded"] = torch.randperm(6).tolist()
        return out

    shape = simcomm.World(2, tensors="shape").run(program)
    with torch.random.fork_rng():
        for rank in range(2):
            expected = _bookkeeping(rank)
            torch.multinomial(torch.ones(8), 3)
            torch.manual_seed(99)
            expected["reseeded"] = torch.randperm(6).tolist()
            assert shape[rank] == expected
    assert shape[0]["perm"] != shape[1]["perm"]


def test_a_draw_after_a_fake_initialisation_has_the_values_torch_draws_after_it():
    def program(comm=None):
        torch.manual_seed(0)
        torch.nn.Linear(8, 8)                 # fake parameters: their draws are followed (shape_random)
        return torch.randperm(10).tolist()

    shape = simcomm.World(2, tensors="shape").run(program)
    with torch.random.fork_rng():
        assert shape == [program(), program()]


def test_a_large_draw_a_draw_into_a_parameter_and_a_draw_after_an_unfollowed_draw_have_no_values():
    def program(comm, what):
        g = torch.Generator().manual_seed(1)
        if what == "after an unfollowed draw":
            torch.multinomial(torch.ones(4), 2, generator=g)   # takes what its values need: g unknown
            return torch.randint(0, 9, (3,), generator=g).tolist()
        if what == "large":
            return torch.randperm(simcomm.sim.shape.RANDOM_INDEX_LIMIT + 1, generator=g)[:3].tolist()
        weight = torch.nn.Parameter(torch.empty(4))
        with torch.no_grad():
            weight.uniform_(generator=g)      # model data: no value, even drawn from a known state
        return weight.tolist()

    for what in ("large", "parameter", "after an unfollowed draw"):
        _refused(program, 1, what)


def _refused(program, world_size: int, *args) -> None:
    with pytest.raises(RankError) as error:
        simcomm.World(world_size, tensors="shape").run(program, *args)
    assert isinstance(error.value.__cause__, ShapeOnlyError), repr(error.value.__cause__)
    assert "aten._local_scalar_dense" in str(error.value.__cause__)
