"""reduce, scatter, differentiable gather and all_to_all_single on virtual ranks, forward and
backward, against the float64 single-device reference; gradcheck across ranks; errors."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm import RankError

from ..harness import make_inputs, run_both, split_sizes

WORLD_SIZES = list(range(1, 9))
REDUCE_OPS = ["sum", "avg", "max", "min", "product"]


def assert_close(actual, expected):
    for rank, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a.shape == e.shape and a.dtype == e.dtype, f"rank {rank}: {a.shape} {a.dtype} != {e.shape} {e.dtype}"
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=lambda m: f"rank {rank}: {m}")


def check(op, inputs, **kw):
    """Forward values and input gradients of every rank equal the reference's, with an
    upstream gradient of each rank's own output shape."""
    (_, _), (ref_outs, _) = run_both(op, inputs, None, **kw)
    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(y.shape, generator=gen, dtype=torch.float64) for y in ref_outs]
    (outs, in_grads), (ref_outs, ref_grads) = run_both(op, inputs, grads, **kw)
    assert_close(outs, ref_outs)
    assert_close(in_grads, ref_grads)
    return outs, in_grads


# -- reduce ------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("reduce", REDUCE_OPS)
def test_reduce(world_size, reduce):
    inputs = make_inputs(world_size, (3, 4), seed=world_size)
    for dst in {0, world_size - 1}:
        outs, _ = check("reduce", inputs, dst=dst, reduce=reduce)
        for rank, out in enumerate(outs):
            if rank != dst:
                assert torch.equal(out, torch.zeros(3, 4, dtype=torch.float64))


def test_reduce_max_ties_and_product_zeros_match_the_reference():
    inputs = [torch.tensor([5.0, 2.0, 0.0], dtype=torch.float64),
              torch.tensor([5.0, 7.0, -1.0], dtype=torch.float64),
              torch.tensor([5.0, 7.0, 3.0], dtype=torch.float64)]
    for reduce in ("max", "min", "product"):
        check("reduce", inputs, dst=1, reduce=reduce)


def test_reduce_backward_is_a_broadcast_of_dsts_grad():
    world = simcomm.World(3)

    def program(comm):
        x = torch.ones(2, requires_grad=True)
        y = comm.reduce(x, dst=2)
        (y * (comm.rank + 1)).sum().backward()     # only dst's weight (3) reaches the inputs
        return x.grad

    assert all(torch.equal(g, torch.full((2,), 3.0)) for g in world.run(program))
    assert [(e.op, e.phase) for e in world.trace if e.rank == 0] == [("reduce", "forward"), ("broadcast", "backward")]


# -- broadcast's backward is a reduce ----------------------------------------------------------

def test_broadcast_backward_is_a_reduce_to_src():
    world = simcomm.World(4)

    def program(comm):
        x = torch.full((2,), float(comm.rank), requires_grad=True)
        y = comm.broadcast(x, src=1)
        (y * (comm.rank + 1)).sum().backward()
        return x.grad

    grads = world.run(program)
    assert torch.equal(grads[1], torch.full((2,), 10.0)) and all(not g.any() for r, g in enumerate(grads) if r != 1)
    backward = [e for e in world.trace if e.phase == "backward"]
    assert {e.op for e in backward} == {"reduce"} and all(e.root == 1 for e in backward)
    assert world.trace.comm_matrix(op="reduce") == [[0, 8, 0, 0], [0, 0, 0, 0], [0, 8, 0, 0], [0, 8, 0, 0]]


# -- scatter -----------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter(world_size, dim):
    shape = [2, 3]
    shape[dim] *= world_size
    inputs = make_inputs(world_size, tuple(shape), seed=world_size)
    for src in {0, world_size - 1}:
        check("scatter", inputs, src=src, dim=dim)


def test_scatter_off_source_follows_the_sources_requires_grad():
    def program(comm, source_requires_grad):
        x = torch.arange(4.0).requires_grad_(source_requires_grad) if comm.rank == 0 else None
        y = comm.scatter(x, src=0, dim=0)
        with torch.no_grad():
            z = comm.scatter(torch.arange(4.0, requires_grad=True) if comm.rank == 0 else None, src=0, dim=0)
        return y.requires_grad, z.requires_grad, y.detach()

    for flag in (False, True):
        outs = simcomm.World(2).run(program, flag)
        assert [o[:2] for o in outs] == [(flag, False)] * 2
        assert torch.equal(outs[1][2], torch.tensor([2.0, 3.0]))


