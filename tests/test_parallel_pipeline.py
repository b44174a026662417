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
    assert sum(len(t.x) for t in figure.data) == 32
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
    assert all(t.textfont.size >= 14 for t in figure.data)
