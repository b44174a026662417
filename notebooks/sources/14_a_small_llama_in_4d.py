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
# # Lesson 14: A small Llama in 4-D, trained against one device
#
# **Goal:** train one real model, a small Llama, for 100 steps with all four parallelisms at once
# (data parallelism with FSDP, a 1F1B pipeline, context parallelism, tensor + sequence +
# vocabulary parallelism) on 16 virtual ranks, and check that the loss at **every step** is the
# loss of the same training on one device in float64; then checkpoint it with
# `torch.distributed.checkpoint` and resume on a different layout, with the loss continuing exactly.
#
# This is the test every distributed training has to pass: one that does not reproduce the
# single-device loss curve has a bug, however fast it runs. Lessons 4-12 took each parallelism
# alone; here they run together on one model, and every collective of lessons 1-3 is in play.

# %%
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard
from simcomm import configured_backend
from simcomm.backend import backend_name
import simcomm.lessons.lesson_14 as check
from simcomm.models import llama, llama_pipeline, llama_training as lt
from simcomm.parallel import llama_fsdp
from simcomm.parallel.mesh import Layout
from simcomm.parallel.pipeline import schedule
from simcomm.viz import use_export_renderer
from simcomm.viz.loss_curves import loss_curves
use_export_renderer()   # figures live in JupyterLab and survive an HTML export

torch.set_num_threads(1)          # matrices of 32 x 64: one thread is fastest, and the cores are shared
sim = backend_name() == "sim"
# 16 virtual ranks; on real workers (gloo processes sharing this machine's 2 cores) 8 ranks, fewer steps:
# the pipeline, context and tensor parallelism of the 4-D run (section 2 runs FSDP on them)
layout = (Layout(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2) if sim
          else Layout(pp=2, dp_replicate=1, dp_shard=1, cp=2, tp=2))
steps = 100 if sim else 10
world = configured_backend(layout.world_size)      # SIMCOMM_BACKEND: virtual ranks or real processes

# %% [markdown]
# ## 1. The model, the corpus and the oracle
#
# `llama` is a Llama-style decoder written for this course (`simcomm/models/llama.py`; its
# functional form is about 250 lines): RMSNorm, rotary position embeddings, grouped-query attention (4 query heads share
# 2 key/value heads), a SwiGLU feed-forward, an untied output layer. Its single-device form
# `llama.loss` is the oracle; `llama.tp_loss` is the same function with Megatron's tensor +
# sequence parallelism, including a **vocabulary-parallel embedding and cross-entropy**: each
# tensor rank holds `V/t` rows of the embedding and of the output layer, and the cross-entropy
# is computed from the logits shard `(s, V/t)` with three all-reduces of one number per token
# (max, sum of exponentials, the target's logit), so the logits are never gathered.
#
# **Why this model and not torchtitan's?** torchtitan's Llama runs on virtual ranks too, but its
# `parallelize` functions apply DTensor plans, FSDP2 hooks and `torch.distributed.pipelining`:
# the collectives happen inside hooks and DTensor dispatch, out of sight. Here every collective
# is a line of the model you can read, run on one device in float64 for the oracle, and change in
# an exercise. The architecture is torchtitan's (lesson 15 plans the real Llama 3 shapes).
#
# The corpus is generated and deterministic: 32 sequences of 17 tokens from a seeded Markov chain
# in which every token has 4 likely successors, so there is something to learn: the loss starts
# near 4.6 (above `log 64 = 4.16`, a uniform guess) and falls below `log 4 = 1.39`, the chain's own
# entropy, because 32 sequences are also learnt by heart. Each data-parallel rank reads its sequences through
# `torch.utils.data.DistributedSampler`; the global batch is 4 sequences a step.

# %%
config = llama.Config()                           # vocab 64, hidden 32, 4 heads / 2 KV heads, ffn 64, 2 layers
data = lt.corpus(config, sequences=32, length=17)
params = llama.init_params(config)                # float64
reference = lt.reference_losses(data, params, config, dp=2, steps=steps + 10, global_batch=4)
print(f"{sum(p.numel() for p in params.values()):,} parameters; one device, float64: loss "
      f"{reference[0]:.3f} at step 0, {reference[steps - 1]:.3f} at step {steps - 1}")

