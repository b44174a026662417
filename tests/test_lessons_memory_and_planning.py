"""The checkers of lessons 13 and 15 accept the solutions and reject wrong, partial and malformed answers."""
from __future__ import annotations

import pytest
import torch

from simcomm.lessons import memory_and_planning as mp_checks
from simcomm.lessons.verdicts import NOT_ANSWERED
from simcomm.parallel import planner
from simcomm.parallel.planner import GiB, LLAMA3_8B, LLAMA3_70B

SIZE = (256, 1, 128, 8, 4)


def kind(verdict: str) -> str:
    return "correct" if verdict.startswith("Correct") else "not answered" if verdict == NOT_ANSWERED else \
        "not yet" if verdict.startswith("Not yet: ") else "other"


# -- lesson 13 ---------------------------------------------------------------------------------

def test_activation_prediction_solution_is_correct_and_matches_the_lesson_numbers():
    answer = mp_checks.solution_activation_prediction(*SIZE)
    assert answer == {"none": 934400, "selective": 279040, "full": 16384}
    assert kind(mp_checks.check_activation_prediction(answer, *SIZE)) == "correct"


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
    verdict = mp_checks.check_activation_prediction(answer, *SIZE)
    if hint is None:
        assert verdict == NOT_ANSWERED
    else:
        assert kind(verdict) == "not yet" and hint in verdict, verdict


def test_model_state_bytes_solution_and_mistakes():
    assert kind(mp_checks.check_model_state_bytes(mp_checks.solution_model_state_bytes)) == "correct"

    def placeholder(stage, psi, world_size, gradients):
        raise NotImplementedError
    assert mp_checks.check_model_state_bytes(placeholder) == NOT_ANSWERED

    def fp32_everywhere(stage, psi, world_size, gradients):          # the fp32 ZeRO table of lesson 7
        n = world_size
        return {"parameters": 4 * psi / (n if stage >= 3 else 1), "gradients": 4 * psi / (n if stage >= 2 else 1),
                "optimizer_state": 8 * psi / (n if stage >= 1 else 1)}
    verdict = mp_checks.check_model_state_bytes(fp32_everywhere)
    assert kind(verdict) == "not yet" and "12 for master + Adam" in verdict

    def no_main_grad(stage, psi, world_size, gradients):
        return mp_checks.solution_model_state_bytes(stage, psi, world_size, "16-bit")
    assert "fp32 main_grad" in mp_checks.check_model_state_bytes(no_main_grad)

    def missing_key(stage, psi, world_size, gradients):
        return {"parameters": 2 * psi, "gradients": 2 * psi}
    assert "exactly the keys" in mp_checks.check_model_state_bytes(missing_key)
    assert kind(mp_checks.check_model_state_bytes(lambda *a: 1 / 0)) == "not yet"
    assert "give a function" in mp_checks.check_model_state_bytes(16)


def test_skip_step_solution_buggy_version_and_other_mistakes():
    assert kind(mp_checks.check_skip_step(mp_checks.solution_skip_step)) == "correct"
    verdict = mp_checks.check_skip_step(mp_checks.buggy_skip_step)
    assert kind(verdict) == "not yet" and "diverge" in verdict and "all_reduce" in verdict
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
    best = mp_checks.solution_plan_choice(ROWS70, LIMIT)
    assert kind(mp_checks.check_plan_choice(best, ROWS70, LIMIT)) == "correct"
    assert mp_checks.check_plan_choice(..., ROWS70, LIMIT) == NOT_ANSWERED
    too_big = next(planner.key(r) for r in ROWS70 if r["total"] > LIMIT)
    assert "filter the rows by memory" in mp_checks.check_plan_choice(too_big, ROWS70, LIMIT)
    slower = next(planner.key(r) for r in sorted(ROWS70, key=lambda r: -r["step_time"]) if r["total"] <= LIMIT)
    assert "shorter modelled step" in mp_checks.check_plan_choice(slower, ROWS70, LIMIT)
    assert "four ints" in mp_checks.check_plan_choice((1, 16, 8), ROWS70, LIMIT)
    assert "four ints" in mp_checks.check_plan_choice("1, 16, 8, 8", ROWS70, LIMIT)
    assert "not a layout of the table" in mp_checks.check_plan_choice((3, 1, 1, 1), ROWS70, LIMIT)


def test_sequence_doubling_checker():
    args = (LLAMA3_8B, 1024, 8192, LIMIT)
    right = mp_checks.solution_sequence_doubling(*args, global_batch=1024)
    assert right == "cp"
    assert kind(mp_checks.check_sequence_doubling(" CP ", *args, global_batch=1024)) == "correct"
    for wrong in ("tp", "pp", "dp"):
        verdict = mp_checks.check_sequence_doubling(wrong, *args, global_batch=1024)
        assert kind(verdict) == "not yet" and "Hint" in verdict
    assert "answer one of" in mp_checks.check_sequence_doubling("sequence", *args, global_batch=1024)
    assert mp_checks.check_sequence_doubling(..., *args, global_batch=1024) == NOT_ANSWERED


def test_out_of_memory_reason_checker():
    rows8 = planner.plan(LLAMA3_8B, 1024, seq=8192, global_batch=1024)
    oom = next(r for r in rows8 if planner.key(r) == (1, 1, 1, 1024))
    assert oom["total"] > LIMIT and mp_checks.solution_out_of_memory_reason(oom) == "activations"
    assert kind(mp_checks.check_out_of_memory_reason("activations", oom, LIMIT)) == "correct"
    assert "another label holds more" in mp_checks.check_out_of_memory_reason("gradients", oom, LIMIT)
    assert "answer one of" in mp_checks.check_out_of_memory_reason("memory", oom, LIMIT)
    assert mp_checks.check_out_of_memory_reason(..., oom, LIMIT) == NOT_ANSWERED
