"""simcomm.dtypes: the real backends' dtype x op tables, and the check that follows them.

The oracle is the table itself (measured on gloo by benchmarks/gloo_dtypes.py): a call it
refuses raises every time, however often accepted calls ran before it, and a call it
accepts never raises.
"""
from __future__ import annotations

import pytest
import torch

from simcomm import dtypes


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_a_refused_call_raises_every_time_even_after_accepted_ones(device):
    for _ in range(3):
        dtypes.check("all_reduce", torch.float32, "sum", device, 0)      # accepted, remembered
        with pytest.raises(RuntimeError, match=r"all_reduce: rank 3's tensor has dtype int16.*gloo"):
            dtypes.check("all_reduce", torch.int16, "sum", device, 3)
        with pytest.raises(ValueError, match=r"all_reduce does not support MAX on complex tensors \(rank 1"):
            dtypes.check("all_reduce", torch.complex64, "max", device, 1)


def test_the_rank_in_a_refusal_is_the_callers_not_the_first_callers():
    with pytest.raises(ValueError, match="rank 5"):
        dtypes.check("reduce", torch.int64, "avg", "cpu", 5)
    with pytest.raises(ValueError, match="rank 6"):
        dtypes.check("reduce", torch.int64, "avg", "cpu", 6)


def test_accepted_calls_and_no_tensor_pass_quietly():
    for op in ("all_reduce", "all_gather", "broadcast", "gather"):
        dtypes.check(op, torch.float32, None, "cpu", 0)
        dtypes.check(op, torch.float32, None, "cpu", 0)
    dtypes.check("barrier", None, None, "cpu", 0)
    with pytest.raises(RuntimeError, match="gather: rank 2's tensor has dtype complex64"):
        dtypes.check("gather", torch.complex64, None, "cpu", 2)


def test_the_backend_follows_the_device():
    assert dtypes.table_for("cpu") == "gloo"
    assert dtypes.table_for(torch.device("cuda", 0)) == "nccl"
