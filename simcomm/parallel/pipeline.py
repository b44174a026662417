"""Pipeline parallelism on the communicator: stages, microbatches, schedules and their bubbles.

The model (an MLP of :mod:`simcomm.parallel.data`) is cut into ``p`` stages,
one per rank, each holding consecutive layers. A batch is split into ``m``
microbatches. A stage runs a *schedule*: a list of actions ``("F", i)``
(forward of microbatch ``i``: receive the activation from the previous stage,
run its layers, send the output on) and ``("B", i)`` (backward: receive the
output's gradient from the next stage, backpropagate, send the input's
gradient back). The last stage computes the loss. A zero-bubble schedule
splits the backward in two: ``("B", i)`` computes only the gradients of the
stage's input and of its layers' outputs (what the previous stage waits for) and
sends the input's gradient at once; ``("W", i)`` computes the weights'
gradients from them later, with no message, wherever the stage would idle.

=========  ================================================  ====================
schedule   order on stage ``s``                              microbatches held
=========  ================================================  ====================
naive      F0 B0 F1 B1 ...: one microbatch in flight         1
gpipe      all forwards, then all backwards                  ``m``
1f1b       ``p-s-1`` forwards, then one F one B, then Bs     ``min(p - s, m)``
zb-h1      1F1B's F and B order; W ``i`` runs ``s`` Bs       ``min(p, m)``
           after B ``i``, the rest fill the drain
=========  ================================================  ====================

With forward time ``tf`` and backward ``tb`` per microbatch and stage, GPipe
and 1F1B both take ``(m + p - 1)(tf + tb)``: the *bubble* (idle share of the
stages' time) is ``(p-1)/(m+p-1)``; naive's is ``(p-1)/p``. ZB-H1 (Qi et al.,
"Zero Bubble Pipeline Parallelism", 2023, arXiv:2401.10241, its handcrafted
schedule ZB-H1) keeps
1F1B's peak memory (``p`` microbatches on stage 0) and shrinks the bubble from
``(p-1)(tF + tB + tW)`` to ``(p-1)(tF + tB - tW)``; with the backward split into
``tB = tW = tf`` that is ``(p-1)/(3m+p-1)`` of the time for ``m >= p``. :func:`bubble`
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

__all__ = ["SCHEDULES", "ZERO_BUBBLE", "ALL_SCHEDULES", "PIPE_SIZES", "FORWARD_SECONDS", "schedule", "check_schedule",
           "held", "makespan", "stage_layers",
           "pipeline_step", "torch_pipeline_step", "reference", "bubble", "bubble_formula", "interleaved_plan",
           "interleaved_step", "interleaved_bubble_formula", "TORCH_MULTISTAGE", "torch_stage_ids",
           "torch_multistage_step"]

SCHEDULES = ("naive", "gpipe", "1f1b")
#: the zero-bubble schedule: 1F1B with each backward split into B (input gradient) and W (weight gradient)
ZERO_BUBBLE = "zb-h1"
ALL_SCHEDULES = SCHEDULES + (ZERO_BUBBLE,)
#: widths of the pipeline lessons' MLP: 4 linear layers, one per stage on 4 ranks
PIPE_SIZES = (16, 64, 64, 64, 8)
#: declared forward compute per microbatch and stage (seconds); backward is twice that
FORWARD_SECONDS = 1e-3


def schedule(name: str, stages: int, microbatches: int) -> list[list[tuple[str, int]]]:
    """The actions of every stage: ``result[s]`` is stage ``s``'s list of ``("F", i)`` / ``("B", i)``
    (and ``("W", i)`` for :data:`ZERO_BUBBLE`)."""
    if name not in ALL_SCHEDULES:
        raise ValueError(f"pipeline.schedule: name={name!r}; schedules are {list(ALL_SCHEDULES)}")
    if stages < 1 or microbatches < 1:
        raise ValueError(f"pipeline.schedule: stages={stages} and microbatches={microbatches} must be >= 1")
    plans = []
    for stage in range(stages):
        if name == "naive":
            plan = [(kind, i) for i in range(microbatches) for kind in ("F", "B")]
        elif name == "gpipe":
            plan = [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
        elif name == ZERO_BUBBLE:
            plan = _zero_bubble_h1(stage, stages, microbatches)
        else:
            warmup = min(stages - stage - 1, microbatches)
            plan = [("F", i) for i in range(warmup)]
            for i in range(microbatches - warmup):
                plan += [("F", warmup + i), ("B", i)]
            plan += [("B", i) for i in range(microbatches - warmup, microbatches)]
        plans.append(plan)
    return plans


def _zero_bubble_h1(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """ZB-H1 on ``stage``: 1F1B's forwards and input-gradient backwards, each W ``stage`` Bs late.

    Stage ``s`` of 1F1B holds ``p - s`` microbatches; holding each W back by ``s`` backwards lets every
    stage hold ``p`` (stage 0's count, so the peak does not grow) and moves ``s`` weight-gradient
    passes into the drain, where 1F1B's stage ``s`` idles while the last backwards reach stage 0."""
    warmup = min(stages - stage - 1, microbatches)
    plan: list[tuple[str, int]] = [("F", i) for i in range(warmup)]
    weights = iter(range(microbatches))
    for j in range(microbatches):
        if warmup + j < microbatches:
            plan.append(("F", warmup + j))
        plan.append(("B", j))
        if j >= stage:
            plan.append(("W", next(weights)))
    return plan + [("W", i) for i in weights]


def _dependency(kind: str, microbatch: int, stage: int) -> tuple[str, int, int]:
    """The action an action waits for: F the previous stage's F, B the next stage's B, W its own B."""
    return {"F": ("F", microbatch, stage - 1), "B": ("B", microbatch, stage + 1),
            "W": ("B", microbatch, stage)}[kind]


def _walk(plans: Sequence[Sequence[tuple[str, int]]], seconds: Sequence[dict[str, float]]
          ) -> tuple[list[int], list[float]]:
    """Run every stage's plan in order, each action once its input exists: ``(cursor, clock)``, how far
    each stage got (a stage short of its plan's end waits forever) and when it finished its last action.
    ``seconds[stage]`` maps ``"F"``, ``"B"``, ``"W"`` to their durations on that stage."""
    stages = len(plans)
    done: dict[tuple[str, int, int], float] = {}
    cursor, clock = [0] * stages, [0.0] * stages
    progress = True
    while progress:
        progress = False
        for stage, plan in enumerate(plans):
            while cursor[stage] < len(plan):
                kind, i = plan[cursor[stage]]
                needs = _dependency(kind, i, stage)
                if 0 <= needs[2] < stages and needs not in done:
                    break
                start = max(clock[stage], done.get(needs, 0.0))
                clock[stage] = done[(kind, i, stage)] = start + seconds[stage][kind]
                cursor[stage] += 1
                progress = True
    return cursor, clock


def _splits_backward(plan: Sequence[tuple[str, int]]) -> bool:
    return any(action[0] == "W" for action in plan)


def check_schedule(plans: Sequence[Sequence[tuple[str, int]]], microbatches: int) -> str | None:
    """Why ``plans`` cannot run as a pipeline, or None when it can.

    Each stage must do ``F i`` and ``B i`` once for every microbatch, ``F i``
    before ``B i``; a stage that splits its backward (any ``("W", i)``) does
    ``W i`` once for every microbatch too, after ``B i``. Executed with
    blocking receives (each action waits for its input from the neighbour;
    ``W`` only for its own ``B``), every action must eventually run: no stage
    may wait forever.
    """
    for stage, plan in enumerate(plans):
        if not all(isinstance(a, (tuple, list)) and len(a) == 2 and a[0] in ("F", "B", "W")
                   and isinstance(a[1], int) and not isinstance(a[1], bool) for a in plan):
            return f"stage {stage}: every action must be a pair like ('F', 0), ('B', 0) or ('W', 0)"
        plan = [tuple(a) for a in plan]
        kinds = ("F", "B", "W") if _splits_backward(plan) else ("F", "B")
        want = sorted((kind, i) for kind in kinds for i in range(microbatches))
        if sorted(plan) != want:
            return (f"stage {stage} must run {', '.join(f'{kind} i' for kind in kinds)} exactly once for i in "
                    f"0..{microbatches - 1}")
        for i in range(microbatches):
            for first, then in zip(kinds, kinds[1:]):
                if plan.index((then, i)) < plan.index((first, i)):
                    return f"stage {stage} runs {then} {i} before {first} {i}"
    plans = [[tuple(a) for a in plan] for plan in plans]
    cursor, _ = _walk(plans, [{"F": 1.0, "B": 1.0, "W": 1.0}] * len(plans))
    stuck = [s for s in range(len(plans)) if cursor[s] < len(plans[s])]
    if stuck:
        s = stuck[0]
        return (f"deadlock: stage {s} waits forever at {plans[s][cursor[s]]} "
                f"(its neighbour never produces that input)")
    return None


def held(plan: Sequence[tuple[str, int]]) -> int:
    """The most microbatches whose activations a stage holds at once: forwarded, and not yet through
    their backward (their ``W`` when the plan splits the backward: the weight gradient needs the inputs)."""
    release = "W" if _splits_backward(plan) else "B"
    live = peak = 0
    for kind, _ in plan:
        live += 1 if kind == "F" else -1 if kind == release else 0
        peak = max(peak, live)
    return peak


def makespan(plans: Sequence[Sequence[tuple[str, int]]], forward: float = 1.0, backward: float = 2.0) -> float:
    """When the last stage finishes ``plans`` (which must pass :func:`check_schedule`), with blocking
    dependencies and no communication time: ``F`` takes ``forward``, ``B`` ``backward``; on a stage that
    splits its backward, ``B`` and ``W`` take half of ``backward`` each."""
    problem = check_schedule(plans, max((i for plan in plans for _, i in plan), default=-1) + 1)
    if problem:
        raise ValueError(f"pipeline.makespan: {problem}")
    seconds = [{"F": forward, "B": backward / 2 if _splits_backward(plan) else backward, "W": backward / 2}
               for plan in plans]
    return max(_walk([[tuple(a) for a in plan] for plan in plans], seconds)[1], default=0.0)


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

    ``plan_name_or_plans``: a name of ``ALL_SCHEDULES``, or every stage's
    action list. Returns ``{"grads": this stage's parameter gradients,
    "loss": the summed microbatch losses (last stage; None elsewhere),
    "held": the most microbatches held at once, "activation_bytes": the most bytes this
    step held beyond what the rank held before it, measured after each action (None when
    memory is not tracked)}``. Activations are counted as
    ``"activations"`` by :mod:`simcomm.memory` when the run tracks memory.
    Sends are ``isend`` (waited on at the end), receives block. Collective.

    A forward declares ``forward_seconds`` of compute, a backward twice that. Where the stage's plan
    splits the backward, ``B`` computes the gradients of the stage's input (sent on at once) and of
    every Linear layer's output, and ``W`` the weights' gradients from those (``dW = dz^T a``,
    ``db = sum dz``, by autograd on the Linear alone); each declares ``forward_seconds``.
    """
    stages, stage = comm.world_size, comm.rank
    plans = (schedule(plan_name_or_plans, stages, microbatches) if isinstance(plan_name_or_plans, str)
             else plan_name_or_plans)
    split = _splits_backward(plans[stage])
    layers = stage_layers(make_model(sizes), stages, stage)
    linears = [m for m in layers if isinstance(m, nn.Linear)]
    xs, ys = x.chunk(microbatches), y.chunk(microbatches)
    width_in, width_out = linears[0].in_features, linears[-1].out_features
    saved: dict[int, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = {}
    output_grads: dict[int, tuple[torch.Tensor, ...]] = {}      # B's gradients of the Linears' outputs, for W
    sends, loss_total, peak = _Sends(plans), None, 0
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
                    sends.received(stage - 1, ("F", i))
                out, linear_outputs = _forward(layers, inp)
                comm.compute(seconds=forward_seconds)
                if stage == stages - 1:
                    out = sum_loss(nn.Identity(), out, ys[i]) / x.shape[0]
                    loss_total = out.detach() if loss_total is None else loss_total + out.detach()
                else:
                    sends.sent(comm.isend(out.detach(), stage + 1), stage + 1, ("F", i))
            saved[i] = (inp, out, linear_outputs)
            peak = max(peak, len(saved))
        elif kind == "B":
            inp, out, linear_outputs = saved[i] if split else saved.pop(i)
            grad_out = None
            if stage < stages - 1:
                grad_out = comm.recv((rows, width_out), x.dtype, src=stage + 1)
                sends.received(stage + 1, ("B", i))
            if split:                         # input and layer-output gradients only; the graph stays for W
                wanted = ([inp] if stage > 0 else []) + linear_outputs
                grads = torch.autograd.grad(out, wanted, grad_out, retain_graph=True)
                output_grads[i] = grads[len(wanted) - len(linear_outputs):]
                input_grad = grads[0] if stage > 0 else None
                del grads
            else:
                out.backward(grad_out)
                input_grad = inp.grad if stage > 0 else None
            comm.compute(seconds=(1 if split else 2) * forward_seconds)
            if stage > 0:
                sends.sent(comm.isend(input_grad, stage - 1), stage - 1, ("B", i))
            del inp, out, linear_outputs, input_grad
        else:                                 # W: each Linear's weight gradient from its output's gradient
            _, _, linear_outputs = saved.pop(i)
            for linear, z, dz in zip(linears, linear_outputs, output_grads.pop(i), strict=True):
                weight_grads = torch.autograd.grad(z, list(linear.parameters()), dz)
                for param, grad in zip(linear.parameters(), weight_grads, strict=True):
                    param.grad += grad
                del weight_grads, grad            # parameter-sized temporaries: not held between actions
            comm.compute(seconds=forward_seconds)
            del linear_outputs
        if baseline is not None:
            peak_bytes = max(peak_bytes, memory.current_bytes() - baseline)
    sends.wait_all()
    return {"grads": [p.grad.detach().clone() for p in layers.parameters()], "loss": loss_total, "held": peak,
            "activation_bytes": peak_bytes if baseline is not None else None}


def _forward(layers: nn.Sequential, inp: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The stage's output and the output of each of its Linear layers (what a split backward's W needs)."""
    outputs, hidden = [], inp
    for module in layers:
        hidden = module(hidden)
        if isinstance(module, nn.Linear):
            outputs.append(hidden)
    return hidden, outputs


class _Sends:
    """The step's ``isend`` handles, each waited on (releasing its buffer) as soon as that cannot stall.

    A send to a neighbour is waited on once this rank has received a message the neighbour sent *after*
    the action that received ours: the neighbour then has it, and the wait returns at once, on real
    workers and on the modelled timeline alike. (Waiting on whatever ``is_completed()`` says would
    depend on thread timing and put waits on the modelled timeline where a GPU would not stall.)"""

    def __init__(self, plans: Sequence[Sequence[tuple[str, int]]]):
        self.position = [{tuple(action): index for index, action in enumerate(plan)} for plan in plans]
        self.pending: list[tuple[object, int, int]] = []         # (handle, peer, peer's action that receives it)

    def sent(self, handle, peer: int, action: tuple[str, int]) -> None:
        self.pending.append((handle, peer, self.position[peer][action]))

    def received(self, peer: int, action: tuple[str, int]) -> None:
        """This rank received the message ``peer`` sent at its ``action``: wait on what it had received."""
        sent_at = self.position[peer][action]
        keep = []
        for handle, to, received_at in self.pending:
            if to == peer and received_at < sent_at:
                handle.wait()
            else:
                keep.append((handle, to, received_at))
        self.pending = keep

    def wait_all(self) -> None:
        for handle, _, _ in self.pending:
            handle.wait()
        self.pending = []


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
    """The textbook bubble as a share of the total time: ``(p-1)/(m+p-1)`` for GPipe and 1F1B,
    ``(p-1)/p`` for naive, and for ZB-H1 ``(p-1)(tF+tB-tW) / (m(tF+tB+tW) + (p-1)(tF+tB-tW))``
    (Qi et al. 2023, ZB-H1) with this module's ``tF = tB = tW``: ``(p-1)/(3m+p-1)``. ZB-H1's
    formula needs ``m >= p`` (with fewer microbatches the Ws cannot fill the drain): ``ValueError``
    otherwise."""
    schedule(name, stages, microbatches)
    if name == "naive":
        return (stages - 1) / stages
    if name == ZERO_BUBBLE:
        if microbatches < stages:
            raise ValueError(f"pipeline.bubble_formula: {ZERO_BUBBLE}'s bubble formula needs microbatches >= "
                             f"stages; got microbatches={microbatches}, stages={stages}")
        t_f = t_b = t_w = 1.0
        idle = (stages - 1) * (t_f + t_b - t_w)
        return idle / (microbatches * (t_f + t_b + t_w) + idle)
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


# -- torch.distributed.pipelining with several stages per rank -----------------------------------------

#: torch's schedules with several stages per rank, and how they place the stages (see :func:`torch_stage_ids`)
TORCH_MULTISTAGE = {"ScheduleInterleaved1F1B": "loop", "ScheduleInterleavedZeroBubble": "loop",
                    "ScheduleZBVZeroBubble": "v"}


def torch_stage_ids(schedule_class: str, rank: int, stages: int, chunks: int) -> list[int]:
    """The virtual stages rank ``rank`` holds: ``r, r + p, r + 2p, ...`` for the looped schedules,
    ``r`` and ``2p - 1 - r`` for ZBV's V shape (two chunks: the model goes down the ranks and back up)."""
    if schedule_class not in TORCH_MULTISTAGE:
        raise ValueError(f"pipeline.torch_stage_ids: schedule_class={schedule_class!r}; multi-stage schedules "
                         f"are {list(TORCH_MULTISTAGE)}")
    if TORCH_MULTISTAGE[schedule_class] == "v":
        if chunks != 2:
            raise ValueError(f"pipeline.torch_stage_ids: {schedule_class} places 2 chunks per rank; got "
                             f"chunks={chunks}")
        return [rank, 2 * stages - 1 - rank]
    return [rank + c * stages for c in range(chunks)]


def torch_multistage_step(comm: Communicator, x: torch.Tensor, y: torch.Tensor, microbatches: int, chunks: int,
                          sizes: Sequence[int], schedule_class: str = "ScheduleInterleavedZeroBubble") -> dict:
    """One step of a ``torch.distributed.pipelining`` schedule with ``chunks`` stages per rank
    (:data:`TORCH_MULTISTAGE`: interleaved 1F1B, and torch's zero-bubble schedules, which split each
    backward into its input and weight halves as :data:`ZERO_BUBBLE` does) on the run's torch.distributed.
    ``sizes`` must have ``stages * chunks`` layers; the loss is :func:`torch_pipeline_step`'s. Returns
    ``{"stage_ids": the virtual stages of this rank, "grads": their parameter gradients, "loss": on the
    rank holding the last stage (None elsewhere)}``. Collective."""
    from torch.distributed import pipelining

    stages, rank = comm.world_size, comm.rank
    virtual = stages * chunks
    ids = torch_stage_ids(schedule_class, rank, stages, chunks)
    model = make_model(sizes)
    modules = [stage_layers(model, virtual, k) for k in ids]
    pipe_stages = [pipelining.PipelineStage(m, k, virtual, torch.device("cpu")) for m, k in zip(modules, ids)]
    batch = x.shape[0]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).sum() * (microbatches / batch)

    runner = getattr(pipelining, schedule_class)(pipe_stages, n_microbatches=microbatches, loss_fn=loss_fn)
    losses: list[torch.Tensor] = []
    inputs = (x,) if 0 in ids else ()
    if virtual - 1 in ids:
        runner.step(*inputs, target=y, losses=losses)
    else:
        runner.step(*inputs)
    loss = sum(loss.detach() for loss in losses) / microbatches if losses else None
    return {"stage_ids": ids, "grads": [[p.grad.detach().clone() for p in m.parameters()] for m in modules],
            "loss": loss}
