"""Process groups found and made by ranks and tag (c10d's ``_new_group_with_tag``,
``_find_pg_by_ranks_and_tag``, ``_find_or_create_pg_by_ranks_and_tag``, ``_get_group_tag``),
as the functional collectives use them. Run on 4 ranks; each prints ``rankN: name=value ...``.
"""
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.distributed_c10d as c10d


def pair_groups(tag=None):
    """Every rank asks for the groups [0, 1] and [2, 3] (with ``tag``); the one holding it is returned."""
    mine = None
    for first in range(0, dist.get_world_size(), 2):
        ranks = [first, first + 1]
        group = c10d._new_group_with_tag(ranks, pg_tag=tag)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def found_again(group, tag=None):
    """The group c10d finds for what the functional collectives make of ``group`` (and ``tag``)."""
    found_tag, ranks, _ = funcol._expand_group(group, tag)
    return c10d._find_pg_by_ranks_and_tag(found_tag, ranks)


def flag(value) -> str:
    return str(bool(value))


dist.init_process_group("gloo")
rank = dist.get_rank()
report = {}

# made by a tagged call on every rank, then found by ranks and tag. (Here every rank makes both pairs:
# where each rank asks _find_or_create_pg_by_ranks_and_tag to make only its own pair, gloo gives both
# pairs one group name, and their rendezvous in the store can hang; tests/c10d/test_group_tags.py
# runs that on virtual ranks and on real workers.)
made = pair_groups("made")
report["made_ranks"] = ",".join(map(str, dist.get_process_group_ranks(made)))
report["made_tag"] = c10d._get_group_tag(made)
report["made_found"] = flag(c10d._find_or_create_pg_by_ranks_and_tag("made", [0, 1, 2, 3], 2) is made)
report["made_again"] = flag(pair_groups("made") is made)

first, second = pair_groups("blue"), pair_groups("blue")
other_tag, untagged, untagged_again = pair_groups("green"), pair_groups(), pair_groups()
report["same_tag_same_group"] = flag(first is second and first == second)
report["other_tag_differs"] = flag(first != other_tag)
report["untagged_differs"] = flag(first != untagged and untagged != untagged_again)
report["tags"] = ",".join([c10d._get_group_tag(first), c10d._get_group_tag(other_tag),
                           c10d._get_group_tag(untagged).split(":")[0]])
report["names"] = ",".join(c10d._get_process_group_name(g) for g in (first, second, other_tag, untagged))
report["roundtrip"] = flag(all(found_again(g) is g for g in (first, other_tag, untagged, untagged_again)))
report["by_tag"] = flag(found_again(other_tag, "blue") is first and found_again(untagged, "blue") is first
                        and found_again(first, "") is first)
report["world"] = flag(c10d._find_pg_by_ranks_and_tag("", [0, 1, 2, 3]) is dist.group.WORLD)
pair = [rank // 2 * 2, rank // 2 * 2 + 1]
reduced = funcol.all_reduce(torch.full((2,), float(rank + 1)), "sum", pair, tag="blue")
report["reduced"] = ",".join(f"{v:g}" for v in reduced.tolist())
dist.barrier(group=first)
print(f"rank{rank}: " + " ".join(f"{key}={value}" for key, value in report.items()), flush=True)
dist.destroy_process_group()
