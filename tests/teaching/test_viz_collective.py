"""collective_figure: panel layout, values equal to what a World produces, colours by source rank."""
import numpy as np
import pytest

import simcomm
from simcomm.viz import OPS, collective_figure, provenance_tensor, run_collective
from simcomm.viz.collective import SCREEN_HEIGHT_PX
from simcomm.viz.grids import MIN_FONT_PX
from simcomm.viz.style import MIXED_COLOURSCALE, colour_at, rank_colour


def heatmaps(fig):
    return {trace.name: trace for trace in fig.data if trace.type == "heatmap"}


def colours(fig, trace):
    """The colour plotly gives every cell of a heatmap trace, from its colour axis."""
    axis = fig.layout[trace.coloraxis]
    z = np.asarray(trace.z, dtype=float)
    fractions = (z - axis.cmin) / (axis.cmax - axis.cmin)
    scale = [list(stop) for stop in axis.colorscale]
    return [[colour_at(scale, f) for f in row] for row in fractions]


def world_run(world_size, call, shape, base):
    """The op run independently of the viz code: coded inputs and coded incoming grads."""
    def program(comm):
        x = provenance_tensor(comm.rank, shape, base=base).requires_grad_()
        y = call(comm, x)
        g = provenance_tensor(comm.rank, y.shape, base=base)
        y.backward(g)
        return y.detach(), g, x.grad
    return simcomm.World(world_size).run(program)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_op_draws_one_row_per_rank(op, world_size):
    shape = {"all_to_all_4D": None, "reduce_scatter": (2, 2 * world_size), "slice": (2, 2 * world_size)}.get(op, (2, 2))
    fig = collective_figure(op, world_size, shape)
    names = set(heatmaps(fig))
    stages = ["x", "y"] if OPS[op].backward_kind is None else ["x", "y", "dL/dy", "dL/dx"]
    expected = {f"rank {r} {stage}" for r in range(world_size) for stage in stages}
    if op == "gather":  # only dst=0 receives; the other output panels are notes
        expected -= {f"rank {r} y" for r in range(1, world_size)}
        notes = [a.text for a in fig.layout.annotations if a.text.startswith("None")]
        assert len(notes) == world_size - 1
    assert names == expected
    assert len(fig.data) == len(expected)
    rank_titles = [fig.layout[f"yaxis{'' if i == 0 else i * len(stages) + 1}"].title.text for i in range(world_size)]
    top_titles = [a.text for a in fig.layout.annotations if a.yref == "paper" and a.y == 1.0][:world_size]
    # ranks are rows, or (a figure too tall for a screen) columns with the stages as rows
    assert rank_titles == [f"rank {r}" for r in range(world_size)] or (
        top_titles == [f"rank {r}" for r in range(world_size)] and fig.layout.height <= SCREEN_HEIGHT_PX + 60)


@pytest.mark.parametrize("world_size", [6, 8])
def test_projector_minimum_font_and_screen_height(world_size):
    for op, kwargs in [("all_gather", {"shape": (2, 2), "dim": 0}), ("all_reduce", {"shape": (2, 3)}),
                       ("all_to_all_4D", {})]:
        fig = collective_figure(op, world_size, **kwargs)
        assert all(trace.textfont.size >= MIN_FONT_PX for trace in fig.data), op
        assert all(a.font.size is None or a.font.size >= MIN_FONT_PX for a in fig.layout.annotations), op
        assert fig.layout.height <= SCREEN_HEIGHT_PX + 60, (op, fig.layout.height)


def test_sums_name_the_ranks_added_not_a_grey_value():
    fig = collective_figure("all_reduce", 4, (2, 3), backward=False)
    output = next(trace for trace in fig.data if trace.name == "rank 2 y")
    assert all(text == "Σ0-3" for row in output.text for text in row)
    assert all("sum over ranks 0-3 of their element" in hover for row in output.customdata for hover in row)
    assert fig.layout.coloraxis2.showscale is False         # no "mixed value" colour bar
    assert {trace.name.split()[-1] for trace in fig.data} == {"x", "y"}   # backward=False: forward only