def test_scatter_ignores_a_tensor_off_source_and_checks_dims():
    outs = simcomm.World(2).run(lambda comm: comm.scatter(torch.full((4,), float(comm.rank)), src=1, dim=-1))
    assert all(torch.equal(out, torch.ones(2)) for out in outs)
    with pytest.raises(RankError, match=r"scatter: dim=1 on rank 0 does not name the dim dim=0 of the source rank 1"):
        simcomm.World(2).run(lambda comm: comm.scatter(torch.ones(4, 2) if comm.rank == 1 else None, src=1,
                                                        dim=0 if comm.rank == 1 else 1))


# -- gather --------------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim", [0, -1])
def test_differentiable_gather(world_size, dim):
    inputs = make_inputs(world_size, (2, 3), seed=world_size)
    for dst in {0, world_size - 1}:
        outs, _ = check("gather", inputs, dst=dst, dim=dim)
        for rank, out in enumerate(outs):
            if rank != dst:
                assert out.numel() == 0 and out.shape[dim] == 0


def test_gather_without_grad_still_returns_none_off_dst():
    outs = simcomm.World(3).run(lambda comm: comm.gather(torch.ones(2, requires_grad=True).detach(), dst=2))
    assert outs[0] is None and outs[1] is None and torch.equal(outs[2], torch.ones(6))


# -- all_to_all_single -------------------------------------------------------------------------

@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uneven_all_to_all_single(world_size, seed):
    input_splits = split_sizes(world_size, seed)
    output_splits = [[input_splits[i][j] for i in range(world_size)] for j in range(world_size)]
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(sum(input_splits[r]), 3, generator=gen, dtype=torch.float64) for r in range(world_size)]
    check("all_to_all_single", inputs, output_split_sizes=output_splits, input_split_sizes=input_splits)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_even_all_to_all_single_with_default_splits(world_size):
    inputs = make_inputs(world_size, (2 * world_size, 2), seed=world_size)
    check("all_to_all_single", inputs, output_split_sizes=None, input_split_sizes=None)


def test_all_to_all_single_all_zero_splits_and_zero_rows():
    outs = simcomm.World(3).run(lambda comm: comm.all_to_all_single(torch.ones(0, 2), [0, 0, 0], [0, 0, 0]))
    assert all(out.shape == (0, 2) for out in outs)
    # a rank that sends nothing and receives everything
    splits = {0: ([0, 3], [0, 0]), 1: ([0, 0], [3, 0])}   # (output, input) per rank

    def program(comm):
        x = torch.arange(3.0 * comm.rank).reshape(-1, 1).requires_grad_()
        out_splits, in_splits = splits[comm.rank]
        y = comm.all_to_all_single(x, out_splits, in_splits)
        (y * 2).sum().backward()
        return y.detach(), x.grad

    (y0, g0), (y1, g1) = simcomm.World(2).run(program)
    assert torch.equal(y0, torch.arange(3.0).reshape(3, 1)) and y1.shape == (0, 1)
    assert g0.shape == (0, 1) and torch.equal(g1, torch.full((3, 1), 2.0))


def test_all_to_all_single_trace_bytes_follow_the_splits():
    world = simcomm.World(2)
    splits = {0: ([1, 2], [1, 3]), 1: ([3, 0], [2, 0])}

    def program(comm):
        out_splits, in_splits = splits[comm.rank]
        return comm.all_to_all_single(torch.ones(sum(in_splits), 2, dtype=torch.float64), out_splits, in_splits)

    world.run(program)
    assert world.trace.comm_matrix(op="all_to_all_single") == [[0, 3 * 16], [2 * 16, 0]]
    events = {e.rank: e for e in world.trace}
    assert events[0].args == {"input_split_sizes": [1, 3], "output_split_sizes": [1, 2]}
    assert events[1].received == {0: 3 * 16} and events[0].received == {1: 2 * 16}


def test_scatter_and_reduce_trace_bytes():
    world = simcomm.World(4)

    def program(comm):
        comm.scatter(torch.ones(8, dtype=torch.float64) if comm.rank == 2 else None, src=2, dim=0)
        comm.reduce(torch.ones(3), dst=0)

    world.run(program)
    assert world.trace.comm_matrix(op="scatter") == [[0] * 4, [0] * 4, [16, 16, 0, 16], [0] * 4]
    assert all(e.received == ({2: 16} if e.rank != 2 else {}) for e in world.trace.filter(op="scatter"))
    assert world.trace.comm_matrix(op="reduce") == [[0] * 4, [12, 0, 0, 0], [12, 0, 0, 0], [12, 0, 0, 0]]


