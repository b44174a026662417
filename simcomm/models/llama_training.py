"""Training the small Llama on a data x pipeline x context x tensor mesh against one device, step by step.

The corpus (:func:`corpus`) is generated: sequences of a seeded first-order
Markov chain over the vocabulary, so there is something to learn and the loss
falls. Each data-parallel rank reads its share of each global batch through
``torch.utils.data.DistributedSampler`` (shuffled, the epoch set every pass);
the tensor-parallel ranks of a data-parallel rank read the same sequences.

The ranks form the project's one mesh, a :class:`simcomm.parallel.mesh.Layout`
``Layout(pp=, dp_replicate=, dp_shard=, cp=, tp=)`` (or plain ``dp=``: no
sharding), numbered row-major as ``init_device_mesh`` numbers a ``("pp",
"dp_replicate", "dp_shard", "cp", "tp")`` mesh: pipeline outermost, tensor
innermost, the data dimension ``dp = dp_replicate x dp_shard`` as HSDP's 2-D
``(replicate, shard)`` mesh (``dp_shard = 1``: plain data parallelism;
``dp_replicate = 1``: FSDP; both > 1: HSDP). One step on the rank at ``(p, d,
c, t)`` (``d`` the flattened data-parallel index):

1. its sequences are the micro-batches of a 1F1B pipeline over the ``pp``
   stages (:func:`simcomm.models.llama_pipeline.stage_step`), each stage a
   tensor + sequence + vocabulary parallel part of the model over the ``tp``
   ranks, each sequence split over the ``cp`` context ranks; every loss
   ``/ global_batch``; backward inside the schedule;
2. gradients: under FSDP (``dp_shard > 1``) the parameters are flat pieces over
   the shard group, all-gathered before each micro-batch's forward, and the
   all-gather's backward reduce-scatters the gradients into the pieces
   (:mod:`simcomm.parallel.llama_fsdp`); then an all-reduce over the
   replicate x context ranks (``layout.groups("dp_replicate", "cp")``; plain
   data parallelism: all of ``dp x cp``); the replicated RMSNorm weights'
   parts are summed over the tensor group too;
3. **global gradient-norm clipping**: the squared norms of the tensor-sharded
   gradients all-reduced over the tensor group (the replicated ones counted
   once), then over the shard group (FSDP pieces) and the pipeline stages;
   ``clip = min(1, max_norm / (norm + 1e-6))`` as
   ``torch.nn.utils.clip_grad_norm_``;
4. ``torch.optim.Adam`` on what the rank holds (elementwise, so sharded Adam
   is Adam, and under FSDP its state is sharded too).

:func:`reference_losses` is the same training on one device without
communication; the test and lesson compare every step's loss.
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.data import DistributedSampler

from ..communicator import Communicator
from . import llama, llama_pipeline
from ..parallel import llama_fsdp, mesh

__all__ = ["corpus", "batches", "train", "grad_norm_sq", "save_checkpoint", "held_numel", "reference_losses"]


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
          layout: mesh.Layout, steps: int, global_batch: int, lr: float = 1e-2, max_norm: float = 1.0,
          seed: int = 0, first_step: int = 0, load: str | None = None, save: str | None = None) -> dict:
    """``steps`` steps on the ``comm.world_size == layout.world_size`` ranks of ``layout`` (a
    :class:`simcomm.parallel.mesh.Layout`; the module docstring). Each data-parallel rank's
    sequences are the micro-batches of a 1F1B pipeline of ``layout.pp`` stages
    (:func:`simcomm.models.llama_pipeline.stage_step`; ``pp = 1`` is one stage); with ``cp > 1``
    each sequence is split over the context group; with ``dp_shard > 1`` the parameters are FSDP
    pieces (:mod:`simcomm.parallel.llama_fsdp`) gathered before every micro-batch's forward, their
    gradients reduce-scattered over the shard group, then all-reduced over the replicate x context
    ranks. Returns the global ``losses`` per step (float64, the same on every rank), this rank's
    final ``shards`` (its tensor shards of its stage's parameters, whole even under FSDP), its
    ``coords`` ``{"pp": p, "dp": d, "cp": c, "tp": t}`` (``d`` the flattened data-parallel index)
    and ``held``, the number of parameter elements it kept between steps (FSDP: its pieces, padding
    included; Adam keeps two moments of each).
    Collective over the world; blocks.

    Checkpoints (``torch.distributed.checkpoint``): ``save`` writes the tensor shards and Adam's
    state after the last step as DTensors on the ``(dp_replicate, dp_shard, cp, tp)`` sub-mesh of
    each stage (FSDP pieces are gathered first, so the checkpoint does not depend on ``dp_shard``
    or ``pp``); ``load`` reads such a checkpoint, written on any layout, into this one before the
    first step (DCP reshards), and ``first_step`` says how many steps it holds, so the data
    continues where it stopped: the global batch of a step does not depend on the layout
    (``DistributedSampler`` deals a global permutation out round-robin)."""
    if not isinstance(layout, mesh.Layout):
        raise TypeError(f"llama_training.train: rank {comm.rank}: layout={layout!r} must be a "
                        "simcomm.parallel.mesh.Layout with its sizes by name, e.g. "
                        "Layout(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2)")
    if layout.world_size != comm.world_size:
        raise ValueError(f"llama_training.train: rank {comm.rank}: layout={layout!r} has {layout.world_size} "
                         f"ranks, the world {comm.world_size}")
    fsdp, shard = layout.dp_shard, layout.coordinate(comm.rank, "dp_shard")
    coords = {dim: layout.coordinate(comm.rank, dim) for dim in ("pp", "dp", "cp", "tp")}
    p, d, t = coords["pp"], coords["dp"], coords["tp"]
    tensor = comm.subgroup(layout.groups("tp"))
    context = comm.subgroup(layout.groups("cp"))
    pipe = comm.subgroup(layout.groups("pp"))
    shard_group = comm.subgroup(layout.groups("dp_shard"))
    replicate = comm.subgroup(layout.groups("dp_replicate", "cp"))   # gradients all-reduced over these
    data_context = comm.subgroup(layout.groups("dp", "cp"))          # the loss parts summed over these
    names = llama_pipeline.stage_names(config, p, layout.pp)
    full = llama.shard_params(params, config, t, layout.tp)
    shapes = {n: full[n].shape for n in names}
    leaves = {n: llama_fsdp.piece(full[n], shard, fsdp).requires_grad_() if fsdp > 1
              else full[n].clone().requires_grad_() for n in names}
    optimizer = torch.optim.Adam(leaves.values(), lr=lr)
    stage_params = (lambda: llama_fsdp.unshard(shard_group, leaves, shapes)) if fsdp > 1 else leaves
    if load:
        _load(load, _stage_mesh(layout), leaves, optimizer, shapes, shard, fsdp)
    losses = []
    for indices in batches(data, first_step + steps, global_batch, layout.dp, d, seed)[first_step:]:
        optimizer.zero_grad()
        local = llama_pipeline.stage_step(pipe, tensor, [data[i] for i in indices.tolist()], stage_params, config,
                                          global_batch, context if layout.cp > 1 else None)
        losses.append(pipe.all_reduce(data_context.all_reduce(local)))    # the last stage holds it
        with torch.no_grad():
            names = list(leaves)
            grads = dict(zip(names, llama_fsdp.all_reduce_bucket(replicate, [leaves[n].grad for n in names])))
            norms = [n for n in names if n.split(".")[-1] in llama.REPLICATED]   # and over the sequence shards
            grads.update(zip(norms, llama_fsdp.all_reduce_bucket(tensor, [grads[n] for n in norms])))
            for name in names:
                leaves[name].grad = grads[name]
            norm_sq = grad_norm_sq(tensor, shard_group, pipe, grads, norms)
            coefficient = _clip_coefficient(norm_sq, max_norm)
            for leaf in leaves.values():
                leaf.grad.mul_(coefficient.to(leaf.grad.dtype))
        optimizer.step()
    if save:
        save_checkpoint(save, layout, leaves, optimizer, shard_group, shapes)
    shards = {n: llama_fsdp.gather_piece(shard_group, leaf, shapes[n]) if fsdp > 1 else leaf.detach()
              for n, leaf in leaves.items()}
    return {"losses": torch.stack(losses).double(), "shards": shards, "coords": coords,
            "held": sum(leaf.numel() for leaf in leaves.values())}


def grad_norm_sq(tensor: Communicator, shard_group: Communicator, pipe: Communicator,
                 grads: dict[str, torch.Tensor], replicated: list[str]) -> torch.Tensor:
    """The squared norm of the whole model's gradient (float64, 0-d, the same on every rank) from this
    rank's ``grads`` (tensor shards, FSDP pieces of them, its stage's): the sharded squares summed over
    the tensor group, the ``replicated`` ones (whole on every tensor rank) counted once, then summed
    over the FSDP pieces and the pipeline stages. Collective over the three groups."""
    zero = torch.zeros((), dtype=torch.float64)
    sharded_sq = sum((g.double().pow(2).sum() for n, g in grads.items() if n not in replicated), zero)
    replicated_sq = sum((grads[n].double().pow(2).sum() for n in replicated), zero)
    norm_sq = tensor.all_reduce(sharded_sq) + replicated_sq         # every tensor shard once
    return pipe.all_reduce(shard_group.all_reduce(norm_sq))         # every FSDP piece, every stage


def save_checkpoint(path: str, layout: mesh.Layout, leaves: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
                    shard_group: Communicator, shapes: dict[str, torch.Size]) -> None:
    """Write this rank's part of a checkpoint that :func:`train` (``load=``) reads on any layout: its
    stage's tensor shards and Adam's state as DTensors on the stage's ``(dp_replicate, dp_shard, cp, tp)``
    sub-mesh (FSDP pieces, of the parameters ``shapes`` gives, gathered over ``shard_group`` first),
    with ``torch.distributed.checkpoint``. Collective over the world."""
    dcp.save(_state(_stage_mesh(layout), leaves, optimizer, shard_group, shapes), checkpoint_id=path)


def held_numel(config: llama.Config, layout: mesh.Layout, rank: int) -> int:
    """The parameter elements ``rank`` keeps between steps on ``layout``, from the sizes alone: its
    stage's parameters (:func:`simcomm.models.llama_pipeline.stage_names`), each as its tensor
    shard (the norms whole), each cut into ``layout.dp_shard`` pieces padded up
    (:func:`simcomm.parallel.llama_fsdp.piece_numel`). Adam keeps two moments of each element."""
    shapes = {name: param.shape for name, param in llama.init_params(config).items()}
    total = 0
    for name in llama_pipeline.stage_names(config, layout.coordinate(rank, "pp"), layout.pp):
        numel = shapes[name].numel()
        numel //= 1 if name.split(".")[-1] in llama.REPLICATED else layout.tp
        total += llama_fsdp.piece_numel(numel, layout.dp_shard)
    return total


_STAGE_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")


def _stage_mesh(layout: mesh.Layout):
    """This stage's ``(dp_replicate, dp_shard, cp, tp)`` sub-mesh of the 5-D mesh (every dimension
    present, size 1 or not, so a checkpoint's placements have one shape on every layout)."""
    full = mesh.Layout(pp=layout.pp, **{dim: layout.size(dim) for dim in _STAGE_DIMS})
    return full.device_mesh("cpu")[_STAGE_DIMS]