def test_all_gather_values_equal_the_world_run_and_colours_are_source_ranks():
    world_size, shape, base = 4, (2, 2), 100
    fig = collective_figure("all_gather", world_size, shape)
    expected = world_run(world_size, lambda comm, x: comm.all_gather(x, -1), shape, base)
    panels = heatmaps(fig)
    for rank, (y, g, x_grad) in enumerate(expected):
        assert np.array_equal(panels[f"rank {rank} x"].z, provenance_tensor(rank, shape, base=base).numpy())
        assert np.array_equal(panels[f"rank {rank} y"].z, y.numpy())
        assert np.array_equal(panels[f"rank {rank} dL/dy"].z, g.numpy())
        assert np.array_equal(panels[f"rank {rank} dL/dx"].z, x_grad.numpy())
        # the output is [x_0 | x_1 | x_2 | x_3]: column block j has rank j's colour
        output_colours = colours(fig, panels[f"rank {rank} y"])
        for row in output_colours:
            assert row == [rank_colour(j // 2) for j in range(8)]
        # the incoming grad is rank r's own code; the input grad mixes ranks (grey axis)
        assert {c for row in colours(fig, panels[f"rank {rank} dL/dy"]) for c in row} == {rank_colour(rank)}
        assert panels[f"rank {rank} dL/dx"].coloraxis == "coloraxis2"
    assert [list(s) for s in fig.layout.coloraxis2.colorscale] == MIXED_COLOURSCALE
    # by hand: rank r's input grad = sum over ranks s of chunk r (columns 2r, 2r+1) of s's code
    grad_rank1 = sum(provenance_tensor(s, (2, 8), base=base)[:, 2:4] for s in range(world_size))
    assert np.array_equal(panels["rank 1 dL/dx"].z, grad_rank1.numpy())
    assert "rank r's output = concat of every rank's input" in fig.layout.title.text


def test_reduce_scatter_backward_colours_each_grad_chunk_by_its_rank():
    fig = collective_figure("reduce_scatter", 3, (2, 6), dim=1)
    panels = heatmaps(fig)
    assert panels["rank 0 y"].coloraxis == "coloraxis2"  # a sum of three ranks
    for rank in range(3):
        grad_colours = colours(fig, panels[f"rank {rank} dL/dx"])
        assert grad_colours[0] == [rank_colour(j // 2) for j in range(6)]


def test_all_to_all_4D_moves_sequence_shards_to_head_shards_and_grads_back():
    world_size, base = 4, 100
    fig = collective_figure("all_to_all_4D", world_size)  # (1, 2, 4, 2) per rank: (b, s/P, h, d)
    expected = world_run(world_size, lambda comm, x: comm.all_to_all_4D(x, 2, 1), (1, 2, 4, 2), base)
    panels = heatmaps(fig)
    for rank, (y, g, x_grad) in enumerate(expected):
        assert y.shape == (1, 8, 1, 2)  # (b, s, h/P, d)
        assert np.array_equal(panels[f"rank {rank} y"].z, y.reshape(8, 2).numpy())
        assert np.array_equal(panels[f"rank {rank} dL/dx"].z, x_grad.reshape(2, 8).numpy())
        # output rows (sequence positions) come in blocks of 2 from ranks 0..3
        assert [row[0] for row in colours(fig, panels[f"rank {rank} y"])] == [rank_colour(s // 2) for s in range(8)]
        # input-grad columns (head h, 2 head_dim each) come back from the rank that owned head h
        assert colours(fig, panels[f"rank {rank} dL/dx"])[0] == [rank_colour(c // 2) for c in range(8)]
    assert "sequence shards (b, s/P, h, d) -> head shards (b, s, h/P, d)" in fig.layout.title.text
    assert "rows: batch x seq, columns: heads x head_dim" in fig.layout.title.text


def test_all_reduce_max_forward_is_rank_n_minus_1_and_grad_goes_there():
    fig = collective_figure("all_reduce", 3, (2, 2), op="max")
    panels = heatmaps(fig)
    assert {c for row in colours(fig, panels["rank 0 y"]) for c in row} == {rank_colour(2)}
    assert np.array_equal(panels["rank 0 dL/dx"].z, np.zeros((2, 2)))
    grads = sum(provenance_tensor(s, (2, 2), base=100) for s in range(3))  # base: 3 ranks x 4 elements
    assert np.array_equal(panels["rank 2 dL/dx"].z, grads.numpy())


def test_slice_input_is_replicated_and_broadcast_grad_lands_on_src():
    fig = collective_figure("slice", 2, (2, 4))
    panels = heatmaps(fig)
    assert np.array_equal(panels["rank 0 x"].z, panels["rank 1 x"].z)
    fig = collective_figure("broadcast", 3, (1, 2), src=1)
    panels = heatmaps(fig)
    assert {c for row in colours(fig, panels["rank 2 y"]) for c in row} == {rank_colour(1)}
    assert np.array_equal(panels["rank 0 dL/dx"].z, np.zeros((1, 2)))
    assert panels["rank 1 dL/dx"].z[0] == pytest.approx([0 + 10 + 20, 1 + 11 + 21])  # base 10: 3 x 2 elements


def test_hover_names_the_source_rank_and_position():
    fig = collective_figure("all_gather", 2, (1, 2))
    hover = heatmaps(fig)["rank 0 y"].customdata
    assert hover[0][3] == "rank 0 y(0, 3) = 11<br>came from rank 1, element (0, 1)"


def test_errors_name_function_argument_and_value():
    with pytest.raises(ValueError, match=r"collective_figure: unknown op 'all_gahter' \(did you mean 'all_gather'\?\)"):
        collective_figure("all_gahter")
    with pytest.raises(ValueError, match=r"all_gather takes dim; got src=1"):
        collective_figure("all_gather", src=1)
    with pytest.raises(ValueError, match=r"collective_figure: reduce_scatter with shape=\(2, 5\), world_size=4"
                                         r".*not divisible"):
        collective_figure("reduce_scatter", 4, (2, 5))
    with pytest.raises(ValueError, match=r"send_recv needs world_size >= 2, got world_size=1"):
        collective_figure("send_recv", 1)
    with pytest.raises(ValueError, match=r"all_reduce reduce_op='median'"):
        collective_figure("all_reduce", reduce_op="median")
    with pytest.raises(ValueError, match=r"collective_figure: shape=4 must be a non-empty sequence"):
        collective_figure("all_reduce", 2, 4)
    with pytest.raises(ValueError, match=r"run_collective: world_size=0 must be a positive int"):
        run_collective("all_reduce", 0)


def test_hover_of_mixed_values_names_the_position_they_combine():
    panels = heatmaps(collective_figure("all_gather", 4, (2, 2)))
    # rank 1's dL/dx(0, 1) = sum over s of dL/dy_s(0, 3) = 100 * (0+1+2+3) + 4 * 3
    assert panels["rank 1 dL/dx"].customdata[0][1] == (
        "rank 1 dL/dx(0, 1) = 612<br>= sum over ranks 0-3 of their element (0, 3)")
    panels = heatmaps(collective_figure("all_reduce", 3, (2, 2), op="avg"))
    assert panels["rank 1 y"].customdata[1][1].endswith("= mean over ranks 0-2 of their element (1, 1)")
    panels = heatmaps(collective_figure("slice", 2, (2, 4), scale_grad=True))
    assert panels["rank 1 dL/dx"].customdata[1][3].endswith("= (rank 1's element (1, 1)) / 2: a code divided "
                                                            "by the world size")
    panels = heatmaps(collective_figure("reduce_scatter", 3, (2, 6), op="max"))
    assert panels["rank 2 dL/dx"].coloraxis == "coloraxis"  # the holder gets the codes unchanged
    assert panels["rank 0 dL/dx"].customdata[0][0].endswith("= 0: nothing reaches this element")
    panels = heatmaps(collective_figure("all_reduce", 3, (2, 2), op="product"))
    assert panels["rank 1 y"].customdata[1][1].endswith("mixes several ranks' values")


def test_ulysses_cells_are_labelled_by_token_and_head():
    world_size, tokens, heads = 4, 2, 4
    fig = collective_figure("all_to_all_4D", world_size, (1, tokens, heads, 1))
    panels = {trace.name: [text for row in trace.text for text in row] for trace in fig.data}
    for rank in range(world_size):
        # input: rank r's sequence shard, tokens r*2 and r*2+1 of every head, row by row
        assert panels[f"rank {rank} x"] == [f"t{rank * tokens + t}<br>h{h}" for t in range(tokens) for h in range(heads)]
        # output: head r, every token in order (the head shard Ulysses attends over)
        assert panels[f"rank {rank} y"] == [f"t{t}<br>h{rank}" for t in range(tokens * world_size)]
        # the incoming grad lives in the head-shard layout; its backward returns it to sequence shards
        assert panels[f"rank {rank} dL/dx"] == panels[f"rank {rank} x"]


def test_forward_only_figures_label_like_the_lesson_inputs():
    # lesson 01 prints rank r's input as [10r, 10r + 1, ...]: its figures use the same labels
    fig = collective_figure("all_gather", 4, (4,), dim=0, backward=False)
    texts = {trace.name: [t for row in trace.text for t in row] for trace in fig.data}
    assert texts["rank 3 x"] == ["30", "31", "32", "33"]
    assert texts["rank 0 y"] == [str(10 * r + i) for r in range(4) for i in range(4)]
