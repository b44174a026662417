"""The checkers of lessons 13 and 15 accept the solutions and reject wrong, partial and malformed answers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from simcomm.lessons import memory_and_planning as mp_checks
from simcomm.lessons.verdicts import HINT_OFFER, NOT_ANSWERED
from simcomm.parallel import mixed_precision
from simcomm.planning import activations, planner
from simcomm.models.llama import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B
from simcomm.parallel.mesh import Layout
from simcomm.planning.planner import GiB

SIZE = (256, 1, 128, 8, 4)


def kind(verdict: str) -> str:
    return "correct" if verdict.startswith("Correct") else "not answered" if verdict == NOT_ANSWERED else \
        "not yet" if verdict.startswith("Not yet: ") else "other"


# -- lesson 13 ---------------------------------------------------------------------------------

def test_activation_prediction_right_answer_is_correct_and_matches_the_lesson_numbers():
    answer = {mode: activations.expected_bytes(*SIZE, mode) for mode in activations.RECOMPUTE}
    assert answer == {"none": 934400, "selective": 279040, "full": 16384}
    assert kind(mp_checks.check_activation_prediction(answer, *SIZE)) == "correct"
    assert kind(mp_checks.check_activation_prediction({"none": torch.tensor(934400), "selective": 279040.0,
                                                       "full": 16384}, *SIZE)) == "correct"


@pytest.mark.parametrize("answer, hint", [
    ({"none": ..., "selective": ..., "full": ...}, None),
    ({"none": 933888, "selective": 279040, "full": 16384}, "mean and rstd"),          # the paper's formula
    ({"none": 934400 * 4, "selective": 279040, "full": 16384}, "split over the t = 4"),
    ({"none": 934400, "selective": 279040}, "no entry for ['full']"),               # partial
    ({"none": 934400, "selective": "many", "full": 16384}, "is not a number"),       # malformed
    ([934400, 279040, 16384], "give a dict"),
    ({"none": 934400, "selective": 279040, "full": 16896}, "count what backward needs"),  # stats kept in full
])
def test_activation_prediction_rejects(answer, hint):
    verdict = mp_checks.check_activation_prediction(answer, *SIZE, show_hint=True)
    if hint is None:
        assert verdict == NOT_ANSWERED
    else:
        assert kind(verdict) == "not yet" and hint in verdict, verdict


def test_the_first_answer_states_the_problem_and_the_hint_comes_on_request():
    paper = {"none": 933888, "selective": 279040, "full": 16384}
    first = mp_checks.check_activation_prediction(paper, *SIZE)
    assert "the paper's formula" in first and "Hint" not in first and "rstd" not in first
    assert first.endswith(HINT_OFFER)
    second = mp_checks.check_activation_prediction(paper, *SIZE, show_hint=True)
    assert "the paper's formula" in second and "\nHint: " in second and "rstd" in second


def state_bytes(stage, psi, world_size, gradients):
    """Exercise 2's right answer, written out: 2 + (2 or 4) + 12 bytes, stage k shards the first k."""
    grad = 2 if gradients == "16-bit" else 4
    return {"parameters": 2 * psi / (world_size if stage >= 3 else 1),
            "gradients": grad * psi / (world_size if stage >= 2 else 1),
            "optimizer_state": 12 * psi / (world_size if stage >= 1 else 1)}


def test_the_state_bytes_formula_is_the_measured_one():
    for gradients in mixed_precision.GRADIENTS:
        for stage in range(4):
            assert state_bytes(stage, 5768, 4, gradients) == mixed_precision.expected_bytes(stage, 5768, 4, gradients)


