# ---
# jupyter:
#   jupytext:
#     formats: ipynb,sources//py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Lesson 8: pipeline parallelism
#
# **Goal:** cut a model into 4 stages on 4 ranks that pass activations forward and gradients
# backward with send/recv, run the naive, GPipe, 1F1B and zero-bubble (ZB-H1) schedules, measure
# each one's *bubble* (idle time) and activation memory from the program's own trace, and check
# that the loss and every gradient equal the unsplit model's.
#
# The model is a 4-layer tanh MLP (`simcomm.parallel.pipeline.PIPE_SIZES`), one layer per stage; the batch
# of 16 rows is split into microbatches. Every check compares with the unsplit model in float64.

# %% expect=["4 stages; stage 0 holds Linear(16 -> 64) + Tanh"]
import torch
import simcomm
from simcomm import viz
from simcomm.parallel import data as dp, pipeline as pp
import simcomm.lessons.lesson_08 as check
viz.use_export_renderer()   # figures live in JupyterLab and survive an HTML export

stages = 4
world = simcomm.configured_backend(stages, memory=True)
x, y = dp.make_data(16, pp.PIPE_SIZES)               # (16, 16) inputs, (16, 8) targets, float64
loss_ref, grads_ref = pp.reference(x, y, stages)     # unsplit model, one device
first = pp.stage_layers(dp.make_model(pp.PIPE_SIZES), stages, 0)
print(f"{stages} stages; stage 0 holds Linear({first[0].in_features} -> {first[0].out_features}) + Tanh")

# %% [markdown]
# ## 1. Stages that talk with send/recv
#
# Stage `s` (rank `s`) holds layer `s`. Forward of a microbatch: receive the activation from stage
# `s-1` (stage 0 reads the input), run the layer, send the output to stage `s+1` (the last stage
# computes the loss). Backward: receive the output's gradient from stage `s+1`, call
# `out.backward(grad)`, send the input's gradient to stage `s-1`. Which microbatch a stage works
# on when is the **schedule**, a list of actions per stage. *Naive*: one microbatch at a time.
# *GPipe*: every forward, then every backward. *1F1B* (section 3, and you write it in exercise 2)
# runs warm-up forwards, then alternates one forward and one backward, so that a stage holds
# fewer microbatches; until then it comes from the library, `pp.schedule`:

# %%
def schedule(name, stages, microbatches):
    """Every stage's actions: result[s] is stage s's list of ("F", i) and ("B", i)."""
    plans = []
    for stage in range(stages):
        if name == "naive":
            plan = [(kind, i) for i in range(microbatches) for kind in ("F", "B")]
        elif name == "gpipe":
            plan = [("F", i) for i in range(microbatches)] + [("B", i) for i in range(microbatches)]
        elif name == "1f1b":
            plan = pp.schedule("1f1b", stages, microbatches)[stage]        # exercise 2 writes it
        else:
            raise ValueError(f"schedule: name={name!r}; schedules are naive, gpipe, 1f1b")
        plans.append(plan)
    return plans

# %% expect=["naive stage 0: F0 B0 F1 B1 F2 B2 F3 B3", "gpipe stage 0: F0 F1 F2 F3 B0 B1 B2 B3", "1f1b stage 0: F0 F1 F2 F3 B0 B1 B2 B3", "1f1b stage 2: F0 F1 B0 F2 B1 F3 B2 B3"]
for name in pp.SCHEDULES:
    print(f"{name} stage 0:", " ".join(f"{kind}{i}" for kind, i in schedule(name, stages, 4)[0]))
print("1f1b stage 2:", " ".join(f"{kind}{i}" for kind, i in schedule("1f1b", stages, 4)[2]))

# %% [markdown]
# `pipeline_step` runs one stage's plan: sends are `isend` (waited on at the end), receives
# block, and each action declares its compute (1 ms forward, 2 ms backward) so the cost model can
# lay the trace out in time. Each microbatch's loss is its summed squared error divided by the
# *whole* batch size, so the microbatch losses add up to the batch's mean loss and the gradients
# add up to the unsplit ones. (The library's `pp.pipeline_step`, used from section 2 on, is this
# function plus memory accounting, the split backward of section 6, and send buffers released as
# soon as the neighbour has them; a test checks that the two give the same results.)

