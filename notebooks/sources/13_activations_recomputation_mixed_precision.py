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
# # Lesson 13: Activations, recomputation and mixed precision
#
# **Goal:** measure, byte by byte on each rank, what a transformer layer keeps for its backward
# pass, with and without recomputation, against the formula of Korthikanti et al. 2022; see what
# recomputation costs on the modelled timeline; and train in mixed precision as frameworks do
# (bf16 compute, fp32 master weights, Adam and gradient accumulation), with the bytes per rank
# equal to `(2 + 2 + 12) psi` and its ZeRO-sharded forms, and the loss within a stated bf16
# tolerance of the float64 run.
#
# Lessons 6 and 7 counted the *model states* (parameters, gradients, optimizer state). For large
# models with long sequences the *activations* are larger: every tensor the forward pass saves
# for the backward pass stays alive until the backward pass reaches it.

# %%
import torch
from simcomm import World, configured_backend, memory
import simcomm.lessons.lesson_13 as check
from simcomm.model.cost import modelled_timeline
from simcomm.parallel import mixed_precision as mp
from simcomm.planning import activations as act
from simcomm.parallel.zero import MLP, Adam, make_batch, padded, shard
from simcomm.viz.memory import memory_figure
from simcomm.viz.recompute import activation_curve, trade_figure
from simcomm.viz import use_export_renderer
use_export_renderer()   # figures live in JupyterLab and survive an HTML export

tp = 4
world = configured_backend(tp, memory=True)      # SIMCOMM_BACKEND: virtual ranks or real processes

# %% [markdown]
# ## 1. The layer, and what its backward pass needs
#
# A GPT layer: LayerNorm, QKV, attention with `a` heads, projection, dropout, residual; LayerNorm,
# a `4h` MLP with GeLU, dropout, residual. For sequence length `s`, micro-batch `b`, hidden `h`,
# 16-bit activations (2 bytes) and 1-byte dropout masks, Korthikanti et al. count per layer:
#
# | saved for backward | bytes |
# |---|---|
# | attention: QKV input, Q and K, softmax output, its dropout mask, the dropped-out probabilities and V, the projection input, the dropout mask after it | `11 sbh + 5 a s^2 b` |
# | MLP: first input, GeLU input, second input, dropout mask | `19 sbh` |
# | two LayerNorm inputs | `4 sbh` |
# | **total** | **`sbh (34 + 5 a s / h)`** |
#
# With tensor parallelism over `t` ranks *and* sequence parallelism (Megatron: the LayerNorms
# and dropouts run on a sequence shard; a sublayer's first linear all-gathers its input but keeps
# only the shard for backward), every one of these is split: divide by `t`. *Selective*
# recomputation drops the `5 a s^2 b` attention terms (the attention core is recomputed in
# backward): `34 sbh / t`. *Full* recomputation keeps only the layer's input: `2 sbh / t`.
#
# `act.tp_layer` is that layer; first, is it the same function as on one device? In float64,
# two layers on 4 ranks against `act.stack_loss` on one device, for each recomputation mode:

# %% expect=["none: loss and all 24 gradients match one device", "selective: loss and all 24 gradients match one device", "full: loss and all 24 gradients match one device"]
s, b, h, heads = 16, 2, 16, 4
gen = torch.Generator().manual_seed(0)
x, weights = torch.randn(s, b, h, dtype=torch.float64, generator=gen), torch.randn(s, b, h, dtype=torch.float64, generator=gen)
stack = [act.make_layer(h, seed=i) for i in range(2)]
leaves = [{name: p.clone().requires_grad_() for name, p in params.items()} for params in stack]
reference = act.stack_loss(x, weights, leaves, heads)      # one device, no communication
reference.backward()
for mode in act.RECOMPUTE:
    outs = world.run(act.activation_run, x, weights, stack, heads, mode, dtype=torch.float64)
    grads = act.assemble_grads(outs, h)
    assert abs(sum(o["loss"] for o in outs) - reference) < 1e-10
    assert all((grads[i][n] - p.grad).abs().max() < 1e-10 for i, ps in enumerate(leaves) for n, p in ps.items())
    print(f"{mode}: loss and all {sum(len(g) for g in grads)} gradients match one device")

