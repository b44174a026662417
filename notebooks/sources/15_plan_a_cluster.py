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
# # Lesson 15: Plan a cluster
#
# **Goal:** choose how to lay out Llama 3 8B and 70B on 1024 GPUs (and 405B on 16,384): for
# every split into tensor, context, pipeline and data parallelism, the memory per GPU by label
# and the modelled step time; keep the layouts that fit an H100's memory, rank them by time, and
# set the planner beside what the Llama 3 paper and torchtitan published. Then say plainly what
# such a plan can and cannot tell.
#
# Nothing here trains a large model: a plan is the accounting of lessons 6, 7, 12 and 13 (model
# states, activations per layer, the collectives each dimension adds) applied to real shapes.

# %%
import time
import torch
from simcomm import World, configured_backend
from simcomm.lessons import memory_and_planning as checks
from simcomm.parallel import mixed_precision as mp
from simcomm.planning import cluster_step, planner, published
from simcomm.parallel.mesh import Layout
from simcomm.models.llama import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B
from simcomm.planning.planner import GiB
from simcomm.viz.cluster_plan import cluster, plan_figure
from simcomm.viz.planning import layout_memory_figure
from simcomm.viz import use_export_renderer
use_export_renderer()   # figures live in JupyterLab and survive an HTML export

LIMIT = planner.H100_MEMORY   # an "80 GB" H100 offers 81,559 MiB (nvidia-smi): 79.6 GiB, not 80
world = configured_backend(4, memory=True)      # SIMCOMM_BACKEND: virtual ranks or real processes

# %% [markdown]
# ## 1. The models
#
# The Llama 3 shapes (the paper's Table 3): layers, hidden size, attention and KV heads
# (grouped-query attention), the SwiGLU width and the vocabulary. Their parameter counts, from the
# shapes alone, against the published sizes:

# %% expect=["Llama 3 8B: 32 layers, h 4096, 32/8 heads, ffn 14336: 8.03 B parameters", "Llama 3 70B: 80 layers, h 8192, 64/8 heads, ffn 28672: 70.55 B parameters", "Llama 3 405B: 126 layers, h 16384, 128/8 heads, ffn 53248: 405.85 B parameters"]
for model, published_size in ((LLAMA3_8B, 8.0e9), (LLAMA3_70B, 70.6e9), (LLAMA3_405B, 405e9)):
    assert abs(model.parameters - published_size) / published_size < 0.01
    print(f"{model.name}: {model.layers} layers, h {model.hidden}, {model.heads}/{model.kv_heads} heads, "
          f"ffn {model.ffn}: {model.parameters / 1e9:.2f} B parameters")

# %% [markdown]
# ## 2. What a run measures, and what a shape-only run gives
#
# The planner's model states for Megatron-style training (bf16 weights, fp32 `main_grad`, fp32
# master + Adam sharded ZeRO-1) are `mp.expected_bytes`. A run measures them: lesson 13's
# mixed-precision MLP, data parallel on 4 ranks of the configured backend (virtual ranks, or
# real gloo processes with `SIMCOMM_BACKEND=real`):

# %% expect=["measured on 4 ranks = planner's formula: 2 + 4 + 12/4 = 9.0 bytes per parameter"]
psi = mp.MLP().numel
world.run(mp.train, 1, gradients="fp32 main_grad", steps=1)
formula = mp.expected_bytes(1, psi, 4, "fp32 main_grad")
for snap in world.memory.at("after step 1"):
    assert {label: snap[label] for label in formula} == formula
print(f"measured on 4 ranks = planner's formula: 2 + 4 + 12/4 = {sum(formula.values()) / psi:.1f} bytes per parameter")

# %% [markdown]
# A whole cluster cannot run here, but `World(n, tensors="shape")` runs a program on fake tensors
# (virtual ranks only: real processes would need the real memory): shapes, the trace of every
# collective and the bytes each rank holds, no arithmetic. One 3-D step of `cluster_step`
# (transformer blocks at Llama 3 8B's width, `s = 8192`) on 16 ranks, read against an H100 cluster:

# %% tags=["nbval-ignore-output"]
layout = Layout(pp=2, dp=2, tp=4)                    # ranks (p * dp + d) * tp + t, as init_device_mesh
shape_world = World(layout.world_size, tensors="shape", memory=True)
start = time.perf_counter()
shape_world.run(cluster_step.step, layout, cluster_step.Block(hidden=4096, heads=32, seq=8192, micro_batches=2))
print(f"{layout.world_size} shape-only ranks in {time.perf_counter() - start:.1f} s; rank 0 peaked at "
      f"{shape_world.memory.peak[0] / GiB:.2f} GiB")
