"""tp_mlp_shards_figure: each weight coloured by the rank that holds it, as shard_mlp splits it."""
from __future__ import annotations

import pytest
import torch

from simcomm.parallel.tensor import shard_mlp
from simcomm.viz import tp_mlp_shards_figure


@pytest.mark.parametrize("hidden, ffn, world_size", [(8, 16, 4), (3, 6, 2), (4, 6, 3)])
def test_owners_match_shard_mlp(hidden, ffn, world_size):
    fig = tp_mlp_shards_figure(hidden, ffn, world_size)
    owner_w1, owner_w2 = (torch.tensor(trace.z) for trace in fig.data[:2])
    assert owner_w1.shape == (ffn, hidden) and owner_w2.shape == (hidden, ffn)
    # the oracle: weights whose value is their flat position, split by shard_mlp
    params = {"w1": torch.arange(ffn * hidden).reshape(ffn, hidden).double(), "b1": torch.zeros(ffn),
              "w2": torch.arange(hidden * ffn).reshape(hidden, ffn).double(), "b2": torch.zeros(hidden)}
    for rank in range(world_size):
        shards = shard_mlp(params, rank, world_size)
        for name, owner in (("w1", owner_w1), ("w2", owner_w2)):
            held = set(shards[name].flatten().long().tolist())
            mine = set(torch.nonzero(owner.flatten() == rank).flatten().tolist())
            assert held == mine, (name, rank)
    assert all(trace.textfont.size >= 14 for trace in fig.data[:2])


def test_bad_sizes_are_named():
    with pytest.raises(ValueError, match="ffn=6 is not divisible by the world size 4"):
        tp_mlp_shards_figure(4, 6, 4)
    with pytest.raises(ValueError, match="hidden=0"):
        tp_mlp_shards_figure(0, 8, 2)
