"""simcomm.lessons: the helpers and exercise checkers the notebooks rely on."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm import lessons
from simcomm.models import tp_mlp


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


def test_check_shapes():
    calls = {"all_gather": {"dim": 0}, "gather": {"dst": 1}}
    assert lessons.check_shapes({"all_gather": ..., "gather": ...}, world_size=2, shape=(2, 2), args=calls) \
        == lessons.NOT_ANSWERED
    assert lessons.check_shapes({"all_gather": (4, 2), "gather": None}, world_size=2, shape=(2, 2),
                                args=calls).startswith("Correct")
    with pytest.raises(AssertionError, match=r"you said \(2, 2\), rank 0 gets \(4, 2\)"):
        lessons.check_shapes({"all_gather": (2, 2)}, world_size=2, shape=(2, 2), args=calls)


def test_check_prediction():
    assert lessons.check_prediction(..., torch.tensor([1.0]), "x") == lessons.NOT_ANSWERED
    assert lessons.check_prediction([1], torch.tensor([1.0]), "x") == "Correct: x is [1]."
    with pytest.raises(AssertionError, match=r"you said \[2\], it is \[1\]"):
        lessons.check_prediction([2], torch.tensor([1.0]), "x")
    with pytest.raises(AssertionError, match="not a number"):
        lessons.check_prediction("one", torch.tensor([1.0]), "x")


def test_check_count_ranks():
    assert lessons.check_count_ranks(_placeholder) == lessons.NOT_ANSWERED
    assert lessons.check_count_ranks(lambda comm: comm.all_reduce(torch.ones(1)).item()).startswith("Correct")
    with pytest.raises(AssertionError, match="returned"):
        lessons.check_count_ranks(lambda comm: comm.all_reduce(torch.ones(1)).item() + 1)
    with pytest.raises(AssertionError, match="no all-reduce"):
        lessons.check_count_ranks(lambda comm: comm.world_size)


def test_check_all_gather_backward():
    assert lessons.check_all_gather_backward(_placeholder) == lessons.NOT_ANSWERED
    right = lambda comm, grad, dim: comm.reduce_scatter(grad, dim=dim)
    assert lessons.check_all_gather_backward(right).startswith("Correct")
    with pytest.raises(AssertionError, match="differs"):
        lessons.check_all_gather_backward(lambda comm, grad, dim: comm.slice(grad, dim=dim, scale_grad=False))
    with pytest.raises(AssertionError, match="shape"):
        lessons.check_all_gather_backward(lambda comm, grad, dim: grad)


def test_check_tp_mlp():
    assert lessons.check_tp_mlp(_placeholder) == lessons.NOT_ANSWERED
    assert lessons.check_tp_mlp(lambda comm, x, s: tp_mlp(comm, x, s, conjugate=True)).startswith("Correct")
    with pytest.raises(AssertionError, match="= 4"):
        lessons.check_tp_mlp(lambda comm, x, s: tp_mlp(comm, x, s, conjugate=False))


def test_check_ring_counts():
    assert lessons.check_ring_counts(_placeholder, _placeholder) == lessons.NOT_ANSWERED
    assert lessons.check_ring_counts(lambda n: 2 * (n - 1), lambda n, b: 2 * (n - 1) * b / n).startswith("Correct")
    with pytest.raises(AssertionError, match="you said each rank sends"):
        lessons.check_ring_counts(lambda n: 2 * (n - 1), lambda n, b: 2 * b)


def test_check_ulysses_bytes():
    assert lessons.check_ulysses_bytes(_placeholder) == lessons.NOT_ANSWERED
    right = lambda b, s, h, d, p, i: 4 * b * (s // p) * h * d * i * (p - 1) / p
    assert lessons.check_ulysses_bytes(right).startswith("Correct")
    with pytest.raises(AssertionError, match="you said"):
        lessons.check_ulysses_bytes(lambda b, s, h, d, p, i: 4 * b * (s // p) * h * d * i)