plan_figure(shape_world.trace, cluster("h100-ndr-cluster", layout.world_size))

# %% [markdown]
# That costs seconds per 16 ranks here: every layout of a thousand GPUs would take hours. So the
# planner (`simcomm.planning.planner`) applies the accounting as formulas, per GPU, to every layout:
#
# * **memory** by label: model states (above) for this GPU's `1/tp` of its stage's layers (plus
#   embedding / output); `unsharded`: what FSDP gathers; `activations`: what each layer keeps
#   (`recompute`: none, torchtitan's op-level selective, full) times the micro-batches the pipeline
#   schedule keeps in flight; `workspace`: the backward's transient peak (one layer recomputed, or
#   the loss's fp32 logits); `overhead`: the allocator's share, calibrated on a published run;
# * **time**: each GEMM at a sustained fraction of peak with wave quantization, flash attention at
#   its published efficiency, elementwise ops at HBM bandwidth; the pipeline bubble of the schedule;
#   the TP / CP collectives on the critical path and the DP traffic beyond what it overlaps
#   (`simcomm.model.cost`, each group on its real GPUs).
#
# ## 3. Every layout of 1024 GPUs for Llama 3 8B
#
# Sequence 8192, one sequence per GPU per step (global batch 1024 sequences, 8 M tokens):

# %% expect=["99 layouts of 1024 GPUs; 98 fit 79.6 GiB", "fastest that fits: tp 1, cp 2, pp 1, dp 512"]
rows8 = planner.plan(LLAMA3_8B, 1024, seq=8192, global_batch=1024)
fitting = sorted((row for row in rows8 if row["total"] <= LIMIT), key=lambda row: row["step_time"])
print(f"{len(rows8)} layouts of 1024 GPUs; {len(fitting)} fit {LIMIT / GiB:.1f} GiB")
print("fastest that fits: tp {}, cp {}, pp {}, dp {}".format(*planner.key(fitting[0])))

# %% [markdown]
# The accounting of that layout, by hand: with `pp = 1` one GPU holds every layer, the embedding
# *and* the output layer; states of `2 + 4` bytes per parameter plus `12/(dp cp)`; per layer the
# tensors op-level selective checkpointing saves, `2 T (4h + kv + ffn)` bytes for `T = s/cp` tokens:

# %% expect=["parameters 14.96 GiB, gradients 29.92 GiB, optimizer state 0.09 GiB, activations 7.75 GiB"]
row = fitting[0]
psi, s, h, ffn = LLAMA3_8B.parameters, 8192 // 2, LLAMA3_8B.hidden, LLAMA3_8B.ffn
assert psi == 32 * LLAMA3_8B.layer_parameters + 2 * LLAMA3_8B.vocab * h + h       # layers, embedding, output, norm
kv = h * LLAMA3_8B.kv_heads // LLAMA3_8B.heads
assert abs(row["parameters"] - 2 * psi) < 2 and abs(row["gradients"] - 4 * psi) < 4
assert abs(row["optimizer_state"] - 12 * psi / 1024) < 1
assert row["activations"] == 32 * 2 * s * (4 * h + kv + ffn)                   # one micro-batch in flight
print(f"parameters {row['parameters'] / GiB:.2f} GiB, gradients {row['gradients'] / GiB:.2f} GiB, optimizer state "
      f"{row['optimizer_state'] / GiB:.2f} GiB, activations {row['activations'] / GiB:.2f} GiB")

# %% tags=["nbval-ignore-output"]
layout_memory_figure(rows8, LIMIT, title="Llama 3 8B on 1024 H100s: the 16 fastest layouts that fit")

# %% [markdown]
# What the step is made of differs by layout; the next cell counts it rather than guessing:

# %% expect=["compute is more than half of the modelled step in 90 of 99 layouts", "modelled steps range from 0.88 s to 6.16 s"]
dominated = [r for r in rows8 if r["compute"] > r["step_time"] / 2]
print(f"compute is more than half of the modelled step in {len(dominated)} of {len(rows8)} layouts")
print(f"modelled steps range from {min(r['step_time'] for r in rows8):.2f} s to "
      f"{max(r['step_time'] for r in rows8):.2f} s")

# %% [markdown]
# The slow end is pipeline parallelism with few micro-batches per replica (the 1F1B bubble) and
# wide tensor or context groups; context parallelism 2 halves the activations for one K/V
# all-gather per layer.
#
# ## 4. Llama 3 70B on 1024 GPUs

