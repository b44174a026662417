"""Mixed-precision training as frameworks do it: 16-bit compute, fp32 master weights and Adam.

Each rank holds, for ``psi`` parameters on ``N`` data-parallel ranks:

* the **16-bit parameters** the forward and backward run with (bf16, or fp16
  with loss scaling): ``2 psi``;
* the **gradients**: 16-bit as autograd makes them (``2 psi``, the ZeRO
  paper's count), or an fp32 buffer every backward adds into (Megatron's and
  picotron's ``main_grad``: ``4 psi``), so that many micro-batches accumulate
  without 16-bit rounding;
* the **optimizer state**: fp32 master weights, Adam's two moments: ``12 psi``.

ZeRO shards them as :mod:`simcomm.parallel.zero` does for fp32 (the same
collectives, in the gradient's dtype): stage 1 the optimizer state
(``2 + 2 + 12/N``), stage 2 the gradients too (``2 + (2 + 12)/N``), stage 3
the 16-bit parameters too (``(2 + 2 + 12)/N``); :func:`expected_bytes` gives
every form. :func:`train` labels what it keeps (:mod:`simcomm.memory`) and
marks ``"after step k"``: the bytes measured per rank are these.

The step: forward and backward in the 16-bit dtype on this rank's rows of the
batch; the gradients summed over the ranks (all-reduce, or reduce-scatter for
stages >= 1); Adam on the fp32 master shard with the fp32 gradient; the
updated master cast to 16 bits (and all-gathered for stages 1 and 2).

**Loss scaling (fp16).** fp16 has 5 exponent bits: small gradients underflow
to zero. :class:`LossScaler` multiplies the loss by ``scale`` before backward
and divides the gradients by it after; if any rank's gradients hold an inf or
NaN (the all-reduce of a flag, MAX), every rank skips the step and halves the
scale; after ``growth_interval`` good steps the scale doubles (as
``torch.amp.GradScaler``). bf16 has fp32's exponent range and needs none.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import memory
from ..communicator import Communicator
from .zero import MLP, STAGES, Adam, make_batch, padded, shard

__all__ = ["GRADIENTS", "LossScaler", "any_overflow", "train", "expected_bytes", "reference_losses",
           "BF16_TOLERANCE"]

#: how gradients are kept: as autograd makes them (16-bit) or accumulated into an fp32 main_grad
GRADIENTS = ("16-bit", "fp32 main_grad")
#: the stated tolerance of a bf16 run's loss against fp32/float64: relative, 2 ** -6 (bf16 keeps 8
#: significant bits; a few steps of rounding in the forward, backward and reduction stay within 2 units)
BF16_TOLERANCE = 2.0 ** -6


@dataclass
class LossScaler:
    """Dynamic loss scale (fp16): ``scale`` halves on an overflow, doubles after ``growth_interval``
    steps without one. ``history`` holds ``(step, scale used, overflowed)`` per step."""

    scale: float = 2.0 ** 16
    growth_interval: int = 4
    good_steps: int = 0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"LossScaler: scale={self.scale!r} must be positive")
        self.history: list[tuple[int, float, bool]] = []

    def update(self, step: int, overflowed: bool) -> None:
        """Record ``step`` and move the scale: halve on overflow, double after enough good steps."""
        self.history.append((step, self.scale, overflowed))
        if overflowed:
            self.scale /= 2
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= 2
                self.good_steps = 0


def any_overflow(comm: Communicator, grads: list[torch.Tensor]) -> bool:
    """Whether any element of any rank's ``grads`` is inf or NaN: each rank's flag all-reduced with MAX,
    so every rank gets the same answer and skips (or applies) the step with the others. Collective."""
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    return bool(comm.all_reduce(torch.tensor([0.0 if finite else 1.0]), "max").item())


def _check(stage: int, gradients: str, dtype: torch.dtype, where: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"{where}: stage={stage!r}; ZeRO stages are {list(STAGES)}")
    if gradients not in GRADIENTS:
        raise ValueError(f"{where}: gradients={gradients!r} must be one of {list(GRADIENTS)}")
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{where}: dtype={dtype} must be torch.bfloat16 or torch.float16")


def expected_bytes(stage: int, psi: int, world_size: int, gradients: str = "16-bit") -> dict[str, float]:
    """Bytes per rank of each model state: 16-bit parameters, gradients (2 or 4 bytes), and the
    fp32 master weights with Adam's moments (``12 psi``), sharded as ZeRO ``stage`` shards them."""
    _check(stage, gradients, torch.bfloat16, "mixed_precision.expected_bytes")
    n = world_size
    grad = 2 if gradients == "16-bit" else 4
    return {"parameters": 2 * psi / (n if stage >= 3 else 1),
            "gradients": grad * psi / (n if stage >= 2 else 1),
            "optimizer_state": 12 * psi / (n if stage >= 1 else 1)}


