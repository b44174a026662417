"""Pipeline schedules: gradients equal to the unsplit model, bubbles and activation memory against the formulas."""
import pytest

import simcomm
from simcomm import viz
from simcomm.lessons.training import schedule_makespan
from simcomm.parallel import data as dp
from simcomm.parallel import pipeline as pp


@pytest.fixture(scope="module")
def batch():
    return dp.make_data(16, pp.PIPE_SIZES, seed=4)


@pytest.mark.parametrize("name", pp.SCHEDULES)
@pytest.mark.parametrize("stages, microbatches", [(4, 4), (4, 8), (2, 2)])
def test_loss_and_every_gradient_equal_the_unsplit_model(batch, name, stages, microbatches):
    x, y = batch
    loss, ref = pp.reference(x, y, stages)
    outs = simcomm.World(stages).run(pp.pipeline_step, x, y, name, microbatches)
    assert abs(outs[-1]["loss"] - loss) < 1e-12
    for stage, out in enumerate(outs):
        assert max((a - b).abs().max().item() for a, b in zip(out["grads"], ref[stage], strict=True)) < 1e-12


@pytest.mark.parametrize("name", pp.SCHEDULES)
@pytest.mark.parametrize("stages, microbatches", [(4, 8), (4, 4), (3, 6)])
def test_measured_bubble_matches_the_formula(batch, name, stages, microbatches):
    x, y = batch
    sizes = (16,) + (64,) * (stages - 1) + (8,)
    world = simcomm.World(stages)
    world.run(pp.pipeline_step, x, y, name, microbatches, sizes)
    measured = pp.bubble(world.trace)
    assert measured == pytest.approx(pp.bubble_formula(name, stages, microbatches), abs=0.01)
    assert measured >= pp.bubble_formula(name, stages, microbatches) - 1e-9   # messages only add time


@pytest.mark.parametrize("stages, microbatches", [(4, 8), (4, 2), (1, 3), (5, 5)])
def test_schedules_are_valid_and_hold_what_the_table_says(stages, microbatches):
    for name in pp.SCHEDULES:
        plans = pp.schedule(name, stages, microbatches)
        assert pp.check_schedule(plans, microbatches) is None
        held = [pp.held(plan) for plan in plans]
        want = {"naive": [1] * stages, "gpipe": [microbatches] * stages,
                "1f1b": [min(stages - s, microbatches) for s in range(stages)]}[name]
        assert held == want
        if name != "naive":
            assert schedule_makespan(plans) == (microbatches + stages - 1) * 3


def test_measured_activation_memory_gpipe_vs_1f1b(batch):
    x, y = batch
    world = simcomm.World(4, memory=True)
    gpipe = world.run(pp.pipeline_step, x, y, "gpipe", 8)
    onef = world.run(pp.pipeline_step, x, y, "1f1b", 8)
    assert [o["held"] for o in gpipe] == [8] * 4 and [o["held"] for o in onef] == [4, 3, 2, 1]
    for stage in range(3):      # the last stage holds a loss, not an activation to send
        assert onef[stage]["activation_bytes"] < gpipe[stage]["activation_bytes"]


def test_check_schedule_finds_deadlocks_and_malformed_plans():
    problem = pp.check_schedule([[("F", 0), ("B", 0)], [("B", 0), ("F", 0)]], 1)
    assert problem and "B 0 before F 0" in problem
    assert "exactly once" in pp.check_schedule([[("F", 0)]], 1)
    dead = [[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]]
    assert "deadlock: stage 0 waits forever at ('B', 0)" in pp.check_schedule(dead, 2)
    assert "pair" in pp.check_schedule([["F0"]], 1)
    with pytest.raises(ValueError, match="schedules are"):
        pp.schedule("zigzag", 2, 2)


def test_pipeline_figure_draws_every_action(batch):
    x, y = batch
    world = simcomm.World(4)
    world.run(pp.pipeline_step, x, y, "1f1b", 4)
    plans = pp.schedule("1f1b", 4, 4)
    boxes = viz.pipeline.pipeline_boxes(world.trace, plans)
    assert len(boxes) == 4 * 8
    figure = viz.pipeline_figure(world.trace, plans)
    assert sum(len(t.x) for t in figure.data if t.meta == "boxes") == 32
    with pytest.raises(ValueError, match="compute events"):
        viz.pipeline_figure(world.trace, pp.schedule("1f1b", 4, 2))


