"""ReduceOp.PREMUL_SUM: sum of each rank's ``factor * x``, forward and backward, against the
single-device float64 reference; through the communicator, torch.distributed, FSDP2 and gloo."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

import simcomm
from simcomm import collectives
from simcomm.errors import RankError

from ..harness import make_inputs

WORLD = 3
FACTORS = (0.5, -1.25, 3.0)     # one per rank: NCCL applies each rank's own factor locally


def _factor(rank: int, kind: str, dtype=torch.float64, requires_grad: bool = False):
    """Rank ``rank``'s PREMUL_SUM op with its factor as a Python float or a 0-d tensor."""
    value = FACTORS[rank]
    if kind == "float":
        return ReduceOp.PREMUL_SUM(value), value
    tensor = torch.tensor(value, dtype=dtype, requires_grad=requires_grad)
    return dist._make_nccl_premul_sum(tensor), tensor


# -- the math, one device ------------------------------------------------------------------------

def test_reduce_is_the_sum_of_factor_times_input_in_the_input_dtype():
    inputs = make_inputs(WORLD, (6, 4), seed=1, dtype=torch.float64)
    expected = sum(f * x for f, x in zip(FACTORS, inputs))
    got = collectives.reduce(inputs, "premul_sum", factors=list(FACTORS))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    for got in collectives.all_reduce(inputs, ReduceOp.PREMUL_SUM(1.0), factors=list(FACTORS)):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-15)
    chunks = collectives.reduce_scatter(inputs, 0, "premul_sum", factors=list(FACTORS))
    torch.testing.assert_close(torch.cat(chunks), expected, rtol=0, atol=1e-15)
    bf16 = [x.to(torch.bfloat16) for x in inputs]
    out = collectives.reduce(bf16, "premul_sum", factors=[torch.tensor(f, dtype=torch.bfloat16) for f in FACTORS])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), sum(f * x.double() for f, x in zip(FACTORS, bf16)),
                               rtol=2e-2, atol=2e-2)


def test_the_math_refuses_missing_factors_and_integers():
    inputs = make_inputs(2, (3,))
    with pytest.raises(ValueError, match=r"PREMUL_SUM needs factors, one per rank \(2\)"):
        collectives.reduce(inputs, "premul_sum")
    with pytest.raises(ValueError, match="only for PREMUL_SUM, not sum"):
        collectives.reduce(inputs, "sum", factors=[1.0, 2.0])
    with pytest.raises(ValueError, match="ReduceOp.PREMUL_SUM needs a floating-point dtype, got torch.int64"):
        collectives.reduce([torch.ones(3, dtype=torch.long)] * 2, "premul_sum", factors=[1.0, 1.0])


# -- the communicator: forward and backward against the reference -------------------------------

def _reference(inputs, factors, weights, method, dst=0):
    """Single device, float64: every rank's output and the gradients of the sum of the per-rank
    losses ``(y_r * w_r).sum()`` with respect to every input and every factor."""
    xs = [x.clone().requires_grad_() for x in inputs]
    fs = [torch.tensor(f, dtype=torch.float64, requires_grad=True) for f in factors]
    total = sum(f * x for f, x in zip(fs, xs))
    if method == "all_reduce":
        outs = [total] * len(xs)
    elif method == "reduce_scatter":
        outs = list(total.chunk(len(xs), 0))
    else:
        outs = [total if r == dst else torch.zeros_like(total) for r in range(len(xs))]
    loss = sum((y * w).sum() for y, w in zip(outs, weights))
    grads = torch.autograd.grad(loss, [*xs, *fs])
    return [y.detach() for y in outs], grads[:len(xs)], grads[len(xs):]


@pytest.mark.parametrize("method", ["all_reduce", "reduce_scatter", "reduce"])
@pytest.mark.parametrize("kind", ["float", "tensor"])
@pytest.mark.parametrize("async_op", [False, True])
def test_forward_and_backward_equal_the_reference(method, kind, async_op):
    inputs = make_inputs(WORLD, (6, 2), seed=2)
    out_rows = 2 if method == "reduce_scatter" else 6
    weights = make_inputs(WORLD, (out_rows, 2), seed=3)
    ref_outs, ref_x_grads, ref_f_grads = _reference(inputs, FACTORS, weights, method, dst=1)

    def program(comm):
        x = inputs[comm.rank].clone().requires_grad_()
        op, factor = _factor(comm.rank, kind, requires_grad=True)
        call = {"all_reduce": lambda: comm.all_reduce(x, op, async_op=async_op),
                "reduce_scatter": lambda: comm.reduce_scatter(x, 0, op, async_op=async_op),
                "reduce": lambda: comm.reduce(x, 1, op, async_op=async_op)}[method]
        y = call()
        y = y.wait() if async_op else y
        (y * weights[comm.rank]).sum().backward()
        return y.detach(), x.grad, factor.grad if kind == "tensor" else None

    world = simcomm.World(WORLD)
    for rank, (y, x_grad, f_grad) in enumerate(world.run(program)):
        assert y.dtype == torch.float64
        torch.testing.assert_close(y, ref_outs[rank], rtol=0, atol=1e-14)
        torch.testing.assert_close(x_grad, ref_x_grads[rank], rtol=0, atol=1e-14)
        if kind == "tensor":
            torch.testing.assert_close(f_grad, ref_f_grads[rank], rtol=0, atol=1e-13)
    forward = [e for e in world.trace.events if e.rank == 0 and e.phase == "forward"]
    assert [e.op for e in forward] == [method] and forward[0].args["op"] == "premul_sum"