# %% [markdown]
# `reference_losses` is plain PyTorch on one device: the loss of the global batch,
# `torch.nn.utils.clip_grad_norm_(max_norm=1)`, `torch.optim.Adam`. Everything below is checked
# against it.
#
# ## 2. Data parallelism with FSDP, and HSDP
#
# Plain data parallelism keeps every parameter and its Adam state on every data-parallel rank.
# **FSDP** (ZeRO-3) keeps `1/dp` of each: `llama_fsdp.piece` flattens a parameter (already a
# tensor shard), pads it to a multiple of the shard count and keeps one piece. Before each
# micro-batch's forward, `llama_fsdp.unshard` concatenates a stage's pieces and all-gathers them
# in **one** collective (FSDP2 does the same per module); the communicator's all-gather is
# differentiable, and its backward is a reduce-scatter, which *is* FSDP's gradient
# reduce-scatter: each piece's gradient arrives summed over the shard group. Adam is elementwise,
# so Adam on the pieces is Adam, and its state is sharded too.
#
# **HSDP** puts the data-parallel ranks on a 2-D `(replicate, shard)` mesh: shard within a group
# of `fsdp` ranks (one node, fast links), and all-reduce the pieces' gradients across the
# replicas. The mesh is the one of lessons 12 and 15, `simcomm.parallel.mesh.Layout`, with the
# data dimension split as torchtitan splits it: `Layout(pp=, dp_replicate=, dp_shard=, cp=, tp=)`
# numbers the ranks as `init_device_mesh` numbers a `("pp", "dp_replicate", "dp_shard", "cp", "tp")`
# mesh (row-major: pipeline outermost, tensor innermost; `dp = dp_replicate x dp_shard`, and the
# data-parallel index is `replica * dp_shard + shard`). `dp_shard = 1` is plain data parallelism,
# `dp_replicate = 1` FSDP. `layout.groups("dp_shard")` are the FSDP groups,
# `layout.groups("dp_replicate", "cp")` the ranks the gradients are all-reduced over.
#
# Why not `torch.distributed.fsdp.fully_shard` (lesson 7 runs it on virtual ranks)? Its hooks
# fire on `nn.Module` forward and backward and expect DTensor tensor parallelism; this model's
# stages are functions of hand-sharded tensors driven by a hand-written 1F1B schedule. The
# mechanism (`Shard(0)` pieces, one all-gather per group, a reduce-scatter in backward) is the
# same, in one short file you can read (`simcomm/parallel/llama_fsdp.py`).
#
# A few steps of each on the world's ranks with `tp = 2`, against one device:

