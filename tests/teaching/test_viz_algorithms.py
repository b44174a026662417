"""ring_allreduce_figure: frames per step, partial sums at every step, a static HTML export that animates."""
import math

import pytest
import torch

from simcomm import collectives
from simcomm.viz import allreduce_figure, allreduce_steps, ring_allreduce_figure, tree_allreduce_figure


def _count(text: str) -> int:
    """How many ranks a cell's text ``"value<br>{0-2,5}"`` names."""
    ranks = 0
    for part in text.split("{")[1].rstrip("}").split(","):
        low, _, high = part.partition("-")
        ranks += int(high or low) - int(low) + 1
    return ranks


def chunk_values(world_size):
    """Rank r's chunk c starts as r * base + c (base 10 up to 10 ranks)."""
    return [torch.tensor([float(r * 10 + c) for c in range(world_size)]) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_ring_has_2_n_minus_1_steps_plus_the_start_and_ends_with_the_all_reduce(world_size):
    fig = ring_allreduce_figure(world_size)
    assert len(fig.frames) == 2 * (world_size - 1) + 1
    assert len(fig.layout.sliders[0].steps) == len(fig.frames)
    assert [s.args[0][0] for s in fig.layout.sliders[0].steps] == [f.name for f in fig.frames]
    expected = collectives.all_reduce(chunk_values(world_size))
    final = fig.frames[-1].data[0]
    for rank in range(world_size):
        assert list(final.customdata[rank]) == expected[rank].tolist()
        assert all(text.endswith("{" + (f"0-{world_size - 1}" if world_size > 1 else "0") + "}")
                   for text in final.text[rank])                    # every chunk holds every rank
        # colour is the source rank; a sum of several ranks is the neutral band (index world_size)
        assert list(final.z[rank]) == [world_size if world_size > 1 else 0] * world_size


def test_ring_partial_sums_after_each_reduce_scatter_step():
    fig = ring_allreduce_figure(4)
    assert [f.name for f in fig.frames] == ["start", "RS1", "RS2", "RS3", "AG1", "AG2", "AG3"]
    values = chunk_values(4)
    # after step s, rank r's chunk (r - s) mod n holds the sum over ranks r - s .. r
    for step in range(1, 4):
        heatmap = fig.frames[step].data[0]
        for rank in range(4):
            chunk = (rank - step) % 4
            contributors = [(rank - k) % 4 for k in range(step + 1)]
            assert heatmap.customdata[rank][chunk] == sum(values[s][chunk].item() for s in contributors)
            assert _count(heatmap.text[rank][chunk]) == step + 1
            assert heatmap.z[rank][chunk] == 4                       # a sum of several ranks: neutral
    # after reduce-scatter, rank r holds the complete chunk r + 1; nothing else is complete yet
    last_rs = fig.frames[3].data[0]
    complete = {(r, c) for r in range(4) for c in range(4) if _count(last_rs.text[r][c]) == 4}
    assert complete == {(r, (r + 1) % 4) for r in range(4)}
    assert len(fig.frames[1].layout.annotations) == 4  # one arrow per send


@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_tree_has_2_ceil_log2_n_steps_plus_the_start(world_size):
    fig = tree_allreduce_figure(world_size)
    assert fig.to_dict() == allreduce_figure(world_size, "tree").to_dict()
    levels = math.ceil(math.log2(world_size)) if world_size > 1 else 0
    assert len(fig.frames) == 2 * levels + 1
    expected = collectives.all_reduce(chunk_values(world_size))
    assert list(fig.frames[-1].data[0].customdata[world_size - 1]) == expected[0].tolist()
    after_reduce = fig.frames[levels].data[0]
    assert [_count(text) for text in after_reduce.text[0]] == [world_size] * world_size  # rank 0: the full sum


def test_steps_read_the_state_before_the_step():
    steps = allreduce_steps(3, "ring")
    # step 1: rank 0 sends chunk 0 to rank 1 while rank 2 sends chunk 2 to rank 0; no chain within a step
    assert steps[1].ranks[1][0] == frozenset({0, 1})
    assert steps[1].ranks[2][1] == frozenset({1, 2})


def test_html_export_contains_frames_slider_and_play_button(tmp_path):
    path = tmp_path / "ring.html"
    ring_allreduce_figure(4).write_html(path, include_plotlyjs=False)
    html = path.read_text()
    assert "Plotly.addFrames" in html  # plotly's HTML export adds the frames after the first draw
    for name in ["start", "RS1", "RS2", "RS3", "AG1", "AG2", "AG3"]:
        assert f'"name":"{name}"' in html
    assert '"sliders"' in html and '"method":"animate"' in html
    assert '"label":"Play"' in html


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"allreduce_figure: algorithm='butterfly'"):
        allreduce_figure(4, algorithm="butterfly")
    with pytest.raises(ValueError, match=r"allreduce_figure: world_size=0"):
        ring_allreduce_figure(0)
    with pytest.raises(TypeError):
        ring_allreduce_figure(4, algorithm="tree")      # a ring figure draws only the ring