# -- errors ------------------------------------------------------------------------------------

def _run_error(world_size, program):
    with pytest.raises(Exception) as info:
        simcomm.World(world_size).run(program)
    return str(info.value)


def test_all_to_all_single_split_lists_that_disagree_name_both_ranks():
    splits = {0: ([1, 1], [1, 1]), 1: ([2, 0], [1, 1])}   # rank 1 expects 2 rows from itself, sends 1

    def program(comm):
        out_splits, in_splits = splits[comm.rank]
        return comm.all_to_all_single(torch.ones(2), out_splits, in_splits)

    with pytest.raises(simcomm.CollectiveMismatchError) as info:
        simcomm.World(2).run(program)
    message = str(info.value)
    assert ("all_to_all_single: rank 0 sends 1 rows to rank 1 (input_split_sizes=[1, 1] on rank 0) but rank 1 "
            "expects 2 from rank 0 (output_split_sizes=[2, 0] on rank 1)") in message, message


@pytest.mark.parametrize("args,match", [
    (([1, 1], [1, 2]), r"input_split_sizes=\[1, 2\] on rank \d sums to 3, but dim 0 of the input has size 2"),
    (([1, 1], [2]), r"input_split_sizes=\[2\] on rank \d must be 2 non-negative ints"),
    (([1, 1], [3, -1]), r"input_split_sizes=\[3, -1\] on rank \d must be 2 non-negative ints"),
    (([1, 0.5], [1, 1]), r"output_split_sizes contains 0.5 \(float\) on rank \d; ranks must be ints"),
    ((None, [1, 1, 1]), r"input_split_sizes=\[1, 1, 1\] on rank \d must be 2"),
])
def test_all_to_all_single_bad_split_lists(args, match):
    with pytest.raises(RankError, match=match):
        simcomm.World(2).run(lambda comm: comm.all_to_all_single(torch.ones(2), *args))


def test_all_to_all_single_rows_of_different_sizes_are_a_mismatch():
    with pytest.raises(simcomm.CollectiveMismatchError, match=r"all_to_all_single"):
        simcomm.World(2).run(lambda comm: comm.all_to_all_single(torch.ones(2, comm.rank + 1)))


def test_reduce_and_scatter_argument_errors():
    with pytest.raises(RankError, match=r"reduce: dst=2 on rank 0 is not a rank of this group"):
        simcomm.World(2).run(lambda comm: comm.reduce(torch.ones(2), dst=2))
    with pytest.raises(RankError, match=r"reduce: ReduceOp.AVG on rank 0 needs a floating-point dtype, "
                                        r"got torch.int64"):
        simcomm.World(1).run(lambda comm: comm.reduce(torch.ones(2, dtype=torch.int64), op="avg"))
    with pytest.raises(RankError, match=r"scatter: size 3 of dim=0 \(shape \(3,\)\) on rank 0 is not divisible"):
        simcomm.World(2).run(lambda comm: comm.scatter(torch.ones(3) if comm.rank == 0 else None))
    with pytest.raises(RankError, match=r"scatter: input_='x' on rank 0 is a str, not a torch.Tensor"):
        simcomm.World(2).run(lambda comm: comm.scatter("x" if comm.rank == 0 else None))


def test_peer_bytes_of_the_new_ops():
    from simcomm.trace import peer_bytes

    ranks = (0, 1, 2)
    assert peer_bytes("reduce", 40, ranks, 1, root=0) == ({0: 40}, {})
    assert peer_bytes("reduce", 40, ranks, 0, root=0) == ({}, {1: 40, 2: 40})
    assert peer_bytes("scatter", 60, ranks, 2, root=2) == ({0: 20, 1: 20}, {})
    assert peer_bytes("scatter", 0, ranks, 0, root=2, out_nbytes=20) == ({}, {2: 20})
    args = {"input_split_sizes": [1, 0, 2], "output_split_sizes": [3, 1, 0]}
    assert peer_bytes("all_to_all_single", 24, ranks, 0, args=args, row_bytes=8) == ({1: 0, 2: 16}, {1: 8, 2: 0})
