"""Data parallelism on the communicator: replicate the model, shard the batch, average the gradients.

The objective of one training step is the mean squared error over the whole
(global) batch of ``B`` rows, ``L = sum_i l_i / B`` with ``l_i`` the summed
squared error of row ``i``. Rank ``r`` holds rows ``r*B/P ... (r+1)*B/P`` and a
full replica of the model. Two ways give every rank the gradient of ``L``:

* each rank's loss is the *mean* over its own rows (``local_sum / (B/P)``), and
  the gradients are all-reduced with ``ReduceOp.AVG``;
* each rank's loss is ``local_sum / B`` (the mean divided by ``P``), so the
  ranks' losses *add up* to ``L`` (lesson 02's sum-of-losses convention), and
  the gradients are all-reduced with ``ReduceOp.SUM``.

Mixing them (mean loss, SUM) gives ``P`` times the gradient.

:class:`BucketedReducer` is what DDP does on top: gradient hooks flatten
gradients into buckets in the order backward produces them and issue an
async all-reduce as soon as a bucket is full, so communication overlaps the
rest of the backward pass. It declares each parameter's backward compute
(``comm.compute``) so that :func:`simcomm.model.cost.modelled_timeline` can place it.

Every function here is a plain module-level function (the real backend's
workers import them) and nothing prints.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed import ReduceOp

from ..communicator import Communicator
from ..handles import Handle
from ..model.cost import modelled_timeline
from ..trace import Trace, backward_phase

__all__ = ["SIZES", "make_model", "make_data", "rows", "sum_loss", "reference_grads", "grads_of",
           "dp_grads", "accumulation_grads", "bucket_plan", "BucketedReducer", "bucketed_grads", "accumulated_bucketed_grads",
           "overlap_of", "ddp_grads", "BACKWARD_SECONDS_PER_PARAM", "PRESET"]

#: layer widths of the lessons' MLP (Linear + tanh between layers)
SIZES = (32, 256, 256, 256, 256, 8)
#: declared backward compute per parameter (seconds): an H100 doing ~100 TFLOP/s on a batch of ~2^15 tokens
BACKWARD_SECONDS_PER_PARAM = 5e-10
#: the topology the lessons' modelled timelines use
PRESET = "a100-hdr-cluster"


def make_model(sizes: Sequence[int] = SIZES, seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    """An MLP ``Linear, Tanh, ..., Linear`` with weights from a generator of its own: the same model on
    every rank and backend, whatever the global random state."""
    generator = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(zip(sizes, sizes[1:])):
        layer = nn.Linear(fan_in, fan_out, dtype=dtype)
        with torch.no_grad():
            bound = fan_in ** -0.5
            layer.weight.copy_((torch.rand(fan_out, fan_in, generator=generator, dtype=dtype) * 2 - 1) * bound)
            layer.bias.copy_((torch.rand(fan_out, generator=generator, dtype=dtype) * 2 - 1) * bound)
        layers.append(layer)
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def make_data(batch: int, sizes: Sequence[int] = SIZES, seed: int = 1,
              dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` of shapes ``(batch, sizes[0])`` and ``(batch, sizes[-1])``."""
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, sizes[0], generator=generator, dtype=dtype),
            torch.randn(batch, sizes[-1], generator=generator, dtype=dtype))


