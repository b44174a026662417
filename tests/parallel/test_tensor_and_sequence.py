"""End to end: tensor-parallel MLP, Ulysses attention and a 2x2 mesh equal their single-device models."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.parallel import sequence as sequence_parallel
from simcomm.parallel import tensor as tensor_parallel

WORLD = 4


def reference_mlp(x, params):
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    x = x.clone().requires_grad_()
    y = tensor_parallel.mlp(x, leaves)
    return y, x, leaves


def gathered_grads(outs, key, dim):
    return torch.cat([o["grads"][key] for o in outs], dim)


def run_tp_mlp(loss_fn, conjugate):
    params = tensor_parallel.make_mlp(hidden=6, ffn=8, seed=1)
    x = torch.randn(5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def program(comm):
        shards = tensor_parallel.shard_mlp(params, comm.rank, comm.world_size)
        x_local = x.clone().requires_grad_()
        y = tensor_parallel.tp_mlp(comm, x_local, shards, conjugate=conjugate)
        loss_fn(comm, y).backward()
        return {"y": y.detach(), "x_grad": x_local.grad, "grads": {k: v.grad for k, v in shards.items()}}

    return params, x, simcomm.World(WORLD).run(program)


def check_against_reference(params, x, outs, *, scale=1.0, b2_summed=False):
    y_ref, x_ref, leaves = reference_mlp(x, params)
    y_ref.pow(2).sum().backward()
    for out in outs:
        torch.testing.assert_close(out["y"], y_ref.detach())
        torch.testing.assert_close(out["x_grad"], scale * x_ref.grad)
    torch.testing.assert_close(gathered_grads(outs, "w1", 0), scale * leaves["w1"].grad)
    torch.testing.assert_close(gathered_grads(outs, "b1", 0), scale * leaves["b1"].grad)
    torch.testing.assert_close(gathered_grads(outs, "w2", 1), scale * leaves["w2"].grad)
    b2 = sum(o["grads"]["b2"] for o in outs) if b2_summed else outs[0]["grads"]["b2"]
    torch.testing.assert_close(b2, scale * leaves["b2"].grad)


def test_tp_mlp_replicated_loss_with_the_conjugate_pair_matches_the_reference():
    params, x, outs = run_tp_mlp(lambda comm, y: y.pow(2).sum(), conjugate=True)
    check_against_reference(params, x, outs)


def test_tp_mlp_sum_of_per_rank_losses_with_all_reduce_matches_the_reference():
    # each rank owns a quarter of the objective; the losses sum to the reference loss
    params, x, outs = run_tp_mlp(lambda comm, y: y.pow(2).sum() / comm.world_size, conjugate=False)
    # sharded weights get exact gradients; the input and the replicated bias get their share,
    # which a data-parallel style all-reduce (here: the sum over ranks) completes
    y_ref, x_ref, leaves = reference_mlp(x, params)
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(gathered_grads(outs, "w1", 0), leaves["w1"].grad)
    torch.testing.assert_close(gathered_grads(outs, "w2", 1), leaves["w2"].grad)
    torch.testing.assert_close(sum(o["grads"]["b2"] for o in outs), leaves["b2"].grad)
    torch.testing.assert_close(sum(o["x_grad"] for o in outs), x_ref.grad)


def test_tp_mlp_replicated_loss_with_plain_all_reduce_overcounts_by_world_size():
    params, x, outs = run_tp_mlp(lambda comm, y: y.pow(2).sum(), conjugate=False)
    y_ref, x_ref, leaves = reference_mlp(x, params)
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(gathered_grads(outs, "w1", 0), WORLD * leaves["w1"].grad)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(gathered_grads(outs, "w1", 0), leaves["w1"].grad)


@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_attention_matches_single_device_attention(causal):
    q, k, v = sequence_parallel.make_qkv(batch=2, seq=8, heads=4, head_dim=3, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = sequence_parallel.attention(*leaves, causal=causal)
    upstream = torch.randn_like(out_ref)
    (out_ref * upstream).sum().backward()

    def program(comm):
        def shard(t):
            return t.chunk(comm.world_size, 1)[comm.rank]  # (b, s/P, h, d)

        local = [shard(t).clone().requires_grad_() for t in (q, k, v)]
        out = sequence_parallel.ulysses_attention(comm, *local, causal=causal)
        (out * shard(upstream)).sum().backward()   # per-rank losses sum to the reference loss
        return out.detach(), [t.grad for t in local]

    outs = simcomm.World(WORLD).run(program)
    torch.testing.assert_close(torch.cat([o for o, _ in outs], 1), out_ref.detach())
    for index, leaf in enumerate(leaves):
        torch.testing.assert_close(torch.cat([g[index] for _, g in outs], 1), leaf.grad)


def test_ulysses_with_heads_not_divisible_by_world_size_is_a_clear_error():
    q, k, v = sequence_parallel.make_qkv(batch=1, seq=8, heads=3, head_dim=2)

    def program(comm):
        return sequence_parallel.ulysses_attention(comm, *(t.chunk(4, 1)[comm.rank] for t in (q, k, v)))

    with pytest.raises(simcomm.RankError) as info:
        simcomm.World(WORLD).run(program)
    assert "size 3 of scatter_dim (heads)=2" in str(info.value.__cause__)
    assert "world size 4" in str(info.value.__cause__)


def test_subgroups_of_a_2x2_mesh_reduce_only_their_members():
    """Ranks 0..3 as a (dp=2, tp=2) mesh: tp groups [[0, 1], [2, 3]], dp groups [[0, 2], [1, 3]]."""
    def program(comm):
        tp = comm.subgroup([[0, 1], [2, 3]])
        dp = comm.subgroup([[0, 2], [1, 3]])
        x = torch.tensor([float(10 ** comm.rank)])
        return {"tp": tp.all_reduce(x).item(), "dp": dp.all_reduce(x).item(),
                "tp_ranks": tp.ranks, "dp_ranks": dp.ranks, "tp_rank": tp.rank, "dp_rank": dp.rank,
                "tp_gather": tp.all_gather(x).tolist()}

    outs = simcomm.World(4).run(program)
    assert [o["tp"] for o in outs] == [11, 11, 1100, 1100]
    assert [o["dp"] for o in outs] == [101, 1010, 101, 1010]
    assert [o["tp_ranks"] for o in outs] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [o["dp_ranks"] for o in outs] == [(0, 2), (1, 3), (0, 2), (1, 3)]
    assert [o["tp_rank"] for o in outs] == [0, 1, 0, 1]
    assert outs[3]["tp_gather"] == [100.0, 1000.0]


def test_2d_tensor_and_data_parallel_mlp_matches_the_reference():
    """tp=2 shards the MLP; dp=2 splits the batch; gradients averaged over dp equal the reference."""
    params = tensor_parallel.make_mlp(hidden=4, ffn=6, seed=4)
    x = torch.randn(6, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    def program(comm):
        tp = comm.subgroup([[0, 1], [2, 3]])
        dp = comm.subgroup([[0, 2], [1, 3]])
        shards = tensor_parallel.shard_mlp(params, tp.rank, tp.world_size)
        batch = x.chunk(dp.world_size, 0)[dp.rank]
        y = tensor_parallel.tp_mlp(tp, batch, shards, conjugate=True)
        y.pow(2).sum().backward()                     # replicated within tp, one share of the batch per dp rank
        return {k: dp.all_reduce(v.grad) for k, v in shards.items()}

    outs = simcomm.World(4).run(program)
    y_ref, _, leaves = reference_mlp(x, params)
    y_ref.pow(2).sum().backward()
    torch.testing.assert_close(torch.cat([outs[0]["w1"], outs[1]["w1"]], 0), leaves["w1"].grad)
    torch.testing.assert_close(torch.cat([outs[2]["w2"], outs[3]["w2"]], 1), leaves["w2"].grad)
    torch.testing.assert_close(outs[3]["b2"], leaves["b2"].grad)
