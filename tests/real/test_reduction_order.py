"""Floating-point reductions on virtual ranks equal gloo's, bit for bit.

A float sum rounds at every step, so its value depends on the order of the ranks' terms; gloo adds
them in the order of its ring (:mod:`simcomm.sim.ring_order`). One program runs on gloo workers
(``real``) and on virtual ranks (``simcomm.World``), and every result must be ``torch.equal``:
``dist.all_reduce`` (SUM, PRODUCT), ``dist.reduce`` to every rank, ``dist.reduce_scatter_tensor``
and ``dist.reduce_scatter``'s list form, each on gloo's own process group (gloo itself) and on the
default group (``real``'s c10d translation); and the communicator's AVG and PREMUL_SUM (a sum
then a division, a premultiplication then a sum). World sizes 2 to 5; sizes from one element to
past gloo's 1 MiB segments, none divisible by the world size.

The data are random values of one magnitude, for which the orders differ on many elements: the
test checks that, so that a simulator adding in another order would fail it.
"""
from __future__ import annotations

import zlib
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import simcomm
from simcomm.sim import ring_order

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(600)]

_OPS = {"sum": ReduceOp.SUM, "product": ReduceOp.PRODUCT, "avg": ReduceOp.AVG}
_FACTORS = (0.75, -1.5, 3.0, 0.1, -2.25)           # PREMUL_SUM: rank r's own factor
PAST_SEGMENTS = 3_000_001                           # float32 elements: 12 MB, over 2 * world MiB up to 5 ranks


class Case(NamedTuple):
    """One call: ``kind`` (below), the reduction, the dtype, the number of elements per rank;
    ``via``, for a ``dist.*`` call, ``"gloo"`` (the backend's own group) or ``"c10d"`` (the default
    group; on virtual ranks both are the simulator's)."""

    kind: str
    op: str
    dtype: torch.dtype
    numel: int
    via: str = "gloo"

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.op}-{str(self.dtype).removeprefix('torch.')}-{self.numel}-{self.via}"