def rows(comm: Communicator, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """This rank's equal share of the rows of each tensor (views). Raises ``ValueError`` naming the rank
    when the rows do not divide by the world size."""
    out = []
    for index, tensor in enumerate(tensors):
        if tensor.shape[0] % comm.world_size:
            raise ValueError(f"data_parallel.rows: tensor {index} has {tensor.shape[0]} rows on rank {comm.rank},"
                             f" not divisible by the world size {comm.world_size}")
        out.append(tensor.chunk(comm.world_size)[comm.rank])
    return tuple(out)


def sum_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared error summed over the rows and outputs of ``x``."""
    return (model(x) - y).pow(2).sum()


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    """Detached copies of every parameter's ``.grad``, in ``parameters()`` order."""
    return [p.grad.detach().clone() for p in model.parameters()]


def reference_grads(x: torch.Tensor, y: torch.Tensor, sizes: Sequence[int] = SIZES, seed: int = 0) -> list[torch.Tensor]:
    """The single-device float64 gradient of the mean loss ``sum_loss / len(x)`` over the whole batch."""
    model = make_model(sizes, seed)
    (sum_loss(model, x.double(), y.double()) / x.shape[0]).backward()
    return grads_of(model)


def dp_grads(comm: Communicator, x: torch.Tensor, y: torch.Tensor, mode: str = "avg",
             sizes: Sequence[int] = SIZES) -> list[torch.Tensor]:
    """One data-parallel backward; returns this rank's gradients after the all-reduce.

    ``mode``: ``"avg"`` (local mean loss, AVG all-reduce), ``"scaled"`` (loss
    ``local_sum / B``, SUM all-reduce) or ``"sum"`` (local mean loss, SUM: the
    bug that multiplies the gradient by the world size). Collective; blocks.
    """
    if mode not in ("avg", "scaled", "sum"):
        raise ValueError(f"dp_grads: mode={mode!r} on rank {comm.rank}; use 'avg', 'scaled' or 'sum'")
    model = make_model(sizes)
    xs, ys = rows(comm, x, y)
    divide = x.shape[0] if mode == "scaled" else xs.shape[0]
    (sum_loss(model, xs, ys) / divide).backward()
    op = ReduceOp.AVG if mode == "avg" else ReduceOp.SUM
    return [comm.all_reduce(p.grad, op) for p in model.parameters()]


def accumulation_grads(comm: Communicator, x: torch.Tensor, y: torch.Tensor, microbatches: int,
                       sizes: Sequence[int] = SIZES) -> list[torch.Tensor]:
    """Gradient accumulation: ``microbatches`` backward passes on slices of this rank's rows, gradients
    summed locally in ``.grad`` (no communication), then one AVG all-reduce per parameter for the step.
    Returns the averaged gradients. Collective; blocks."""
    model = make_model(sizes)
    xs, ys = rows(comm, x, y)
    if xs.shape[0] % microbatches:
        raise ValueError(f"accumulation_grads: {xs.shape[0]} rows on rank {comm.rank} do not divide into "
                         f"microbatches={microbatches}")
    for xm, ym in zip(xs.chunk(microbatches), ys.chunk(microbatches)):
        (sum_loss(model, xm, ym) / xs.shape[0]).backward()     # .grad accumulates: the local mean's gradient
    return [comm.all_reduce(p.grad, ReduceOp.AVG) for p in model.parameters()]


def bucket_plan(numels: Sequence[int], itemsize: int, bucket_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket, in backward order (last parameter first): a bucket is closed as soon
    as it holds at least ``bucket_bytes``. ``bucket_bytes <= 0`` or above the model: one bucket."""
    order = list(range(len(numels)))[::-1]
    if bucket_bytes <= 0:
        return [order]
    plan, current, size = [], [], 0
    for index in order:
        current.append(index)
        size += numels[index] * itemsize
        if size >= bucket_bytes:
            plan.append(current)
            current, size = [], 0
    if current:
        plan.append(current)
    return plan


class BucketedReducer:
    """Average a model's gradients over the group, a bucket at a time, while backward still runs.

    A gradient hook on every parameter (``register_post_accumulate_grad_hook``)
    first declares that parameter's backward compute (``comm.compute``,
    ``seconds_per_param`` times its size), then marks it ready; when every
    parameter of a bucket is ready, the bucket's gradients are flattened into
    one buffer and an ``all_reduce(..., async_op=True)`` is issued (traced as a
    backward-phase call). After ``loss.backward()``, :meth:`finish` waits on
    every handle and writes the summed gradients back into ``.grad`` (in
    place). Gradients must come from a loss whose sum over ranks is the
    objective (SUM all-reduce).

    Gradient accumulation: run every micro-batch's backward but the last inside
    ``with reducer.no_sync():`` (DDP's ``no_sync``). Autograd then only adds
    into ``.grad`` and nothing is communicated; the last backward, outside the
    block, all-reduces the accumulated gradients once per bucket. A second
    synchronising backward before :meth:`finish` raises ``RuntimeError`` (as
    DDP does): its buckets would mix two backward passes.
    """

    def __init__(self, comm: Communicator, model: nn.Module, bucket_bytes: int,
                 seconds_per_param: float = BACKWARD_SECONDS_PER_PARAM):
        self.comm, self.params = comm, list(model.parameters())
        itemsize = self.params[0].element_size()
        self.plan = bucket_plan([p.numel() for p in self.params], itemsize, bucket_bytes)
        self.bucket_of = {index: b for b, bucket in enumerate(self.plan) for index in bucket}
        self.ready = [0] * len(self.plan)
        self.handles: list[tuple[int, Handle]] = []
        self.seconds_per_param = seconds_per_param
        self.sync = True
        for index, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, index=index: self._ready(index))

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside this block backward only accumulates into ``.grad`` (no collective is issued)."""
        previous, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = previous

    def _ready(self, index: int) -> None:
        self.comm.compute(seconds=self.params[index].numel() * self.seconds_per_param)
        if not self.sync:
            return
        bucket = self.bucket_of[index]
        if self.ready[bucket] == len(self.plan[bucket]):
            raise RuntimeError(
                f"BucketedReducer: parameter {index} on rank {self.comm.rank} got a second synchronising "
                "gradient before finish(): call finish() after every synchronising backward, and run the "
                "backward of every micro-batch but the last inside reducer.no_sync()")
        self.ready[bucket] += 1
        if self.ready[bucket] == len(self.plan[bucket]):
            flat = torch.cat([self.params[i].grad.reshape(-1) for i in self.plan[bucket]])   # (bucket numel,)
            with backward_phase():
                self.handles.append((bucket, self.comm.all_reduce(flat, async_op=True)))

    def finish(self) -> None:
        """Wait for every bucket; write the summed gradients into ``.grad``. Blocks.
        Raises ``RuntimeError`` if a bucket was only partly ready (some parameter got no gradient)."""
        partial = [b for b, count in enumerate(self.ready) if 0 < count < len(self.plan[b])]
        for bucket, handle in self.handles:
            flat = handle.wait()
            for i, piece in zip(self.plan[bucket], flat.split([self.params[i].numel() for i in self.plan[bucket]])):
                self.params[i].grad.copy_(piece.view_as(self.params[i].grad))
        self.handles, self.ready = [], [0] * len(self.plan)
        if partial:
            raise RuntimeError(f"BucketedReducer.finish on rank {self.comm.rank}: buckets {partial} were only "
                               "partly ready: some parameters got no gradient in the last backward")


def bucketed_grads(comm: Communicator, x: torch.Tensor, y: torch.Tensor, bucket_bytes: int,
                   sizes: Sequence[int] = SIZES) -> list[torch.Tensor]:
    """One data-parallel backward with :class:`BucketedReducer`; returns the averaged gradients."""
    model = make_model(sizes)
    reducer = BucketedReducer(comm, model, bucket_bytes)
    xs, ys = rows(comm, x, y)
    comm.compute(seconds=sum(p.numel() for p in reducer.params) * reducer.seconds_per_param / 2)  # forward
    (sum_loss(model, xs, ys) / x.shape[0]).backward()
    reducer.finish()
    return grads_of(model)


def accumulated_bucketed_grads(comm: Communicator, x: torch.Tensor, y: torch.Tensor, microbatches: int,
                               bucket_bytes: int, sizes: Sequence[int] = SIZES) -> list[torch.Tensor]:
    """Gradient accumulation with :class:`BucketedReducer`: this rank's rows in ``microbatches`` slices,
    every backward but the last inside ``reducer.no_sync()``, each loss ``sum_loss / len(x)`` so that the
    losses of all micro-batches and ranks add up to the whole batch's mean. Returns the synchronised
    gradients (the whole batch's, on every rank). Collective; blocks."""
    model = make_model(sizes)
    reducer = BucketedReducer(comm, model, bucket_bytes)
    xs, ys = rows(comm, x, y)
    if xs.shape[0] % microbatches:
        raise ValueError(f"accumulated_bucketed_grads: {xs.shape[0]} rows on rank {comm.rank} do not divide "
                         f"into microbatches={microbatches}")
    pieces = list(zip(xs.chunk(microbatches), ys.chunk(microbatches)))
    with reducer.no_sync():
        for xm, ym in pieces[:-1]:
            (sum_loss(model, xm, ym) / x.shape[0]).backward()      # only adds into .grad
    (sum_loss(model, *pieces[-1]) / x.shape[0]).backward()         # all-reduces the accumulated buckets
    reducer.finish()
    return grads_of(model)


def overlap_of(trace: Trace, preset: str = PRESET, rank: int = 0) -> dict[str, float]:
    """Rank ``rank``'s modelled ``compute``, ``communication``, ``exposed``, ``hidden`` and ``end``
    (seconds) on ``preset``: :func:`simcomm.model.cost.modelled_timeline` of the trace."""
    summary = modelled_timeline(trace, preset).ranks[rank]
    return {"compute": summary.compute, "communication": summary.communication, "exposed": summary.exposed,
            "hidden": summary.hidden, "end": summary.end}


def ddp_grads(comm: Communicator, x: torch.Tensor, y: torch.Tensor, bucket_cap_mb: float = 25.0,
              sizes: Sequence[int] = SIZES) -> list[torch.Tensor]:
    """One backward of :func:`make_model` wrapped in PyTorch's ``DistributedDataParallel`` (on the run's
    torch.distributed: virtual ranks or real processes); each rank's loss is the mean over its rows and
    DDP averages the gradients. Returns this rank's gradients. Collective; blocks."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(make_model(sizes), bucket_cap_mb=bucket_cap_mb)
    xs, ys = rows(comm, x, y)
    (sum_loss(model, xs, ys) / xs.shape[0]).backward()
    return grads_of(model)
