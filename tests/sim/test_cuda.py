"""A World on a CUDA device: every op forward and backward on 4 virtual ranks (skips without a GPU).

With CUDA tensors autograd would run backward on its device thread, shared by
every rank thread, where the scheduler cannot see a rank's waits; each rank
thread therefore runs with autograd multithreading disabled. The oracle is
the single-device float64 reference of ``tests/reference.py`` on the CPU.
"""
from __future__ import annotations

import pytest
import torch

import simcomm

from .. import reference as ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WORLD = 4


def _inputs(shape, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(WORLD)]


def _weights(outs) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]


CASES = {
    # name: (call on a rank, reference over every rank's leaf, input shape, replicated input)
    "all_reduce_sum": (lambda c, x: c.all_reduce(x), lambda xs: ref.all_reduce(xs, "sum"), (4, 6), False),
    "all_reduce_avg": (lambda c, x: c.all_reduce(x, op="avg"), lambda xs: ref.all_reduce(xs, "avg"), (4, 6), False),
    "all_reduce_max": (lambda c, x: c.all_reduce(x, op="max"), lambda xs: ref.all_reduce(xs, "max"), (4, 6), False),
    "all_reduce_min": (lambda c, x: c.all_reduce(x, op="min"), lambda xs: ref.all_reduce(xs, "min"), (4, 6), False),
    "all_reduce_product": (lambda c, x: c.all_reduce(x, op="product"),
                           lambda xs: ref.all_reduce(xs, "product"), (4, 6), False),
    "all_gather": (lambda c, x: c.all_gather(x, dim=1), lambda xs: ref.all_gather(xs, 1), (4, 6), False),
    "reduce_scatter": (lambda c, x: c.reduce_scatter(x, dim=0), lambda xs: ref.reduce_scatter(xs, 0), (8, 3), False),
    "slice": (lambda c, x: c.slice(x, dim=1, scale_grad=False), lambda xs: ref.slice_(xs[0], WORLD, 1), (2, 8), True),
    "all_to_all_4D": (lambda c, x: c.all_to_all_4D(x, 2, 1), lambda xs: ref.all_to_all_4d(xs, 2, 1),
                      (1, 2, 4, 3), False),
    "broadcast": (lambda c, x: c.broadcast(x, src=2), lambda xs: ref.broadcast(xs, 2), (5,), False),
    "copy_to_group": (lambda c, x: c.copy_to_group(x), lambda xs: list(xs), (5,), False),
    "reduce_from_group": (lambda c, x: c.reduce_from_group(x), lambda xs: ref.all_reduce(xs, "sum"), (5,), False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_of_every_op_on_a_cuda_world(name):
    call, reference, shape, replicated = CASES[name]
    inputs = _inputs(shape)
    if replicated:
        inputs = [inputs[0]] * WORLD
    ref_leaves = [x.clone().requires_grad_() for x in inputs]
    ref_outs = reference(ref_leaves)
    weights = _weights(ref_outs)

    def program(comm, inputs, weights):
        x = inputs[comm.rank].detach().requires_grad_()       # on the World's device already
        y = call(comm, x)
        (y * weights[comm.rank]).sum().backward()
        return y.device.type, y.detach().cpu(), x.grad.cpu()

    outs = simcomm.World(WORLD, device="cuda").run(program, inputs, weights)
    objective = sum((y * w).sum() for y, w in zip(ref_outs, weights))
    objective.backward()
    ref_grads = [leaf.grad for leaf in ref_leaves]
    if replicated:   # one shared tensor: its gradient is the sum over ranks
        ref_grads = [ref_leaves[0].grad] * WORLD
    for rank, (device_type, y, grad) in enumerate(outs):
        assert device_type == "cuda"
        torch.testing.assert_close(y, ref_outs[rank].detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, ref_grads[rank], rtol=1e-12, atol=1e-12)


def test_gather_send_recv_barrier_and_subgroup_on_a_cuda_world():
    inputs = _inputs((3,))

    def program(comm, inputs):
        x = inputs[comm.rank]
        gathered = comm.gather(x, dst=1, dim=0)
        comm.barrier()
        if comm.rank % 2 == 0:
            comm.send(x, dst=comm.rank + 1)
            received = None
        else:
            received = comm.recv((3,), torch.float64, src=comm.rank - 1).cpu()
        pair = comm.subgroup([[0, 1], [2, 3]])
        pair_sum = pair.all_reduce(x).cpu()
        return (gathered.cpu() if gathered is not None else None), received, pair_sum

    outs = simcomm.World(WORLD, device="cuda").run(program, inputs)
    torch.testing.assert_close(outs[1][0], ref.gather(inputs, 1, 0)[1])
    assert outs[0][0] is None
    for rank in (1, 3):
        torch.testing.assert_close(outs[rank][1], inputs[rank - 1])
    for rank in range(WORLD):
        first = rank - rank % 2
        torch.testing.assert_close(outs[rank][2], inputs[first] + inputs[first + 1])


def test_each_rank_has_its_own_cuda_random_state():
    def program(comm):
        torch.manual_seed(0)
        first = torch.randn(3, device="cuda")
        comm.barrier()
        second = torch.randn(3, device="cuda")
        return first.cpu(), second.cpu()

    gen = torch.Generator(device="cuda").manual_seed(0)
    expected = [torch.randn(3, device="cuda", generator=gen).cpu() for _ in range(2)]
    for rank, (first, second) in enumerate(simcomm.World(WORLD, device="cuda").run(program)):
        assert torch.equal(first, expected[0]) and torch.equal(second, expected[1]), rank