# %% expect=["plain DP: every step equals one device within 1e-12", "FSDP: every step equals one device within 1e-12", "HSDP: every step equals one device within 1e-12", "FSDP keeps 1/dp of what plain DP keeps on each rank (padding aside); HSDP 1/fsdp"]
dp = layout.world_size // 2
held = {}
for name, shards in (("plain DP", 1), ("FSDP", dp), ("HSDP", 2)):
    data_layout = Layout(dp_replicate=dp // shards, dp_shard=shards, tp=2)
    outs = world.run(lt.train, data, params, config, layout=data_layout, steps=2, global_batch=dp)
    expected = lt.reference_losses(data, params, config, dp=dp, steps=2, global_batch=dp)
    assert all((out["losses"] - expected).abs().max() < 1e-12 for out in outs)
    held[name] = outs[0]["held"]
    assert held[name] == lt.held_numel(config, data_layout, 0)
    print(f"{name}: every step equals one device within 1e-12")
for name, shards in (("FSDP", dp), ("HSDP", 2)):     # each parameter's piece is padded by < 1 element
    assert held["plain DP"] / shards <= held[name] < held["plain DP"] / shards + len(params)
print("FSDP keeps 1/dp of what plain DP keeps on each rank (padding aside); HSDP 1/fsdp")

# %% [markdown]
# ## 3. The 1F1B pipeline inside the training loop
#
# With `pp = 2` stage 0 holds the embedding and layer 0, stage 1 layer 1, the final norm and the
# output layer (`llama_pipeline.stage_names`). A data-parallel rank's sequences of a step are the
# micro-batches; `llama_pipeline.stage_step` runs them in lesson 8's 1F1B order, sending the
# sequence-parallel shard `(s / (cp t), h)` from tensor rank `t` of one stage to tensor rank `t`
# of the next, and the gradient back. The order of each stage, for 2 stages and 2 micro-batches:

# %% expect=["stage 0: F0 F1 B0 B1", "stage 1: F0 B0 F1 B1"]
for stage, plan in enumerate(schedule("1f1b", 2, 2)):
    print(f"stage {stage}: " + " ".join(f"{kind}{index}" for kind, index in plan))

# %% [markdown]
# ## 4. All four at once, 100 steps
#
# Here is the 4-D training, put together from the pieces of sections 1-3. Each rank first makes
# its subgroups of the 5-D mesh, one per job:

# %%
def mesh_groups(comm, layout):
    return {"tensor": comm.subgroup(layout.groups("tp")), "context": comm.subgroup(layout.groups("cp")),
            "pipe": comm.subgroup(layout.groups("pp")), "shard": comm.subgroup(layout.groups("dp_shard")),
            "replicate": comm.subgroup(layout.groups("dp_replicate", "cp")),   # gradients all-reduced over these
            "data_context": comm.subgroup(layout.groups("dp", "cp"))}          # loss parts summed over these

# %% [markdown]
# and keeps its parameters: its stage's (section 3), its tensor shard of each (section 1), and
# under FSDP its flat piece of that (section 2). `shapes` remembers each tensor shard's shape,
# which `unshard` needs to put the pieces back together:

# %%
def stage_leaves(params, config, layout, rank):
    stage, t = layout.coordinate(rank, "pp"), layout.coordinate(rank, "tp")
    fsdp, shard = layout.dp_shard, layout.coordinate(rank, "dp_shard")
    names = llama_pipeline.stage_names(config, stage, layout.pp)                 # this stage's parameters
    full = llama.shard_params(params, config, t, layout.tp)                      # tensor shards
    shapes = {n: full[n].shape for n in names}
    leaves = {n: llama_fsdp.piece(full[n], shard, fsdp).requires_grad_() if fsdp > 1
              else full[n].clone().requires_grad_() for n in names}              # FSDP: one piece each
    return leaves, shapes

# %% [markdown]
# One step: the 1F1B pipeline runs the rank's sequences as micro-batches, forward and backward
# (under FSDP each micro-batch's forward first gathers the stage's pieces); the loss parts are
# summed. Then the gradients: all-reduced over the replicas and context ranks (one bucket), the
# RMSNorm weights' parts summed over the tensor ranks too (each saw its sequence shard only),
# **global gradient-norm clipping** as `torch.nn.utils.clip_grad_norm_` does it, by
# `min(1, max_norm / norm)`, and Adam. The norm of the whole model's gradient, from shards, pieces
# and stages, is exercise 1: until you have written it, `lt.grad_norm_sq` computes it.

# %%
def train_step(groups, layout, leaves, shapes, optimizer, sequences, config, global_batch, max_norm):
    optimizer.zero_grad()
    stage_params = (lambda: llama_fsdp.unshard(groups["shard"], leaves, shapes)) if layout.dp_shard > 1 else leaves
    local = llama_pipeline.stage_step(groups["pipe"], groups["tensor"], sequences, stage_params, config,
                                      global_batch, groups["context"] if layout.cp > 1 else None)   # 1F1B
    loss = groups["pipe"].all_reduce(groups["data_context"].all_reduce(local))   # the last stage holds it
    with torch.no_grad():
        names = list(leaves)
        grads = dict(zip(names, llama_fsdp.all_reduce_bucket(groups["replicate"], [leaves[n].grad for n in names])))
        norms = [n for n in names if n.split(".")[-1] in llama.REPLICATED]       # RMSNorm weights: whole
        grads.update(zip(norms, llama_fsdp.all_reduce_bucket(groups["tensor"], [grads[n] for n in norms])))
        for name in names:
            leaves[name].grad = grads[name]
        norm_sq = lt.grad_norm_sq(groups["tensor"], groups["shard"], groups["pipe"], grads, norms)   # exercise 1
        coefficient = torch.clamp(max_norm / (norm_sq.sqrt() + 1e-6), max=1.0)
        for leaf in leaves.values():
            leaf.grad.mul_(coefficient.to(leaf.grad.dtype))
    optimizer.step()
    return loss

# %% [markdown]
# After the last step the training can write a **checkpoint** that any other layout can resume
# from (section 5). Each stage's tensor shards and Adam's two moments become DTensors on the
# stage's `(dp_replicate, dp_shard, cp, tp)` sub-mesh (FSDP pieces gathered first, so the file does
# not depend on `dp_shard`): a DTensor says how its local tensor lies in the whole one, along each
# mesh dimension `Replicate()` (the same on every rank) or `Shard(dim)` (a slice along `dim`: rows,
# or columns for `wo` and `w_down`, over the tensor ranks). `torch.distributed.checkpoint` (DCP)
# writes each whole tensor once, from its pieces, with Adam's step count:

# %%
STAGE_DIMS = ("dp_replicate", "dp_shard", "cp", "tp")

def stage_mesh(layout):          # this stage's 4-D sub-mesh, every dimension present (size 1 or not)
    full = Layout(pp=layout.pp, **{dim: layout.size(dim) for dim in STAGE_DIMS})
    return full.device_mesh("cpu")[STAGE_DIMS]

def placement(name):             # along (dp_replicate, dp_shard, cp, tp)
    kind = name.split(".")[-1]
    dim = 1 if kind in ("wo", "w_down") else None if kind in llama.REPLICATED else 0
    return [Replicate(), Replicate(), Replicate(), Replicate() if dim is None else Shard(dim)]

def save_checkpoint(path, layout, leaves, optimizer, shard_group, shapes):
    mesh, state = stage_mesh(layout), {}
    for name, leaf in leaves.items():
        moments = optimizer.state[leaf]
        for key, local in (("model", leaf.detach()), ("exp_avg", moments["exp_avg"]),
                           ("exp_avg_sq", moments["exp_avg_sq"])):
            whole = llama_fsdp.gather_piece(shard_group, local, shapes[name])     # FSDP pieces gathered
            state[f"{key}.{name}"] = DTensor.from_local(whole, mesh, placement(name), run_check=False)
        state["step"] = moments["step"].clone()
    dcp.save(state, checkpoint_id=path)

# %% [markdown]
# Loading runs the other way: empty DTensors laid out for *this* layout, which DCP fills from
# the file, whatever layout wrote it (it reshards: reads the slices each rank's pieces need);
# then each rank cuts its FSDP piece and gives the optimizer its moments and step:

# %%
def load_checkpoint(path, layout, leaves, optimizer, shapes, shard, fsdp):
    mesh, state = stage_mesh(layout), {"step": torch.zeros((), dtype=torch.float32)}
    for name in leaves:
        for key in ("model", "exp_avg", "exp_avg_sq"):
            empty = torch.zeros(shapes[name], dtype=leaves[name].dtype)              # my tensor shard's shape
            state[f"{key}.{name}"] = DTensor.from_local(empty, mesh, placement(name), run_check=False)
    dcp.load(state, checkpoint_id=path)                                               # filled in place
    with torch.no_grad():
        for name, leaf in leaves.items():
            mine = {key: llama_fsdp.piece(state[f"{key}.{name}"].to_local(), shard, fsdp).view(leaf.shape)
                    for key in ("model", "exp_avg", "exp_avg_sq")}
            leaf.copy_(mine["model"])
            optimizer.state[leaf] = {"step": state["step"].clone(), "exp_avg": mine["exp_avg"],
                                     "exp_avg_sq": mine["exp_avg_sq"]}

# %% [markdown]
# The training: every step's sequences come from `lt.batches` (a `DistributedSampler` per
# data-parallel rank, section 1). With `load` it first reads a checkpoint that holds `first_step`
# steps, and its data continues where that run stopped (the global batch of a step does not
# depend on the layout). After the last step it can write a checkpoint, and it returns every
# step's loss, the rank's final tensor shards (FSDP pieces gathered) and how many elements it
# kept. (The library's `lt.train`, which section 2 uses, is the same training. A test checks that
# the two agree: losses, shards, checkpoints and the collectives they call.)

# %%
def train(comm, data, params, config, *, layout, steps, global_batch, lr=1e-2, max_norm=1.0, seed=0,
          first_step=0, load=None, save=None):
    groups = mesh_groups(comm, layout)
    leaves, shapes = stage_leaves(params, config, layout, comm.rank)
    optimizer = torch.optim.Adam(leaves.values(), lr=lr)
    if load:
        load_checkpoint(load, layout, leaves, optimizer, shapes, layout.coordinate(comm.rank, "dp_shard"),
                        layout.dp_shard)
    mine = lt.batches(data, first_step + steps, global_batch, layout.dp, layout.coordinate(comm.rank, "dp"),
                      seed)[first_step:]                                   # the steps after the checkpoint's
    losses = [train_step(groups, layout, leaves, shapes, optimizer, [data[i] for i in indices.tolist()], config,
                         global_batch, max_norm) for indices in mine]
    if save:
        save_checkpoint(save, layout, leaves, optimizer, groups["shard"], shapes)
    shards = {n: llama_fsdp.gather_piece(groups["shard"], leaf, shapes[n]) if layout.dp_shard > 1 else leaf.detach()
              for n, leaf in leaves.items()}
    coords = {dim: layout.coordinate(comm.rank, dim) for dim in ("pp", "dp", "cp", "tp")}
    return {"losses": torch.stack(losses).double(), "shards": shards, "coords": coords,
            "held": sum(leaf.numel() for leaf in leaves.values())}

# %% [markdown]
# On 16 virtual ranks: `pp 2 x dp 2 x cp 2 x tp 2`, FSDP over the two data-parallel ranks
# (`dp_shard = 2`). On real workers the layout is `pp 2 x cp 2 x tp 2` (8 gloo processes) for 10
# steps: the same context-parallel attention, across processes (FSDP ran on them in section 2). The tolerance is `1e-10` (float64 sums in a different order differ in the last bits:
# about `1e-14` after 100 steps here).
# The checkpoint of the last step is written too (section 5):

# %% expect=["every step's loss equals one device's within 1e-10"]
checkpoint = tempfile.mkdtemp(prefix="llama4d_")
outs = world.run(train, data, params, config, layout=layout, steps=steps, global_batch=4, save=checkpoint)
losses = outs[0]["losses"]
error = max(float((out["losses"] - reference[:steps]).abs().max()) for out in outs)
assert error < 1e-10 and all(torch.equal(out["losses"], losses) for out in outs)
assert layout.cp > 1 and layout.tp > 1 and layout.pp > 1      # context parallelism on both backends
assert reference[steps - 10:steps].mean() < reference[:10].mean() - 0.5 or not sim     # it learns
print("every step's loss equals one device's within 1e-10")

# %% tags=["nbval-ignore-output"]
print(f"{steps} steps on {layout.world_size} ranks {layout}: largest |loss - one device| = {error:.1e}")

# %% [markdown]
# ## 5. Checkpoint, and resume on another layout
#
# `save` wrote each stage's tensor shards and Adam's moments as DTensors, plus Adam's step, with
# `torch.distributed.checkpoint`. `load` reads them into **any** layout: DCP reshards, and since
# the global batch of a step does not depend on the layout, the data continues where it stopped.
# Resume for 10 steps on HSDP with 4 data-parallel ranks and no context parallelism:

# %% expect=["resumed on another layout: the next 10 losses equal one device's within 1e-10"]
resume = (Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2) if sim
          else Layout(dp_replicate=2, dp_shard=2, tp=2))
