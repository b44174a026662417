"""simcomm.lessons.foundations: the helpers and exercise checkers the notebooks rely on."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.lessons import foundations as lessons
from simcomm.parallel.tensor import tp_mlp


def test_per_rank_formats_numbers_tuples_and_none():
    text = lessons.per_rank([torch.tensor([1.0, 2.5]), None, (3, torch.tensor([4.0]))])
    assert text == "rank 0: [1, 2.5]\nrank 1: None\nrank 2: (3, [4])"


def test_assert_close_and_max_error():
    assert lessons.assert_close([torch.ones(2)], [torch.ones(2)], "x") == "x: matches the reference"
    with pytest.raises(AssertionError, match="differs from the reference by 0.5"):
        lessons.assert_close(torch.ones(2), torch.tensor([1.0, 1.5]), "x")
    with pytest.raises(AssertionError, match="shape"):
        lessons.max_error(torch.ones(2), torch.ones(3))
    with pytest.raises(AssertionError, match="1 tensors where 2"):
        lessons.max_error([torch.ones(1)], [torch.ones(1), torch.ones(1)])


def test_expect_error_checks_type_and_message():
    def boom():
        raise ValueError("size 6 is not divisible")

    assert isinstance(lessons.expect_error(boom, ValueError, "size 6"), ValueError)
    with pytest.raises(AssertionError, match="does not mention"):
        lessons.expect_error(boom, ValueError, "size 7")
    with pytest.raises(AssertionError, match="returned normally"):
        lessons.expect_error(lambda: None, ValueError)
    with pytest.raises(ValueError):
        lessons.expect_error(boom, KeyError)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5])
def test_ring_all_reduce_equals_all_reduce(world_size):
    def program(comm):
        x = torch.arange(2.0 * world_size).reshape(2, world_size) * (comm.rank + 1)   # (2, world_size)
        return lessons.ring_all_reduce(comm, x), comm.all_reduce(x), x.clone()

    for rank, (ring, builtin, x) in enumerate(simcomm.World(world_size).run(program)):
        assert torch.equal(ring, builtin)
        assert torch.equal(x, torch.arange(2.0 * world_size).reshape(2, world_size) * (rank + 1))  # untouched


def test_ring_sends_two_n_minus_one_chunks_per_rank():
    world = simcomm.World(4)
    world.run(lambda comm: lessons.ring_all_reduce(comm, torch.ones(8)))
    sends = world.trace.filter(rank=0, op="send").events
    assert len(sends) == 6 and all(event.nbytes == 8 for event in sends)


def test_ring_reduce_scatter_leaves_rank_r_with_chunk_r_plus_1():
    for n in (2, 3, 4, 5):
        # follow which ranks have been added into each (rank, chunk) along the reduce-scatter
        holders = {(rank, chunk): {rank} for rank in range(n) for chunk in range(n)}
        for step in lessons.ring_schedule(n)[:n - 1]:
            for sender, receiver, chunk in step:
                holders[(receiver, chunk)] = holders[(receiver, chunk)] | holders[(sender, chunk)]
        for rank in range(n):
            assert holders[(rank, (rank + 1) % n)] == set(range(n))


def test_ring_schedule_matches_the_figure_module():
    from simcomm.viz import allreduce_steps
    for n in (2, 3, 4, 8):
        steps = allreduce_steps(n, "ring")[1:]
        assert [[(s, d, c) for s, d, (c,) in step.sends] for step in steps] == lessons.ring_schedule(n)


def _square_sum(comm, x):
    return (comm.all_gather(x, dim=0) ** 2).sum() * (comm.rank + 1)


class _WrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        return grad * 2          # should be 3


def _wrong(comm, x):
    return comm.all_reduce(_WrongBackward.apply(x)).sum()


def test_gradcheck_across_ranks_passes_right_and_catches_wrong_gradients():
    world = simcomm.World(3)
    inputs = [torch.randn(2, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    assert lessons.gradcheck_across_ranks(world, _square_sum, inputs) < 1e-6
    with pytest.raises(AssertionError, match="relative error"):
        lessons.gradcheck_across_ranks(world, _wrong, inputs)


def _placeholder(*args):
    raise NotImplementedError


def _not_yet(verdict: str, *fragments: str) -> None:
    """A checker's verdict on a wrong answer: ``Not yet``, the fragments, no traceback text."""
    assert verdict.startswith("Not yet: "), verdict
    assert not lessons.is_correct(verdict)
    assert "Traceback" not in verdict and "File \"" not in verdict, verdict
    for fragment in fragments:
        assert fragment in verdict, (fragment, verdict)


CALLS = {"all_gather": {"dim": 0}, "gather": {"dst": 1}}


def _shapes(predictions):
    return lessons.check_shapes(predictions, world_size=2, shape=(2, 2), args=CALLS, show_hint=True)


def test_check_shapes_right_placeholder():
    assert _shapes({"all_gather": ..., "gather": ...}) == lessons.NOT_ANSWERED
    assert _shapes({"all_gather": (4, 2), "gather": None}) == "Correct: all 2 shapes."
    assert _shapes({"all_gather": [4, 2], "gather": None}) == "Correct: all 2 shapes."


