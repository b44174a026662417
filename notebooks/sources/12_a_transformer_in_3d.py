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
# # Lesson 12: A transformer block in 3-D
#
# **Goal:** train one transformer block (attention, MLP, two LayerNorms) for a step on 8 ranks
# with tensor + sequence parallelism, data parallelism and a 2-stage pipeline at once, check the
# loss and every gradient against one device, and find out, for every way of splitting 8 ranks,
# how much memory each rank needs and how long the step takes on an NVLink node and on an
# InfiniBand cluster.
#
# The pieces are the earlier lessons': the tensor-parallel MLP (lesson 4) and attention with
# heads split over ranks, wrapped in Megatron's *sequence parallelism*: between the sublayers
# the activations stay sharded by sequence, an all-gather (backward: reduce-scatter) enters
# each sublayer and a reduce-scatter (backward: all-gather) leaves it.

# %%
import math
import torch
import torch.nn.functional as F
import simcomm
from simcomm import memory
import simcomm.lessons.lesson_12 as check
from simcomm.planning import layout_choice
from simcomm.viz import scaling as figures
from simcomm.parallel.mesh import Layout
from simcomm.models.transformer import SHARDING, assemble_grads, loss, make_block, shard_block
from simcomm.viz import use_export_renderer
use_export_renderer()   # figures live in JupyterLab and survive an HTML export

world_size, batch, seq, hidden, ffn, heads = 8, 8, 32, 128, 512, 8
world = simcomm.configured_backend(world_size)
params = make_block(hidden, ffn, seed=0)                                   # float64
gen = torch.Generator().manual_seed(1)
x, weights = (torch.randn(batch, seq, hidden, dtype=torch.float64, generator=gen) for _ in range(2))

# %% [markdown]
# ## 1. Eight ranks on a 3-D mesh
#
# A `Layout(pp=..., dp=..., tp=...)` with `pp * dp * tp = 8`, each size by name. Tensor-parallel
# ranks are neighbours (they talk the most, so they should share the fastest links), then data
# parallel, then the pipeline stage: rank = `(stage * dp + d) * tp + t`, the row-major order in
# which torch's `init_device_mesh` numbers a mesh of shape `(pp, dp, tp)`. Each axis is a set of
# subgroups (`layout.groups(dim)`, the partition `comm.subgroup` takes):

# %% expect=["rank 0: stage 0, d 0, t 0", "rank 1: stage 0, d 0, t 1", "rank 2: stage 0, d 1, t 0", "rank 3: stage 0, d 1, t 1", "rank 4: stage 1, d 0, t 0", "rank 5: stage 1, d 0, t 1", "rank 6: stage 1, d 1, t 0", "rank 7: stage 1, d 1, t 1", "tp groups [[0, 1], [2, 3], [4, 5], [6, 7]]; dp groups [[0, 2], [1, 3], [4, 6], [5, 7]]; stage pairs [[0, 4], [1, 5], [2, 6], [3, 7]]"]
layout = Layout(pp=2, dp=2, tp=2)
for rank in range(world_size):
    stage, d, t = layout.coordinates(rank)
    print(f"rank {rank}: stage {stage}, d {d}, t {t}")
print(f"tp groups {layout.groups('tp')}; dp groups {layout.groups('dp')}; stage pairs {layout.groups('pp')}")

# %% [markdown]
# ## 2. One step, equal to one device
#
# The block is `h = x + attention(LN1(x)) @ wo.T + bo`, then `out = h + gelu(LN2(h) @ w1.T + b1) @ w2.T + b2`,
# and the loss `sum(out * weights)`. We build its step from the bottom up.
#
# **The sublayers, tensor + sequence parallel.** Between the sublayers each tp rank holds a
# sequence shard `(b, S/tp, H)`. A sublayer runs LayerNorm on the shard, all-gathers the
# sequence, applies its column-parallel layer (this rank's heads of wq/wk/wv, its rows of w1)
# and its row-parallel layer (its columns of wo, w2), whose partial sums the reduce-scatter adds
# up and shards by sequence again. Their backward passes are the duals: reduce-scatter for the
# all-gather, all-gather for the reduce-scatter.

# %%
def heads_attention(y, wq, wk, wv, head_dim):
    """Causal attention of y (b, s, H) for the heads whose rows of wq, wk, wv are given."""
    b, s, _ = y.shape
    q, k, v = ((y @ w.T).view(b, s, -1, head_dim).transpose(1, 2) for w in (wq, wk, wv))  # (b, heads, s, hd)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)                              # (b, heads, s, s)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)                   # (b, s, heads * hd)

