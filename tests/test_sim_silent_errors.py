"""Errors no rank may miss on virtual ranks: the collective's math failing for the whole group."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm import RankError


def _complex_max(comm):
    return comm.all_reduce(torch.ones(2, dtype=torch.complex64), "max")


def _scatter_with_another_dim(comm):
    if comm.rank == 0:
        return comm.scatter(torch.ones(6, 6), src=0, dim=0)
    return comm.scatter(None, src=0, dim=1)


def _async_complex_max(comm):
    return comm.all_reduce(torch.ones(2, dtype=torch.complex64), "max", async_op=True).wait()


@pytest.mark.parametrize("call, error", [(_complex_max, "NotImplementedError"),
                                         (_scatter_with_another_dim, "ValueError"),
                                         (_async_complex_max, "NotImplementedError")])
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_sees_an_error_of_the_collectives_math(call, error, world_size):
    """gloo raises on every rank of a failed call; here too, whichever rank computed it."""
    def program(comm):
        try:
            call(comm)
        except Exception as caught:     # noqa: BLE001 - the program under test catches everything
            return type(caught).__name__, str(caught).splitlines()[0]
        return "no error", ""

    outs = simcomm.World(world_size).run(program)
    assert [name for name, _ in outs] == [error] * world_size, outs
    assert len({first_line for _, first_line in outs}) == 1, outs


def test_an_uncaught_error_of_the_math_fails_the_run_naming_a_rank():
    with pytest.raises(RankError) as caught:
        simcomm.World(2).run(_complex_max)
    assert "rank" in str(caught.value)
