"""torch.distributed programs on the simulator and on real gloo workers: the same outcome.

Each test runs one program on both backends: a misuse raises the same error
class (and names the same ranks and program line) at once, never a timeout;
a legal program returns the same values, equal to the float64 single-device
reference; the traces are the same op by op.
"""
from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist

import simcomm
from simcomm.errors import CollectiveMismatchError, DeadlockError

pytestmark = [pytest.mark.real, pytest.mark.slow]

WORLD = 2


@pytest.fixture(scope="module")
def cluster(gloo_cluster):
    return gloo_cluster(WORLD, timeout=60.0)


def _outcome(run, program):
    """``(error class, message)`` of a run that raised, or ``(None, results)``."""
    try:
        return None, run(program)
    except (CollectiveMismatchError, DeadlockError) as error:
        return type(error), str(error)


# -- misuse: the simulator's named error on both backends, at once ----------------------

def one_rank_collective(comm):
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(2))


def shape_mismatch(comm):
    dist.all_reduce(torch.ones(2 + dist.get_rank()))


def dtype_mismatch(comm):
    dist.all_reduce(torch.ones(2, dtype=torch.float64 if dist.get_rank() else torch.float32))


def reduce_op_mismatch(comm):
    dist.all_reduce(torch.ones(2), op=dist.ReduceOp.SUM if dist.get_rank() == 0 else dist.ReduceOp.MAX)


def divergent_new_group(comm):
    dist.new_group([0, 1] if dist.get_rank() == 0 else [1])


def new_group_on_one_rank(comm):
    if dist.get_rank() == 0:
        dist.new_group([0])
    dist.barrier()


def local_group_named_apart(comm):
    dist.new_group([0])          # rank 0 now belongs to 2 groups, rank 1 to 1: torch names the next apart
    pair = dist.new_group([0, 1], use_local_synchronization=True)
    dist.all_reduce(torch.ones(2), group=pair)


def p2p_size_mismatch(comm):
    if dist.get_rank() == 0:
        dist.send(torch.ones(3), 1)
    else:
        dist.recv(torch.empty(2), 0)


def divergent_fsdp_modules(comm):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    width = 4 if dist.get_rank() == 0 else 6
    model = torch.nn.Sequential(torch.nn.Linear(width, 4), torch.nn.Linear(4, 2))
    fully_shard(model)
    model(torch.ones(1, width)).sum().backward()


MISUSES = {
    "one-rank collective": (one_rank_collective, DeadlockError, None),
    "shape": (shape_mismatch, CollectiveMismatchError, r"shape=\(3,\)"),
    "dtype": (dtype_mismatch, CollectiveMismatchError, "dtype=float64"),
    "reduce op": (reduce_op_mismatch, CollectiveMismatchError, "op=max"),
    "divergent new_group": (divergent_new_group, CollectiveMismatchError, "subgroup"),
    "new_group on one rank": (new_group_on_one_rank, CollectiveMismatchError, "subgroup"),
    "local group named apart": (local_group_named_apart, CollectiveMismatchError,
                                r"called new_group\(name=\w+, ranks=\[0, 1\], use_local_synchronization=True\)"
                                r"(.|\n)*belongs to the same number of groups"),
    "p2p size": (p2p_size_mismatch, CollectiveMismatchError, "send/recv mismatch"),
    "divergent FSDP modules": (divergent_fsdp_modules, CollectiveMismatchError, None),
}


@pytest.mark.parametrize("name", list(MISUSES))
def test_a_torch_distributed_misuse_is_the_same_named_error_on_both_backends(cluster, name):
    program, error, pattern = MISUSES[name]
    sim_error, sim_text = _outcome(simcomm.World(WORLD).run, program)
    real_error, real_text = _outcome(cluster.run, program)
    assert sim_error is error and real_error is error, (sim_text, real_text)
    for text in (sim_text, real_text):
        assert __file__ in text                    # the program's line, not torch's
        if pattern is not None:
            assert re.search(pattern, text), text
    assert cluster.run(lambda comm: dist.get_rank()) == list(range(WORLD))   # the workers serve on