def test_torch_pipelining_gpipe_equals_the_unsplit_model(batch):
    x, y = batch
    loss, ref = pp.reference(x, y, 4)
    outs = simcomm.World(4).run(pp.torch_pipeline_step, x, y, 4)
    assert abs(outs[-1]["loss"] - loss) < 1e-12
    for stage, out in enumerate(outs):
        assert max((a - b).abs().max().item() for a, b in zip(out["grads"], ref[stage], strict=True)) < 1e-12


@pytest.mark.parametrize("stages, chunks, microbatches", [(4, 2, 8), (2, 3, 8)])
def test_interleaved_stages_equal_the_unsplit_model_and_shrink_the_bubble(stages, chunks, microbatches):
    sizes = (16,) + (32,) * (stages * chunks - 1) + (8,)
    x, y = dp.make_data(16, sizes, seed=6)
    loss, ref = pp.reference(x, y, stages * chunks, sizes)
    world = simcomm.World(stages)
    # 10 ms per stage: the few microseconds each blocking recv costs stay below the tolerance
    outs = world.run(pp.interleaved_step, x, y, microbatches, chunks, sizes, 1e-2)
    assert abs(outs[-1]["loss"] - loss) < 1e-12
    for rank, out in enumerate(outs):
        for chunk, grads in enumerate(out["grads"]):
            want = ref[rank + chunk * stages]
            assert max((a - b).abs().max().item() for a, b in zip(grads, want, strict=True)) < 1e-12
    formula = pp.interleaved_bubble_formula(stages, microbatches, chunks)
    assert formula - 1e-9 <= pp.bubble(world.trace) <= formula + 0.01
    assert formula < pp.bubble_formula("gpipe", stages, microbatches)


def test_interleaved_plan_needs_enough_microbatches():
    with pytest.raises(ValueError, match="microbatches=2 < stages=4"):
        pp.interleaved_plan(4, 2, 2)


def test_pipeline_figure_fonts_are_readable(batch):
    x, y = batch
    world = simcomm.World(2)
    world.run(pp.pipeline_step, x, y, "gpipe", 2)
    figure = viz.pipeline_figure(world.trace, pp.schedule("gpipe", 2, 2))
    assert figure.layout.font.size >= 14
    assert all(t.textfont.size >= 14 for t in figure.data if t.meta == "boxes")
    assert figure.layout.uniformtext.minsize >= 14 and figure.layout.uniformtext.mode == "hide"


def _contrast(a: float, b: float) -> float:
    return (max(a, b) + 0.05) / (min(a, b) + 0.05)


def test_pipeline_figure_labels_contrast_legend_says_what_encodes_and_chunks_are_hatched(batch):
    x, y = batch
    world = simcomm.World(4)
    world.run(pp.pipeline_step, x, y, "zb-h1", 4)
    figure = viz.pipeline_figure(world.trace, pp.schedule("zb-h1", 4, 4))
    boxes = next(t for t in figure.data if t.meta == "boxes")
    for fill, ink in zip(boxes.marker.color, boxes.textfont.color, strict=True):
        rgb = viz.pipeline.rgb_triple(fill)
        text = 1.0 if ink == "white" else 0.0
        assert _contrast(viz.pipeline.luminance(rgb), text) >= 4.5, (fill, ink)     # WCAG AA
    legend = [t.name for t in figure.data if t.showlegend]
    assert legend == [viz.pipeline.KINDS[k][0] for k in "FBW"]
    assert "micro-batch" in figure.layout.legend.title.text
    greys = {tuple(round(c) for c in viz.pipeline.blend("rgb(128, 128, 128)", amount))
             for _, amount in viz.pipeline.KINDS.values()}
    assert {viz.pipeline.rgb_triple(t.marker.color) for t in figure.data if t.showlegend} <= greys   # not a micro-batch's
    # interleaved: the chunk of each box is its hatch, and the legend names it
    world.run(pp.interleaved_step, *dp.make_data(16, (16,) + (32,) * 7 + (8,)), 4, 2, (16,) + (32,) * 7 + (8,))
    figure = viz.pipeline_figure(world.trace, pp.interleaved_plan(4, 4, 2))
    boxes = next(t for t in figure.data if t.meta == "boxes")
    plan_chunks = [c for plan in pp.interleaved_plan(4, 4, 2) for _, _, c in plan]
    assert list(boxes.marker.pattern.shape) == [viz.pipeline.CHUNK_PATTERNS[c] for c in plan_chunks]
    assert [t.name for t in figure.data if t.showlegend][-2:] == ["chunk v0 (no hatch)", "chunk v1 (hatched /)"]


