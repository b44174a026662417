"""The one mesh (simcomm.parallel.mesh.Layout) against torch's own: for every small layout, each rank's
coordinates and its group along every dimension equal what ``init_device_mesh`` gives that rank on
virtual ranks (``DeviceMesh.get_coordinate``, ``mesh[dim].mesh``, ``get_process_group_ranks(
mesh.get_group(dim))``), and on gloo processes for one layout; sizes are keyword-only."""
from __future__ import annotations

import itertools
import pickle

import pytest
import torch.distributed as dist

import simcomm
from simcomm.parallel.mesh import DIMS, Layout

SMALL = [dict(zip(("pp", "dp", "tp"), sizes)) for sizes in itertools.product((1, 2, 3), repeat=3)
         if sizes[0] * sizes[1] * sizes[2] <= 12]


def torch_view(comm, layout: Layout) -> dict:
    """What torch's DeviceMesh of ``layout``'s shape and names says about this rank."""
    mesh = layout.device_mesh("cpu")
    return {"coordinates": tuple(mesh.get_coordinate()),
            "sub_mesh": {dim: mesh[dim].mesh.tolist() for dim in layout.dims},
            "group": {dim: dist.get_process_group_ranks(mesh.get_group(dim)) for dim in layout.dims},
            "flat": dist.get_process_group_ranks(mesh[layout.dims[-2:]]._flatten().get_group())
            if len(layout.dims) >= 2 else None}


def expected_view(layout: Layout, rank: int) -> dict:
    return {"coordinates": layout.coordinates(rank),
            "sub_mesh": {dim: layout.group_of(rank, dim) for dim in layout.dims},
            "group": {dim: layout.group_of(rank, dim) for dim in layout.dims},
            "flat": layout.group_of(rank, *layout.dims[-2:]) if len(layout.dims) >= 2 else None}


