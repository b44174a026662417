"""Second derivatives through collectives, against the single-device float64 reference.

Every rank ``r`` computes ``loss_r`` from its collective's output; the objective is
``sum_r loss_r``. Each rank takes ``g_r = d loss_r / d x_r`` with ``create_graph=True``
(in the sum-of-losses convention that is the gradient of the whole objective on
rank ``r``), then ``h_r = d (g_r . v_r) / d x_r``: together the Hessian-vector
product of the objective with ``v``. The reference computes the same on one
device, with plain torch ops (:mod:`tests.reference`), no communication.
"""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm import ReduceOp

from .. import reference

WORLD = 3


def _loss(y: torch.Tensor, rank: int) -> torch.Tensor:
    """A rank-dependent, non-quadratic loss, so the Hessian is neither zero nor constant."""
    weight = torch.linspace(0.5, 1.5, y.numel(), dtype=y.dtype).reshape(y.shape) * (rank + 1)
    return (weight * y ** 3).sum() + y.sin().sum()


def _inputs(shape, seed=0, positive=False):
    generator = torch.Generator().manual_seed(seed)
    xs = [torch.rand(shape, generator=generator, dtype=torch.float64) + 0.5 if positive else
          torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(WORLD)]
    vs = [torch.randn(shape, generator=generator, dtype=torch.float64) for _ in range(WORLD)]
    return xs, vs


def _on_ranks(call, xs, vs):
    def program(comm):
        x = xs[comm.rank].clone().requires_grad_(True)
        y = call(comm, x)
        (g,) = torch.autograd.grad(_loss(y, comm.rank), x, create_graph=True)
        (h,) = torch.autograd.grad((g * vs[comm.rank]).sum(), x, allow_unused=True)
        return g.detach(), torch.zeros_like(x) if h is None else h
    return simcomm.World(WORLD).run(program)


def _reference(ref, xs, vs):
    leaves = [x.clone().requires_grad_(True) for x in xs]
    ys = ref(leaves)
    total = sum(_loss(y, r) for r, y in enumerate(ys) if y is not None)
    gs = torch.autograd.grad(total, leaves, create_graph=True, allow_unused=True)
    gs = [torch.zeros_like(x) if g is None else g for g, x in zip(gs, leaves)]
    hs = torch.autograd.grad(sum((g * v).sum() for g, v in zip(gs, vs)), leaves, allow_unused=True)
    return [(g.detach(), torch.zeros_like(x) if h is None else h) for g, h, x in zip(gs, hs, leaves)]


SPLITS_IN = [[1, 2, 3], [3, 0, 3], [2, 2, 2]]            # rank i sends SPLITS_IN[i][j] rows to j
SPLITS_OUT = [[SPLITS_IN[i][j] for i in range(WORLD)] for j in range(WORLD)]