resumed = world.run(train, data, params, config, layout=resume, steps=10, global_batch=4, load=checkpoint,
                    first_step=steps)
resume_error = max(float((out["losses"] - reference[steps:]).abs().max()) for out in resumed)
assert resume_error < 1e-10
print("resumed on another layout: the next 10 losses equal one device's within 1e-10")

# %% tags=["nbval-ignore-output"]
print(f"resumed on {resume}: largest |loss - one device| = {resume_error:.1e}")
loss_curves({"one device, float64": reference, f"{layout.world_size} ranks in 4-D": losses,
             f"resumed from the checkpoint on {resume.world_size} ranks": resumed[0]["losses"]},
            first_steps={f"resumed from the checkpoint on {resume.world_size} ranks": steps},
            title="The small Llama: the 4-D training lies on the one-device curve")

# %% [markdown]
# The curves lie on each other: the pale line is one device, the markers the distributed runs.
#
# ## Exercise 1: find the bug
#
# Global gradient-norm clipping multiplies every gradient by `min(1, max_norm / norm)`, where
# `norm` is the norm of the **whole model's** gradient. With tensor parallelism each rank holds
# only shards of most gradients (and the RMSNorm weights whole). This version works on one device;
# run the checker (4 tensor ranks) to see what it does to a sharded model, then fix it. The norm
# must be within a relative `1e-6` of the one-device norm (float32 arithmetic is enough), the same
# on every rank; what a rank needs from another must reach it through a collective.

