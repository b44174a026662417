"""Every collective's forward and backward on virtual ranks against the float64 single-device reference."""
from __future__ import annotations

import pytest
import torch

import simcomm

from .harness import call, make_inputs, run_both

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