@pytest.mark.parametrize("method", ["all_reduce", "reduce_scatter", "reduce"])
@pytest.mark.parametrize("perturbed_rank", [0, 1])
def test_gradcheck_across_ranks(method, perturbed_rank):
    """``gradcheck`` of rank ``perturbed_rank``'s input and factor tensor; the other rank calls in
    lockstep with its own fixed input and factor, and its output enters the checked function
    through the rank's loss weight, so the Jacobian includes the other ranks' upstream gradients."""
    inputs = make_inputs(2, (4, 3), seed=4)

    def program(comm):
        x = inputs[comm.rank].clone().requires_grad_()
        factor = torch.tensor(FACTORS[comm.rank], dtype=torch.float64, requires_grad=True)

        def fn(t, f):
            op = dist._make_nccl_premul_sum(f)
            if method == "all_reduce":
                return comm.all_reduce(t, op)
            if method == "reduce_scatter":
                return comm.reduce_scatter(t, 0, op)
            return comm.reduce(t, 0, op)

        if comm.rank == perturbed_rank:
            return torch.autograd.gradcheck(fn, (x, factor), eps=1e-6, atol=1e-7)
        # the other rank: one call per evaluation gradcheck makes (same count: the same fn shape)
        fixed_x, fixed_f = x.detach().clone(), factor.detach().clone()
        return torch.autograd.gradcheck(lambda t, f: fn(fixed_x + 0 * t, fixed_f + 0 * f) * 0,
                                        (x, factor), eps=1e-6, atol=1e-7)

    assert simcomm.World(2).run(program) == [True, True]


def test_bad_factors_name_the_op_rank_and_value():
    def program(comm, op):
        return comm.all_reduce(torch.ones(2), op)

    world = simcomm.World(2)
    with pytest.raises(RankError, match=r"all_reduce: op=.* on rank 0 is PREMUL_SUM without a factor"):
        world.run(program, ReduceOp.PREMUL_SUM)
    with pytest.raises(RankError, match=r"all_reduce: op='premul_sum' on rank 0 is PREMUL_SUM without a factor"):
        world.run(program, "premul_sum")
    with pytest.raises(RankError, match=r"the PREMUL_SUM factor on rank 0 is a torch.float64 tensor but the "
                                        r"input is torch.float32"):
        world.run(program, dist._make_nccl_premul_sum(torch.tensor(2.0, dtype=torch.float64)))
    with pytest.raises(RankError, match=r"factor on rank 0 is a torch.int64 tensor of shape \(\); it must be "
                                        r"one floating-point element"):
        world.run(program, dist._make_nccl_premul_sum(torch.tensor(2)))

    def integers(comm):
        return comm.reduce_scatter(torch.ones(2, dtype=torch.int32), 0, ReduceOp.PREMUL_SUM(2.0))

    with pytest.raises(RankError, match="reduce_scatter: ReduceOp.PREMUL_SUM on rank 0 needs a floating-point"):
        world.run(integers)


