"""Provenance codes: value = rank * base + flat position, decoded back exactly."""
import numpy as np
import pytest
import torch

from simcomm.viz import decode, describe, provenance_base, provenance_tensor, provenance_tensors


def test_base_is_the_smallest_power_of_ten_above_every_position():
    assert provenance_base(1) == 10
    assert provenance_base(10) == 10
    assert provenance_base(11) == 100
    assert provenance_base(100) == 100
    assert provenance_base(101) == 1000


def test_tensor_values_read_as_rank_then_position():
    tensor = provenance_tensor(2, (2, 3))
    assert tensor.dtype == torch.float64
    assert tensor.tolist() == [[20, 21, 22], [23, 24, 25]]


def test_decode_inverts_the_code_after_data_moves():
    tensors = provenance_tensors(4, (2, 3), base=100)
    moved = torch.cat([tensors[3], tensors[1]], dim=1)  # what an all-gather of two ranks would hold
    ranks, positions = decode(moved, 100)
    assert ranks.tolist() == [[3, 3, 3, 1, 1, 1], [3, 3, 3, 1, 1, 1]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 2], [3, 4, 5, 3, 4, 5]]


def test_describe_names_rank_and_multi_index():
    assert describe(24, 10, (2, 3)) == "rank 2, element (1, 1)"
    assert describe(7, 10, (8,)) == "rank 0, element (7,)"


@pytest.mark.parametrize("value", [-1.0, 2.5, float("nan")])
def test_decode_rejects_values_that_are_not_codes(value):
    with pytest.raises(ValueError, match="decode: value .* is not a provenance code"):
        decode(np.array([1.0, value]), 10)


def test_errors_name_function_and_argument():
    with pytest.raises(ValueError, match=r"provenance_tensor: base=5 is smaller than the 6 elements"):
        provenance_tensor(0, (2, 3), base=5)
    with pytest.raises(ValueError, match=r"provenance_tensors: world_size=0"):
        provenance_tensors(0, (2,))
    with pytest.raises(ValueError, match=r"provenance_tensor: shape=\(2, 0\)"):
        provenance_tensor(0, (2, 0))
    with pytest.raises(ValueError, match=r"describe: value 9 encodes position 9, outside shape \(2, 3\)"):
        describe(9, 10, (2, 3))