# %%
def forward_action(comm, layers, widths, x, y, i, batch, run):
    """F i: receive the input (stage 0: read it), run the layers, send the output (last stage: the loss)."""
    stage, last = comm.rank, comm.rank == comm.world_size - 1
    inp = x if stage == 0 else comm.recv((len(x), widths[0]), x.dtype, src=stage - 1).requires_grad_()
    out = layers(inp)
    comm.compute(seconds=pp.FORWARD_SECONDS)
    if last:
        out = dp.sum_loss(torch.nn.Identity(), out, y) / batch           # this microbatch's share
        run["loss"] = out.detach() if run["loss"] is None else run["loss"] + out.detach()
    else:
        run["sends"].append(comm.isend(out.detach(), stage + 1))
    run["saved"][i] = (inp, out)                                         # kept for B i
    run["held"] = max(run["held"], len(run["saved"]))


def backward_action(comm, layers, widths, x, y, i, batch, run):
    """B i: receive the output's gradient (last stage: none), backward, send the input's gradient."""
    stage, last = comm.rank, comm.rank == comm.world_size - 1
    inp, out = run["saved"].pop(i)
    out.backward(None if last else comm.recv((len(x), widths[1]), x.dtype, src=stage + 1))
    comm.compute(seconds=2 * pp.FORWARD_SECONDS)
    if stage > 0:
        run["sends"].append(comm.isend(inp.grad, stage - 1))

# %%
def pipeline_step(comm, x, y, name, microbatches):
    layers = pp.stage_layers(dp.make_model(pp.PIPE_SIZES), comm.world_size, comm.rank)   # this stage's
    linears = [m for m in layers if isinstance(m, torch.nn.Linear)]
    widths = (linears[0].in_features, linears[-1].out_features)
    xs, ys = x.chunk(microbatches), y.chunk(microbatches)
    run = {"saved": {}, "sends": [], "loss": None, "held": 0}
    for kind, i in schedule(name, comm.world_size, microbatches)[comm.rank]:
        action = forward_action if kind == "F" else backward_action
        action(comm, layers, widths, xs[i], ys[i], i, x.shape[0], run)
    for handle in run["sends"]:
        handle.wait()
    return {"grads": [p.grad.detach().clone() for p in layers.parameters()], "loss": run["loss"],
            "held": run["held"]}

# %% [markdown]
# Each schedule, against the unsplit model on one device:

# %% expect=["naive: loss and every stage's gradients: matches the reference", "gpipe: loss and every stage's gradients: matches the reference", "1f1b: loss and every stage's gradients: matches the reference"]
microbatches = 8
traces, results = {}, {}
for name in pp.SCHEDULES:
    mine = world.run(pipeline_step, x, y, name, microbatches)
    got = [mine[-1]["loss"]] + [out["grads"] for out in mine]
    print(check.assert_close(got, [loss_ref] + grads_ref, f"{name}: loss and every stage's gradients"))
    outs = world.run(pp.pipeline_step, x, y, name, microbatches)      # the library's: the same numbers
    assert all(torch.equal(a, b) for m, o in zip(mine, outs) for a, b in zip(m["grads"], o["grads"]))
    traces[name], results[name] = world.trace, outs

# %% [markdown]
# ## 2. The stage x time chart and its bubble
#
# Each rank's compute events, placed in modelled time (`cost.modelled_timeline`) and named by the
# schedule (drawn for `m = 4` microbatches): the **colour** is the microbatch (`F3` and `B3` share
# micro-batch 3's colour), the **shade** the kind of work (light forward, full-colour backward);
# the legend's grey swatches show the shades. A label is drawn only where it fits at a readable
# size; hover over a box for its name and times. The white gaps are the **bubble**: stage 0 waits
# for the first backward to come all the way back.

# %% tags=["nbval-ignore-output"]
chart = {}
for name in pp.SCHEDULES:                          # m = 4 microbatches: the labels fit
    world.run(pp.pipeline_step, x, y, name, 4)
    chart[name] = world.trace
viz.pipeline_figure(chart, {name: pp.schedule(name, stages, 4) for name in pp.SCHEDULES})