def test_shape_only_ranks_premultiply_and_trace_the_same():
    def program(comm):
        x = torch.ones(4, 2, dtype=torch.bfloat16)
        y = comm.all_reduce(x, ReduceOp.PREMUL_SUM(0.5))
        z = torch.empty(2, 2, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(z, x, op=dist._make_nccl_premul_sum(0.25))
        return y, z

    signatures = []
    for tensors in ("real", "shape"):
        world = simcomm.World(2, tensors=tensors)
        outs = world.run(program)
        assert [(tuple(t.shape), t.dtype) for t in outs[0]] == [((4, 2), torch.bfloat16), ((2, 2), torch.bfloat16)]
        signatures.append(simcomm.sim.shape.trace_signature(world.trace))
        if tensors == "real":
            assert torch.equal(outs[0][0], torch.ones(4, 2, dtype=torch.bfloat16))
            assert torch.equal(outs[1][1], torch.full((2, 2), 0.5, dtype=torch.bfloat16))
    assert signatures[0] == signatures[1]


# -- torch.distributed -----------------------------------------------------------------------------

def dist_premul_program(comm, inputs):
    """``dist.all_reduce`` / ``reduce_scatter_tensor`` / ``reduce`` with each rank's own factor."""
    rank = dist.get_rank()
    x = inputs[rank].clone()
    dist.all_reduce(x, op=ReduceOp.PREMUL_SUM(FACTORS[rank]))
    out = torch.empty(inputs[rank].shape[0] // dist.get_world_size(), *inputs[rank].shape[1:],
                      dtype=inputs[rank].dtype)
    dist.reduce_scatter_tensor(out, inputs[rank], op=dist._make_nccl_premul_sum(
        torch.tensor(FACTORS[rank], dtype=inputs[rank].dtype)))
    rooted = inputs[rank].clone()
    dist.reduce(rooted, dst=0, op=ReduceOp.PREMUL_SUM(FACTORS[rank]))
    return x, out, rooted if rank == 0 else None


def test_dist_collectives_with_premul_sum_equal_the_reference():
    inputs = make_inputs(WORLD, (6, 2), seed=5)
    expected = sum(f * x for f, x in zip(FACTORS, inputs))
    outs = simcomm.World(WORLD).run(dist_premul_program, inputs)
    for rank, (x, out, rooted) in enumerate(outs):
        torch.testing.assert_close(x, expected, rtol=0, atol=1e-14)
        torch.testing.assert_close(out, expected.chunk(WORLD)[rank], rtol=0, atol=1e-14)
    torch.testing.assert_close(outs[0][2], expected, rtol=0, atol=1e-14)


def fsdp2_train(comm, sizes, batches, divide_factor, lr=0.05):
    """FSDP2 (every Linear and the root under ``fully_shard``), float32, plain SGD; each rank
    trains on its rows of each batch with the loss ``sum of squared errors / global batch rows``,
    and every FSDP module has ``set_gradient_divide_factor(divide_factor)``: with 1.0 FSDP
    reduce-scatters with PREMUL_SUM(1.0), i.e. sums the ranks' gradients, as torchtitan does."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(divide_factor)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        rows = x.shape[0] // comm.world_size
        xs, ys = x[comm.rank * rows:(comm.rank + 1) * rows], y[comm.rank * rows:(comm.rank + 1) * rows]
        loss = ((model(xs) - ys) ** 2).sum() / x.shape[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return [p.full_tensor().detach() for p in model.parameters()]


def reference_train(sizes, batches, scale, lr=0.05):
    """The same model and steps on one device in float64, the gradient of the whole batch's
    loss times ``scale`` (FSDP with divide factor ``d`` on ``n`` ranks: ``scale = 1 / d``)."""
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1]).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for x, y in batches:
        loss = ((model(x.double()) - y.double()) ** 2).sum() / x.shape[0] * scale
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world_size, divide_factor", [(4, 1.0), (2, 1.0), (4, 2.0)])
def test_fsdp2_with_a_gradient_divide_factor_trains_as_one_device(world_size, divide_factor):
    sizes = (6, 16, 4)
    generator = torch.Generator().manual_seed(7)
    batches = [(torch.randn(8, 6, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(3)]
    expected = reference_train(sizes, batches, scale=1.0 / divide_factor)
    world = simcomm.World(world_size)
    for params in world.run(fsdp2_train, sizes, batches, divide_factor):
        for got, want in zip(params, expected, strict=True):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)
    reduce_ops = {e.args.get("op") for e in world.trace.events if e.op == "reduce_scatter"}
    assert reduce_ops == {"premul_sum"}   # torch's FSDP2 chose PREMUL_SUM(1 / divide_factor)


# -- real workers (gloo has no PREMUL_SUM: the communicator premultiplies, then sums) ------------

def communicator_premul_program(comm, inputs):
    rank = comm.rank
    x = inputs[rank].clone().requires_grad_()
    op = ReduceOp.PREMUL_SUM(FACTORS[rank])
    y = comm.all_reduce(x, op)
    chunk = comm.reduce_scatter(x, 0, dist._make_nccl_premul_sum(torch.tensor(FACTORS[rank], dtype=x.dtype)))
    rooted = comm.reduce(x, 0, op)
    (y.sum() + (chunk * (rank + 1)).sum() + rooted.pow(2).sum()).backward()
    return y.detach(), chunk.detach(), rooted.detach(), x.grad


@pytest.mark.real
@pytest.mark.slow
def test_communicator_premul_sum_on_gloo_equals_the_simulator_and_the_reference(gloo_cluster):
    inputs = make_inputs(2, (4, 3), seed=6)
    real_outs = gloo_cluster(2).run(communicator_premul_program, inputs)
    sim_outs = simcomm.World(2).run(communicator_premul_program, inputs)
    expected = FACTORS[0] * inputs[0] + FACTORS[1] * inputs[1]
    for rank, (real_out, sim_out) in enumerate(zip(real_outs, sim_outs)):
        for got, want in zip(real_out, sim_out):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
        torch.testing.assert_close(real_out[0], expected, rtol=0, atol=1e-14)
        torch.testing.assert_close(real_out[1], expected.chunk(2)[rank], rtol=0, atol=1e-14)
    # reference gradient: d/dx_r [sum_s sum(y) + sum_s (s+1) chunk_s + sum(rooted^2)] = f_r * (...)
    upstream = torch.full_like(expected, 2.0) + torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)]) \
        + 2 * expected
    for rank in range(2):
        torch.testing.assert_close(real_outs[rank][3], FACTORS[rank] * upstream, rtol=0, atol=1e-13)
