"""Checkers of lessons 06-08: right answers pass; wrong, partial and malformed ones get a hint, never a
traceback. Plus the numbers lesson 07 shows: ZeRO memory and communication volume against the formulas."""
from fractions import Fraction

import numpy as np
import pytest
import torch

import simcomm
from simcomm import ReduceOp
from simcomm.lessons import training as tl
from simcomm.parallel import data as dp
from simcomm.parallel import pipeline as pp
from simcomm.parallel import zero


def _verdicts_ok(verdict: str, correct: bool) -> None:
    assert isinstance(verdict, str)
    assert "Traceback" not in verdict
    if correct:
        assert tl.is_correct(verdict), verdict
    else:
        assert verdict.startswith("Not yet:") and not tl.is_correct(verdict), verdict


# -- lesson 06 --------------------------------------------------------------------------------

def _avg_step(comm, model, xs, ys):
    (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()
    for p in model.parameters():
        p.grad = comm.all_reduce(p.grad, ReduceOp.AVG)


def _scaled_step(comm, model, xs, ys):
    (dp.sum_loss(model, xs, ys) / (xs.shape[0] * comm.world_size)).backward()
    for p in model.parameters():
        p.grad = comm.all_reduce(p.grad)


def _forgets_to_average(comm, model, xs, ys):
    (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()
    for p in model.parameters():
        p.grad = comm.all_reduce(p.grad)


def _weights_only(comm, model, xs, ys):
    (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()
    for p in list(model.parameters())[::2]:
        p.grad = comm.all_reduce(p.grad, ReduceOp.AVG)


def _no_communication(comm, model, xs, ys):
    (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()


def _placeholder(*args):
    raise NotImplementedError


def _float32_cast(comm, model, xs, ys):
    (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()
    for p in model.parameters():
        p.grad = comm.all_reduce(p.grad.float(), ReduceOp.AVG).double()


def _max_all_reduce(comm, model, xs, ys):
    (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()
    for p in model.parameters():
        p.grad = comm.all_reduce(p.grad, ReduceOp.MAX)


def _rank0_only(comm, model, xs, ys):
    (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()
    if comm.rank == 0:
        for p in model.parameters():
            p.grad = comm.all_reduce(p.grad, ReduceOp.AVG)


def _average_twice(comm, model, xs, ys):
    (dp.sum_loss(model, xs, ys) / (xs.shape[0] * comm.world_size)).backward()
    for p in model.parameters():
        p.grad = comm.all_reduce(p.grad, ReduceOp.AVG)


@pytest.mark.parametrize("step, correct, fragment", [
    (_avg_step, True, "whole batch"),
    (_scaled_step, True, "whole batch"),
    (_forgets_to_average, False, "4 x the reference"),
    (_average_twice, False, "1/4 x the reference"),
    (_weights_only, False, "parameters [1, 3, 5]"),
    (_no_communication, False, "different gradients"),
    (_float32_cast, False, "lower precision"),
    (_max_all_reduce, False, "combined their gradients"),
    (_rank0_only, False, "rank 0 waits in all_reduce"),
    (lambda comm: None, False, "raised TypeError"),
    (42, False, "must be a function"),
])
def test_check_dp_step(step, correct, fragment):
    verdict = tl.check_dp_step(step, show_hint=True)
    _verdicts_ok(verdict, correct)
    assert fragment in verdict


def test_the_untouched_buggy_step_gets_the_problem_first_and_the_fix_on_request():
    first = tl.check_dp_step(_forgets_to_average)
    assert "4 x the reference" in first and "Hint" not in first and "AVG" not in first, first
    assert "show_hint=True" in first
    second = tl.check_dp_step(_forgets_to_average, show_hint=True)
    assert "Hint:" in second and "AVG" in second


def _accumulate_right(comm, model, reducer, micro_batches, batch):
    with reducer.no_sync():
        for xm, ym in micro_batches[:-1]:
            (dp.sum_loss(model, xm, ym) / batch).backward()
    (dp.sum_loss(model, *micro_batches[-1]) / batch).backward()
    reducer.finish()


def _accumulate_without_no_sync(comm, model, reducer, micro_batches, batch):
    for xm, ym in micro_batches:
        (dp.sum_loss(model, xm, ym) / batch).backward()
    reducer.finish()


def _accumulate_everything_in_no_sync(comm, model, reducer, micro_batches, batch):
    with reducer.no_sync():
        for xm, ym in micro_batches:
            (dp.sum_loss(model, xm, ym) / batch).backward()
    reducer.finish()


def _accumulate_mean_per_microbatch(comm, model, reducer, micro_batches, batch):
    with reducer.no_sync():
        for xm, ym in micro_batches[:-1]:
            (dp.sum_loss(model, xm, ym) / xm.shape[0]).backward()
    (dp.sum_loss(model, *micro_batches[-1]) / micro_batches[-1][0].shape[0]).backward()
    reducer.finish()


def _accumulate_then_all_reduce_by_hand(comm, model, reducer, micro_batches, batch):
    with reducer.no_sync():
        for xm, ym in micro_batches:
            (dp.sum_loss(model, xm, ym) / batch).backward()
    for p in model.parameters():
        p.grad = comm.all_reduce(p.grad)


def _sync_every_microbatch(comm, model, reducer, micro_batches, batch):
    for xm, ym in micro_batches:
        (dp.sum_loss(model, xm, ym) / batch).backward()
        reducer.finish()


@pytest.mark.parametrize("step, correct, fragment", [
    (_accumulate_right, True, "3 all-reduces per step"),
    (_accumulate_without_no_sync, False, "second backward synchronised"),
    (_accumulate_everything_in_no_sync, False, "different gradients"),
    (_accumulate_mean_per_microbatch, False, "16 x the reference"),
    (_accumulate_then_all_reduce_by_hand, False, "issued 6 collectives"),
    (_sync_every_microbatch, False, "issued 12 collectives"),
    (lambda comm, model: None, False, "raised TypeError"),
    ("step", False, "must be a function"),
])
def test_check_accumulation_step(step, correct, fragment):
    verdict = tl.check_accumulation_step(step, show_hint=True)
    _verdicts_ok(verdict, correct)
    assert fragment in verdict, verdict


def test_placeholders_say_not_answered():
    for checker in (tl.check_dp_step, tl.check_accumulation_step, tl.check_zero2_grads, tl.check_1f1b):
        assert checker(...) == tl.NOT_ANSWERED
        assert checker(_placeholder) == tl.NOT_ANSWERED
    for checker in (tl.check_zero3_bytes, tl.check_bubble):
        assert checker(...) == tl.NOT_ANSWERED


# -- lesson 07 --------------------------------------------------------------------------------

PSI, N, K = tl.ZERO3_EXERCISE["psi"], tl.ZERO3_EXERCISE["world_size"], tl.ZERO3_EXERCISE["K"]
RIGHT = {"parameters": 2 * PSI / N, "gradients": 2 * PSI / N, "optimizer_state": K * PSI / N}


@pytest.mark.parametrize("answer, correct, fragment", [
    (RIGHT, True, "GB per rank"),
    ({**RIGHT, "parameters": 2 * PSI}, False, "unsharded"),
    ({**RIGHT, "gradients": 4 * PSI / N}, False, "4 bytes per value"),
    ({"parameters": RIGHT["parameters"]}, False, "missing"),
    ({**RIGHT, "optimizer_state": "lots"}, False, "numbers of bytes"),
    (16 * PSI / N, False, "must be a dict"),
    ({**RIGHT, "optimizer_state": 1.0}, False, "off"),
    ({k: np.float64(v) for k, v in RIGHT.items()}, True, "GB per rank"),        # numbers of any numeric type
    ({k: torch.tensor(v, dtype=torch.float64) for k, v in RIGHT.items()}, True, "GB per rank"),
    ({k: np.int64(round(v)) for k, v in RIGHT.items()}, True, "GB per rank"),
    ({**RIGHT, "parameters": torch.ones(2)}, False, "numbers of bytes"),
])
def test_check_zero3_bytes(answer, correct, fragment):
    verdict = tl.check_zero3_bytes(answer, show_hint=True)
    _verdicts_ok(verdict, correct)
    assert fragment in verdict


def _rs(comm, grad):
    return comm.reduce_scatter(grad, dim=0)


def _ar_then_slice(comm, grad):
    return comm.all_reduce(grad).chunk(comm.world_size)[comm.rank]


def _local_chunk(comm, grad):
    return grad.chunk(comm.world_size)[comm.rank]


def _reduce_then_scatter(comm, grad):
    total = comm.reduce(grad, dst=0)
    return comm.scatter(total if comm.rank == 0 else None, src=0, dim=0)


def _dist_reduce_then_scatter(comm, grad):
    import torch.distributed as dist

    total = grad.clone()
    dist.reduce(total, dst=0)
    shard = torch.empty(grad.numel() // comm.world_size, dtype=grad.dtype)
    dist.scatter(shard, list(total.chunk(comm.world_size)) if comm.rank == 0 else None, src=0)
    return shard


def _whole(comm, grad):
    return comm.all_reduce(grad)


@pytest.mark.parametrize("fn, correct, fragment", [
    (_rs, True, "reduce-scatter"),
    (_ar_then_slice, False, "ranks [0-3] each sent 576 B and received 576 B"),
    # every rank counted: rank 0 sends only 288 B (the budget) but receives three whole tensors,
    # and ranks 1-3 each send a whole tensor (384 B)
    (_reduce_then_scatter, False, "rank 0 received 1152 B; ranks [1-3] each sent 384 B"),
    (_dist_reduce_then_scatter, False, "rank 0 received 1152 B; ranks [1-3] each sent 384 B"),
    (_local_chunk, False, "not summed"),
    (_whole, False, "shapes"),
    (lambda comm, grad: "shard", False, "not a tensor"),
    ("reduce_scatter", False, "must be a function"),
])
def test_check_zero2_grads(fn, correct, fragment):
    verdict = tl.check_zero2_grads(fn, show_hint=True)
    _verdicts_ok(verdict, correct)
    assert fragment in verdict


def test_lessons_02_and_07_judge_traffic_by_one_rule():
    """The same all-reduce-then-chunk pattern is rejected in both lessons, with the same hint."""
    from simcomm.lessons import foundations
    from simcomm.lessons.verdicts import TRAFFIC_RULE

    in_07 = tl.check_zero2_grads(_ar_then_slice, show_hint=True)
    in_02 = foundations.check_all_gather_backward(
        lambda comm, grad, dim: comm.all_reduce(grad).chunk(comm.world_size, dim=dim)[comm.rank], show_hint=True)
    for verdict in (in_07, in_02):
        assert verdict.startswith("Not yet: right values, but more bytes than necessary"), verdict
        assert verdict.endswith(f"Hint: {TRAFFIC_RULE}"), verdict


MLP = zero.MLP((16, 64, 64, 8))   # every layer divides by 4: no padding


@pytest.mark.parametrize("stage", zero.STAGES)
def test_communication_volume_per_stage(stage):
    """Bytes rank 0 sends in one step, in units of (n-1)/n psi fp32: 2 for DP, ZeRO-1, ZeRO-2; 3 for ZeRO-3."""
    world = simcomm.World(4)
    world.run(zero.train, stage, MLP, steps=1, batch_size=8)
    sent = sum(sum(e.sent.values()) for e in world.trace.events if e.rank == 0)
    assert sent / (3 / 4 * MLP.numel * 4) == pytest.approx(3.0 if stage == 3 else 2.0)


# -- lesson 08 --------------------------------------------------------------------------------

@pytest.mark.parametrize("answer, correct, fragment", [
    (7 / 39, True, "7/39"),
    ("7/39", False, "not a number"),
    (7 / 32, False, "(p-1)/m"),
    (7 / 8, False, "naive"),
    (100 * 7 / 39, False, "percentage"),
    (0.5, False, "not it"),
    (None, False, "not a number"),
    (np.float64(7 / 39), True, "7/39"),
    (torch.tensor(7 / 39), True, "7/39"),
    (Fraction(7, 39), True, "7/39"),
    (torch.tensor([7 / 39, 0.1]), False, "not a number"),
])
def test_check_bubble(answer, correct, fragment):
    verdict = tl.check_bubble(answer, show_hint=True)
    _verdicts_ok(verdict, correct)
    assert fragment in verdict


#: the library's schedules for every size the checkers try, computed at import: the checkers refuse a
#: function that calls ``pp.schedule`` (the lesson's own answer), so the tests' answers look them up
PLANS = {(name, stages, microbatches): pp.schedule(name, stages, microbatches)
         for name in ("naive", "gpipe", "1f1b", "zb-h1")
         for stages, microbatches in ((4, 8), (4, 4), (3, 7), (4, 2), (1, 3), (2, 5))}


def _named(name):
    return lambda stage, stages, microbatches: PLANS[name, stages, microbatches][stage]


@pytest.mark.parametrize("fn, correct, fragment", [
    (_named("1f1b"), True, "as fast as GPipe"),
    (_named("gpipe"), False, "holds 8 microbatches"),
    (_named("naive"), False, "time units"),
    (lambda s, p, m: [("B", i) for i in range(m)] + [("F", i) for i in range(m)], False, "before"),
    (lambda s, p, m: [("F", i) for i in range(m)], False, "exactly once"),
    (lambda s, p, m: "F0 B0", False, "is a pair"),
    (lambda s, p, m: ["F0", "B0"], False, "'F0' is not ('F', i)"),                      # format errors get the
    (lambda s, p, m: [("f", i) for i in range(m)], False, "('f', 0) is not ('F', i)"),    # format, not the algorithm
    (lambda s, p, m: [("F", i) for i in range(m + 1)], False, "from 0 to"),
    (lambda s, p: [], False, "raised TypeError"),
])
def test_check_1f1b(fn, correct, fragment):
    verdict = tl.check_1f1b(fn, show_hint=True)
    _verdicts_ok(verdict, correct)
    assert fragment in verdict


def test_the_library_schedule_is_not_an_answer():
    verdict = tl.check_1f1b(lambda s, p, m: pp.schedule("1f1b", p, m)[s])
    assert verdict.startswith("Not yet") and "pipeline.schedule is the lesson's own answer" in verdict
    assert "pipeline.schedule is the lesson's own answer" in tl.check_zero_bubble(
        lambda s, p, m: pp.schedule("zb-h1", p, m)[s])


def test_a_format_error_gets_the_format_not_the_algorithm():
    verdict = tl.check_1f1b(lambda s, p, m: ["F0"], show_hint=True)
    assert "('F', 3)" in verdict and "warm up" not in verdict, verdict


def _zb_solution(stage, stages, microbatches):
    return PLANS["zb-h1", stages, microbatches][stage]


def _unsplit_1f1b(stage, stages, microbatches):
    return PLANS["1f1b", stages, microbatches][stage]


def _w_right_after_b(stage, stages, microbatches):           # valid, but the drain stays idle
    plan = []
    for kind, i in PLANS["1f1b", stages, microbatches][stage]:
        plan += [("F", i)] if kind == "F" else [("B", i), ("W", i)]
    return plan


def _all_w_at_the_end(stage, stages, microbatches):           # fast, but holds every micro-batch
    plan = [a for a in PLANS["1f1b", stages, microbatches][stage]]
    return plan + [("W", i) for i in range(microbatches)]


def _w_before_b(stage, stages, microbatches):
    return [("W", i) if kind == "B" else (kind, i) for kind, i in _zb_solution(stage, stages, microbatches)
            if kind != "W"] + [("B", i) for i in range(microbatches)]


@pytest.mark.parametrize("answer, problem", [
    (_unsplit_1f1b, "never runs a W"),
    (_w_right_after_b, "ZB-H1 takes"),
    (_all_w_at_the_end, "1F1B's peak"),
    (_w_before_b, "before B"),
    (lambda s, p, m: "F0 B0 W0", "is not ('F', i) or ('B', i) or ('W', i)"),
    (lambda s, p, m: [("f", 0)], "is not ('F', i)"),
    (lambda s, p, m: None, "raised TypeError"),
    (42, "must be a function"),
])
def test_check_zero_bubble_rejects_wrong_partial_and_malformed_answers_with_a_hint(answer, problem):
    verdict = tl.check_zero_bubble(answer)
    assert verdict.startswith("Not yet") and problem in verdict, verdict
    if "Hint" in tl.check_zero_bubble(answer, show_hint=True):
        assert "Hint" not in verdict


def test_check_zero_bubble_accepts_zb_h1_and_numpy_microbatch_numbers():
    import numpy as np

    assert tl.check_zero_bubble(_zb_solution).startswith("Correct")
    assert tl.check_zero_bubble(lambda s, p, m: [(k, np.int64(i)) for k, i in _zb_solution(s, p, m)]).startswith(
        "Correct")

    def placeholder(stage, stages, microbatches):
        raise NotImplementedError
    assert tl.check_zero_bubble(placeholder) == tl.NOT_ANSWERED
    assert tl.check_zero_bubble(...) == tl.NOT_ANSWERED


def test_check_1f1b_takes_numpy_microbatch_numbers_and_names_the_format_of_a_malformed_action():
    import numpy as np

    right = lambda s, p, m: [(k, np.int64(i)) for k, i in PLANS["1f1b", p, m][s]]   # noqa: E731
    assert tl.check_1f1b(right).startswith("Correct")
    for malformed in (lambda s, p, m: ["F0"], lambda s, p, m: [("f", 0)]):
        verdict = tl.check_1f1b(malformed, show_hint=True)
        assert "is not ('F', i) or ('B', i)" in verdict and "an action is a pair" in verdict
        assert "warm up" not in verdict                    # the format, not the algorithm
