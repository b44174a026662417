"""The planner's accounting against hand-computed formulas and the measured mixed-precision bytes."""
from __future__ import annotations

import pytest

import simcomm
from simcomm.parallel import mixed_precision as mp
from simcomm.planning import planner
from simcomm.models.llama import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B
from simcomm.planning.planner import GiB


def test_parameter_counts_match_the_published_sizes():
    assert LLAMA3_8B.parameters == 8_030_261_248            # Hugging Face's count for Meta-Llama-3-8B
    assert abs(LLAMA3_70B.parameters - 70.6e9) / 70.6e9 < 0.001
    assert abs(LLAMA3_405B.parameters - 405.9e9) / 405.9e9 < 0.001


def test_layouts_multiply_to_the_budget_and_respect_the_limits():
    found = planner.layouts(LLAMA3_70B, 1024, global_batch=1024)
    assert found and all(tp * cp * pp * dp == 1024 for tp, cp, pp, dp in found)
    assert all(tp <= 8 and cp <= 16 and pp <= 16 and 1024 % dp == 0 for tp, cp, pp, dp in found)
    assert (8, 1, 16, 8) in found and (16, 1, 1, 64) not in found
    with pytest.raises(ValueError, match="gpus=1000"):
        planner.layouts(LLAMA3_8B, 1000, global_batch=1000)


def test_memory_by_label_of_a_4d_layout_by_hand():
    tp, cp, pp, dp = 8, 2, 4, 8
    row = planner.memory_per_gpu(LLAMA3_70B, (tp, cp, pp, dp), seq=8192, global_batch=64)
    layers = 80 // pp
    psi = layers * LLAMA3_70B.layer_parameters / tp + LLAMA3_70B.vocab * LLAMA3_70B.hidden / tp
    assert row["stage"] == "first"                           # 4 micro-batches in flight on the first stage
    assert row["parameters"] == pytest.approx(2 * psi, abs=2)
    assert row["gradients"] == pytest.approx(4 * psi, abs=4)
    assert row["optimizer_state"] == pytest.approx(12 * psi / (dp * cp), abs=1)
    h, f = 8192, 28672
    per_layer = 2 * 8192 * (6 * h + 2 * h * 8 / 64 + 4 * f) / (tp * cp)
    assert row["activations"] == pytest.approx(4 * layers * per_layer)
    full = planner.memory_per_gpu(LLAMA3_70B, (tp, cp, pp, dp), seq=8192, global_batch=64, recompute="full")
    assert full["activations"] == pytest.approx(4 * layers * 2 * 8192 * h / (tp * cp))


def test_model_states_are_the_measured_mixed_precision_bytes():
    """The planner's model states are mixed_precision.expected_bytes, which a run measures."""
    psi = mp.MLP().numel
    world = simcomm.World(4, memory=True)
    world.run(mp.train, 1, gradients="fp32 main_grad", steps=1)
    measured = world.memory.at("after step 1")[0]
    assert {k: measured[k] for k in ("parameters", "gradients", "optimizer_state")} == \
        mp.expected_bytes(1, psi, 4, "fp32 main_grad")


def test_step_time_parts_and_the_ranking():
    rows = planner.plan(LLAMA3_8B, 1024, seq=8192, global_batch=1024)
    for row in rows:
        parts = row["compute"] + row["bubble"] + row["tp_comm"] + row["cp_comm"] + row["dp_exposed"]
        assert row["step_time"] == pytest.approx(parts)
        assert (row["tp_comm"] > 0) == (row["tp"] > 1) and (row["cp_comm"] > 0) == (row["cp"] > 1)
        assert row["bubble"] == pytest.approx(row["compute"] * (row["pp"] - 1) / row["micro_batches"])
    compute = {round(row["compute"], 9) for row in rows}
    assert len(compute) == 1                                  # the same flops on the same GPUs
    flops = 6 * (32 * LLAMA3_8B.layer_parameters + LLAMA3_8B.vocab * 4096) * 1024 * 8192 \
        + 6 * 32 * 4096 * 8192 * 1024 * 8192
    assert rows[0]["compute"] == pytest.approx(flops / (1024 * 989e12 * 0.4))
    best = planner.fastest_fitting(rows, 80 * GiB)
    fitting = [r for r in rows if r["total"] <= 80 * GiB]
    assert best == planner.key(min(fitting, key=lambda r: r["step_time"]))
    assert planner.fastest_fitting(rows, 1) is None


def test_published_layouts_are_rows_of_their_plans():
    for case in planner.published_layouts():
        rows = planner.plan(case["model"], case["gpus"], **case["plan"])
        assert case["layout"] in [planner.key(r) for r in rows], case["source"]