@pytest.mark.parametrize("sizes", SMALL, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_ranks_and_groups_equal_init_device_mesh_on_virtual_ranks(sizes):
    layout = Layout(**sizes)
    outs = simcomm.World(layout.world_size).run(torch_view, layout)
    for rank, got in enumerate(outs):
        assert got == expected_view(layout, rank), (layout, rank)
        assert layout.rank(**dict(zip(layout.dims, got["coordinates"]))) == rank


@pytest.mark.parametrize("sizes", [dict(pp=2, tp=3), dict(dp=4), dict(pp=2, dp=1, cp=2, tp=2)])
def test_partial_and_four_dimensional_layouts_equal_init_device_mesh(sizes):
    layout = Layout(**sizes)
    outs = simcomm.World(layout.world_size).run(torch_view, layout)
    assert outs == [expected_view(layout, rank) for rank in range(layout.world_size)]


@pytest.mark.real
@pytest.mark.slow
def test_ranks_and_groups_equal_init_device_mesh_on_gloo(gloo_cluster):
    layout = Layout(pp=2, dp=2, tp=2)
    outs = gloo_cluster(layout.world_size).run(torch_view, layout)
    assert outs == [expected_view(layout, rank) for rank in range(layout.world_size)]


def test_the_rank_order_by_hand():
    layout = Layout(tp=2, dp=2, pp=2)                       # the keyword order does not matter
    assert layout == Layout(pp=2, dp=2, tp=2) and layout.dims == ("pp", "dp", "tp")
    assert [layout.coordinates(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("dp", "tp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.partitions() == {dim: layout.groups(dim) for dim in ("pp", "dp", "tp")}
    wide = Layout(tp=8, pp=4, dp=32)
    assert wide.rank(pp=1, dp=3, tp=5) == (1 * 32 + 3) * 8 + 5
    assert wide.group_of(0, "dp")[:3] == [0, 8, 16] and wide.group_of(0, "pp") == [0, 256, 512, 768]


def test_a_dimension_not_given_has_size_one_and_coordinate_zero():
    layout = Layout(dp=2, tp=2)
    assert (layout.pp, layout.cp, layout.world_size, layout.shape) == (1, 1, 4, (2, 2))
    assert [layout.coordinate(r, "pp") for r in range(4)] == [0, 0, 0, 0]
    assert layout.group_of(3, "pp") == [3] and layout.groups("cp") == [[0], [1], [2], [3]]


def test_sizes_are_keyword_only():
    with pytest.raises(TypeError, match=r"by name only.*Layout\(pp=2, dp=2, tp=2\).*\(2, 4, 1\)"):
        Layout(2, 4, 1)
    with pytest.raises(TypeError, match="unknown dimension 'td'; did you mean 'tp'"):
        Layout(td=2)
    with pytest.raises(TypeError, match="at least one size"):
        Layout()
    with pytest.raises(TypeError, match="not a tuple of sizes"):
        tuple(Layout(tp=2))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2"])
def test_a_bad_size_names_the_dimension_and_the_value(bad):
    with pytest.raises(ValueError, match=rf"Layout: dp={bad!r} must be a whole number >= 1"):
        Layout(dp=bad, tp=2)


def test_bad_ranks_coordinates_and_dimensions_are_named():
    layout = Layout(pp=2, tp=2)
    with pytest.raises(ValueError, match=r"Layout.coordinates: rank=4 is not a rank of Layout\(pp=2, tp=2\)"):
        layout.coordinates(4)
    with pytest.raises(ValueError, match=r"Layout.rank: tp=2 is outside 0..1"):
        layout.rank(tp=2)
    with pytest.raises(ValueError, match="Layout.group_of: unknown dimension 'data'"):
        layout.group_of(0, "data")


def test_immutable_hashable_and_picklable():
    layout = Layout(pp=2, dp=3, cp=1, tp=2)
    assert pickle.loads(pickle.dumps(layout)) == layout
    assert len({layout, Layout(tp=2, cp=1, dp=3, pp=2)}) == 1
    assert layout != Layout(pp=2, dp=3, tp=2)               # cp given or not: a different mesh shape
    assert repr(layout) == "Layout(pp=2, dp=3, cp=1, tp=2)"
    with pytest.raises(AttributeError, match="immutable"):
        layout.tp = 4
    assert set(layout.dims) <= set(DIMS)


# -- the data dimension split for HSDP: (pp, dp_replicate, dp_shard, cp, tp), torchtitan's mesh ---------------

SPLIT = [dict(pp=2, dp_replicate=2, dp_shard=2, tp=2), dict(dp_replicate=3, dp_shard=2),
         dict(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2), dict(dp_replicate=2, dp_shard=2, cp=2),
         dict(pp=1, dp_replicate=2, dp_shard=1, cp=1, tp=3)]

#: flattened groups the 4-D training uses (and torchtitan's "dp", "dp_shard_cp", "dp_cp"), as mesh dims
FLATTENED = [("dp_replicate", "dp_shard"), ("dp_shard", "cp"), ("dp_replicate", "dp_shard", "cp"),
             ("dp_replicate", "cp"), ("pp", "dp_shard"), ("dp_shard", "tp")]


def torch_split_view(comm, layout: Layout) -> dict:
    """What ``init_device_mesh`` with all five of torchtitan's dims says about this rank."""
    mesh = layout.device_mesh("cpu")
    flat = {}
    for dims in FLATTENED:
        present = tuple(dim for dim in dims if dim in layout.dims)
        if len(present) >= 2:
            name = "_".join(present)
            flat[dims] = dist.get_process_group_ranks(mesh[present]._flatten(name).get_group())
    return {"coordinates": tuple(mesh.get_coordinate()),
            "group": {dim: dist.get_process_group_ranks(mesh.get_group(dim)) for dim in layout.dims},
            "flat": flat}


@pytest.mark.parametrize("sizes", SPLIT, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_the_hsdp_split_equals_init_device_mesh_on_virtual_ranks(sizes):
    layout = Layout(**sizes)
    outs = simcomm.World(layout.world_size).run(torch_split_view, layout)
    for rank, got in enumerate(outs):
        assert got["coordinates"] == layout.coordinates(rank) and got["flat"]
        assert got["group"] == {dim: layout.group_of(rank, dim) for dim in layout.dims}
        for dims, ranks in got["flat"].items():
            assert ranks == layout.group_of(rank, *dims), (layout, rank, dims)
        if "dp_replicate" in layout.dims and "dp_shard" in layout.dims:    # "dp" names the flattened pair
            assert layout.group_of(rank, "dp") == got["flat"][("dp_replicate", "dp_shard")]
            assert layout.group_of(rank, "dp", "cp") == layout.group_of(rank, "dp_replicate", "dp_shard", "cp")
        replica, shard = layout.coordinate(rank, "dp_replicate"), layout.coordinate(rank, "dp_shard")
        assert layout.coordinate(rank, "dp") == replica * layout.dp_shard + shard


def test_the_hsdp_split_by_hand():
    layout = Layout(tp=2, dp_shard=2, pp=2, dp_replicate=2)
    assert layout.dims == ("pp", "dp_replicate", "dp_shard", "tp") and layout.shape == (2, 2, 2, 2)
    assert (layout.dp, layout.dp_replicate, layout.dp_shard, layout.world_size) == (4, 2, 2, 16)
    assert layout.rank(pp=1, dp_replicate=1, dp_shard=0, tp=1) == ((1 * 2 + 1) * 2 + 0) * 2 + 1
    assert layout.rank(pp=1, dp=2, tp=1) == 13                              # dp 2 = replica 1, shard 0
    assert layout.group_of(0, "dp_shard") == [0, 2] and layout.group_of(0, "dp_replicate") == [0, 4]
    assert layout.group_of(0, "dp") == [0, 2, 4, 6] and layout.group_of(0, "pp") == [0, 8]
    assert layout.groups("dp_shard", "tp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert [layout.coordinate(rank, "dp") for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert Layout(dp_shard=4).dp == 4 and Layout(dp_shard=4).dp_replicate == 1


def test_plain_dp_is_replicas_and_numbers_the_ranks_as_the_split_with_one_shard():
    plain, split = Layout(pp=2, dp=3, tp=2), Layout(pp=2, dp_replicate=3, dp_shard=1, tp=2)
    assert plain != split and plain.dims == ("pp", "dp", "tp")           # different mesh names
    assert (plain.dp_replicate, plain.dp_shard) == (3, 1)
    for dims in (("dp",), ("dp_replicate",), ("dp_shard",), ("dp", "tp"), ("pp", "dp_replicate")):
        assert plain.groups(*dims) == split.groups(*dims), dims
    assert [plain.coordinate(r, "dp") for r in range(12)] == [split.coordinate(r, "dp") for r in range(12)]


def test_the_split_keeps_the_clear_errors():
    with pytest.raises(TypeError, match=r"dp= or as dp_replicate= and dp_shard=, not both \(got dp=4 and dp_shard=2\)"):
        Layout(dp=4, dp_shard=2)
    with pytest.raises(TypeError, match="unknown dimension 'dp_shards'; did you mean 'dp_shard'"):
        Layout(dp_shards=2)
    with pytest.raises(ValueError, match=r"Layout: dp_shard=0 must be a whole number >= 1 \(the number of ranks"):
        Layout(dp_replicate=2, dp_shard=0)
    layout = Layout(dp_replicate=2, dp_shard=2)
    with pytest.raises(ValueError, match=r"Layout.rank: dp=4 is outside 0..3"):
        layout.rank(dp=4)
    with pytest.raises(ValueError, match="Layout.rank: give dp= or dp_replicate=/dp_shard=, not both"):
        layout.rank(dp=1, dp_shard=1)
    with pytest.raises(AttributeError, match="immutable"):
        layout.dp_shard = 4
    assert pickle.loads(pickle.dumps(layout)) == layout and hash(layout) == hash(Layout(dp_shard=2, dp_replicate=2))
    assert repr(layout) == "Layout(dp_replicate=2, dp_shard=2)"
