"""The "simcomm" c10d backend: dist.* on virtual ranks, checked against one device in float64."""
from __future__ import annotations

import inspect
import threading
import time

import pytest
import torch
import torch.distributed as dist

import simcomm
from simcomm import CollectiveMismatchError, DeadlockError, RankError

from .. import torch_dist_programs as progs

WORLD = progs.WORLD


def _assert_same(got: dict, want: dict, rank: int) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype, (rank, name)
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-12, msg=f"rank {rank} {name}")


def rank_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("simcomm-rank")]


def assert_clean() -> None:
    """No rank thread, no process group and no per-thread registry left behind."""
    from simcomm.sim import dist_world as c10d_world
    assert rank_threads() == []
    assert not dist.is_initialized()
    assert c10d_world._active == 0


# -- the default group ------------------------------------------------------------------------

def test_every_rank_has_the_world_as_default_group():
    def program(comm):
        group = dist.group.WORLD
        return (dist.is_initialized(), dist.get_rank(), dist.get_world_size(), comm.rank,
                dist.get_backend(), dist.get_process_group_ranks(group))

    outs = simcomm.World(WORLD).run(program)
    for rank, (initialized, dist_rank, size, comm_rank, backend, ranks) in enumerate(outs):
        assert initialized and dist_rank == comm_rank == rank and size == WORLD
        assert backend == "simcomm" and ranks == list(range(WORLD))


def test_nothing_leaks_into_the_main_thread_or_the_next_run():
    hook = __import__("sys").excepthook

    def program(comm, tag):
        group = dist.new_group([0, 1])
        count = len(dist.distributed_c10d._world.pg_map)
        return tag, dist.get_rank(), count, group is dist.GroupMember.NON_GROUP_MEMBER

    world_a, world_b = simcomm.World(WORLD), simcomm.World(2)
    first = world_a.run(program, "a1")
    assert world_b.run(program, "b") == [("b", 0, 2, False), ("b", 1, 2, False)]
    again = world_a.run(program, "a2")
    assert [o[1:] for o in first] == [o[1:] for o in again]
    assert first == [("a1", r, 2 if r < 2 else 1, r >= 2) for r in range(WORLD)]
    assert not dist.is_initialized()
    assert __import__("sys").excepthook is hook
    assert_clean()


def test_a_program_without_torch_distributed_creates_no_process_group():
    def program(comm):
        return comm.all_reduce(torch.ones(2)).sum()

    world = simcomm.World(WORLD)
    assert [float(v) for v in world.run(program)] == [8.0] * WORLD
    assert [e.op for e in world.trace.filter(rank=0)] == ["all_reduce"]
    assert not dist.is_initialized()


# -- dist.* collectives ----------------------------------------------------------------------

def test_every_dist_collective_matches_the_single_device_reference():
    outs = simcomm.World(WORLD).run(progs.collectives_program)
    for rank, (got, want) in enumerate(zip(outs, progs.collectives_reference(), strict=True)):
        _assert_same(got, want, rank)


def test_dist_and_comm_calls_share_the_world_sequence():
    def program(comm):
        t = torch.ones(3)
        dist.all_reduce(t)
        u = comm.all_gather(t, dim=0)
        dist.broadcast(u, src=1)
        return u

    world = simcomm.World(WORLD)
    outs = world.run(program)
    assert all(torch.equal(o, torch.full((12,), 4.0)) for o in outs)
    assert [(e.step, e.op) for e in world.trace.filter(rank=2)] == [
        (0, "all_reduce"), (1, "all_gather"), (2, "broadcast")]


