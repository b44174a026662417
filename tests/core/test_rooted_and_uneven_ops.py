"""reduce, scatter, differentiable gather, broadcast and uneven all_to_all_single: their backward is
the exact adjoint across ranks, on virtual ranks and on gloo processes (the ``backend`` fixture).

Each check is ``torch.autograd.gradcheck`` on one rank's input of a function whose output is
every rank's output (flattened, padded to one length and all-gathered), so the checked Jacobian is
the whole column d(y_0, ..., y_{n-1}) / d x_r, across ranks. Then, on gloo processes (2 and 4
ranks) beside virtual ranks: uneven splits with zeros, split lists that disagree, and the trace."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import real
import simcomm

from ..harness import call, make_inputs, split_sizes

WORLD_SIZES = [2, 3]


def _gradcheck(comm, op, kw, rows, perturbed_rank):
    """The other ranks run the same number of calls with fixed inputs and zero upstream gradients.
    Every rank's gradcheck input has the same shape; rank r uses its first ``rows[r]`` rows."""
    world_size, height = comm.world_size, max(rows)
    length = world_size * height * 2

    def wrap(y):
        flat = y.reshape(-1)
        return comm.all_gather(F.pad(flat, (0, length - flat.numel())), 0)

    mine = rows[comm.rank]
    x = make_inputs(world_size, (height, 2), seed=11)[comm.rank].requires_grad_()
    if comm.rank == perturbed_rank:
        fn = lambda t: wrap(call(comm, op, t[:mine], **kw))  # noqa: E731
    else:
        fixed = x.detach().clone()
        fn = lambda t: wrap(call(comm, op, (fixed + 0 * t)[:mine], **kw)) * 0  # noqa: E731
    return torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("op,kw", [
    ("reduce", {"dst": 1, "reduce": "sum"}),
    ("reduce", {"dst": 0, "reduce": "avg"}),
    ("reduce", {"dst": 1, "reduce": "max"}),
    ("reduce", {"dst": 0, "reduce": "product"}),
    ("scatter", {"src": 1, "dim": 0}),
    ("gather", {"dst": 1, "dim": -1}),
    ("broadcast", {"src": 0}),
])
def test_gradcheck_across_ranks(backend, world_size, op, kw):
    runner = backend(world_size)
    for perturbed in range(world_size):
        if op == "scatter" and perturbed != kw["src"]:
            continue
        rows = [2 * world_size] * world_size
        assert runner.run(_gradcheck, op, kw, rows, perturbed) == [True] * world_size, perturbed


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_gradcheck_uneven_all_to_all_single(backend, world_size):
    input_splits = split_sizes(world_size, 5)
    input_splits[0][world_size - 1] = 0                      # a zero-size split
    output_splits = [[input_splits[i][j] for i in range(world_size)] for j in range(world_size)]
    kw = {"output_split_sizes": output_splits, "input_split_sizes": input_splits}
    rows = [sum(input_splits[r]) for r in range(world_size)]
    runner = backend(world_size)
    for perturbed in range(world_size):
        if rows[perturbed] == 0:
            continue
        assert runner.run(_gradcheck, "all_to_all_single", kw, rows, perturbed) == [True] * world_size, perturbed


# -- gloo processes beside virtual ranks: zero splits, disagreeing split lists, the trace ------

@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def cluster(request, gloo_cluster):
    return gloo_cluster(request.param)


def _zero_splits(comm):
    world = comm.world_size
    # rank 0 sends nothing; every other rank sends all its rows (rank + 1 of them) to rank 0
    in_splits = [0] * world if comm.rank == 0 else [comm.rank + 1] + [0] * (world - 1)
    out_splits = [r + 1 if r else 0 for r in range(world)] if comm.rank == 0 else [0] * world
    x = torch.full((sum(in_splits), 2), float(comm.rank), dtype=torch.float64, requires_grad=True)
    y = comm.all_to_all_single(x, out_splits, in_splits)
    (y * (comm.rank + 1)).sum().backward()
    return y.detach(), x.grad


@pytest.mark.real
@pytest.mark.timeout(300)
def test_uneven_all_to_all_with_zero_splits_equals_the_simulator(cluster):
    got = cluster.run(_zero_splits)
    simulated = simcomm.World(cluster.world_size).run(_zero_splits)
    expected = torch.cat([torch.full((r + 1, 2), float(r), dtype=torch.float64) for r in range(1, cluster.world_size)])
    assert torch.equal(got[0][0], expected)
    for (y, grad), (sim_y, sim_grad) in zip(got, simulated):
        assert torch.equal(y, sim_y) and torch.equal(grad, sim_grad)
    assert all(torch.equal(g, torch.ones_like(g)) for _, g in got[1:])   # rank 0's weight 1 goes back


def _disagreeing_splits(comm):
    world = comm.world_size
    out_splits = [1] * world
    if comm.rank == 1:
        out_splits = [2] + [0] * (world - 1)     # expects 2 rows from rank 0, which sends 1
    return comm.all_to_all_single(torch.ones(world), out_splits, [1] * world)


@pytest.mark.real
@pytest.mark.timeout(300)
def test_split_lists_that_disagree_name_both_ranks_on_both_backends(cluster):
    expected = (r"all_to_all_single: rank 0 sends 1 rows to rank 1 \(input_split_sizes=\[1(, 1)+\] on rank 0\) "
                r"but rank 1 expects 2 from rank 0 \(output_split_sizes=\[2(, 0)+\] on rank 1\)")
    with pytest.raises(simcomm.CollectiveMismatchError, match=expected):
        cluster.run(_disagreeing_splits)      # checked mode (the default) finds it before data moves
    with pytest.raises(simcomm.RankError, match=expected):
        real.run(_disagreeing_splits, world_size=cluster.world_size, checked=False)   # the transport's check
    with pytest.raises(simcomm.CollectiveMismatchError, match=expected):
        simcomm.World(cluster.world_size).run(_disagreeing_splits)


def _traced(comm):
    world = comm.world_size
    x = torch.ones(2 * world, 3, requires_grad=True)
    y = comm.reduce(x, dst=world - 1, op="max")
    z = comm.scatter(x if comm.rank == 0 else None, src=0, dim=0)
    g = comm.gather(x, dst=1, dim=-1)
    splits = [(comm.rank + j) % 2 for j in range(world)]
    w = comm.all_to_all_single(torch.ones(sum(splits), 3, requires_grad=True),
                               [(i + comm.rank) % 2 for i in range(world)], splits)
    b = comm.broadcast(x, src=1)
    (y.sum() + z.sum() + g.sum() + w.sum() + b.sum()).backward()


@pytest.mark.real
@pytest.mark.timeout(300)
def test_new_ops_trace_like_the_simulator(cluster):
    cluster.run(_traced)
    world = simcomm.World(cluster.world_size)
    world.run(_traced)
    key = lambda e: (e.rank, e.step, e.phase, e.op)  # noqa: E731
    real_events, sim_events = sorted(cluster.trace, key=key), sorted(world.trace, key=key)
    for a, b in zip(real_events, sim_events, strict=True):
        assert (a.op, a.group, a.rank, a.step, a.phase, a.shape, a.dtype, a.nbytes, a.out_shape, a.args,
                a.root, a.sent, a.received) == \
               (b.op, b.group, b.rank, b.step, b.phase, b.shape, b.dtype, b.nbytes, b.out_shape, b.args,
                b.root, b.sent, b.received)
    ops = {e.op for e in world.trace}
    assert {"reduce", "scatter", "gather", "all_to_all_single", "broadcast"} <= ops
    assert cluster.trace.comm_matrix() == world.trace.comm_matrix()