@pytest.mark.parametrize("stages, microbatches", [(4, 8), (4, 4), (2, 16), (3, 8)])
def test_zero_bubble_equals_the_unsplit_model_and_measures_the_papers_bubble(batch, stages, microbatches):
    """ZB-H1 (Qi et al. 2023): B and W split; loss and gradients exact; bubble (p-1)/(3m+p-1) measured."""
    x, y = batch
    sizes = (16,) + (64,) * (stages - 1) + (8,)
    loss, ref = pp.reference(x, y, stages, sizes)
    world = simcomm.World(stages)
    outs = world.run(pp.pipeline_step, x, y, pp.ZERO_BUBBLE, microbatches, sizes)
    assert abs(outs[-1]["loss"] - loss) < 1e-12
    for stage, out in enumerate(outs):
        assert max((a - b).abs().max().item() for a, b in zip(out["grads"], ref[stage], strict=True)) < 1e-12
    formula = pp.bubble_formula(pp.ZERO_BUBBLE, stages, microbatches)
    assert formula == pytest.approx((stages - 1) / (3 * microbatches + stages - 1))
    measured = pp.bubble(world.trace)
    assert formula - 1e-9 <= measured <= formula + 0.01
    assert measured < pp.bubble_formula("1f1b", stages, microbatches) / 2


def test_zero_bubble_with_two_layers_per_stage_splits_every_linear(batch):
    x, y = batch
    sizes = (16,) + (32,) * 7 + (8,)                      # 8 linears on 4 stages
    loss, ref = pp.reference(x, y, 4, sizes)
    outs = simcomm.World(4).run(pp.pipeline_step, x, y, "zb-h1", 8, sizes)
    assert abs(outs[-1]["loss"] - loss) < 1e-12
    for stage, out in enumerate(outs):
        assert max((a - b).abs().max().item() for a, b in zip(out["grads"], ref[stage], strict=True)) < 1e-12


@pytest.mark.parametrize("stages, microbatches", [(4, 8), (4, 4), (8, 32), (1, 3), (5, 5)])
def test_zero_bubble_plan_is_valid_keeps_1f1bs_peak_and_fills_the_drain(stages, microbatches):
    plans = pp.schedule("zb-h1", stages, microbatches)
    assert pp.check_schedule(plans, microbatches) is None
    assert [pp.held(plan) for plan in plans] == [min(stages, microbatches)] * stages
    assert max(pp.held(plan) for plan in plans) == max(pp.held(plan) for plan in pp.schedule("1f1b", stages,
                                                                                              microbatches))
    # F = B = W = 1 time unit: 3m units of work per stage plus the (p-1)(tF + tB - tW) bubble
    assert pp.makespan(plans) == 3 * microbatches + stages - 1
    assert pp.makespan(pp.schedule("1f1b", stages, microbatches)) == 3 * (microbatches + stages - 1)