def test_model_state_bytes_solution_and_mistakes():
    assert kind(mp_checks.check_model_state_bytes(state_bytes)) == "correct"
    assert mp_checks.check_model_state_bytes(...) == NOT_ANSWERED

    def placeholder(stage, psi, world_size, gradients):
        raise NotImplementedError
    assert mp_checks.check_model_state_bytes(placeholder) == NOT_ANSWERED

    def fp32_everywhere(stage, psi, world_size, gradients):          # the fp32 ZeRO table of lesson 7
        n = world_size
        return {"parameters": 4 * psi / (n if stage >= 3 else 1), "gradients": 4 * psi / (n if stage >= 2 else 1),
                "optimizer_state": 8 * psi / (n if stage >= 1 else 1)}
    verdict = mp_checks.check_model_state_bytes(fp32_everywhere)
    assert kind(verdict) == "not yet" and "12 for master + Adam" not in verdict and HINT_OFFER in verdict
    verdict = mp_checks.check_model_state_bytes(fp32_everywhere, show_hint=True)
    assert kind(verdict) == "not yet" and "12 for master + Adam" in verdict

    def no_main_grad(stage, psi, world_size, gradients):
        return state_bytes(stage, psi, world_size, "16-bit")
    assert "fp32 main_grad" in mp_checks.check_model_state_bytes(no_main_grad)

    def missing_key(stage, psi, world_size, gradients):
        return {"parameters": 2 * psi, "gradients": 2 * psi}
    assert "exactly the keys" in mp_checks.check_model_state_bytes(missing_key, show_hint=True)
    assert kind(mp_checks.check_model_state_bytes(lambda *a: 1 / 0)) == "not yet"
    assert "give a function" in mp_checks.check_model_state_bytes(16)


def skip_step(comm, grads):
    """Exercise 3's right answer: the ranks' overflow flags combined with MAX before deciding."""
    flag = torch.tensor([0.0 if all(bool(torch.isfinite(g).all()) for g in grads) else 1.0])
    return bool(comm.all_reduce(flag, "max").item())


def buggy_skip_step(comm, grads):
    """Exercise 3's bug: each rank decides on its own gradients."""
    return not all(bool(torch.isfinite(g).all()) for g in grads)


def test_skip_step_solution_buggy_version_and_other_mistakes():
    assert kind(mp_checks.check_skip_step(skip_step)) == "correct"
    assert mp_checks.check_skip_step(...) == NOT_ANSWERED
    first = mp_checks.check_skip_step(buggy_skip_step)
    assert kind(first) == "not yet" and "diverge" in first and "all_reduce" not in first and "Hint" not in first
    assert first.endswith(HINT_OFFER)
    verdict = mp_checks.check_skip_step(buggy_skip_step, show_hint=True)
    assert kind(verdict) == "not yet" and "diverge" in verdict and "Hint: " in verdict and "all_reduce" in verdict
    assert "expected False" in mp_checks.check_skip_step(lambda comm, grads: bool(comm.all_reduce(
        torch.ones(1), "max").item()))                                      # always skips
    def only_inf(comm, grads):                                            # NaN is an overflow too
        flag = torch.tensor([float(any(bool(torch.isinf(g).any()) for g in grads))])
        return bool(comm.all_reduce(flag, "max").item())
    assert "expected True" in mp_checks.check_skip_step(only_inf)
    assert "return True (skip) or False" in mp_checks.check_skip_step(lambda comm, grads: 0)
    def rank0_only(comm, grads):                                          # a collective on one rank: deadlock
        if comm.rank == 0:
            comm.all_reduce(torch.ones(1))
        return False
    assert kind(mp_checks.check_skip_step(rank0_only)) == "not yet"


# -- lesson 15 ---------------------------------------------------------------------------------

ROWS70 = planner.plan(LLAMA3_70B, 1024, seq=8192, global_batch=1024)
LIMIT = planner.H100_MEMORY
BEST70 = (2, 4, 4, 32)


def test_plan_choice_is_the_fastest_fitting_row_by_hand():
    fitting = [row for row in ROWS70 if row["total"] <= LIMIT]
    assert planner.key(min(fitting, key=lambda row: row["step_time"])) == BEST70 == \
        planner.fastest_fitting(ROWS70, LIMIT)