def _placement(name: str) -> list:
    kind = name.split(".")[-1]
    dim = 1 if kind in ("wo", "w_down") else None if kind in llama.REPLICATED else 0
    return [Replicate(), Replicate(), Replicate(), Replicate() if dim is None else Shard(dim)]


def _state(stage_mesh, leaves: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, shard_group: Communicator,
           shapes: dict[str, torch.Size]) -> dict:
    """The checkpoint's state dict: DTensors of the tensor shards and of Adam's moments (FSDP pieces
    gathered), and Adam's step."""
    state = {}
    for name, leaf in leaves.items():
        moments = optimizer.state[leaf]
        for key, local in (("model", leaf.detach()), ("exp_avg", moments["exp_avg"]),
                           ("exp_avg_sq", moments["exp_avg_sq"])):
            whole = llama_fsdp.gather_piece(shard_group, local, shapes[name])
            state[f"{key}.{name}"] = DTensor.from_local(whole, stage_mesh, _placement(name), run_check=False)
        state["step"] = moments["step"].clone()
    return state


def _load(path: str, stage_mesh, leaves: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
          shapes: dict[str, torch.Size], shard: int, fsdp: int) -> None:
    state = {"step": torch.zeros((), dtype=torch.float32)}
    for name in leaves:
        for key in ("model", "exp_avg", "exp_avg_sq"):
            state[f"{key}.{name}"] = DTensor.from_local(torch.zeros(shapes[name], dtype=leaves[name].dtype),
                                                        stage_mesh, _placement(name), run_check=False)
    dcp.load(state, checkpoint_id=path)
    with torch.no_grad():
        for name, leaf in leaves.items():
            mine = {key: llama_fsdp.piece(state[f"{key}.{name}"].to_local(), shard, fsdp)
                    for key in ("model", "exp_avg", "exp_avg_sq")}
            leaf.copy_(mine["model"].view(leaf.shape))
            optimizer.state[leaf] = {"step": state["step"].clone(), "exp_avg": mine["exp_avg"].view(leaf.shape),
                                     "exp_avg_sq": mine["exp_avg_sq"].view(leaf.shape)}


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
