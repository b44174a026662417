"""Training the small Llama on a data x context x tensor mesh against one device, step by step.

The corpus (:func:`corpus`) is generated: sequences of a seeded first-order
Markov chain over the vocabulary, so there is something to learn and the loss
falls. Each data-parallel rank reads its share of each global batch through
``torch.utils.data.DistributedSampler`` (shuffled, the epoch set every pass);
the tensor-parallel ranks of a data-parallel rank read the same sequences.

One step on rank ``(d, t)`` (rank ``= d * tp + t``, tensor-innermost):

1. the loss of each of its sequences with :func:`simcomm.parallel.llama.tp_loss`,
   averaged over the global batch (``1 / global_batch`` each), backward;
2. gradients summed over the data-parallel group (all-reduce), and the
   replicated RMSNorm weights' parts summed over the tensor group too;
3. **global gradient-norm clipping**: the squared norms of the sharded
   gradients all-reduced over the tensor group (the replicated ones counted
   once), ``clip = min(1, max_norm / (norm + 1e-6))`` as
   ``torch.nn.utils.clip_grad_norm_``;
4. ``torch.optim.Adam`` on the shards (elementwise, so sharded Adam is Adam).

:func:`reference_losses` is the same training on one device without
communication; the test and lesson compare every step's loss.
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.data import DistributedSampler

from ..communicator import Communicator
from . import llama

__all__ = ["corpus", "batches", "train", "reference_losses"]


def corpus(config: llama.Config, sequences: int = 64, length: int = 17, seed: int = 0) -> torch.Tensor:
    """``(sequences, length)`` token ids from a seeded Markov chain (each token has 4 likely successors)."""
    gen = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, config.vocab, (config.vocab, 4), generator=gen)
    data = torch.empty(sequences, length, dtype=torch.int64)
    data[:, 0] = torch.randint(0, config.vocab, (sequences,), generator=gen)
    for position in range(1, length):
        choice = torch.randint(0, 4, (sequences,), generator=gen)
        data[:, position] = successors[data[:, position - 1], choice]
    return data


def batches(data: torch.Tensor, steps: int, global_batch: int, dp: int, rank: int, seed: int = 0) -> list[torch.Tensor]:
    """The sequence indices data-parallel rank ``rank`` of ``dp`` trains on at each step:
    ``DistributedSampler`` order, ``global_batch / dp`` per step, a new epoch when one runs out."""
    if global_batch % dp:
        raise ValueError(f"llama_training.batches: global_batch={global_batch} is not divisible by dp={dp}")
    sampler = DistributedSampler(range(data.shape[0]), num_replicas=dp, rank=rank, shuffle=True, seed=seed)
    per, out, epoch, order = global_batch // dp, [], 0, []
    while len(out) < steps:
        if len(order) < per:
            sampler.set_epoch(epoch)
            order, epoch = list(sampler), epoch + 1
        out.append(torch.tensor(order[:per]))
        order = order[per:]
    return out


def _clip_coefficient(norm_sq: torch.Tensor, max_norm: float) -> torch.Tensor:
    return torch.clamp(max_norm / (norm_sq.sqrt() + 1e-6), max=1.0)


def train(comm: Communicator, data: torch.Tensor, params: dict[str, torch.Tensor], config: llama.Config, *,
          tp: int, steps: int, global_batch: int, cp: int = 1, lr: float = 1e-2, max_norm: float = 1.0,
          seed: int = 0, first_step: int = 0, load: str | None = None, save: str | None = None) -> dict:
    """``steps`` steps on ``comm.world_size = dp * cp * tp`` ranks (module docstring; rank
    ``= (d * cp + c) * tp + t``; with ``cp > 1`` each sequence is split over the context group and
    the gradients are summed over the ``dp * cp`` ranks of a tensor rank). Returns the global
    ``losses`` per step (float64, the same on every rank) and this rank's final ``shards``.
    Collective over the world; blocks.

    Checkpoints (``torch.distributed.checkpoint``): ``save`` writes the shards and Adam's state
    after the last step as DTensors on the ``(dp, cp, tp)`` mesh; ``load`` reads such a checkpoint,
    written on any layout, into this one before the first step (DCP reshards), and ``first_step``
    says how many steps it holds, so the data continues where it stopped: the global batch of a
    step does not depend on the layout (``DistributedSampler`` deals a global permutation out
    round-robin)."""
    if comm.world_size % (tp * cp):
        raise ValueError(f"llama_training.train: rank {comm.rank}: world size {comm.world_size} is not "
                         f"divisible by tp * cp = {tp} * {cp}")
    dp = comm.world_size // (tp * cp)
    d, t = comm.rank // (tp * cp), comm.rank % tp
    rank_of = lambda dd, cc, tt: (dd * cp + cc) * tp + tt   # noqa: E731
    tensor = comm.subgroup([[rank_of(dd, cc, tt) for tt in range(tp)] for dd in range(dp) for cc in range(cp)])
    context = comm.subgroup([[rank_of(dd, cc, tt) for cc in range(cp)] for dd in range(dp) for tt in range(tp)])
    data_group = comm.subgroup([[rank_of(dd, cc, tt) for dd in range(dp) for cc in range(cp)] for tt in range(tp)])
    shards = {n: p.clone().requires_grad_() for n, p in llama.shard_params(params, config, t, tp).items()}
    optimizer = torch.optim.Adam(shards.values(), lr=lr)
    mesh = init_device_mesh("cpu", (dp, cp, tp)) if load or save else None
    if load:
        _load(load, mesh, shards, optimizer)
    losses = []
    for indices in batches(data, first_step + steps, global_batch, dp, d, seed)[first_step:]:
        optimizer.zero_grad()
        local = sum(llama.tp_loss(tensor, data[i], shards, config, context if cp > 1 else None)
                    for i in indices.tolist()) / global_batch
        local.backward()
        losses.append(data_group.all_reduce(local.detach()))
        norm_sq = torch.zeros((), dtype=torch.float64)
        replicated_sq = torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for name, p in shards.items():
                p.grad = data_group.all_reduce(p.grad)                       # over batch and context shards
                if name.split(".")[-1] in llama.REPLICATED:
                    p.grad = tensor.all_reduce(p.grad)                       # and over the sequence shards
                    replicated_sq = replicated_sq + p.grad.double().pow(2).sum()
                else:
                    norm_sq = norm_sq + p.grad.double().pow(2).sum()
            norm_sq = tensor.all_reduce(norm_sq) + replicated_sq            # every shard once
            coefficient = _clip_coefficient(norm_sq, max_norm)
            for p in shards.values():
                p.grad.mul_(coefficient.to(p.grad.dtype))
        optimizer.step()
    if save:
        dcp.save(_state(mesh, shards, optimizer), checkpoint_id=save)
    return {"losses": torch.stack(losses).double(), "shards": {n: p.detach() for n, p in shards.items()}}


def _placement(name: str) -> list:
    kind = name.split(".")[-1]
    dim = 1 if kind in ("wo", "w_down") else None if kind in llama.REPLICATED else 0
    return [Replicate(), Replicate(), Replicate() if dim is None else Shard(dim)]


def _state(mesh, shards: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> dict:
    """The checkpoint's state dict: DTensors of the shards and of Adam's moments, and Adam's step."""
    state = {}
    for name, p in shards.items():
        moments = optimizer.state[p]
        for key, local in (("model", p.detach()), ("exp_avg", moments["exp_avg"]),
                           ("exp_avg_sq", moments["exp_avg_sq"])):
            state[f"{key}.{name}"] = DTensor.from_local(local, mesh, _placement(name), run_check=False)
        state["step"] = moments["step"].clone()
    return state