TOO_BIG = next(planner.key(r) for r in ROWS70 if r["total"] > LIMIT)
SLOWER = next(planner.key(r) for r in sorted(ROWS70, key=lambda r: -r["step_time"]) if r["total"] <= LIMIT)
BEST_ROW = next(r for r in ROWS70 if planner.key(r) == BEST70)


@pytest.mark.parametrize("answer, verdict, text", [
    (BEST70, "correct", ""),
    (list(BEST70), "correct", ""),
    (tuple(np.int64(v) for v in BEST70), "correct", ""),                     # numpy ints
    (tuple(torch.tensor(v) for v in BEST70), "correct", ""),                 # torch ints
    ({"tp": 2, "cp": 4, "pp": 4, "dp": 32}, "correct", ""),
    ({"TP": 2, "Cp": 4, " PP ": 4, "dp": 32}, "correct", ""),                # capitalisation
    (Layout(tp=2, cp=4, pp=4, dp=32), "correct", ""),
    (..., "not answered", ""),
    (None, "not yet", "got None"),
    (TOO_BIG, "not yet", "filter the rows by memory"),
    (SLOWER, "not yet", "shorter modelled step"),
    ((2, 4, 4), "not yet", "four ints"),                                    # partial
    ("2, 4, 4, 32", "not yet", "four ints"),                                # malformed
    ((2.0, 4, 4, 32), "not yet", "four ints"),
    ((True, 4, 4, 32), "not yet", "four ints"),
    ({"tp": 2, "cp": 4, "pp": 4}, "not yet", "exactly the keys"),
    ((3, 1, 1, 1), "not yet", "not a layout of the table"),
    (BEST_ROW, "not yet", "the planner's row"),                              # a helper's result, not a layout
    ([BEST_ROW], "not yet", "the planner's row"),
])
def test_plan_choice_checker_table(answer, verdict, text):
    got = mp_checks.check_plan_choice(answer, ROWS70, LIMIT, show_hint=True)
    assert kind(got) == verdict and text in got, got


def test_plan_choice_hint_only_on_request():
    verdict = mp_checks.check_plan_choice(TOO_BIG, ROWS70, LIMIT)
    assert "filter the rows by memory" not in verdict and verdict.endswith(HINT_OFFER)


def test_sequence_doubling_checker():
    args = (LLAMA3_8B, 1024, 8192, LIMIT)
    before = planner.fastest_fitting(planner.plan(LLAMA3_8B, 1024, seq=8192, global_batch=1024), LIMIT)
    after = planner.fastest_fitting(planner.plan(LLAMA3_8B, 1024, seq=16384, global_batch=1024), LIMIT)
    assert [name for name, a, b in zip(planner.DIMENSIONS, before, after) if b > a] == ["cp"]
    for right in (" CP ", "cp", "Cp", ["cp"]):
        assert kind(mp_checks.check_sequence_doubling(right, *args, global_batch=1024)) == "correct", right
    for wrong in ("tp", "pp", "dp"):
        verdict = mp_checks.check_sequence_doubling(wrong, *args, global_batch=1024)
        assert kind(verdict) == "not yet" and "Hint" not in verdict and verdict.endswith(HINT_OFFER)
        verdict = mp_checks.check_sequence_doubling(wrong, *args, global_batch=1024, show_hint=True)
        assert kind(verdict) == "not yet" and "Hint: " in verdict
    for malformed in ("sequence", None, 2, ("cp", "tp")):
        assert "answer one of" in mp_checks.check_sequence_doubling(malformed, *args, global_batch=1024)
    assert mp_checks.check_sequence_doubling(..., *args, global_batch=1024) == NOT_ANSWERED