def test_zero_bubble_checks_and_formula_errors():
    assert "W 0 before B 0" in pp.check_schedule([[("F", 0), ("W", 0), ("B", 0)]], 1)
    assert "F i, B i, W i exactly once" in pp.check_schedule([[("F", 0), ("B", 0), ("W", 0), ("W", 0)]], 1)
    # W waits only for its own stage's B: delaying it to the end is valid
    assert pp.check_schedule([[("F", 0), ("B", 0), ("W", 0)], [("F", 0), ("B", 0), ("W", 0)]], 1) is None
    with pytest.raises(ValueError, match="needs microbatches >= stages"):
        pp.bubble_formula("zb-h1", 4, 2)
    with pytest.raises(ValueError, match="pipeline.makespan: stage 1 runs B 0 before F 0"):
        pp.makespan([[("F", 0), ("B", 0)], [("B", 0), ("F", 0)]])
    with pytest.raises(ValueError, match="deadlock: stage 0 waits forever"):
        pp.makespan([[("F", 0), ("B", 0), ("F", 1), ("B", 1)], [("F", 0), ("F", 1), ("B", 0), ("B", 1)]])


def test_simulated_memory_per_stage_1f1b_below_gpipe_and_zero_bubble(batch):
    """Simulated memory per stage: ZB-H1's bytes; GPipe > 1F1B on every stage, the last one included."""
    x, y = batch
    world = simcomm.World(4, memory=True)
    got = {name: [o["activation_bytes"] for o in world.run(pp.pipeline_step, x, y, name, 8)]
           for name in ("gpipe", "1f1b", "zb-h1")}
    assert all(a < b for a, b in zip(got["1f1b"], got["gpipe"], strict=True))
    assert all(a <= b for a, b in zip(got["1f1b"], got["zb-h1"], strict=True))   # ZB holds p on every stage


@pytest.mark.real
def test_activation_bytes_on_real_workers_against_the_simulator(batch):
    """The same step on gloo workers, checked and unchecked: every stage's bytes are the
    simulator's to the byte under every schedule (an isend's copy counts on its sender until
    the step waits on it, on both backends), and 1F1B holds less than GPipe on every stage."""
    import real

    x, y = batch
    world = simcomm.World(4, memory=True)
    sim = {name: [o["activation_bytes"] for o in world.run(pp.pipeline_step, x, y, name, 8)]
           for name in ("gpipe", "1f1b", "zb-h1")}
    assert all(a < b for a, b in zip(sim["1f1b"], sim["gpipe"], strict=True))
    for checked in (True, False):
        with real.Cluster(4, backend="gloo", memory=True, timeout=120, checked=checked) as cluster:
            for name, want in sim.items():
                for _ in range(2):           # a second step in the same workers: the same bytes
                    got = [o["activation_bytes"] for o in cluster.run(pp.pipeline_step, x, y, name, 8)]
                    assert got == want, (checked, name, got, want)


@pytest.mark.parametrize("schedule_class", sorted(pp.TORCH_MULTISTAGE))
def test_torch_zero_bubble_and_interleaved_schedules_equal_the_unsplit_model(schedule_class):
    sizes = (16,) + (32,) * 7 + (8,)
    x, y = dp.make_data(16, sizes, seed=8)
    loss, ref = pp.reference(x, y, 8, sizes)
    outs = simcomm.World(4).run(pp.torch_multistage_step, x, y, 8, 2, sizes, schedule_class)
    assert sorted(k for out in outs for k in out["stage_ids"]) == list(range(8))
    losses = [out["loss"] for out in outs if out["loss"] is not None]
    assert len(losses) == 1 and abs(losses[0] - loss) < 1e-12
    for out in outs:
        for stage_id, grads in zip(out["stage_ids"], out["grads"], strict=True):
            assert max((a - b).abs().max().item() for a, b in zip(grads, ref[stage_id], strict=True)) < 1e-12


def test_torch_stage_ids_place_loops_and_the_v():
    assert pp.torch_stage_ids("ScheduleInterleavedZeroBubble", 1, 4, 2) == [1, 5]
    assert pp.torch_stage_ids("ScheduleZBVZeroBubble", 1, 4, 2) == [1, 6]
    with pytest.raises(ValueError, match="places 2 chunks per rank"):
        pp.torch_stage_ids("ScheduleZBVZeroBubble", 0, 4, 3)
    with pytest.raises(ValueError, match="multi-stage schedules are"):
        pp.torch_stage_ids("ScheduleGPipe", 0, 4, 2)
