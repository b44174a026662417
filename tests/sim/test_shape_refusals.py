"""Shape-only ranks refuse what needs values with a ShapeOnlyError that says why and what to do."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import simcomm
from simcomm import RankError
from simcomm.errors import ShapeOnlyError


def _refusal(program) -> ShapeOnlyError:
    with pytest.raises(RankError) as error:
        simcomm.World(2, tensors="shape").run(program)
    cause = error.value.__cause__
    assert isinstance(cause, ShapeOnlyError), repr(cause)
    return cause


def test_numpy_on_a_shape_only_rank_is_a_shape_only_error():
    def program(comm):
        return torch.ones(2).numpy() if comm.rank == 1 else None

    text = str(_refusal(program))
    assert "rank 1" in text and ".numpy()" in text and "tensors='real'" in text, text


def test_numpy_works_real_valued():
    assert simcomm.World(2).run(lambda comm: torch.ones(2).numpy().sum())[0] == 2.0


def test_ddp_options_not_simulated_on_a_shape_only_rank_say_why():
    def program(comm):
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(nn.Linear(4, 4), find_unused_parameters=True)
        model(torch.ones(2, 4)).sum().backward()
        return None

    text = str(_refusal(program))
    assert "rank 0" in text and "DistributedDataParallel" in text and "tensors='real'" in text, text
    assert "find_unused_parameters=True" in text, text
    simcomm.World(2).run(program)    # the same program runs with values