def test_subgroups_follow_new_group_and_new_subgroups():
    def program(comm):
        rank = dist.get_rank()
        pair = dist.new_group([3, 1])          # torch sorts the ranks: group rank 0 is global 1
        t = torch.tensor([float(rank)])
        if rank in (1, 3):
            dist.all_reduce(t, group=pair)
            group_rank = dist.get_group_rank(pair, rank)
        else:
            group_rank = -1
        sub, _ = dist.new_subgroups(group_size=2)
        u = torch.tensor([float(rank)])
        dist.all_reduce(u, group=sub, op=dist.ReduceOp.MAX)
        return float(t), group_rank, float(u)

    world = simcomm.World(WORLD)
    outs = world.run(program)
    assert outs == [(0.0, -1, 1.0), (4.0, 0, 1.0), (2.0, -1, 3.0), (4.0, 1, 3.0)]
    groups = {e.group for e in world.trace if e.op == "all_reduce"}
    assert groups == {(1, 3), (0, 1), (2, 3)}


def test_functional_collectives_run_on_the_simulator():
    import torch.distributed._functional_collectives as funcol

    def program(comm):
        rank = dist.get_rank()
        x = progs.rank_input(rank)
        reduced = funcol.all_reduce(x, "sum", dist.group.WORLD)
        gathered = funcol.all_gather_tensor(x, 0, dist.group.WORLD)
        scattered = funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD)
        return [torch.as_tensor(t) + 0 for t in (reduced, gathered, scattered)]

    world = simcomm.World(WORLD)
    outs = world.run(program)
    xs = [progs.rank_input(r) for r in range(WORLD)]
    total = torch.stack(xs).sum(0)
    for rank, (reduced, gathered, scattered) in enumerate(outs):
        torch.testing.assert_close(reduced, total)
        torch.testing.assert_close(gathered, torch.cat(xs))
        torch.testing.assert_close(scattered, total[rank: rank + 1])
    assert {e.op for e in world.trace} == {"all_reduce", "all_gather", "reduce_scatter"}


def test_async_op_work_writes_the_buffer_on_wait_and_its_future_holds_it():
    def program(comm):
        t = torch.ones(2)
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        return work.is_completed(), t, work.get_future().value()[0] is t

    for done, t, same in simcomm.World(WORLD).run(program):
        assert done and same and torch.equal(t, torch.full((2,), 4.0))


# -- torch.distributed.nn.functional -------------------------------------------------------------

def _nn_reference(op_name: str):
    xs = [progs.rank_input(r, (5,)).requires_grad_() for r in range(WORLD)]
    y = {"sum": lambda s: s.sum(0), "max": lambda s: s.amax(0)}[op_name](torch.stack(xs))
    sum((y * progs.rank_input(50 + r, (5,))).sum() for r in range(WORLD)).backward()
    return y.detach(), [x.grad for x in xs]


def test_nn_functional_all_reduce_sum_forward_and_backward():
    outs = simcomm.World(WORLD).run(progs.nn_functional_program, "sum")
    y, grads = _nn_reference("sum")
    for rank, (got_y, got_grad) in enumerate(outs):
        torch.testing.assert_close(got_y, y)
        torch.testing.assert_close(got_grad, grads[rank])


def test_nn_functional_all_reduce_max_backward_differs_from_the_exact_rule():
    """Upstream's backward of a MAX all-reduce all-reduces the gradient with MAX too: every
    rank gets the largest upstream gradient, whoever held the maximum. simcomm's rule sends
    the summed gradient to the rank holding the maximum (the single-device gradient)."""
    outs = simcomm.World(WORLD).run(progs.nn_functional_program, "max")
    y, exact = _nn_reference("max")
    upstream = torch.stack([progs.rank_input(50 + r, (5,)) for r in range(WORLD)]).amax(0)
    for rank, (got_y, got_grad) in enumerate(outs):
        torch.testing.assert_close(got_y, y)
        torch.testing.assert_close(got_grad, upstream)     # what torch.distributed.nn computes
        assert not torch.allclose(got_grad, exact[rank])   # ... which is not the gradient

    def simcomm_rule(comm):
        x = progs.rank_input(comm.rank, (5,)).requires_grad_()
        comm.all_reduce(x, op="max").mul(progs.rank_input(50 + comm.rank, (5,))).sum().backward()
        return x.grad

    for rank, grad in enumerate(simcomm.World(WORLD).run(simcomm_rule)):
        torch.testing.assert_close(grad, exact[rank])


