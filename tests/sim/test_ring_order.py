"""The simulator's reductions (simcomm.sim.ring_order): floating-point sums in gloo's ring order,
exact reductions equal to the reference's, meta tensors of shape-only ranks."""
from __future__ import annotations

import pytest
import torch

from simcomm import collectives
from simcomm.sim import ring_order


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int64, torch.bool, torch.float32])
@pytest.mark.parametrize("op", ["sum", "product", "max", "min"])
@pytest.mark.parametrize("numel", [5, 70_001])   # below and above the in-place accumulation size
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_exact_reductions_equal_the_references_bit_for_bit(dtype, op, numel, world_size):
    """Integers and bools, MAX and MIN, are exact in any order: stacked (the reference) or
    accumulated in place (the simulator's large ones) give the same bits, wrapping alike."""
    if dtype == torch.float32 and op in ("sum", "product"):
        return
    gen = torch.Generator().manual_seed(numel + world_size)
    inputs = [torch.randint(-120, 120, (numel,), generator=gen).to(dtype) for _ in range(world_size)]
    want = collectives.reduce(inputs, op)
    for got in (ring_order.reduce(inputs, op), ring_order.all_reduce(inputs, op)[0],
                ring_order.reduce_to(inputs, 0, op)[0]):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_premul_sum_reaches_the_ring_premultiplied_and_orders_are_named():
    with pytest.raises(ValueError, match="PREMUL_SUM reaches gloo's order premultiplied"):
        ring_order.reduce([torch.ones(2)] * 3, "premul_sum")
    with pytest.raises(ValueError, match=r"order='tree' is not one of \('all_reduce', 'reduce'\)"):
        ring_order.reduce([torch.ones(2)] * 3, "sum", order="tree")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "product"])
@pytest.mark.parametrize("shape", [(3, 5), (300, 300)])       # the stacked and the accumulated path
def test_a_reduction_of_meta_tensors_has_the_metadata_of_the_real_one(dtype, op, shape):
    """Shape-only ranks reduce meta tensors, and from three ranks on only two of them (alike
    tensors reduce to the same metadata whatever their number): the result's shape, strides and
    dtype are those of the real reduction of all five; meta tensors that differ are all read."""
    if op == "avg" and not dtype.is_floating_point:
        return
    inputs = [torch.ones(shape[::-1], dtype=dtype).T for _ in range(5)]      # strided, not contiguous
    want = ring_order.reduce(inputs, op)
    got = ring_order.reduce([torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")
                              for t in inputs], op)
    assert (got.shape, got.stride(), got.dtype, got.device.type) == (want.shape, want.stride(), want.dtype, "meta")
    unlike = [torch.empty(shape, dtype=dtype, device="meta")] * 4 + [torch.empty(shape[0] + 1, shape[1], device="meta")]
    with pytest.raises((RuntimeError, ValueError)):       # torch's, or simcomm's check of the shapes
        ring_order.reduce(unlike, op)


# -- the order of floating-point reductions: gloo's ring -------------------------------------------
#
# gloo's ring cuts the flat buffer into one chunk per rank; chunk c leaves rank c - 1 and every rank
# down the ring adds its part: ((x[c-1] + x[c-2]) + ...) + x[c]. Below 2 * world MiB a chunk is
# 2 * ceil(numel / (2 * world)) elements long (two segments); past it, gloo/allreduce.cc and
# gloo/reduce.cc size their 1 MiB segments differently (the lengths below are worked out by hand).

def _ring_orders(values: torch.Tensor, op: str = "sum") -> list[torch.Tensor]:
    """``values``: ``(world, ...)``, one entry per rank; entry ``c`` of the result combines them as
    the ring combines chunk ``c``, in ``values``' dtype, one rounding per step."""
    world = values.shape[0]
    results = []
    for owner in range(world):
        ranks = [(owner - 1 - step) % world for step in range(world)]
        acc = values[ranks[0]]
        for rank in ranks[1:]:
            acc = acc * values[rank] if op == "product" else acc + values[rank]
        results.append(acc)
    return results


def _telltale(world: int, dtype: torch.dtype) -> torch.Tensor:
    """One value per rank for which the ``world`` orders of the ring give ``world`` different sums:
    1, -1 and multiples of eps/8, so which order made an element can be read off its value."""
    gen = torch.Generator().manual_seed(world)
    eps = torch.finfo(dtype).eps
    for _ in range(100):
        ones = (torch.randint(0, 2, (world,), generator=gen) * 2 - 1).to(torch.float64)
        small = torch.randint(1, 8, (world,), generator=gen).to(torch.float64) * eps / 8
        values = torch.where(torch.randint(0, 3, (world,), generator=gen) == 0, ones, small).to(dtype)
        if len({float(v) for v in _ring_orders(values)}) == world:
            return values
    raise AssertionError(f"no telltale values for world {world}, {dtype}")