CASES = {
    # name: (communicator call, reference, input shape, positive inputs)
    "all_reduce_sum": (lambda c, x: c.all_reduce(x), lambda xs: reference.all_reduce(xs), (2, 3), False),
    "all_reduce_avg": (lambda c, x: c.all_reduce(x, ReduceOp.AVG),
                       lambda xs: reference.all_reduce(xs, "avg"), (2, 3), False),
    "all_reduce_max": (lambda c, x: c.all_reduce(x, ReduceOp.MAX),
                       lambda xs: reference.all_reduce(xs, "max"), (2, 3), False),
    "all_reduce_min": (lambda c, x: c.all_reduce(x, ReduceOp.MIN),
                       lambda xs: reference.all_reduce(xs, "min"), (2, 3), False),
    "all_reduce_product": (lambda c, x: c.all_reduce(x, ReduceOp.PRODUCT),
                           lambda xs: reference.all_reduce(xs, "product"), (2, 3), False),
    "all_reduce_premul_sum": (lambda c, x: c.all_reduce(x, ReduceOp.PREMUL_SUM(0.5 + c.rank)),
                              lambda xs: reference.all_reduce([x * (0.5 + r) for r, x in enumerate(xs)]),
                              (2, 3), False),
    "all_gather": (lambda c, x: c.all_gather(x, 0), lambda xs: reference.all_gather(xs, 0), (2, 3), False),
    "reduce_scatter_sum": (lambda c, x: c.reduce_scatter(x, 0),
                           lambda xs: reference.reduce_scatter(xs, 0), (6, 2), False),
    "reduce_scatter_max": (lambda c, x: c.reduce_scatter(x, 1, ReduceOp.MAX),
                           lambda xs: reference.reduce_scatter(xs, 1, "max"), (2, 6), False),
    "reduce_scatter_product": (lambda c, x: c.reduce_scatter(x, 0, ReduceOp.PRODUCT),
                               lambda xs: reference.reduce_scatter(xs, 0, "product"), (6, 2), False),
    "all_to_all_4D": (lambda c, x: c.all_to_all_4D(x, 2, 1),
                      lambda xs: reference.all_to_all_4d(xs, 2, 1), (1, 2, 3, 2), False),
    "broadcast": (lambda c, x: c.broadcast(x, 1), lambda xs: reference.broadcast(xs, 1), (2, 3), False),
    "reduce_sum": (lambda c, x: c.reduce(x, 2), lambda xs: reference.reduce(xs, 2), (2, 3), False),
    "reduce_product": (lambda c, x: c.reduce(x, 0, ReduceOp.PRODUCT),
                       lambda xs: reference.reduce(xs, 0, "product"), (2, 3), False),
    "gather": (lambda c, x: c.gather(x, 1, 0), lambda xs: reference.gather_with_grad(xs, 1, 0), (2, 3), False),
    "scatter": (lambda c, x: c.scatter(x, 0, 1), lambda xs: reference.scatter(xs, 0, 1), (2, 6), False),
    "all_to_all_single": (lambda c, x: c.all_to_all_single(x, SPLITS_OUT[c.rank], SPLITS_IN[c.rank]),
                          lambda xs: reference.all_to_all_single(xs, SPLITS_OUT, SPLITS_IN), (6, 2), False),
    # conjugate pair: checked by their own formulas below
    "copy_to_group": (lambda c, x: c.copy_to_group(x), None, (2, 3), False),
    "reduce_from_group": (lambda c, x: c.reduce_from_group(x), None, (2, 3), False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_hessian_vector_product_matches_the_single_device_reference(name):
    call, ref, shape, positive = CASES[name]
    xs, vs = _inputs(shape, seed=len(name), positive=positive)
    got = _on_ranks(call, xs, vs)
    if name == "copy_to_group":
        _check_copy_to_group(got, xs, vs)
        return
    if name == "reduce_from_group":
        # all-reduce forward, identity backward: g_r = d loss_r / d y at y = sum x
        _check_reduce_from_group(got, xs, vs)
        return
    expected = _reference(ref, xs, vs)
    for rank, ((g, h), (g_ref, h_ref)) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, g_ref, msg=f"{name}: gradient on rank {rank}")
        torch.testing.assert_close(h, h_ref, msg=f"{name}: Hessian-vector product on rank {rank}")
        assert h.abs().sum() > 0 or h_ref.abs().sum() == 0


def _check_copy_to_group(got, xs, vs):
    """Identity forward, all-reduce backward: g_r = sum_s loss_s'(x_s). Differentiating
    g_r . v_r runs the all-reduce backward (sum_s v_s reaches every rank's loss_s'), then
    each rank's second derivative, then copy_to_group's own backward again (an all-reduce):
    h_r = sum_s loss_s''(x_s) (sum_t v_t), the same on every rank."""
    leaves = [x.clone().requires_grad_(True) for x in xs]
    owns = [torch.autograd.grad(_loss(x, r), x, create_graph=True)[0] for r, x in enumerate(leaves)]
    h_ref = sum(torch.autograd.grad((own * sum(vs)).sum(), x, retain_graph=True)[0]
                for own, x in zip(owns, leaves))
    for rank, (g, h) in enumerate(got):
        torch.testing.assert_close(g, sum(owns).detach(), msg=f"copy_to_group: gradient on rank {rank}")
        torch.testing.assert_close(h, h_ref, msg=f"copy_to_group: Hessian-vector product on rank {rank}")


def _check_reduce_from_group(got, xs, vs):
    total = sum(xs).clone().requires_grad_(True)
    for rank, (g, h) in enumerate(got):
        (g_ref,) = torch.autograd.grad(_loss(total, rank), total, create_graph=True)
        # identity backward: g_r depends on every x through y = sum x, but the identity rule
        # passes the second derivative of x_r alone on: d(g_r . v_r)/dx_r = loss_r''(y) v_r
        (h_ref,) = torch.autograd.grad((g_ref * vs[rank]).sum(), total)
        torch.testing.assert_close(g, g_ref.detach(), msg=f"reduce_from_group: gradient on rank {rank}")
        torch.testing.assert_close(h, h_ref, msg=f"reduce_from_group: Hessian-vector product on rank {rank}")


def test_the_issue_example_all_gather_second_derivative():
    def program(comm):
        x = torch.tensor([comm.rank + 1.0], dtype=torch.float64, requires_grad=True)
        y = comm.all_gather(x, 0)
        (g,) = torch.autograd.grad((y ** 3).sum(), x, create_graph=True)
        (h,) = torch.autograd.grad(g.sum(), x)
        return g.item(), h.item()

    # single device: L = sum_r sum_s y_s^3, y = [1, 2]; dL/dx_s = 2 * 3 x_s^2, d2 = 2 * 6 x_s
    assert simcomm.World(2).run(program) == [(6.0 * 1, 12.0), (6.0 * 4, 24.0)]


def test_a_gradient_penalty_trains_the_same_as_on_one_device():
    """WGAN-GP style: loss + |d loss / d x|^2, differentiated with respect to the weight."""
    xs, _ = _inputs((4,), seed=7)
    weight0 = torch.linspace(-1, 1, 4, dtype=torch.float64)

    def objective(weight, y, rank):
        return (weight * y).tanh().sum() * (rank + 1)

    def program(comm):
        weight = weight0.clone().requires_grad_(True)
        x = xs[comm.rank].clone().requires_grad_(True)
        y = comm.all_reduce(x)
        loss = objective(weight, y, comm.rank)
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        total = loss + (gx ** 2).sum()
        total.backward()
        return weight.grad

    got = simcomm.World(WORLD).run(program)
    weight = weight0.clone().requires_grad_(True)
    leaves = [x.clone().requires_grad_(True) for x in xs]
    y = sum(leaves)
    loss = sum(objective(weight, y, r) for r in range(WORLD))
    gxs = torch.autograd.grad(loss, leaves, create_graph=True)
    (loss + sum((gx ** 2).sum() for gx in gxs)).backward()
    # each rank's weight.grad is its own loss's share; their sum is the objective's gradient
    torch.testing.assert_close(sum(got), weight.grad)


def test_async_handles_give_the_same_second_derivatives():
    xs, vs = _inputs((2, 3), seed=3)

    def call(comm, x):
        return comm.all_gather(x, 1, async_op=True).wait()

    got = _on_ranks(call, xs, vs)
    expected = _reference(lambda ls: reference.all_gather(ls, 1), xs, vs)
    for (g, h), (g_ref, h_ref) in zip(got, expected):
        torch.testing.assert_close(g, g_ref)
        torch.testing.assert_close(h, h_ref)


def _gradients_on_ranks(call, xs):
    def program(comm):
        x = xs[comm.rank].clone().requires_grad_(True)
        (g,) = torch.autograd.grad(_loss(call(comm, x), comm.rank), x, allow_unused=True)
        return torch.zeros_like(x) if g is None else g   # scatter off src: the input is not used
    return simcomm.World(WORLD).run(program)


@pytest.mark.parametrize("name", sorted(set(CASES) - {"copy_to_group", "reduce_from_group"}))
def test_double_backward_matches_finite_differences_of_the_distributed_gradient(name):
    """gradgradcheck's test across ranks: the Hessian-vector product from double backward
    equals the central difference of the ranks' first derivatives along v (every rank's
    input moved at once), with no single-device code involved."""
    call, _ref, shape, positive = CASES[name]
    xs, vs = _inputs(shape, seed=len(name), positive=positive)
    got = _on_ranks(call, xs, vs)
    eps = 1e-6
    plus = _gradients_on_ranks(call, [x + eps * v for x, v in zip(xs, vs)])
    minus = _gradients_on_ranks(call, [x - eps * v for x, v in zip(xs, vs)])
    for rank, ((_g, h), g_plus, g_minus) in enumerate(zip(got, plus, minus)):
        torch.testing.assert_close(h, (g_plus - g_minus) / (2 * eps), rtol=1e-5, atol=1e-6,
                                   msg=f"{name}: Hessian-vector product on rank {rank}")


def _hvp_program(comm, name, xs, vs):
    call = CASES[name][0]
    x = xs[comm.rank].clone().requires_grad_(True)
    (g,) = torch.autograd.grad(_loss(call(comm, x), comm.rank), x, create_graph=True)
    (h,) = torch.autograd.grad((g * vs[comm.rank]).sum(), x, allow_unused=True)
    return g.detach(), torch.zeros_like(x) if h is None else h


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("name", ["all_gather", "reduce_scatter_product", "all_reduce_max", "broadcast", "gather",
                                  "scatter", "all_to_all_single"])
def test_second_derivatives_on_gloo_equal_the_simulators(gloo_cluster, name):
    _call, _ref, shape, positive = CASES[name]
    xs, vs = _inputs(shape, seed=len(name), positive=positive)
    got = gloo_cluster(WORLD).run(_hvp_program, name, xs, vs)
    want = simcomm.World(WORLD).run(_hvp_program, name, xs, vs)
    for (g, h), (g_sim, h_sim) in zip(got, want, strict=True):
        torch.testing.assert_close(g, g_sim)
        torch.testing.assert_close(h, h_sim)


def test_premul_sum_mixed_second_derivative_with_respect_to_a_tensor_factor():
    """d/df_r of (g_r . v_r), g_r = d loss / d x_r = f_r * sum_s loss_s'(y): both through the
    factor and through y = sum_s f_s x_s."""
    xs, vs = _inputs((3,), seed=11)
    factors = [0.5 + r for r in range(WORLD)]

    def program(comm):
        x = xs[comm.rank].clone().requires_grad_(True)
        factor = torch.tensor([factors[comm.rank]], dtype=torch.float64, requires_grad=True)
        y = comm.all_reduce(x, ReduceOp.PREMUL_SUM(factor))
        (g,) = torch.autograd.grad(_loss(y, comm.rank), x, create_graph=True)
        h_x, h_f = torch.autograd.grad((g * vs[comm.rank]).sum(), (x, factor))
        return g.detach(), h_x, h_f

    got = simcomm.World(WORLD).run(program)
    leaves = [x.clone().requires_grad_(True) for x in xs]
    fs = [torch.tensor([f], dtype=torch.float64, requires_grad=True) for f in factors]
    y = sum(f * x for f, x in zip(fs, leaves))
    total = sum(_loss(y, r) for r in range(WORLD))
    gs = torch.autograd.grad(total, leaves, create_graph=True)
    hs = torch.autograd.grad(sum((g * v).sum() for g, v in zip(gs, vs)), [*leaves, *fs])
    for rank, (g, h_x, h_f) in enumerate(got):
        torch.testing.assert_close(g, gs[rank].detach())
        torch.testing.assert_close(h_x, hs[rank])
        torch.testing.assert_close(h_f, hs[WORLD + rank])
