"""Lessons 00-12: answers every checker must reject and answers it must accept.

Each lesson's own solution is accepted by the nbval run of the lesson (its collapsed solution runs
as code there and must print ``Correct``). Here: every checker answers ``...`` with
``NOT_ANSWERED`` and rejects ``None``, a string and a number of the wrong kind with a ``Not yet``
verdict (never a traceback); the distributed exercises reject the same right computation done
through Python objects plus ``comm.barrier()`` instead of a collective, naming that mistake: a
module-level object, and (:mod:`tests.teaching.shared_object_cheats`) a class's, an imported
class's, an imported module's, ``__main__``'s, ``builtins``', a function's and a helper module's
attributes; and accept right answers in other forms; the value exercises (00's deadlocks, 01's
shapes and predictions, 07's ZeRO-3 bytes, 08's bubble, 12's layout) accept the solution and other
correct forms (other numeric types and containers, other capitals, a number within the stated
precision) and refuse wrong, partial and malformed ones; so do the functions whose result is a value
(05, 09, 10, 12); the schedule exercises refuse the library's ``pp.schedule`` as an answer.
"""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from torch.distributed import ReduceOp

import simcomm.lessons.lesson_00 as check00
import simcomm.lessons.lesson_02 as check02
import simcomm.lessons.lesson_03 as check03
import simcomm.lessons.lesson_06 as check06
import simcomm.lessons.lesson_07 as check07
import simcomm.lessons.lesson_08 as check08
import simcomm.lessons.lesson_11 as check11
from simcomm.lessons import (lesson_00, lesson_01, lesson_02, lesson_03, lesson_04, lesson_05, lesson_06,
                             lesson_07, lesson_08, lesson_09, lesson_10, lesson_11, lesson_12)
from simcomm.lessons.verdicts import NOT_ANSWERED
from simcomm.parallel import data as dp
from simcomm.parallel.mesh import Layout
from tests.teaching.shared_object_cheats import CHANNELS, reset

MODULES = [lesson_00, lesson_01, lesson_02, lesson_03, lesson_04, lesson_05, lesson_06, lesson_07, lesson_08,
           lesson_09, lesson_10, lesson_11, lesson_12]
#: the checkers whose answer is the first argument alone (the others take the lesson's data too)
ONE_ARGUMENT = [(module.__name__.rsplit("_", 1)[1], name) for module in MODULES for name in module.__all__
                if name.startswith("check_") and name not in ("check_prediction", "check_shapes",
                                                                  "check_deadlocks", "check_layout_choice")]


def kind(verdict: str) -> str:
    return "correct" if verdict.startswith("Correct") else "not answered" if verdict == NOT_ANSWERED else \
        "not yet" if verdict.startswith("Not yet: ") else "other"


def checker(lesson: str, name: str):
    return getattr(next(m for m in MODULES if m.__name__.endswith(lesson)), name)


@pytest.mark.parametrize("lesson, name", ONE_ARGUMENT, ids=[f"{lesson}-{name}" for lesson, name in ONE_ARGUMENT])
def test_every_checker_answers_the_placeholder_and_rejects_malformed_answers(lesson, name):
    check = checker(lesson, name)
    assert check(...) == NOT_ANSWERED
    for malformed in (None, "the answer", 3 + 4j, [None]):
        verdict = check(malformed, show_hint=True)
        assert kind(verdict) == "not yet" and "Traceback" not in verdict, (malformed, verdict)


# -- distributed answers: the right computation through Python objects is refused ----------------------

SEEN: list = []


def count_through_a_list(comm):                        # lesson 00: an all-reduce that carries nothing
    comm.all_reduce(torch.zeros(1))
    SEEN.append(comm.rank)
    comm.barrier()
    n = len(SEEN)
    comm.barrier()
    if comm.rank == 0:
        SEEN.clear()
    comm.barrier()
    return n


GRADS: dict = {}


def shard_through_a_dict(comm, grad):                  # lesson 07: the sum read from the other ranks' objects
    GRADS[comm.rank] = grad.clone()
    comm.barrier()
    total = sum(GRADS[r] for r in range(comm.world_size))
    comm.barrier()
    return total.chunk(comm.world_size)[comm.rank].clone()


def backward_through_a_dict(comm, grad_out, dim):     # lesson 02
    GRADS[comm.rank] = grad_out.detach().clone()
    comm.barrier()
    total = sum(GRADS[r] for r in range(comm.world_size))
    comm.barrier()
    return total.chunk(comm.world_size, dim)[comm.rank].clone()


