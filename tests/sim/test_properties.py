"""Property tests: random shapes, dims and world sizes, every op against the reference."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import simcomm

from ..harness import make_inputs, run_both

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def case(draw, op):
    world_size = draw(st.integers(1, 5))
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(-ndim, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    if op in ("reduce_scatter", "slice"):
        shape[dim] *= world_size
    return world_size, tuple(shape), dim, draw(st.integers(0, 2 ** 16))


def check(op, world_size, shape, dim, seed, **kw):
    inputs = make_inputs(world_size, shape, seed=seed)
    (_, _), (ref_outs, _) = run_both(op, inputs, None, dim=dim, **kw)
    grads = make_inputs(world_size, ref_outs[0].shape, seed=seed + 1)
    (outs, in_grads), (ref_outs, ref_grads) = run_both(op, inputs, grads, dim=dim, **kw)
    for got, want in zip(outs + in_grads, ref_outs + ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@SETTINGS
@given(case("all_gather"))
def test_all_gather_any_shape(args):
    check("all_gather", *args)


@SETTINGS
@given(case("reduce_scatter"), st.sampled_from(["sum", "avg", "max", "min", "product"]))
def test_reduce_scatter_any_shape(args, reduce):
    check("reduce_scatter", *args, reduce=reduce)


@SETTINGS
@given(case("slice"))
def test_slice_any_shape(args):
    check("slice", *args)


@SETTINGS
@given(case("all_gather"), st.sampled_from(["sum", "avg", "max", "min", "product"]))
def test_all_reduce_any_shape(args, reduce):
    check("all_reduce", *args, reduce=reduce)   # dim is drawn but all_reduce has none


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2 ** 16))
def test_all_to_all_matches_the_list_math_and_its_swap_is_the_inverse(world_size, a, b, seed):
    shards = make_inputs(world_size, (a * world_size, b * world_size, 2), seed=seed)

    def program(comm):
        moved = comm.all_to_all(shards[comm.rank], scatter_dim=0, gather_dim=1)
        return moved, comm.all_to_all(moved, scatter_dim=1, gather_dim=0)

    outs = simcomm.World(world_size).run(program)
    expected = simcomm.collectives.all_to_all(shards, 0, 1)
    for (moved, back), want, original in zip(outs, expected, shards):
        assert torch.equal(moved, want)
        assert torch.equal(back, original)


@SETTINGS
@given(st.integers(1, 5), st.integers(0, 2 ** 16), st.integers(1, 3))
def test_uneven_all_to_all_single_any_splits(world_size, seed, width):
    gen = torch.Generator().manual_seed(seed)
    input_splits = torch.randint(0, 3, (world_size, world_size), generator=gen).tolist()
    output_splits = [[input_splits[i][j] for i in range(world_size)] for j in range(world_size)]
    inputs = [torch.randn(sum(input_splits[r]), width, generator=gen, dtype=torch.float64)
              for r in range(world_size)]
    (_, _), (ref_outs, _) = run_both("all_to_all_single", inputs, None, output_split_sizes=output_splits,
                                     input_split_sizes=input_splits)
    grads = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in ref_outs]
    (outs, in_grads), (ref_outs, ref_grads) = run_both(
        "all_to_all_single", inputs, grads, output_split_sizes=output_splits, input_split_sizes=input_splits)
    for got, want in zip(outs + in_grads, ref_outs + ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@SETTINGS
@given(case("reduce_scatter"), st.sampled_from(["sum", "avg", "max", "min", "product"]))
def test_reduce_and_scatter_any_shape(args, reduce):
    world_size, shape, dim, seed = args
    root = seed % world_size
    check("reduce", world_size, shape, dim, seed, dst=root, reduce=reduce)
    check("scatter", world_size, shape, dim, seed, src=root)
