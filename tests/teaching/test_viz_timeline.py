"""timeline_figure: measured bars per rank; modelled compute and communication rows, exposed vs hidden."""
import re

import pytest
import torch

import simcomm
from simcomm.model import cost
from simcomm.model.cost import annotate, estimate
from simcomm.trace import Trace, TraceEvent
from simcomm.viz import timeline_figure
from simcomm.viz.timeline import MIN_FONT_PX


def forward_backward(comm):
    x = torch.ones(2, 4, requires_grad=True)
    y = comm.all_gather(x, dim=0)
    comm.compute(seconds=1e-3)
    comm.all_reduce(y).sum().backward()
    return x.grad


@pytest.fixture
def trace():
    world = simcomm.World(3)
    world.run(forward_backward)
    return world.trace


def _fonts(fig):
    """Every font size the figure sets, with where it is set."""
    sizes = [("layout", fig.layout.font.size), ("title", fig.layout.title.font.size),
             ("xaxis", fig.layout.xaxis.tickfont.size), ("yaxis", fig.layout.yaxis.tickfont.size),
             ("xtitle", fig.layout.xaxis.title.font.size), ("legend", fig.layout.legend.font.size)]
    sizes += [("annotation", a.font.size) for a in fig.layout.annotations]
    sizes += [("title span", int(px)) for px in re.findall(r"font-size:(\d+)px", fig.layout.title.text)]
    return sizes


def _assert_projector_ready(fig):
    for where, size in _fonts(fig):
        assert size is not None and size >= MIN_FONT_PX, (where, size)
    assert "<sup>" not in fig.layout.title.text          # <sup> shrinks the subtitle
    html = fig.to_html(full_html=False, include_plotlyjs=False)
    for bar in fig.data:                                   # the HTML export holds every trace
        assert f'"name":"{bar.name}"' in html


# --- measured ---------------------------------------------------------------------------------

def test_one_bar_per_event_on_its_rank_row(trace):
    fig = timeline_figure(trace)
    bars = [(y, trace_.name) for trace_ in fig.data for y in trace_.y]
    assert len(bars) == len(trace.events)
    for rank in range(3):
        assert sum(1 for y, _ in bars if y == f"rank {rank}") == len(trace.filter(rank=rank).events)
    assert list(fig.layout.yaxis.categoryarray) == ["rank 0", "rank 1", "rank 2"]
    names = {t.name for t in fig.data}
    # the backward of all_gather is a reduce-scatter
    assert names == {"all_gather (forward)", "reduce_scatter (backward)", "all_reduce (forward)",
                     "all_reduce (backward)", "compute"}
    for bar in fig.data:
        assert bar.marker.pattern.shape == ("/" if "(backward)" in bar.name else "")
    _assert_projector_ready(fig)


def test_hover_names_op_phase_shape_and_bytes(trace):
    fig = timeline_figure(trace)
    gather = next(t for t in fig.data if t.name == "all_gather (forward)")
    hover = gather.customdata[0]
    assert "<b>all_gather</b> (forward)" in hover
    assert "shape (2, 4) -> (6, 4) float32" in hover
    assert "sent 64 B, received 64 B" in hover  # 32 bytes to each of 2 peers


def test_the_subtitle_says_where_measured_times_come_from(trace):
    real = timeline_figure(trace, source="gloo").layout.title.text
    assert "real processes (gloo)" in real and "simulated" not in real
    sim = timeline_figure(trace, source="sim").layout.title.text
    assert "simulated run" in sim
    assert trace.backend == "simcomm"                     # a World's trace says what recorded it
    assert "simulated run" in timeline_figure(trace).layout.title.text
    trace.backend = None
    unknown = timeline_figure(trace).layout.title.text
    assert "simulated" not in unknown and "measured wall-clock time" in unknown
    trace.backend = "nccl"                                 # a trace that says what recorded it
    assert "real processes (nccl)" in timeline_figure(trace).layout.title.text


# --- modelled ---------------------------------------------------------------------------------

