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
# and the modelled step time; keep the layouts that fit 80 GB, rank them by time, and set the
# choice beside what the Llama 3 paper and torchtitan published. Then say plainly what such a
# plan can and cannot tell.
#
# Nothing here runs a model: a plan is the accounting of lessons 6, 7, 12 and 13 (model states,
# activations per layer, the collectives each dimension adds) applied to real shapes.

# %%
import time
from simcomm import World
from simcomm.lessons import memory_and_planning as checks
from simcomm.planning import cluster_step, planner
from simcomm.parallel.mesh import Layout
from simcomm.models.llama import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B
from simcomm.planning.planner import GiB
from simcomm.viz.cluster_plan import cluster, plan_figure
from simcomm.viz.planning import layout_memory_figure
from simcomm.viz import use_export_renderer
use_export_renderer()   # figures live in JupyterLab and survive an HTML export

LIMIT = 80 * GiB

# %% [markdown]
# ## 1. The models
#
# The Llama 3 shapes (the paper's Table 3): layers, hidden size, attention and KV heads
# (grouped-query attention), the SwiGLU width and the vocabulary. Their parameter counts, from the
# shapes alone, against the published sizes:

# %% expect=["Llama 3 8B: 32 layers, h 4096, 32/8 heads, ffn 14336: 8.03 B parameters", "Llama 3 70B: 80 layers, h 8192, 64/8 heads, ffn 28672: 70.55 B parameters", "Llama 3 405B: 126 layers, h 16384, 128/8 heads, ffn 53248: 405.85 B parameters"]
for model, published in ((LLAMA3_8B, 8.0e9), (LLAMA3_70B, 70.6e9), (LLAMA3_405B, 405e9)):
    assert abs(model.parameters - published) / published < 0.01
    print(f"{model.name}: {model.layers} layers, h {model.hidden}, {model.heads}/{model.kv_heads} heads, "
          f"ffn {model.ffn}: {model.parameters / 1e9:.2f} B parameters")

# %% [markdown]
# ## 2. What a shape-only run gives
#
# `World(n, tensors="shape")` runs a program on fake tensors: shapes, dtypes, the trace of every
# collective and the bytes each rank holds, but no values and no arithmetic. Here one 3-D step
# of `cluster_step` (tensor x pipeline x data parallel transformer blocks at Llama 3 8B's width,
# `h = 4096`, 32 heads, `s = 8192`) on 16 ranks, read against an H100 InfiniBand cluster:

# %% tags=["nbval-ignore-output"]
layout = Layout(pp=2, dp=2, tp=4)                    # ranks (p * dp + d) * tp + t, as init_device_mesh
shape_world = World(layout.world_size, tensors="shape", memory=True)
start = time.perf_counter()
shape_world.run(cluster_step.step, layout, cluster_step.Block(hidden=4096, heads=32, seq=8192, micro_batches=2))
print(f"{layout.world_size} shape-only ranks in {time.perf_counter() - start:.1f} s; rank 0 peaked at "
      f"{shape_world.memory.peak[0] / GiB:.2f} GiB")
plan_figure(shape_world.trace, cluster("h100-ndr-cluster", layout.world_size)).update_layout(width=1000)

# %% [markdown]
# That is exact for the program traced, and costs seconds per 16 ranks on this machine: a
# thousand ranks and every layout would take hours. So the planner (`simcomm.planning.planner`)
# applies the same accounting as formulas, per GPU, to every layout at once:
#
# * **model states** (lesson 13's `mp.expected_bytes`): bf16 parameters, fp32 `main_grad`
#   gradients, fp32 master weights + Adam sharded over the `dp x cp` replicas (ZeRO-1, Megatron's
#   distributed optimizer), for this GPU's `1/tp` of its stage's layers (plus embedding/output);
# * **activations** (lesson 13, for a Llama layer with flash attention): per layer
#   `2 sb (6h + 2h kv/a + 4 ffn) / (tp cp)` bytes, times the stage's layers, times the
#   micro-batches 1F1B keeps in flight on the first stage, plus the logits on the last;
# * **time**: `6 x parameters x tokens` plus attention flops at 40 % of the H100's peak, the
#   1F1B bubble, the TP and CP collectives on the critical path, the DP traffic beyond the
#   compute it overlaps (`simcomm.model.cost`, each group on its real GPUs: TP inside a node).
#
# ## 3. Every layout of 1024 GPUs for Llama 3 8B
#
# Sequence 8192, one sequence per GPU per step (global batch 1024 sequences, 8 M tokens):