def _short_chunk(numel: int, world_size: int) -> int:
    """A chunk's length below 2 * world MiB: two segments of ``ceil(numel / (2 * world))``."""
    return 2 * -(-numel // (2 * world_size))


def _expected(telltale: torch.Tensor, numel: int, chunk: int, op: str = "sum") -> torch.Tensor:
    """What the ring gives element ``i`` when every rank's tensor is its telltale value throughout:
    the order of chunk ``i // chunk``."""
    by_owner = torch.stack(_ring_orders(telltale, op))          # (world,)
    owners = torch.arange(numel) // chunk
    return by_owner[owners]


@pytest.mark.parametrize("world_size", [3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("numel", [1, 2, 7, 30, 1001])
def test_every_element_is_summed_in_the_order_of_its_ring_chunk(world_size, dtype, numel):
    telltale = _telltale(world_size, dtype)
    inputs = [torch.full((numel,), float(value), dtype=dtype) for value in telltale]
    chunk = _short_chunk(numel, world_size)
    expected = _expected(telltale, numel, chunk)
    assert len(set(expected.tolist())) == min(world_size, -(-numel // chunk))   # one value per chunk
    for got in ring_order.all_reduce(inputs, "sum"):
        assert torch.equal(got, expected)
    assert torch.equal(ring_order.reduce_to(inputs, world_size - 1, "sum")[world_size - 1], expected)
    assert torch.equal(ring_order.reduce(inputs, "avg"), expected / world_size)
    # complex: its real view is the buffer, real and imaginary parts in turn
    if dtype in (torch.float32, torch.float64):
        got = ring_order.all_reduce([torch.complex(t, t) for t in inputs], "sum")[0]
        assert torch.equal(torch.view_as_real(got).reshape(-1),
                           _expected(telltale, 2 * numel, _short_chunk(2 * numel, world_size)))


@pytest.mark.parametrize("world_size", [3, 5])
def test_reduce_scatter_sums_in_the_order_of_the_buffer_it_reduces(world_size):
    """The tensor with ``dim`` moved first, flat, is the buffer (gloo all-reduces it whole);
    ``separately``, each rank's chunk is a buffer of its own (c10d's list form on gloo)."""
    telltale = _telltale(world_size, torch.float32)
    rows = 7
    inputs = [torch.full((2, world_size * rows), float(value)) for value in telltale]   # scattered along dim 1
    numel = 2 * world_size * rows
    whole = _expected(telltale, numel, _short_chunk(numel, world_size))
    whole = whole.view(world_size * rows, 2).movedim(0, 1)      # (P*rows, 2) -> (2, P*rows): dim 1 first, flat
    for rank, got in enumerate(ring_order.reduce_scatter(inputs, 1, "sum")):
        assert torch.equal(got, whole[:, rank * rows:(rank + 1) * rows])
    alone = _expected(telltale, 2 * rows, _short_chunk(2 * rows, world_size))
    alone = alone.view(rows, 2).movedim(0, 1)                   # each chunk's own (rows, 2) buffer -> (2, rows)
    for got in ring_order.reduce_scatter(inputs, 1, "sum", separately=True):
        assert torch.equal(got, alone)


def test_chunk_lengths_past_gloos_1_mib_segments():
    """Worked by hand from gloo/allreduce.cc and gloo/reduce.cc (kMaxSegmentSize = 1 MiB)."""
    chunk = ring_order._ring_chunk
    assert chunk(10, 4, 3, "all_reduce") == chunk(10, 4, 3, "reduce") == 4            # 2 * ceil(10 / 6)
    # 2.2M float32 on 4 ranks (8.8 MB): all-reduce: 12 segments of ceil(2.2M / 12) = 183334, 3 per rank;
    # reduce: segments of min(ceil(2.2M / 8), 262144) = 262144, ceil(2.2M / 262144) = 9 -> 12, 3 per rank
    assert chunk(2_200_000, 4, 4, "all_reduce") == 3 * 183_334
    assert chunk(2_200_000, 4, 4, "reduce") == 3 * 262_144
    # 6,000,001 bfloat16 on 5 ranks: ceil(6000001 / 524288) = 12 -> 15 segments, 3 per rank
    assert chunk(6_000_001, 2, 5, "all_reduce") == 3 * 400_001
    assert chunk(6_000_001, 2, 5, "reduce") == 3 * 524_288


def test_a_large_buffer_is_summed_in_gloos_chunks_with_and_without_a_gradient():
    world_size, numel = 4, 2_200_000
    telltale = _telltale(world_size, torch.float32)
    inputs = [torch.full((numel,), float(value)) for value in telltale]
    expected = _expected(telltale, numel, 3 * 183_334)
    assert torch.equal(ring_order.all_reduce(inputs, "sum")[0], expected)
    assert torch.equal(ring_order.reduce_to(inputs, 0, "sum")[0], _expected(telltale, numel, 3 * 262_144))
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = ring_order.reduce(leaves, "avg")
    assert torch.equal(out.detach(), expected / world_size)
    out.backward(torch.ones(numel))
    assert all(torch.equal(leaf.grad, torch.full((numel,), 1 / world_size)) for leaf in leaves)


@pytest.mark.parametrize("world_size", [3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_follow_the_ring_and_random_data_tells_the_orders_apart(world_size, dtype):
    """Random values of one magnitude: the ring's order and the ranks' order differ on many
    elements (so a test comparing values can tell them apart), and the product is the ring's."""
    gen = torch.Generator().manual_seed(world_size)
    numel = 1001
    for op in ("sum", "product"):
        stacked = (torch.randn(world_size, numel, generator=gen, dtype=torch.float64) / 8 + 1).to(dtype)
        chunk = _short_chunk(numel, world_size)
        by_owner = torch.stack(_ring_orders(stacked, op))      # (owner, numel): every element in every order
        expected = by_owner[torch.arange(numel) // chunk, torch.arange(numel)]
        got = ring_order.reduce(list(stacked), op)
        assert torch.equal(got, expected)
        rank_order = stacked[0]
        for rank in range(1, world_size):
            rank_order = rank_order * stacked[rank] if op == "product" else rank_order + stacked[rank]
        assert (got != rank_order).sum() > numel // 20, (op, (got != rank_order).sum())


def test_gradcheck_through_the_ring_order():
    inputs = [torch.randn(11, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    for op in ("sum", "avg", "product"):
        assert torch.autograd.gradcheck(lambda *xs: ring_order.reduce(list(xs), op), inputs)
    assert torch.autograd.gradcheck(lambda *xs: ring_order.reduce_to(list(xs), 1, "sum")[1], inputs)