# %% expect=["99 layouts; 63 fit 79.6 GiB"]
rows70 = planner.plan(LLAMA3_70B, 1024, seq=8192, global_batch=1024)
fit70 = [row for row in rows70 if row["total"] <= LIMIT]
print(f"{len(rows70)} layouts; {len(fit70)} fit {LIMIT / GiB:.1f} GiB")

# %% [markdown]
# Which of the 63 is fastest is exercise 1: try it before section 5's figures.
#
# ## 5. Beside what was published
#
# The Llama 3 paper (Table 4) trained 405B on H100s with **TP 8, CP 1, PP 16, DP 128** on 16,384
# GPUs and **DP 64** on 8,192 (sequence 8192, 16 M tokens a step), and for long context
# **TP 8, CP 16, PP 16, DP 8** (sequence 131,072): 400, 430 and 380 TFLOPs per GPU. As tokens per
# GPU per second, in the paper's `6N + 12Lhs` flops convention and in the causal count:

# %% expect=["TP 8 x CP 16 x PP 16 x DP 8 = 16,384 GPUs", "400 TFLOPs: 152 tokens/GPU/s (6N + 12Lhs), 158 (causal)", "430 TFLOPs: 164 tokens/GPU/s (6N + 12Lhs), 170 (causal)", "380 TFLOPs: 67 tokens/GPU/s (6N + 12Lhs), 94 (causal)"]
assert 8 * 16 * 16 * 8 == 16384
print(f"TP 8 x CP 16 x PP 16 x DP 8 = {8 * 16 * 16 * 8:,} GPUs")
for tflops, seq in ((400, 8192), (430, 8192), (380, 131072)):
    convention = tflops * 1e12 / planner.flops_per_token(LLAMA3_405B, seq)
    causal = tflops * 1e12 / planner.flops_per_token(LLAMA3_405B, seq, causal=True)
    print(f"{tflops} TFLOPs: {convention:.0f} tokens/GPU/s (6N + 12Lhs), {causal:.0f} (causal)")

# %% [markdown]
# Every published row beside the planner (`python benchmarks/published_runs.py` prints the same;
# `docs/planning_llama.md` discusses it). Two rows **calibrate** the planner (the GPUs' sustained
# GEMM fraction, the allocator overhead); the other 19 only **validate**:

# %% tags=["nbval-ignore-output"]
runs = published.published_runs()
for run in runs:
    got = published.evaluate_run(run)
    want, mine, unit = (run["tflops"], got["tflops"], "TFLOPs") if run["tflops"] else \
        (run["tps"], got["tokens_per_gpu_s"], "tok/s")
    memory = f"{run['memory_gib']:5.1f} vs {got['total'] / GiB:5.1f} GiB" if run["memory_gib"] else " " * 19
    print(f"{run['role']:<9} {run['name']:<36} {memory} | {want:>5} vs {mine:5.0f} {unit:<6} "
          f"({mine / want:.2f}) MFU {got['mfu']:.0%}")
validating = [r for r in runs if r["role"] == "validate" and r["memory_gib"]]
assert len([r for r in runs if r["role"] == "calibrate"]) == 2 and len(validating) == 17

# %% [markdown]
# Where the Llama 3 paper's 8K layout ranks among the planner's layouts for the same run (no
# activation checkpointing, interleaved 1F1B, 16,384 GPUs, 2048 sequences):

# %% expect=["the paper's layout needs 92.3 GiB per GPU in the plan: activations 63.5 GiB (16 micro-batches x 8 layers in flight)", "by modelled step alone it ranks 35 of 90; the fastest that fits, tp 4, cp 8, pp 16, dp 32, takes 0.89 of its step", "bubble: 1.20 s for the paper's layout (16 micro-batches), 0.31 s for it (64)", "to fit, its activations would have to be 11.2 GiB (18%) smaller"]
meta = runs[0]
rows405 = sorted(planner.plan(LLAMA3_405B, 16384, meta["recipe"]), key=lambda r: r["step_time"])
paper = next(r for r in rows405 if planner.key(r) == (8, 1, 16, 128))
best = next(r for r in rows405 if r["total"] <= LIMIT)
assert paper["total"] > LIMIT and paper["micro_batches"] == 16
print(f"the paper's layout needs {paper['total'] / GiB:.1f} GiB per GPU in the plan: activations "
      f"{paper['activations'] / GiB:.1f} GiB (16 micro-batches x 8 layers in flight)")
