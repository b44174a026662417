"""explore(): plain widgets; every change of a control redraws collective_figure into the Output widget."""
import ipywidgets as widgets
import pytest

from simcomm.viz import explore
from simcomm.viz.explore import parse_shape


def rows_drawn(panel):
    spec = panel.output.outputs[0]["data"]["application/vnd.plotly.v1+json"]
    return {t["name"].split()[1] for t in spec["data"]}


def test_moving_the_world_size_slider_redraws():
    panel = explore("all_gather", world_size=4)
    assert isinstance(panel.controls["world_size"], widgets.IntSlider)
    assert rows_drawn(panel) == {"0", "1", "2", "3"}
    first = panel.figure
    panel.controls["world_size"].value = 6
    assert panel.figure is not first
    assert rows_drawn(panel) == {str(r) for r in range(6)}
    assert "on 6 ranks" in panel.status.value


def test_controls_reach_the_figure_and_bad_combinations_show_the_error():
    panel = explore("reduce_scatter", world_size=2)
    panel.controls["reduce_op"].value = "max"
    assert "reduce_scatter(x, dim=-1, max)" in str(panel.figure.layout.annotations)
    panel.controls["shape"].value = "2, 3"
    assert "not divisible by the world size 2" in panel.error
    assert panel.output.outputs == ()
    panel.controls["shape"].value = "4, 2"
    panel.controls["dim"].value = 0
    assert panel.error is None
    panel.controls["op"].value = "all_reduce"
    assert panel.controls["dim"].disabled and not panel.controls["reduce_op"].disabled
    panel.controls["op"].value = "all_to_all_4D"
    panel.controls["shape"].value = ""
    panel.controls["direction"].value = "heads -> sequence (1, 2)"
    assert "heads -> sequence" in panel.figure.layout.title.text.split("<br>")[0] or \
        "inverse" in panel.figure.layout.title.text


def test_parse_shape():
    assert parse_shape("2, 4") == (2, 4)
    assert parse_shape("(1, 2, 4, 2)") == (1, 2, 4, 2)
    assert parse_shape(" ") is None
    with pytest.raises(ValueError, match="explore: shape '2, a' must be positive ints"):
        parse_shape("2, a")