def test_check_shapes_wrong_partial_malformed():
    _not_yet(_shapes({"all_gather": (2, 2), "gather": None}), "1 of 2 shapes are wrong", "all_gather", "Hint:")
    assert "(4, 2)" not in _shapes({"all_gather": (2, 2), "gather": None}), "a wrong answer is not corrected"
    _not_yet(_shapes({"all_gather": (4, 2)}), "1 of 2 calls", "missing: ['gather']")   # partial
    _not_yet(_shapes({"all_gather": 4, "gather": None}), "all_gather", "tuple of ints")   # an int, not a shape
    _not_yet(_shapes({"all_gathr": (4, 2), "gather": None}), "['all_gathr'] is not one of the calls")
    _not_yet(_shapes([(4, 2), None]), "write a dict")
    _not_yet(_shapes({"all_gather": ("4", 2), "gather": None}), "tuple of ints")


def test_check_prediction_runs_the_collective_itself():
    from torch.distributed import ReduceOp
    check = lessons.check_prediction
    rs_max, ar_min = ("reduce_scatter", {"dim": 0, "op": ReduceOp.MAX}), ("all_reduce", {"op": ReduceOp.MIN})
    assert check(..., *rs_max, rank=3, what="x") == lessons.NOT_ANSWERED
    for right in ([33], 33, 33.0, (33,), torch.tensor([33.0]), torch.tensor(33)):     # other forms
        assert check(right, *rs_max, rank=3, what="x") == "Correct: x is [33]."
    for right in ([0, 1, 2, 3], torch.arange(4), (0.0, 1.0, 2.0, 3.0)):
        assert check(right, *ar_min, rank=1, what="y") == "Correct: y is [0, 1, 2, 3]."
    assert check([60, 64, 68, 72], "all_reduce", {}, rank=2, what="z") == "Correct: z is [60, 64, 68, 72]."
    _not_yet(check([30], *rs_max, rank=3, what="x", hint="think", show_hint=True), "x is not [30]", "Hint: think")
    _not_yet(check([3], *rs_max, rank=0, what="x"), "x is not [3]")          # rank 3's answer for rank 0
    _not_yet(check([0, 1], *ar_min, rank=1, what="y"), "holds 4 number(s); you gave 2")           # partial
    _not_yet(check("one", *ar_min, rank=1, what="y"), "not a number")                              # malformed
    _not_yet(check([[1], [2, 3]], *ar_min, rank=1, what="y"), "not a number")
    _not_yet(check(None, *ar_min, rank=1, what="y"), "not a number")
    with pytest.raises(ValueError, match="op='send'"):
        check([1], "send", {}, rank=0, what="x")
    with pytest.raises(ValueError, match="rank=4"):
        check([1], "all_reduce", {}, rank=4, what="x")

def _count_with_all_reduce(comm):
    return comm.all_reduce(torch.ones(1)).item()


def test_check_count_ranks():
    assert lessons.check_count_ranks(_placeholder) == lessons.NOT_ANSWERED
    assert lessons.check_count_ranks(_count_with_all_reduce) == "Correct: right on 1, 2, 3, 5 ranks."
    assert lessons.check_count_ranks(lambda comm: comm.all_reduce(torch.ones(1))).startswith("Correct")
    _not_yet(lessons.check_count_ranks(lambda comm: comm.all_reduce(torch.ones(1)).item() + 1), "returned")
    _not_yet(lessons.check_count_ranks(lambda comm: comm.world_size), "comm.world_size")   # forbidden
    _not_yet(lessons.check_count_ranks(lambda comm: len(comm.ranks)), "comm.ranks")
    _not_yet(lessons.check_count_ranks(lambda comm: comm.all_reduce(torch.ones(2))), "one number")  # malformed
    _not_yet(lessons.check_count_ranks(lambda comm: 1 / 0), "ZeroDivisionError", "rank")


def _even_odd(comm):
    lessons.ring_exchange(comm, torch.ones(2))


def _all_send_first(comm):
    comm.send(torch.ones(2))
    comm.recv((2,))


def _barrier_on_rank_0_only(comm):
    if comm.rank == 0:
        comm.barrier()


PROGRAMS = {"A": _even_odd, "B": _all_send_first, "C": _barrier_on_rank_0_only}


def test_check_deadlocks():
    assert lessons.check_deadlocks(..., PROGRAMS) == lessons.NOT_ANSWERED
    assert lessons.check_deadlocks({"B", "C"}, PROGRAMS) == "Correct: B, C deadlock(s) on 4 ranks."
    assert lessons.check_deadlocks(["C", "B"], PROGRAMS).startswith("Correct")
    _not_yet(lessons.check_deadlocks({"A", "B"}, PROGRAMS), "2 of the 3")
    _not_yet(lessons.check_deadlocks({"B"}, PROGRAMS), "1 of the 3")                     # partial
    _not_yet(lessons.check_deadlocks({"D"}, PROGRAMS), "not one of the programs")        # malformed
    _not_yet(lessons.check_deadlocks(2, PROGRAMS), "set of program names")


