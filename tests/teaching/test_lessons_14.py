"""Lesson 14's checkers: right answers pass; wrong, partial and malformed ones get "Not yet" and a hint."""
from __future__ import annotations

import torch

import simcomm.lessons.lesson_14 as checks
from simcomm.lessons.verdicts import HINT_OFFER, NOT_ANSWERED
from simcomm.models import llama
from simcomm.models import llama_pipeline as lp
from simcomm.models import llama_training as lt
from simcomm.parallel.mesh import Layout

CONFIG = llama.Config()
LAYOUT = Layout(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2)


def _squares(grads):
    return sum(g.double().pow(2).sum() for g in grads)


def right_norm(comm, sharded, replicated):
    return (comm.all_reduce(_squares(sharded)) + _squares(replicated)).sqrt()


def local_norm(comm, sharded, replicated):                   # the bug of the lesson
    return (_squares(sharded) + _squares(replicated)).sqrt()


def replicated_counted_again(comm, sharded, replicated):
    return comm.all_reduce(_squares(sharded) + _squares(replicated)).sqrt()


def squared(comm, sharded, replicated):
    return comm.all_reduce(_squares(sharded)) + _squares(replicated)


def test_grad_norm_accepts_the_global_norm():
    assert checks.check_grad_norm(right_norm).startswith("Correct")
    assert checks.check_grad_norm(lambda c, s, r: float(right_norm(c, s, r))).startswith("Correct")


def test_grad_norm_rejects_the_local_norm_and_names_the_different_clip_factors():
    verdict = checks.check_grad_norm(local_norm)
    assert verdict.startswith("Not yet: the ranks disagree") and "clip by" in verdict and verdict.endswith(HINT_OFFER)
    assert "all_reduce" in checks.check_grad_norm(local_norm, show_hint=True)


def test_grad_norm_rejects_partial_and_malformed_answers():
    assert "counted 4 times" in checks.check_grad_norm(replicated_counted_again)
    assert "squared norm" in checks.check_grad_norm(squared)
    assert "one number" in checks.check_grad_norm(lambda c, s, r: torch.ones(2))
    assert checks.check_grad_norm(lambda c, s, r: 1.0).startswith("Not yet: the norm is 1.000000")
    assert "raised ZeroDivisionError" in checks.check_grad_norm(lambda c, s, r: 1 / 0)
    assert "give a function" in checks.check_grad_norm(3)

    def deadlocks(comm, sharded, replicated):
        return comm.all_reduce(_squares(sharded)) if comm.rank else _squares(sharded)
    assert checks.check_grad_norm(deadlocks).startswith("Not yet: the ranks")


def test_grad_norm_placeholder_is_not_answered():
    def placeholder(comm, sharded, replicated):
        raise NotImplementedError
    assert checks.check_grad_norm(placeholder) == NOT_ANSWERED
    assert checks.check_grad_norm(...) == NOT_ANSWERED


#: the library's bytes, computed at import: the checker refuses an answer whose cell calls the helper
LIBRARY_BYTES = (24 * lt.held_numel(CONFIG, Layout(pp=2, dp_replicate=2, dp_shard=1, cp=2, tp=2), 0),
                 24 * lt.held_numel(CONFIG, LAYOUT, 0))


def test_held_bytes_accepts_the_measured_bytes():
    dp, fsdp = LIBRARY_BYTES
    assert (dp, fsdp) == (136_704, 68_352)      # stage 0, tensor rank 0: 5,696 elements, half under FSDP
    assert checks.check_held_bytes({"dp": dp, "fsdp": fsdp}, CONFIG, LAYOUT).startswith("Correct")
    assert checks.check_held_bytes({"dp": float(dp), "fsdp": torch.tensor(fsdp)}, CONFIG, LAYOUT).startswith("Correct")
    for same_sizes in (Layout(pp=2, dp=2, cp=2, tp=2), Layout(pp=2, dp_replicate=2, cp=2, tp=2)):
        assert checks.check_held_bytes({"dp": dp, "fsdp": fsdp}, CONFIG, same_sizes).startswith("Correct")


def test_held_bytes_rejects_wrong_partial_and_malformed_answers():
    dp, fsdp = 136_704, 68_352

    def verdict(answer):
        return checks.check_held_bytes(answer, CONFIG, LAYOUT, show_hint=True)
    assert "parameters only" in verdict({"dp": dp // 3, "fsdp": fsdp // 3})
    assert "what plain data parallelism keeps" in verdict({"dp": dp, "fsdp": dp})
    whole = 24 * sum(p.numel() for p in llama.init_params(CONFIG).values())
    assert "whole model" in verdict({"dp": whole, "fsdp": fsdp})
    params = llama.init_params(CONFIG)
    stage_whole = 24 * sum(params[name].numel() for name in lp.stage_names(CONFIG, 0, 2))   # no tensor split
    assert "stage's matrices whole" in verdict({"dp": stage_whole, "fsdp": fsdp})
    assert "stage's matrices whole" in verdict({"dp": dp, "fsdp": stage_whole // 2})
    assert "is not what rank 0 keeps" in verdict({"dp": dp + 8, "fsdp": fsdp})
    assert "not a number" in verdict({"dp": "lots", "fsdp": fsdp})
    assert "give a dict" in verdict({"dp": dp})
    assert "give a dict" in verdict([dp, fsdp])
    assert checks.check_held_bytes({"dp": ..., "fsdp": ...}, CONFIG, LAYOUT) == NOT_ANSWERED
    assert checks.check_held_bytes({"dp": dp // 3, "fsdp": fsdp}, CONFIG, LAYOUT).endswith(HINT_OFFER)