def test_a_local_group_named_apart_is_the_same_error_on_unchecked_workers():
    """Members of a use_local_synchronization group that torch named differently would wait for
    each other forever under torchrun; unchecked workers compare the names in the world's store
    as virtual ranks do, and raise the same error, then serve on (a run that agrees after it)."""
    import real

    _, want_pattern = MISUSES["local group named apart"][1:]
    sim_error, sim_text = _outcome(simcomm.World(WORLD).run, local_group_named_apart)
    with real.Cluster(WORLD, backend="gloo", timeout=60.0, checked=False) as cluster:
        real_error, real_text = _outcome(cluster.run, local_group_named_apart)
        assert sim_error is real_error is CollectiveMismatchError, (sim_text, real_text)
        assert re.search(want_pattern, real_text) and __file__ in real_text, real_text
        assert cluster.run(agreeing) == simcomm.World(WORLD).run(agreeing) == [[3.0, 3.0]] * WORLD


def agreeing(comm):
    pair = dist.new_group([0, 1], use_local_synchronization=True)
    out = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(out, group=pair)
    return out.tolist()


# -- one sequence, one trace -------------------------------------------------------------

def mixed_collective(comm):
    t = torch.full((3,), float(dist.get_rank() + 1), dtype=torch.float64)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
        return t
    return comm.all_reduce(t)


def mixed_p2p(comm):
    if dist.get_rank() == 0:
        dist.send(torch.arange(3, dtype=torch.float64), 1)
        return None
    return comm.recv((3,), torch.float64, 0)


def test_comm_and_dist_calls_are_one_sequence_on_both_backends(cluster):
    want = torch.full((3,), 3.0, dtype=torch.float64)               # 1 + 2
    for outs in (cluster.run(mixed_collective), simcomm.World(WORLD).run(mixed_collective)):
        for out in outs:
            torch.testing.assert_close(out, want, rtol=0, atol=0)
    for outs in (cluster.run(mixed_p2p), simcomm.World(WORLD).run(mixed_p2p)):
        assert outs[0] is None
        torch.testing.assert_close(outs[1], torch.arange(3, dtype=torch.float64), rtol=0, atol=0)


def traced_program(comm):
    rank = dist.get_rank()
    t = torch.full((4,), float(rank), dtype=torch.float64)
    dist.all_reduce(t)
    gathered = torch.empty(8, dtype=torch.float64)
    dist.all_gather_into_tensor(gathered, t)
    pair = dist.new_group([0, 1])
    work = dist.broadcast(t, src=1, group=pair, async_op=True)
    work.wait()
    if rank == 0:
        dist.send(t[:2].contiguous(), 1)
    else:
        dist.recv(torch.empty(2, dtype=torch.float64), 0)
    out = torch.empty(4, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, gathered)
    return out


def _events(trace):
    return sorted((event.rank, event.op, event.group, event.step, event.shape, event.dtype, event.nbytes,
                   event.async_op) for event in trace.events if event.op != "compute")


