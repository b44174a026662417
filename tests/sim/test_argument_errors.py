"""Bad receive specs and split lists: the error names the op, the rank, the argument and the value."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm import P2POp, RankError


def _error_of(program, world_size: int = 2) -> BaseException:
    with pytest.raises(RankError) as caught:
        simcomm.World(world_size).run(program)
    return caught.value.__cause__ or caught.value


def _message(program, world_size: int = 2) -> str:
    return str(_error_of(program, world_size))


@pytest.mark.parametrize("call, op, arg, value", [
    (lambda c: c.irecv(2, torch.float32, 0), "irecv", "size", "2"),
    (lambda c: c.recv(2, torch.float32, 0), "recv", "size", "2"),
    (lambda c: c.irecv((2,), "float32", 0), "irecv", "dtype", "'float32'"),
    (lambda c: c.recv((2.5,), torch.float32, 0), "recv", "size", "2.5"),
    (lambda c: c.recv((2, -1), torch.float32, 0), "recv", "size", "-1"),
    (lambda c: c.recv("ab", torch.float32, 0), "recv", "size", "'ab'"),
    (lambda c: c.batch_isend_irecv([P2POp("irecv", (2, torch.float32), 0)]), "batch_isend_irecv", "size", "2"),
    (lambda c: c.batch_isend_irecv([P2POp("irecv", ((2,), "float32"), 0)]), "batch_isend_irecv", "dtype",
     "'float32'"),
])
def test_a_bad_receive_spec_names_op_rank_argument_and_value(call, op, arg, value):
    def program(comm):
        if comm.rank == 1:
            call(comm)
        return None

    error = _error_of(program)
    text = str(error)
    assert isinstance(error, TypeError), type(error)
    assert text.startswith(f"{op}"), text
    assert "rank 1" in text and arg in text and value in text, text
    assert "iterable" not in text and "itemsize" not in text, text


def test_a_good_receive_spec_in_any_sequence_form_still_works():
    def program(comm):
        if comm.rank == 0:
            for _ in range(3):
                comm.send(torch.arange(6.0).reshape(2, 3), 1)
            return None
        return [comm.recv(size, torch.float32, 0).shape for size in ((2, 3), [2, 3], torch.Size([2, 3]))]

    assert simcomm.World(2).run(program)[1] == [torch.Size([2, 3])] * 3


@pytest.mark.parametrize("arg", ["input_split_sizes", "output_split_sizes"])
def test_none_splits_over_rows_that_do_not_divide_name_the_argument(arg):
    def program(comm):
        splits = {"input_split_sizes": [2, 1], "output_split_sizes": [2, 1]}
        splits[arg] = None
        return comm.all_to_all_single(torch.ones(3), **splits)

    text = _message(program)
    assert text.startswith("all_to_all_single:"), text
    assert f"{arg}=None" in text and "rank 0" in text and "size 3" in text and "(3,)" in text, text
    assert "=0 (shape" not in text, text


def test_a_split_list_of_the_wrong_length_names_it():
    text = _message(lambda comm: comm.all_to_all_single(torch.ones(4), [2, 2], [1, 1, 2]))
    assert "input_split_sizes=[1, 1, 2]" in text and "rank 0" in text and "2 non-negative ints" in text, text
