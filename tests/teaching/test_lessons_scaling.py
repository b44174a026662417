"""The checkers of lessons 09-12: a right answer is Correct; wrong, partial and malformed answers
get 'Not yet:' with a hint; the placeholder gets NOT_ANSWERED; nothing raises."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from simcomm.lessons import scaling as sl
from simcomm.parallel.expert import switch_aux_loss
from simcomm.parallel.mesh import Layout
from simcomm.models.transformer import make_block


def not_implemented(*args):
    raise NotImplementedError


def crashes(*args):
    raise KeyError("oops")


def verdict_kind(verdict: str) -> str:
    if verdict == sl.NOT_ANSWERED:
        return "unanswered"
    assert verdict.startswith(("Correct", "Not yet: ")), verdict
    return "correct" if sl.is_correct(verdict) else "not yet"


# -- 09 -----------------------------------------------------------------------------------------

def merge_right(o1, l1, o2, l2):
    lse = torch.logaddexp(l1, l2)
    return o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None], lse


@pytest.mark.parametrize("answer, kind, hint", [
    (merge_right, "correct", ""),
    (..., "unanswered", ""),
    (not_implemented, "unanswered", ""),
    (crashes, "not yet", "KeyError"),
    (lambda o1, l1, o2, l2: (o1 + o2) / 2, "not yet", "return a pair"),                       # malformed
    (lambda o1, l1, o2, l2: ((o1 + o2) / 2, torch.logaddexp(l1, l2)), "not yet", "lse is right"),  # partial
    (lambda o1, l1, o2, l2: (merge_right(o1, l1, o2, l2)[0], torch.maximum(l1, l2)), "not yet", "output is right"),
    (lambda o1, l1, o2, l2: (o1, l1), "not yet", "both differ"),
    (lambda o1, l1, o2, l2: (merge_right(o1, l1, o2, l2)[0], (l1.exp() + l2.exp()).log() + 0 * l1.exp().isinf()),
     "not yet", "overflows float32"),                                    # right for small logits only
    (lambda o1, l1, o2, l2: (lambda lse: (o1 * (l1.exp() / lse.exp())[..., None] + o2 * (l2.exp() / lse.exp())[..., None],
                                          lse))(torch.log(torch.exp(l1) + torch.exp(l2))), "not yet", "overflows"),
])
def test_check_lse_merge(answer, kind, hint):
    verdict = sl.check_lse_merge(answer, show_hint=True)
    assert verdict_kind(verdict) == kind and hint in verdict, verdict


def test_check_lse_merge_empty_block_rule():
    def no_logaddexp(o1, l1, o2, l2):          # right on finite blocks, nan on the empty start block
        lse = l1 + torch.log1p((l2 - l1).exp())
        out = o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None]
        return out, lse
    assert sl.check_lse_merge(no_logaddexp).startswith("Not yet: merging with an empty block")


@pytest.mark.parametrize("answer, kind, hint", [
    (lambda r, p: [r, 2 * p - 1 - r], "correct", ""),
    (lambda r, p: [p - 1 - r, p + r], "correct", ""),                      # balanced too: judged by the work
    (lambda r, p: torch.tensor([r, 2 * p - 1 - r]), "correct", ""),
    (lambda r, p: [2 * r, 2 * r + 1], "not yet", "head"),                 # contiguous pairs: unbalanced
    (lambda r, p: [r, r + p], "not yet", "head"),                          # every chunk held, still unbalanced
    (lambda r, p: [r, r], "not yet", "exactly one rank"),                  # partial: chunks missing
    (lambda r, p: r, "not yet", "list of two"),                            # malformed
    (..., "unanswered", ""),
])
def test_check_zigzag_chunks(answer, kind, hint):
    verdict = sl.check_zigzag_chunks(answer, show_hint=True)
    assert verdict_kind(verdict) == kind and hint in verdict, verdict


# -- 10 -----------------------------------------------------------------------------------------

def splits_right(experts, num_experts, world_size):
    return torch.bincount(experts.flatten() // (num_experts // world_size), minlength=world_size).tolist()


@pytest.mark.parametrize("answer, kind, hint", [
    (splits_right, "correct", ""),
    (lambda e, n, p: torch.bincount(e.flatten(), minlength=n).tolist(), "not yet", "one entry per expert"),  # partial
    (lambda e, n, p: torch.bincount(e[:, 0] // (n // p), minlength=p).tolist(), "not yet", "add up to"),    # top-1 only
    (lambda e, n, p: torch.bincount(e.flatten() % p, minlength=p).tolist(), "not yet", "rank r holds"),     # round robin
    (lambda e, n, p: "4, 4", "not yet", "list of"),                                                          # malformed
    (lambda e, n, p: torch.bincount(e.flatten() // (n // p), minlength=p), "correct", ""),                 # a tensor is fine
    (lambda e, n, p: [np.int64(v) for v in splits_right(e, n, p)], "correct", ""),                           # numpy ints
    (lambda e, n, p: np.array(splits_right(e, n, p)), "correct", ""),
    (not_implemented, "unanswered", ""),
])
def test_check_split_sizes(answer, kind, hint):
    verdict = sl.check_split_sizes(answer, show_hint=True)
    assert verdict_kind(verdict) == kind and hint in verdict, verdict


@pytest.mark.parametrize("answer, kind, hint", [
    (lambda e, n, c: int((torch.bincount(e.flatten(), minlength=n) - c).clamp(min=0).sum()), "correct", ""),
    (lambda e, n, c: int((torch.bincount(e.flatten(), minlength=n) - c).sum()), "not yet", "max(0"),      # partial
    (lambda e, n, c: [0], "not yet", "a whole number"),                                                     # malformed
    (lambda e, n, c: "2", "not yet", "a whole number"),
    (lambda e, n, c: np.int64((torch.bincount(e.flatten(), minlength=n) - c).clamp(min=0).sum()), "correct", ""),
    (lambda e, n, c: (torch.bincount(e.flatten(), minlength=n) - c).clamp(min=0).sum(), "correct", ""),  # 0-d
    (..., "unanswered", ""),
])
def test_check_dropped(answer, kind, hint):
    verdict = sl.check_dropped(answer, show_hint=True)
    assert verdict_kind(verdict) == kind and hint in verdict, verdict


# -- 11 -----------------------------------------------------------------------------------------

def exchange_right(comm, x):
    left, right = (comm.rank - 1) % comm.world_size, (comm.rank + 1) % comm.world_size
    if comm.rank % 2 == 0:
        comm.send(x, right)
        from_left = comm.recv(x.shape, x.dtype, left)
        comm.send(x, left)
        from_right = comm.recv(x.shape, x.dtype, right)
    else:
        from_left = comm.recv(x.shape, x.dtype, left)
        comm.send(x, right)
        from_right = comm.recv(x.shape, x.dtype, right)
        comm.send(x, left)
    return from_left, from_right


def exchange_deadlocks(comm, x):
    left, right = (comm.rank - 1) % comm.world_size, (comm.rank + 1) % comm.world_size
    comm.send(x, right)
    return comm.recv(x.shape, x.dtype, left), x


def exchange_blocking_swapped(comm, x):
    from_left, from_right = exchange_right(comm, x)
    return from_right, from_left


def exchange_forever(comm, x):
    while True:
        comm.barrier()


def exchange_non_blocking(comm, x):
    handles = comm.batch_isend_irecv([
        __import__("simcomm").P2POp("isend", x, (comm.rank + 1) % comm.world_size),
        __import__("simcomm").P2POp("isend", x, (comm.rank - 1) % comm.world_size),
        __import__("simcomm").P2POp("irecv", (x.shape, x.dtype), (comm.rank - 1) % comm.world_size),
        __import__("simcomm").P2POp("irecv", (x.shape, x.dtype), (comm.rank + 1) % comm.world_size)])
    for h in handles:
        h.wait()
    return handles[3].wait(), handles[2].wait()              # wrong order: right first


@pytest.mark.parametrize("answer, kind, hint", [
    (exchange_right, "correct", ""),
    (exchange_deadlocks, "not yet", "deadlocks"),
    (exchange_non_blocking, "not yet", "blocking send and recv only"),
    (exchange_blocking_swapped, "not yet", "expected rank"),
    (lambda comm, x: tuple(comm.all_gather(x[None], dim=0)[[(comm.rank - 1) % comm.world_size,
                                                            (comm.rank + 1) % comm.world_size]]),
     "not yet", "['all_gather']"),
    (exchange_forever, "not yet", "still running after"),
    (lambda comm, x: x, "not yet", "return a pair"),
    (not_implemented, "unanswered", ""),
    (crashes, "not yet", "KeyError"),
])
def test_check_neighbour_exchange(answer, kind, hint):
    verdict = sl.check_neighbour_exchange(answer, show_hint=True)
    assert verdict_kind(verdict) == kind and hint in verdict, verdict


def layernorm_step(all_reduce: bool, factor: float = 1.0):
    def step(comm, x, weight, bias, probe):
        (F.layer_norm(x, (6,), weight, bias) * probe).sum().backward()
        grads = weight.grad * factor, bias.grad
        return tuple(comm.all_reduce(g) for g in grads) if all_reduce else grads
    return step


@pytest.mark.parametrize("answer, kind, hint", [
    (layernorm_step(True), "correct", ""),
    (layernorm_step(False), "not yet", "all-reduce it"),          # the bug of the lesson
    (layernorm_step(True, 4.0), "not yet", "4 times too large"),
    (lambda comm, x, w, b, p: tuple(comm.all_reduce(g, __import__("simcomm").ReduceOp.AVG) for g in (   # lesson 06's AVG
        (F.layer_norm(x, (6,), w, b) * p).sum().backward() or (w.grad, b.grad))), "not yet", "1/4 of the single"),
    (lambda comm, x, w, b, p: (lambda g: (comm.all_reduce(g[0]), g[1]))(                  # partial: bias not summed
        (F.layer_norm(x, (6,), w, b) * p).sum().backward() or (w.grad, b.grad)), "not yet", "bias gradient is only"),
    (lambda comm, x, w, b, p: w, "not yet", "return (weight_grad, bias_grad)"),
    (not_implemented, "unanswered", ""),
])
def test_check_sp_layernorm(answer, kind, hint):
    verdict = sl.check_sp_layernorm(answer, show_hint=True)
    assert verdict_kind(verdict) == kind and hint in verdict, verdict


# -- 12 -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("answer, kind, hint", [
    (lambda r, *, pp, dp, tp: (r // (tp * dp), (r // tp) % dp, r % tp), "correct", ""),
    (lambda r, *, pp, dp, tp: (r // (tp * dp), r % dp, r // dp % tp), "not yet", "neighbours"),   # dp innermost
    (lambda r, *, pp, dp, tp: (r % pp, (r // pp) % dp, r // (pp * dp)), "not yet", "neighbours"),  # pp innermost
    (lambda r, *, pp, dp, tp: (r // (tp * dp), r % tp), "not yet", "return (stage, d, t)"),
    (lambda r, tp, dp, pp: (r // (tp * dp), (r // tp) % dp, r % tp), "correct", ""),  # any order, by name
    (..., "unanswered", ""),
])
def test_check_mesh_coords(answer, kind, hint):
    verdict = sl.check_mesh_coords(answer, show_hint=True)
    assert verdict_kind(verdict) == kind and hint in verdict, verdict


def _row(tp, dp, pp, peak, cluster):
    return {"tp": tp, "dp": dp, "pp": pp, "peak_bytes": peak, "NVLink node": cluster / 3, "InfiniBand cluster": cluster}


#: a table of the exercise's shape: seven layouts of 8 ranks, five of them within 700 bytes
ROWS = [_row(1, 8, 1, 900, 1e-5), _row(2, 4, 1, 500, 3e-5), _row(1, 4, 2, 600, 2e-5), _row(8, 1, 1, 300, 9e-5),
        _row(4, 2, 1, 400, 5e-5), _row(2, 2, 2, 450, 4e-5), _row(1, 2, 4, 800, 1.5e-5)]


@pytest.mark.parametrize("answer, kind, hint", [
    (Layout(tp=1, dp=4, pp=2), "correct", ""),
    (Layout(pp=2, dp=4), "correct", ""),                     # tp=1 left out: the same mesh of ranks
    (Layout(tp=1, dp=8, pp=1), "not yet", "more than the limit"),
    (Layout(tp=2, dp=4, pp=1), "not yet", "another layout that fits is faster"),
    (Layout(tp=8, dp=8, pp=8), "not yet", "not a layout of the table"),
    ((1, 4, 2), "not yet", "by name, as Layout(pp=..., dp=..., tp=...)"),   # a tuple's order is ambiguous
    ("1, 4, 2", "not yet", "by name"),
    (..., "unanswered", ""),
])
def test_check_layout_choice(answer, kind, hint):
    verdict = sl.check_layout_choice(answer, ROWS, 700, "InfiniBand cluster", show_hint=True)
    assert verdict_kind(verdict) == kind and hint in verdict, verdict


@pytest.mark.parametrize("rows, limit, topology, problem", [
    (ROWS[2:3], 700, "InfiniBand cluster", "7 layouts"),                 # only the learner's row
    (ROWS[:6] + [ROWS[2]], 700, "InfiniBand cluster", "different layouts"),
    ([{**row, "peak_bytes": 1} for row in ROWS], 700, "InfiniBand cluster", "7 layouts fit"),   # edited
    (ROWS, 10 ** 9, "InfiniBand cluster", "7 layouts fit"),              # a limit everything fits
    (ROWS, 700, "NVLink node", "asks about the InfiniBand cluster"),
])
def test_check_layout_choice_does_not_trust_the_table_it_is_given(rows, limit, topology, problem):
    verdict = sl.check_layout_choice(Layout(tp=1, dp=4, pp=2), rows, limit, topology)
    assert verdict_kind(verdict) == "not yet" and problem in verdict, verdict


def test_layout_table_rows_are_checked_and_fastest_fitting():
    from simcomm.planning.layout_choice import TOPOLOGIES, layout_table
    from simcomm.planning.planner import fastest_fitting
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(4, 8, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    rows = layout_table(x, w, make_block(8, 16), 4)
    assert {(r["tp"], r["dp"], r["pp"]) for r in rows} == {(1, 8, 1), (2, 4, 1), (4, 2, 1), (1, 4, 2), (2, 2, 2),
                                                          (4, 1, 2)} - {(1, 8, 1)}   # batch 4: dp <= 4
    assert all(r["layout"] == Layout(pp=r["pp"], dp=r["dp"], tp=r["tp"]) for r in rows)
    assert all(r["max_error"] < 1e-10 and r["peak_bytes"] > 0 and all(r[t] > 0 for t in TOPOLOGIES) for r in rows)
    least = min(r["peak_bytes"] for r in rows)
    best = fastest_fitting(rows, least, "NVLink node")
    assert [r for r in rows if r["layout"] == best][0]["peak_bytes"] == least
    assert fastest_fitting(rows, least - 1, "NVLink node") is None


# -- simcomm.lessons.debugging ----------------------------------------------------------------------------

def test_assert_replicated_names_the_ranks_that_differ_and_passes_replicas():
    import simcomm
    from simcomm.lessons.debugging import assert_replicated, error_summary

    def program(comm, skew):
        w = torch.ones(3) + (skew if comm.rank == 2 else 0.0)
        assert_replicated(comm, w, "w")
        return True

    assert simcomm.World(3).run(program, 0.0) == [True] * 3
    with pytest.raises(simcomm.RankError) as info:
        simcomm.World(3).run(program, 0.5)
    assert "w is not replicated: it differs from rank 0's on rank 2 by 0.5" in str(info.value.__cause__)

    def mismatch(comm):
        return comm.all_gather(torch.ones(2 + (comm.rank == 1)), dim=0)

    with pytest.raises(simcomm.CollectiveMismatchError) as info:
        simcomm.World(2).run(mismatch)
    summary = error_summary(info.value)
    assert summary.startswith("CollectiveMismatchError: ") and "/" not in summary and " of mismatch" in summary


def test_the_first_answer_names_the_problem_and_the_fix_comes_on_request():
    """Lesson 11's untouched buggy exercises: what is wrong first, the fix only when asked for."""
    first = sl.check_neighbour_exchange(exchange_deadlocks)
    assert "deadlocks" in first and "even ranks" not in first and "show_hint=True" in first, first
    assert "even ranks" in sl.check_neighbour_exchange(exchange_deadlocks, show_hint=True)
    first = sl.check_sp_layernorm(layernorm_step(False))
    assert "only its own shard" in first and "all-reduce" not in first, first
    assert "all-reduce it" in sl.check_sp_layernorm(layernorm_step(False), show_hint=True)


