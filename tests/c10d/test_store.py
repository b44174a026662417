"""The c10d store of a run on virtual ranks (simcomm.sim.store), and c10d's store barrier.

The reference for the store's answers is torch's own in-process ``HashStore``;
for the barrier (``TORCH_DIST_INIT_BARRIER=1``), the single-device sums and gloo
processes running the same program.
"""
from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist

import simcomm
from simcomm import DeadlockError

from ..foreign_thread import ForeignThread

WORLD = 4


def _default_store():
    return dist.distributed_c10d._get_default_store()


def _store_script(store) -> list:
    """One rank's sequence of store calls; what each returned (bytes, ints, bools)."""
    return [
        store.set("a", "1"), store.get("a"), store.add("n", 5), store.add("n", -2), store.get("n"),
        store.compare_set("a", "1", "2"), store.compare_set("a", "1", "3"),
        store.compare_set("absent", "x", "y"), store.check(["absent"]),
        store.compare_set("fresh", "", "z"), store.get("fresh"),
        store.append("log", "ab"), store.append("log", b"cd"), store.get("log"),
        store.multi_set(["k1", "k2"], ["v1", b"v2"]), store.multi_get(["k1", "k2"]),
        store.check(["a", "k1", "k2"]), store.check(["a", "k3"]),
        store.set("raw", b"\xff\x00"), store.get("raw"),
    ]


def test_the_store_answers_as_torchs_hash_store():
    def program(comm):
        return _store_script(dist.PrefixStore(f"r{comm.rank}", _default_store()))

    reference = _store_script(dist.PrefixStore("r0", dist.HashStore()))
    assert simcomm.World(2).run(program) == [reference, reference]


def test_a_get_waits_visibly_for_the_rank_that_sets_the_key():
    def program(comm):
        store = _default_store()
        if comm.rank == 0:
            value = store.get("ready")          # blocks: the turn passes to the other ranks
            order = store.add("order", 1)
        else:
            order = store.add("order", 1)
            if comm.rank == WORLD - 1:
                store.set("ready", f"from {comm.rank}")
            value = store.get("ready")
        store.wait(["ready"])
        return value, order

    outs = simcomm.World(WORLD).run(program)
    assert outs[0] == (b"from 3", WORLD)     # rank 0 ran on once rank 3 had set the key
    assert sorted(order for _, order in outs[1:]) == [1, 2, 3]


def test_a_key_no_rank_sets_is_a_deadlock_naming_the_key():
    def program(comm):
        _default_store().wait(["never-set"])

    with pytest.raises(DeadlockError) as info:
        simcomm.World(2).run(program, timeout=60)
    message = str(info.value)
    assert "rank 0 waits in store.wait for key" in message and "never-set" in message
    assert "rank 1 waits in store.wait" in message


def test_the_store_refuses_a_thread_no_rank_started_and_adding_to_text():
    def program(comm):
        store = _default_store()
        outcome = helper.call(lambda: store.set("x", "1"))
        errors = [str(outcome.get("error"))]
        mine: dict = {}
        thread = threading.Thread(target=lambda: mine.update(value=store.set("y", "2") or store.get("y")))
        thread.start()                      # a thread the rank started is the rank's
        thread.join(10)
        assert mine == {"value": b"2"}, mine
        store.set("text", "abc")
        try:
            store.add("text", 1)
        except ValueError as error:
            errors.append(str(error))
        return errors

    helper = ForeignThread("helper")       # started before the run: no rank's thread
    try:
        errors = simcomm.World(1).run(program)[0]
    finally:
        helper.close()
    assert "store.set from thread 'helper'" in errors[0] and "rank" in errors[0]
    assert "store.add" in errors[1] and "holds b'abc', not an integer" in errors[1]


# -- TORCH_DIST_INIT_BARRIER: c10d's store barrier after init_process_group and new_group --------

def barrier_program(comm) -> list:
    """The default group, a world-synchronised new_group and its collective, float64; and
    the variable as this rank sees it."""
    rank = dist.get_rank()
    x = torch.arange(3, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(x)
    pair = dist.new_group([0, 1])
    y = torch.full((2,), float(rank + 1), dtype=torch.float64)
    if pair is not None:
        dist.all_reduce(y, group=pair)
    dist.barrier()
    return [x, y, os.environ.get("TORCH_DIST_INIT_BARRIER")]


def barrier_reference(world_size: int, barrier: str) -> list[list]:
    """The same sums on one device, without communication."""
    x = sum(torch.arange(3, dtype=torch.float64) * (rank + 1) for rank in range(world_size))
    pair = torch.full((2,), 3.0, dtype=torch.float64)   # ranks 0 and 1: 1 + 2
    return [[x, pair if rank < 2 else torch.full((2,), float(rank + 1), dtype=torch.float64), barrier]
            for rank in range(world_size)]


def _assert_outputs(outs, reference) -> None:
    for got, want in zip(outs, reference, strict=True):
        *tensors, variable = got
        *wanted, wanted_variable = want
        assert variable == wanted_variable
        for g, w in zip(tensors, wanted, strict=True):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("barrier", ["0", "1"])
def test_init_barrier_variable_on_virtual_ranks(monkeypatch, barrier):
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", barrier)
    _assert_outputs(simcomm.World(WORLD).run(barrier_program, timeout=60), barrier_reference(WORLD, barrier))


@pytest.mark.parametrize("barrier", ["0", "1"])
def test_init_barrier_with_ranks_that_touch_torch_distributed_late_or_never(monkeypatch, barrier):
    # the default group is created on a rank's first use of torch.distributed; the run is its
    # rendezvous, so its barrier does not wait for ranks that never use it (a real process
    # joins its group at init_process_group, before any such branch)
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", barrier)

    def program(comm):
        if comm.rank % 2 == 0:
            return dist.get_rank(), dist.get_world_size()
        return None

    assert simcomm.World(WORLD).run(program, timeout=60) == [(0, WORLD), None, (2, WORLD), None]


def test_init_barrier_after_destroy_and_init_again(monkeypatch):
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")

    def program(comm):
        dist.barrier()
        dist.destroy_process_group()
        dist.init_process_group("gloo")
        x = torch.ones(1, dtype=torch.float64) * (comm.rank + 1)
        dist.all_reduce(x)
        return x

    want = torch.tensor([sum(range(1, WORLD + 1))], dtype=torch.float64)
    for out in simcomm.World(WORLD).run(program, timeout=60):
        torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.real
@pytest.mark.parametrize("barrier", ["0", "1"])
def test_init_barrier_variable_on_gloo_processes_gives_the_same(monkeypatch, barrier):
    import real

    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", barrier)   # fresh workers take it at start
    real_outs = real.run(barrier_program, world_size=WORLD, backend="gloo", timeout=120)
    _assert_outputs(real_outs, barrier_reference(WORLD, barrier))
    _assert_outputs(simcomm.World(WORLD).run(barrier_program, timeout=60), real_outs)