@pytest.mark.parametrize("op", progs.NN_OPS)
def test_nn_functional_collectives_forward_and_backward(op):
    outs = simcomm.World(WORLD).run(progs.nn_functional_collective_program, op)
    want_outs, want_grads = progs.nn_functional_collective_reference(op)
    for rank, (out, grad) in enumerate(outs):
        torch.testing.assert_close(out, want_outs[rank])
        torch.testing.assert_close(grad, want_grads[rank])


# -- trace ----------------------------------------------------------------------------------

def test_backward_calls_are_traced_as_backward_with_the_program_line():
    world = simcomm.World(WORLD)
    world.run(progs.nn_functional_program, "sum")
    assert [(e.op, e.phase) for e in world.trace.filter(rank=1)] == [
        ("all_reduce", "forward"), ("all_reduce", "backward")]
    event = world.trace.filter(rank=1).events[0]
    assert event.group == (0, 1, 2, 3) and event.shape == (5,) and event.dtype == "float64"
    assert event.sent == {0: 20, 2: 20, 3: 20}


# -- errors ----------------------------------------------------------------------------------

def test_the_classic_hang_is_a_deadlock_error_naming_the_line():
    def program(comm):
        t = torch.ones(2)
        if dist.get_rank() == 0:
            dist.all_reduce(t)
        return t

    start = time.perf_counter()
    with pytest.raises(DeadlockError) as info:
        simcomm.World(WORLD).run(program)
    assert time.perf_counter() - start < 5.0   # a hang would run into the test timeout instead
    message = str(info.value)
    assert "rank 0 waits in all_reduce" in message
    assert "test_c10d.py" in message and "in program" in message
    for rank in (1, 2, 3):
        assert f"rank {rank} has finished" in message
    assert_clean()


def test_two_groups_of_the_same_ranks_used_apart_are_a_deadlock_with_a_note():
    """Ranks 0 and 1 make two groups of the same ranks and each all-reduces in another one: the
    groups never meet. The DeadlockError says so in a note."""
    def program(comm):
        first, second = dist.new_group([0, 1]), dist.new_group([0, 1])
        t = torch.ones(2)
        if dist.get_rank() in (0, 1):
            dist.all_reduce(t, group=first if dist.get_rank() == 0 else second)
        return t

    with pytest.raises(DeadlockError) as info:
        simcomm.World(3).run(program)
    message = str(info.value)
    assert "rank 0 waits in all_reduce" in message and "rank 1 waits in all_reduce" in message
    assert "note: rank 0 and rank 1 wait at step 0 of 2 different groups of the same ranks [0, 1]" in message
    assert "use_local_synchronization" not in message     # not groups made by their members only
    assert_clean()


def test_groups_of_the_same_ranks_made_alike_meet():
    """The same groups made in the same order on every rank (the note's advice): no deadlock,
    and no note where ranks simply wait in one group."""
    def program(comm):
        dist.new_group([0, 1])
        pair = dist.new_group([1, 2])
        t = torch.ones(2) * (dist.get_rank() + 1)
        if dist.get_rank() in (1, 2):
            dist.all_reduce(t, group=pair)
        return t

    out = simcomm.World(3).run(program)
    assert [t.tolist() for t in out] == [[1.0, 1.0], [5.0, 5.0], [5.0, 5.0]]


def test_a_mismatched_all_gather_into_tensor_names_each_rank_and_line():
    def program(comm):
        rank = dist.get_rank()
        x = torch.ones(3 if rank == 2 else 2)
        out = torch.empty(x.numel() * WORLD)
        dist.all_gather_into_tensor(out, x)

    with pytest.raises(CollectiveMismatchError) as info:
        simcomm.World(WORLD).run(program)
    message = str(info.value)
    assert "shape=(2,)" in message and "shape=(3,)" in message and "rank 2 called all_gather" in message
    assert message.count("test_c10d.py") == 2 and "site-packages" not in message
    assert_clean()


