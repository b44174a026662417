"""ZeRO data parallelism, stages 0 to 3: one Adam step of a small MLP on the communicator.

Every rank holds the same model and a different slice of the batch. What the
ranks keep of the *model states* (parameters, gradients, Adam's two moments)
is what the stages change (Rajbhandari et al., "ZeRO", 2020), for ``psi``
parameters on ``N`` ranks, fp32 everywhere:

=====  ==========================================  ============  ==========  ===============
stage  what it adds                                 parameters    gradients   optimizer state
=====  ==========================================  ============  ==========  ===============
0      plain data parallelism: all-reduce grads     4 psi         4 psi       8 psi
1      each rank updates only its shard             4 psi         4 psi       8 psi / N
2      + keep only the gradient shard               4 psi         4 psi / N   8 psi / N
3      + all-gather each layer's params just        4 psi / N     4 psi / N   8 psi / N
       before use (forward, and again in
       backward), free them after
=====  ==========================================  ============  ==========  ===============

Each layer's parameters live in one flat fp32 vector, zero-padded to a
multiple of the world size so that shard ``r`` (:func:`shard`) is simply chunk
``r``. Stages 0-2 move the same bytes per rank (an all-reduce's worth, ``2 psi``:
stage 0 all-reduces, stages 1-2 reduce-scatter gradients and all-gather
updated shards); stage 3 moves ``3 psi`` (parameters gathered twice). Every
stage computes the same update: single-device Adam on the whole
batch (``tests/parallel/test_zero.py`` checks it against ``torch.optim.Adam`` in
float64). The programs label their tensors (:mod:`simcomm.memory`) and mark
``"after step k"`` once each step's parameters are final, the gathered
parameters of stage 3 already freed: that is the *steady state* the table
describes.

Two stages have a second way, ``variant=``, as the systems that ship them do:

* stage 2, ``"in_backward"``: a gradient hook reduce-scatters each layer's
  gradient the moment backward has produced it and frees the full gradient
  (DeepSpeed's ZeRO-2 with one bucket per layer), so the full gradient of the
  whole model never exists at once. The default, ``"after_backward"``,
  reduce-scatters after the whole backward: its *peak* holds every full
  gradient, as stage 1 does.
* stage 3, ``"fsdp"``: FSDP's way. Forward all-gathers each layer and frees
  it after use; a saved-tensor hook keeps the layer's activations but not its
  gathered parameters, and re-gathers them when backward reaches the layer
  (FSDP's pre-backward all-gather); the all-gather's backward reduce-scatters
  the gradient into the shard (FSDP's post-backward reduce-scatter). The
  default, ``"checkpoint"``, recomputes each layer's forward in backward
  (``torch.utils.checkpoint``): the same collectives, no activations kept
  inside a layer, a second forward's compute.

>>> world = simcomm.World(4, memory=True)
>>> world.run(zero.train, stage=2, steps=2)
>>> world.memory.at("after step 2")[0]["optimizer_state"]     # 8 * psi / 4 bytes
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from .. import memory
from ..communicator import Communicator
from ..trace import backward_phase

__all__ = ["MLP", "Adam", "shard", "padded", "make_batch", "train", "step_stage", "STAGES", "VARIANTS",
           "expected_bytes"]

STAGES = (0, 1, 2, 3)
#: each stage's ways to run, the default first
VARIANTS = {0: ("plain",), 1: ("plain",), 2: ("after_backward", "in_backward"), 3: ("checkpoint", "fsdp")}


@dataclass(frozen=True)
class MLP:
    """A tanh MLP whose layer ``i`` is one flat vector: weight ``(out, in)`` row-major, then bias ``(out,)``."""

    sizes: tuple[int, ...] = (16, 64, 64, 8)

    @property
    def layer_numels(self) -> list[int]:
        return [fan_out * fan_in + fan_out for fan_in, fan_out in zip(self.sizes, self.sizes[1:])]

    @property
    def numel(self) -> int:
        """``psi``: the number of parameters."""
        return sum(self.layer_numels)

    def init(self, seed: int = 0) -> list[torch.Tensor]:
        """One flat fp32 vector per layer, uniform in ``+-1/sqrt(fan_in)``, from a generator of its own
        (the same values on every rank and backend, whatever the global random state)."""
        return list(self.init_layers(seed))

    def init_layers(self, seed: int = 0) -> Iterator[torch.Tensor]:
        """:meth:`init`'s vectors one at a time (a sharded model never holds them all at once)."""
        generator = torch.Generator().manual_seed(seed)
        for numel, fan_in in zip(self.layer_numels, self.sizes):
            yield (torch.rand(numel, generator=generator) * 2 - 1) / math.sqrt(fan_in)

    def apply_layer(self, i: int, x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """Layer ``i`` (and its tanh, except on the last layer) on ``x``, its parameters in ``flat``."""
        fan_in, fan_out = self.sizes[i], self.sizes[i + 1]
        weight, bias, _padding = flat.split([fan_out * fan_in, fan_out, flat.numel() - fan_out * fan_in - fan_out])
        weight = weight.view(fan_out, fan_in)                             # (out * in,) -> (out, in)
        x = x @ weight.T + bias                                           # (batch, out)
        return torch.tanh(x) if i < len(self.sizes) - 2 else x

    def forward(self, x: torch.Tensor, layer: Callable[[int], torch.Tensor], *,
                recompute: bool = False) -> torch.Tensor:
        """``layer(i)`` gives layer ``i``'s flat vector (possibly padded at the end).

        ``recompute``: each layer under ``torch.utils.checkpoint``: autograd keeps
        only the layer's input, and backward calls ``layer(i)`` again (ZeRO-3
        gathers the parameters a second time instead of holding them).
        """
        for i in range(len(self.sizes) - 1):
            if recompute:
                x = checkpoint(lambda x, i=i: self.apply_layer(i, x, layer(i)), x, use_reentrant=False)
            else:
                x = self.apply_layer(i, x, layer(i))
        return x

    def loss(self, x: torch.Tensor, y: torch.Tensor, global_batch: int,
             layer: Callable[[int], torch.Tensor], *, recompute: bool = False) -> torch.Tensor:
        """Squared error summed over this batch, divided by ``global_batch * outputs``: the ranks'
        losses add up to the mean squared error of the whole batch."""
        return ((self.forward(x, layer, recompute=recompute) - y) ** 2).sum() / (global_batch * self.sizes[-1])


def make_batch(mlp: MLP, batch_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``: ``(batch, in)`` inputs and ``(batch, out)`` targets from a generator of their own."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch_size, mlp.sizes[0], generator=generator),
            torch.randn(batch_size, mlp.sizes[-1], generator=generator))


def padded(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size``."""
    return -(-numel // world_size) * world_size


def shard(flat: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's chunk of a padded flat vector: a view, no copy."""
    return flat.view(comm.world_size, -1)[comm.rank]      # (N, numel/N) -> (numel/N,)


class Adam:
    """Adam (no weight decay) for one flat tensor or shard; its two moments are the optimizer state.

    ``update(param, grad)`` changes ``param`` in place (call it on a tensor that
    does not require grad, e.g. ``p.detach()``); ``grad`` is not modified.
    """

    def __init__(self, numel: int, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.lr, self.betas, self.eps, self.step = lr, betas, eps, 0
        with memory.label("optimizer_state"):
            self.exp_avg = torch.zeros(numel)
            self.exp_avg_sq = torch.zeros(numel)

    def update(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        beta1, beta2 = self.betas
        self.step += 1
        with torch.no_grad(), memory.label("optimizer_state"):
            self.exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
            self.exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (self.exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** self.step)).add_(self.eps)
            param.addcdiv_(self.exp_avg, denom, value=-self.lr / (1 - beta1 ** self.step))


def _backward(mlp: MLP, batch: tuple, layer: Callable[[int], torch.Tensor], recompute: bool = False) -> None:
    x, y, global_batch = batch
    with memory.label("activations"):
        loss = mlp.loss(x, y, global_batch, layer, recompute=recompute)
    with memory.label("gradients"):
        loss.backward()


# -- the four stages: one training step each ---------------------------------------------------
# params: stage 0-2 the full padded flat vector of each layer (leaves); stage 3 this rank's shard.
# opt: one Adam per layer, over what this rank updates. grads: stage 2's gradient shards.

def _step_stage0(comm, mlp, params, opt, grads, batch) -> None:
    _backward(mlp, batch, params.__getitem__)
    for p, adam in zip(params, opt):
        with memory.label("gradients"):
            p.grad = comm.all_reduce(p.grad)              # the whole batch's gradient, on every rank
        adam.update(p.detach(), p.grad)                   # every rank updates every parameter


def _step_stage1(comm, mlp, params, opt, grads, batch) -> None:
    _backward(mlp, batch, params.__getitem__)
    for p, adam in zip(params, opt):
        with memory.label("gradients"):                   # the full local gradient stays (4 psi)
            summed = comm.reduce_scatter(p.grad, dim=0)   # only my chunk of the sum: DP's volume
        mine = shard(p.detach(), comm)                    # this rank's 1/N of the parameters
        adam.update(mine, summed)                         # Adam's moments exist for that shard only
        del summed
        p.detach().copy_(comm.all_gather(mine, dim=0))    # every rank gets every updated shard


def _step_stage2(comm, mlp, params, opt, grads, batch) -> None:
    _backward(mlp, batch, params.__getitem__)
    for i, (p, adam) in enumerate(zip(params, opt)):
        with memory.label("gradients"):
            grads[i] = comm.reduce_scatter(p.grad, dim=0)  # summed over ranks, only my chunk kept
        p.grad = None                                      # the full gradient is freed
        mine = shard(p.detach(), comm)
        adam.update(mine, grads[i])
        p.detach().copy_(comm.all_gather(mine, dim=0))


def _step_stage3(comm, mlp, params, opt, grads, batch) -> None:
    def gathered(i: int) -> torch.Tensor:                 # layer i, just before it runs
        with memory.label("parameters"):
            return comm.all_gather(params[i], dim=0)      # backward: reduce-scatter into params[i].grad
    _backward(mlp, batch, gathered, recompute=True)       # freed after forward, gathered again in backward
    for p, adam in zip(params, opt):
        adam.update(p.detach(), p.grad)                   # shard, gradient shard, moments: all 1/N


def _step_stage2_in_backward(comm, mlp, params, opt, grads, batch) -> None:
    def reduce_now(i: int) -> Callable:
        def hook(p: torch.Tensor) -> None:               # layer i's gradient is final: reduce it now
            with memory.label("gradients"), backward_phase():
                grads[i] = comm.reduce_scatter(p.grad, dim=0)
            p.grad = None                                 # freed before the next layer's gradient exists
        return hook
    hooks = [p.register_post_accumulate_grad_hook(reduce_now(i)) for i, p in enumerate(params)]
    try:
        _backward(mlp, batch, params.__getitem__)
    finally:
        for hook in hooks:
            hook.remove()
    for i, (p, adam) in enumerate(zip(params, opt)):
        mine = shard(p.detach(), comm)
        adam.update(mine, grads[i])
        p.detach().copy_(comm.all_gather(mine, dim=0))


def _step_stage3_fsdp(comm, mlp, params, opt, grads, batch) -> None:
    alive: dict[int, tuple[int, weakref.ref]] = {}        # storage address -> (layer, gathered tensor)

    def gathered(i: int) -> torch.Tensor:                 # forward: layer i, just before it runs
        with memory.label("parameters"):
            full = comm.all_gather(params[i], dim=0)      # backward: reduce-scatter into params[i].grad
        alive[full.untyped_storage().data_ptr()] = (i, weakref.ref(full))
        return full

    def pack(saved: torch.Tensor):
        layer, ref = alive.get(saved.untyped_storage().data_ptr(), (None, None))
        if ref is None or ref() is None or ref().untyped_storage().data_ptr() != saved.untyped_storage().data_ptr():
            return saved                                  # an activation: kept until backward
        return layer, saved.size(), saved.stride(), saved.storage_offset()   # gathered parameters: not kept

    def unpack(saved):
        if isinstance(saved, torch.Tensor):
            return saved
        layer, size, stride, offset = saved
        with torch.no_grad(), backward_phase(), memory.label("parameters"):
            full = comm.all_gather(params[layer].detach(), dim=0)            # pre-backward re-gather
        return full.as_strided(size, stride, offset)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        _backward(mlp, batch, gathered)
    for p, adam in zip(params, opt):
        adam.update(p.detach(), p.grad)


_STEPS = {(0, "plain"): _step_stage0, (1, "plain"): _step_stage1, (2, "after_backward"): _step_stage2,
          (2, "in_backward"): _step_stage2_in_backward, (3, "checkpoint"): _step_stage3,
          (3, "fsdp"): _step_stage3_fsdp}


def step_stage(stage: int, variant: str | None = None) -> Callable:
    """The one-step function of ``stage`` (and ``variant``, :data:`VARIANTS`; ``None``: the default):
    ``step(comm, mlp, params, opt, grads, batch)``. Raises ``ValueError`` naming a stage or variant
    that does not exist."""
    if stage not in VARIANTS:
        raise ValueError(f"zero: stage={stage!r}; ZeRO stages are {list(STAGES)}")
    variant = VARIANTS[stage][0] if variant is None else variant
    if variant not in VARIANTS[stage]:
        raise ValueError(f"zero: variant={variant!r} for stage {stage}; use one of {list(VARIANTS[stage])}")
    return _STEPS[(stage, variant)]


def train(comm: Communicator, stage: int, mlp: MLP = MLP(), *, steps: int = 2, batch_size: int = 8,
          lr: float = 1e-2, seed: int = 0, variant: str | None = None,
          step: Callable | None = None) -> list[torch.Tensor]:
    """``steps`` Adam steps of ``mlp`` on the whole batch, data-parallel with ZeRO ``stage``.

    Rank ``r`` trains on rows ``r * batch_size / N ...`` of :func:`make_batch`
    (``batch_size`` must divide by the world size); ``variant``: one of
    ``VARIANTS[stage]`` (``None``: the default); ``step``: a one-step function with the signature of
    :func:`step_stage`'s to run instead (lesson 7 writes its own copies of the steps). Marks ``"after step k"``
    (:func:`simcomm.memory.mark`) after each step. Returns this rank's
    parameters, one flat fp32 vector per layer: the full padded vectors for
    stages 0-2, this rank's shards for stage 3 (``torch.cat`` over ranks and
    cut to each layer's size gives the model). Collective; blocks.
    """
    step = step_stage(stage, variant) if step is None else step
    world_size, rank = comm.world_size, comm.rank
    if batch_size % world_size:
        raise ValueError(f"zero.train: batch_size={batch_size} on rank {rank} is not divisible by "
                         f"the world size {world_size}")
    with memory.label("inputs"):
        x, y = make_batch(mlp, batch_size, seed + 1)
        rows = slice(rank * batch_size // world_size, (rank + 1) * batch_size // world_size)
        batch = (x[rows].clone(), y[rows].clone(), batch_size)
        del x, y
    with memory.label("parameters"):
        params = []
        for layer in mlp.init_layers(seed):              # one full layer at a time: no init-time peak
            full = torch.nn.functional.pad(layer, (0, padded(layer.numel(), world_size) - layer.numel()))
            del layer
            params.append(shard(full, comm).clone() if stage == 3 else full)
            del full
    params = [p.requires_grad_() for p in params]
    opt = [Adam(p.numel() // world_size if stage in (1, 2) else p.numel(), lr) for p in params]
    grads: list[torch.Tensor | None] = [None] * len(params)
    for k in range(1, steps + 1):
        for i, p in enumerate(params):
            p.grad = grads[i] = None          # last step's gradients are dropped before the next backward
        step(comm, mlp, params, opt, grads, batch)
        memory.mark(f"after step {k}")
    return [p.detach() for p in params]


def expected_bytes(stage: int, psi: int, world_size: int) -> dict[str, float]:
    """The ZeRO paper's fp32 bytes per rank of each model state for ``psi`` parameters."""
    step_stage(stage)
    n = world_size
    return {"parameters": 4 * psi / (n if stage >= 3 else 1),
            "gradients": 4 * psi / (n if stage >= 2 else 1),
            "optimizer_state": 8 * psi / (n if stage >= 1 else 1)}