def _cases(world_size: int) -> list[Case]:
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        for numel in (1, 7, 1001):
            for via in ("gloo", "c10d"):
                cases += [Case("all_reduce", "sum", dtype, numel, via),
                          Case("all_reduce", "product", dtype, numel, via), Case("reduce", "sum", dtype, numel, via)]
            cases += [Case("comm_all_reduce", "avg", dtype, numel), Case("comm_reduce", "avg", dtype, numel)]
        for rows in (1, 7, 334):            # rows per rank: P * rows rows of 3
            numel = world_size * rows * 3
            for via in ("gloo", "c10d"):
                cases += [Case("reduce_scatter_tensor", "sum", dtype, numel, via),
                          Case("reduce_scatter_tensor", "product", dtype, numel, via),
                          Case("reduce_scatter_list", "sum", dtype, numel, via),
                          Case("reduce_scatter_list", "avg", dtype, numel, via)]
            cases += [Case("comm_reduce_scatter", "avg", dtype, numel)]
    cases += [Case("all_reduce", "sum", torch.float64, 1001), Case("all_reduce", "sum", torch.complex64, 1001),
              Case("reduce", "sum", torch.complex64, 1001), Case("comm_all_reduce", "premul_sum", torch.float32, 1001),
              Case("all_reduce", "sum", torch.float32, 65_537),              # chunks summed one at a time
              # past gloo's 1 MiB segments: all-reduce and reduce cut the buffer differently
              Case("all_reduce", "sum", torch.float32, PAST_SEGMENTS),
              Case("reduce", "sum", torch.float32, PAST_SEGMENTS),
              Case("all_reduce", "sum", torch.bfloat16, 2 * PAST_SEGMENTS),
              Case("reduce_scatter_tensor", "sum", torch.float32, 3 * world_size * (PAST_SEGMENTS // (3 * world_size)))]
    return cases


def _input(case: Case, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor for ``case``: standard normal (1 + N/8 for a product), in its dtype."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()) + rank)   # the same in every process
    if case.dtype.is_complex:
        pairs = torch.randn(case.numel, 2, generator=gen, dtype=torch.float64)
        return torch.view_as_complex(pairs).to(case.dtype)
    values = torch.randn(case.numel, generator=gen, dtype=torch.float64)
    return (1 + values / 8 if case.op == "product" else values).to(case.dtype)


def _large(case: Case) -> bool:
    return case.numel >= PAST_SEGMENTS


def _gloo_group(comm) -> dist.ProcessGroup | None:
    """On a gloo worker, gloo's own process group: ``dist.*`` on it reaches gloo without ``real``'s
    translation (:mod:`real.checked_pg`); None on virtual ranks (the default group serves)."""
    from real.transport import DistTransport

    transport = getattr(comm.transport, "inner", comm.transport)      # a checked transport wraps it
    return transport.group if isinstance(transport, DistTransport) else None


def _run(comm, case: Case):
    """``case`` on this rank; what this rank holds afterwards (None where it holds nothing to compare)."""
    rank, world_size = comm.rank, comm.world_size
    group = _gloo_group(comm) if case.via == "gloo" else None
    x = _input(case, rank)
    if case.kind == "all_reduce":
        dist.all_reduce(x, op=_OPS[case.op], group=group)
        return x if rank == 0 or not _large(case) else None       # a large result comes back once
    if case.kind == "reduce":
        dsts = [world_size - 1] if _large(case) else range(world_size)
        held = []
        for dst in dsts:
            y = x.clone()
            dist.reduce(y, dst=dst, op=_OPS[case.op], group=group)
            held.append(y if rank == dst else None)
        return held
    if case.kind == "reduce_scatter_tensor":
        rows = x.view(-1, 3)                                        # (P * rows, 3)
        out = rows.new_empty(rows.shape[0] // world_size, 3)
        reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        reduce_scatter_single(out, rows, op=_OPS[case.op], group=group)
        return out
    if case.kind == "reduce_scatter_list":
        entries = list(x.view(-1, 3).chunk(world_size))            # P x (rows, 3)
        out = torch.empty_like(entries[0])
        dist.reduce_scatter(out, entries, op=_OPS[case.op], group=group)
        return out
    if case.kind == "comm_all_reduce":
        if case.op == "premul_sum":
            return comm.all_reduce(x, op=ReduceOp.PREMUL_SUM(_FACTORS[rank]))
        return comm.all_reduce(x, op=case.op)
    if case.kind == "comm_reduce":
        return comm.reduce(x, dst=world_size - 1, op=case.op)
    if case.kind == "comm_reduce_scatter":
        return comm.reduce_scatter(x.view(-1, 3).T, dim=1, op=case.op)   # (3, P * rows): dim 1 is scattered
    raise ValueError(f"unknown case kind {case.kind!r}")


def every_case(comm, cases: list[Case]) -> dict[str, object]:
    """The program both backends run: every case, one after the other, on this rank."""
    return {case.name: _run(comm, case) for case in cases}


def _flatten(value) -> list:
    return [t for item in value for t in _flatten(item)] if isinstance(value, list) else [value]


@pytest.mark.parametrize("world_size", [2, 3, 4, 5])
def test_virtual_ranks_reduce_floats_bit_for_bit_as_gloo(gloo_cluster, world_size):
    cases = _cases(world_size)
    real_results = gloo_cluster(world_size).run(every_case, cases)
    sim_results = simcomm.World(world_size).run(every_case, cases)
    compared = 0
    for rank in range(world_size):
        for case in cases:
            got, want = _flatten(real_results[rank][case.name]), _flatten(sim_results[rank][case.name])
            assert len(got) == len(want), (case.name, rank)
            for real_value, sim_value in zip(got, want):
                assert (real_value is None) == (sim_value is None), (case.name, rank)
                if real_value is not None:
                    assert real_value.dtype == sim_value.dtype and real_value.shape == sim_value.shape
                    differ = (real_value != sim_value).sum().item()
                    assert torch.equal(real_value, sim_value), f"{case.name} on rank {rank}: {differ} elements differ"
                    compared += 1
    assert compared > 30 * world_size


@pytest.mark.parametrize("world_size", [3, 4, 5])
def test_the_data_tells_the_orders_apart(world_size):
    """On these inputs another order gives other bits on many elements: the ranks' own order
    (0, 1, 2, ...) on 1001 elements, and past the 1 MiB segments, gloo's reduce chunks instead of
    its all-reduce chunks. So the comparison above would catch a simulator that adds otherwise."""
    for dtype in (torch.float32, torch.bfloat16):
        case = Case("all_reduce", "sum", dtype, 1001)
        inputs = [_input(case, rank) for rank in range(world_size)]
        ring = ring_order.reduce(inputs, "sum")
        in_rank_order = inputs[0]
        for x in inputs[1:]:
            in_rank_order = in_rank_order + x
        assert (ring != in_rank_order).sum() > 100, dtype            # a tenth of the elements, or more
    case = Case("all_reduce", "sum", torch.float32, PAST_SEGMENTS)
    inputs = [_input(case, rank) for rank in range(world_size)]
    by_all_reduce = ring_order.reduce(inputs, "sum", order="all_reduce")
    by_reduce = ring_order.reduce(inputs, "sum", order="reduce")
    assert (by_all_reduce != by_reduce).sum() > 10_000
