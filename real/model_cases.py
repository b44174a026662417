"""The model cases of ``real.verify``: tensor-parallel MLP, Ulysses attention, a 2D (tp x dp) program.

Each program is compared with the same model computed on one device in
float64 (:func:`simcomm.parallel.tensor.mlp`, :func:`simcomm.parallel.sequence.attention`).
"""
from __future__ import annotations

from functools import partial

import torch

from simcomm.communicator import Communicator
from simcomm.parallel.sequence import attention, make_qkv, ulysses_attention
from simcomm.parallel.tensor import make_mlp, mlp, shard_mlp, tp_mlp

from .cases import Case, RankResult, on_cpu, smooth

__all__ = ["model_cases"]

_HIDDEN, _BATCH = 6, 3
_PARAM_NAMES = ("w1", "b1", "w2", "b2")


def _shard_grads(grads: dict[str, torch.Tensor], rank: int, world_size: int) -> list[torch.Tensor]:
    """Rank ``rank``'s part of full-model gradients, as :func:`simcomm.parallel.tensor.shard_mlp` shards."""
    shard = grads["w1"].shape[0] // world_size
    rows = slice(rank * shard, (rank + 1) * shard)
    return [grads["w1"][rows], grads["b1"][rows], grads["w2"][:, rows], grads["b2"]]


# -- tensor-parallel MLP -----------------------------------------------------------------

def _tp_program(conjugate: bool, comm: Communicator) -> RankResult:
    world_size, device = comm.world_size, comm.device
    params = make_mlp(_HIDDEN, 4 * world_size, seed=1)
    shards = {k: v.detach().to(device).requires_grad_() for k, v in shard_mlp(params, comm.rank, world_size).items()}
    x = smooth("tp/x", (_BATCH, _HIDDEN)).to(device).requires_grad_()        # replicated input
    out = tp_mlp(comm, x, shards, conjugate=conjugate)                          # (batch, hidden), replicated
    (out * smooth("tp/w", tuple(out.shape)).to(device)).sum().backward()
    grads = [shards[k].grad for k in _PARAM_NAMES]
    return on_cpu([out]), on_cpu(grads + ([x.grad] if conjugate else []))


def _tp_reference(conjugate: bool, world_size: int) -> list[RankResult]:
    params = {k: v.requires_grad_() for k, v in make_mlp(_HIDDEN, 4 * world_size, seed=1).items()}
    x = smooth("tp/x", (_BATCH, _HIDDEN)).requires_grad_()
    out = mlp(x, params)
    (out * smooth("tp/w", tuple(out.shape))).sum().backward()
    grads = {k: v.grad for k, v in params.items()}
    results = []
    for rank in range(world_size):
        shard = _shard_grads(grads, rank, world_size)
        if conjugate:          # every rank's loss is the one replicated loss
            results.append(([out.detach()], shard + [x.grad]))
        else:                  # the objective is the sum of world_size equal per-rank losses
            scaled = [g * world_size for g in shard[:3]] + [shard[3]]   # b2 is added after the all-reduce
            results.append(([out.detach()], scaled))
    return results


# -- Ulysses attention -------------------------------------------------------------------

def _qkv(world_size: int):
    return make_qkv(2, 2 * world_size, 2 * world_size, 4, seed=2)            # (b, s, h, d) each


def _seq_shard(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    shard = t.shape[1] // world_size
    return t[:, rank * shard:(rank + 1) * shard]                               # (b, s/P, h, d)


def _ulysses_program(causal: bool, comm: Communicator) -> RankResult:
    world_size, device = comm.world_size, comm.device
    q, k, v = (_seq_shard(t, comm.rank, world_size).to(device).requires_grad_() for t in _qkv(world_size))
    out = ulysses_attention(comm, q, k, v, causal=causal)                      # (b, s/P, h, d)
    weight = _seq_shard(smooth("ulysses/w", tuple(_qkv(world_size)[0].shape)), comm.rank, world_size)
    (out * weight.to(device)).sum().backward()
    return on_cpu([out]), on_cpu([q.grad, k.grad, v.grad])


def _ulysses_reference(causal: bool, world_size: int) -> list[RankResult]:
    q, k, v = (t.requires_grad_() for t in _qkv(world_size))
    out = attention(q, k, v, causal=causal)                                    # (b, s, h, d)
    (out * smooth("ulysses/w", tuple(out.shape))).sum().backward()
    return [([_seq_shard(out.detach(), r, world_size)],
             [_seq_shard(t.grad, r, world_size) for t in (q, k, v)]) for r in range(world_size)]


# -- 2D: tensor parallel inside data parallel --------------------------------------------

def _mesh(world_size: int) -> tuple[int, int]:
    """(tp, dp) sizes: tensor parallel over pairs when the world size is even."""
    tp = 2 if world_size % 2 == 0 else 1
    return tp, world_size // tp


def _mesh_program(comm: Communicator) -> RankResult:
    tp, dp = _mesh(comm.world_size)
    replica, tp_rank = divmod(comm.rank, tp)
    tp_comm = comm.subgroup([[d * tp + t for t in range(tp)] for d in range(dp)])   # [[0, 1], [2, 3]]
    dp_comm = comm.subgroup([[d * tp + t for d in range(dp)] for t in range(tp)])   # [[0, 2], [1, 3]]
    device = comm.device
    params = make_mlp(_HIDDEN, 4 * tp, seed=3)
    shards = {k: v.detach().to(device).requires_grad_() for k, v in shard_mlp(params, tp_rank, tp).items()}
    rows = slice(replica * _BATCH, (replica + 1) * _BATCH)
    x = smooth("mesh/x", (dp * _BATCH, _HIDDEN))[rows].to(device)                  # this replica's batch
    out = tp_mlp(tp_comm, x, shards)                                                 # (batch, hidden)
    (out * smooth("mesh/w", (dp * _BATCH, _HIDDEN))[rows].to(device)).sum().backward()
    grads = [dp_comm.all_reduce(shards[k].grad) for k in _PARAM_NAMES]            # sum over replicas
    return on_cpu([out]), on_cpu(grads)


def _mesh_reference(world_size: int) -> list[RankResult]:
    tp, dp = _mesh(world_size)
    params = {k: v.requires_grad_() for k, v in make_mlp(_HIDDEN, 4 * tp, seed=3).items()}
    x = smooth("mesh/x", (dp * _BATCH, _HIDDEN))
    out = mlp(x, params)                                                             # (dp*batch, hidden)
    (out * smooth("mesh/w", tuple(out.shape))).sum().backward()
    grads = {k: v.grad for k, v in params.items()}
    results = []
    for rank in range(world_size):
        replica, tp_rank = divmod(rank, tp)
        rows = slice(replica * _BATCH, (replica + 1) * _BATCH)
        results.append(([out.detach()[rows]], _shard_grads(grads, tp_rank, tp)))
    return results


def model_cases() -> list[Case]:
    return [
        Case("tp_mlp[replicated loss]", partial(_tp_program, True), partial(_tp_reference, True)),
        Case("tp_mlp[summed losses]", partial(_tp_program, False), partial(_tp_reference, False)),
        Case("ulysses_attention", partial(_ulysses_program, False), partial(_ulysses_reference, False)),
        Case("ulysses_attention[causal]", partial(_ulysses_program, True), partial(_ulysses_reference, True)),
        Case("2d_tp_x_dp[subgroups]", _mesh_program, _mesh_reference),
    ]