def _event(op, rank, start, *, group=(0, 1), nbytes=1 << 20, **fields):
    return TraceEvent(op=op, group=group, rank=rank, step=0 if op != "compute" else -1, phase="forward",
                      shape=(nbytes // 4,), dtype="float32", nbytes=nbytes, start=start, end=start, **fields)


def _overlap_trace(async_op):
    """2 ranks: an all-reduce of 1 MiB at t=0 (async: waited at t=3), then 1 ms of compute."""
    events = []
    for rank in (0, 1):
        events.append(_event("all_reduce", rank, 0.0, async_op=async_op, waited=3.0 if async_op else None))
        events.append(_event("compute", rank, 1.0, group=(rank,), nbytes=0, args={"seconds": 1e-3}))
    return Trace(events)


def _rows(fig, name):
    return [bar for bar in fig.data if bar.name == name]


def test_modelled_rows_compute_bars_and_exposed_communication():
    fig = timeline_figure(_overlap_trace(False), modelled=True, topology="pcie-2gpu")
    duration = estimate("all_reduce", 1 << 20, 2, "pcie-2gpu").time
    assert list(fig.layout.yaxis.categoryarray) == ["rank 0 compute", "rank 0 comm", "rank 1 compute",
                                                    "rank 1 comm"]
    compute, = _rows(fig, "compute")
    assert list(compute.y) == ["rank 0 compute", "rank 1 compute"]
    unit = {"µs": 1e6, "ms": 1e3, "s": 1.0}[fig.layout.xaxis.title.text.split("(")[1].rstrip(")")]
    assert list(compute.x) == pytest.approx([1e-3 * unit] * 2)
    assert list(compute.base) == pytest.approx([duration * unit] * 2)      # after the blocking call
    exposed, = _rows(fig, "all_reduce: exposed")
    assert exposed.marker.pattern.shape == "x"
    assert list(exposed.y) == ["rank 0 comm", "rank 1 comm"]
    assert list(exposed.x) == pytest.approx([duration * unit] * 2)
    assert _rows(fig, "all_reduce: hidden") == []
    waiting, = _rows(fig, "compute lane waits")
    assert list(waiting.y) == ["rank 0 compute", "rank 1 compute"]
    summary = [a.text for a in fig.layout.annotations]
    assert len(summary) == 2 and all("exposed" in text and "hidden 0" in text for text in summary)
    _assert_projector_ready(fig)


def test_modelled_async_communication_is_hidden_under_compute():
    fig = timeline_figure(_overlap_trace(True), modelled=True, topology="pcie-2gpu")
    duration = estimate("all_reduce", 1 << 20, 2, "pcie-2gpu").time
    unit = {"µs": 1e6, "ms": 1e3, "s": 1.0}[fig.layout.xaxis.title.text.split("(")[1].rstrip(")")]
    hidden, = _rows(fig, "all_reduce: hidden")
    assert hidden.marker.pattern.shape == ""
    assert list(hidden.x) == pytest.approx([duration * unit] * 2)
    assert list(hidden.base) == [0.0, 0.0]
    assert _rows(fig, "all_reduce: exposed") == [] and _rows(fig, "compute lane waits") == []
    compute, = _rows(fig, "compute")
    assert list(compute.base) == [0.0, 0.0]                                  # overlaps the all-reduce
    timeline = cost.modelled_timeline(_overlap_trace(True), "pcie-2gpu")
    for rank, note in zip((0, 1), fig.layout.annotations):
        summary = timeline.ranks[rank]
        assert summary.exposed == 0 and summary.hidden == pytest.approx(duration)
        assert f"exposed {0 * unit:.3g}" in note.text and f"hidden {summary.hidden * unit:.3g}" in note.text
    _assert_projector_ready(fig)


def test_modelled_bars_of_a_world_run_use_the_cost_model_durations(trace):
    with pytest.raises(ValueError, match=r"timeline_figure: modelled=True but .* call simcomm.model.cost.annotate"):
        timeline_figure(trace, modelled=True)
    annotate(trace, "h100-nvswitch")
    fig = timeline_figure(trace, modelled=True)
    unit = {"µs": 1e6, "ms": 1e3, "s": 1.0}[fig.layout.xaxis.title.text.split("(")[1].rstrip(")")]
    comm = sorted(w for t in fig.data if ":" in t.name for w in t.x)      # blocking: all exposed
    assert comm == pytest.approx(sorted(e.modelled * unit for e in trace.events if e.op != "compute"))
    compute, = _rows(fig, "compute")
    assert list(compute.x) == pytest.approx([1e-3 * unit] * 3)
    assert {t.name for t in fig.data} >= {"all_gather: exposed", "reduce_scatter: exposed",
                                          "all_reduce: exposed", "compute"}
    for t in fig.data:
        assert min(t.base if t.type == "bar" else t.x) >= 0


def test_errors():
    with pytest.raises(ValueError, match="timeline_figure: the trace has no events"):
        timeline_figure(simcomm.Trace())
    with pytest.raises(ValueError, match="timeline_figure: trace must be a simcomm.Trace, got list"):
        timeline_figure([])


def test_durations_are_written_without_scientific_notation():
    from simcomm.viz.timeline import _plain

    assert _plain(9.06e-07) == "0" and _plain(0.0) == "0"
    assert _plain(17.94) == "17.9" and _plain(0.0123) == "0.0123" and _plain(12345.6) == "12,346"
    assert all("e" not in _plain(v) for v in (1e-9, 3e-3, 0.5, 999.9, 1e6))


def _tiny_compute_trace(compute_seconds):
    """2 ranks: a blocking 1 MiB all-reduce, then compute of ``compute_seconds``, then another."""
    events = []
    for rank in (0, 1):
        events.append(_event("all_reduce", rank, 0.0))
        events.append(_event("compute", rank, 1.0, group=(rank,), nbytes=0, args={"seconds": compute_seconds}))
        events.append(TraceEvent(**{**vars(_event("all_reduce", rank, 2.0)), "step": 1}))
    return Trace(events)


def test_compute_too_short_for_a_bar_is_drawn_as_a_tick_over_the_waits():
    """A compute block of 1 ns between two all-reduces: its bar is far below a pixel, so a tick marks it
    on its compute row (09 and 12 looked as if their compute rows only waited)."""
    fig = timeline_figure(_tiny_compute_trace(1e-9), modelled=True, topology="pcie-2gpu")
    names = [t.name for t in fig.data]
    assert names.index("compute lane waits") < names.index("compute") < names.index("compute (too short for a bar)")
    ticks, = _rows(fig, "compute (too short for a bar)")
    compute, = _rows(fig, "compute")
    assert ticks.type == "scatter" and ticks.marker.symbol == "line-ns"
    assert list(ticks.y) == list(compute.y) == ["rank 0 compute", "rank 1 compute"]
    assert list(ticks.x) == pytest.approx([b + w / 2 for b, w in zip(compute.base, compute.x)])
    assert list(ticks.customdata) == list(compute.customdata)              # the same hover: its own times
    assert "a tick |: a compute block too short" in fig.layout.title.text
    assert all(a.text.startswith("compute under 0.005 µs<br>comm ") for a in fig.layout.annotations)
    _assert_projector_ready(fig)
    wide = timeline_figure(_tiny_compute_trace(1e-3), modelled=True, topology="pcie-2gpu")
    assert _rows(wide, "compute (too short for a bar)") == [] and "a tick" not in wide.layout.title.text
    assert all(a.text.startswith("compute 1 ms<br>") or a.text.startswith("compute 1,000 µs<br>")
               for a in wide.layout.annotations), [a.text for a in wide.layout.annotations]


@pytest.mark.parametrize("ranks", [None, [0]])
def test_the_title_sits_above_the_plot_and_the_legend_below_it(ranks):
    """Title and legend cannot overlap, however many lines and rows: the title at the top of the
    figure in a margin sized to its lines, the legend at the bottom in a margin sized to its rows."""
    from simcomm.viz.style import MAX_WIDTH_PX
    from simcomm.viz.timeline import _LEGEND_ROW_PX, _LINE_PX, _legend_rows

    fig = timeline_figure(_tiny_compute_trace(1e-9), modelled=True, topology="pcie-2gpu", ranks=ranks,
                          groups={"pairs": [[0, 1]]} if ranks else None)
    layout = fig.layout
    assert (layout.title.yref, layout.title.y, layout.title.yanchor) == ("container", 1.0, "top")
    assert (layout.legend.yref, layout.legend.y, layout.legend.yanchor) == ("container", 0.0, "bottom")
    lines = layout.title.text.count("<br>")
    assert layout.margin.t >= 26 + _LINE_PX * lines + 20
    rows = _legend_rows([t.name for t in fig.data], layout.legend.title.text,
                        MAX_WIDTH_PX - layout.margin.l - layout.margin.r)
    assert layout.width is None                            # sized to its column, at most MAX_WIDTH_PX wide
    assert rows >= 2                                       # 5 entries do not fit one row of the plot's width
    assert layout.margin.b >= 70 + _LEGEND_ROW_PX * rows   # below the x axis and its title
