"""rank_grid: one panel per rank, shared colour scale, grid layouts named for non-2-D tensors."""
import numpy as np
import pytest
import torch

from simcomm.viz import as_grid, grid_layout, provenance_tensors, rank_grid
from simcomm.viz.style import colour_at, rank_colour


def test_one_panel_per_rank_with_its_values_and_shared_axis():
    tensors = [torch.arange(6.0).reshape(2, 3) * (rank + 1) for rank in range(3)]
    fig = rank_grid(tensors)
    assert len(fig.data) == 3
    for rank, trace in enumerate(fig.data):
        assert np.array_equal(trace.z, tensors[rank].numpy())
    assert {trace.coloraxis for trace in fig.data} == {"coloraxis2"}  # one shared value scale
    assert fig.layout.coloraxis2.cmin == 0 and fig.layout.coloraxis2.cmax == 15
    titles = [a.text for a in fig.layout.annotations]
    assert titles == ["rank 0", "rank 1", "rank 2"]


def test_provenance_tensors_are_coloured_by_rank():
    fig = rank_grid(provenance_tensors(4, (2, 3)), base=10)
    axis = fig.layout.coloraxis
    scale = [list(stop) for stop in axis.colorscale]
    for rank, trace in enumerate(fig.data):
        for value in np.asarray(trace.z).ravel():
            assert colour_at(scale, (value - axis.cmin) / (axis.cmax - axis.cmin)) == rank_colour(rank)
    assert list(axis.colorbar.ticktext) == [f"rank {r}" for r in range(4)]


@pytest.mark.parametrize("shape, grid, layout", [
    ((5,), (1, 5), "one row: dim 0"),
    ((2, 3, 4), (6, 4), "rows: dim 0 x dim 1, columns: dim 2"),
    ((1, 2, 3, 4), (2, 12), "rows: dim 0 x dim 1, columns: dim 2 x dim 3"),
])
def test_non_2d_tensors_are_reshaped_row_major_and_the_layout_named(shape, grid, layout):
    tensor = torch.arange(float(np.prod(shape))).reshape(shape)
    assert as_grid(tensor).shape == grid
    assert np.array_equal(as_grid(tensor).ravel(), tensor.reshape(-1).numpy())
    assert grid_layout(shape) == layout
    fig = rank_grid([tensor, tensor + 1])
    assert layout in fig.layout.title.text
    assert fig.data[1].customdata[0][1].startswith(f"rank 1 x({', '.join(['0'] * (len(shape) - 1))}, 1)"
                                                   if len(shape) > 1 else "rank 1 x(1,)")


def test_none_draws_an_empty_panel_and_wraps_rows():
    fig = rank_grid([torch.ones(2, 2), None, torch.ones(2, 2), torch.ones(2, 2), torch.ones(2, 2)], columns=2)
    assert len(fig.data) == 4
    assert any(a.text == "None" for a in fig.layout.annotations)
    assert fig.data[-1].xaxis == "x5" and fig.data[-1].yaxis == "y5"


def test_errors_name_the_function_argument_and_value():
    with pytest.raises(ValueError, match="rank_grid: tensors is empty"):
        rank_grid([])
    with pytest.raises(ValueError, match=r"rank_grid: x on rank 0 is not provenance-coded with base=10"):
        rank_grid([torch.tensor([0.5])], base=10)
    with pytest.raises(ValueError, match=r"rank_grid: x on rank 0 holds code 30, from rank 3, but world_size=2"):
        rank_grid([torch.tensor([30.0]), torch.tensor([1.0])], base=10)
    with pytest.raises(ValueError, match=r"rank_grid: tensors\[1\] is a list"):
        rank_grid([torch.ones(1), [1.0]])
