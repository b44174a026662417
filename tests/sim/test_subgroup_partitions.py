"""comm.subgroup on virtual ranks: checked and traced like a collective, but no rank waits in it,
so programs that build their own partition lists need not hold them all at once."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.checks import PartitionTable
from simcomm.errors import CollectiveMismatchError, DeadlockError


def test_membership_index_by_hand():
    table = PartitionTable()
    normalized = table.check("subgroup", [[0, 2], [3, 1]], 4, 0)
    assert normalized == ((0, 2), (1, 3))
    assert [table.membership(normalized, r) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]


LOG: list[tuple[str, int]] = []    # shared by the virtual ranks (arguments are copied per rank)


def _own_lists(comm):
    parts = [list(range(base, base + 2)) for base in range(0, comm.world_size, 2)]
    LOG.append(("called", comm.rank))
    sub = comm.subgroup(parts)
    LOG.append(("returned", comm.rank))
    del parts                                     # the rank's own lists: garbage from here on
    out = sub.all_reduce(torch.ones(1) * comm.rank)
    return sub.rank, sub.world_size, out.item()


def test_each_rank_builds_its_partition_and_goes_on_before_the_others_call():
    LOG.clear()
    outs = simcomm.World(6).run(_own_lists)
    log = list(LOG)
    assert outs == [(r % 2, 2, 4.0 * (r // 2) + 1.0) for r in range(6)]
    # a rank returns from subgroup before the last rank has called it: it never held its lists
    # while waiting for the whole world
    last_call = max(i for i, (what, _) in enumerate(log) if what == "called")
    assert any(what == "returned" and i < last_call for i, (what, _) in enumerate(log))


def _no_wait(comm):
    # rank 1 receives from rank 0 before it joins; rank 0 joins first: no rank waits in subgroup
    if comm.rank == 1:
        got = comm.recv((1,), torch.float32, 0)
        sub = comm.subgroup([[0, 1]])
    else:
        sub = comm.subgroup([[0, 1]])
        comm.send(torch.ones(1), 1)
        got = torch.zeros(1)
    return sub.all_reduce(got).item()


def test_a_rank_goes_on_after_subgroup():
    assert simcomm.World(2).run(_no_wait) == [1.0, 1.0]


def test_different_partitions_still_abort_naming_both_calls():
    def program(comm):
        comm.subgroup([[0, 1], [2, 3]] if comm.rank else [[0, 2], [1, 3]])
    with pytest.raises(CollectiveMismatchError, match="subgroup"):
        simcomm.World(4).run(program)


def test_a_rank_that_skips_subgroup_is_a_deadlock_at_the_next_collective():
    def program(comm):
        if comm.rank != 3:
            sub = comm.subgroup([[0, 1], [2, 3]])
            sub.all_reduce(torch.ones(1))
    with pytest.raises(DeadlockError):
        simcomm.World(4).run(program)


def test_subgroups_are_traced_once_per_rank():
    world = simcomm.World(4)
    world.run(lambda comm: comm.subgroup([[0, 1], [2, 3]]).all_reduce(torch.ones(1)))
    assert sorted(e.rank for e in world.trace.events if e.op == "subgroup") == [0, 1, 2, 3]
