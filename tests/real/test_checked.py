"""real.checked: calls compared across ranks before data moves; mismatches named with their lines."""
from __future__ import annotations

import datetime
import re
import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import real
import real.checked_store
import simcomm
from real.checked import CheckedTransport
from real.checked_store import Checker

pytestmark = pytest.mark.real


class _FakeTransport:
    """A transport that moves nothing: each primitive records its call and returns a marker."""

    def __init__(self, rank: int, ranks: tuple[int, ...]):
        self.rank, self.ranks, self.world_size = rank, ranks, len(ranks)
        self.device = torch.device("cpu")
        self.calls: list[str] = []

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)

        def primitive(*args, **kwargs):
            self.calls.append(name)
            if name in ("isend", "irecv") or kwargs.get("async_op"):
                return SimpleNamespace(wait=lambda: name, is_completed=lambda: True)
            if name == "batch_isend_irecv":
                return [SimpleNamespace(wait=lambda: "batch") for _ in args[0]]
            if name == "subgroup":
                return _FakeTransport(self.rank, self.ranks)
            return name

        return primitive


def _on_ranks(world_size: int, program) -> list:
    """``program(checked_transport)`` on ``world_size`` threads sharing one in-process store;
    returns each rank's result or exception."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=10))
    ranks = tuple(range(world_size))
    outcomes: list = [None] * world_size

    def body(rank: int) -> None:
        checker = Checker(store, rank, world_size)
        transport = CheckedTransport(_FakeTransport(rank, ranks), checker)
        try:
            outcomes[rank] = program(transport)
            checker.ended()                                  # as a worker does when the program returns
        except Exception as error:  # collected for the assertions
            outcomes[rank] = error

    threads = [threading.Thread(target=body, args=(rank,)) for rank in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcomes


def test_matching_collectives_pass_and_unknown_names_pass_through():
    def program(t):
        x = torch.ones(4)
        return [t.all_reduce(x, "sum"), t.reduce(x, 0, "max"), t.scatter(x if t.rank == 1 else None, 1, 0),
                t.broadcast(x, src=0, async_op=True).wait(), t.compute(seconds=1.0), t.some_new_primitive(x),
                t.barrier(), t.rank]

    outcomes = _on_ranks(2, program)
    for rank, out in enumerate(outcomes):
        assert out == ["all_reduce", "reduce", "scatter", "broadcast", "compute",
                       "some_new_primitive", "barrier", rank]


@pytest.mark.parametrize("call, expected", [
    (lambda t: t.all_reduce(torch.ones(4), "max" if t.rank == 1 else "sum"), "op=max"),
    (lambda t: t.all_gather(torch.ones(4 + t.rank), 0), r"shape=\(5,\)"),
    (lambda t: t.broadcast(torch.ones(2), src=t.rank), "src=1"),
    (lambda t: t.reduce(torch.ones(2), t.rank, "sum"), "dst=1"),
    (lambda t: t.all_reduce(torch.ones(2, dtype=torch.float64 if t.rank else torch.float32), "sum"),
     "dtype=float64"),
    (lambda t: t.barrier() if t.rank else t.all_reduce(torch.ones(1), "sum"), "called barrier()"),
])
def test_collective_mismatch_names_both_ranks_and_lines(call, expected):
    outcomes = _on_ranks(2, call)
    for out in outcomes:
        assert isinstance(out, simcomm.CollectiveMismatchError), out
        message = str(out)
        assert "ranks of group [0, 1] disagree at collective step 0" in message
        assert "rank 0 called" in message and "rank 1 called" in message
        assert __file__ in message                          # each rank's program line
    assert any(re.search(expected, str(out)) for out in outcomes)


def test_all_to_all_single_split_sizes_must_pair_up():
    def program(t):
        # rank 0 sends 2 rows to rank 1, but rank 1 expects 1 row from rank 0
        if t.rank == 0:
            return t.all_to_all_single(torch.ones(3, 2), [1, 1], [1, 2])
        return t.all_to_all_single(torch.ones(2, 2), [1, 1], [1, 1])

    outcomes = _on_ranks(2, program)
    assert all(isinstance(out, simcomm.CollectiveMismatchError) for out in outcomes), outcomes
    assert ("all_to_all_single: rank 0 sends 2 rows to rank 1 (input_split_sizes=[1, 2] on rank 0) "
            "but rank 1 expects 1 from rank 0 (output_split_sizes=[1, 1] on rank 1)") in str(outcomes[0])

    def consistent(t):
        # rank 0 sends [2, 1] rows and receives [2, 3]; rank 1 sends [3, 0] and receives [1, 0]
        output_splits, input_splits = ([2, 3], [2, 1]) if t.rank == 0 else ([1, 0], [3, 0])
        return t.all_to_all_single(torch.ones(3, 2), output_splits, input_splits)

    assert _on_ranks(2, consistent) == ["all_to_all_single"] * 2


def test_point_to_point_pairs_compare_shape_and_dtype():
    def good(t):
        if t.rank == 0:
            return [t.send(torch.ones(3), 1), t.isend(torch.ones(2), 1).wait()]
        return [t.recv((3,), torch.float32, 0), t.irecv((2,), torch.float32, 0).wait()]

    assert _on_ranks(2, good) == [["send", "isend"], ["recv", "irecv"]]

    def too_large(t):
        return t.send(torch.ones(2), 1) if t.rank == 0 else t.recv((3,), torch.float32, 0)

    outcomes = _on_ranks(2, too_large)
    assert all(isinstance(out, simcomm.CollectiveMismatchError) for out in outcomes), outcomes
    assert "rank 0 sends float32 (2,)" in str(outcomes[1]) and "rank 1 expects float32 (3,)" in str(outcomes[1])

    def wrong_dtype_async(t):
        if t.rank == 0:
            return t.isend(torch.ones(2), 1).wait()
        return t.irecv((2,), torch.int32, 0).wait()

    outcomes = _on_ranks(2, wrong_dtype_async)
    assert all(isinstance(out, simcomm.CollectiveMismatchError) for out in outcomes), outcomes
    assert "expects int32 (2,)" in str(outcomes[0])


def test_batch_isend_irecv_exchange_does_not_wait_at_issue():
    def program(t):
        peer = 1 - t.rank
        ops = [SimpleNamespace(op="isend", tensor=torch.ones(2), peer=peer),
               SimpleNamespace(op="irecv", tensor=None, shape=(2,) if t.rank == 0 else (4,),
                               dtype=torch.float32, peer=peer)]
        return [handle.wait() for handle in t.batch_isend_irecv(ops)]

    outcomes = _on_ranks(2, program)
    # rank 0's isend (2 elements) meets rank 1's irecv of 4: both sides' wait() raises
    assert all(isinstance(out, simcomm.CollectiveMismatchError) for out in outcomes), outcomes
    assert "rank 1 expects float32 (4,)" in str(outcomes[1])


def test_a_rank_that_returned_is_named_instead_of_a_timeout():
    def skips_a_collective(t):
        return t.all_reduce(torch.ones(1), "sum") if t.rank == 0 else "returned"

    outcomes = _on_ranks(2, skips_a_collective)
    assert outcomes[1] == "returned" and isinstance(outcomes[0], simcomm.DeadlockError), outcomes
    assert "rank 1 of group [0, 1] returned from the program while rank 0 waits in all_reduce" in str(outcomes[0])

    def recv_nobody_sends(t):
        return t.recv((2,), torch.float32, 1) if t.rank == 0 else "returned"

    outcomes = _on_ranks(2, recv_nobody_sends)
    assert isinstance(outcomes[0], simcomm.DeadlockError) and "waits in recv(shape=(2,)" in str(outcomes[0])

    def subgroup_then_skip(t):
        sub = t.subgroup(((0, 1),))
        return sub.broadcast(torch.ones(1), 0) if t.rank == 1 else "returned"

    outcomes = _on_ranks(2, subgroup_then_skip)
    assert isinstance(outcomes[1], simcomm.DeadlockError), outcomes


def test_ranks_waiting_on_each_other_are_found():
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=3))
    outcomes: list = [None, None]

    def both_send_first(rank: int) -> None:
        transport = CheckedTransport(_FakeTransport(rank, (0, 1)), Checker(store, rank, 2))
        try:
            transport.send(torch.ones(2), 1 - rank)        # each waits for the other's recv
        except Exception as error:  # the store's timeout ends the threads
            outcomes[rank] = error

    assert real.checked_store.find_deadlock(store, [0, 1]) is None     # nobody waits yet
    threads = [threading.Thread(target=both_send_first, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    message = None
    for _ in range(100):
        message = real.checked_store.find_deadlock(store, [0, 1])
        if message is not None:
            break
        threading.Event().wait(0.02)
    for thread in threads:
        thread.join(10)
    assert message is not None and "every running rank waits for another ([0, 1])" in message
    assert "rank 0 waits in send(shape=(2,), dtype=float32) at" in message and "for rank 1" in message
    assert __file__ in message
    assert all(isinstance(out, dist.DistStoreError) for out in outcomes)  # the threads were really stuck


def test_subgroups_are_checked_too():
    def program(t):
        sub = t.subgroup(((0, 1),))
        return sub.all_reduce(torch.ones(1), "sum" if t.rank else "max")

    outcomes = _on_ranks(2, program)
    assert all(isinstance(out, simcomm.CollectiveMismatchError) for out in outcomes)
    assert "collective step 1" in str(outcomes[0])          # step 0 was the subgroup call itself


# -- on real processes ---------------------------------------------------------------------

def _max_vs_sum(comm):
    x = torch.ones(2) * (comm.rank + 1)
    return comm.all_reduce(x, op="max" if comm.rank == 0 else "sum")


def _recv_too_large(comm):
    if comm.rank == 0:
        comm.send(torch.ones(2), dst=1)
        return None
    return comm.recv((3,), torch.float32, src=0)


def _recv_wrong_dtype(comm):
    if comm.rank == 0:
        comm.send(torch.ones(2), dst=1)
        return None
    return comm.recv((2,), torch.int32, src=0)


def _both_send_first(comm):
    comm.send(torch.ones(2), dst=1 - comm.rank)
    return comm.recv((2,), torch.float32, src=1 - comm.rank)


def _skips_the_all_reduce_on_rank_one(comm):
    if comm.rank == 0:
        return comm.all_reduce(torch.ones(1))
    return None


@pytest.fixture(scope="module")
def cluster(gloo_cluster):
    return gloo_cluster(2, timeout=30)


@pytest.mark.timeout(90)
def test_real_mismatches_raise_at_once_and_keep_the_workers(cluster):
    cluster.run(lambda comm: comm.barrier())
    pids = cluster.pids
    with pytest.raises(simcomm.CollectiveMismatchError) as info:
        cluster.run(_max_vs_sum)
    message = str(info.value)
    assert "op=max" in message and "op=sum" in message and "_max_vs_sum" in message
    assert "real/test_checked.py" in message
    for program, expected in ((_recv_too_large, "rank 1 expects float32 (3,)"),
                              (_recv_wrong_dtype, "rank 1 expects int32 (2,)")):
        with pytest.raises(simcomm.CollectiveMismatchError, match=re.escape(expected)):
            cluster.run(program)
    with pytest.raises(simcomm.DeadlockError, match="rank 1 of group .0, 1. returned from the program"):
        cluster.run(_skips_the_all_reduce_on_rank_one)
    assert cluster.pids == pids                              # nothing moved: the workers stay
    assert cluster.run(lambda comm: comm.all_reduce(torch.ones(1)).item()) == [2.0, 2.0]
    with pytest.raises(simcomm.DeadlockError, match="rank 1 waits in send.* for rank 0"):
        cluster.run(_both_send_first)                        # as on the simulator, not a timeout
    assert cluster.run(lambda comm: comm.all_reduce(torch.ones(1)).item()) == [2.0, 2.0]


@pytest.mark.timeout(90)
def test_unchecked_cluster_runs_without_comparing():
    with real.Cluster(2, backend="gloo", timeout=30, checked=False) as unchecked:
        # gloo reduces with rank 0's op; the simulator and the checked mode refuse the program
        outs = unchecked.run(_max_vs_sum)
        assert len(outs) == 2 and all(isinstance(out, torch.Tensor) for out in outs)


def test_every_extractor_has_the_signature_of_its_transport_primitive():
    """A call whose arguments an extractor cannot take runs unchecked: the table must follow
    the transport's signatures exactly, or checked mode silently checks nothing."""
    import inspect

    from real.checked_calls import EXTRACTORS
    from real.transport import DistTransport

    for name, extractor in EXTRACTORS.items():
        primitive = getattr(DistTransport, name, None)
        if primitive is None:          # isend/irecv: the communicator calls send/recv(async_op=True)
            continue
        expected = [p.name for p in inspect.signature(primitive).parameters.values()][1:]   # no self
        assert [p.name for p in inspect.signature(extractor).parameters.values()] == expected, name


def test_a_checked_async_call_is_traced_when_and_where_the_program_issued_it(gloo_cluster):
    """Checked mode issues an async collective from a thread of its own once the ranks agree; its
    record still carries the program's issue time and phase, so the modelled overlap of bucketed
    gradient all-reduces fired from backward hooks is the simulator's."""
    from simcomm.parallel import data as dp

    x, y = dp.make_data(32)
    cluster = gloo_cluster(4)
    cluster.run(dp.bucketed_grads, x, y, 1 << 20)
    world = simcomm.World(4)
    world.run(dp.bucketed_grads, x, y, 1 << 20)
    assert {e.phase for e in cluster.trace.events if e.op == "all_reduce"} == {"backward"}
    assert dp.overlap_of(cluster.trace) == pytest.approx(dp.overlap_of(world.trace))
    assert dp.overlap_of(cluster.trace)["hidden"] > 0