# %% [markdown]
# The bubble fraction, measured from the chart (one minus the stages' compute time over
# `stages x` the step's duration), next to the textbook formula: `(p-1)/(m+p-1)` for GPipe and
# 1F1B, `(p-1)/p` for the naive schedule (one microbatch in flight, whatever `m`). This is the idle
# share of the **total** time (GPipe's convention, used throughout this lesson). Megatron-LM
# (Narayanan et al., 2021) and the Ultra-Scale Playbook quote the bubble relative to the **ideal**
# compute time instead: `(p-1)/m`, and `(1/v)(p-1)/m` with `v` interleaved chunks per rank. Both
# say the same thing; the first is at most 1, the second is the slowdown over no bubble:

# %% expect=["naive: formula 0.750, measured within 0.01 of it", "gpipe: formula 0.273, measured within 0.01 of it", "1f1b: formula 0.273, measured within 0.01 of it"]
measured = {name: pp.bubble(trace) for name, trace in traces.items()}
for name in pp.SCHEDULES:
    formula = pp.bubble_formula(name, stages, microbatches)
    assert formula - 1e-9 <= measured[name] <= formula + 0.01, (name, measured[name], formula)
    print(f"{name}: formula {formula:.3f}, measured within 0.01 of it")

# %% tags=["nbval-ignore-output"]
print({name: round(value, 4) for name, value in measured.items()})   # sends take a few us: a bit above

# %% [markdown]
# ## 3. Activation memory: GPipe holds `m`, 1F1B at most `p - s`
#
# GPipe and 1F1B have the same bubble. The difference is memory: a stage must keep a
# microbatch's activations from its forward until its backward. GPipe runs all forwards first, so
# every stage holds all `m = 8`. 1F1B starts backwards as soon as it can: stage `s` holds at most
# `p - s`. The programs count the microbatches held and measure the bytes (`memory=True`):

# %% expect=["microbatches held per stage: gpipe [8, 8, 8, 8], 1f1b [4, 3, 2, 1]", "1F1B holds fewer bytes than GPipe on every stage"]
held = {name: [out["held"] for out in results[name]] for name in ("gpipe", "1f1b")}
assert held["1f1b"] == [pp.held(plan) for plan in pp.schedule("1f1b", stages, microbatches)]
print(f"microbatches held per stage: gpipe {held['gpipe']}, 1f1b {held['1f1b']}")
nbytes = {name: [out["activation_bytes"] for out in results[name]] for name in ("gpipe", "1f1b")}
assert all(a < b for a, b in zip(nbytes["1f1b"], nbytes["gpipe"]))
print("1F1B holds fewer bytes than GPipe on every stage")

# %% tags=["nbval-ignore-output"]
print("activation bytes per stage (measured):", nbytes)

# %% [markdown]
# The bytes are everything the step holds beyond what the rank held before it, measured after each
# action: activations, and the send buffers not yet waited on. An `isend` copies its tensor, and
# the copy is held until the program waits on the send, as a real backend's `Work` holds what it
# sends until then. A stage waits on a send once the neighbour has certainly taken it: when a
# message arrives that the neighbour sent after receiving ours, so the wait returns at once. Real
# gloo workers count the same bytes per stage, to the byte, under every schedule
# (`tests/parallel/test_pipeline.py`).

# %% [markdown]
# ## 4. Why the sends are `isend`
#
# In 1F1B's steady state, stage `s` sends an activation forward while stage `s+1` sends a
# gradient back, at the same time. With *blocking* sends both wait for the other to receive:
# a deadlock (real NCCL would hang; the simulator names it at once):

# %% expect=["DeadlockError: every rank that has not finished is blocked, so none can make progress:"]
def both_send_first(comm):
    peer = 1 - comm.rank
    comm.send(torch.ones(4) * comm.rank, peer)   # blocks until the peer receives ...
    return comm.recv((4,), torch.float32, peer)  # ... which it never reaches

error = check.expect_error(lambda: simcomm.World(2).run(both_send_first), simcomm.DeadlockError)
print("DeadlockError:", str(error).splitlines()[0])

