"""Pipeline parallelism on the communicator: stages, microbatches, schedules and their bubbles.

The model (an MLP of :mod:`simcomm.parallel.data`) is cut into ``p`` stages,
one per rank, each holding consecutive layers. A batch is split into ``m``
microbatches. A stage runs a *schedule*: a list of actions ``("F", i)``
(forward of microbatch ``i``: receive the activation from the previous stage,
run its layers, send the output on) and ``("B", i)`` (backward: receive the
output's gradient from the next stage, backpropagate, send the input's
gradient back). The last stage computes the loss.

=========  ================================================  ====================
schedule   order on stage ``s``                              microbatches held
=========  ================================================  ====================
naive      F0 B0 F1 B1 ...: one microbatch in flight         1
gpipe      all forwards, then all backwards                  ``m``
1f1b       ``p-s-1`` forwards, then one F one B, then Bs     ``min(p - s, m)``
=========  ================================================  ====================

With forward time ``tf`` and backward ``tb`` per microbatch and stage, GPipe
and 1F1B both take ``(m + p - 1)(tf + tb)``: the *bubble* (idle share of the
stages' time) is ``(p-1)/(m+p-1)``; naive's is ``(p-1)/p``. :func:`bubble`
measures it from the modelled timeline of the program's own trace; the
program declares its compute (``comm.compute``) and sends with ``isend`` (so
two neighbours that both send first do not block each other), receives with
the blocking ``recv``.

Loss convention: the objective is the mean over the whole batch; microbatch
``i``'s loss is its summed squared error divided by the batch size, so the
microbatch losses add up to it and the gradients of one step are exactly the
unsplit model's.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .. import memory
from ..communicator import Communicator
from ..model.cost import modelled_timeline
from ..trace import Trace
from .data import make_model, sum_loss

__all__ = ["SCHEDULES", "PIPE_SIZES", "FORWARD_SECONDS", "schedule", "check_schedule", "held", "stage_layers",
           "pipeline_step", "torch_pipeline_step", "reference", "bubble", "bubble_formula", "interleaved_plan",
           "interleaved_step", "interleaved_bubble_formula"]

SCHEDULES = ("naive", "gpipe", "1f1b")
#: widths of the pipeline lessons' MLP: 4 linear layers, one per stage on 4 ranks
PIPE_SIZES = (16, 64, 64, 64, 8)
#: declared forward compute per microbatch and stage (seconds); backward is twice that
FORWARD_SECONDS = 1e-3


def schedule(name: str, stages: int, microbatches: int) -> list[list[tuple[str, int]]]:
    """The actions of every stage: ``result[s]`` is stage ``s``'s list of ``("F", i)`` / ``("B", i)``."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline.schedule: name={name!r}; schedules are {list(SCHEDULES)}")
    if stages < 1 or microbatches < 1:
        raise ValueError(f"pipeline.schedule: stages={stages} and microbatches={microbatches} must be >= 1")
    plans = []
    for stage in range(stages):
        if name == "naive":
            plan = [(kind, i) for i in range(microbatches) for kind in ("F", "B")]
        elif name == "gpipe":
            plan = [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
        else:
            warmup = min(stages - stage - 1, microbatches)
            plan = [("F", i) for i in range(warmup)]
            for i in range(microbatches - warmup):
                plan += [("F", warmup + i), ("B", i)]
            plan += [("B", i) for i in range(microbatches - warmup, microbatches)]
        plans.append(plan)
    return plans


def check_schedule(plans: Sequence[Sequence[tuple[str, int]]], microbatches: int) -> str | None:
    """Why ``plans`` cannot run as a pipeline, or None when it can.

    Each stage must do ``F i`` and ``B i`` once for every microbatch, ``F i``
    before ``B i``; and executed with blocking receives (each action waits for
    its input from the neighbour), every action must eventually run: no
    stage may wait forever.
    """
    stages = len(plans)
    want = sorted([("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)])
    for stage, plan in enumerate(plans):
        if not all(isinstance(a, (tuple, list)) and len(a) == 2 and a[0] in ("F", "B") and isinstance(a[1], int)
                   and not isinstance(a[1], bool) for a in plan):
            return f"stage {stage}: every action must be a pair like ('F', 0) or ('B', 0)"
        plan = [tuple(a) for a in plan]
        got = sorted(plan)
        if got != want:
            return f"stage {stage} must run F i and B i exactly once for i in 0..{microbatches - 1}"
        for i in range(microbatches):
            if plan.index(("B", i)) < plan.index(("F", i)):
                return f"stage {stage} runs B {i} before F {i}"
    plans = [[tuple(a) for a in plan] for plan in plans]
    done: set[tuple[str, int, int]] = set()
    cursor = [0] * stages
    progress = True
    while progress:
        progress = False
        for stage, plan in enumerate(plans):
            while cursor[stage] < len(plan):
                kind, i = plan[cursor[stage]]
                needs = ("F", i, stage - 1) if kind == "F" else ("B", i, stage + 1)
                if 0 <= needs[2] < stages and needs not in done:
                    break
                done.add((kind, i, stage))
                cursor[stage] += 1
                progress = True
    stuck = [s for s in range(stages) if cursor[s] < len(plans[s])]
    if stuck:
        s = stuck[0]
        return (f"deadlock: stage {s} waits forever at {plans[s][cursor[s]]} "
                f"(its neighbour never produces that input)")
    return None


def held(plan: Sequence[tuple[str, int]]) -> int:
    """The most microbatches whose activations a stage holds at once (forwarded, not yet backwarded)."""
    live = peak = 0
    for kind, _ in plan:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def stage_layers(model: nn.Sequential, stages: int, stage: int) -> nn.Sequential:
    """Stage ``stage``'s consecutive layers: the Linear layers are split evenly, each with the activation
    that follows it."""
    blocks: list[list[nn.Module]] = []
    for layer in model:
        if isinstance(layer, nn.Linear):
            blocks.append([layer])
        else:
            blocks[-1].append(layer)
    if len(blocks) % stages:
        raise ValueError(f"pipeline.stage_layers: {len(blocks)} linear layers do not split into {stages} stages")
    per = len(blocks) // stages
    return nn.Sequential(*[m for block in blocks[stage * per:(stage + 1) * per] for m in block])


def pipeline_step(comm: Communicator, x: torch.Tensor, y: torch.Tensor, plan_name_or_plans, microbatches: int,
                  sizes: Sequence[int] = PIPE_SIZES, forward_seconds: float = FORWARD_SECONDS) -> dict:
    """One training step of the pipeline on this rank (stage ``comm.rank`` of ``comm.world_size``).

    ``plan_name_or_plans``: a name of :data:`SCHEDULES`, or every stage's
    action list. Returns ``{"grads": this stage's parameter gradients,
    "loss": the summed microbatch losses (last stage; None elsewhere),
    "held": the most microbatches held at once, "activation_bytes": the most bytes this
    step held beyond what the rank held before it, measured after each forward (None when
    memory is not tracked)}``. Activations are counted as
    ``"activations"`` by :mod:`simcomm.memory` when the run tracks memory.
    Sends are ``isend`` (waited on at the end), receives block. Collective.
    """
    stages, stage = comm.world_size, comm.rank
    plans = (schedule(plan_name_or_plans, stages, microbatches) if isinstance(plan_name_or_plans, str)
             else plan_name_or_plans)
    layers = stage_layers(make_model(sizes), stages, stage)
    xs, ys = x.chunk(microbatches), y.chunk(microbatches)
    width_in = layers[0].in_features
    width_out = [m for m in layers if isinstance(m, nn.Linear)][-1].out_features
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    sends, loss_total, peak = [], None, 0
    for p in layers.parameters():
        p.grad = torch.zeros_like(p)          # allocated up front: backward accumulates into it
    baseline, peak_bytes = memory.current_bytes(), 0
    for kind, i in plans[stage]:
        rows = xs[i].shape[0]
        if kind == "F":
            with memory.label("activations"):
                if stage == 0:
                    inp = xs[i]
                else:
                    inp = comm.recv((rows, width_in), x.dtype, src=stage - 1).requires_grad_()
                out = layers(inp)
                comm.compute(seconds=forward_seconds)
                if stage == stages - 1:
                    out = sum_loss(nn.Identity(), out, ys[i]) / x.shape[0]
                    loss_total = out.detach() if loss_total is None else loss_total + out.detach()
                else:
                    sends.append(comm.isend(out.detach(), stage + 1))
            saved[i] = (inp, out)
            peak = max(peak, len(saved))
            if baseline is not None:
                peak_bytes = max(peak_bytes, memory.current_bytes() - baseline)
        else:
            inp, out = saved.pop(i)
            if stage == stages - 1:
                out.backward()
            else:
                out.backward(comm.recv((rows, width_out), x.dtype, src=stage + 1))
            comm.compute(seconds=2 * forward_seconds)
            if stage > 0:
                sends.append(comm.isend(inp.grad, stage - 1))
            del inp, out
        sends = _settle(sends)                # release what the neighbours already received
    for handle in sends:
        handle.wait()
    return {"grads": [p.grad.detach().clone() for p in layers.parameters()], "loss": loss_total, "held": peak,
            "activation_bytes": peak_bytes if baseline is not None else None}


def _settle(handles: list) -> list:
    """Wait on the completed handles (which then release their buffers); return the others."""
    pending = []
    for handle in handles:
        if handle.is_completed():
            handle.wait()
        else:
            pending.append(handle)
    return pending


def reference(x: torch.Tensor, y: torch.Tensor, stages: int, sizes: Sequence[int] = PIPE_SIZES
              ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
    """The unsplit model on one device in float64: the mean loss and every stage's parameter gradients."""
    model = make_model(sizes)
    loss = sum_loss(model, x.double(), y.double()) / x.shape[0]
    loss.backward()
    return loss.detach(), [[p.grad for p in stage_layers(model, stages, s).parameters()] for s in range(stages)]


def bubble(trace: Trace, preset: str = "h100-nvswitch") -> float:
    """The idle share of the stages' time, measured on the modelled timeline of ``trace``: one minus the
    compute time of every rank over (ranks x the time from 0 to the last compute's end)."""
    timeline = modelled_timeline(trace, preset)
    compute = [p for p in timeline if p.lane == "compute"]
    if not compute:
        raise ValueError("pipeline.bubble: the trace has no compute events (did the program call comm.compute?)")
    span = max(p.end for p in compute)
    ranks = {event.rank for event in trace.events}
    return 1.0 - sum(p.end - p.start for p in compute) / (len(ranks) * span)


def bubble_formula(name: str, stages: int, microbatches: int) -> float:
    """The textbook bubble: ``(p-1)/(m+p-1)`` for GPipe and 1F1B, ``(p-1)/p`` for naive."""
    schedule(name, stages, microbatches)
    if name == "naive":
        return (stages - 1) / stages
    return (stages - 1) / (microbatches + stages - 1)


def torch_pipeline_step(comm: Communicator, x: torch.Tensor, y: torch.Tensor, microbatches: int,
                        schedule_class: str = "ScheduleGPipe", sizes: Sequence[int] = PIPE_SIZES) -> dict:
    """The same step with ``torch.distributed.pipelining`` (``PipelineStage`` + ``schedule_class``) on the
    run's torch.distributed. Its loss function is :func:`simcomm.parallel.data.sum_loss`, divided by the
    batch size times ``microbatches`` (torch's schedules divide by the number of microbatches again), so the
    gradients are the unsplit model's. Returns ``{"grads", "loss"}`` like :func:`pipeline_step`. Collective."""
    from torch.distributed import pipelining

    stages, stage = comm.world_size, comm.rank
    layers = stage_layers(make_model(sizes), stages, stage)
    pipe_stage = pipelining.PipelineStage(layers, stage, stages, torch.device("cpu"))
    batch = x.shape[0]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).sum() * (microbatches / batch)

    runner = getattr(pipelining, schedule_class)(pipe_stage, n_microbatches=microbatches, loss_fn=loss_fn)
    losses: list[torch.Tensor] = []
    if stage == 0:
        runner.step(x)
    elif stage == stages - 1:
        runner.step(target=y, losses=losses)
    else:
        runner.step()
    loss = sum(loss.detach() for loss in losses) / microbatches if losses else None
    return {"grads": [p.grad.detach().clone() for p in layers.parameters()], "loss": loss}


# -- interleaved stages ----------------------------------------------------------------------------

def interleaved_plan(stages: int, microbatches: int, chunks: int) -> list[list[tuple[str, int, int]]]:
    """Breadth-first interleaved schedule: rank ``r`` holds ``chunks`` model chunks, the virtual stages
    ``r, r + p, r + 2p, ...``; it runs every microbatch's forward through its chunk 0, then chunk 1, ...,
    then the backwards in the reverse chunk order. ``result[r]`` lists ``(kind, microbatch, chunk)``."""
    if microbatches < stages:
        raise ValueError(f"pipeline.interleaved_plan: microbatches={microbatches} < stages={stages}: the "
                         f"wrap-around from the last rank to the first would stall")
    forwards = [("F", i, c) for c in range(chunks) for i in range(microbatches)]
    backwards = [("B", i, c) for c in reversed(range(chunks)) for i in range(microbatches)]
    return [forwards + backwards for _ in range(stages)]


def interleaved_bubble_formula(stages: int, microbatches: int, chunks: int) -> float:
    """``(p-1) / (v m + p - 1)``: each of the ``p - 1`` fill and drain slots is ``1/v`` as long."""
    return (stages - 1) / (chunks * microbatches + stages - 1)


def interleaved_step(comm: Communicator, x: torch.Tensor, y: torch.Tensor, microbatches: int, chunks: int,
                     sizes: Sequence[int], forward_seconds: float = FORWARD_SECONDS) -> dict:
    """One step of :func:`interleaved_plan` on this rank; ``sizes`` must have ``stages * chunks`` layers.

    Virtual stage ``k`` runs on rank ``k % p``; activations go to rank ``r + 1`` (the last rank sends
    to rank 0 for the next chunk), gradients to rank ``r - 1``. Each chunk declares ``1/chunks`` of a
    stage's compute. Returns ``{"grads": [chunk 0's gradients, chunk 1's, ...], "loss"}`` (loss: on
    the rank that holds the last virtual stage). Collective; blocks.
    """
    stages, rank = comm.world_size, comm.rank
    virtual = stages * chunks
    model = make_model(sizes)
    layers = [stage_layers(model, virtual, rank + c * stages) for c in range(chunks)]
    xs, ys = x.chunk(microbatches), y.chunk(microbatches)
    prev, nxt = (rank - 1) % stages, (rank + 1) % stages
    saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    sends, loss_total = [], None
    for kind, i, c in interleaved_plan(stages, microbatches, chunks)[rank]:
        k, rows = rank + c * stages, xs[i].shape[0]
        stage = layers[c]
        if kind == "F":
            inp = xs[i] if k == 0 else comm.recv((rows, stage[0].in_features), x.dtype, src=prev).requires_grad_()
            out = stage(inp)
            comm.compute(seconds=forward_seconds / chunks)
            if k == virtual - 1:
                out = sum_loss(nn.Identity(), out, ys[i]) / x.shape[0]
                loss_total = out.detach() if loss_total is None else loss_total + out.detach()
            else:
                sends.append(comm.isend(out.detach(), nxt))
            saved[(i, c)] = (inp, out)
        else:
            inp, out = saved.pop((i, c))
            if k == virtual - 1:
                out.backward()
            else:
                out.backward(comm.recv(tuple(out.shape), x.dtype, src=nxt))
            comm.compute(seconds=2 * forward_seconds / chunks)
            if k > 0:
                sends.append(comm.isend(inp.grad, prev))
    for handle in sends:                     # waited at the end: a wait on the model's timeline never stalls a chunk
        handle.wait()
    return {"grads": [[p.grad.detach().clone() for p in chunk.parameters()] for chunk in layers], "loss": loss_total}