def test_a_torch_distributed_program_has_the_same_trace_on_both_backends(cluster):
    world = simcomm.World(WORLD)
    sim_outs = world.run(traced_program)
    real_outs = cluster.run(traced_program)
    for got, want in zip(real_outs, sim_outs, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    sim_events, real_events = _events(world.trace), _events(cluster.trace)
    assert {event[1] for event in real_events} >= {"all_reduce", "all_gather", "subgroup", "broadcast",
                                                     "send", "recv", "reduce_scatter"}
    assert real_events == sim_events


# -- groups ----------------------------------------------------------------------------------

def world_sized_subgroup(comm):
    """Async ops on a subgroup with the world's members and on the world, issued in opposite
    orders on the two ranks: legal, since they are two groups."""
    sub = comm.subgroup([[0, 1]])
    x = torch.full((2,), float(comm.rank + 1), dtype=torch.float64)
    if comm.rank == 0:
        first, second = sub.all_reduce(x, async_op=True), comm.all_reduce(x * 10, async_op=True)
    else:
        second, first = comm.all_reduce(x * 10, async_op=True), sub.all_reduce(x, async_op=True)
    return first.wait(), second.wait()


def two_partitions_async(comm):
    """Async collectives on two partitions of 4 ranks, issued in different orders on different
    ranks (legal: each group sees its own calls in one order)."""
    rank = dist.get_rank()
    rows = dist.new_group([0, 1]), dist.new_group([2, 3])
    cols = dist.new_group([0, 2]), dist.new_group([1, 3])
    row, col = rows[rank // 2], cols[rank % 2]
    a = torch.full((2,), float(rank), dtype=torch.float64)
    b = a + 100
    if rank % 2 == 0:
        works = [dist.all_reduce(a, group=row, async_op=True), dist.all_reduce(b, group=col, async_op=True)]
    else:
        works = [dist.all_reduce(b, group=col, async_op=True), dist.all_reduce(a, group=row, async_op=True)]
    for work in works:
        work.wait()
    return a, b


def test_a_subgroup_with_the_worlds_members_is_a_group_of_its_own(cluster):
    want = (torch.full((2,), 3.0, dtype=torch.float64), torch.full((2,), 30.0, dtype=torch.float64))
    for outs in (cluster.run(world_sized_subgroup), simcomm.World(WORLD).run(world_sized_subgroup)):
        for first, second in outs:
            torch.testing.assert_close(first, want[0], rtol=0, atol=0)
            torch.testing.assert_close(second, want[1], rtol=0, atol=0)


def test_async_collectives_on_two_partitions_in_different_orders_pass_checked_mode(gloo_cluster):
    def reference(rank):
        row = [r for r in range(4) if r // 2 == rank // 2]
        col = [r for r in range(4) if r % 2 == rank % 2]
        return (torch.full((2,), float(sum(row)), dtype=torch.float64),
                torch.full((2,), float(sum(col)) + 200.0, dtype=torch.float64))

    for outs in (gloo_cluster(4, timeout=60.0).run(two_partitions_async),
                 simcomm.World(4).run(two_partitions_async)):
        for rank, (a, b) in enumerate(outs):
            want_a, want_b = reference(rank)
            torch.testing.assert_close(a, want_a, rtol=0, atol=0)
            torch.testing.assert_close(b, want_b, rtol=0, atol=0)


def _open_fds(comm):
    import gc
    gc.collect()                   # the store connections of earlier runs' checks are garbage
    return len(os.listdir("/proc/self/fd"))


def test_groups_made_by_a_run_are_not_kept_by_the_next(cluster):
    def program(comm):
        group = dist.new_group([0, 1])
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        return t.item(), len(dist.distributed_c10d._world.pg_map)

    first = cluster.run(program)
    before = cluster.run(_open_fds)
    outs = [cluster.run(program) for _ in range(20)]
    after = cluster.run(_open_fds)
    assert outs[-1] == first
    assert all(a <= b for a, b in zip(after, before)), (before, after)   # no fd per run (was 5)
    assert simcomm.World(WORLD).run(program) == [(2.0, 2)] * WORLD == [(t, 2) for t, _ in first]


# -- PREMUL_SUM: gloo has none; emulated as the factor times the input, then SUM -----------

def premul_program(comm, factor):
    rank = dist.get_rank()
    x = torch.arange(4, dtype=torch.float64) + rank
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(factor))
    full = torch.arange(4, dtype=torch.float64) * (rank + 1)
    out = torch.empty(2, dtype=torch.float64)
    dist.reduce_scatter_tensor(out, full, op=dist._make_nccl_premul_sum(factor))
    return x, out


@pytest.mark.parametrize("factor", [0.5, torch.tensor(0.25, dtype=torch.float64)])
def test_premul_sum_on_real_workers_equals_the_reference(cluster, factor):
    outs = cluster.run(premul_program, factor)
    scale = float(factor)
    ranks = torch.arange(WORLD, dtype=torch.float64)
    want_x = sum(scale * (torch.arange(4, dtype=torch.float64) + r) for r in ranks)
    want_full = sum(scale * torch.arange(4, dtype=torch.float64) * (r + 1) for r in ranks)
    for rank, (x, out) in enumerate(outs):
        torch.testing.assert_close(x, want_x, rtol=1e-15, atol=0)
        torch.testing.assert_close(out, want_full[2 * rank:2 * rank + 2], rtol=1e-15, atol=0)


# -- a mismatched async point-to-point pair moves nothing ----------------------------------

def async_p2p_size_mismatch(comm):
    if comm.rank == 0:
        comm.isend(torch.ones(3), 1).wait()
    else:
        comm.irecv((2,), torch.float32, 0).wait()


def dist_async_p2p_size_mismatch(comm):
    if dist.get_rank() == 0:
        dist.isend(torch.ones(3), 1).wait()
    else:
        dist.irecv(torch.empty(2), 0).wait()


def blocking_pair(comm):
    if comm.rank == 0:
        comm.send(torch.arange(4.0), 1)
        return None
    return comm.recv((4,), torch.float32, 0)


@pytest.mark.parametrize("program", [async_p2p_size_mismatch, dist_async_p2p_size_mismatch])
def test_a_mismatched_async_pair_is_caught_before_data_moves_and_the_workers_serve_on(cluster, program):
    pids = cluster.pids
    for run in (simcomm.World(WORLD).run, cluster.run):
        error, text = _outcome(run, program)
        assert error is CollectiveMismatchError, text
        assert "send/recv mismatch" in text and "float32 (3,)" in text and "float32 (2,)" in text
    assert cluster.pids == pids                     # nothing half-delivered: the same workers
    outs = cluster.run(blocking_pair, timeout=20)
    torch.testing.assert_close(outs[1], torch.arange(4.0), rtol=0, atol=0)


# -- one rule for handles never waited on -------------------------------------------------

def returns_a_functional_collective(comm):
    import torch.distributed._functional_collectives as funcol
    return funcol.all_gather_tensor(torch.full((2,), float(dist.get_rank())), 0, dist.group.WORLD)


def forgets_a_work(comm):
    dist.all_reduce(torch.ones(2), async_op=True)


def forgets_a_handle(comm):
    comm.all_reduce(torch.ones(2), async_op=True)
    return 1


def test_a_returned_functional_collective_is_used_on_both_backends(cluster):
    want = torch.tensor([0.0, 0.0, 1.0, 1.0])
    for outs in (cluster.run(returns_a_functional_collective),
                 simcomm.World(WORLD).run(returns_a_functional_collective)):
        for out in outs:
            assert type(out) is torch.Tensor
            torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("program", [forgets_a_work, forgets_a_handle])
def test_a_handle_never_waited_on_is_the_same_error_on_both_backends(cluster, program):
    for run in (simcomm.World(WORLD).run, cluster.run):
        with pytest.raises(simcomm.RankError) as info:
            run(program)
        assert isinstance(info.value.__cause__, simcomm.UnwaitedHandleError), info.value
        assert "without waiting on 1 handle(s)" in str(info.value) and __file__ in str(info.value)


# -- dtypes: the simulator accepts exactly what gloo accepts ---------------------------------

DTYPE_CASES = [(dtype, op) for dtype in ("float32", "float64", "bfloat16", "int16", "int32", "bool", "complex64")
               for op in ("sum", "avg", "max", "product")]


def dtype_table_program(comm):
    """Every (dtype, reduction) through comm.all_reduce, dist.all_reduce, comm.reduce_scatter and
    comm.gather; each outcome is the error class or "ok" (a refusal happens on every rank alike)."""
    outcomes = []
    for dtype_name, op in DTYPE_CASES:
        dtype = getattr(torch, dtype_name)
        x = torch.ones(4, dtype=dtype)
        calls = {"comm.all_reduce": lambda: comm.all_reduce(x, op=op),
                 "dist.all_reduce": lambda: dist.all_reduce(x.clone(), op=getattr(dist.ReduceOp, op.upper())),
                 "comm.reduce_scatter": lambda: comm.reduce_scatter(x, dim=0, op=op),
                 "comm.gather": lambda: comm.gather(x, dst=0, dim=0)}
        for name, call in calls.items():
            try:
                call()
                outcomes.append((name, dtype_name, op, "ok"))
            except (RuntimeError, ValueError) as error:
                outcomes.append((name, dtype_name, op, type(error).__name__))
    return outcomes


def test_the_dtype_table_is_the_same_on_the_simulator_and_on_gloo(cluster):
    sim = simcomm.World(WORLD).run(dtype_table_program)
    real_outs = cluster.run(dtype_table_program)
    assert sim == real_outs
    outcome = {entry[:3]: entry[3] for entry in sim[0]}
    assert outcome[("comm.all_reduce", "int16", "sum")] == "RuntimeError"          # gloo: Invalid scalar type
    assert outcome[("comm.all_reduce", "complex64", "sum")] == "ok"                # as real views
    assert outcome[("comm.all_reduce", "complex64", "max")] == "ValueError"        # supports_complex
    assert outcome[("dist.all_reduce", "complex64", "product")] == "ValueError"
    assert outcome[("comm.reduce_scatter", "complex64", "max")] == "RuntimeError"
    assert outcome[("comm.gather", "complex64", "sum")] == "RuntimeError"          # gloo has no complex gather
    assert outcome[("comm.all_reduce", "bfloat16", "product")] == "ok"
    assert outcome[("dist.all_reduce", "int32", "avg")] == "ValueError"           # on every rank, at once
    assert outcome[("dist.all_reduce", "float32", "avg")] == "ok"