# %% [markdown]
# ## 5. Extension: interleaved stages
#
# Give each rank `v` smaller chunks of the model instead of one: with 8 layers on 4 ranks, rank
# `r` holds layers `r` and `r + 4` (virtual stages `r` and `r + p`); the last rank sends on to
# rank 0 for the second chunk. Every fill and drain slot is now `1/v` as long, so the bubble
# shrinks to `(p-1)/(v m + p - 1)`. This is the breadth-first order (all forwards through chunk 0,
# then chunk 1, ...; `pp.interleaved_plan`); Megatron's interleaved 1F1B uses the same chunks in a
# depth-first order to also bound the activations held. The price: `v` times as many messages
# (Narayanan et al., 2021): a microbatch now crosses `v p - 1` chunk boundaries instead of `p - 1`,
# each a send and a receive of its activations forward and of their gradient backward.

# %% expect=["interleaved, v = 2: loss and every chunk's gradients: matches the reference", "bubble: formula 0.158 (GPipe 0.273), measured within 0.01 of it"]
chunks, deep = 2, (16,) + (64,) * 7 + (8,)                         # 8 layers: 2 chunks per rank
xi, yi = dp.make_data(16, deep)
loss_i, grads_i = pp.reference(xi, yi, stages * chunks, deep)       # one entry per virtual stage
outs = world.run(pp.interleaved_step, xi, yi, microbatches, chunks, deep)
got = [outs[-1]["loss"]] + [g for c in range(chunks) for g in (out["grads"][c] for out in outs)]
print(check.assert_close(got, [loss_i] + grads_i, "interleaved, v = 2: loss and every chunk's gradients"))
formula = pp.interleaved_bubble_formula(stages, microbatches, chunks)
assert formula - 1e-9 <= pp.bubble(world.trace) <= formula + 0.01
print(f"bubble: formula {formula:.3f} (GPipe {pp.bubble_formula('gpipe', stages, microbatches):.3f}), "
      "measured within 0.01 of it")
interleaved_trace = world.trace

# %% tags=["nbval-ignore-output"]
viz.pipeline_figure(interleaved_trace, pp.interleaved_plan(stages, microbatches, chunks),
                    title="interleaved, 2 chunks per rank: hatched boxes are chunk v1; each box is half a stage")

# %% [markdown]
# ## 6. `torch.distributed.pipelining` on virtual ranks
#
# PyTorch's pipelining runs unchanged on the virtual ranks: `PipelineStage` wraps each stage's
# layers, `ScheduleGPipe` or `Schedule1F1B` runs the schedule (`pp.torch_pipeline_step`). Same
# loss, same gradients. (`Schedule1F1B` posts each send together with a receive through
# `batch_isend_irecv`, the non-blocking exchange that keeps neighbours from waiting on each other.)

# %% expect=["torch ScheduleGPipe: loss and every stage's gradients: matches the reference", "torch Schedule1F1B: loss and every stage's gradients: matches the reference"]
for schedule_class in ("ScheduleGPipe", "Schedule1F1B"):
    outs = world.run(pp.torch_pipeline_step, x, y, 4, schedule_class)
    got = [outs[-1]["loss"]] + [out["grads"] for out in outs]
    print(check.assert_close(got, [loss_ref] + grads_ref, f"torch {schedule_class}: loss and every stage's gradients"))

# %% tags=["nbval-ignore-output"]
print(sorted({(e.op, e.phase) for e in world.trace.events}) or "not traced (real processes: gloo directly)")

# %% [markdown]
# ## 7. Zero bubble: split the backward in two
#
# A layer's backward computes two things: the gradient of its **input** (`B`, what the previous stage
# waits for) and the gradient of its **weights** (`W`, which nobody waits for). Qi et al. ("Zero
# Bubble Pipeline Parallelism", 2023, arXiv:2401.10241) split them: `B` runs at once and its input
# gradient is sent on, `W` runs later, wherever the stage would otherwise idle. Their **ZB-H1**
# schedule keeps 1F1B's order of `F` and `B`, and on stage `s` holds each `W` back by `s`
# backwards: the deferred `W`s fill the drain, where 1F1B's later stages wait for the last
# backwards to reach stage 0. `pp.pipeline_step` runs a plan with `W` actions this way: `B` asks
# autograd for the gradients of the stage's input and of each Linear's output only, `W` turns each
# output gradient into its weight gradients (`dW = dz^T a`, `db = sum dz`). Each takes 1 ms, half
# of the 2 ms backward:

# %% expect=["zb-h1 stage 0: F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7", "zb-h1 stage 3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7", "zb-h1: loss and every stage's gradients: matches the reference"]
zb_plans = pp.schedule(pp.ZERO_BUBBLE, stages, microbatches)
for stage in (0, 3):
    print(f"zb-h1 stage {stage}:", " ".join(f"{kind}{i}" for kind, i in zb_plans[stage]))
outs = world.run(pp.pipeline_step, x, y, pp.ZERO_BUBBLE, microbatches)
traces["zb-h1"], results["zb-h1"] = world.trace, outs
got = [outs[-1]["loss"]] + [out["grads"] for out in outs]
print(check.assert_close(got, [loss_ref] + grads_ref, "zb-h1: loss and every stage's gradients"))

# %% [markdown]
# The paper's bubble for ZB-H1 is `(p-1)(tF + tB - tW)`, against 1F1B's `(p-1)(tF + tB + tW)`
# (`tB` and `tW` are the two halves of the backward). With `tF = tB = tW` the step takes
# `3m + p - 1` slots instead of `3(m + p - 1)`: a third of 1F1B's idle slots, and an idle share of
# the total time of `(p-1)/(3m+p-1)` (for `m >= p`). Measured on the modelled timeline beside
# GPipe and 1F1B, same `p = 4`, `m = 8`:

# %% expect=["gpipe: formula 0.273, measured within 0.01 of it", "1f1b: formula 0.273, measured within 0.01 of it", "zb-h1: formula 0.111, measured within 0.01 of it", "zb-h1 holds 4 microbatches on every stage (1F1B's peak, on stage 0): [4, 4, 4, 4]"]
for name in ("gpipe", "1f1b", "zb-h1"):
    formula, measured_bubble = pp.bubble_formula(name, stages, microbatches), pp.bubble(traces[name])
    assert formula - 1e-9 <= measured_bubble <= formula + 0.01, (name, measured_bubble, formula)
    print(f"{name}: formula {formula:.3f}, measured within 0.01 of it")
zb_held = [out["held"] for out in results["zb-h1"]]
assert zb_held == [pp.held(plan) for plan in zb_plans] and max(zb_held) == max(held["1f1b"])
print(f"zb-h1 holds {max(zb_held)} microbatches on every stage (1F1B's peak, on stage 0): {zb_held}")

# %% [markdown]
# The two schedules side by side (`m = 4`): the dark boxes are the `W`s. On stage 3 they move to
# the end, into what was 1F1B's drain; stage 0 runs each `W` right after its `B`.

# %% tags=["nbval-ignore-output"]
world.run(pp.pipeline_step, x, y, pp.ZERO_BUBBLE, 4)
zb_chart = {"1f1b": chart["1f1b"], "zb-h1": world.trace}          # 1F1B's m = 4 trace from section 2
viz.pipeline_figure(zb_chart, {name: pp.schedule(name, stages, 4) for name in zb_chart},
                    title="1F1B and ZB-H1, m = 4: light F, full-colour B, dark W; gaps = bubble")

# %% [markdown]
# PyTorch ships zero-bubble schedules too, with two model chunks per rank:
# `ScheduleInterleavedZeroBubble` (chunks `r` and `r + p`, as in section 5) and
# `ScheduleZBVZeroBubble` (the paper's ZB-V: chunks `r` and `2p - 1 - r`, so the model runs down the
# ranks and back up). Both split the backward into input and weight halves as ZB-H1 does. They run
# unchanged on the virtual ranks (`pp.torch_multistage_step`) and give the unsplit 8-layer model's
# loss and gradients:

# %% expect=["torch ScheduleInterleavedZeroBubble: loss and every chunk's gradients: matches the reference", "torch ScheduleZBVZeroBubble: loss and every chunk's gradients: matches the reference"]
for schedule_class in ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"):
    outs = world.run(pp.torch_multistage_step, xi, yi, microbatches, chunks, deep, schedule_class)
    loss_got = next(out["loss"] for out in outs if out["loss"] is not None)
    got = [loss_got] + [out["grads"][c] for out in outs for c in range(chunks)]
    want = [loss_i] + [grads_i[k] for out in outs for k in out["stage_ids"]]
    print(check.assert_close(got, want, f"torch {schedule_class}: loss and every chunk's gradients"))