print(f"by modelled step alone it ranks {rows405.index(paper) + 1} of {len(rows405)}; the fastest that fits, "
      "tp {}, cp {}, pp {}, dp {}, ".format(*planner.key(best)) + f"takes {best['step_time'] / paper['step_time']:.2f} of its step")
print(f"bubble: {paper['bubble']:.2f} s for the paper's layout (16 micro-batches), {best['bubble']:.2f} s for it "
      f"({best['micro_batches']})")
excess = (paper["total"] - LIMIT) / (1 + planner.H100_SXM.memory_overhead)       # before the allocator's share
print(f"to fit, its activations would have to be {excess / GiB:.1f} GiB ({excess / paper['activations']:.0%}) smaller")

# %% [markdown]
# Read that as the model's limits, with numbers:
#
# * **Memory.** Meta trained 8K without activation checkpointing. The plan counts what fused
#   kernels save per layer (0.50 GiB here) for every micro-batch the interleaved schedule holds:
#   with 16 micro-batches on 16 stages that is all of them. To fit 79.6 GiB those 128
#   layer-micro-batches would have to hold about a fifth less; the paper credits deallocating
#   tensors early and its own schedule, which the plan does not model.
# * **Time.** The planner's favourite halves TP and adds CP 8 at 8K tokens, and with DP 32 gets 64
#   micro-batches per replica, which shrinks the bubble. The plan charges CP for an all-gather of
#   K and V and smaller GEMMs, not for the attention kernels' lower efficiency on 1K-token chunks
#   (docs/planning_llama.md: with ring attention modelled step by step, torchtitan's long-context CP
#   rows still run as if attention reached only 0.6-0.7 of the kernel's figure). The paper
#   measured; the plan estimates, and its favourite is only 11 % faster in the model.
#
# ## 6. What a plan can and cannot tell
#
# * **It can**: which layouts cannot fit (states are exact; activations as counted per layer; the
#   allocator's share is calibrated), how memory moves with each dimension, which collectives each
#   dimension adds and over which links, and a first ranking.
# * **It cannot**: compute anything (no values: it cannot find a numerical bug), see the real
#   allocator, know kernel efficiency beyond its calibration, congestion, stragglers or failures.
#   Its times are a model, not a measurement: run the top few layouts for real.
#
# ## Exercise 1: the fastest layout that fits
#
# From `rows70` (Llama 3 70B, 1024 GPUs), which layout fits `LIMIT` per GPU and has the shortest
# modelled step? Filter, then rank. Answer a `(tp, cp, pp, dp)` tuple (a dict of the four sizes
# or a `Layout` also works).

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
choice = ...   # (tp, cp, pp, dp)

print(checks.check_plan_choice(choice, rows70, LIMIT))

# %% [markdown] expect=["Correct: (2, 4, 4, 32) is the fastest layout that fits 79.6 GiB per GPU."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# # Keep the rows whose memory per GPU fits, then take the one with the shortest modelled step.
# fits_limit = [row for row in rows70 if row["total"] <= LIMIT]
# choice_solution = planner.key(min(fits_limit, key=lambda row: row["step_time"]))
# print(checks.check_plan_choice(choice_solution, rows70, LIMIT))
# ```
#
# </details>

# %% [markdown]
# The 16 fastest 70B layouts that fit, for after your answer:

# %% tags=["nbval-ignore-output"]
layout_memory_figure(rows70, LIMIT, title="Llama 3 70B on 1024 H100s: the 16 fastest layouts that fit")

# %% [markdown]
# ## Exercise 2: the sequence doubles
#
# Llama 3 8B on 1024 GPUs, now with sequences of 16,384 tokens (the same number of sequences). Which
# dimension of the fastest layout that fits grows: `"tp"`, `"cp"`, `"pp"` or `"dp"`? Predict first;
# then check with `planner.plan(LLAMA3_8B, 1024, seq=16384, global_batch=1024)`.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
grows = ...   # "tp", "cp", "pp" or "dp"

print(checks.check_sequence_doubling(grows, LLAMA3_8B, 1024, 8192, LIMIT, global_batch=1024))

# %% [markdown] expect=["Correct: at twice the sequence the best layout grows cp."] tags=["solution"]
# <details><summary>Solution of exercise 2 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 2.
# # Activations grow with s; model states do not. Context parallelism divides the sequence (and so
# # the activations) at the price of one K/V all-gather per layer, while TP would also add
# # collectives on every sublayer and PP a bubble: cp grows (2 to 4).
# grows_solution = "cp"
# print(checks.check_sequence_doubling(grows_solution, LLAMA3_8B, 1024, 8192, LIMIT, global_batch=1024))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 3: why does it not fit?
#
# Pure data parallelism of Llama 3 8B at sequence 8192 (`tp = cp = pp = 1`, `dp = 1024`) needs more
# than `LIMIT`. Read its bar below: which label is largest?