def dp_step_through_a_dict(comm, model, xs, ys):     # lesson 06: gradients averaged through a dict
    (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()
    GRADS[comm.rank] = [p.grad.clone() for p in model.parameters()]
    comm.barrier()
    for i, p in enumerate(model.parameters()):
        p.grad = sum(GRADS[r][i] for r in range(comm.world_size)) / comm.world_size
    comm.barrier()


CHEATS = [
    (check00.check_count_ranks, count_through_a_list),
    (check07.check_zero2_grads, shard_through_a_dict),
    (check02.check_all_gather_backward, backward_through_a_dict),
    (check06.check_dp_step, dp_step_through_a_dict),
]


@pytest.mark.parametrize("check, cheat", CHEATS, ids=[c.__name__ for _, c in CHEATS])
def test_data_passed_through_python_objects_is_refused(check, cheat):
    verdict = check(cheat, show_hint=True)
    assert kind(verdict) == "not yet", verdict
    assert "through Python objects" in verdict or "collective" in verdict, verdict


@pytest.mark.parametrize("check, cheat", CHEATS[:3], ids=[c.__name__ for _, c in CHEATS[:3]])
def test_the_verdict_names_the_object_when_only_the_objects_made_it_pass(check, cheat):
    verdict = check(cheat, show_hint=True)
    assert "through Python objects" in verdict and "comm.barrier() only waits" in verdict, verdict


# -- right answers in other forms are accepted -------------------------------------------------------

ACCEPTED = [
    (check00.check_count_ranks, lambda comm: comm.all_reduce(torch.ones(1)).item()),                 # float
    (check00.check_count_ranks, lambda comm: int(comm.all_reduce(torch.tensor([1])))),               # int
    (check00.check_count_ranks, lambda comm: comm.all_reduce(torch.ones(())) ),                      # 0-d tensor
    (check02.check_all_gather_backward, lambda comm, g, dim: comm.reduce_scatter(g, dim=dim)),
    (check02.check_all_gather_backward,
     lambda comm, g, dim: comm.reduce_scatter(g.contiguous(), dim=dim).clone()),
    (check07.check_zero2_grads, lambda comm, grad: comm.reduce_scatter(grad, dim=0)),
    (check07.check_zero2_grads, lambda comm, grad: comm.reduce_scatter(grad.clone(), dim=0).clone()),
    (check06.check_dp_step, lambda comm, model, xs, ys: [
        setattr(p, "grad", comm.all_reduce(p.grad, ReduceOp.AVG))
        for p in ((dp.sum_loss(model, xs, ys) / xs.shape[0]).backward(), model.parameters())[1]]),
    (check06.check_dp_step, lambda comm, model, xs, ys: [
        setattr(p, "grad", comm.all_reduce(p.grad))
        for p in ((dp.sum_loss(model, xs, ys) / xs.shape[0] / comm.world_size).backward(), model.parameters())[1]]),
]


@pytest.mark.parametrize("index", range(len(ACCEPTED)))
def test_right_answers_in_other_forms_are_accepted(index):
    check, answer = ACCEPTED[index]
    verdict = check(answer)
    assert kind(verdict) == "correct", verdict


def ring_all_gather(comm, x):                          # lesson 03, with the lesson's exchange
    n, rank = comm.world_size, comm.rank
    shards = [None] * n
    shards[rank] = x.clone()
    for step in range(n - 1):
        shards[(rank - 1 - step) % n] = check03.ring_exchange(comm, shards[(rank - step) % n])
    return torch.cat(shards)


def test_lesson03_accepts_the_ring_and_refuses_the_builtin_and_python_objects():
    assert kind(check03.check_ring_all_gather(ring_all_gather)) == "correct"
    assert kind(check03.check_ring_all_gather(lambda comm, x: comm.all_gather(x, dim=0))) == "not yet"
    shards: dict = {}

    def through_a_dict(comm, x):
        shards[comm.rank] = x.clone()
        comm.barrier()
        out = torch.cat([shards[r] for r in range(comm.world_size)])
        comm.barrier()
        return out
    assert kind(check03.check_ring_all_gather(through_a_dict)) == "not yet"


def test_lesson11_refuses_an_exchange_through_python_objects():
    box: dict = {}

    def through_a_dict(comm, x):
        box[comm.rank] = x.clone()
        comm.barrier()
        n = comm.world_size
        out = (box[(comm.rank - 1) % n], box[(comm.rank + 1) % n])
        comm.barrier()
        return out
    assert kind(check11.check_neighbour_exchange(through_a_dict)) == "not yet"


def test_lesson08_refuses_the_library_schedule():
    from simcomm.parallel import pipeline as pp
    verdict = check08.check_1f1b(lambda s, p, m: pp.schedule("1f1b", p, m)[s])
    assert "pipeline.schedule is the lesson's own answer" in verdict


def test_lesson10_refuses_the_library_rows_per_rank_and_accepts_the_counts_written_out():
    from simcomm.parallel import expert as ep

    def with_the_helper(experts, num_experts, world_size):
        return ep.rows_per_rank(torch.bincount(experts.flatten(), minlength=num_experts), world_size)

    def written_out(experts, num_experts, world_size):
        per_expert = torch.bincount(experts.flatten(), minlength=num_experts)
        return per_expert.view(world_size, -1).sum(1).tolist()
    assert "expert.rows_per_rank is the lesson's own answer" in lesson_10.check_split_sizes(with_the_helper)
    assert kind(lesson_10.check_split_sizes(written_out)) == "correct"


def test_lesson10_refuses_the_library_keep_mask_as_the_dropped_count():
    from simcomm.parallel import expert as ep

    def with_the_helper(experts, num_experts, capacity):
        return int((~ep.keep_mask(experts, num_experts, capacity)).sum())

    def written_out(experts, num_experts, capacity):
        return sum(max(0, int((experts == e).sum()) - capacity) for e in range(num_experts))
    assert "expert.keep_mask is the lesson's own answer" in lesson_10.check_dropped(with_the_helper)
    assert kind(lesson_10.check_dropped(written_out)) == "correct"


def test_lesson09_refuses_the_library_merge_and_chunks_the_lesson_imports():
    from simcomm.parallel import context

    def merged_by_the_library(out1, lse1, out2, lse2):
        return context.lse_merge(out1, lse1, out2, lse2)

    def chunks_of_the_library(rank, world_size):
        return context.chunk_ids(rank, world_size, "zigzag")
    for merge in (context.lse_merge, merged_by_the_library):
        assert "context.lse_merge is the lesson's own answer" in lesson_09.check_lse_merge(merge)
    assert "context.chunk_ids is the lesson's own answer" in lesson_09.check_zigzag_chunks(chunks_of_the_library)

    def merged_written_out(out1, lse1, out2, lse2):
        lse = torch.logaddexp(lse1, lse2)
        return out1 * (lse1 - lse).exp()[..., None] + out2 * (lse2 - lse).exp()[..., None], lse
    assert kind(lesson_09.check_lse_merge(merged_written_out)) == "correct"
    assert kind(lesson_09.check_zigzag_chunks(lambda rank, p: (2 * p - 1 - rank, rank))) == "correct"


def test_lesson12_refuses_the_coordinates_of_the_library_layout():
    from simcomm.parallel.mesh import Layout
    verdict = lesson_12.check_mesh_coords(lambda rank, *, pp, dp, tp: Layout(pp=pp, dp=dp, tp=tp).coordinates(rank))
    assert kind(verdict) == "not yet" and "Layout computes the coordinates" in verdict
    assert kind(lesson_12.check_mesh_coords(lambda rank, *, pp, dp, tp: (rank // (dp * tp), rank // tp % dp,
                                                                         rank % tp))) == "correct"


# -- data passed through objects no per-rank copy separates: class, module and function attributes,
# -- builtins, sys.modules["__main__"], a helper module (tests/teaching/shared_object_cheats.py) --------

def _gather_through(put, take, comm, value):
    put(comm.rank, value)
    comm.barrier()
    values = [take(rank) for rank in range(comm.world_size)]
    comm.barrier()
    return values


def count_cheat(put, take):                              # lesson 00
    def count_ranks(comm):
        comm.all_reduce(torch.zeros(1))
        put(comm.rank, 1)
        comm.barrier()
        seen = 0
        while True:
            try:
                take(seen)
            except (KeyError, AttributeError, NameError):
                break
            seen += 1
        comm.barrier()
        return seen
    return count_ranks


def backward_cheat(put, take):                           # lesson 02
    def backward(comm, grad_out, dim):
        total = sum(_gather_through(put, take, comm, grad_out.detach().clone()))
        return total.chunk(comm.world_size, dim)[comm.rank].clone()
    return backward


def ring_cheat(put, take):                               # lesson 03
    def all_gather(comm, x):
        return torch.cat(_gather_through(put, take, comm, x.clone()))
    return all_gather


def dp_step_cheat(put, take):                            # lesson 06
    def step(comm, model, xs, ys):
        (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()
        grads = _gather_through(put, take, comm, [p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = sum(g[i] for g in grads) / comm.world_size
    return step


def zero2_cheat(put, take):                              # lesson 07
    def shard(comm, grad):
        return sum(_gather_through(put, take, comm, grad.clone())).chunk(comm.world_size)[comm.rank].clone()
    return shard


def exchange_cheat(put, take):                           # lesson 11
    def exchange(comm, x):
        values, n = _gather_through(put, take, comm, x.clone()), comm.world_size
        return values[(comm.rank - 1) % n], values[(comm.rank + 1) % n]
    return exchange


SHARED_OBJECT_CHEATS = [(check, make, channel) for check, make in [
    (check00.check_count_ranks, count_cheat), (check02.check_all_gather_backward, backward_cheat),
    (check03.check_ring_all_gather, ring_cheat), (check06.check_dp_step, dp_step_cheat),
    (check07.check_zero2_grads, zero2_cheat), (check11.check_neighbour_exchange, exchange_cheat)]
    for channel in CHANNELS]


@pytest.mark.parametrize("check, make, channel", SHARED_OBJECT_CHEATS,
                         ids=[f"{check.__name__}-{channel}" for check, _, channel in SHARED_OBJECT_CHEATS])
def test_data_kept_on_shared_objects_is_refused_naming_the_object(check, make, channel):
    put, take, label = CHANNELS[channel]
    reset()
    try:
        verdict = check(make(put, take), show_hint=True)
    finally:
        reset()
    assert kind(verdict) == "not yet" and label in verdict, verdict
    assert "real processes each have their own copy" in verdict and "comm.barrier() only waits" in verdict, verdict


# -- value exercises: the solution and other correct forms accepted, wrong ones refused --------------

def program_a(comm):                                     # lesson 00's three programs: only B deadlocks
    x = torch.ones(2)
    if comm.rank % 2 == 0:
        comm.send(x)
        return comm.recv((2,))
    y = comm.recv((2,))
    comm.send(x)
    return y


def program_b(comm):
    total = comm.all_reduce(torch.ones(1))
    if comm.rank == 0:
        comm.barrier()
    return total


def program_c(comm):
    if comm.rank == 0:
        comm.send(torch.ones(2), dst=1)
    if comm.rank == 1:
        return comm.recv((2,), src=0)
    return None


PROGRAMS = {"A": program_a, "B": program_b, "C": program_c}
ACCEPT_00_2 = [{"B"}, ["B"], "B", ("b",), {" b "}, frozenset({"B"}), np.array(["B"]),
               {"A": False, "B": True, "C": False}]
REJECT_00_2 = [({"A"}, "classified wrongly"), ({"A", "B"}, "classified wrongly"), (set(), "classified wrongly"),
               ({"D"}, "not one of the programs"), (None, "write a set"), (3, "write a set"),
               ({"A": "no", "B": "yes"}, "write a set"), ([None], "not one of the programs")]

CALLS = {"all_reduce": {}, "all_gather": {"dim": 0}, "reduce_scatter": {"dim": 1},
         "all_to_all": {"scatter_dim": 1, "gather_dim": 0}, "gather": {"dst": 3, "dim": 1}}
SHAPES = {"all_reduce": (4, 8), "all_gather": (16, 8), "reduce_scatter": (4, 2), "all_to_all": (16, 2), "gather": None}


def _shapes(make, keys=str):
    return {keys(op): None if shape is None else make(shape) for op, shape in SHAPES.items()}


ACCEPT_01_1 = [SHAPES, _shapes(list), _shapes(torch.Size), _shapes(lambda s: tuple(np.int64(n) for n in s)),
               _shapes(lambda s: tuple(torch.tensor(n) for n in s)), _shapes(np.array), _shapes(tuple, str.upper),
               _shapes(tuple, lambda op: op.replace("_", " "))]
REJECT_01_1 = [({**SHAPES, "all_gather": (4, 8)}, "1 of 5 shapes are wrong"),
               ({**SHAPES, "gather": (4, 32)}, "['gather']"),
               ({op: s for op, s in SHAPES.items() if op != "gather"}, "still missing: ['gather']"),
               (_shapes(lambda s: tuple(float(n) for n in s)), "a tuple of ints"),
               ({**SHAPES, "all_reduce": (True, 8)}, "a tuple of ints"),
               ({**SHAPES, "all_reduce": "(4, 8)"}, "a tuple of ints"),
               ({**SHAPES, "broadcast": (4, 8)}, "not one of the calls"),
               ([(4, 8)] * 5, "write a dict")]

MAX3 = ("reduce_scatter", {"dim": 0, "op": ReduceOp.MAX}, 3)
MIN1 = ("all_reduce", {"op": ReduceOp.MIN}, 1)
ACCEPT_01_2 = [(MAX3, [33]), (MAX3, 33), (MAX3, (33,)), (MAX3, torch.tensor([33.0])), (MAX3, np.array([33])),
               (MAX3, np.int64(33)), (MAX3, [33.0000000001]), (MAX3, torch.tensor(33)),
               (MIN1, [0, 1, 2, 3]), (MIN1, (0, 1, 2, 3)), (MIN1, torch.arange(4)), (MIN1, np.arange(4.0)),
               (MIN1, [np.int64(i) for i in range(4)]), (MIN1, [[0, 1], [2, 3]])]     # the numbers, in any shape
REJECT_01_2 = [(MAX3, [30], "is not [30]"), (MAX3, [33, 33], "holds 1 number"), (MAX3, "33", "not a number"),
               (MAX3, None, "not a number"), (MIN1, [0, 1, 2], "holds 4 number(s); you gave 3"),
               (MIN1, [30, 31, 32, 33], "is not")]

ZERO3 = {"parameters": 2 * 7.5e9 / 64, "gradients": 2 * 7.5e9 / 64, "optimizer_state": 12 * 7.5e9 / 64}
ACCEPT_07_1 = [ZERO3, {k: int(v) for k, v in ZERO3.items()}, {k: np.float64(v) for k, v in ZERO3.items()},
               {k: torch.tensor(v) for k, v in ZERO3.items()}, {k: np.int64(v) for k, v in ZERO3.items()},
               {"parameters": 2.34e8, "gradients": 2.34e8, "optimizer_state": 1.41e9},      # three figures
               {"Parameters": 234375000, "Gradients": 234375000, "Optimizer state": 1406250000}]
REJECT_07_1 = [({k: v * 64 for k, v in ZERO3.items()}, "unsharded size"),
               ({**ZERO3, "parameters": 2 * ZERO3["parameters"]}, "counts 4 bytes per value"),
               ({k: v for k, v in ZERO3.items() if k != "gradients"}, "missing ['gradients']"),
               ({**ZERO3, "gradients": "234375000"}, "must be numbers"), ({**ZERO3, "gradients": None}, "must be numbers"),
               (list(ZERO3.values()), "must be a dict"),
               ({"parameters": 2.3e8, "gradients": 2.3e8, "optimizer_state": 1.4e9}, "are off"),   # two figures
               ({**ZERO3, "optimizer_state": 16 * 7.5e9 / 64}, "are off")]

ACCEPT_08_1 = [7 / 39, Fraction(7, 39), np.float64(7 / 39), np.float32(7 / 39), torch.tensor(7 / 39),
               torch.tensor([7 / 39]), 0.1795]
REJECT_08_1 = [(7 / 32, "(p-1)/m"), (7 / 8, "naive schedule"), (17.95, "not a percentage"), (True, "not True/False"),
               ("seven", "is not a number"), ("7/39", "is not a number"), (0.2, "is not it"), (torch.tensor([0.1, 0.2]), "is not a number")]


def _table_row(tp, dp, pp, peak, cluster):
    return {"tp": tp, "dp": dp, "pp": pp, "peak_bytes": peak, "NVLink node": cluster / 3, "InfiniBand cluster": cluster,
            "layout": Layout(pp=pp, dp=dp, tp=tp)}


#: a table of lesson 12's shape: seven layouts of 8 ranks, five of them within 700 bytes
LAYOUT_ROWS = [_table_row(1, 8, 1, 900, 1e-5), _table_row(2, 4, 1, 500, 3e-5), _table_row(1, 4, 2, 600, 2e-5),
               _table_row(8, 1, 1, 300, 9e-5), _table_row(4, 2, 1, 400, 5e-5), _table_row(2, 2, 2, 450, 4e-5),
               _table_row(1, 2, 4, 800, 1.5e-5)]
ACCEPT_12_2 = [Layout(pp=2, dp=4, tp=1), Layout(tp=1, dp=4, pp=2), Layout(pp=2, dp=4), LAYOUT_ROWS[2],
               LAYOUT_ROWS[2]["layout"], Layout(pp=2, dp_replicate=4, tp=1), Layout(pp=2, dp=4, cp=1, tp=1)]
REJECT_12_2 = [((1, 4, 2), "by name"), ("Layout(pp=2, dp=4, tp=1)", "by name"), (None, "by name"),
               (Layout(pp=1, dp=8, tp=1), "more than the limit"), (Layout(pp=1, dp=4, tp=2), "another layout"),
               (Layout(pp=8, dp=1, tp=1), "not a layout of the table"), (Layout(pp=2, dp=2, cp=2), "by name"),
               ({"pp": 2, "dp": 4, "tp": 1}, "by name")]


@pytest.mark.parametrize("answer", ACCEPT_00_2, ids=range(len(ACCEPT_00_2)))
def test_lesson00_deadlocks_accepts(answer):
    assert kind(check00.check_deadlocks(answer, PROGRAMS)) == "correct", answer


@pytest.mark.parametrize("answer, phrase", REJECT_00_2, ids=range(len(REJECT_00_2)))
def test_lesson00_deadlocks_rejects(answer, phrase):
    verdict = check00.check_deadlocks(answer, PROGRAMS, show_hint=True)
    assert kind(verdict) == "not yet" and phrase in verdict, verdict


@pytest.mark.parametrize("answer", ACCEPT_01_1, ids=range(len(ACCEPT_01_1)))
def test_lesson01_shapes_accepts(answer):
    verdict = lesson_01.check_shapes(answer, world_size=4, shape=(4, 8), args=CALLS)
    assert kind(verdict) == "correct", verdict


@pytest.mark.parametrize("answer, phrase", REJECT_01_1, ids=range(len(REJECT_01_1)))
def test_lesson01_shapes_rejects(answer, phrase):
    verdict = lesson_01.check_shapes(answer, world_size=4, shape=(4, 8), args=CALLS, show_hint=True)
    assert kind(verdict) == "not yet" and phrase in verdict, verdict


@pytest.mark.parametrize("case, answer", ACCEPT_01_2, ids=range(len(ACCEPT_01_2)))
def test_lesson01_predictions_accept(case, answer):
    op, kwargs, rank = case
    verdict = lesson_01.check_prediction(answer, op, kwargs, rank=rank, what="the result")
    assert kind(verdict) == "correct", verdict


@pytest.mark.parametrize("case, answer, phrase", REJECT_01_2, ids=range(len(REJECT_01_2)))
def test_lesson01_predictions_reject(case, answer, phrase):
    op, kwargs, rank = case
    verdict = lesson_01.check_prediction(answer, op, kwargs, rank=rank, what="the result", hint="a hint",
                                         show_hint=True)
    assert kind(verdict) == "not yet" and phrase in verdict, verdict


@pytest.mark.parametrize("answer", ACCEPT_07_1, ids=range(len(ACCEPT_07_1)))
def test_lesson07_zero3_bytes_accepts(answer):
    assert kind(check07.check_zero3_bytes(answer)) == "correct", answer


@pytest.mark.parametrize("answer, phrase", REJECT_07_1, ids=range(len(REJECT_07_1)))
def test_lesson07_zero3_bytes_rejects(answer, phrase):
    verdict = check07.check_zero3_bytes(answer, show_hint=True)
    assert kind(verdict) == "not yet" and phrase in verdict, verdict


@pytest.mark.parametrize("answer", ACCEPT_08_1, ids=range(len(ACCEPT_08_1)))
def test_lesson08_bubble_accepts(answer):
    assert kind(check08.check_bubble(answer)) == "correct", answer


@pytest.mark.parametrize("answer, phrase", REJECT_08_1, ids=range(len(REJECT_08_1)))
def test_lesson08_bubble_rejects(answer, phrase):
    verdict = check08.check_bubble(answer, show_hint=True)
    assert kind(verdict) == "not yet" and phrase in verdict, verdict


@pytest.mark.parametrize("answer", ACCEPT_12_2, ids=range(len(ACCEPT_12_2)))
def test_lesson12_layout_choice_accepts(answer):
    verdict = lesson_12.check_layout_choice(answer, LAYOUT_ROWS, 700, "InfiniBand cluster")
    assert kind(verdict) == "correct", verdict


@pytest.mark.parametrize("answer, phrase", REJECT_12_2, ids=range(len(REJECT_12_2)))
def test_lesson12_layout_choice_rejects(answer, phrase):
    verdict = lesson_12.check_layout_choice(answer, LAYOUT_ROWS, 700, "InfiniBand cluster", show_hint=True)
    assert kind(verdict) == "not yet" and phrase in verdict, verdict


# -- functions whose result is a value: the result in other correct forms ----------------------------

def gqa_bytes(batch, seq, q_heads, kv_heads, head_dim, world_size, itemsize):          # lesson 05
    return batch * (seq // world_size) * head_dim * itemsize * (2 * q_heads + 2 * kv_heads) * (world_size - 1) \
        // world_size


def split_sizes(experts, num_experts, world_size):                                      # lesson 10
    return torch.bincount(experts.flatten(), minlength=num_experts).view(world_size, -1).sum(1)


def dropped(experts, num_experts, capacity):                                            # lesson 10
    return sum(max(0, int((experts == e).sum()) - capacity) for e in range(num_experts))


def coords(rank, *, pp, dp, tp):                                                         # lesson 12
    return rank // (dp * tp), rank // tp % dp, rank % tp


RESULT_FORMS = [
    (lesson_05.check_ulysses_gqa_bytes, [gqa_bytes, lambda *a: float(gqa_bytes(*a)), lambda *a: np.int64(gqa_bytes(*a)),
                                         lambda *a: torch.tensor(gqa_bytes(*a))]),
    (lesson_09.check_zigzag_chunks, [lambda r, p: [r, 2 * p - 1 - r], lambda r, p: (2 * p - 1 - r, r),
                                     lambda r, p: np.array([r, 2 * p - 1 - r]), lambda r, p: {r, 2 * p - 1 - r},
                                     lambda r, p: torch.tensor([r, 2 * p - 1 - r])]),
    (lesson_10.check_split_sizes, [lambda *a: split_sizes(*a).tolist(), split_sizes, lambda *a: split_sizes(*a).numpy(),
                                   lambda *a: tuple(float(n) for n in split_sizes(*a))]),
    (lesson_10.check_dropped, [dropped, lambda *a: np.int64(dropped(*a)), lambda *a: torch.tensor(dropped(*a)),
                               lambda *a: float(dropped(*a))]),
    (lesson_12.check_mesh_coords, [coords, lambda rank, **sizes: list(coords(rank, **sizes)),
                                   lambda rank, **sizes: np.array(coords(rank, **sizes)),
                                   lambda rank, **sizes: torch.tensor(coords(rank, **sizes))]),
]
RESULT_ROWS = [(check, form) for check, forms in RESULT_FORMS for form in forms]
WRONG_RESULTS = [
    (lesson_05.check_ulysses_gqa_bytes, lambda *a: str(gqa_bytes(*a)), "is not a number"),
    (lesson_05.check_ulysses_gqa_bytes, lambda *a: 2 * gqa_bytes(*a), "does not send"),
    (lesson_05.check_ulysses_gqa_bytes, lambda b, s, hq, hkv, d, p, i: gqa_bytes(b, s, hq, hq, d, p, i), "does not send"),
    (lesson_09.check_zigzag_chunks, lambda r, p: [2 * r, 2 * r + 1], "not balanced"),
    (lesson_09.check_zigzag_chunks, lambda r, p: [r], "two chunk"),
    (lesson_10.check_split_sizes, lambda *a: split_sizes(*a).tolist()[::-1], "Not yet"),
    (lesson_10.check_dropped, lambda *a: dropped(*a) + 0.5, "Not yet"),
    (lesson_12.check_mesh_coords, lambda rank, *, pp, dp, tp: coords(rank, pp=pp, dp=dp, tp=tp)[::-1], "is not its"),
    (lesson_12.check_mesh_coords, lambda rank, *, pp, dp, tp: str(coords(rank, pp=pp, dp=dp, tp=tp)), "three whole"),
]


@pytest.mark.parametrize("index", range(len(RESULT_ROWS)))
def test_results_in_other_forms_are_accepted(index):
    check, form = RESULT_ROWS[index]
    verdict = check(form)
    assert kind(verdict) == "correct", (check.__name__, verdict)


@pytest.mark.parametrize("check, answer, phrase", WRONG_RESULTS, ids=range(len(WRONG_RESULTS)))
def test_wrong_results_are_refused(check, answer, phrase):
    verdict = check(answer, show_hint=True)
    assert kind(verdict) == "not yet" and phrase in verdict, verdict


def one_f_one_b(stage, stages, microbatches):                                           # lesson 08's solution
    warmup = min(stages - stage - 1, microbatches)
    plan = [("F", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        plan += [("F", warmup + i), ("B", i)]
    return plan + [("B", i) for i in range(microbatches - warmup, microbatches)]


SCHEDULE_FORMS = [
    one_f_one_b,
    lambda *a: [[kind, i] for kind, i in one_f_one_b(*a)],                              # lists for pairs
    lambda *a: tuple((kind, np.int64(i)) for kind, i in one_f_one_b(*a)),                # numpy numbers, a tuple
    lambda *a: iter([(kind, torch.tensor(i)) for kind, i in one_f_one_b(*a)]),          # 0-d tensors, an iterator
]
WRONG_SCHEDULES = [
    (lambda *a: [(kind.lower(), i) for kind, i in one_f_one_b(*a)], "is not ('F', i) or ('B', i)"),
    (lambda *a: [(kind, i + 0.5) for kind, i in one_f_one_b(*a)], "is not ('F', i) or ('B', i)"),
    (lambda s, p, m: [("F", i) for i in range(m)] + [("B", i) for i in range(m)], "holds"),          # GPipe
    (lambda s, p, m: one_f_one_b(s, p, m)[:-1], "Not yet"),                                           # partial
]


@pytest.mark.parametrize("index", range(len(SCHEDULE_FORMS)))
def test_lesson08_1f1b_accepts_other_forms(index):
    verdict = check08.check_1f1b(SCHEDULE_FORMS[index])
    assert kind(verdict) == "correct", verdict


@pytest.mark.parametrize("index", range(len(WRONG_SCHEDULES)))
def test_lesson08_1f1b_refuses_wrong_schedules(index):
    answer, phrase = WRONG_SCHEDULES[index]
    verdict = check08.check_1f1b(answer, show_hint=True)
    assert kind(verdict) == "not yet" and phrase in verdict, verdict


# -- right answers that use Python objects without passing data between ranks are accepted ----------

ONES = [1.0]


class Tally:                                             # a class of the learner's, its state per instance
    def __init__(self):
        self.total = 0.0


def count_reading_a_global_list(comm):                   # reads module-level data, writes nothing shared
    tally = Tally()
    tally.total = comm.all_reduce(torch.tensor(ONES)).item()
    return tally.total


def exchange_with_torch_distributed(comm, x):            # torch.distributed's own module state is not the learner's
    import torch.distributed as dist
    n, rank = dist.get_world_size(), dist.get_rank()
    left, right = torch.empty_like(x), torch.empty_like(x)
    if rank % 2 == 0:
        dist.send(x, (rank + 1) % n), dist.recv(left, (rank - 1) % n)
        dist.send(x, (rank - 1) % n), dist.recv(right, (rank + 1) % n)
    else:
        dist.recv(left, (rank - 1) % n), dist.send(x, (rank + 1) % n)
        dist.recv(right, (rank + 1) % n), dist.send(x, (rank - 1) % n)
    return left, right


def dp_step_over_modules(comm, model, xs, ys):           # model.modules(), dist.all_reduce on every gradient
    import torch.distributed as dist
    (dp.sum_loss(model, xs, ys) / xs.shape[0]).backward()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


NOT_SHARING = [(check00.check_count_ranks, count_reading_a_global_list),
               (check11.check_neighbour_exchange, exchange_with_torch_distributed),
               (check06.check_dp_step, dp_step_over_modules)]


@pytest.mark.parametrize("check, answer", NOT_SHARING, ids=[a.__name__ for _, a in NOT_SHARING])
def test_answers_that_share_no_data_are_accepted(check, answer):
    verdict = check(answer)
    assert kind(verdict) == "correct", verdict