# %% [markdown]
# ## 2. Activation bytes, measured per rank
#
# `act.measure` runs two bf16 layers on the 4 ranks for each size and mode with memory tracking
# (`simcomm.memory`): the layers' forward runs under the label `"activations"` and marks
# `"after forward"`. Divided by the layers, that is the bytes per layer and rank.
#
# Our layer follows the paper's accounting with one difference, which `act.expected_bytes`
# adds: each LayerNorm also keeps its mean and reciprocal standard deviation for backward, `2 sb/t`
# values, so `8 sb / t` bytes per layer (the paper drops them as small). They go with the layer
# under full recomputation. Their 2 bytes are the CPU's: a bf16 LayerNorm on the CPU keeps its
# statistics in bf16 (measured below), while PyTorch's CUDA kernel keeps them in fp32, the
# accumulation type (`aten/src/ATen/native/cuda/layer_norm_kernel.cu`), so on a GPU they are
# `16 sb / t` bytes. The causal mask is one `(s, s)` tensor for the whole run.

# %% expect=["s=64 b=2 h=64 a=4      none: paper    110,592  + LN stats = 110,848  measured 110,848 B", "s=64 b=2 h=64 a=4 selective: paper     69,632  + LN stats =  69,888  measured  69,888 B", "s=64 b=2 h=64 a=4      full: paper      4,096  + LN stats =   4,096  measured   4,096 B", "s=128 b=1 h=64 a=8      none: paper    233,472  + LN stats = 233,728  measured 233,728 B", "s=128 b=1 h=64 a=8 selective: paper     69,632  + LN stats =  69,888  measured  69,888 B", "s=128 b=1 h=64 a=8      full: paper      4,096  + LN stats =   4,096  measured   4,096 B"]
sizes = [(64, 2, 64, 4), (128, 1, 64, 8)]
rows = act.measure(world, sizes)
for row in rows:
    assert all(m == row["expected"] for m in row["measured"]), row     # every rank, to the byte
    (s_, b_, h_, a_) = row["size"]
    print(f"s={s_} b={b_} h={h_} a={a_} {row['mode']:>9}: paper {row['formula']:>10,.0f}  + LN stats = "
          f"{row['expected']:>7,.0f}  measured {row['measured'][0]:>7,.0f} B")

# %% [markdown]
# At `s = 128, a = 8, h = 64` the attention scores (`5 a s / h = 80`) outweigh everything else
# (`34`): selective recomputation saves 70 % of the activations while recomputing only the
# attention core. Full recomputation keeps 2 of the 34 + 80.
#
# Through one step (the last size; rank 0): the activations grow layer by layer in the forward
# pass and are freed layer by layer as the backward pass reaches them.

# %% tags=["nbval-ignore-output"]
last = {row["mode"]: row["report"] for row in rows if row["size"] == sizes[-1]}
activation_curve(last)

# %% [markdown]
# ## 3. What recomputation costs
#
# Backward costs about twice the forward. Full recomputation runs the forward again before each
# layer's backward: `(1 + 1 + 2) / (1 + 2) = 4/3` of the compute. Selective recomputation redoes
# only the attention core (`4 b s^2 h / t` flops of the layer's `24 s b h^2 / t + 4 b s^2 h / t`).
# The layers declare their flops (`comm.compute`); the modelled timeline on an H100 node adds
# them up (the trace of a run on virtual ranks):

# %% expect=["      none: compute 1.000 x, activations 233,728 B per layer", " selective: compute 1.083 x, activations 69,888 B per layer", "      full: compute 1.333 x, activations 4,096 B per layer"]
s, b, h, heads = sizes[-1]
compute = {}
for mode in act.RECOMPUTE:
    sim = World(tp)
    sim.run(act.activation_run, torch.zeros(s, b, h, dtype=torch.float64), torch.zeros(s, b, h, dtype=torch.float64),
            [act.make_layer(h, seed=i) for i in range(2)], heads, mode)
    compute[mode] = modelled_timeline(sim.trace, "h100-nvswitch").ranks[0].compute