def test_a_rank_error_is_reported_and_the_next_run_starts_clean():
    def failing(comm):
        dist.new_group([0, 1])
        if dist.get_rank() == 3:
            raise KeyError("boom")
        dist.barrier()

    world = simcomm.World(WORLD)
    with pytest.raises(RankError) as info:
        world.run(failing)
    assert info.value.rank == 3 and isinstance(info.value.__cause__, KeyError)
    assert_clean()
    outs = world.run(lambda comm: (len(dist.distributed_c10d._world.pg_map), dist.get_rank()))
    assert outs == [(1, r) for r in range(WORLD)]


def test_unsupported_operations_raise_not_implemented_naming_them():
    def tagged(comm):
        if dist.get_rank() == 0:
            dist.send(torch.ones(2), dst=1, tag=7)
        else:
            dist.recv(torch.empty(2), src=0, tag=7)

    with pytest.raises(RankError) as info:
        simcomm.World(2).run(tagged)
    assert isinstance(info.value.__cause__, NotImplementedError) and "tag=7" in str(info.value.__cause__)


def test_bad_buffers_name_the_op_and_the_sizes():
    def program(comm):
        dist.all_gather_into_tensor(torch.empty(5), torch.ones(2))

    with pytest.raises(RankError) as info:
        simcomm.World(2).run(program)
    assert isinstance(info.value.__cause__, ValueError)
    assert "all_gather_into_tensor" in str(info.value.__cause__) and "4" in str(info.value.__cause__)


def test_a_module_imported_on_a_rank_thread_does_not_capture_that_ranks_group(tmp_path, monkeypatch):
    """torch evaluates ``group=group.WORLD`` defaults at import time; a module first imported
    inside a run must see the process's state (no group), not the importing rank's."""
    (tmp_path / "c10d_import_probe.py").write_text(
        "import torch.distributed as dist\nCAPTURED = dist.group.WORLD\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def program(comm):
        import c10d_import_probe
        return c10d_import_probe.CAPTURED is None, dist.group.WORLD is not None

    assert simcomm.World(2).run(program) == [(True, True), (True, True)]


def test_coalesced_variants():
    import torch.distributed._functional_collectives as funcol

    def program(comm):
        rank = dist.get_rank()
        a, b = progs.rank_input(rank, (2,)), progs.rank_input(rank, (3,))
        gathered = funcol.all_gather_into_tensor_coalesced([a, b], dist.group.WORLD)
        scattered = funcol.reduce_scatter_tensor_coalesced(
            [progs.rank_input(rank, (8,)), progs.rank_input(rank, (4,))], "sum", [0, 0], dist.group.WORLD)
        x, y = a.clone(), b.clone()
        with dist._coalescing_manager():
            dist.all_reduce(x)
            dist.all_reduce(y)
        return [t + 0 for t in (*gathered, *scattered)] + [x, y]

    world = simcomm.World(WORLD)
    outs = world.run(program)
    inputs = {shape: [progs.rank_input(r, (shape,)) for r in range(WORLD)] for shape in (2, 3, 8, 4)}
    for rank, got in enumerate(outs):
        want = [torch.cat(inputs[2]), torch.cat(inputs[3]),
                torch.stack(inputs[8]).sum(0)[2 * rank: 2 * rank + 2],
                torch.stack(inputs[4]).sum(0)[rank: rank + 1],
                torch.stack(inputs[2]).sum(0), torch.stack(inputs[3]).sum(0)]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w)
    assert [op for _, op, _ in world.trace.ops()] == ["all_gather"] * 2 + ["reduce_scatter"] * 2 + ["all_reduce"] * 2


