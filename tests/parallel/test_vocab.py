"""Vocabulary-parallel embedding and cross-entropy against one device in float64; logits never gathered."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import simcomm
from simcomm.parallel.vocab import vocab_parallel_cross_entropy, vocab_parallel_embedding, vocab_range

TOKENS, VOCAB, HIDDEN = 12, 16, 8


def _data():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(TOKENS, HIDDEN, dtype=torch.float64, generator=gen),
            torch.randn(VOCAB, HIDDEN, dtype=torch.float64, generator=gen),
            torch.randint(0, VOCAB, (TOKENS,), generator=gen))


def _program(comm, x, table, target):
    start, end = vocab_range(VOCAB, comm.rank, comm.world_size)
    x = x.clone().requires_grad_()
    shard = table[start:end].clone().requires_grad_()
    emb = vocab_parallel_embedding(comm, target, shard)                      # (tokens, h), replicated
    logits = comm.copy_to_group(x + emb) @ shard.T                           # (tokens, V/t)
    loss = vocab_parallel_cross_entropy(comm, logits, target).mean()          # replicated
    loss.backward()
    return {"loss": loss.detach(), "dx": x.grad, "dshard": shard.grad}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_loss_and_gradients_equal_one_device(world_size):
    x, table, target = _data()
    xr, tr = x.clone().requires_grad_(), table.clone().requires_grad_()
    reference = F.cross_entropy((xr + F.embedding(target, tr)) @ tr.T, target)
    reference.backward()
    world = simcomm.World(world_size)
    outs = world.run(_program, x, table, target)
    for out in outs:
        torch.testing.assert_close(out["loss"], reference.detach(), rtol=0, atol=1e-12)
        torch.testing.assert_close(out["dx"], xr.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(torch.cat([o["dshard"] for o in outs]), tr.grad, rtol=0, atol=1e-12)
    if world_size > 1:   # only per-token numbers and the (tokens, h) embedding cross ranks, never logits
        moved = {tuple(e.shape) for e in world.trace.events if e.op not in ("compute", "subgroup")}
        assert moved == {(TOKENS,), (TOKENS, HIDDEN)}, moved


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="vocab=10 is not divisible by the tensor-parallel size 4"):
        vocab_range(10, 0, 4)
    _, table, target = _data()
    with pytest.raises(simcomm.RankError, match=r"ids must lie in \[0, 16\); got min 0, max 99"):
        simcomm.World(2).run(lambda comm: vocab_parallel_embedding(comm, torch.tensor([0, 99]), table[:8]))
    with pytest.raises(simcomm.RankError, match="logits must be"):
        simcomm.World(2).run(lambda comm: vocab_parallel_cross_entropy(comm, table[:8], target))
