"""The list-in/list-out math of simcomm.collectives against the independent reference."""
from __future__ import annotations

import pytest
import torch

from simcomm import ReduceOp, collectives

from . import reference as ref
from .harness import make_inputs


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product"])
@pytest.mark.parametrize("numel", [7, 300_001])   # small: stacked; large: accumulated in place
def test_reduce_matches_reference(op, numel):
    inputs = make_inputs(3, (numel,), seed=numel)
    torch.testing.assert_close(collectives.reduce(inputs, op), ref.all_reduce(inputs, op)[0],
                               rtol=1e-12, atol=1e-12)


def test_large_integer_sum_is_exact_and_avg_of_integers_is_refused():
    inputs = [torch.arange(300_000) * (rank + 1) for rank in range(4)]
    assert torch.equal(collectives.reduce(inputs, "sum"), torch.arange(300_000) * 10)
    with pytest.raises(ValueError, match="AVG needs a floating-point dtype"):
        collectives.reduce(inputs, "avg")


def test_reduce_op_names():
    assert collectives.reduce_op_name(ReduceOp.MAX) == "max"
    assert collectives.reduce_op_name("PROD") == "product"
    assert collectives.to_reduce_op("avg") == ReduceOp.AVG
    with pytest.raises(ValueError, match="unsupported reduce op"):
        collectives.reduce_op_name("median")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_list_math_matches_reference(world_size):
    inputs = make_inputs(world_size, (2 * world_size, 3 * world_size))
    for got, want in [
        (collectives.all_reduce(inputs, "max"), ref.all_reduce(inputs, "max")),
        (collectives.all_gather(inputs, 1), ref.all_gather(inputs, 1)),
        (collectives.reduce_scatter(inputs, 0), ref.reduce_scatter(inputs, 0)),
        (collectives.scatter(inputs[0], world_size, 1), ref.slice_(inputs[0], world_size, 1)),
        (collectives.broadcast(inputs, world_size - 1), ref.broadcast(inputs, world_size - 1)),
        (collectives.gather(inputs, 0, 0), ref.gather(inputs, 0, 0)),
    ]:
        for g, w in zip(got, want):
            assert (g is None and w is None) or torch.equal(g, w)
    shards = make_inputs(world_size, (1, 2, 2 * world_size, 3))
    for g, w in zip(collectives.all_to_all(shards, 2, 1), ref.all_to_all_4d(shards, 2, 1)):
        assert torch.equal(g, w)


def test_mismatched_shapes_are_named():
    with pytest.raises(ValueError, match=r"rank 1 has torch.float32 \(3,\) but rank 0 has torch.float32 \(2,\)"):
        collectives.all_gather([torch.ones(2), torch.ones(3)])