# %% expect=["99 layouts of 1024 GPUs; 98 fit 80 GiB", "fastest that fits: tp 1, cp 2, pp 1, dp 512"]
rows8 = planner.plan(LLAMA3_8B, 1024, seq=8192, global_batch=1024)
fitting = sorted((row for row in rows8 if row["total"] <= LIMIT), key=lambda row: row["step_time"])
print(f"{len(rows8)} layouts of 1024 GPUs; {len(fitting)} fit 80 GiB")
print("fastest that fits: tp {}, cp {}, pp {}, dp {}".format(*planner.key(fitting[0])))

# %% [markdown]
# The accounting, checked by hand for pure data parallelism (`tp = cp = pp = 1`): every GPU holds
# all 8.03 B parameters in bf16 and their fp32 gradients, and 1/1024 of the 12-byte optimizer state:

# %% expect=["parameters 16.06 GB, gradients 32.12 GB, optimizer state 0.094 GB, activations 50.33 GB"]
row = next(r for r in rows8 if planner.key(r) == (1, 1, 1, 1024))
psi, s, h = LLAMA3_8B.parameters, 8192, LLAMA3_8B.hidden
per_layer = 2 * s * (6 * h + 2 * h * 8 / 32 + 4 * LLAMA3_8B.ffn)       # bf16, flash attention
assert abs(row["parameters"] - 2 * psi) < 1 and abs(row["gradients"] - 4 * psi) < 1
assert abs(row["optimizer_state"] - 12 * psi / 1024) < 1
assert abs(row["activations"] - (32 * per_layer + 6 * s * LLAMA3_8B.vocab)) < 1   # + bf16 and fp32 logits
print(f"parameters {row['parameters'] / 1e9:.2f} GB, gradients {row['gradients'] / 1e9:.2f} GB, optimizer state "
      f"{row['optimizer_state'] / 1e9:.3f} GB, activations {row['activations'] / 1e9:.2f} GB")

# %% tags=["nbval-ignore-output"]
layout_memory_figure(rows8, LIMIT, title="Llama 3 8B on 1024 H100s: the 16 fastest layouts")

# %% [markdown]
# For 8B the compute dominates every layout (about 1.07 s a step); what differs is small: context
# parallelism 2 halves the activations for one cheap all-gather of K and V per layer, tensor
# parallelism adds collectives on the critical path. Most layouts fit: the model is small.
#
# ## 4. Llama 3 70B on 1024 GPUs

# %% expect=["99 layouts; 58 fit 80 GiB", "fastest that fits: tp 1, cp 16, pp 8, dp 8"]
rows70 = planner.plan(LLAMA3_70B, 1024, seq=8192, global_batch=1024)
fit70 = [row for row in rows70 if row["total"] <= LIMIT]
print(f"{len(rows70)} layouts; {len(fit70)} fit 80 GiB")
print("fastest that fits: tp {}, cp {}, pp {}, dp {}".format(*planner.fastest_fitting(rows70, LIMIT)))

# %% tags=["nbval-ignore-output"]
layout_memory_figure(rows70, LIMIT, title="Llama 3 70B on 1024 H100s: the 16 fastest layouts")

# %% [markdown]
# ## 5. Beside what was published
#
# The Llama 3 paper trained 405B on 16,384 H100s with **TP 8, CP 1, PP 16, DP 128** (sequence 8192,
# 16 M tokens a step), and for long context **TP 8, CP 16, PP 16, DP 4** (sequence 131,072); it
# reports about 400 TFLOPS per GPU (38-43 % of peak). torchtitan's `docs/performance.md` gives
# measured memory per GPU for Llama 3.1 on H100s. The planner's row for each published layout:

# %% tags=["nbval-ignore-output"]
published = planner.published_layouts()
for case in published:
    rows = planner.plan(case["model"], case["gpus"], **case["plan"])
    case["row"] = row = next(r for r in rows if planner.key(r) == case["layout"])
    print(f"{case['source']:<40} {case['model'].name:<12} tp{row['tp']} cp{row['cp']} pp{row['pp']} dp{row['dp']:<4}"
          f" | GiB/GPU: plan {row['total'] / GiB:5.1f}, published {case['memory_gib'] or '-':>4}"
          f" | tokens/GPU/s: plan {row['tokens_per_gpu_s']:5.0f}, published {case['tps'] or '-':>4}")