flops = act.layer_flops(s, b, h, tp)
assert abs(compute["full"] / compute["none"] - 4 / 3) < 1e-12
assert abs(compute["selective"] / compute["none"] - 1 - flops["attention"] / (3 * sum(flops.values()))) < 1e-12
trade = [{"mode": row["mode"], "bytes": row["measured"][0], "compute": compute[row["mode"]] / compute["none"]}
         for row in rows if row["size"] == sizes[-1]]
for point in trade:
    print(f"{point['mode']:>10}: compute {point['compute']:.3f} x, activations {point['bytes']:,.0f} B per layer")

# %% tags=["nbval-ignore-output"]
trade_figure(trade)

# %% [markdown]
# Selective recomputation is the bargain: 70 % of the memory for 8 % more compute at this size
# (the attention core's share of a layer's flops is `s / (6h + s)`: it grows with `s`, but stays
# small while `s` is well below `6h`). Flash attention goes further: it never stores the `s x s` scores at all.
#
# ## 4. Mixed precision as frameworks train
#
# The training below runs a small MLP (lesson 7's) for 2 Adam steps, data parallel on 4 ranks, as Megatron does
# (picotron keeps only Megatron's fp32 `main_grad`: its `train.py` casts the model to bf16 and runs
# `AdamW` on the bf16 parameters, so its moments are bf16 too): the forward and backward in **bf16** (2 bytes a parameter), an **fp32 master**
# copy of the weights and Adam's two **fp32 moments** (12 bytes), and gradients either as
# autograd makes them (bf16, 2 bytes: the ZeRO paper's `2 + 2 + 12 = 16 psi`) or accumulated over
# micro-batches into an **fp32 `main_grad`** (4 bytes: `18 psi`; measured here with ZeRO-1, Megatron's distributed optimizer). ZeRO stage `k` shards the first
# `k` of optimizer state, gradients, parameters.
#
# First what a rank keeps: the fp32 master (whole, or its ZeRO shard of the flat padded vector)
# and the 16-bit copy the forward and backward run with (whole, or under ZeRO-3 its shard,
# all-gathered layer by layer when the layer runs). Every tensor is allocated under the label
# of what it is, which is what the memory report counts:

# %%
def keep_states(comm, stage, mlp, seed, dtype):
    full = [torch.nn.functional.pad(p, (0, padded(p.numel(), comm.world_size) - p.numel())) for p in mlp.init(seed)]
    with memory.label("optimizer_state"):                                  # fp32 master weights
        master = [p.clone() if stage == 0 else shard(p, comm).clone() for p in full]
    with memory.label("parameters"):                                       # the 16-bit copies
        params = [(p if stage < 3 else shard(p, comm)).to(dtype).requires_grad_() for p in full]
    if stage < 3:
        return master, params, params.__getitem__
    def layer(i):                          # ZeRO-3: a layer's weights gathered when it runs;
        with memory.label("parameters"):   # the gather's backward reduce-scatters their gradient
            return comm.all_gather(params[i], dim=0)
    return master, params, layer

# %% [markdown]
# The forward and backward of each micro-batch run in 16 bits (the loss is fp32, from 16-bit
# outputs). Gradients are kept one of two ways: left to autograd, which adds each micro-batch's
# into `p.grad` in 16 bits, or added into an fp32 `main_grad` buffer after each backward (and
# `p.grad` dropped). `scale` is 1 here; section 5 needs it for fp16:

# %%
def backward(comm, mlp, layer, params, x, y, batch_size, micro_batches, gradients, scale, stage):
    kept, total = [None] * len(params), torch.zeros((), dtype=torch.float64)
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
    return kept, comm.all_reduce(total)                                    # the whole batch's loss

# %% [markdown]
# Then the gradients are summed over the ranks as lesson 7's ZeRO sums them, in their own dtype,
# and Adam updates the **fp32 master** with the fp32 gradient; the master, cast to 16 bits, is the
# new 16-bit copy (under ZeRO-1 and 2 each rank updated its shard: all-gathered):

# %%
def sum_gradients(comm, stage, kept):
    mine = []                                                              # what this rank updates with
    for i in range(len(kept)):
        with memory.label("gradients"):
            if stage == 0:
                kept[i] = comm.all_reduce(kept[i])                         # the whole batch's gradient
                mine.append(kept[i])
            elif stage == 1:
                mine.append(comm.reduce_scatter(kept[i], dim=0))           # the full local buffer stays
            elif stage == 2:
                kept[i] = comm.reduce_scatter(kept[i], dim=0)              # only my chunk of the sum stays
                mine.append(kept[i])
            else:
                mine.append(kept[i])                                       # ZeRO-3: summed by the gather's backward
    return mine