# %% expect=["Not yet: the ranks disagree on the norm (6.2536, 6.0815, 8.2826, 9.6876): with max_norm = 1 they would clip by (rank 0: 0.16, rank 1: 0.16, rank 2: 0.12, rank 3: 0.10), so the shards are scaled differently and the model is no longer the one-device model", "(Stuck? Run the same check again with show_hint=True for a hint.)"]
def grad_norm(comm, sharded, replicated):
    squares = sum(g.double().pow(2).sum() for g in sharded + replicated)
    return squares.sqrt()

print(check.check_grad_norm(grad_norm))

# %% [markdown] expect=["Correct: every rank computes the norm of the whole gradient, so all clip by the same factor."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# # Each rank summed the squares of its own shards only. Sum the sharded part over the tensor
# # ranks first; the replicated gradients are the same on every rank, so add them once.
# def grad_norm_solution(comm, sharded, replicated):
#     sharded_sq = comm.all_reduce(sum(g.double().pow(2).sum() for g in sharded))
#     return (sharded_sq + sum(g.double().pow(2).sum() for g in replicated)).sqrt()
#
# print(check.check_grad_norm(grad_norm_solution))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 2: predict the memory per rank, DP against FSDP
#
# On the layout of section 4 (`pp 2 x dp 2 x cp 2 x tp 2`), how many bytes of parameters and
# Adam's two moments (float64: 8 bytes each) does rank 0 (stage 0, tensor rank 0) keep between
# steps with plain data parallelism, and with FSDP over the two data-parallel ranks? Work it out
# from the shapes of `llama.init_params` and what each parallelism splits (the tensor shards of
# section 1, the stages of section 3, the pieces of section 2); do not call `lt.held_numel` (the
# checker refuses an answer computed with it). The answer is exact: a whole number of bytes.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
prediction = {"dp": ..., "fsdp": ...}         # bytes on rank 0