def sharded_attention(tp, x, p, head_dim):
    y = F.layer_norm(x, x.shape[-1:], p["ln1_w"], p["ln1_b"])            # (b, S/tp, H)
    y = tp.all_gather(y, dim=1)                                           # (b, S, H)
    heads_out = heads_attention(y, p["wq"], p["wk"], p["wv"], head_dim)   # (b, S, H/tp): my heads
    return x + tp.reduce_scatter(heads_out @ p["wo"].T, dim=1) + p["bo"]  # (b, S/tp, H)

def sharded_mlp(tp, h, p):
    y = tp.all_gather(F.layer_norm(h, h.shape[-1:], p["ln2_w"], p["ln2_b"]), dim=1)  # (b, S, H)
    partial = F.gelu(y @ p["w1"].T + p["b1"]) @ p["w2"].T                            # (b, S, H), a share
    return h + tp.reduce_scatter(partial, dim=1) + p["b2"]                           # (b, S/tp, H)

# %% [markdown]
# **The pipeline.** With pp = 2, stage 0 runs the attention sublayer and stage 1 the MLP
# sublayer: `h` goes forward with `send`, its gradient comes back with `recv`, and each stage
# waits while the other works (one micro-batch: the bubble of lesson 8). With pp = 1 a rank runs
# both. Each matmul is declared to the trace (`comm.compute(flops=...)`, backward twice the
# forward), so that the cost model can time the step:

# %%
def run_stages(comm, tp, stage, partner, x, weights, shards, head_dim, flops):
    """This rank's stage, forward and backward (partner: the other stage's rank, None if pp = 1).
    Returns its share of the loss, 0 on stage 0 of two."""
    attention_flops, mlp_flops = flops
    if partner is None or stage == 0:
        h = sharded_attention(tp, x, shards, head_dim)                   # (b, S/tp, H)
        comm.compute(flops=attention_flops)
    if partner is not None and stage == 0:
        comm.send(h.detach(), partner)                                   # h to stage 1 ...
        grad_h = comm.recv(h.shape, h.dtype, partner)                    # ... dloss/dh back
        comm.compute(flops=2 * attention_flops)
        h.backward(grad_h)
        return torch.zeros((), dtype=x.dtype)
    if partner is not None:
        h = comm.recv(x.shape, x.dtype, partner).requires_grad_()        # stage 1: h from stage 0
    out = sharded_mlp(tp, h, shards)
    comm.compute(flops=mlp_flops)
    part = (out * weights).sum()                                         # my share of the loss
    comm.compute(flops=2 * (mlp_flops + (attention_flops if partner is None else 0)))
    part.backward()
    if partner is not None:
        comm.send(h.grad, partner)                                       # dloss/dh to stage 0
    return part.detach()

# %% [markdown]
# **The gradients.** A parameter's gradient must be summed over the ranks that hold a copy of
# it and saw different data. The LayerNorm weights and output biases are whole on every tp rank
# (`SHARDING[name]` says which dimension tp splits, `None`: none), but each rank saw only its
# sequence shard: they are all-reduced over the tp group. Every gradient is then all-reduced
# over the dp group (other batch rows). Each sum is one flat all-reduce, one bucket:

# %%
def sync(group, grads):
    """Sum grads over group in one flat all-reduce."""
    if not grads or group.world_size == 1:
        return grads
    total = group.all_reduce(torch.cat([g.flatten() for g in grads]))
    return [part.view_as(g) for part, g in zip(total.split([g.numel() for g in grads]), grads)]

def sync_grads(tp, dp, shards):
    names = list(shards)
    replicated = [n for n in names if SHARDING[n][1] is None]            # whole on every tp rank
    tp_synced = dict(zip(replicated, sync(tp, [shards[n].grad for n in replicated])))
    grads = [tp_synced.get(n, shards[n].grad) for n in names]
    with memory.label("gradients"):
        return dict(zip(names, sync(dp, grads)))

# %% [markdown]
# **The step.** Each rank finds its coordinates and its two subgroups, clones its shards of the
# parameters (`shard_block`: its stage's, split by tp), takes its batch rows (dp) and sequence
# shard (tp), runs its stage and synchronises its gradients:

