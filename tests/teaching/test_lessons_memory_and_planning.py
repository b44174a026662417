"""The checkers of lessons 13 and 15 accept the solutions and reject wrong, partial and malformed answers."""
from __future__ import annotations

import pytest
import torch

from simcomm.lessons import memory_and_planning as mp_checks
from simcomm.lessons.verdicts import HINT_OFFER, NOT_ANSWERED
from simcomm.parallel import mixed_precision
from simcomm.planning import activations, planner
from simcomm.models.llama import LLAMA3_8B, LLAMA3_70B
from simcomm.planning.planner import GiB

SIZE = (256, 1, 128, 8, 4)


def kind(verdict: str) -> str:
    return "correct" if verdict.startswith("Correct") else "not answered" if verdict == NOT_ANSWERED else \
        "not yet" if verdict.startswith("Not yet: ") else "other"


# -- lesson 13 ---------------------------------------------------------------------------------

#: the library's bytes, computed at import: the checker refuses an answer whose cell calls the helper
LIBRARY_ANSWER = {mode: activations.expected_bytes(*SIZE, mode) for mode in activations.RECOMPUTE}


def test_activation_prediction_right_answer_is_correct_and_matches_the_lesson_numbers():
    answer = dict(LIBRARY_ANSWER)
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
LIMIT = 80 * GiB


def test_plan_choice_checker():
    fitting = [row for row in ROWS70 if row["total"] <= LIMIT]
    best = planner.key(min(fitting, key=lambda row: row["step_time"]))
    assert best == (1, 16, 8, 8) == planner.fastest_fitting(ROWS70, LIMIT)
    assert kind(mp_checks.check_plan_choice(best, ROWS70, LIMIT)) == "correct"
    assert mp_checks.check_plan_choice(..., ROWS70, LIMIT) == NOT_ANSWERED
    too_big = next(planner.key(r) for r in ROWS70 if r["total"] > LIMIT)
    assert "filter the rows by memory" not in mp_checks.check_plan_choice(too_big, ROWS70, LIMIT)
    assert "filter the rows by memory" in mp_checks.check_plan_choice(too_big, ROWS70, LIMIT, show_hint=True)
    slower = next(planner.key(r) for r in sorted(ROWS70, key=lambda r: -r["step_time"]) if r["total"] <= LIMIT)
    assert "shorter modelled step" in mp_checks.check_plan_choice(slower, ROWS70, LIMIT)
    assert "four ints" in mp_checks.check_plan_choice((1, 16, 8), ROWS70, LIMIT)
    assert "four ints" in mp_checks.check_plan_choice("1, 16, 8, 8", ROWS70, LIMIT)
    assert "not a layout of the table" in mp_checks.check_plan_choice((3, 1, 1, 1), ROWS70, LIMIT)
    assert kind(mp_checks.check_plan_choice(list(best), ROWS70, LIMIT)) == "correct"   # a list is a layout too


def test_sequence_doubling_checker():
    args = (LLAMA3_8B, 1024, 8192, LIMIT)
    before = planner.fastest_fitting(planner.plan(LLAMA3_8B, 1024, seq=8192, global_batch=1024), LIMIT)
    after = planner.fastest_fitting(planner.plan(LLAMA3_8B, 1024, seq=16384, global_batch=1024), LIMIT)
    assert [name for name, a, b in zip(planner.DIMENSIONS, before, after) if b > a] == ["cp"]
    assert kind(mp_checks.check_sequence_doubling(" CP ", *args, global_batch=1024)) == "correct"
    for wrong in ("tp", "pp", "dp"):
        verdict = mp_checks.check_sequence_doubling(wrong, *args, global_batch=1024)
        assert kind(verdict) == "not yet" and "Hint" not in verdict and verdict.endswith(HINT_OFFER)
        verdict = mp_checks.check_sequence_doubling(wrong, *args, global_batch=1024, show_hint=True)
        assert kind(verdict) == "not yet" and "Hint: " in verdict
    assert "answer one of" in mp_checks.check_sequence_doubling("sequence", *args, global_batch=1024)
    assert mp_checks.check_sequence_doubling(..., *args, global_batch=1024) == NOT_ANSWERED


def test_out_of_memory_reason_checker():
    rows8 = planner.plan(LLAMA3_8B, 1024, seq=8192, global_batch=1024)
    oom = next(r for r in rows8 if planner.key(r) == (1, 1, 1, 1024))
    assert oom["total"] > LIMIT and max(planner.LABELS, key=lambda label: oom[label]) == "activations"
    assert kind(mp_checks.check_out_of_memory_reason("activations", oom, LIMIT)) == "correct"
    assert "another label holds more" in mp_checks.check_out_of_memory_reason("gradients", oom, LIMIT)
    verdict = mp_checks.check_out_of_memory_reason("gradients", oom, LIMIT, show_hint=True)
    assert "stacked bar" in verdict
    assert "answer one of" in mp_checks.check_out_of_memory_reason("memory", oom, LIMIT)
    assert mp_checks.check_out_of_memory_reason(..., oom, LIMIT) == NOT_ANSWERED
