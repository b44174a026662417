"""ReduceOp.BAND, BOR and BXOR on virtual ranks, as gloo reduces them.

The oracle is the same fold done on one device: ``bitwise_and`` / ``or`` / ``xor`` of
every rank's tensor in int64 (or bool), compared exactly. Floating-point tensors are
refused with a RuntimeError, as gloo refuses them ("Cannot use ReduceOp.BAND with
non-integral dtype").
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import simcomm
from simcomm import RankError, collectives

WORLD = 4
OPS = {"band": (dist.ReduceOp.BAND, torch.bitwise_and),
       "bor": (dist.ReduceOp.BOR, torch.bitwise_or),
       "bxor": (dist.ReduceOp.BXOR, torch.bitwise_xor)}


def _rank_input(rank: int, dtype: torch.dtype = torch.int64, numel: int = 6) -> torch.Tensor:
    """Distinct bit patterns per rank and element (bools: a pattern with both values)."""
    values = (torch.arange(numel) * 7 + rank * 5 + 3) % 16
    return values % 2 == 1 if dtype == torch.bool else values.to(dtype)


def _expected(name: str, dtype: torch.dtype = torch.int64, numel: int = 6) -> torch.Tensor:
    fold = OPS[name][1]
    return functools.reduce(fold, [_rank_input(r, dtype, numel) for r in range(WORLD)])


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_all_reduce_bitwise_matches_the_one_device_fold(name, dtype):
    op = OPS[name][0]

    def program(comm):
        t = _rank_input(comm.rank, dtype)
        dist.all_reduce(t, op=op)
        return t

    expected = _expected(name, dtype)
    assert not torch.equal(expected, _rank_input(0, dtype))      # the fold changes something
    for out in simcomm.World(WORLD).run(program):
        assert out.dtype == dtype and torch.equal(out, expected)


def test_a_large_tensor_takes_the_same_path_exactly():
    numel = 100_000      # past the size where sums fold in place

    def program(comm):
        t = _rank_input(comm.rank, torch.int64, numel)
        dist.all_reduce(t, op=dist.ReduceOp.BXOR)
        return t

    expected = _expected("bxor", torch.int64, numel)
    assert all(torch.equal(out, expected) for out in simcomm.World(WORLD).run(program))


def test_reduce_scatter_reduce_and_functional_all_reduce_take_bitwise_ops():
    def program(comm):
        r = comm.rank
        rows = torch.stack([_rank_input(r) + 16 * j for j in range(WORLD)])   # (WORLD, 6)
        out = torch.empty(1, 6, dtype=torch.int64)
        dist.reduce_scatter_tensor(out, rows, op=dist.ReduceOp.BOR)
        to_root = _rank_input(r)
        dist.reduce(to_root, dst=2, op=dist.ReduceOp.BAND)
        functional = funcol.all_reduce(_rank_input(r), "bxor", dist.group.WORLD)
        return out[0], to_root, functional

    outs = simcomm.World(WORLD).run(program)
    for rank, (scattered, to_root, functional) in enumerate(outs):
        rows = functools.reduce(torch.bitwise_or, [_rank_input(r) + 16 * rank for r in range(WORLD)])
        assert torch.equal(scattered, rows)
        assert torch.equal(functional, _expected("bxor"))
        if rank == 2:
            assert torch.equal(to_root, _expected("band"))


def test_the_collectives_module_folds_bitwise_ops_too():
    inputs = [_rank_input(r) for r in range(WORLD)]
    for name in OPS:
        assert torch.equal(collectives.reduce(inputs, name), _expected(name))
        assert torch.equal(collectives.reduce(inputs, OPS[name][0]), _expected(name))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_floating_point_tensor_is_refused_as_gloo_refuses_it(dtype):
    def program(comm):
        dist.all_reduce(torch.ones(3, dtype=dtype), op=dist.ReduceOp.BOR)

    with pytest.raises(RankError) as info:
        simcomm.World(2).run(program)
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError)
    text = str(cause)
    assert "all_reduce" in text and "rank 0" in text and "BOR" in text and str(dtype) in text
    with pytest.raises(RuntimeError, match="non-integral dtype"):
        collectives.reduce([torch.ones(2), torch.ones(2)], "band")
