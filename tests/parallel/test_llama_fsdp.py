"""FSDP pieces of the small Llama: the gather rebuilds the parameter, its backward reduce-scatters the gradient."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.parallel import llama_fsdp


def test_pieces_cover_the_tensor_with_zero_padding():
    tensor = torch.arange(10, dtype=torch.float64).view(2, 5)
    pieces = [llama_fsdp.piece(tensor, rank, 4) for rank in range(4)]
    assert [p.numel() for p in pieces] == [3] * 4 and llama_fsdp.piece_numel(10, 4) == 3
    assert torch.cat(pieces).tolist() == list(range(10)) + [0, 0]
    with pytest.raises(ValueError, match="rank=4 is not in \\[0, 4\\)"):
        llama_fsdp.piece(tensor, 4, 4)
    with pytest.raises(ValueError, match="shards=0 must be >= 1"):
        llama_fsdp.piece_numel(10, 0)


def _program(comm, weight, xs):
    shapes = {"w": weight.shape}
    pieces = {"w": llama_fsdp.piece(weight, comm.rank, comm.world_size).requires_grad_()}
    whole = llama_fsdp.unshard(comm, pieces, shapes)["w"]
    (xs[comm.rank] @ whole.T).pow(2).sum().backward()          # each rank's own batch
    return {"whole": whole.detach(), "grad": pieces["w"].grad,
            "gathered": llama_fsdp.gather_piece(comm, pieces["w"], shapes["w"])}


def test_unshard_is_the_parameter_and_its_backward_sums_the_gradients_into_the_pieces():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(2, 7, dtype=torch.float64, generator=gen)
    xs = torch.randn(3, 4, 7, dtype=torch.float64, generator=gen)
    leaf = weight.clone().requires_grad_()
    sum((x @ leaf.T).pow(2).sum() for x in xs).backward()      # one device: the sum of the ranks' losses
    outs = simcomm.World(3).run(_program, weight, xs)
    expected = [llama_fsdp.piece(leaf.grad, rank, 3) for rank in range(3)]
    for rank, out in enumerate(outs):
        assert torch.equal(out["whole"], weight) and torch.equal(out["gathered"], weight)
        torch.testing.assert_close(out["grad"], expected[rank], rtol=0, atol=1e-12)
    assert outs[2]["grad"][-1] == 0                             # the padding's gradient is zero