# %% [markdown]
# * **The Llama 3 paper's 405B layouts fit** 80 GB in the plan with full recomputation (as planned
#   here); with selective recomputation the first stage's 16 micro-batches of activations do not.
# * **torchtitan's memory differs both ways.** For 8B with "selective" checkpointing the plan is
#   *higher*: our selective keeps every matmul input, torchtitan's op-level selective checkpointing
#   recomputes more. With full checkpointing the plan is *lower*: torchtitan reports the allocator's
#   peak, which holds the one layer being recomputed with all its activations, the FSDP-gathered
#   bf16 parameters in flight, the cross-entropy's temporaries at long sequences, and workspace
#   and fragmentation; the plan counts the tensors kept between layers only.
# * **Tokens per GPU per second** agree within a factor of about two: the plan assumes 40 % of peak
#   for every matmul; torch.compile, Float8 and small micro-batches move that either way.

# %% expect=["the paper's 405B layout fits 80 GiB in the plan (full recomputation): True", "planner's fastest fitting 405B layout: tp 4, cp 16, pp 8, dp 32"]
rows405 = planner.plan(LLAMA3_405B, 16384, seq=8192, global_batch=2048, recompute="full")
paper = next(r for r in rows405 if planner.key(r) == (8, 1, 16, 128))
print(f"the paper's 405B layout fits 80 GiB in the plan (full recomputation): {paper['total'] <= LIMIT}")
print("planner's fastest fitting 405B layout: tp {}, cp {}, pp {}, dp {}".format(
    *planner.fastest_fitting(rows405, LIMIT)))

# %% [markdown]
# The planner prefers context parallelism 16 where Meta used tensor parallelism 8 and no context
# parallelism at 8 K tokens. That is the cost model talking: it prices CP as one all-gather of K
# and V per layer and charges nothing for the attention work CP splits unevenly (causal masks:
# later chunks do more work), for its extra kernels, or for the smaller matmuls. Meta measured;
# the plan estimates.
#
# ## 6. What a plan can and cannot tell
#
# * **It can**: which layouts cannot fit (the accounting is exact for the tensors it counts; lesson
#   13 measured it byte for byte on small layers), how memory moves with each dimension, which
#   collectives each dimension adds and over which links, and a first ranking.
# * **It cannot**: compute anything (no values: it cannot find a numerical bug), see the allocator
#   (fragmentation, workspace, caches), know real kernel efficiency, overlap, congestion, stragglers
#   or failures. Its times are a model, not a measurement: run the top few layouts for real.
#
# ## Exercise 1: the fastest layout that fits
#
# From `rows70` (Llama 3 70B, 1024 GPUs), which layout fits 80 GiB per GPU and has the shortest
# modelled step? Filter, then rank.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
choice = ...   # (tp, cp, pp, dp)

print(checks.check_plan_choice(choice, rows70, LIMIT))

# %% [markdown] expect=["Correct: (1, 16, 8, 8) is the fastest layout that fits 80 GiB per GPU."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# # Keep the rows whose memory per GPU fits, then take the one with the shortest modelled step.
# fits_80 = [row for row in rows70 if row["total"] <= LIMIT]
# choice_solution = planner.key(min(fits_80, key=lambda row: row["step_time"]))
# print(checks.check_plan_choice(choice_solution, rows70, LIMIT))
# ```
#
# </details>

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
# than 80 GiB. Read its bar below: which label is largest?

# %% tags=["nbval-ignore-output"]
oom = next(r for r in rows8 if planner.key(r) == (1, 1, 1, 1024))
layout_memory_figure([oom], LIMIT, title="Llama 3 8B, tp 1 cp 1 pp 1 dp 1024")

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
reason = ...   # "parameters", "gradients", "optimizer_state" or "activations"

print(checks.check_out_of_memory_reason(reason, oom, LIMIT))

# %% [markdown] expect=["Correct: activations (46.9 GiB) is what overflows 80 GiB in layout (1, 1, 1, 1024)."] tags=["solution"]
# <details><summary>Solution of exercise 3 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 3.
# # 32 layers of 2 sb (6h + 2h kv/a + 4 ffn) bytes at s = 8192, plus the logits (about 47 GiB), more
# # than the fp32 gradients (30 GiB). Context parallelism 2 (or full recomputation) brings it under
# # 80 GiB; ZeRO would not, since the optimizer state is already sharded 1024 ways.
# reason_solution = "activations"
# print(checks.check_out_of_memory_reason(reason_solution, oom, LIMIT))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * A plan is accounting: model states (`2 + 4 + 12/(dp cp)` bytes per parameter here), activations
#   per layer divided by `tp x cp`, and the in-flight micro-batches of the pipeline; filter by memory
#   first, then rank by modelled time.
# * Small models fit almost anywhere and want the least communication; large ones are forced into
#   tensor and pipeline parallelism by memory; long sequences call for context parallelism.
# * A plan ranks candidates; it does not measure them. Published layouts differ from the plan's
#   first choice where the cost model is simplest: run the top few for real before committing.