def train(comm: Communicator, stage: int = 0, mlp: MLP = MLP(), *, steps: int = 3, batch_size: int = 8,
          lr: float = 1e-2, seed: int = 0, dtype: torch.dtype = torch.bfloat16, gradients: str = "16-bit",
          loss_scale: float | None = None, growth_interval: int = 4, micro_batches: int = 1) -> dict:
    """``steps`` mixed-precision Adam steps of ``mlp`` (module docstring), data-parallel with ZeRO
    ``stage`` over the whole world; rank ``r`` takes its rows of :func:`simcomm.parallel.zero.make_batch`.

    Returns ``losses`` (the whole batch's loss at each step, float64, the same on every rank:
    the ranks' parts all-reduced), ``master`` (this rank's fp32 master vectors: full for stage 0,
    shards otherwise) and, with a ``loss_scale``, the :class:`LossScaler`'s ``history`` (each rank
    keeps its own scaler, starting at ``loss_scale``; the overflow flag is all-reduced, so they
    agree). Marks ``"after step k"``. Collective; blocks. fp16 needs a ``loss_scale``.
    """
    _check(stage, gradients, dtype, "mixed_precision.train")
    if dtype == torch.float16 and loss_scale is None:
        raise ValueError(f"mixed_precision.train: rank {comm.rank}: dtype=torch.float16 needs loss_scale= "
                         f"(e.g. 2.0 ** 16): fp16 gradients underflow without loss scaling")
    scaler = None if loss_scale is None else LossScaler(loss_scale, growth_interval)
    world_size, rank = comm.world_size, comm.rank
    if batch_size % (world_size * micro_batches):
        raise ValueError(f"mixed_precision.train: batch_size={batch_size} on rank {rank} is not divisible "
                         f"by world size x micro_batches = {world_size} x {micro_batches}")
    with memory.label("inputs"):
        x, y = make_batch(mlp, batch_size, seed + 1)
        rows = slice(rank * batch_size // world_size, (rank + 1) * batch_size // world_size)
        x, y = x[rows].to(dtype), y[rows].clone()                          # (batch/N, in), (batch/N, out)
    full = [torch.nn.functional.pad(p, (0, padded(p.numel(), world_size) - p.numel())) for p in mlp.init(seed)]
    with memory.label("optimizer_state"):                                  # fp32 master weights
        master = [p.clone() if stage == 0 else shard(p, comm).clone() for p in full]
    with memory.label("parameters"):                                       # the 16-bit copies
        params = [(p if stage < 3 else shard(p, comm)).to(dtype).requires_grad_() for p in full]
    del full
    opt = [Adam(m.numel(), lr) for m in master]
    if stage == 3:
        def layer(i: int) -> torch.Tensor:
            with memory.label("parameters"):
                return comm.all_gather(params[i], dim=0)                  # backward: reduce-scatter (sum)
    else:
        layer = params.__getitem__
    losses = []
    for k in range(1, steps + 1):
        scale = scaler.scale if scaler is not None else 1.0
        kept, total = _backward(comm, mlp, layer, params, x, y, batch_size, micro_batches, gradients, scale, stage)
        mine = []                                                          # the summed gradient I update with
        for i in range(len(params)):
            with memory.label("gradients"):
                if stage == 0:
                    kept[i] = comm.all_reduce(kept[i])                     # the whole batch's gradient
                    mine.append(kept[i])
                elif stage == 1:
                    mine.append(comm.reduce_scatter(kept[i], dim=0))       # the full local buffer stays
                elif stage == 2:
                    kept[i] = comm.reduce_scatter(kept[i], dim=0)          # only my chunk of the sum stays
                    mine.append(kept[i])
                else:
                    mine.append(kept[i])                                   # stage 3: summed by the gather's backward
        overflowed = scaler is not None and any_overflow(comm, mine)
        if scaler is not None:
            scaler.update(k, overflowed)
        g = None
        if not overflowed:
            for p, m, adam, g in zip(params, master, opt, mine):
                adam.update(m, g.float() / scale)                          # fp32 update of the master
                with torch.no_grad():
                    p.copy_(m.to(dtype) if stage in (0, 3) else comm.all_gather(m.to(dtype), dim=0))
        del mine, g
        losses.append(total)
        memory.mark(f"after step {k}")
        del kept
    out = {"losses": torch.stack(losses), "master": [m.clone() for m in master]}
    if scaler is not None:
        out["history"] = list(scaler.history)
    return out


def _backward(comm, mlp, layer, params, x, y, batch_size, micro_batches, gradients, scale, stage):
    """Forward and backward of every micro-batch; returns this rank's accumulated gradients (16-bit
    as autograd accumulates them, or the fp32 main_grad buffers) and the batch's loss (all-reduced)."""
    kept: list = [None] * len(params)
    total = torch.zeros((), dtype=torch.float64)
    for xs, ys in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        with memory.label("activations"):
            loss = mlp.loss(xs, ys, batch_size, layer, recompute=stage == 3)   # fp32 from 16-bit outputs
        with memory.label("gradients"):
            (loss * scale).backward()
            if gradients == "fp32 main_grad":
                for i, p in enumerate(params):                             # main_grad += grad, in fp32
                    kept[i] = p.grad.float() if kept[i] is None else kept[i].add_(p.grad)
                    p.grad = None
        total = total + loss.detach().double()
    if gradients == "16-bit":
        kept = [p.grad for p in params]                                    # accumulated by autograd, 16-bit
        for p in params:
            p.grad = None
    return kept, comm.all_reduce(total)


def reference_losses(mlp: MLP = MLP(), *, steps: int = 3, batch_size: int = 8, lr: float = 1e-2, seed: int = 0,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The oracle: the same training on one device in ``dtype`` with ``torch.optim.Adam``;
    the loss before each step."""
    params = [p.to(dtype).requires_grad_() for p in mlp.init(seed)]
    x, y = make_batch(mlp, batch_size, seed + 1)
    x, y = x.to(dtype), y.to(dtype)
    opt = torch.optim.Adam(params, lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = mlp.loss(x, y, batch_size, params.__getitem__)
        loss.backward()
        opt.step()
        losses.append(loss.detach().double())
    return torch.stack(losses)