# %%
def block_step(comm, x, weights, params, heads, layout):
    (batch, seq, hidden), ffn = x.shape, params["w1"].shape[0]
    stage, d, t = layout.coordinates(comm.rank)
    tp, dp = comm.subgroup(layout.groups("tp")), comm.subgroup(layout.groups("dp"))
    with memory.label("parameters"):
        shards = shard_block(params, layout, comm.rank)
    b, s = batch // layout.dp, seq // layout.tp
    mine = (slice(d * b, (d + 1) * b), slice(t * s, (t + 1) * s))          # my rows, my sequence shard
    flops = ((8 * b * seq * hidden * hidden + 4 * b * seq * seq * hidden) / layout.tp,   # q, k, v, o; scores, AV
             4 * b * seq * hidden * ffn / layout.tp)                                  # w1, w2
    partner = layout.rank(pp=1 - stage, dp=d, tp=t) if layout.pp == 2 else None
    part = run_stages(comm, tp, stage, partner, x[mine], weights[mine], shards, hidden // heads, flops)
    return {"coords": (stage, d, t), "loss": part, "grads": sync_grads(tp, dp, shards)}

# %% [markdown]
# The step gives the single-device loss (the ranks' shares add up to it) and every gradient.
# (The library keeps the same step, `simcomm.models.transformer.block_step`, which also checks
# that the layout fits the block; section 3 and later lessons use it, and a test checks that the
# two agree: loss, gradients, the collectives they call and the memory they hold.)

# %% expect=["Layout(pp=2, dp=2, tp=2): loss and all 13 gradients match the single-device block"]
leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
reference = loss(x, weights, leaves, heads)
reference.backward()
outs = world.run(block_step, x, weights, params, heads, layout)
check.assert_close(sum(o["loss"] for o in outs), reference.detach(), "loss", atol=1e-9)
grads = assemble_grads(outs, layout)                     # the shards put back together
check.assert_close(grads, {name: p.grad for name, p in leaves.items()}, "gradients", atol=1e-9)
print(f"{layout}: loss and all {len(grads)} gradients match the single-device block")

# %% [markdown]
# The collectives of one step, on rank 0 (the simulator's trace):

# %% expect=["all_gather on (0, 1): forward 1, backward 1", "reduce_scatter on (0, 1): forward 1, backward 1", "send on (0, 1, 2, 3, 4, 5, 6, 7): forward 1, backward 0", "recv on (0, 1, 2, 3, 4, 5, 6, 7): forward 1, backward 0", "all_reduce on (0, 1): forward 1, backward 0", "all_reduce on (0, 2): forward 1, backward 0"]
sim = simcomm.World(world_size)
sim.run(block_step, x, weights, params, heads, layout)
calls = {}
for event in sim.trace.filter(rank=0).events:
    if event.op not in ("compute", "subgroup"):
        calls.setdefault((event.op, event.group), {"forward": 0, "backward": 0})[event.phase] += 1
for (op, group), count in calls.items():
    print(f"{op} on {group}: forward {count['forward']}, backward {count['backward']}")

# %% [markdown]
# Rank 0 is in stage 0 (attention): one all-gather in, one reduce-scatter out, each with its
# dual in the backward pass; the LayerNorm/bias all-reduce on its tp group `(0, 1)`, the
# gradient all-reduce on its dp group `(0, 2)`; the activation to rank 4 and its gradient back.
#
# ## 3. Every layout of 8 ranks: memory and modelled step time
#
# `layout_choice.layout_table` runs the step for each layout on virtual ranks with memory
# tracking, checks it against one device, and models the step on two machines: one H100 node
# (NVLink for every group) and an H100 InfiniBand cluster with the 8 ranks spread 2 per node
# (a group of ranks `2i, 2i+1` stays on NVLink; anything larger crosses InfiniBand).

# %% tags=["nbval-ignore-output"]
rows = layout_choice.layout_table(x, weights, params, heads)
assert all(row["max_error"] < 1e-9 for row in rows)
print(f"{'tp dp pp':>9} | {'peak memory/rank':>16} | {'NVLink node':>11} | {'InfiniBand cluster':>18}")
for row in rows:
    print(f"{row['tp']:3}{row['dp']:3}{row['pp']:3} | {row['peak_bytes'] / 2**20:12.2f} MiB | "
          f"{row['NVLink node'] * 1e6:8.1f} us | {row['InfiniBand cluster'] * 1e6:15.1f} us")

# %% tags=["nbval-ignore-output"]
figures.layout_figure(rows, list(layout_choice.TOPOLOGIES))

# %% [markdown]
# Which layout wins, and why:

# %% expect=["fastest on the NVLink node: Layout(pp=1, dp=8, tp=1); on the InfiniBand cluster: Layout(pp=1, dp=8, tp=1)", "least memory per rank: Layout(pp=1, dp=2, tp=4)"]
fastest = {name: min(rows, key=lambda row: row[name]) for name in layout_choice.TOPOLOGIES}
least = min(rows, key=lambda row: row["peak_bytes"])
print(f"fastest on the NVLink node: {fastest['NVLink node']['layout']}; "
      f"on the InfiniBand cluster: {fastest['InfiniBand cluster']['layout']}")
print(f"least memory per rank: {least['layout']}")

# %% [markdown]
# * **Time.** At this size a step is tens of microseconds and every collective pays a fixed
#   latency. Pure data parallelism issues one all-reduce per step; tensor + sequence parallelism
#   adds two blocking collectives per sublayer forward and two backward, on the critical path.
#   So dp = 8 wins on both machines. On the cluster every call that leaves a node is slower, and
#   tp >= 4 puts all tensor-parallel traffic on InfiniBand: those layouts lose the most.
# * **Memory.** dp = 8 replicates every weight, gradient and the full-sequence activations
#   of its batch row; tp = 4 splits the weights and the activations four ways and needs about a
#   quarter. (tp = 8 gains nothing more here: with 32 tokens each rank keeps 4, while the
#   gathered full-sequence activations of all 8 batch rows do not shrink.)
# * **Pipeline.** pp = 2 halves the weights per rank and the size of the dp all-reduce, but with
#   a single micro-batch each stage waits for the other (the bubble).
#
# The widget runs the step for the layout you choose and draws its modelled timeline (compute
# and communication lanes per rank). Below it, the default layout's figure as drawn when the
# cell ran, which a static export keeps.

# %% tags=["nbval-ignore-output"]
explorer = figures.LayoutExplorer(x, weights, params, heads, [row["layout"] for row in rows],
                                  layout_choice.TOPOLOGIES, layout=layout)
display(explorer.panel)
explorer.figure

# %% [markdown]
# ## Exercise 1: mesh coordinates
#
# Write `coords(rank, *, pp, dp, tp)` returning `(stage, d, t)` for the layout above (tensor
# parallel innermost, then data parallel, then the pipeline stage); the sizes come by name.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def coords_of(rank, *, pp, dp, tp):
    raise NotImplementedError   # (stage, d, t)

print(check.check_mesh_coords(coords_of))

# %% [markdown] expect=["Correct: mesh coordinates for 5 layouts, every rank."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# def coords_solution(rank, *, pp, dp, tp):
#     return rank // (tp * dp), (rank // tp) % dp, rank % tp
#
# print(check.check_mesh_coords(coords_solution))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 2: choose a layout for a memory limit
#
# Each rank may hold at most `memory_limit` bytes (the measured peak of the table above). Which
# layout gives the shortest step on the InfiniBand cluster? Read it from `rows` (or the table);
# then say why it beats the other layouts that fit.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
memory_limit = sorted(row["peak_bytes"] for row in rows)[4] + 1     # five of the seven layouts fit
choice = ...   # Layout(pp=..., dp=..., tp=...), or a row's row["layout"]

print(check.check_layout_choice(choice, rows, memory_limit, "InfiniBand cluster"))

# %% [markdown] expect=["Correct: the fastest layout that fits, on the InfiniBand cluster."] tags=["solution"]
# <details><summary>Solution of exercise 2 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 2.
# fitting = [row for row in rows if row["peak_bytes"] <= memory_limit]
# best = min(fitting, key=lambda row: row["InfiniBand cluster"])
# choice_solution = best["layout"]
# print(check.check_layout_choice(choice_solution, rows, memory_limit, "InfiniBand cluster").split(":")[0]
#       + ": the fastest layout that fits, on the InfiniBand cluster.")
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * A 3-D layout is three sets of subgroups; each parameter's gradient is summed over exactly
#   the ranks that hold a copy of it and saw different data: the dp group for every weight, and
#   the tp group too for the weights that sequence parallelism replicates (LayerNorms, biases).
# * Composed correctly, the 8-rank step gives the single-device loss and gradients, whatever
#   the layout.
# * At this lesson's size (32 tokens, a step of tens of microseconds) data parallelism is the
#   fastest while the model fits, and tensor parallelism buys memory with many latency-bound
#   collectives. That is a statement about latency: with thousands of tokens per rank its
#   collectives become bandwidth-bound and run beside large matrix multiplications, and tensor
#   parallelism inside a node is how large models train (Megatron-LM). Wherever it is used, it
#   belongs inside a node; a pipeline halves weights and the
#   gradient all-reduce but idles without enough micro-batches. The memory limit picks the
#   candidates, the interconnect picks the winner.

# %%
world.close()
