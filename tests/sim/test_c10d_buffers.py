"""c10d output buffers are written as gloo writes them: invisible to autograd.

The reference is gloo itself: the same program on real processes moves each output
buffer's version counter the same number of times, and a tensor saved for backward
before the collective is then used as it is (no "modified by an inplace operation").
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import simcomm

WORLD = 2

#: what gloo does to the version counter of each output buffer (measured on gloo, 2 processes)
GLOO_BUMPS = {"all_reduce": [0], "broadcast": [0], "reduce": [0], "all_to_all_single": [0], "scatter": [0],
              "recv": [0], "irecv": [0], "all_reduce_async": [0], "all_gather": [1, 1], "gather": [1, 1],
              "all_to_all": [1, 1], "reduce_scatter_tensor": [1], "all_gather_into_tensor": [2]}


def version_program(comm=None):
    warnings.simplefilter("ignore", FutureWarning)
    rank, out = dist.get_rank(), {}

    def bumps(name, buffers, call):
        before = [b._version for b in buffers]
        call()
        out[name] = [b._version - v for v, b in zip(before, buffers)]

    b = torch.zeros(4)
    bumps("all_reduce", [b], lambda: dist.all_reduce(b))
    b = torch.zeros(4)
    bumps("broadcast", [b], lambda: dist.broadcast(b, 1))           # rank 0 receives
    b = torch.zeros(4)
    bumps("reduce", [b], lambda: dist.reduce(b, 0))
    o = torch.zeros(8)
    bumps("all_gather_into_tensor", [o], lambda: dist.all_gather_into_tensor(o, torch.ones(4)))
    outs = [torch.zeros(4), torch.zeros(4)]
    bumps("all_gather", outs, lambda: dist.all_gather(outs, torch.ones(4)))
    o = torch.zeros(2)
    bumps("reduce_scatter_tensor", [o], lambda: dist.reduce_scatter_tensor(o, torch.ones(4)))
    o = torch.zeros(4)
    bumps("all_to_all_single", [o], lambda: dist.all_to_all_single(o, torch.ones(4)))
    o = torch.zeros(4)
    bumps("scatter", [o], lambda: dist.scatter(o, [torch.ones(4)] * 2 if rank == 0 else None, 0))
    gathered = [torch.zeros(4), torch.zeros(4)]
    bumps("gather", gathered, lambda: dist.gather(torch.ones(4), gathered if rank == 0 else None, 0))
    if rank != 0:
        out["gather"] = [1, 1]                                          # only dst has buffers
    pieces = [torch.zeros(2), torch.zeros(2)]
    bumps("all_to_all", pieces, lambda: dist.all_to_all(pieces, [torch.ones(2), torch.ones(2)]))
    o = torch.zeros(4)
    if rank == 1:
        dist.send(torch.ones(4), 0)
        dist.isend(torch.ones(4), 0).wait()
        out["recv"] = out["irecv"] = [0]
    else:
        bumps("recv", [o], lambda: dist.recv(o, 1))
        o = torch.zeros(4)
        bumps("irecv", [o], lambda: dist.irecv(o, 1).wait())
    o = torch.zeros(4)
    bumps("all_reduce_async", [o], lambda: dist.all_reduce(o, async_op=True).wait())

    # a tensor saved for backward, then all-reduced in place: backward uses it as it is now
    weight = torch.ones(4, requires_grad=True)
    hidden = weight * 2
    loss = (hidden ** 2).sum()                # saves hidden
    dist.all_reduce(hidden)                   # hidden = 2 * 2 on every element
    loss.backward()                           # d/dw (2w)^2 = 8w, read from the saved (now 4): 2 * 2 * 4
    out["grad"] = weight.grad
    return out


def test_output_buffers_move_the_version_counter_as_gloo_does():
    for rank, out in enumerate(simcomm.World(WORLD).run(version_program)):
        grad = out.pop("grad")
        assert out == GLOO_BUMPS, (rank, out)
        torch.testing.assert_close(grad, torch.full((4,), 16.0))


@pytest.mark.real
@pytest.mark.slow
def test_the_version_counts_are_gloos(gloo_cluster):
    real_outs = gloo_cluster(WORLD).run(version_program)
    sim_outs = simcomm.World(WORLD).run(version_program)
    for real_out, sim_out in zip(real_outs, sim_outs, strict=True):
        torch.testing.assert_close(real_out.pop("grad"), sim_out.pop("grad"))
        assert real_out == sim_out == GLOO_BUMPS
