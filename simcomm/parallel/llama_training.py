"""Training the small Llama on a data x pipeline x context x tensor mesh against one device, step by step.

The corpus (:func:`corpus`) is generated: sequences of a seeded first-order
Markov chain over the vocabulary, so there is something to learn and the loss
falls. Each data-parallel rank reads its share of each global batch through
``torch.utils.data.DistributedSampler`` (shuffled, the epoch set every pass);
the tensor-parallel ranks of a data-parallel rank read the same sequences.

The ranks form a 4-D mesh ``dp x pp x cp x tp`` (:class:`Layout`, this module's
own mapping, row-major as ``init_device_mesh`` numbers a ``(dp, pp, cp, tp)``
mesh, tensor innermost). One step on rank ``(d, p, c, t)``:

1. its sequences are the micro-batches of a 1F1B pipeline over the ``pp``
   stages (:func:`simcomm.parallel.llama_pipeline.stage_step`), each stage a
   tensor + sequence + vocabulary parallel part of the model over the ``tp``
   ranks, each sequence split over the ``cp`` context ranks; every loss
   ``/ global_batch``; backward inside the schedule;
2. gradients: under FSDP (``fsdp > 1``) the parameters are flat pieces over
   the shard group, all-gathered before each micro-batch's forward, and the
   all-gather's backward reduce-scatters the gradients into the pieces
   (:mod:`simcomm.parallel.llama_fsdp`); then an all-reduce over the
   replicate x context ranks (plain data parallelism: ``fsdp = 1``, all of
   ``dp x cp``; HSDP: the replicate dim of the 2-D ``(replicate, shard)``
   mesh); the replicated RMSNorm weights' parts are summed over the tensor
   group too;
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

from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.data import DistributedSampler

from ..communicator import Communicator
from . import llama, llama_fsdp, llama_pipeline

__all__ = ["Layout", "corpus", "batches", "train", "held_numel", "reference_losses"]


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


@dataclass(frozen=True)
class Layout:
    """The 4-D layout ``dp x pp x cp x tp`` (data, pipeline, context, tensor), ranks row-major as
    ``init_device_mesh("cpu", (dp, pp, cp, tp))`` numbers them (tensor innermost):
    ``rank = ((d * pp + p) * cp + c) * tp + t``. The data dimension is ``replicate x fsdp``
    (``d = d_replicate * fsdp + d_shard``): parameters and Adam's state are sharded over the
    ``fsdp`` ranks of a shard group (``fsdp = 1``: plain data parallelism; ``fsdp = dp``: FSDP;
    in between: HSDP on the 2-D ``(replicate, shard)`` mesh)."""

    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    fsdp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "cp", "tp", "fsdp"):
            if getattr(self, name) < 1:
                raise ValueError(f"llama_training.Layout: {name}={getattr(self, name)} must be >= 1")
        if self.dp % self.fsdp:
            raise ValueError(f"llama_training.Layout: dp={self.dp} is not divisible by fsdp={self.fsdp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """``(d, p, c, t)`` of ``rank``."""
        rest, t = divmod(rank, self.tp)
        rest, c = divmod(rest, self.cp)
        d, p = divmod(rest, self.pp)
        return d, p, c, t

    def rank(self, d: int, p: int, c: int, t: int) -> int:
        return ((d * self.pp + p) * self.cp + c) * self.tp + t

    def groups(self, vary: str) -> list[list[int]]:
        """The partition of the ranks into groups along the dimensions named in ``vary`` (letters of
        ``"rspct"``: replicate, shard, pipeline, context, tensor), each group in rank order."""
        sizes = {"r": self.dp // self.fsdp, "s": self.fsdp, "p": self.pp, "c": self.cp, "t": self.tp}
        out: dict[tuple, list[int]] = {}
        for rank in range(self.world_size):
            d, p, c, t = self.coords(rank)
            where = {"r": d // self.fsdp, "s": d % self.fsdp, "p": p, "c": c, "t": t}
            out.setdefault(tuple(where[k] for k in "rspct" if k not in vary), []).append(rank)
        assert all(len(g) == _prod(sizes[k] for k in vary) for g in out.values())
        return list(out.values())


def _prod(values) -> int:
    result = 1
    for v in values:
        result *= v
    return result


def train(comm: Communicator, data: torch.Tensor, params: dict[str, torch.Tensor], config: llama.Config, *,
          tp: int, steps: int, global_batch: int, cp: int = 1, pp: int = 1, fsdp: int = 1, lr: float = 1e-2,
          max_norm: float = 1.0, seed: int = 0, first_step: int = 0, load: str | None = None,
          save: str | None = None) -> dict:
    """``steps`` steps on ``comm.world_size = dp * pp * cp * tp`` ranks (:class:`Layout`; the module
    docstring). Each data-parallel rank's sequences are the micro-batches of a 1F1B pipeline of
    ``pp`` stages (:func:`simcomm.parallel.llama_pipeline.stage_step`; ``pp = 1`` is one stage);
    with ``cp > 1`` each sequence is split over the context group; with ``fsdp > 1`` the
    parameters are FSDP pieces (:mod:`simcomm.parallel.llama_fsdp`) gathered before every
    micro-batch's forward, their gradients reduce-scattered over the shard group, then
    all-reduced over the replicate x context ranks. Returns the global ``losses`` per step
    (float64, the same on every rank), this rank's final ``shards`` (its tensor shards of its
    stage's parameters, whole even under FSDP), its ``coords`` ``(d, p, c, t)`` and ``held``, the
    number of parameter elements it kept between steps (FSDP: its pieces, padding included; Adam
    keeps two moments of each).
    Collective over the world; blocks.

    Checkpoints (``torch.distributed.checkpoint``): ``save`` writes the tensor shards and Adam's
    state after the last step as DTensors on the ``(dp, cp, tp)`` sub-mesh of each stage (FSDP
    pieces are gathered first, so the checkpoint does not depend on ``fsdp`` or ``pp``); ``load``
    reads such a checkpoint, written on any layout, into this one before the first step (DCP
    reshards), and ``first_step`` says how many steps it holds, so the data continues where it
    stopped: the global batch of a step does not depend on the layout (``DistributedSampler``
    deals a global permutation out round-robin)."""
    if comm.world_size % (tp * cp * pp):
        raise ValueError(f"llama_training.train: rank {comm.rank}: world size {comm.world_size} is not "
                         f"divisible by pp * cp * tp = {pp} * {cp} * {tp}")
    layout = Layout(comm.world_size // (tp * cp * pp), pp, cp, tp, fsdp)
    d, p, c, t = layout.coords(comm.rank)
    tensor = comm.subgroup(layout.groups("t"))
    context = comm.subgroup(layout.groups("c"))
    pipe = comm.subgroup(layout.groups("p"))
    shard_group = comm.subgroup(layout.groups("s"))
    replicate = comm.subgroup(layout.groups("rc"))          # gradients all-reduced over these
    data_context = comm.subgroup(layout.groups("rsc"))      # the loss parts summed over these
    names = llama_pipeline.stage_names(config, p, pp)
    full = llama.shard_params(params, config, t, tp)
    shapes = {n: full[n].shape for n in names}
    leaves = {n: llama_fsdp.piece(full[n], d % fsdp, fsdp).requires_grad_() if fsdp > 1
              else full[n].clone().requires_grad_() for n in names}
    optimizer = torch.optim.Adam(leaves.values(), lr=lr)
    stage_params = (lambda: llama_fsdp.unshard(shard_group, leaves, shapes)) if fsdp > 1 else leaves
    mesh = _mesh(layout) if load or save else None
    if load:
        _load(load, mesh, leaves, optimizer, shapes, d % fsdp, fsdp)
    losses = []
    for indices in batches(data, first_step + steps, global_batch, layout.dp, d, seed)[first_step:]:
        optimizer.zero_grad()
        local = llama_pipeline.stage_step(pipe, tensor, [data[i] for i in indices.tolist()], stage_params, config,
                                          global_batch, context if cp > 1 else None)
        losses.append(pipe.all_reduce(data_context.all_reduce(local)))    # the last stage holds it
        with torch.no_grad():
            names = list(leaves)
            grads = dict(zip(names, llama_fsdp.all_reduce_bucket(replicate, [leaves[n].grad for n in names])))
            norms = [n for n in names if n.split(".")[-1] in llama.REPLICATED]   # and over the sequence shards
            grads.update(zip(norms, llama_fsdp.all_reduce_bucket(tensor, [grads[n] for n in norms])))
            sharded_sq = sum((grads[n].double().pow(2).sum() for n in names if n not in norms),
                             torch.zeros((), dtype=torch.float64))
            replicated_sq = sum((grads[n].double().pow(2).sum() for n in norms), torch.zeros((), dtype=torch.float64))
            for name in names:
                leaves[name].grad = grads[name]
            norm_sq = tensor.all_reduce(sharded_sq) + replicated_sq         # every tensor shard once
            norm_sq = pipe.all_reduce(shard_group.all_reduce(norm_sq))      # every FSDP piece, every stage
            coefficient = _clip_coefficient(norm_sq, max_norm)
            for leaf in leaves.values():
                leaf.grad.mul_(coefficient.to(leaf.grad.dtype))
        optimizer.step()
    if save:
        dcp.save(_state(mesh, leaves, optimizer, shard_group, shapes), checkpoint_id=save)
    shards = {n: llama_fsdp.gather_piece(shard_group, leaf, shapes[n]) if fsdp > 1 else leaf.detach()
              for n, leaf in leaves.items()}
    return {"losses": torch.stack(losses).double(), "shards": shards, "coords": (d, p, c, t),
            "held": sum(leaf.numel() for leaf in leaves.values())}


def held_numel(config: llama.Config, layout: Layout, rank: int) -> int:
    """The parameter elements ``rank`` keeps between steps on ``layout``, from the sizes alone: its
    stage's parameters (:func:`simcomm.parallel.llama_pipeline.stage_names`), each as its tensor
    shard (the norms whole), each cut into ``fsdp`` pieces padded up
    (:func:`simcomm.parallel.llama_fsdp.piece_numel`). Adam keeps two moments of each element."""
    _, p, _, t = layout.coords(rank)
    shapes = {name: param.shape for name, param in llama.init_params(config).items()}
    total = 0
    for name in llama_pipeline.stage_names(config, p, layout.pp):
        numel = _prod(shapes[name])
        numel //= 1 if name.split(".")[-1] in llama.REPLICATED else layout.tp
        total += llama_fsdp.piece_numel(numel, layout.fsdp)
    return total


def _mesh(layout: Layout):
    """This stage's ``(dp, cp, tp)`` sub-mesh of the 4-D mesh."""
    mesh = init_device_mesh("cpu", (layout.dp, layout.pp, layout.cp, layout.tp),
                            mesh_dim_names=("dp", "pp", "cp", "tp"))
    return mesh["dp", "cp", "tp"]


