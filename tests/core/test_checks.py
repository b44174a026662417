"""checks.PartitionTable: one normalized partition for every rank, and never laxer than check_partition."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import simcomm
from simcomm import RankError
from simcomm.checks import PartitionTable, check_partition


def _refusal(groups, world_size: int = 2) -> str:
    with pytest.raises(ValueError) as caught:
        check_partition("subgroup", groups, world_size, 1)
    return str(caught.value)


def test_equal_partitions_share_one_normalized_object():
    table = PartitionTable()
    first = table.check("subgroup", [[1, 0], [3, 2]], 4, 0)
    assert first == ((0, 1), (2, 3)) == check_partition("subgroup", [[1, 0], [3, 2]], 4, 0)
    again = table.check("subgroup", [[1, 0], [3, 2]], 4, 1)       # another rank's own lists
    assert again is first
    assert table.check("subgroup", first, 4, 2) is first
    frozen = ((0, 2), (1, 3))
    assert table.check("subgroup", frozen, 4, 0) == frozen
    assert table.check("subgroup", frozen, 4, 1) is table.check("subgroup", [(0, 2), (1, 3)], 4, 2)
    assert (table.hits, table.misses) == (3, 3)     # a list of tuples is checked, then shares the result


@pytest.mark.parametrize("bad", [[[False, True]], [[0.0, 1]], [[0, 1.0]], [[np.float64(0), 1]]])
def test_an_accepted_equal_partition_does_not_admit_what_check_partition_refuses(bad):
    table = PartitionTable()
    table.check("subgroup", [[0, 1]], 2, 0)
    assert bad == [[0, 1]]                                           # equal in Python's eyes
    with pytest.raises(ValueError) as caught:
        table.check("subgroup", bad, 2, 1)
    assert str(caught.value) == _refusal(bad)


def test_entries_without_a_truth_value_are_checked_as_check_partition_checks_them():
    table = PartitionTable()
    table.check("subgroup", [[0, 1]], 2, 0)
    bad = [[torch.tensor([0, 1]), 1]]
    with pytest.raises(ValueError) as caught:
        table.check("subgroup", bad, 2, 1)
    assert str(caught.value) == _refusal(bad)
    # integer scalars that check_partition accepts give its result (not a cached entry)
    assert table.check("subgroup", [[np.int64(1), torch.tensor(0)]], 2, 1) == ((0, 1),)


def test_a_list_changed_after_it_was_accepted_is_checked_again():
    table = PartitionTable()
    groups = [[0, 1], [2, 3]]
    table.check("subgroup", groups, 4, 0)
    groups[1][0] = 1                                                 # no longer a partition
    with pytest.raises(ValueError, match="must partition the ranks 0..3"):
        table.check("subgroup", groups, 4, 1)
    assert table.check("subgroup", [[0, 1], [2, 3]], 4, 2) == ((0, 1), (2, 3))


def test_the_same_partition_of_another_world_size_is_checked_on_its_own():
    table = PartitionTable()
    table.check("subgroup", [[0], [1]], 2, 0)
    with pytest.raises(ValueError, match="must partition the ranks 0..2"):
        table.check("subgroup", [[0], [1]], 3, 0)


def _two_partitions(comm, tp):
    world = comm.world_size
    tensor = comm.subgroup([list(range(base, base + tp)) for base in range(0, world, tp)])
    data = comm.subgroup([list(range(first, world, tp)) for first in range(tp)])
    return tensor.ranks, data.ranks, id(tensor.ranks), id(data.ranks)   # (results are rebuilt on return)


@pytest.mark.parametrize("tensors", ["real", "shape"])
def test_every_rank_of_a_run_holds_the_same_partition_objects(tensors):
    world = simcomm.World(16, tensors=tensors)
    outs = world.run(_two_partitions, 4)
    for rank, (tensor, data, _, _) in enumerate(outs):
        assert tensor == tuple(range(rank // 4 * 4, rank // 4 * 4 + 4))
        assert data == tuple(range(rank % 4, 16, 4))
    recorded = [event.args["groups"] for event in world.trace.events if event.op == "subgroup"]
    assert len(recorded) == 32 and len({id(groups) for groups in recorded}) == 2
    # the group tuples are shared too: one per part, not one per member
    assert len({out[2] for out in outs}) == 4 and len({out[3] for out in outs}) == 4


def test_a_rank_passing_a_different_partition_is_still_a_mismatch():
    def program(comm):
        return comm.subgroup([[0, 1], [2, 3]] if comm.rank else [[0, 2], [1, 3]]).ranks

    with pytest.raises(simcomm.CollectiveMismatchError):
        simcomm.World(4).run(program)


def test_a_rank_passing_bools_is_refused_after_the_others_passed_ints():
    def program(comm):
        return comm.subgroup([[False, True]] if comm.rank == 1 else [[0, 1]]).ranks

    with pytest.raises(RankError) as caught:
        simcomm.World(2).run(program)
    assert caught.value.rank == 1
    assert str(caught.value.__cause__) == _refusal([[False, True]])


def test_new_group_partitions_are_shared_by_the_ranks_too():
    import torch.distributed as dist

    def program(comm):
        group = dist.new_group([1, 3])
        return (dist.get_rank(group), dist.get_world_size(group)) if comm.rank in (1, 3) else None

    world = simcomm.World(4)
    assert world.run(program) == [None, (0, 2), None, (1, 2)]
    recorded = [event.args["groups"] for event in world.trace.events if event.op == "subgroup"]
    assert len(recorded) == 4 and len({id(groups) for groups in recorded}) == 1
    assert recorded[0] == ((0, 2), (1, 3))      # the partition: its parts in the order of their first rank


@pytest.mark.parametrize("last", [299.0, True, "299"])
def test_a_large_partition_with_one_entry_of_another_type_is_refused(last):
    table = PartitionTable()
    table.check("subgroup", [list(range(150)), list(range(150, 300))], 300, 0)
    bad = [list(range(150)), [*range(150, 299), last]]
    with pytest.raises(ValueError) as caught:
        table.check("subgroup", bad, 300, 1)
    assert str(caught.value) == _refusal(bad, 300)


def test_int_subclasses_are_accepted_as_check_partition_accepts_them():
    class Rank(int):
        pass
    table = PartitionTable()
    first = table.check("subgroup", [[0, 1], [2, 3]], 4, 0)
    assert table.check("subgroup", [[Rank(0), 1], [2, Rank(3)]], 4, 1) == first
    assert table.check("subgroup", [[0, 1], [2, 3]], 4, 2) is first


class _Part(list):
    """A list subclass: parts that are no plain list or tuple (marshal does not write them)."""


@pytest.mark.parametrize("other", [
    [[0, 1], {2, 3}],                      # a set for a part: same first part, same length
    [[0, 1], range(2, 4)],                 # a range
    [[0, 1], _Part([2, 3])],               # a list subclass
    [[0, 1], [2, 3.0]],                    # a float entry in a later part
    [[0, 1], [3, 2]],                      # the same partition with a part unsorted
])
def test_parts_of_other_types_after_an_accepted_partition_get_check_partitions_answer(other):
    # an accepted partition is looked up by its first part and length alone, without each part's
    # type: what is not the accepted partition's own bytes is checked by check_partition
    table = PartitionTable()
    first = table.check("subgroup", [[0, 1], [2, 3]], 4, 0)
    try:
        expected = check_partition("subgroup", other, 4, 1)
    except ValueError as refusal:
        with pytest.raises(ValueError) as caught:
            table.check("subgroup", other, 4, 1)
        assert str(caught.value) == str(refusal)
    else:
        assert table.check("subgroup", other, 4, 1) == expected == first
        assert table.misses == 2


def test_what_is_no_partition_at_all_is_refused_after_an_accepted_one():
    table = PartitionTable()
    table.check("subgroup", [[0, 1]], 2, 0)
    for bad in ([0, 1], [[0, 1], 5], "01", [["0", "1"]]):
        with pytest.raises(ValueError) as caught:
            table.check("subgroup", bad, 2, 1)
        assert str(caught.value) == _refusal(bad)
