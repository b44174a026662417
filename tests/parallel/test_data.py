"""Data parallelism on the communicator, against the single-device float64 gradient."""
import pytest
import torch

import simcomm
from simcomm import viz
from simcomm.model import cost
from simcomm.parallel import data as dp
from simcomm.parallel import fsdp, zero

SMALL = (8, 16, 16, 4)


@pytest.fixture(scope="module")
def batch():
    return dp.make_data(16, SMALL, seed=3)


def _max_error(got, want):
    return max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("mode", ["avg", "scaled"])
def test_dp_gradients_equal_the_whole_batch(batch, world_size, mode):
    x, y = batch
    ref = dp.reference_grads(x, y, SMALL)
    outs = simcomm.World(world_size).run(dp.dp_grads, x, y, mode, SMALL)
    for grads in outs:
        assert _max_error(grads, ref) < 1e-12


def test_sum_of_mean_losses_is_world_size_times_too_big(batch):
    x, y = batch
    ref = dp.reference_grads(x, y, SMALL)
    for grads in simcomm.World(4).run(dp.dp_grads, x, y, "sum", SMALL):
        assert _max_error(grads, [4 * g for g in ref]) < 1e-12
        assert _max_error(grads, ref) > 1e-3


def test_accumulation_communicates_once_per_step(batch):
    x, y = batch
    ref = dp.reference_grads(x, y, SMALL)
    world = simcomm.World(2)
    for grads in world.run(dp.accumulation_grads, x, y, 4, SMALL):
        assert _max_error(grads, ref) < 1e-12
    calls = [e for e in world.trace.events if e.rank == 0 and e.op == "all_reduce"]
    assert len(calls) == len(list(dp.make_model(SMALL).parameters()))


def test_bucket_plan():
    assert dp.bucket_plan([4, 4, 4], 8, 0) == [[2, 1, 0]]
    assert dp.bucket_plan([4, 4, 4], 8, 1) == [[2], [1], [0]]
    assert dp.bucket_plan([4, 4, 4], 8, 64) == [[2, 1], [0]]
    assert dp.bucket_plan([4, 4, 4], 8, 10 ** 6) == [[2, 1, 0]]


@pytest.mark.parametrize("bucket_bytes", [0, 1, 600, 10 ** 6])
def test_bucketed_reducer_averages_and_issues_one_async_call_per_bucket(batch, bucket_bytes):
    x, y = batch
    ref = dp.reference_grads(x, y, SMALL)
    world = simcomm.World(4)
    for grads in world.run(dp.bucketed_grads, x, y, bucket_bytes, SMALL):
        assert _max_error(grads, ref) < 1e-12
    numels = [p.numel() for p in dp.make_model(SMALL).parameters()]
    calls = [e for e in world.trace.events if e.rank == 0 and e.op == "all_reduce"]
    assert len(calls) == len(dp.bucket_plan(numels, 8, bucket_bytes))
    assert all(e.async_op for e in calls)


@pytest.mark.parametrize("world_size, microbatches, bucket_bytes", [(1, 4, 600), (2, 4, 600), (4, 2, 0),
                                                                    (4, 4, 1)])
def test_no_sync_accumulates_the_whole_batch_gradient_and_communicates_once(batch, world_size, microbatches,
                                                                            bucket_bytes):
    x, y = batch
    ref = dp.reference_grads(x, y, SMALL)
    world = simcomm.World(world_size)
    for grads in world.run(dp.accumulated_bucketed_grads, x, y, microbatches, bucket_bytes, SMALL):
        assert _max_error(grads, ref) < 1e-12
    numels = [p.numel() for p in dp.make_model(SMALL).parameters()]
    calls = [e for e in world.trace.events if e.rank == 0 and e.op == "all_reduce"]
    assert len(calls) == len(dp.bucket_plan(numels, 8, bucket_bytes))
    assert {e.phase for e in calls} == {"backward"}


def _accumulate_without_no_sync(comm, x, y):
    model = dp.make_model(SMALL)
    reducer = dp.BucketedReducer(comm, model, 600)
    xs, ys = dp.rows(comm, x, y)
    for xm, ym in zip(xs.chunk(2), ys.chunk(2)):
        (dp.sum_loss(model, xm, ym) / x.shape[0]).backward()
    reducer.finish()


def test_a_second_synchronising_backward_before_finish_is_an_error(batch):
    with pytest.raises(simcomm.RankError, match="no_sync"):
        simcomm.World(2).run(_accumulate_without_no_sync, *batch)