def _placement(name: str) -> list:
    kind = name.split(".")[-1]
    dim = 1 if kind in ("wo", "w_down") else None if kind in llama.REPLICATED else 0
    return [Replicate(), Replicate(), Replicate() if dim is None else Shard(dim)]


def _state(mesh, leaves: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, shard_group: Communicator,
           shapes: dict[str, torch.Size]) -> dict:
    """The checkpoint's state dict: DTensors of the tensor shards and of Adam's moments (FSDP pieces
    gathered), and Adam's step."""
    state = {}
    for name, leaf in leaves.items():
        moments = optimizer.state[leaf]
        for key, local in (("model", leaf.detach()), ("exp_avg", moments["exp_avg"]),
                           ("exp_avg_sq", moments["exp_avg_sq"])):
            whole = llama_fsdp.gather_piece(shard_group, local, shapes[name])
            state[f"{key}.{name}"] = DTensor.from_local(whole, mesh, _placement(name), run_check=False)
        state["step"] = moments["step"].clone()
    return state


def _load(path: str, mesh, leaves: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
          shapes: dict[str, torch.Size], shard: int, fsdp: int) -> None:
    state = {"step": torch.zeros((), dtype=torch.float32)}
    for name in leaves:
        for key in ("model", "exp_avg", "exp_avg_sq"):
            state[f"{key}.{name}"] = DTensor.from_local(torch.zeros(shapes[name], dtype=leaves[name].dtype),
                                                        mesh, _placement(name), run_check=False)
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