print(check.check_held_bytes(prediction))

# %% [markdown] expect=["Correct: rank 0 keeps 136,704 bytes with plain data parallelism and 68,352 with FSDP."] tags=["solution"]
# <details><summary>Solution of exercise 2 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 2.
# # Stage 0 holds the embedding (64 x 32) and layer 0: two norms (32 each, whole on every tensor
# # rank), wq and wo (32 x 32), wk and wv (16 x 32), gate and up (64 x 32), down (32 x 64).
# # Tensor parallelism halves every matrix: 1,024 + 512 + 256 + 256 + 512 + 3 x 1,024 = 5,632,
# # plus 64 for the norms = 5,696 elements. Context parallelism splits no parameter. FSDP over 2
# # halves each again (every size is even: no padding). Parameter + 2 moments = 3 x 8 bytes.
# elements = 64 * 32 // 2 + (32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 64 * 32) // 2 + 2 * 32
# prediction_solution = {"dp": 24 * elements, "fsdp": 24 * elements // 2}
# print(check.check_held_bytes(prediction_solution))
# ```
#
# </details>

# %%
world.close()

# %% [markdown]
# ## Takeaway
#
# * One model, four parallelisms: FSDP (or HSDP) over the data-parallel ranks, a 1F1B pipeline
#   over the layers, context parallelism over the sequence, tensor + sequence + vocabulary
#   parallelism inside each layer. Each is a few collectives; together they are still the same
#   function, and the loss at every one of 100 steps equals one device's in float64 (within
#   `1e-10`; in fact about `1e-14`).
# * FSDP is an all-gather before use whose backward is the gradient reduce-scatter: each rank
#   keeps `1/dp` of the parameters and of Adam's state. HSDP shards within a group and
#   all-reduces across the replicas.
# * Anything computed from a sharded quantity, such as the gradient norm for clipping, must be
#   reduced over every dimension that shards it, counting replicated parts once.
# * A DCP checkpoint of layout-independent tensors (DTensors of the whole parameters) resumes on
#   any layout, and the loss continues exactly.