def test_buckets_hide_communication_behind_backward():
    """One bucket waits for the whole backward: all of it exposed. Buckets overlap: less exposed."""
    x, y = dp.make_data(16)
    world = simcomm.World(4)
    summary = {}
    for bucket_bytes in (0, 1 << 20):
        world.run(dp.bucketed_grads, x, y, bucket_bytes)
        summary[bucket_bytes] = dp.overlap_of(world.trace)
    assert summary[0]["hidden"] == pytest.approx(0.0, abs=1e-12)
    assert summary[0]["exposed"] == pytest.approx(summary[0]["communication"])
    assert summary[1 << 20]["hidden"] > 0
    assert summary[1 << 20]["exposed"] < summary[0]["exposed"]
    figure = viz.bucket_overlap_figure({"one bucket": summary[0], "1 MiB": summary[1 << 20]})
    assert [t.name for t in figure.data][:2] == ["exposed communication", "hidden communication"]


def test_ddp_on_virtual_ranks_equals_the_reference(batch):
    x, y = batch
    ref = dp.reference_grads(x, y, SMALL)
    world = simcomm.World(2)
    for grads in world.run(dp.ddp_grads, x, y, 25.0, SMALL):
        assert _max_error(grads, ref) < 1e-12
    assert any(e.op == "all_reduce" and e.phase == "backward" for e in world.trace.events)


def test_rows_names_a_bad_split():
    with pytest.raises(simcomm.RankError, match="not divisible by the world size 4"):
        simcomm.World(4).run(lambda comm: dp.rows(comm, torch.zeros(6, 2)))


def test_zero3_prefetch_hides_all_gathers_and_keeps_the_output():
    mlp = zero.MLP((16, 64, 64, 8))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2))
    ref = fsdp.reference_forward(x, mlp)
    world = simcomm.World(4)
    exposed = {}
    for prefetch in (False, True):
        outs = world.run(fsdp.zero3_forward, x, mlp, prefetch=prefetch)
        assert all((o.double() - ref).abs().max() < 1e-5 for o in outs)   # fp32 model vs float64
        exposed[prefetch] = cost.modelled_timeline(world.trace, dp.PRESET).ranks[0].exposed
    assert exposed[True] < exposed[False]


def test_fsdp2_fully_shard_equals_the_reference():
    mlp = zero.MLP((8, 16, 8))
    x, y = (torch.randn(8, s, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in (8, 8))
    ref = fsdp.reference_grads(x, y, mlp)
    world = simcomm.World(2)
    for grads in world.run(fsdp.fsdp2_grads, x, y, mlp):
        assert _max_error(grads, ref) < 1e-12
    ops = {(e.op, e.phase) for e in world.trace.events}
    assert ("all_gather", "forward") in ops and ("reduce_scatter", "backward") in ops


def test_bucket_slider_shows_the_chosen_figure_and_fonts_are_readable():
    import plotly.graph_objects as go
    figures = {"a": go.Figure(layout=dict(title="a")), "b": go.Figure(layout=dict(title="b"))}
    box = viz.bucket_slider(figures, default="b")
    slider, output = box.children
    assert slider.value == "b" and list(slider.options) == ["a", "b"]
    slider.value = "a"                       # the observer redraws the output area without error
    with pytest.raises(ValueError, match="default='c'"):
        viz.bucket_slider(figures, default="c")
    figure = viz.bucket_overlap_figure({"x": {"exposed": 1e-6, "hidden": 2e-6, "end": 4e-6}})
    assert figure.layout.font.size >= 14 and figure.layout.xaxis.tickfont.size >= 14


def test_bucket_slider_offers_its_default_figure_as_a_static_fallback():
    """A static page cannot run the slider: its display carries the default size's figure as HTML,
    beside the widget view JupyterLab draws (the slider is then moved: the fallback stays the default)."""
    import plotly.graph_objects as go
    figures = {"a": go.Figure(layout=dict(title="figure a")), "b": go.Figure(layout=dict(title="figure b"))}
    box = viz.bucket_slider(figures, default="b")
    box.children[0].value = "a"
    bundle = box._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    fallback = bundle["text/html"]
    assert "figure b" in fallback and "figure a" not in fallback and "Plotly.newPlot(" in fallback
    assert "bucket size: b" in fallback and "needs a running kernel" in fallback
