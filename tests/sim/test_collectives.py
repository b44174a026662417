"""Every collective's forward and backward on virtual ranks against the float64 single-device reference."""
from __future__ import annotations

import gc
import sys
import types

import pytest
import torch

import simcomm

from ..harness import call, make_inputs, run_both

WORLD_SIZES = [1, 2, 3, 4, 8]
REDUCE_OPS = ["sum", "avg", "max", "min", "product"]


def assert_close(actual, expected):
    for rank, (a, e) in enumerate(zip(actual, expected)):
        if e is None:  # the reference input took no part in the objective: zero gradient
            e = torch.zeros_like(a)
        assert a.shape == e.shape, f"rank {rank}: shape {tuple(a.shape)} != {tuple(e.shape)}"
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12, msg=lambda m: f"rank {rank}: {m}")


def check(op, world_size, shape, contiguous=True, **kw):
    inputs = make_inputs(world_size, shape, seed=world_size)
    # the upstream gradients have the output's shape: take it from a forward-only run
    (_, _), (ref_outs, _) = run_both(op, inputs, None, **kw)
    grads = make_inputs(world_size, ref_outs[0].shape, seed=100 + world_size)
    (outs, in_grads), (ref_outs, ref_grads) = run_both(op, inputs, grads, contiguous=contiguous, **kw)
    assert_close(outs, ref_outs)
    assert_close(in_grads, ref_grads)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("reduce", REDUCE_OPS)
def test_all_reduce(world_size, reduce):
    check("all_reduce", world_size, (3, 4), reduce=reduce)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
def test_all_gather(world_size, dim):
    check("all_gather", world_size, (2, 3, 4), dim=dim)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim", [0, -1, 1])
@pytest.mark.parametrize("reduce", REDUCE_OPS)
def test_reduce_scatter(world_size, dim, reduce):
    check("reduce_scatter", world_size, (2 * world_size, 3 * world_size, world_size), dim=dim, reduce=reduce)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize("scale_grad", [False, True])
