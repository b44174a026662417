"""ZeRO-3 / FSDP forward with and without prefetching, and FSDP2 ``fully_shard`` on the same MLP.

:func:`zero3_forward` runs the forward pass of a :class:`simcomm.parallel.zero.MLP`
whose layers are sharded over the group: before layer ``i`` runs, its
parameters are all-gathered (``async_op=True``); each layer declares its
compute (``comm.compute``), so the modelled timeline
(:func:`simcomm.model.cost.modelled_timeline`) shows what waits for what. Without
prefetching, layer ``i``'s all-gather is issued when layer ``i`` is about to
run, so the program waits for every gather. With prefetching, layer ``i+1``'s
gather is issued *before* layer ``i``'s compute, so it moves while layer ``i``
computes: only the first gather is exposed.

:func:`fsdp2_grads` is the same model as ``torch.nn`` layers, each wrapped in
``torch.distributed.fsdp.fully_shard``, trained one backward on the
configured backend's torch.distributed (virtual ranks or real processes).
"""
from __future__ import annotations

import torch

from ..communicator import Communicator
from .zero import MLP, padded, shard

__all__ = ["LAYER_SECONDS", "zero3_forward", "reference_forward", "fsdp2_grads", "reference_grads", "adam_reference",
           "assemble"]

#: declared compute per layer in the prefetch demo (seconds)
LAYER_SECONDS = 20e-6


def _shards(comm: Communicator, mlp: MLP, seed: int) -> list[torch.Tensor]:
    return [shard(torch.nn.functional.pad(p, (0, padded(p.numel(), comm.world_size) - p.numel())), comm).clone()
            for p in mlp.init(seed)]


def zero3_forward(comm: Communicator, x: torch.Tensor, mlp: MLP = MLP(), *, prefetch: bool,
                  layer_seconds: float = LAYER_SECONDS, seed: int = 0) -> torch.Tensor:
    """The forward of ``mlp`` on ``x`` with each layer's parameters sharded over the group and
    all-gathered just in time (``prefetch=False``) or one layer ahead (``prefetch=True``).
    Returns the output (no autograd). Collective; blocks."""
    params = _shards(comm, mlp, seed)
    layers = len(params)
    handles = {0: comm.all_gather(params[0], dim=0, async_op=True)}
    with torch.no_grad():
        for i in range(layers):
            if not prefetch and i not in handles:
                handles[i] = comm.all_gather(params[i], dim=0, async_op=True)
            full = handles.pop(i).wait()                      # (padded numel,): the whole layer
            if prefetch and i + 1 < layers:
                handles[i + 1] = comm.all_gather(params[i + 1], dim=0, async_op=True)
            comm.compute(seconds=layer_seconds)
            x = mlp.apply_layer(i, x, full)
            del full                                          # freed after use
    return x


def reference_forward(x: torch.Tensor, mlp: MLP = MLP(), seed: int = 0) -> torch.Tensor:
    """The unsharded forward on one device in float64."""
    params = [p.double() for p in mlp.init(seed)]
    return mlp.forward(x.double(), params.__getitem__)


def _module(mlp: MLP, seed: int, dtype: torch.dtype) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for i, flat in enumerate(mlp.init(seed)):
        fan_in, fan_out = mlp.sizes[i], mlp.sizes[i + 1]
        linear = torch.nn.Linear(fan_in, fan_out, dtype=dtype)
        weight, bias = flat.split([fan_out * fan_in, fan_out])
        with torch.no_grad():
            linear.weight.copy_(weight.view(fan_out, fan_in))            # (out * in,) -> (out, in)
            linear.bias.copy_(bias)
        layers.append(linear)
        if i < len(mlp.sizes) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def reference_grads(x: torch.Tensor, y: torch.Tensor, mlp: MLP = MLP(), seed: int = 0) -> list[torch.Tensor]:
    """Single-device float64 gradients of the mean squared error over the whole batch."""
    model = _module(mlp, seed, torch.float64)
    ((model(x.double()) - y.double()) ** 2).sum().div(x.shape[0] * mlp.sizes[-1]).backward()
    return [p.grad for p in model.parameters()]


def fsdp2_grads(comm: Communicator, x: torch.Tensor, y: torch.Tensor, mlp: MLP = MLP(),
                seed: int = 0) -> list[torch.Tensor]:
    """One backward of ``mlp`` with FSDP2: every Linear and the whole model under ``fully_shard``.
    Each rank uses its rows of the batch; FSDP averages the gradients over ranks. Returns the full
    (unsharded) gradients, float64. Collective; blocks."""
    from torch.distributed.fsdp import fully_shard

    model = _module(mlp, seed, torch.float64)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    xs, ys = x.chunk(comm.world_size)[comm.rank], y.chunk(comm.world_size)[comm.rank]
    ((model(xs) - ys) ** 2).sum().div(xs.shape[0] * mlp.sizes[-1]).backward()
    return [p.grad.full_tensor().detach() for p in model.parameters()]


def adam_reference(mlp: MLP, steps: int, batch_size: int = 8, lr: float = 1e-2, seed: int = 0) -> list[torch.Tensor]:
    """``steps`` of ``torch.optim.Adam`` on the whole batch of :func:`simcomm.parallel.zero.make_batch`, float64, one
    device: each layer's parameters as one flat vector (weight row-major, then bias), as ``zero.train`` keeps
    them (unpadded)."""
    from .zero import make_batch

    model = _module(mlp, seed, torch.float64)
    x, y = (t.double() for t in make_batch(mlp, batch_size, seed + 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    return [torch.cat([m.weight.detach().flatten(), m.bias.detach()]) for m in linears]


def assemble(stage: int, outs: list[list[torch.Tensor]], mlp: MLP) -> list[torch.Tensor]:
    """The whole model from ``zero.train``'s per-rank results: stage 3's shards concatenated over ranks;
    every layer cut to its size (padding dropped)."""
    layers = [torch.cat(shards) for shards in zip(*outs)] if stage == 3 else outs[0]
    return [flat[:numel] for flat, numel in zip(layers, mlp.layer_numels)]