def test_check_all_gather_backward():
    assert lessons.check_all_gather_backward(_placeholder) == lessons.NOT_ANSWERED
    right = lambda comm, grad, dim: comm.reduce_scatter(grad, dim=dim)
    assert lessons.check_all_gather_backward(right).startswith("Correct")
    assert "more per rank" not in lessons.check_all_gather_backward(right)
    # the rule shared with lesson 07 (verdicts.TRAFFIC_RULE): an all-reduce then a chunk has the
    # right values but moves twice a reduce-scatter's bytes, so it is rejected with the rule as hint
    _not_yet(lessons.check_all_gather_backward(
        lambda comm, grad, dim: comm.all_reduce(grad).chunk(comm.world_size, dim=dim)[comm.rank], show_hint=True),
        "right values, but more bytes than necessary", "ranks [0-3] each sent 288 B and received 288 B",
        "the backward of all-gather is a reduce-scatter")
    _not_yet(lessons.check_all_gather_backward(lambda comm, grad, dim: comm.slice(grad, dim=dim, scale_grad=False)),
             "differs")
    _not_yet(lessons.check_all_gather_backward(lambda comm, grad, dim: grad), "shape")
    _not_yet(lessons.check_all_gather_backward(lambda comm, grad, dim: None), "NoneType")
    _not_yet(lessons.check_all_gather_backward(lambda comm, grad, dim: comm.reduce_scatter(grad, dim=5)),
             "raised", "rank")


def _ring_all_gather(comm, x):
    shards = [None] * comm.world_size
    shards[comm.rank] = x.clone()
    for step in range(comm.world_size - 1):
        shards[(comm.rank - 1 - step) % comm.world_size] = lessons.ring_exchange(
            comm, shards[(comm.rank - step) % comm.world_size])
    return torch.cat(shards)


def _ring_in_wrong_order(comm, x):
    return torch.cat(list(reversed(list(_ring_all_gather(comm, x).chunk(comm.world_size)))))


def _naive_sends(comm, x):
    comm.send(x)
    return comm.recv(x.shape, x.dtype)


def test_check_ring_all_gather():
    assert lessons.check_ring_all_gather(_placeholder) == lessons.NOT_ANSWERED
    assert lessons.check_ring_all_gather(_ring_all_gather).startswith("Correct")
    _not_yet(lessons.check_ring_all_gather(lambda comm, x: comm.all_gather(x, dim=0)), "only send and recv")
    _not_yet(lessons.check_ring_all_gather(_ring_in_wrong_order), "wrong values or order")
    _not_yet(lessons.check_ring_all_gather(_naive_sends, show_hint=True), "deadlocked", "ring_exchange")
    _not_yet(lessons.check_ring_all_gather(lambda comm, x: x), "returned (3,)")                 # partial
    _not_yet(lessons.check_ring_all_gather(lambda comm, x: x.add_(1)), "input was modified")


def test_check_tp_mlp():
    assert lessons.check_tp_mlp(_placeholder) == lessons.NOT_ANSWERED
    assert lessons.check_tp_mlp(lambda comm, x, s: tp_mlp(comm, x, s, conjugate=True)).startswith("Correct")
    _not_yet(lessons.check_tp_mlp(lambda comm, x, s: tp_mlp(comm, x, s, conjugate=False)), "= 4")
    _not_yet(lessons.check_tp_mlp(lambda comm, x, s: x), "the output differs")                 # partial
    _not_yet(lessons.check_tp_mlp(lambda comm, x, s: x @ s["w1"].T), "shape")                  # malformed
    _not_yet(lessons.check_tp_mlp(lambda comm, x, s: "out"), "raised")
    _not_yet(lessons.check_tp_mlp(_bias_inside_the_sum), "the output differs")    # lesson 04's buggy layer


def _bias_inside_the_sum(comm, x, shards):
    h = torch.nn.functional.gelu(x @ shards["w1"].T + shards["b1"])      # (batch, ffn / P)
    return comm.reduce_from_group(h @ shards["w2"].T + shards["b2"])


def _gqa_bytes(b, s, hq, hkv, d, p, i):
    return b * (s // p) * d * i * (2 * hq + 2 * hkv) * (p - 1) / p


def test_check_ulysses_gqa_bytes():
    assert lessons.check_ulysses_gqa_bytes(_placeholder) == lessons.NOT_ANSWERED
    assert lessons.check_ulysses_gqa_bytes(lambda *args: ...) == lessons.NOT_ANSWERED
    assert lessons.check_ulysses_gqa_bytes(_gqa_bytes).startswith("Correct")
    mha = lambda b, s, hq, hkv, d, p, i: 4 * b * (s // p) * hq * d * i * (p - 1) / p   # ignores kv_heads
    _not_yet(lessons.check_ulysses_gqa_bytes(mha), "does not send", "kv_heads")
    _not_yet(lessons.check_ulysses_gqa_bytes(lambda *args: "many"), "not a number")
    _not_yet(lessons.check_ulysses_gqa_bytes(lambda b, s: 0), "TypeError")
