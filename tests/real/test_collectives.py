"""Every collective on real gloo processes (2 and 4 ranks): forward, backward, agreement with the
simulator and with the single-device float64 reference."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import simcomm
from real.verify import all_cases, evaluate, run_cases

pytestmark = [pytest.mark.real, pytest.mark.timeout(300)]


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def cluster(request, gloo_cluster):
    return gloo_cluster(request.param)


def assert_cases_pass(cluster, names: list[str]) -> tuple[list, list]:
    """Run the verify cases ``names`` on ``cluster`` and on virtual ranks; assert that every
    one matches the single-device reference and the simulator. Returns both runs' results."""
    got = cluster.run(run_cases, names)
    simulated = simcomm.World(cluster.world_size).run(run_cases, names)
    rows = evaluate(cluster.world_size, list(got), simulated)
    failed = [row for row in rows if not row["passed"]]
    assert len(rows) == len(names) and not failed, failed
    return got, simulated


def test_every_case_matches_reference_and_simulator(cluster):
    world_size = cluster.world_size
    names = [case.name for case in all_cases()]
    got, simulated = assert_cases_pass(cluster, names)
    # the same programs through World.run and real.run: same outputs and gradients
    for rank in range(world_size):
        for name in names:
            (outs, grads), (sim_outs, sim_grads) = got[rank][name], simulated[rank][name]
            for a, b in zip(outs + grads, sim_outs + sim_grads):
                assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-12, atol=1e-12), (name, rank)


def _readme_program(comm):
    x = torch.full((2,), float(comm.rank + 1), requires_grad=True)
    y = comm.all_gather(x, dim=0)
    (y * torch.arange(2.0 * comm.world_size)).sum().backward()
    return y.detach(), x.grad


def test_all_gather_values_and_gradient_by_hand(cluster):
    world_size = cluster.world_size
    outs = cluster.run(_readme_program)
    gathered = torch.arange(1, world_size + 1, dtype=torch.float32).repeat_interleave(2)
    weights_sum = world_size * torch.arange(2.0 * world_size)          # every rank's weights, summed
    for rank, (y, grad) in enumerate(outs):
        assert torch.equal(y, gathered)
        assert torch.equal(grad, weights_sum[2 * rank:2 * rank + 2])   # reduce-scatter of the sum


def _shapes_and_inputs(comm):
    x = torch.arange(2 * 4 * comm.world_size * 3, dtype=torch.float32).reshape(2, 4, comm.world_size * 3)
    x = x + 100 * comm.rank
    before = x.clone()
    strided = x.transpose(0, 2)                                         # non-contiguous input
    out = {
        "all_gather": comm.all_gather(strided, dim=-1).shape,
        "reduce_scatter": comm.reduce_scatter(strided, dim=0).shape,
        # (1, 2P, 3, 4) -> (1, 3, 2P, 4): sequence shards, non-contiguous; -> (1, 3P, 2, 4)
        "all_to_all_4D": comm.all_to_all_4D(torch.zeros(1, 2 * comm.world_size, 3, 4).transpose(1, 2)).shape,
        "broadcast": comm.broadcast(x, src=comm.world_size - 1),
        "device": str(comm.device),
        "group": type(comm.transport.group).__name__,
    }
    rows = torch.arange(6.0 * comm.world_size).reshape(2 * comm.world_size, 3)   # contiguous: no copy
    rows_before = rows.clone()
    comm.reduce_scatter(rows, dim=0)
    comm.all_to_all(rows, scatter_dim=0, gather_dim=1)
    comm.all_gather(rows, dim=0)
    out["unmodified"] = torch.equal(x, before) and torch.equal(rows, rows_before)
    return out


def test_shapes_inputs_untouched_and_device(cluster):
    world_size = cluster.world_size
    for rank, out in enumerate(cluster.run(_shapes_and_inputs)):
        assert out["all_gather"] == (3 * world_size, 4, 2 * world_size)
        assert out["reduce_scatter"] == (3, 4, 2)
        assert out["all_to_all_4D"] == (1, 3 * world_size, 2, 4)
        expected = torch.arange(2 * 4 * world_size * 3, dtype=torch.float32).reshape(2, 4, -1) + 100 * (world_size - 1)
        assert torch.equal(out["broadcast"], expected)
        assert out["device"] == "cpu" and out["group"] == "ProcessGroup" and out["unmodified"]