def test_slice(world_size, dim, scale_grad):
    inputs = make_inputs(world_size, (2 * world_size, 3 * world_size), seed=1)
    grads = make_inputs(world_size, (2, 3 * world_size) if dim == 0 else (2 * world_size, 3), seed=2)
    (outs, in_grads), (ref_outs, ref_grads) = run_both("slice", inputs, grads, dim=dim, scale_grad=scale_grad)
    assert_close(outs, ref_outs)
    if scale_grad:
        ref_grads = [g / world_size for g in ref_grads]
    assert_close(in_grads, ref_grads)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all_4D_sequence_to_heads_and_back(world_size):
    b, s, h, d = 2, 3 * world_size, 2 * world_size, 3
    check("all_to_all_4D", world_size, (b, s // world_size, h, d), scatter_dim=2, gather_dim=1)
    check("all_to_all_4D", world_size, (b, s, h // world_size, d), scatter_dim=1, gather_dim=2)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all_4D_round_trip_is_identity(world_size):
    shards = make_inputs(world_size, (2, 2, 2 * world_size, 3))

    def program(comm):
        heads = comm.all_to_all_4D(shards[comm.rank], 2, 1)
        return comm.all_to_all_4D(heads, 1, 2)

    for back, original in zip(simcomm.World(world_size).run(program), shards):
        assert torch.equal(back, original)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_broadcast(world_size):
    for src in {0, world_size - 1}:
        check("broadcast", world_size, (3, 2), src=src)


@pytest.mark.parametrize("op,kw,shape", [
    ("all_reduce", {"reduce": "max"}, (4, 6)),
    ("all_gather", {"dim": 1}, (4, 6)),
    ("reduce_scatter", {"dim": 1}, (4, 6)),
    ("all_to_all_4D", {"scatter_dim": 2, "gather_dim": 1}, (2, 3, 4, 2)),
])
def test_non_contiguous_inputs(op, kw, shape):
    check(op, 2, shape, contiguous=False, **kw)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gather(world_size):
    inputs = make_inputs(world_size, (2, 3))
    for dst in {0, world_size - 1}:
        outs = simcomm.World(world_size).run(lambda comm: comm.gather(inputs[comm.rank], dst=dst, dim=-1))
        for rank, out in enumerate(outs):
            if rank == dst:
                assert torch.equal(out, torch.cat(inputs, -1))
            else:
                assert out is None


def test_max_ties_share_the_gradient_and_product_is_exact_with_zeros():
    world_size = 4
    # element 0: every rank holds the max; element 1: ranks 1 and 3 tie; element 2: one holder
    inputs = [torch.tensor([5.0, 2.0, 0.0], dtype=torch.float64),
              torch.tensor([5.0, 7.0, -1.0], dtype=torch.float64),
              torch.tensor([5.0, 1.0, 3.0], dtype=torch.float64),
              torch.tensor([5.0, 7.0, 2.0], dtype=torch.float64)]
    grads = make_inputs(world_size, (3,), seed=5)
    (_, in_grads), (_, ref_grads) = run_both("all_reduce", inputs, grads, reduce="max")
    assert_close(in_grads, ref_grads)
    total = sum(grads)
    assert torch.allclose(in_grads[0][0], total[0] / 4)
    assert torch.allclose(in_grads[1][1], total[1] / 2) and in_grads[0][1] == 0
    # product: one zero (element 2 on rank 0) and two zeros (element 0 on ranks 0 and 2)
    inputs = [torch.tensor([0.0, 2.0, 0.0], dtype=torch.float64),
              torch.tensor([3.0, 7.0, -1.0], dtype=torch.float64),
              torch.tensor([0.0, 1.5, 3.0], dtype=torch.float64),
              torch.tensor([2.0, -2.0, 2.0], dtype=torch.float64)]
    (outs, in_grads), (ref_outs, ref_grads) = run_both("all_reduce", inputs, grads, reduce="product")
    assert_close(outs, ref_outs)
    assert_close(in_grads, ref_grads)
    assert in_grads[0][2] == total[2] * (-1.0 * 3.0 * 2.0)   # the zero holder gets the others' product
    assert in_grads[1][0] == 0                                # two zeros: nobody else gets gradient


def test_inputs_are_never_modified():
    inputs = make_inputs(4, (4, 4))
    copies = [t.clone() for t in inputs]

    def program(comm):
        x = inputs[comm.rank]
        outs = [comm.all_reduce(x), comm.all_gather(x), comm.reduce_scatter(x), comm.broadcast(x),
                comm.slice(x, scale_grad=False)]
        for out in outs:
            out.add_(1)  # each rank owns its outputs: touching them changes no other tensor
        return outs

    results = simcomm.World(4).run(program)
    for original, copy in zip(inputs, copies):
        assert torch.equal(original, copy)
    assert torch.equal(results[0][0], results[1][0])


def test_copy_to_group_and_reduce_from_group_are_conjugate():
    inputs = make_inputs(3, (2, 2))
    grads = make_inputs(3, (2, 2), seed=9)

    def program(comm):
        x = inputs[comm.rank].clone().requires_grad_()
        y = comm.reduce_from_group(comm.copy_to_group(x))
        (y * grads[comm.rank]).sum().backward()
        return y.detach(), x.grad

    outs = simcomm.World(3).run(program)
    for y, grad in outs:
        assert torch.allclose(y, sum(inputs))          # forward: identity, then all-reduce
        assert torch.allclose(grad, sum(grads))        # backward: identity, then all-reduce


@pytest.mark.parametrize("op,kw,shape", [
    ("all_reduce", {"reduce": "sum"}, (2, 3)),
    ("all_reduce", {"reduce": "avg"}, (2, 3)),
    ("all_reduce", {"reduce": "max"}, (2, 3)),
    ("all_reduce", {"reduce": "min"}, (2, 3)),
    ("all_reduce", {"reduce": "product"}, (2, 3)),
    ("all_gather", {"dim": 0}, (2, 3)),
    ("all_gather", {"dim": -1}, (2, 3)),
    ("reduce_scatter", {"dim": 0, "reduce": "sum"}, (4, 3)),
    ("reduce_scatter", {"dim": -1, "reduce": "max"}, (3, 4)),
    ("slice", {"dim": 0}, (4, 3)),
    ("slice", {"dim": -1}, (3, 4)),  # scale_grad=True is a convention, not the Jacobian
    ("all_to_all_4D", {"scatter_dim": 2, "gather_dim": 1}, (1, 2, 2, 2)),
    ("all_to_all_4D", {"scatter_dim": 1, "gather_dim": 2}, (1, 2, 2, 2)),
    ("broadcast", {"src": 1}, (2, 3)),
])
@pytest.mark.parametrize("perturbed_rank", [0, 1])
def test_gradcheck_through_each_function(op, kw, shape, perturbed_rank):
    """``torch.autograd.gradcheck`` on one rank, the other ranks calling in lockstep with
    fixed inputs and zero upstream gradient, so the checked Jacobian is d y_r / d x_r."""
    world_size = 2
    inputs = make_inputs(world_size, shape, seed=3)

    def program(comm):
        x = inputs[comm.rank].clone().requires_grad_()
        if comm.rank == perturbed_rank:
            fn = lambda t: call(comm, op, t, **kw)  # noqa: E731
        else:
            fixed = x.detach().clone()
            fn = lambda t: call(comm, op, fixed + 0 * t, **kw) * 0  # noqa: E731
        return torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7)

    assert simcomm.World(world_size).run(program) == [True, True]


# -- fixed defects: subgroup order, aliasing, NaN, zero sizes, argument checks -----------------

def _subgroup_order(comm):
    sub = comm.subgroup([[2, 0], [3, 1]] if comm.world_size == 4 else [[1, 0]])
    return sub.ranks, sub.rank, sub.all_gather(torch.tensor([float(comm.rank)]), 0)


def test_subgroup_ranks_are_sorted_as_torch_new_group_sorts_them():
    for world_size, groups in ((2, [[0, 1]] * 2), (4, [[0, 2], [1, 3], [0, 2], [1, 3]])):
        for rank, (ranks, local, gathered) in enumerate(simcomm.World(world_size).run(_subgroup_order)):
            assert ranks == tuple(groups[rank]) and local == groups[rank].index(rank)
            assert torch.equal(gathered, torch.tensor(groups[rank], dtype=torch.float32))


@pytest.mark.parametrize("bad", [0.7, "0", 1.9, True, 1.0, None])
def test_subgroup_ranks_must_be_ints(bad):
    with pytest.raises(simcomm.RankError, match=r"subgroup: groups=.* contains .* on rank 0; ranks must be ints"):
        simcomm.World(2).run(lambda comm: comm.subgroup([[bad, 1]]))


def test_slice_output_does_not_alias_the_replicated_input():
    shared = torch.arange(8.0)

    def program(comm):
        mine = comm.slice(shared, 0, scale_grad=False)
        mine.zero_()                     # each rank edits its own output in place
        return mine

    simcomm.World(2).run(program)
    assert torch.equal(shared, torch.arange(8.0))


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter"])
@pytest.mark.parametrize("reduce", ["max", "min"])
def test_nan_through_max_min_gives_the_references_gradient(op, reduce):
    inputs = make_inputs(3, (3, 2), seed=4)
    inputs[1][0, 1] = float("nan")
    grads = make_inputs(3, (3, 2) if op == "all_reduce" else (1, 2), seed=5)
    (_, in_grads), (_, ref_grads) = run_both(op, inputs, grads, reduce=reduce, dim=0) if op == "reduce_scatter" \
        else run_both(op, inputs, grads, reduce=reduce)
    for got, want in zip(in_grads, ref_grads):
        assert torch.equal(got.isnan(), want.isnan()) and want.isnan().any()
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-12, atol=1e-12)


def test_zero_size_dims():
    def program(comm):
        empty = torch.ones(0, 3, requires_grad=True)
        outs = [comm.reduce_scatter(empty, dim=0), comm.all_to_all(empty, scatter_dim=0, gather_dim=1),
                comm.all_gather(empty, dim=0), comm.all_reduce(empty), comm.slice(empty, 0, scale_grad=False),
                comm.reduce(empty, dst=1), comm.scatter(empty, src=0, dim=0),
                comm.all_to_all_single(empty, [0] * comm.world_size, [0] * comm.world_size)]
        sum(out.sum() for out in outs).backward()
        return [out.shape for out in outs], empty.grad.shape

    for shapes, grad_shape in simcomm.World(3).run(program):
        assert shapes == [(0, 3), (0, 9), (0, 3), (0, 3), (0, 3), (0, 3), (0, 3), (0, 3)] and grad_shape == (0, 3)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("method", ["all_reduce", "reduce_scatter", "reduce"])
def test_avg_of_integers_is_refused_at_every_world_size(world_size, method):
    def program(comm):
        return getattr(comm, method)(torch.ones(2 * world_size, dtype=torch.int64), op="avg")

    with pytest.raises(simcomm.RankError, match=rf"{method}: ReduceOp.AVG on rank 0 needs a floating-point dtype, "
                                                r"got torch.int64"):
        simcomm.World(world_size).run(program)


NOT_TENSORS = [
    ("all_reduce", lambda comm, v: comm.all_reduce(v), "input_"),
    ("all_gather", lambda comm, v: comm.all_gather(v), "input_"),
    ("reduce_scatter", lambda comm, v: comm.reduce_scatter(v), "input_"),
    ("slice", lambda comm, v: comm.slice(v, scale_grad=False), "input_"),
    ("all_to_all", lambda comm, v: comm.all_to_all(v, 0, 1), "input_"),
    ("all_to_all_4D", lambda comm, v: comm.all_to_all_4D(v), "input_"),
    ("gather", lambda comm, v: comm.gather(v), "input_"),
    ("broadcast", lambda comm, v: comm.broadcast(v), "input_"),
    ("copy_to_group", lambda comm, v: comm.copy_to_group(v), "input_"),
    ("reduce_from_group", lambda comm, v: comm.reduce_from_group(v), "input_"),
    ("reduce", lambda comm, v: comm.reduce(v), "input_"),
    ("scatter", lambda comm, v: comm.scatter(v), "input_"),
    ("all_to_all_single", lambda comm, v: comm.all_to_all_single(v), "input_"),
    ("send", lambda comm, v: comm.send(v, 1), "tensor"),
]


@pytest.mark.parametrize("op,method,arg", NOT_TENSORS, ids=[n for n, _, _ in NOT_TENSORS])
def test_non_tensor_inputs_name_the_op_rank_argument_and_value(op, method, arg):
    with pytest.raises(simcomm.RankError, match=rf"{op}: {arg}=\[1, 2\] on rank 0 is a list, not a torch.Tensor"):
        simcomm.World(2).run(lambda comm: method(comm, [1, 2]))


def test_a_replaced_backward_rule_is_used_inside_the_block_only():
    from simcomm import autograd

    def program(comm):
        x = torch.ones(2, requires_grad=True)
        comm.all_gather(x, 0).sum().backward()
        return x.grad

    def wrong(ctx, grad):
        return None, torch.zeros(2), None

    original = autograd.BACKWARD_RULES["all_gather"]
    with autograd.replaced_backward("all_gather", wrong):
        assert all(not g.any() for g in simcomm.World(2).run(program))
    assert autograd.BACKWARD_RULES["all_gather"] is original
    assert all(torch.equal(g, torch.full((2,), 2.0)) for g in simcomm.World(2).run(program))
    with pytest.raises(ValueError, match="unknown rule 'nope'"):
        with autograd.replaced_backward("nope", wrong):
            pass


def _holds_a_transport(value, depth: int = 3) -> bool:
    """Whether ``value``, or what it holds ``depth`` levels down (dict values, list items, an
    object's attributes), is a transport."""
    from simcomm.transport import TransportBase

    if isinstance(value, TransportBase):
        return True
    if depth == 0 or isinstance(value, (type, types.ModuleType, types.FunctionType, str, bytes, torch.Tensor)):
        return False
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = list(value)
    else:
        items = list(getattr(value, "__dict__", {}).values())
    return any(_holds_a_transport(item, depth - 1) for item in items)


@pytest.mark.parametrize("method", ["all_gather", "all_reduce", "gather", "scatter"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_no_module_level_object_holds_a_transport_after_a_run(method, requires_grad):
    """A run's transports (and with them its state and trace) are not kept by simcomm's modules:
    no Function, rule or context writes them anywhere shared, with or without a gradient."""
    def program(comm):
        x = torch.ones(2, requires_grad=requires_grad)
        y = {"all_gather": lambda: comm.all_gather(x, dim=0), "all_reduce": lambda: comm.all_reduce(x),
             "gather": lambda: comm.gather(x, dst=0, dim=0), "scatter": lambda: comm.scatter(x, src=0, dim=0)}[method]()
        if requires_grad:
            y.sum().backward()
        return None

    simcomm.World(2).run(program)
    gc.collect()
    holders = [f"{name}.{attr}" for name, module in list(sys.modules.items())
               if name.split(".")[0] in ("simcomm", "real")
               for attr, value in list(vars(module).items()) if _holds_a_transport(value)]
    assert not holders, holders


@pytest.mark.parametrize("world_size", [1, 2])
def test_no_output_shares_storage_with_an_input(world_size):
    x = torch.arange(8.0 * world_size).reshape(2 * world_size, 4)   # contiguous: a chunk along dim 0 is a view

    def program(comm):
        outs = [comm.all_reduce(x), comm.all_gather(x, 0), comm.reduce_scatter(x, 0), comm.broadcast(x),
                comm.slice(x, 0, scale_grad=False), comm.all_to_all(x, 0, 1), comm.reduce(x), comm.scatter(x, 0, 0),
                comm.all_to_all_single(x), comm.copy_to_group(x), comm.reduce_from_group(x)]
        gathered = comm.gather(x, dst=0, dim=0)
        return [out for out in outs + [gathered] if out is not None]

    pointer = x.untyped_storage().data_ptr()
    for outs in simcomm.World(world_size).run(program):
        assert all(out.untyped_storage().data_ptr() != pointer for out in outs)