# %% [markdown]
# ## Exercise 1: predict the bubble
#
# A pipeline of `p = 8` stages runs `m = 32` microbatches per step with 1F1B. What fraction of the
# stages' time is idle, as a share of the total time (the convention of section 2)? (A number
# between 0 and 1; a fraction like `3 / 11` is fine.)

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
bubble_fraction = ...

print(check.check_bubble(bubble_fraction))


# %% [markdown] expect=["Correct: (p-1)/(m+p-1) = 7/39 = 0.179 of the stages' time is idle."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# # The step takes m + p - 1 slots; each stage is busy in m of them.
# print(check.check_bubble((8 - 1) / (32 + 8 - 1)))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 2: write the 1F1B schedule
#
# Write `my_schedule(stage, stages, microbatches)` returning stage `stage`'s list of actions
# `("F", i)` / `("B", i)`. The check runs it for several `(stages, microbatches)`, including fewer
# microbatches than stages: no deadlock, at most `min(stages - stage, microbatches)` microbatches
# held, and finished as early as GPipe.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def my_schedule(stage, stages, microbatches):
    raise NotImplementedError   # return a list like [("F", 0), ("F", 1), ("B", 0), ...]

print(check.check_1f1b(my_schedule))

# %% [markdown] expect=["Correct: no deadlock, at most p - s microbatches held, and as fast as GPipe."] tags=["solution"]
# <details><summary>Solution of exercise 2 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 2.
# # Warm up with the forwards the later stages need, then one forward one backward, then drain.
# def schedule_solution(stage, stages, microbatches):
#     warmup = min(stages - stage - 1, microbatches)
#     plan = [("F", i) for i in range(warmup)]
#     for i in range(microbatches - warmup):
#         plan += [("F", warmup + i), ("B", i)]
#     return plan + [("B", i) for i in range(microbatches - warmup, microbatches)]
#
# print(check.check_1f1b(schedule_solution))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 3: write the ZB-H1 schedule
#
# Write `my_zero_bubble(stage, stages, microbatches)` returning stage `stage`'s actions `("F", i)`,
# `("B", i)` (input gradient) and `("W", i)` (weight gradient). The check runs it for several
# `(stages, microbatches)` with `microbatches >= stages`: no deadlock, every backward split, at most
# `stages` microbatches held on any stage (1F1B's peak; a microbatch is held from its `F` to its
# `W`), and the step done in `3m + p - 1` slots when `F`, `B` and `W` take one slot each.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def my_zero_bubble(stage, stages, microbatches):
    raise NotImplementedError   # return a list like [("F", 0), ("B", 0), ("W", 0), ...]

print(check.check_zero_bubble(my_zero_bubble))

# %% [markdown] expect=["Correct: no deadlock, at most p micro-batches held on any stage (1F1B's peak), and the step takes 3m + p - 1 slots: a bubble of (p-1)/(3m+p-1)."] tags=["solution"]
# <details><summary>Solution of exercise 3 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 3.
# # 1F1B's F and B order; stage s runs W j after B (j + s), and the last s Ws fill the drain.
# def zero_bubble_solution(stage, stages, microbatches):
#     warmup = min(stages - stage - 1, microbatches)
#     plan = [("F", i) for i in range(warmup)]
#     weights = iter(range(microbatches))
#     for j in range(microbatches):
#         if warmup + j < microbatches:
#             plan.append(("F", warmup + j))
#         plan.append(("B", j))
#         if j >= stage:
#             plan.append(("W", next(weights)))
#     return plan + [("W", i) for i in weights]
#
# print(check.check_zero_bubble(zero_bubble_solution))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * A pipeline passes activations forward and gradients backward between stages with
#   point-to-point messages; with microbatch losses that add up to the batch loss, the gradients
#   are exactly the unsplit model's.
# * The bubble is `(p-1)/(m+p-1)` for GPipe and 1F1B: more microbatches, smaller bubble.
# * 1F1B has GPipe's bubble but holds at most `p - s` microbatches of activations instead of `m`.
# * Neighbours send to each other at the same time: sends must not block (`isend`), or the
#   pipeline deadlocks.
# * Splitting the backward into the input gradient (`B`, on the critical path) and the weight
#   gradient (`W`, off it) lets ZB-H1 fill the drain with `W`s: the bubble falls from
#   `(p-1)(tF+tB+tW)` to `(p-1)(tF+tB-tW)` at 1F1B's peak memory.

# %%
world.close()