@pytest.mark.parametrize("barrier", [None, "1"], ids=["default", "TORCH_DIST_INIT_BARRIER=1"])
def test_a_group_of_another_backend_is_refused_not_hung(monkeypatch, barrier):
    if barrier is not None:
        monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", barrier)

    def program(comm):
        dist.new_group([0, 1], backend="gloo")

    with pytest.raises(RankError) as info:
        simcomm.World(2).run(program, timeout=60)
    assert isinstance(info.value.__cause__, NotImplementedError)
    assert "backend='gloo'" in str(info.value.__cause__)
    assert_clean()


# -- point to point ---------------------------------------------------------------------------

def test_isend_irecv_between_two_ranks():
    def program(comm):
        rank = dist.get_rank()
        if rank == 0:
            work = dist.isend(progs.rank_input(0), dst=1)
            work.wait()
            return None
        buffer = torch.empty(4, 3, dtype=torch.float64)
        dist.irecv(buffer, src=0).wait()
        return buffer

    world = simcomm.World(2)
    outs = world.run(program)
    torch.testing.assert_close(outs[1], progs.rank_input(0))
    assert [(e.rank, e.op, e.nbytes) for e in world.trace] == [(0, "send", 96), (1, "recv", 96)]


def test_batch_isend_irecv_ring():
    outs = simcomm.World(WORLD).run(progs.batch_isend_irecv_ring)
    for rank, got in enumerate(outs):
        torch.testing.assert_close(got, progs.rank_input((rank - 1) % WORLD))


def test_both_ranks_sending_first_is_a_deadlock_error_naming_the_lines():
    """dist.send blocks until the peer receives: two ranks that both send first wait for
    each other forever on real processes; here it is an error within a second."""
    def program(comm):
        rank = dist.get_rank()
        received = torch.empty(2)
        dist.send(torch.ones(2), dst=1 - rank)
        dist.recv(received, src=1 - rank)
        return received

    start = time.perf_counter()
    with pytest.raises(DeadlockError) as info:
        simcomm.World(2).run(program)
    assert time.perf_counter() - start < 5.0   # a hang would run into the test timeout instead
    message = str(info.value)
    line = inspect.getsourcelines(program)[1] + 3          # the dist.send line
    for rank in (0, 1):
        assert f"rank {rank} waits in send to rank {1 - rank} (float32 (2,)) at " \
               f"{__file__}:{line} in program" in message, message
    assert "site-packages" not in message
    assert_clean()


def test_runs_after_pytorchs_threaded_process_group_replaced_the_state():
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    def program(comm):
        t = torch.ones(2)
        dist.all_reduce(t)
        return t

    assert all(torch.equal(t, torch.full((2,), 2.0)) for t in simcomm.World(2).run(program))
    mtpg._install_threaded_pg()
    try:
        outs = simcomm.World(2).run(program)
    finally:
        mtpg._uninstall_threaded_pg()
    assert all(torch.equal(t, torch.full((2,), 2.0)) for t in outs)
    assert all(torch.equal(t, torch.full((2,), 2.0)) for t in simcomm.World(2).run(program))
    assert_clean()


def test_a_0d_tensor_keeps_its_shape_in_the_buffer_and_the_trace():
    """A 0-d loss is reported as shape (), not the one-element buffer (1,), as gloo takes it."""
    world = simcomm.World(progs.WORLD)
    outs = world.run(progs.zero_d_program)
    for got, want in zip(outs, progs.zero_d_reference(), strict=True):
        for name in want:
            assert got[name].shape == () and torch.equal(got[name], want[name]), name
    shapes = {(e.op, e.shape) for e in world.trace.events}
    assert shapes == {("all_reduce", ()), ("broadcast", ()), ("reduce", ())}, shapes


def test_a_mismatch_report_names_a_0d_tensors_shape():
    def log_loss_on_rank_0(comm):
        if comm.rank == 0:
            dist.all_reduce(torch.tensor(1.0))
        dist.all_reduce(torch.ones(10))

    with pytest.raises(CollectiveMismatchError, match=r"all_reduce\(shape=\(\), dtype=float32"):
        simcomm.World(2).run(log_loss_on_rank_0)