def _fallbacks(comm):
    """The emulated paths for a backend without AVG or reduce_scatter: force them and compare."""
    transport = comm.transport
    x = torch.arange(4.0 * comm.world_size).reshape(2, 2 * comm.world_size) * (comm.rank + 1)
    native = [transport.all_reduce(x, "avg"), transport.reduce_scatter(x, 1, "max"),
              transport.reduce_scatter(x, 1, "avg")]
    transport._cache.unsupported.update({("all_reduce", "avg"), ("reduce_scatter", "max"),
                                         ("reduce_scatter", "avg")})
    try:
        emulated = [transport.all_reduce(x, "avg"), transport.reduce_scatter(x, 1, "max"),
                    transport.reduce_scatter(x, 1, "avg")]
    finally:
        transport._cache.unsupported.clear()
    try:
        transport.all_reduce(torch.ones(2, dtype=torch.int64), "avg")
        integer_avg = None
    except ValueError as error:
        integer_avg = str(error)
    return native, emulated, integer_avg


def test_emulated_reductions_equal_native_ones(cluster):
    world_size = cluster.world_size
    scale = sum(range(1, world_size + 1)) / world_size
    for rank, (native, emulated, integer_avg) in enumerate(cluster.run(_fallbacks)):
        base = torch.arange(4.0 * world_size).reshape(2, 2 * world_size)
        assert torch.allclose(native[0], base * scale)
        assert torch.equal(native[1], (base * world_size)[:, 2 * rank:2 * rank + 2])
        for a, b in zip(native, emulated):
            assert torch.allclose(a, b)
        assert "all_reduce" in integer_avg and f"rank {rank}" in integer_avg and "int64" in integer_avg


def _trace_program(comm):
    x = torch.ones(2, 3, requires_grad=True)
    y = comm.all_gather(x, dim=0)
    z = comm.all_reduce(y, op="max")
    comm.compute(flops=1e6)
    z.sum().backward()
    comm.barrier()
    if comm.rank == 0:
        comm.send(torch.zeros(2), dst=1)
    elif comm.rank == 1:
        comm.recv((2,), src=0)
    return None


def test_trace_in_simcomm_format_matches_simulator(cluster):
    world_size = cluster.world_size
    outs = cluster.run(_trace_program)
    world = simcomm.World(world_size)
    world.run(_trace_program)
    assert outs.trace is cluster.trace
    assert isinstance(cluster.trace, simcomm.Trace) and cluster.trace.ranks == list(range(world_size))
    assert cluster.trace.ops() == world.trace.ops()
    real_events = sorted(cluster.trace, key=lambda e: (e.rank, e.step, e.phase, e.op))
    sim_events = sorted(world.trace, key=lambda e: (e.rank, e.step, e.phase, e.op))
    for a, b in zip(real_events, sim_events, strict=True):
        assert (a.op, a.group, a.rank, a.step, a.phase, a.shape, a.dtype, a.nbytes, a.out_shape, a.args) == \
               (b.op, b.group, b.rank, b.step, b.phase, b.shape, b.dtype, b.nbytes, b.out_shape, b.args)
        assert 0 <= a.start <= a.end
    assert cluster.trace.comm_matrix() == world.trace.comm_matrix()


def _subgroup_program(comm):
    pairs = comm.subgroup([[0, 1], [2, 3]] if comm.world_size == 4 else [[0], [1]])
    again = comm.subgroup([[0, 1], [2, 3]] if comm.world_size == 4 else [[0], [1]])
    x = torch.tensor([float(comm.rank + 1)], requires_grad=True)
    y = pairs.all_reduce(x)
    y.backward()
    return (pairs.ranks, pairs.rank, y.detach(), x.grad, again.all_reduce(x.detach()),
            pairs.transport.group is not again.transport.group, dist.get_world_size(pairs.transport.group))


def test_subgroups_are_real_process_groups(cluster):
    world_size = cluster.world_size
    # each subgroup is a group of its own, also with the same members (as on the simulator);
    # a later run reuses the process groups (nothing leaks)
    for run in range(2):
        for rank, (ranks, local, y, grad, y2, distinct, size) in enumerate(cluster.run(_subgroup_program)):
            members = [rank - rank % 2, rank - rank % 2 + 1] if world_size == 4 else [rank]
            assert ranks == tuple(members) and local == members.index(rank) and size == len(members)
            assert y.item() == sum(m + 1 for m in members) == y2.item()
            assert grad.item() == len(members) and distinct


# -- the simulator and gloo agree: dtypes, subgroup order, zero sizes, NaN, argument errors ------

_INT_DTYPES = [torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool]   # gloo has no int16