def test_out_of_memory_reason_checker():
    rows8 = planner.plan(LLAMA3_8B, 1024, seq=8192, global_batch=1024)
    oom = next(r for r in rows8 if planner.key(r) == (1, 1, 1, 1024))
    psi = LLAMA3_8B.parameters
    assert oom["total"] > LIMIT and oom["gradients"] == 4 * psi                # fp32 main_grad, unsharded
    assert max(planner.LABELS, key=lambda label: oom[label]) == "gradients"
    for right in ("gradients", "Gradients ", ["gradients"]):
        assert kind(mp_checks.check_out_of_memory_reason(right, oom, LIMIT)) == "correct"
    assert "another label holds more" in mp_checks.check_out_of_memory_reason("activations", oom, LIMIT)
    assert kind(mp_checks.check_out_of_memory_reason("Optimizer state", oom, LIMIT)) == "not yet"
    assert "stacked bar" in mp_checks.check_out_of_memory_reason("parameters", oom, LIMIT, show_hint=True)
    for malformed in ("memory", None, 3):
        assert "answer one of" in mp_checks.check_out_of_memory_reason(malformed, oom, LIMIT)
    assert mp_checks.check_out_of_memory_reason(..., oom, LIMIT) == NOT_ANSWERED
    # the lesson's claim: ZeRO-2 (gradients sharded 1024 ways) fits
    assert planner.evaluate(LLAMA3_8B, (1, 1, 1, 1024), seq=8192, global_batch=1024, zero=2)["total"] <= LIMIT


MODELS = (LLAMA3_8B, LLAMA3_70B, LLAMA3_405B)


def _right(model, layout):
    tp, cp, pp, dp = layout
    stack = -(-model.layers // pp) * model.layer_parameters
    embedding = model.vocab * model.hidden
    return (stack + (2 * embedding if pp == 1 else embedding) + model.hidden) / tp


def _buggy(model, layout):                        # the lesson's: the output layer missing when pp == 1
    tp, cp, pp, dp = layout
    stack = -(-model.layers // pp) * model.layer_parameters
    return (stack + model.vocab * model.hidden + model.hidden) / tp


def _not_implemented(model, layout):
    raise NotImplementedError


@pytest.mark.parametrize("answer, verdict, text", [
    (_right, "correct", ""),
    (lambda model, layout: np.float64(_right(model, layout)), "correct", ""),
    (lambda model, layout: torch.tensor(round(_right(model, layout))), "correct", ""),
    (lambda model, layout: int(_right(model, layout)), "correct", ""),
    (_buggy, "not yet", "embedding and the output layer"),
    (lambda model, layout: _right(model, layout) * layout[0], "not yet", "split tp ways"),
    (lambda model, layout: None, "not yet", "not a number"),
    (lambda model, layout: str(_right(model, layout)), "not yet", "not a number"),
    (lambda model: 0, "not yet", "raised TypeError"),
    (_not_implemented, "not answered", ""),
    (..., "not answered", ""),
    (None, "not yet", "a function"),
    (_right(LLAMA3_8B, (1, 1, 1, 1024)), "not yet", "a function"),        # a number, not the function
    (planner.stage_parameters, "not yet", "the planner's own function"),  # the helper itself
])
def test_stage_parameters_checker_table(answer, verdict, text):
    got = mp_checks.check_stage_parameters(answer, MODELS, show_hint=True)
    assert kind(got) == verdict and text in got, got


def test_stage_parameters_by_hand():
    """The library copy against the count by hand: 8B pure data parallel holds every parameter."""
    assert planner.stage_parameters(LLAMA3_8B, (1, 1, 1, 1024)) == LLAMA3_8B.parameters
    assert planner.stage_parameters(LLAMA3_8B, (1, 1, 1, 1024)) - _buggy(LLAMA3_8B, (1, 1, 1, 1024)) == \
        128256 * 4096                                                         # 525 M: 6.5 % of 8B
    for model in MODELS:
        for layout in mp_checks.STAGE_CASES:
            assert planner.stage_parameters(model, layout) == _right(model, layout)
