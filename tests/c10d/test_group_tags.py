"""Groups found and made by ranks and tag (c10d's ``_new_group_with_tag``, ``_find_pg_by_ranks_and_tag``,
``_find_or_create_pg_by_ranks_and_tag``, ``_get_group_tag``) behave on virtual ranks as on
processes: tests/scripts/group_tags.py on 4 ranks with ``simcomm.run`` (fast tier) and under
torchrun on gloo (slow tier)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import simcomm
from simcomm.errors import CollectiveMismatchError
from simcomm.run import run_script
from tests.launchers import rank_reports, torchrun_lines

SCRIPT = Path(__file__).parents[1] / "scripts" / "group_tags.py"


def _lines(text: str) -> dict[int, str]:
    return rank_reports(text)


def _under_torchrun(nproc: int) -> dict[int, str]:
    """Each rank's line under torchrun (gloo)."""
    return torchrun_lines(SCRIPT, nproc, _lines)


def _on_virtual_ranks(capsys) -> dict[int, str]:
    result = run_script(SCRIPT, 4)
    out = capsys.readouterr()
    assert result.returncode == 0, result.summary() + out.err[-3000:]
    return _lines(out.out + out.err)


def test_groups_by_ranks_and_tag_on_virtual_ranks(capsys):
    lines = _on_virtual_ranks(capsys)
    assert sorted(lines) == [0, 1, 2, 3], lines
    for rank, line in lines.items():
        got = dict(item.split("=", 1) for item in line.split())
        pair = "0,1" if rank < 2 else "2,3"
        assert got.pop("made_ranks") == pair
        assert got.pop("reduced") == ("3,3" if rank < 2 else "7,7")   # (r + 1) summed over the pair
        assert got.pop("tags") == "blue,green,ptd"
        assert got.pop("made_tag") == "made"
        names = got.pop("names").split(",")
        assert names[0] == names[1] and len(set(names)) == 3           # the same group, its name kept
        assert set(got.values()) == {"True"}, got


@pytest.mark.slow
def test_groups_by_ranks_and_tag_are_what_they_are_under_torchrun(capsys):
    reference = _under_torchrun(4)
    assert sorted(reference) == [0, 1, 2, 3], reference
    assert _on_virtual_ranks(capsys) == reference


def test_a_tagged_group_asked_for_again_is_the_same_object_registered_once():
    def program(comm):
        first = c10d._new_group_with_tag([0, 1], pg_tag="t")
        second = c10d._new_group_with_tag([0, 1], pg_tag="t")
        if comm.rank == 2:
            return first, second
        return (first is second, c10d._world.tags_to_pg["user:t"].count(first),
                c10d._get_process_group_name(first) == first.group_name, dist.get_rank(first))

    assert simcomm.World(3).run(program) == [(True, 1, True, 0), (True, 1, True, 1),
                                             (dist.GroupMember.NON_GROUP_MEMBER,) * 2]


def test_ranks_naming_different_groups_of_one_partition_agree_and_others_still_mismatch():
    def split(comm):
        group = dist.new_group([0, 1] if comm.rank < 2 else [2])
        ones = torch.ones(1)
        dist.all_reduce(ones, group=group)
        return dist.get_process_group_ranks(group), ones.item()

    assert simcomm.World(3).run(split) == [([0, 1], 2.0), ([0, 1], 2.0), ([2], 1.0)]

    def disagree(comm):
        dist.new_group([0, 1] if comm.rank == 0 else [0, 2])

    with pytest.raises(CollectiveMismatchError, match=r"ranks of group \[0, 1, 2\] disagree"):
        simcomm.World(3).run(disagree)


def _tagged_groups(comm):
    made = c10d._find_or_create_pg_by_ranks_and_tag("made", list(range(comm.world_size)), 2)
    first = c10d._new_group_with_tag([0, 1], pg_tag="t")
    second = c10d._new_group_with_tag([0, 1], pg_tag="t")
    other = c10d._new_group_with_tag([2, 3], pg_tag="t")
    mine = first if comm.rank < 2 else other
    ranks = dist.get_process_group_ranks(mine)
    return (first is second, c10d._get_group_tag(mine), ranks,
            c10d._find_pg_by_ranks_and_tag("t", ranks) is mine,
            dist.get_process_group_ranks(made), c10d._find_pg_by_ranks_and_tag("made", ranks) is made)


def test_tagged_groups_on_both_backends(backend):
    world = backend(4)
    pairs = [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert world.run(_tagged_groups) == [(True, "t", pair, True, pair, True) for pair in pairs]