# %% tags=["nbval-ignore-output"]
oom = next(r for r in rows8 if planner.key(r) == (1, 1, 1, 1024))
layout_memory_figure([oom], LIMIT, title="Llama 3 8B, tp 1 cp 1 pp 1 dp 1024", fitting_only=False)

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
reason = ...   # "parameters", "gradients", "optimizer_state", "unsharded", "activations", "workspace" or "overhead"

print(checks.check_out_of_memory_reason(reason, oom, LIMIT))

# %% [markdown] expect=["ZeRO-2: 47.7 GiB per GPU, which fits: True", "Correct: gradients (29.9 GiB) is the largest part of the 81.4 GiB that overflow 79.6 GiB in layout (1, 1, 1, 1024)."] tags=["solution"]
# <details><summary>Solution of exercise 3 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 3.
# # fp32 main_grad gradients are 4 bytes for each of the 8.03 B parameters on every GPU: 29.9 GiB,
# # more than the bf16 weights (15.0) or the activations. ZeRO-2 shards them 1024 ways:
# reason_solution = "gradients"
# zero2 = planner.evaluate(LLAMA3_8B, (1, 1, 1, 1024), seq=8192, global_batch=1024, zero=2)
# print(f"ZeRO-2: {zero2['total'] / GiB:.1f} GiB per GPU, which fits: {zero2['total'] <= LIMIT}")
# print(checks.check_out_of_memory_reason(reason_solution, oom, LIMIT))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 4: find the bug in a plan
#
# A planning script counts the parameters one GPU holds on its fullest pipeline stage with the
# function below. Its numbers for 405B with pipeline parallelism are right, but its plans for pure
# data parallelism fit layouts that run out of memory. Predict by how many parameters it is wrong
# for Llama 3 8B at `(1, 1, 1, 1024)`, then write `stage_parameters` without the bug (it gets a
# model and a `(tp, cp, pp, dp)` layout; the checker tries 3 models and 5 layouts).

# %%
def buggy_stage_parameters(model, layout):
    tp, cp, pp, dp = layout
    layers = -(-model.layers // pp)                         # the fullest stage
    stack = layers * model.layer_parameters
    embedding = model.vocab * model.hidden                  # input embedding; the output layer is as big
    if pp == 1:
        return (stack + embedding + model.hidden) / tp
    return (stack + embedding + model.hidden) / tp          # the last stage: output layer and final norm

print(f"buggy: {buggy_stage_parameters(LLAMA3_8B, (1, 1, 1, 1024)) / 1e9:.2f} B parameters on one GPU")

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def stage_parameters(model, layout):
    raise NotImplementedError   # your version

print(checks.check_stage_parameters(stage_parameters, (LLAMA3_8B, LLAMA3_70B, LLAMA3_405B)))

# %% [markdown] expect=["Correct: your function agrees with the planner on 15 cases, pipeline or not."] tags=["solution"]
# <details><summary>Solution of exercise 4 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 4.
# # With pp == 1 the only stage holds the embedding AND the output layer (not tied): the buggy
# # version misses vocab x hidden = 525 M parameters for 8B, 6.5 % of the model.
# def stage_parameters_solution(model, layout):
#     tp, cp, pp, dp = layout
#     stack = -(-model.layers // pp) * model.layer_parameters
#     embedding = model.vocab * model.hidden
#     outputs = 2 * embedding if pp == 1 else embedding      # the last stage: the output layer only
#     return (stack + outputs + model.hidden) / tp
# print(checks.check_stage_parameters(stage_parameters_solution, (LLAMA3_8B, LLAMA3_70B, LLAMA3_405B)))
# ```
#
# </details>

# %%
world.close()

# %% [markdown]
# ## Takeaway
#
# * A plan is accounting: model states, activations per layer divided by `tp x cp`, the micro-batches
#   the schedule keeps in flight, the backward's working set; filter by memory first (79.6 GiB on an
#   "80 GB" H100), then rank by modelled time.
# * Small models fit almost anywhere and want the least communication; large ones are forced into
#   tensor and pipeline parallelism by memory; long sequences call for context parallelism.
# * A plan is as good as its calibration and what it models: held against published runs it is
#   within 15 % on most rows, and where it is not, the gap names what it lacks. Run the top few
#   layouts for real before committing.
