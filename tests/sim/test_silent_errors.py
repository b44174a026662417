"""Errors no rank may miss on virtual ranks: the collective's math failing for the whole group."""
from __future__ import annotations

import re

import pytest
import torch

import simcomm
from simcomm import RankError

from ..foreign_thread import ForeignThread


def _complex_max(comm):
    return comm.all_reduce(torch.ones(2, dtype=torch.complex64), "max")


def _scatter_with_another_dim(comm):
    if comm.rank == 0:
        return comm.scatter(torch.ones(6, 6), src=0, dim=0)
    return comm.scatter(None, src=0, dim=1)


def _async_complex_max(comm):
    return comm.all_reduce(torch.ones(2, dtype=torch.complex64), "max", async_op=True).wait()


# complex MAX: the math refuses it (NotImplementedError), or the dtype check of the backend
# the run stands for refuses it first on every rank (ValueError): either way every rank sees it
@pytest.mark.parametrize("call, error", [(_complex_max, ("NotImplementedError", "ValueError")),
                                         (_scatter_with_another_dim, ("ValueError",)),
                                         (_async_complex_max, ("NotImplementedError", "ValueError"))])
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
    names = {name for name, _ in outs}
    assert len(names) == 1 and names <= set(error), outs
    # the same error on every rank (a refusal before the math names each rank's own number)
    assert len({re.sub(r"rank \d+", "rank N", first_line) for _, first_line in outs}) == 1, outs


def test_an_uncaught_error_of_the_math_fails_the_run_naming_a_rank():
    with pytest.raises(RankError) as caught:
        simcomm.World(2).run(_complex_max)
    assert "rank" in str(caught.value)


def test_a_handle_waited_on_from_a_helper_thread_fails_the_run_with_wrong_thread_error():
    import threading

    from simcomm.errors import WrongThreadError

    def program(comm):
        handle = comm.all_reduce(torch.ones(2), async_op=True)
        seen = helper.call(handle.wait)
        assert isinstance(seen.get("error"), WrongThreadError), seen
        return handle.wait()

    helper = ForeignThread("my-helper")     # started before the run: no rank's thread
    try:
        with pytest.raises(RankError) as caught:
            simcomm.World(2).run(program)
    finally:
        helper.close()
    assert isinstance(caught.value.__cause__, WrongThreadError), repr(caught.value.__cause__)
    message = str(caught.value.__cause__)
    assert "wait() on the handle of all_reduce" in message and "'my-helper'" in message and "rank 0" in message
