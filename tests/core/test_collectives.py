"""The list-in/list-out math of simcomm.collectives against the independent reference."""
from __future__ import annotations

import pytest
import torch

from simcomm import ReduceOp, checks, collectives

from .. import reference as ref
from ..harness import make_inputs


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
    assert checks.reduce_op_name(ReduceOp.MAX) == "max"
    assert checks.reduce_op_name("PROD") == "product"
    assert checks.to_reduce_op("avg") == ReduceOp.AVG
    with pytest.raises(ValueError, match="unsupported reduce op"):
        checks.reduce_op_name("median")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_list_math_matches_reference(world_size):
    inputs = make_inputs(world_size, (2 * world_size, 3 * world_size))
    for got, want in [
        (collectives.all_reduce(inputs, "max"), ref.all_reduce(inputs, "max")),
        (collectives.all_gather(inputs, 1), ref.all_gather(inputs, 1)),
        (collectives.scatter(inputs[0], world_size, 1), ref.slice_(inputs[0], world_size, 1)),
        (collectives.broadcast(inputs, world_size - 1), ref.broadcast(inputs, world_size - 1)),
        (collectives.gather(inputs, 0, 0), ref.gather(inputs, 0, 0)),
    ]:
        for g, w in zip(got, want):
            assert (g is None and w is None) or torch.equal(g, w)
    # sums in gloo's ring order, the reference's in its own: equal up to rounding
    for g, w in zip(collectives.reduce_scatter(inputs, 0), ref.reduce_scatter(inputs, 0), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    shards = make_inputs(world_size, (1, 2, 2 * world_size, 3))
    for g, w in zip(collectives.all_to_all(shards, 2, 1), ref.all_to_all_4d(shards, 2, 1)):
        assert torch.equal(g, w)


def test_mismatched_shapes_are_named():
    with pytest.raises(ValueError, match=r"rank 1 has torch.float32 \(3,\) but rank 0 has torch.float32 \(2,\)"):
        collectives.all_gather([torch.ones(2), torch.ones(3)])


INT_DTYPES = [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def _wrapped(value: int, dtype: torch.dtype) -> int:
    """``value`` as a fixed-width integer of ``dtype`` holds it (two's complement), or as a bool."""
    if dtype == torch.bool:
        return int(value != 0)
    bits = torch.iinfo(dtype).bits
    value %= 1 << bits
    return value - (1 << bits) if torch.iinfo(dtype).min < 0 and value >= 1 << (bits - 1) else value


@pytest.mark.parametrize("dtype", INT_DTYPES)
@pytest.mark.parametrize("op", ["sum", "product", "max", "min"])
@pytest.mark.parametrize("numel", [5, 70_001])   # below and above the in-place accumulation size
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_integer_reductions_keep_the_dtype_and_wrap(dtype, op, numel, world_size):
    gen = torch.Generator().manual_seed(numel + world_size)
    if dtype == torch.bool:
        inputs = [torch.randint(0, 2, (numel,), generator=gen).bool() for _ in range(world_size)]
    else:
        low, high = (0, 250) if dtype == torch.uint8 else (-120, 120)
        inputs = [torch.randint(low, high, (numel,), generator=gen).to(dtype) for _ in range(world_size)]
        inputs[0][0] = 100 if dtype != torch.uint8 else 200         # int8: 100 + 100 wraps
        if world_size > 1:
            inputs[1][0] = 100 if dtype != torch.uint8 else 200
    out = collectives.reduce(inputs, op)
    assert out.dtype == dtype and out.shape == (numel,)
    python_values = [t[:5].tolist() for t in inputs]
    combine = {"sum": sum, "product": lambda xs: __import__("math").prod(xs), "max": max, "min": min}[op]
    expected = [_wrapped(int(combine([int(v[i]) for v in python_values])), dtype) for i in range(5)]
    assert [int(v) for v in out[:5].tolist()] == expected
    if dtype == torch.int8 and op == "sum" and world_size == 2:
        assert out[0].item() == -56


def test_avg_of_integers_is_refused_at_every_world_size():
    for world_size in (1, 2, 3):
        with pytest.raises(ValueError, match=r"reduce: ReduceOp.AVG needs a floating-point dtype, got torch.int32"):
            collectives.reduce([torch.ones(2, dtype=torch.int32)] * world_size, "avg")


def test_zero_size_shards_and_no_output_aliases_an_input():
    for world_size in (1, 2, 3):
        empty = [torch.ones(0, 3)] * world_size
        assert all(out.shape == (0, 3) for out in collectives.reduce_scatter(empty, 0))
        assert all(out.shape == (0, 3 * world_size) for out in collectives.all_to_all(empty, 0, 1))
        assert all(out.shape == (0, 3) for out in collectives.scatter(torch.ones(0, 3), world_size, 0))
        source = torch.arange(4.0 * world_size)
        for out in (*collectives.scatter(source, world_size, 0), *collectives.scatter_from([source] * world_size)):
            assert out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()


def test_new_list_math_matches_reference():
    inputs = make_inputs(3, (3, 6))
    for got, want in [(collectives.reduce_to(inputs, 1, "max"), ref.reduce(inputs, 1, "max")),
                      (collectives.scatter_from(inputs, 2, 1), ref.scatter(inputs, 2, 1))]:
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
    input_splits = [[1, 0, 2], [0, 0, 3], [2, 1, 0]]
    output_splits = [[1, 0, 2], [0, 0, 1], [2, 3, 0]]
    xs = [torch.arange(3.0) + 10 * r for r in range(3)]
    for g, w in zip(collectives.all_to_all_single(xs, output_splits, input_splits),
                    ref.all_to_all_single(xs, output_splits, input_splits), strict=True):
        assert torch.equal(g, w)
    with pytest.raises(ValueError, match=r"rank 0 sends 0 rows to rank 1 \(input_split_sizes=\[1, 0, 2\] on rank 0\) "
                                         r"but rank 1 expects 1 from rank 0"):
        collectives.all_to_all_single(xs, [[1, 0, 2], [1, 0, 0], [2, 3, 0]], input_splits)