def _load(path: str, mesh, shards: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer) -> None:
    for p in shards.values():                      # Adam's state, to be overwritten by the checkpoint
        optimizer.state[p] = {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    state = _state(mesh, shards, optimizer)
    dcp.load(state, checkpoint_id=path)
    with torch.no_grad():
        for name, p in shards.items():
            moments = optimizer.state[p]
            p.copy_(state[f"model.{name}"].to_local())
            moments["exp_avg"].copy_(state[f"exp_avg.{name}"].to_local())
            moments["exp_avg_sq"].copy_(state[f"exp_avg_sq.{name}"].to_local())
            moments["step"].copy_(state["step"])


def reference_losses(data: torch.Tensor, params: dict[str, torch.Tensor], config: llama.Config, *, dp: int,
                     steps: int, global_batch: int, lr: float = 1e-2, max_norm: float = 1.0,
                     seed: int = 0) -> torch.Tensor:
    """The oracle: the same steps on one device (the union of the ``dp`` ranks' sequences each step,
    ``torch.nn.utils.clip_grad_norm_``, ``torch.optim.Adam``); the loss of each step."""
    leaves = {n: p.clone().requires_grad_() for n, p in params.items()}
    optimizer = torch.optim.Adam(leaves.values(), lr=lr)
    per_rank = [batches(data, steps, global_batch, dp, rank, seed) for rank in range(dp)]
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        indices = torch.cat([per_rank[rank][step] for rank in range(dp)]).tolist()
        loss = sum(llama.loss(data[i], leaves, config) for i in indices) / global_batch
        loss.backward()
        torch.nn.utils.clip_grad_norm_(leaves.values(), max_norm)
        optimizer.step()
        losses.append(loss.detach().double())
    return torch.stack(losses)
