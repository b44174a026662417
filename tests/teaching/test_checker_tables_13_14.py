"""Lessons 13 and 14: for every exercise, a table of answers the checker must reject and answers it
must accept (the solution and other correct forms).

Rejected: wrong, partial, malformed, ``None``/``...``, the lesson's own helper, a number an earlier
cell printed, and functions that pass data between virtual ranks through Python objects (a
module-level global, a mutable default, a closure, and through every channel of
:mod:`tests.teaching.shared_object_cheats`: a class's, an imported class's, an imported module's,
``__main__``'s, ``builtins``', a function's and a helper module's attributes) with ``comm.barrier()``
instead of a collective: these would be right on threads of one process and wrong on real processes,
and the verdict says so, naming the object.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import simcomm.lessons.lesson_13 as check13
import simcomm.lessons.lesson_14 as check14
from simcomm.lessons.verdicts import NOT_ANSWERED, RanksApart, shared_state_names
from simcomm.parallel.mesh import Layout
from tests.teaching.shared_object_cheats import CHANNELS, reset


def kind(verdict: str) -> str:
    return "correct" if verdict.startswith("Correct") else "not answered" if verdict == NOT_ANSWERED else \
        "not yet" if verdict.startswith("Not yet: ") else "other"


def judged(checker, answer, *args):
    return checker(answer, *args, show_hint=True)


# -- lesson 13, exercise 1: activation bytes -----------------------------------------------------

RIGHT13 = {"none": 934400, "selective": 279040, "full": 16384}

ACCEPT_13_1 = [
    RIGHT13,
    {"none": 934400.0000001, "selective": 279040.0, "full": 16384.0},        # within the stated precision
    {"none": torch.tensor(934400), "selective": np.int64(279040), "full": torch.tensor([16384.0])},
    {"full": 16384, "none": 8192 * 114 + 512, "selective": 34 * 8192 + 512},   # other order, arithmetic
]

REJECT_13_1 = [
    (None, "give a dict"),
    ({"none": ..., "selective": ..., "full": ...}, NOT_ANSWERED),
    ([934400, 279040, 16384], "give a dict"),
    ({"none": 934400, "selective": 279040}, "no entry for ['full']"),                     # partial
    ({"none": 934400, "selective": None, "full": 16384}, "is not a number"),              # malformed
    ({"none": "934400", "selective": 279040, "full": 16384}, "is not a number"),
    ({"none": 933888, "selective": 279040, "full": 16384}, "mean and rstd"),              # the paper's formula
    ({"none": 934912, "selective": 279552, "full": 16384}, "in fp32, as CUDA keeps them"),
    ({"none": 934400 * 4, "selective": 279040, "full": 16384}, "split over the t = 4"),
    ({"none": 934400.4, "selective": 279040, "full": 16384}, "whole number"),             # not a count
    ({"none": 934400, "selective": 279040, "full": 16896}, "count what backward needs"),  # stats kept in full
    ({"none": 233728, "selective": 69888, "full": 4096}, "not what the layer stores"),    # printed by section 2
    ({"none": True, "selective": 279040, "full": 16384}, "is not a number"),
]


@pytest.mark.parametrize("answer", ACCEPT_13_1, ids=range(len(ACCEPT_13_1)))
def test_lesson13_ex1_accepts(answer):
    assert kind(check13.check_activation_prediction(answer, 256, 1, 128, 8, 4)) == "correct"


@pytest.mark.parametrize("answer, phrase", REJECT_13_1, ids=range(len(REJECT_13_1)))
def test_lesson13_ex1_rejects(answer, phrase):
    verdict = judged(check13.check_activation_prediction, answer, 256, 1, 128, 8, 4)
    assert (verdict == NOT_ANSWERED) if phrase == NOT_ANSWERED else (kind(verdict) == "not yet" and phrase in verdict), verdict


def test_lesson13_ex1_refuses_the_helper_and_other_sizes():
    cell = {"check": check13}
    exec("from simcomm.planning import activations as act\n"
         "prediction = {m: act.expected_bytes(256, 1, 128, 8, 4, m) for m in act.RECOMPUTE}\n"
         "verdict = check.check_activation_prediction(prediction, 256, 1, 128, 8, 4)", cell)
    assert kind(cell["verdict"]) == "not yet" and "activations.expected_bytes is the lesson's own answer" in cell["verdict"]
    assert "the exercise asks about" in check13.check_activation_prediction(
        {"none": 4096, "selective": 4096, "full": 4096}, 16, 1, 16, 1, 4)    # sizes the learner chose


# -- lesson 13, exercise 2: model-state bytes ------------------------------------------------------

def state_bytes(stage, psi, world_size, gradients):                  # the solution
    grad = 2 if gradients == "16-bit" else 4
    return {"parameters": 2 * psi / (world_size if stage >= 3 else 1),
            "gradients": grad * psi / (world_size if stage >= 2 else 1),
            "optimizer_state": 12 * psi / (world_size if stage >= 1 else 1)}


def state_bytes_ints(stage, psi, world_size, gradients):             # integers, a table of divisors
    shard = [world_size if stage >= k else 1 for k in (3, 2, 1)]
    return {"parameters": 2 * psi // shard[0], "gradients": {"16-bit": 2, "fp32 main_grad": 4}[gradients] * psi // shard[1],
            "optimizer_state": 12 * psi // shard[2]}


def state_bytes_tensors(stage, psi, world_size, gradients):          # torch scalars
    return {key: torch.tensor(value) for key, value in state_bytes(stage, psi, world_size, gradients).items()}


def uses_library(stage, psi, world_size, gradients):
    from simcomm.parallel import mixed_precision as mp
    return mp.expected_bytes(stage, psi, world_size, gradients)


def fp32_moments_only(stage, psi, world_size, gradients):           # forgets the master: 8 bytes
    out = state_bytes(stage, psi, world_size, gradients)
    return {**out, "optimizer_state": out["optimizer_state"] * 8 / 12}


def no_stage3(stage, psi, world_size, gradients):                   # partial: stage 3 as stage 2
    return state_bytes(min(stage, 2), psi, world_size, gradients)


ACCEPT_13_2 = [state_bytes, state_bytes_ints, state_bytes_tensors]
REJECT_13_2 = [
    (None, "give a function"), (..., NOT_ANSWERED), (16, "give a function"),
    (uses_library, "mixed_precision.expected_bytes is the lesson's own answer"),
    (fp32_moments_only, "optimizer_state"), (no_stage3, "stage 3"),
    (lambda *a: None, "returned None"), (lambda *a: [1, 2, 3], "exactly the keys"),
    (lambda stage, psi, n, g: state_bytes(stage, psi, n, "16-bit"), "fp32 main_grad"),
]


@pytest.mark.parametrize("fn", ACCEPT_13_2, ids=lambda f: f.__name__)
def test_lesson13_ex2_accepts(fn):
    assert kind(check13.check_model_state_bytes(fn)) == "correct"


@pytest.mark.parametrize("fn, phrase", REJECT_13_2, ids=range(len(REJECT_13_2)))
def test_lesson13_ex2_rejects(fn, phrase):
    verdict = judged(check13.check_model_state_bytes, fn)
    assert (verdict == NOT_ANSWERED) if phrase == NOT_ANSWERED else (kind(verdict) == "not yet" and phrase in verdict), verdict


# -- lesson 13, exercise 3: skip the step together -----------------------------------------------

def overflowed(grads):
    return not all(bool(torch.isfinite(g).all()) for g in grads)


def skip_max(comm, grads):                                            # the solution
    return bool(comm.all_reduce(torch.tensor([float(overflowed(grads))]), "max").item())


def skip_sum_count(comm, grads):                                      # a count of overflowing ranks
    return comm.all_reduce(torch.tensor(int(overflowed(grads)))).item() > 0


def skip_all_gather(comm, grads):                                     # every flag gathered, a bool tensor back
    flags = comm.all_gather(torch.tensor([overflowed(grads)], dtype=torch.float32))
    return torch.cat(list(flags) if isinstance(flags, (list, tuple)) else [flags]).bool().any()


def skip_last_only(comm, grads):                                      # partial: checks the last gradient only
    return bool(comm.all_reduce(torch.tensor([float(not torch.isfinite(grads[-1]).all())]), "max").item())


def skip_inf_only(comm, grads):                                       # NaN overflowed too
    return bool(comm.all_reduce(torch.tensor([float(any(torch.isinf(g).any() for g in grads))]), "max").item())


def skip_sum_in_fp16(comm, grads):                                    # 4 x 60000 overflows the sum, not a gradient
    return bool(comm.all_reduce(torch.tensor([float(not all(torch.isfinite(g.sum()) for g in grads))]), "max").item())


def skip_local(comm, grads):                                          # the lesson's bug
    return overflowed(grads)


FLAGS: dict = {}


def skip_through_a_global_dict(comm, grads):                          # cheating: a module-level dict + barrier
    FLAGS[comm.rank] = overflowed(grads)
    comm.barrier()
    answer = any(FLAGS[r] for r in range(comm.world_size))
    comm.barrier()
    return answer


def skip_through_global_statement(comm, grads):                       # cheating: `global` + barrier
    global ANY_OVERFLOW
    if comm.rank == 0:
        ANY_OVERFLOW = False
    comm.barrier()
    if overflowed(grads):
        ANY_OVERFLOW = True
    comm.barrier()
    return ANY_OVERFLOW


def skip_through_default(comm, grads, box=[]):                        # cheating: a mutable default
    box.append(overflowed(grads))
    comm.barrier()
    answer = any(box[-comm.world_size:])
    comm.barrier()
    return answer


def _closure_cheat():
    seen = set()

    def skip(comm, grads):                                            # cheating: a closure's set
        if overflowed(grads):
            seen.add(comm.rank)
        comm.barrier()
        answer = bool(seen)
        comm.barrier()
        if comm.rank == 0:
            seen.clear()
        comm.barrier()
        return answer
    return skip


ACCEPT_13_3 = [skip_max, skip_sum_count, skip_all_gather]
REJECT_13_3 = [
    (None, "give a function"), (..., NOT_ANSWERED), ("skip", "give a function"),
    (skip_local, "the replicas' weights diverge"),
    (skip_last_only, "grads[0] of rank 1"), (skip_inf_only, "expected True"),
    (skip_sum_in_fp16, "expected False"),
    (lambda comm, grads: 0, "return True (skip) or False"),
    (lambda comm, grads: None, "return True (skip) or False"),
    (lambda comm, grads: comm.all_reduce(torch.ones(1)) if comm.rank == 0 else False, "Not yet"),
    (skip_through_a_global_dict, "through Python objects (FLAGS)"),
    (skip_through_global_statement, "through Python objects (ANY_OVERFLOW)"),
    (skip_through_default, "through Python objects (a mutable default argument)"),
    (_closure_cheat(), "through Python objects (seen)"),
]


@pytest.mark.parametrize("fn", ACCEPT_13_3, ids=lambda f: f.__name__)
def test_lesson13_ex3_accepts(fn):
    assert kind(check13.check_skip_step(fn)) == "correct", check13.check_skip_step(fn)


@pytest.mark.parametrize("fn, phrase", REJECT_13_3, ids=range(len(REJECT_13_3)))
def test_lesson13_ex3_rejects(fn, phrase):
    verdict = judged(check13.check_skip_step, fn)
    assert (verdict == NOT_ANSWERED) if phrase == NOT_ANSWERED else (kind(verdict) == "not yet" and phrase in verdict), verdict


def test_cheating_answers_name_the_mistake_and_the_collective():
    verdict = judged(check13.check_skip_step, skip_through_a_global_dict)
    assert "real processes each have their own copy" in verdict and "comm.barrier() only waits" in verdict


def test_ranks_apart_gives_each_thread_its_own_copy_and_leaves_the_original_alone():
    store = {"n": 0}

    def bump():
        store["n"] += 1
        return store["n"]
    apart = RanksApart(bump)
    assert apart() == 1 and apart() == 2                     # one thread: its state persists, as in a process
    import threading
    got = []
    thread = threading.Thread(target=lambda: got.append(apart()))
    thread.start(), thread.join()
    assert got == [1] and store == {"n": 0}                   # another thread: a fresh copy; the original untouched
    assert shared_state_names(bump) == ["store"]


# -- lesson 14, exercise 1: the global gradient norm ----------------------------------------------

def squares(gs, dtype=torch.float64):
    return sum(g.to(dtype).pow(2).sum() for g in gs)


def norm_solution(comm, sharded, replicated):
    return (comm.all_reduce(squares(sharded)) + squares(replicated)).sqrt()


def norm_float32(comm, sharded, replicated):                          # float32 arithmetic: within 1e-6
    return (comm.all_reduce(squares(sharded, torch.float32)) + squares(replicated, torch.float32)).sqrt()


def norm_gathered_python_float(comm, sharded, replicated):            # all_gather, a Python float
    parts = comm.all_gather(squares(sharded).reshape(1))
    parts = torch.cat(list(parts)) if isinstance(parts, (list, tuple)) else parts
    return float(parts.sum() + squares(replicated)) ** 0.5


def norm_bf16(comm, sharded, replicated):                             # rounding beyond the precision
    return (comm.all_reduce(squares(sharded, torch.bfloat16)) + squares(replicated, torch.bfloat16)).sqrt()


def norm_local(comm, sharded, replicated):                            # the lesson's bug
    return (squares(sharded) + squares(replicated)).sqrt()


def norm_replicated_again(comm, sharded, replicated):
    return comm.all_reduce(squares(sharded) + squares(replicated)).sqrt()


def norm_squared(comm, sharded, replicated):
    return comm.all_reduce(squares(sharded)) + squares(replicated)


def norm_sharded_only(comm, sharded, replicated):                     # partial: forgets the norm weights
    return comm.all_reduce(squares(sharded)).sqrt()


SQUARES: list = []


def norm_through_a_global(comm, sharded, replicated):                 # cheating: a module-level list + barrier
    SQUARES.append(float(squares(sharded)))
    comm.barrier()
    total = sum(SQUARES[-comm.world_size:])
    comm.barrier()
    return (total + float(squares(replicated))) ** 0.5


def norm_from_the_library(comm, sharded, replicated):                 # the lesson's helper, not an answer
    from simcomm.models import llama_training
    grads = dict(enumerate(sharded + replicated))
    alone = comm.subgroup([[rank] for rank in range(comm.world_size)])
    return llama_training.grad_norm_sq(comm, alone, alone, grads, list(range(len(sharded), len(grads)))).sqrt()


ACCEPT_14_1 = [norm_solution, norm_float32, norm_gathered_python_float]
REJECT_14_1 = [
    (None, "give a function"), (..., NOT_ANSWERED), (1.0, "give a function"),
    (norm_local, "the ranks disagree"), (norm_replicated_again, "counted 4 times"),
    (norm_squared, "squared norm"), (norm_sharded_only, "the whole gradient's is"),
    (norm_bf16, "that is rounding"), (lambda c, s, r: torch.ones(2), "one number"),
    (lambda c, s, r: None, "one number"), (lambda c, s, r: 14.476835, "the whole gradient's is"),   # a printed number
    (norm_through_a_global, "through Python objects (SQUARES)"),
    (norm_from_the_library, "llama_training.grad_norm_sq is the lesson's own answer"),
]


@pytest.mark.parametrize("fn", ACCEPT_14_1, ids=lambda f: f.__name__)
def test_lesson14_ex1_accepts(fn):
    assert kind(check14.check_grad_norm(fn)) == "correct", check14.check_grad_norm(fn)


@pytest.mark.parametrize("fn, phrase", REJECT_14_1, ids=range(len(REJECT_14_1)))
def test_lesson14_ex1_rejects(fn, phrase):
    verdict = judged(check14.check_grad_norm, fn)
    assert (verdict == NOT_ANSWERED) if phrase == NOT_ANSWERED else (kind(verdict) == "not yet" and phrase in verdict), verdict


# -- lesson 14, exercise 2: bytes held on rank 0 ---------------------------------------------------

DP, FSDP = 136_704, 68_352
ELEMENTS = 5_696                                                    # stage 0, tensor rank 0
NORMS_SPLIT = 24 * (ELEMENTS - 32)                                  # the two norms halved by tp

ACCEPT_14_2 = [
    {"dp": DP, "fsdp": FSDP},
    {"dp": 24.0 * ELEMENTS, "fsdp": torch.tensor(12 * ELEMENTS)},
    {"fsdp": np.int64(FSDP), "dp": 3 * 8 * ELEMENTS},
]
REJECT_14_2 = [
    (None, "give a dict"), ({"dp": ..., "fsdp": ...}, NOT_ANSWERED), ([DP, FSDP], "give a dict"),
    ({"dp": DP}, "give a dict"), ({"dp": "lots", "fsdp": FSDP}, "not a number"),
    ({"dp": DP // 3, "fsdp": FSDP // 3}, "parameters only"),
    ({"dp": ELEMENTS, "fsdp": ELEMENTS // 2}, "number of elements"),
    ({"dp": DP, "fsdp": DP}, "what plain data parallelism keeps"),
    ({"dp": NORMS_SPLIT, "fsdp": NORMS_SPLIT // 2}, "splits the RMSNorm weights over tp"),   # the misleading case
    ({"dp": DP * 2, "fsdp": FSDP * 2}, "scales with cp"),
    ({"dp": DP + 0.5, "fsdp": FSDP}, "whole number"),
    ({"dp": DP + 8, "fsdp": FSDP}, "is not what rank 0 keeps"),
]


@pytest.mark.parametrize("answer", ACCEPT_14_2, ids=range(len(ACCEPT_14_2)))
def test_lesson14_ex2_accepts(answer):
    assert kind(check14.check_held_bytes(answer)) == "correct"


@pytest.mark.parametrize("answer, phrase", REJECT_14_2, ids=range(len(REJECT_14_2)))
def test_lesson14_ex2_rejects(answer, phrase):
    verdict = judged(check14.check_held_bytes, answer)
    assert (verdict == NOT_ANSWERED) if phrase == NOT_ANSWERED else (kind(verdict) == "not yet" and phrase in verdict), verdict


def test_lesson14_ex2_refuses_the_helper_and_another_layout():
    cell = {"check": check14}
    exec("from simcomm.models import llama, llama_training as lt\nfrom simcomm.parallel.mesh import Layout\n"
         "plain = Layout(pp=2, dp_replicate=2, cp=2, tp=2)\n"
         "prediction = {'dp': 24 * lt.held_numel(llama.Config(), plain, 0), "
         "'fsdp': 24 * lt.held_numel(llama.Config(), check.HELD_LAYOUT, 0)}\n"
         "verdict = check.check_held_bytes(prediction)", cell)
    assert "held_numel is the lesson's own answer" in cell["verdict"]
    easier = Layout(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1)
    assert "the exercise asks about rank 0" in check14.check_held_bytes({"dp": DP, "fsdp": FSDP}, None, easier)


# -- lessons 13 (exercise 3) and 14 (exercise 1): data kept on objects no per-rank copy separates --------

def skip_cheat(put, take):
    def skip(comm, grads):
        put(comm.rank, overflowed(grads))
        comm.barrier()
        answer = any(take(rank) for rank in range(comm.world_size))
        comm.barrier()
        return answer
    return skip


def norm_cheat(put, take):
    def norm(comm, sharded, replicated):
        put(comm.rank, float(squares(sharded)))
        comm.barrier()
        total = sum(take(rank) for rank in range(comm.world_size))
        comm.barrier()
        return (total + float(squares(replicated))) ** 0.5
    return norm


SHARED_OBJECT_CHEATS = [(check, make, channel) for check, make in [
    (check13.check_skip_step, skip_cheat), (check14.check_grad_norm, norm_cheat)] for channel in CHANNELS]


@pytest.mark.parametrize("check, make, channel", SHARED_OBJECT_CHEATS,
                         ids=[f"{check.__name__}-{channel}" for check, _, channel in SHARED_OBJECT_CHEATS])
def test_data_kept_on_shared_objects_is_refused_naming_the_object(check, make, channel):
    put, take, label = CHANNELS[channel]
    reset()
    try:
        verdict = judged(check, make(put, take))
    finally:
        reset()
    assert kind(verdict) == "not yet" and label in verdict, verdict
    assert "real processes each have their own copy" in verdict and "comm.barrier() only waits" in verdict, verdict