def master_step(comm, stage, params, master, opt, mine, scale, dtype):
    for p, m, adam, g in zip(params, master, opt, mine):
        adam.update(m, g.float() / scale)                                  # fp32 update of the master
        with torch.no_grad():
            p.copy_(m.to(dtype) if stage in (0, 3) else comm.all_gather(m.to(dtype), dim=0))

# %% [markdown]
# The training: each rank takes its rows of the batch; every step runs the micro-batches, sums the
# gradients and updates the master. The lines with `scaler` are section 5's loss scaling, for
# fp16 only (bf16 needs none). (The library keeps the same training as `mp.train`; a test checks
# that the two agree: losses, master weights, bytes per label and the collectives they call.)

# %%
def train(comm, stage=0, mlp=MLP(), *, steps=3, batch_size=8, lr=1e-2, seed=0, dtype=torch.bfloat16,
          gradients="16-bit", loss_scale=None, growth_interval=4, micro_batches=1):
    scaler = None if loss_scale is None else LossScaler(loss_scale, growth_interval)     # fp16: section 5
    with memory.label("inputs"):
        x, y = make_batch(mlp, batch_size, seed + 1)
        rows = slice(comm.rank * batch_size // comm.world_size, (comm.rank + 1) * batch_size // comm.world_size)
        x, y = x[rows].to(dtype), y[rows].clone()                          # my rows of the batch
    master, params, layer = keep_states(comm, stage, mlp, seed, dtype)
    opt = [Adam(m.numel(), lr) for m in master]                            # Adam's fp32 moments
    losses = []
    for k in range(1, steps + 1):
        scale = 1.0 if scaler is None else scaler.scale
        kept, total = backward(comm, mlp, layer, params, x, y, batch_size, micro_batches, gradients, scale, stage)
        mine = sum_gradients(comm, stage, kept)
        overflowed = scaler is not None and mp.any_overflow(comm, mine)   # exercise 3: until you write it
        if scaler is not None:
            scaler.update(k, overflowed)
        if not overflowed:                                                 # a skipped step keeps the master
            master_step(comm, stage, params, master, opt, mine, scale, dtype)
        del mine
        losses.append(total)
        memory.mark(f"after step {k}")
        del kept
    out = {"losses": torch.stack(losses), "master": [m.clone() for m in master]}
    return out if scaler is None else {**out, "history": list(scaler.history)}

# %% [markdown]
# Measured at `"after step 2"` on every rank:

# %% expect=["psi = 5,768 parameters on 4 ranks (bytes per parameter: params + grads + optimizer state)", "ZeRO-0, 16-bit gradients: 2.00 + 2.00 + 12.00 = 16.00", "ZeRO-1, 16-bit gradients: 2.00 + 2.00 + 3.00 = 7.00", "ZeRO-2, 16-bit gradients: 2.00 + 0.50 + 3.00 = 5.50", "ZeRO-3, 16-bit gradients: 0.50 + 0.50 + 3.00 = 4.00", "ZeRO-1, fp32 main_grad gradients: 2.00 + 4.00 + 3.00 = 9.00"]
psi, labels = MLP().numel, ("parameters", "gradients", "optimizer_state")
dp, runs, reports = world, {}, {}                 # the same 4 ranks, data parallel now
print(f"psi = {psi:,} parameters on 4 ranks (bytes per parameter: params + grads + optimizer state)")
for gradients, stages in (("16-bit", (0, 1, 2, 3)), ("fp32 main_grad", (1,))):   # Megatron's distributed optimizer
    for stage in stages:
        runs[stage, gradients] = dp.run(train, stage, gradients=gradients, steps=2, micro_batches=2)
        reports[f"ZeRO-{stage} {gradients}"] = dp.memory
        expected = mp.expected_bytes(stage, psi, 4, gradients)
        for snap in dp.memory.at("after step 2"):
            assert {label: snap[label] for label in labels} == expected, (stage, gradients, snap)
        parts = [expected[label] / psi for label in labels]
        print(f"ZeRO-{stage}, {gradients} gradients: " + " + ".join(f"{p:.2f}" for p in parts) + f" = {sum(parts):.2f}")

# %% tags=["nbval-ignore-output"]
memory_figure({name: report for name, report in reports.items() if "16-bit" in name}, "after step 2",
              title="bf16 mixed precision: bytes per rank after step 2, ZeRO stages 0-3")

# %% [markdown]
# Is bf16 training the same training? Not to the bit: bf16 keeps 8 significant bits, so every
# matmul output is rounded to about `2^-8` relative. The oracle is the same training on one
# device in float64 (`torch.optim.Adam`). Measured, the largest relative error of a step's loss
# over these runs is `2.3e-4`; the check states `2^-11 = 4.9e-4`, about twice that (a run whose
# bf16 rounding were twice as large would fail it), and that the error is rounding, not zero:

# %% expect=["every run: each step's loss within 2^-11 of float64, and not equal to it"]
reference = mp.reference_losses(steps=2)                     # one device, float64
error = {run: ((outs[0]["losses"] - reference).abs() / reference).max().item() for run, outs in runs.items()}
tolerance = 2.0 ** -11
assert all(1e-6 < e < tolerance for e in error.values()), error
print("every run: each step's loss within 2^-11 of float64, and not equal to it")

# %% tags=["nbval-ignore-output"]
for (stage, gradients), e in error.items():
    print(f"ZeRO-{stage} {gradients:>14}: largest relative loss error {e:.1e}")

# %% [markdown]
# After two steps the loss cannot tell fp32 `main_grad` from 16-bit gradients (which is closer
# changes from seed to seed: the forward's bf16 rounding dominates). What `main_grad` fixes is the
# **sum over micro-batches**: 16-bit gradients added in bf16 are rounded at every addition, an
# fp32 buffer keeps the sum to fp32. Measured on 32 micro-batches' bf16 gradients, for 8 seeds,
# against the float64 sum of the same values:

# %% expect=["8 of 8 seeds: the fp32 main_grad sum is at least 100 x closer to float64 than the bf16 sum"]
ratios = []
for seed in range(8):
    gen = torch.Generator().manual_seed(seed)
    micro = [torch.randn(4096, generator=gen).bfloat16() for _ in range(32)]   # autograd's bf16 gradients
    exact = sum(g.double() for g in micro)
    in_bf16, main_grad = torch.zeros(4096, dtype=torch.bfloat16), torch.zeros(4096)
    for g in micro:
        in_bf16 += g                    # 16-bit gradients: rounded to bf16 at every addition
        main_grad += g.float()          # fp32 main_grad
    ratios.append(((in_bf16.double() - exact).norm() / (main_grad.double() - exact).norm()).item())
assert all(r >= 100 for r in ratios), ratios
print(f"{sum(r >= 100 for r in ratios)} of 8 seeds: the fp32 main_grad sum is at least 100 x closer to float64 than the bf16 sum")

# %% [markdown]
# And why keep an **fp32 master** copy at all, when the model computes in bf16? An Adam step moves
# each weight by about the learning rate. Next to a weight of 1, bf16's neighbours are `2^-8` below
# and `2^-7` above: a step of `1e-3` is less than half that gap, so a master kept in bf16 rounds
# every such update away. 100 steps of `1e-3`, in an fp32 master and in a master rounded to bf16
# after each step:

# %% expect=["fp32 master moved 0.1000 per weight; bf16 master moved 0.0000: every update was rounded away"]
gen = torch.Generator().manual_seed(0)
update = 1e-3 * torch.randn(1000, generator=gen).sign()      # Adam's step: about lr per weight
master32, master16 = torch.ones(1000), torch.ones(1000, dtype=torch.bfloat16)
for _ in range(100):
    master32 -= update
    master16 = (master16.float() - update).bfloat16()         # the master rounded to bf16 each step
moved32, moved16 = (master32 - 1).abs().mean().item(), (master16.float() - 1).abs().mean().item()
assert abs(moved32 - 0.1) < 1e-4 and moved16 == 0.0
print(f"fp32 master moved {moved32:.4f} per weight; bf16 master moved {moved16:.4f}: every update was rounded away")

# %% [markdown]
# ## 5. fp16 needs loss scaling
#
# fp16 has 5 exponent bits: values below `6e-8` flush to zero and above `65504` overflow to
# infinity. Multiplying the loss by a *scale* before backward lifts small gradients out of the
# underflow range; dividing them by it again before the update undoes it. Too large a scale
# overflows: then every rank must skip the step (the overflow flag is all-reduced with MAX, so
# the replicas stay identical) and halve the scale; after `growth_interval` good steps in a row it
# doubles again, to probe for a larger scale. Each rank keeps its own scale and its history:

# %%
class LossScaler:
    def __init__(self, scale, growth_interval):
        self.scale, self.growth_interval, self.good_steps, self.history = scale, growth_interval, 0, []

    def update(self, step, overflowed):
        self.history.append((step, self.scale, overflowed))
        if overflowed:
            self.scale /= 2                                  # too large: halve it, count again
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:     # enough good steps: try twice as large
                self.scale *= 2
                self.good_steps = 0

# %% [markdown]
# `train` of section 4 multiplies the loss by the scale before backward (`backward`), divides the
# gradient by it in the fp32 update (`master_step`), and asks `mp.any_overflow` whether any rank's
# gradients hold an inf or NaN (you write that decision in exercise 3): if so, every rank skips the
# update and halves the scale. Here the scale starts far too high, at `2^24`, and grows after 2
# good steps:

# %% tags=["nbval-ignore-output"]
outs = world.run(train, 1, dtype=torch.float16, loss_scale=2.0 ** 24, growth_interval=2, steps=10)
history = outs[0]["history"]
for (step, scale, overflowed), loss in zip(history, outs[0]["losses"]):
    print(f"step {step}: scale {scale:>12,.0f}, loss {loss:.4f}, "
          + ("overflow: skipped, scale halved" if overflowed else "applied"))

# %% [markdown]
# The checks: every rank kept the same history; each overflow halved the scale and the loss did
# not move; after 2 applied steps in a row the scale doubled; and each applied step matches the
# float64 run's next step:

# %% expect=["the ranks agree; 6 steps skipped, each halving the scale; after 2 good steps it doubled; applied steps follow float64 within 1e-2"]
assert all(out["history"] == history for out in outs)
scales, skipped = [scale for _, scale, _ in history], [over for _, _, over in history]
assert skipped[:6] == [True] * 6 and not any(skipped[6:])
assert all(scales[i + 1] == scales[i] / 2 for i in range(6))
assert scales[8] == 2 * scales[7] and scales[7] == scales[6]          # grown after steps 7 and 8 applied
reference, applied = mp.reference_losses(steps=10), 0
for (_, _, overflowed), loss in zip(history, outs[0]["losses"]):
    assert abs(loss - reference[applied]) / reference[applied] < 1e-2
    applied += not overflowed
print("the ranks agree; 6 steps skipped, each halving the scale; after 2 good steps it doubled; applied steps follow float64 within 1e-2")

# %% [markdown]
# bf16 has fp32's 8 exponent bits: nothing underflows that fp32 keeps, and it trains without loss
# scaling. That is why large runs moved from fp16 to bf16.
#
# ## Exercise 1: predict the activation bytes
#
# For `s = 256, b = 1, h = 128, a = 8` on `t = 4` ranks, how many bytes per layer and rank does
# this lesson's bf16 layer keep, for each recomputation mode? Work it out from the table of
# section 1 and the LayerNorm statistics of section 2 (do not call `act.expected_bytes`).

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
prediction = {"none": ..., "selective": ..., "full": ...}      # bytes per layer and rank

print(check.check_activation_prediction(prediction, 256, 1, 128, 8, 4))

# %% [markdown] expect=["Correct: the bytes per layer and rank for all three recomputation modes."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# # s b h = 32,768 elements per layer input; with sequence parallelism each rank keeps 1/t of every
# # stored tensor: 8,192. none: 8,192 x (34 + 5 a s / h) = 8,192 x 114 = 933,888, plus the LayerNorm
# # statistics 8 s b / t = 512 bytes; selective: 34 x 8,192 + 512; full: the input only, 2 x 8,192
# # (the statistics are recomputed with the layer).
# sbh_per_rank = 256 * 1 * 128 // 4
# stats = 8 * 256 * 1 // 4
# prediction_solution = {"none": sbh_per_rank * (34 + 5 * 8 * 256 // 128) + stats,
#                        "selective": 34 * sbh_per_rank + stats, "full": 2 * sbh_per_rank}
# print(check.check_activation_prediction(prediction_solution, 256, 1, 128, 8, 4))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 2: write the model-state bytes
#
# Write `state_bytes(stage, psi, world_size, gradients)` returning the bytes per rank of
# `"parameters"` (bf16), `"gradients"` (`"16-bit"` or `"fp32 main_grad"`) and `"optimizer_state"`
# (fp32 master and Adam) under ZeRO `stage` 0-3, as measured in section 4.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def state_bytes(stage, psi, world_size, gradients):
    raise NotImplementedError   # {"parameters": ..., "gradients": ..., "optimizer_state": ...}

print(check.check_model_state_bytes(state_bytes))

# %% [markdown] expect=["Correct: model-state bytes for ZeRO stages 0-3, 16-bit and fp32 main_grad gradients."] tags=["solution"]
# <details><summary>Solution of exercise 2 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 2.
# # 2 bytes per bf16 parameter, 2 or 4 per gradient, 12 for the fp32 master and Adam's moments;
# # ZeRO stage k shards the first k of optimizer state, gradients, parameters over the ranks.
# def state_bytes_solution(stage, psi, world_size, gradients):
#     grad = 2 if gradients == "16-bit" else 4
#     return {"parameters": 2 * psi / (world_size if stage >= 3 else 1),
#             "gradients": grad * psi / (world_size if stage >= 2 else 1),
#             "optimizer_state": 12 * psi / (world_size if stage >= 1 else 1)}
#
# print(check.check_model_state_bytes(state_bytes_solution))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 3: find the bug
#
# This decides whether an fp16 step is skipped. On one rank it is right; on many it breaks the
# training. Run the checker to see how, then fix it.

# %% expect=["Not yet: with an overflow in grads[1] of rank 2 only ranks [2] skip the step and the others update: the replicas' weights diverge", "(Stuck? Run the same check again with show_hint=True for a hint.)"]
def skip_step(comm, grads):
    return not all(bool(torch.isfinite(g).all()) for g in grads)

print(check.check_skip_step(skip_step))

# %% [markdown] expect=["Correct: every rank skips together when any rank overflowed, and only then."] tags=["solution"]
# <details><summary>Solution of exercise 3 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 3.
# # Each rank looked at its own gradients only. Combine the flags first (MAX: 1 if any rank
# # overflowed), so every rank decides alike.
# def skip_step_solution(comm, grads):
#     flag = torch.tensor([0.0 if all(bool(torch.isfinite(g).all()) for g in grads) else 1.0])
#     return bool(comm.all_reduce(flag, "max").item())
#
# print(check.check_skip_step(skip_step_solution))
# ```
#
# </details>

# %%
world.close()

# %% [markdown]
# ## Takeaway
#
# * Activations, not weights, fill memory at long sequences: `sbh (34 + 5 a s / h)` bytes per layer,
#   and the `5 a s / h` attention term dominates once `s` exceeds `7h / a`. Measured per rank, our
#   layer keeps exactly that plus `8 sb / t` bytes of LayerNorm statistics (on the CPU; `16 sb / t`
#   with CUDA's fp32 statistics).
# * Tensor + sequence parallelism divides all of it by `t`; selective recomputation removes the
#   attention scores for a few percent more compute; full recomputation keeps the layer inputs only
#   for a third more compute.
# * Mixed precision keeps 16 (or, with fp32 gradient accumulation, 18) bytes per parameter; the fp32
#   master weights and Adam states are 12 of them, which is why ZeRO-1 shards them first. The bf16 loss
#   follows float64 within a relative `2^-11` (twice the error measured); an fp32 `main_grad` keeps the
#   micro-batch sum 100 x closer, and an fp32 master keeps the updates bf16 would round away; fp16 needs a loss scale and a skip that every rank agrees on.