def _aux_right(probs, experts):
    num_experts = probs.shape[1]
    share = torch.bincount(experts.flatten(), minlength=num_experts).double() / experts.numel()
    return num_experts * (share * probs.mean(0)).sum()


@pytest.mark.parametrize("answer, problem", [
    (lambda p, e: _aux_right(p, e) / p.shape[1], "divided by E"),
    (lambda p, e: _aux_right(p, e) * e.shape[1], "times the formula"),
    (lambda p, e: _aux_right(p, e).item(), "plain number"),
    (lambda p, e: _aux_right(p.detach(), e), "no gradient reaches probs"),
    (lambda p, e: p.shape[1] * (p.mean(0) * p.mean(0)).sum(), "is not E * sum_e f_e * P_e"),   # soft f
    (lambda p, e: p.shape[1] * (torch.bincount(e.flatten(), minlength=p.shape[1]).double() / e.numel() * p.mean(0)),
     "shape"),
    # the right value, but the gradient also flows through a differentiable stand-in for f_e
    (lambda p, e: _aux_right(p, e) + (p.mean(0) - p.mean(0).detach()).pow(2).sum() * 0
     + (p - p.detach()).sum() * 1.0, "gradient with respect to probs"),
    (lambda p, e: "1.0", "return a 0-d tensor"),
    (lambda p, e: 1 / 0, "ZeroDivisionError"),
    (3, "must be a function"),
    (switch_aux_loss, "lesson's own answer"),                  # the library's copy, whole or wrapped
    (lambda p, e: switch_aux_loss(p, e) * 1.0, "lesson's own answer"),
])
def test_check_aux_loss_rejects_wrong_partial_and_malformed_answers_with_a_hint(answer, problem):
    verdict = sl.check_aux_loss(answer)
    assert verdict.startswith("Not yet") and problem in verdict, verdict


def test_check_aux_loss_accepts_the_formula_and_not_answered_placeholders():
    assert sl.check_aux_loss(_aux_right).startswith("Correct")

    def placeholder(probs, experts):
        raise NotImplementedError
    assert sl.check_aux_loss(placeholder) == sl.NOT_ANSWERED
    assert sl.check_aux_loss(...) == sl.NOT_ANSWERED
    assert "Hint" in sl.check_aux_loss(lambda p, e: _aux_right(p, e) / p.shape[1], show_hint=True)