def _integer_reductions(comm):
    out = {}
    for dtype in _INT_DTYPES:
        for numel in (6 * comm.world_size, 70_002 * comm.world_size):   # stacked and accumulated paths
            gen = torch.Generator().manual_seed(numel + comm.rank)
            if dtype == torch.bool:
                x = torch.randint(0, 2, (numel,), generator=gen).bool()
            else:
                x = torch.randint(0 if dtype == torch.uint8 else -120, 250 if dtype == torch.uint8 else 120,
                                  (numel,), generator=gen).to(dtype)
                x[0] = 100                                                # int8: 100 + 100 wraps to -56
            for op in ("sum", "product", "max", "min"):
                out[(str(dtype), numel > 100, op, "all_reduce")] = comm.all_reduce(x, op)[:64]
                out[(str(dtype), numel > 100, op, "reduce_scatter")] = comm.reduce_scatter(x, 0, op)[:64]
                out[(str(dtype), numel > 100, op, "reduce")] = comm.reduce(x, comm.world_size - 1, op)[:64]
    return out


def test_integer_and_bool_reductions_equal_the_simulators(cluster):
    got = cluster.run(_integer_reductions)
    simulated = simcomm.World(cluster.world_size).run(_integer_reductions)
    for rank in range(cluster.world_size):
        assert got[rank].keys() == simulated[rank].keys()
        for key, value in got[rank].items():
            assert value.dtype == simulated[rank][key].dtype and torch.equal(value, simulated[rank][key]), (rank, key)
    # 100 on every rank: 200 and 400 wrap around in int8
    assert got[0][("torch.int8", False, "sum", "all_reduce")][0] == (-56 if cluster.world_size == 2 else -112)


def _order_and_edges(comm):
    sub = comm.subgroup([[2, 0], [3, 1]] if comm.world_size == 4 else [[1, 0]])
    empty = torch.ones(0, 3, requires_grad=True)
    outs = [comm.reduce_scatter(empty, dim=0), comm.all_to_all(empty, scatter_dim=0, gather_dim=1),
            comm.all_gather(empty, dim=0), comm.reduce(empty, dst=1), comm.scatter(empty, src=0, dim=0),
            comm.all_to_all_single(empty, [0] * comm.world_size, [0] * comm.world_size)]
    sum(out.sum() for out in outs).backward()
    shared = torch.arange(4.0 * comm.world_size)
    mine = comm.slice(shared, 0, scale_grad=False)
    x = torch.tensor([1.0, float("nan"), 3.0]) * (comm.rank + 1)
    x.requires_grad_()
    (comm.all_reduce(x, "max") * 2).sum().backward()
    errors = []
    for call in (lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), "avg"),
                 lambda: comm.all_gather([1, 2]), lambda: comm.subgroup([[0.7, 1]]),
                 lambda: comm.subgroup([["0", 1]])):
        try:
            call()
        except (TypeError, ValueError) as error:
            errors.append(str(error))
    return (sub.ranks, sub.rank, sub.all_gather(torch.tensor([float(comm.rank)]), 0),
            [tuple(o.shape) for o in outs], tuple(empty.grad.shape),
            mine.untyped_storage().data_ptr() != shared.untyped_storage().data_ptr(), x.grad, errors)


def test_subgroup_order_zero_sizes_nan_and_errors_equal_the_simulators(cluster):
    got = cluster.run(_order_and_edges)
    simulated = simcomm.World(cluster.world_size).run(_order_and_edges)
    for rank, (real_out, sim_out) in enumerate(zip(got, simulated)):
        ranks, local, gathered, shapes, grad_shape, own_copy, nan_grad, errors = real_out
        members = ([0, 2] if rank % 2 == 0 else [1, 3]) if cluster.world_size == 4 else [0, 1]
        assert ranks == tuple(members) and local == members.index(rank)
        assert torch.equal(gathered, torch.tensor(members, dtype=torch.float32))
        assert shapes == [(0, 3), (0, 3 * cluster.world_size), (0, 3), (0, 3), (0, 3), (0, 3)]
        assert grad_shape == (0, 3) and own_copy and nan_grad[1].isnan()
        assert len(errors) == 4 and errors == sim_out[7], (errors, sim_out[7])
        assert f"rank {rank}" in errors[0] and "all_gather: input_=[1, 2]" in errors[1]
        for a, b in zip(real_out[:7], sim_out[:7]):
            assert a == b if not isinstance(a, torch.Tensor) else torch.equal(a.isnan(), b.isnan()) and \
                torch.equal(a.nan_to_num(), b.nan_to_num())
