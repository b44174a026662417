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
# # Lesson 10: Expert parallelism
#
# **Goal:** run a top-k routed mixture-of-experts (MoE) layer with its experts spread over ranks:
# route each token, tell every rank how many tokens to expect, dispatch them with the *uneven*
# all-to-all, run the experts, and bring the results back; check the output and every gradient
# (the router's too) against one device, and see what capacity limits and an imbalanced router
# do to dropped tokens, bytes and time; add a shared expert, and train a router with the
# load-balancing loss to see it spread the tokens.
#
# An MoE layer has `E` small MLPs (*experts*) and a *router*: for each token a softmax over the
# experts picks the top `k`, and the token's output is the sum of those experts' outputs weighed
# by their probabilities (the *gates*). This layer keeps the softmax over **all** `E` experts as the
# gates, not renormalised over the `k` chosen (Switch Transformer's convention, kept for `k > 1`), so
# a token's gates sum to at most 1; GShard renormalises its top-2 gates to sum to 1, and Mixtral
# takes a softmax over the top-`k` logits only. The choice changes the output's scale, not the
# communication this lesson is about. With expert parallelism, rank `r` holds `E/P` experts and
# its own tokens; tokens go to wherever their experts live.

# %%
import torch
import simcomm
from simcomm.model import cost
import simcomm.lessons.lesson_10 as check
from simcomm.viz import scaling as figures
from simcomm.parallel.expert import (capacity, expert, keep_mask, load_balancing_loss, load_imbalance, make_moe,
                                     moe, rows_per_rank, shard_experts, shared_output, tokens_per_expert,
                                     train_router_reference)
from simcomm.viz import use_export_renderer
use_export_renderer()   # figures live in JupyterLab and survive an HTML export

world_size, num_experts, top_k, tokens, hidden, ffn = 4, 8, 2, 8, 8, 16
world = simcomm.configured_backend(world_size)
params = make_moe(hidden, ffn, num_experts, seed=0)               # float64
x = torch.randn(world_size * tokens, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

# %% [markdown]
# ## 1. Routing: which expert gets which token
#
# The router is one linear layer, `(E, hidden)`, and a bias: a softmax over its `E` logits gives
# each token a probability per expert; the token goes to the `k` most probable, and those
# probabilities are its gates:

# %%
def route(x, router, bias, top_k):
    """(gates (T, k), experts (T, k)): each token's top-k router probabilities and expert ids."""
    probs = torch.softmax(x @ router.T + bias, dim=-1)          # (T, E)
    return probs.topk(top_k, dim=-1)

# %% [markdown]
# Rank 0's first tokens each choose 2 of the 8 experts. Experts `2r` and `2r + 1` live on rank `r`:

# %% expect=["token 0: experts [7, 4]", "token 1: experts [6, 4]", "token 2: experts [1, 0]", "token 3: experts [6, 7]"]
gates, experts = route(x[:tokens], params["router"], params["bias"], top_k)   # (T, k) each
for token in range(4):
    print(f"token {token}: experts {experts[token].tolist()}")

# %% [markdown]
# ## 2. The expert-parallel layer equals one device
#
# Each rank routes its own `T` tokens. A token with `k` experts makes `k` *copies*, one per
# chosen expert; `keep_mask` keeps them all for now (section 3 gives it a limit). The layer
# sorts the copies by expert, so that the rows for each rank are one contiguous block, and counts
# them per expert. `rows_per_rank` adds up the counts of the experts each rank holds: the rows
# this rank sends to each rank, the dispatch's `input_split_sizes` (exercise 1 asks you to work
# them out; until then the library's function does it).
#
# The receiving rank must know how many rows to expect before they come: an *even*
# `all_to_all_single` of the `E` counts first gives every rank the counts for its own experts,
# from each rank (its `output_split_sizes`). Then the *uneven*
# `all_to_all_single(rows, output_split_sizes, input_split_sizes)` dispatches the rows, the
# rank runs its experts on them, and a second uneven all-to-all, the split lists swapped,
# brings each result home (the combine), where it is weighed by its gate and added to its token:

# %%
def expert_parallel_moe(comm, x, shards, top_k, *, capacity_factor=None):
    P, local_experts = comm.world_size, shards["w1"].shape[0]
    num_experts = P * local_experts
    gates, experts = route(x, shards["router"], shards["bias"], top_k)          # (T, k) each
    kept = keep_mask(experts, num_experts, capacity(x.shape[0], top_k, num_experts, capacity_factor))
    token, slot = torch.nonzero(kept, as_tuple=True)                            # the kept copies
    order = torch.argsort(experts[token, slot], stable=True)                    # sorted by expert
    token, slot = token[order], slot[order]
    per_expert = tokens_per_expert(experts, kept, num_experts)                  # (E,) copies per expert
    sent = rows_per_rank(per_expert, P)                                         # rows to each rank
    from_each = comm.all_to_all_single(per_expert)                              # counts for my experts
    received = rows_per_rank(from_each, P)                                      # rows from each rank
    arrived = comm.all_to_all_single(x[token], received, sent)                  # dispatch
    results = run_experts(arrived, from_each, shards)
    back = comm.all_to_all_single(results, sent, received)                      # combine: lists swapped
    out = shared_output(x, shards).index_add(0, token, back * gates[token, slot].unsqueeze(-1))
    stats = {"sent": sent, "received": received, "per_expert": per_expert.tolist(),
             "dropped": int((~kept).sum())}
    return out, stats

# %% [markdown]
# The rows arrive grouped by sender, and within each sender by expert: `from_each` holds, for
# every sender, the count for each of this rank's experts. `run_experts` labels every row with
# its expert, groups the rows by expert, runs each expert once on its group (`expert` is a
# two-layer MLP, `gelu(x @ w1.T) @ w2.T`), and puts the results back in arrival order, the order
# the combine sends them in:

# %%
def run_experts(arrived, from_each, shards):
    local_experts = shards["w1"].shape[0]
    local_id = torch.arange(local_experts).repeat(len(from_each) // local_experts)   # expert of each count
    local_id = local_id.repeat_interleave(from_each)                                 # expert of each row
    grouped = torch.argsort(local_id, stable=True)                                   # rows grouped by expert
    counts = torch.bincount(local_id, minlength=local_experts).tolist()
    outputs = [expert(rows, shards["w1"][e], shards["w2"][e])
               for e, rows in enumerate(arrived[grouped].split(counts))]
    return torch.cat(outputs)[torch.argsort(grouped)]                                # arrival order

# %% [markdown]
# The router is replicated: each rank's router gradient comes from its own tokens, and the sum
# over ranks is the single-device gradient (what data parallelism's all-reduce would give). The
# backward runs the two uneven all-to-alls again, swapped. (The library keeps the same layer,
# `simcomm.parallel.expert.expert_parallel_moe`, which later lessons use; a test
# checks that the two agree: outputs, gradients, statistics and the collectives they call.)

# %%
probe = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

def moe_step(comm, x, probe, params, top_k, capacity_factor):
    mine = slice(comm.rank * tokens, (comm.rank + 1) * tokens)
    xr = x[mine].clone().requires_grad_()
    shards = shard_experts(params, comm.rank, comm.world_size)             # router + this rank's experts
    out, stats = expert_parallel_moe(comm, xr, shards, top_k, capacity_factor=capacity_factor)
    (out * probe[mine]).sum().backward()
    return out.detach(), xr.grad, {name: p.grad for name, p in shards.items()}, stats

def reference(capacity_factor, params=params):
    leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
    xr = x.clone().requires_grad_()
    out = moe(xr, leaves, top_k, capacity_factor=capacity_factor, groups=world_size)
    (out * probe).sum().backward()
    return out.detach(), xr.grad, {name: p.grad for name, p in leaves.items()}

# %% expect=["output: matches the reference", "x.grad: matches the reference", "router.grad (sum over ranks): matches the reference", "bias.grad (sum over ranks): matches the reference", "w1.grad (experts of all ranks): matches the reference", "w2.grad (experts of all ranks): matches the reference"]
outs = world.run(moe_step, x, probe, params, top_k, None)
ref_out, ref_xgrad, ref_grads = reference(None)
print(check.assert_close(torch.cat([o[0] for o in outs]), ref_out, "output"))
print(check.assert_close(torch.cat([o[1] for o in outs]), ref_xgrad, "x.grad"))
for name in ("router", "bias"):
    print(check.assert_close(sum(o[2][name] for o in outs), ref_grads[name], f"{name}.grad (sum over ranks)"))
for name in ("w1", "w2"):
    print(check.assert_close(torch.cat([o[2][name] for o in outs]), ref_grads[name],
                               f"{name}.grad (experts of all ranks)"))

# %% [markdown]
# What each rank sent where: the dispatch's `input_split_sizes` (rows to each rank) and
# `output_split_sizes` (rows from each rank). Row `r` of the first list is what rank `r` sends;
# column `r` of it is what rank `r` receives, which is rank `r`'s second list:

# %% expect=["rank 0 sends [3, 1, 4, 8], receives [3, 5, 4, 4]", "rank 1 sends [5, 4, 3, 4], receives [1, 4, 2, 6]", "rank 2 sends [4, 2, 6, 4], receives [4, 3, 6, 2]", "rank 3 sends [4, 6, 2, 4], receives [8, 4, 4, 4]"]
for rank, (_, _, _, stats) in enumerate(outs):
    print(f"rank {rank} sends {stats['sent']}, receives {stats['received']}")
assert [[o[3]["sent"][r] for o in outs] for r in range(world_size)] == [o[3]["received"] for o in outs]

# %% [markdown]
# The same as a figure: tokens each rank sends to each expert, and the load of every expert.

# %% tags=["nbval-ignore-output"]
figures.tokens_per_expert_figure([o[3]["per_expert"] for o in outs], title="tokens per expert, from each rank")

# %% [markdown]
# ## 3. Capacity factor and dropped tokens
#
# Real MoE layers give every expert a fixed buffer, `capacity = ceil(factor * T * k / E)` token
# copies per rank (`T` tokens). Copies beyond it are *dropped*: the token gets nothing from that
# expert (the residual connection around the layer carries it on). The buffer is filled in token
# order, then slot: token 0's second choice gets a place before token 1's first. (GShard fills
# every token's first choice before any second choice, so that a full expert drops second choices
# first; this layer keeps the simpler order, and the exercise uses it.) The layer stays exact with
# respect to the same rule on one device:

# %% expect=["capacity factor None: capacity -, dropped 0 of 64 token copies, matches the reference", "capacity factor 2: capacity 4, dropped 0 of 64 token copies, matches the reference", "capacity factor 1.25: capacity 3, dropped 5 of 64 token copies, matches the reference", "capacity factor 1: capacity 2, dropped 17 of 64 token copies, matches the reference", "capacity factor 0.5: capacity 1, dropped 35 of 64 token copies, matches the reference"]
for factor in (None, 2.0, 1.25, 1.0, 0.5):
    outs = world.run(moe_step, x, probe, params, top_k, factor)
    lost = sum(o[3]["dropped"] for o in outs)
    ref = reference(factor)
    check.assert_close([torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])], ref[:2], "output")
    check.assert_close(sum(o[2]["router"] for o in outs), ref[2]["router"], "router.grad")
    limit = capacity(tokens, top_k, num_experts, factor)                  # None: no limit
    print(f"capacity factor {'None' if factor is None else f'{factor:g}'}: capacity {limit or '-'}, "
          f"dropped {lost} of {world_size * tokens * top_k} token copies, matches the reference")

# %% [markdown]
# ## 4. An imbalanced router: bytes and time
#
# Push the router towards expert 0 (a bias of 2 on its logit), as a collapsing router does
# (an untrained router with random weights is roughly balanced: the first line below). Rank 0, which holds experts 0 and 1, now receives far more rows than the others.
# The all-to-all takes as long as its busiest rank needs. Measured on the simulator's trace,
# with more tokens and a wider hidden size (512 tokens per rank, hidden 1024, float32) and the
# cost model of an H100 node:

# %% expect=["balanced: rows received per rank [1008, 1043, 981, 1064]; busiest rank receives 4.2 MiB; dispatch + combine 52.4 us", "expert 0 favoured: rows received per rank [2088, 685, 629, 694]; busiest rank receives 8.2 MiB; dispatch + combine 72.1 us", "expert 0 favoured, capacity factor 1.25: rows received per rank [975, 685, 629, 694]; dropped 1113; busiest rank receives 3.8 MiB; dispatch + combine 49.6 us"]
def a2a_time(trace, rank=0):
    cost.annotate(trace, "h100-nvswitch")
    events = trace.filter(op="all_to_all_single", rank=rank, phase="forward").events[1:]   # not the counts
    return sum(e.modelled for e in events)

big = make_moe(1024, 32, num_experts, seed=3, dtype=torch.float32)
xb = torch.randn(world_size * 512, 1024, generator=torch.Generator().manual_seed(4))
sim, runs = simcomm.World(world_size), {}
for label, bias, factor in (("balanced", 0.0, None), ("expert 0 favoured", 2.0, None),
                            ("expert 0 favoured, capacity factor 1.25", 2.0, 1.25)):
    big["bias"] = torch.zeros(num_experts).index_fill(0, torch.tensor([0]), bias)
    stats = [o[1] for o in sim.run(lambda comm: expert_parallel_moe(
        comm, xb[comm.rank * 512:(comm.rank + 1) * 512], shard_experts(big, comm.rank, world_size), top_k,
        capacity_factor=factor))]
    runs[label] = stats
    received = [sum(s["received"]) for s in stats]
    extra = f"; dropped {sum(s['dropped'] for s in stats)}" if factor else ""
    busiest = max(received) * xb.shape[1] * xb.element_size() / 2**20            # MiB into the busiest rank
    print(f"{label}: rows received per rank {received}{extra}; busiest rank receives {busiest:.1f} MiB; "
          f"dispatch + combine {a2a_time(sim.trace) * 1e6:.1f} us")

# %% tags=["nbval-ignore-output"]
figures.tokens_per_expert_figure([s["per_expert"] for s in runs["expert 0 favoured"]],
                                 title="expert 0 favoured: tokens per expert, from each rank")

# %% [markdown]
# The favoured expert's rank receives twice its share, and the all-to-all waits for it: dispatch
# and combine take 1.4 times as long (their latency part does not grow), and that rank also
# computes twice the expert work while the others wait.
# A capacity factor bounds both, at the price of dropped tokens. Production routers also add a
# **load-balancing loss** to the training loss, so that the router learns to spread tokens:
# Switch Transformer's `E * sum_e f_e P_e` (`f_e`: the share of assignments expert `e` gets,
# `P_e`: its mean router probability), 1 when routing is uniform, `E` when it collapses onto one
# expert, times a small coefficient (0.01 in Switch). Its gradient flows through `P_e` and lowers
# the favoured expert's probability:

# %% expect=["load-balancing loss, balanced: 1.00", "load-balancing loss, expert 0 favoured: 1.84"]
for label, bias in (("balanced", 0.0), ("expert 0 favoured", 2.0)):
    logit_bias = torch.zeros(num_experts, dtype=torch.float64).index_fill(0, torch.tensor([0]), bias)
    aux = load_balancing_loss(xb.double(), big["router"].double(), logit_bias, top_k)
    print(f"load-balancing loss, {label}: {aux.item():.2f}")

# %% [markdown]
# ## 5. A shared expert
#
# DeepSeekMoE (Dai et al., 2024) adds **shared experts** beside the routed ones: every token goes
# through them, with weight 1, so common knowledge need not be learnt by every routed expert. With
# expert parallelism the shared expert is dense: each rank holds a copy and applies it to its own
# tokens, with no communication (its gradient, like the router's, is each rank's share of the sum).
# `make_moe(..., shared_experts=1)` adds one; the layer stays equal to one device, forward and
# backward, and sends exactly what it sent without it:

# %% expect=["shared + routed output: matches the reference", "x.grad: matches the reference", "shared_w1.grad (sum over ranks): matches the reference", "shared_w2.grad (sum over ranks): matches the reference", "router.grad (sum over ranks): matches the reference", "bytes sent: the same as without the shared expert"]
shared_params = make_moe(hidden, ffn, num_experts, seed=0, shared_experts=1)   # the same routed experts
outs = world.run(moe_step, x, probe, shared_params, top_k, None)
sent_bytes = [sum(sum(e.sent.values()) for e in world.trace.events)]
world.run(moe_step, x, probe, params, top_k, None)                            # without the shared expert
sent_bytes.append(sum(sum(e.sent.values()) for e in world.trace.events))
ref_out, ref_xgrad, ref_grads = reference(None, shared_params)
print(check.assert_close(torch.cat([o[0] for o in outs]), ref_out, "shared + routed output"))
print(check.assert_close(torch.cat([o[1] for o in outs]), ref_xgrad, "x.grad"))
for name in ("shared_w1", "shared_w2", "router"):
    print(check.assert_close(sum(o[2][name] for o in outs), ref_grads[name], f"{name}.grad (sum over ranks)"))
assert sent_bytes[0] == sent_bytes[1] > 0
print("bytes sent: the same as without the shared expert")

# %% [markdown]
# ## 6. Training with the load-balancing loss
#
# Does the loss do what it promises? Take a small layer whose router favours expert 0 (a bias of 2,
# as in section 4), 4 ranks of 32 tokens, and train **only the router** (and its bias) for 20 SGD
# steps on a regression task, once without and once with the auxiliary loss. The training runs on
# the expert-parallel layer of section 2. Each rank's loss is the squared error of its own tokens
# (divided by all ranks' tokens, so the ranks' losses add up to the batch's mean) plus
# `aux_weight / P` times the load-balancing loss of its own tokens; the router is replicated, so its
# gradients are all-reduced (summed) before each SGD step, and every rank takes the same step.
# Before each step (and after the last) it records the tokens each expert got, over all ranks, and
# the mean of the ranks' load-balancing losses:

# %%
def train_router(comm, x, target, params, top_k, *, steps, lr, aux_weight, capacity_factor=None):
    tokens, P = x.shape[0] // comm.world_size, comm.world_size
    mine = slice(comm.rank * tokens, (comm.rank + 1) * tokens)
    xr, target_r = x[mine], target[mine]                               # my tokens
    router, bias = params["router"].clone(), params["bias"].clone()
    history = {"per_expert": [], "aux": []}
    for step in range(steps + 1):
        shards = shard_experts({**params, "router": router, "bias": bias}, comm.rank, P)
        out, stats = expert_parallel_moe(comm, xr, shards, top_k, capacity_factor=capacity_factor)
        counts = comm.all_reduce(torch.tensor(stats["per_expert"], dtype=torch.int64))   # (E,) all ranks
        history["per_expert"].append(counts.tolist())
        aux = load_balancing_loss(xr, shards["router"], shards["bias"], top_k)   # Switch's, my tokens
        history["aux"].append(float(comm.all_reduce(aux.detach()) / P))
        if step == steps:
            break
        loss = (xr + out - target_r).pow(2).sum() / x.shape[0] + aux_weight / P * aux
        grad_router, grad_bias = torch.autograd.grad(loss, [shards["router"], shards["bias"]])
        with torch.no_grad():                                          # summed over the ranks: one step
            router = router - lr * comm.all_reduce(grad_router)
            bias = bias - lr * comm.all_reduce(grad_bias)
    return {**history, "router": router, "bias": bias}

# %% [markdown]
# (The library keeps the same training as `simcomm.parallel.expert.train_router`; a test checks that
# the two agree.) The weight here is 1 (Switch uses 0.01 over many thousand steps; 20 steps need a
# stronger pull). Every step equals the same training on one device in float64
# (`train_router_reference`): the tokens per expert at every step, and the final router:

# %% expect=["no aux loss: every step matches the single-device training", "aux weight 1: every step matches the single-device training"]
router_params = make_moe(hidden, ffn, num_experts, seed=0, shared_experts=1)
router_params["bias"][0] = 2.0                                     # expert 0 favoured
gen = torch.Generator().manual_seed(5)
xt, target = (torch.randn(world_size * 32, 8, dtype=torch.float64, generator=gen) for _ in range(2))
trained = {}
for label, weight in (("no aux loss", 0.0), ("aux weight 1", 1.0)):
    runs = world.run(train_router, xt, target, router_params, top_k, steps=20, lr=2.0, aux_weight=weight)
    one = train_router_reference(xt, target, router_params, top_k, steps=20, lr=2.0, aux_weight=weight,
                                 groups=world_size)
    assert all(run["per_expert"] == one["per_expert"] for run in runs)
    check.assert_close([runs[0]["router"], runs[0]["bias"]], [one["router"], one["bias"]], label)
    trained[label] = one
    print(f"{label}: every step matches the single-device training")

# %% expect=["before training: max/mean load 3.25", "after 20 steps, no aux loss: max/mean load 2.41", "after 20 steps, aux weight 1: max/mean load 1.38"]
loads = {"before training": trained["no aux loss"]["per_expert"][0]}
loads.update({f"after 20 steps, {label}": run["per_expert"][-1] for label, run in trained.items()})
for label, counts in loads.items():
    print(f"{label}: max/mean load {load_imbalance(counts):.2f}")
assert load_imbalance(loads["after 20 steps, aux weight 1"]) < load_imbalance(loads["after 20 steps, no aux loss"])

# %% tags=["nbval-ignore-output"]
figures.load_balance_figure(loads, title="tokens per expert: a router favouring expert 0, trained 20 steps")

# %% [markdown]
# Without the auxiliary loss the task alone leaves expert 0 with more than twice its share; with it,
# the busiest expert's load falls to about 1.4 times the mean, and with it the all-to-all's busiest
# rank and the capacity drops of section 3. The loss itself falls towards 1 (its value for a
# uniform router):

# %% tags=["nbval-ignore-output"]
print({label: [round(a, 3) for a in run["aux"][::5]] for label, run in trained.items()})

# %% [markdown]
# ## Exercise 1: split sizes of a routing
#
# Write `split_sizes(experts, num_experts, world_size)`: for a routing `experts` of shape
# `(T, k)` (expert ids; rank `r` holds experts `r*E/P ... (r+1)*E/P - 1`) return the
# `input_split_sizes` of the dispatch: how many token copies this rank sends to each rank.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def split_sizes(experts, num_experts, world_size):
    raise NotImplementedError   # a list of world_size ints

print(check.check_split_sizes(split_sizes))

# %% [markdown] expect=["Correct: split sizes for 4 routings, including a rank that receives nothing."] tags=["solution"]
# <details><summary>Solution of exercise 1 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 1.
# def split_sizes_solution(experts, num_experts, world_size):
#     owner = experts.flatten() // (num_experts // world_size)          # the rank of each copy's expert
#     return torch.bincount(owner, minlength=world_size).tolist()
#
# print(check.check_split_sizes(split_sizes_solution))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 2: how many are dropped?
#
# Write `dropped(experts, num_experts, capacity)`: how many token copies of the routing
# `experts (T, k)` are dropped when every expert keeps at most `capacity` of them.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def dropped(experts, num_experts, capacity):
    raise NotImplementedError   # an int

print(check.check_dropped(dropped))

# %% [markdown] expect=["Correct: dropped assignments for 4 routings and capacities 0, 1, 2, 5."] tags=["solution"]
# <details><summary>Solution of exercise 2 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 2.
# def dropped_solution(experts, num_experts, capacity):
#     per_expert = torch.bincount(experts.flatten(), minlength=num_experts)
#     return int((per_expert - capacity).clamp(min=0).sum())
#
# print(check.check_dropped(dropped_solution))
# ```
#
# </details>

# %% [markdown]
# ## Exercise 3: the load-balancing loss
#
# Write `aux_loss(probs, experts)`: Switch Transformer's `E * sum_e f_e * P_e` from the router's
# probabilities `probs (T, E)` and the chosen experts `experts (T, k)`, as a 0-d tensor. `f_e` is the
# share of the `T * k` assignments that go to expert `e`, `P_e` the mean of `probs[:, e]`. The
# check compares the value **and its gradient** with respect to `probs` (the router learns
# through it) with the formula's, for three routings.

# %% expect=["Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."]
def aux_loss(probs, experts):
    raise NotImplementedError   # a 0-d tensor

print(check.check_aux_loss(aux_loss))

# %% [markdown] expect=["Correct: the load-balancing loss and its gradient for 3 routings (top-2, top-1, a skewed router)."] tags=["solution"]
# <details><summary>Solution of exercise 3 (open it once you have tried)</summary>
#
# ```python
# # Solution of exercise 3.
# # f_e is a count (no gradient); the gradient flows through P_e = probs.mean(0).
# def aux_loss_solution(probs, experts):
#     num_experts = probs.shape[1]
#     share = torch.bincount(experts.flatten(), minlength=num_experts).to(probs.dtype) / experts.numel()
#     return num_experts * (share * probs.mean(0)).sum()
#
# print(check.check_aux_loss(aux_loss_solution))
# ```
#
# </details>

# %% [markdown]
# ## Takeaway
#
# * Expert parallelism is route, exchange counts, uneven all-to-all out, experts, uneven
#   all-to-all back (split lists swapped). The backward is the same pair of all-to-alls swapped
#   again, so the output and every gradient equal one device, the router's included.
# * The counts must be exchanged first: a rank cannot receive rows it does not know the number of.
# * A capacity factor fixes each expert's buffer; what does not fit is dropped, not an error.
# * The all-to-all lasts as long as its busiest rank: an imbalanced router makes the whole layer
#   wait for the rank of the popular expert.
# * The load-balancing loss `E * sum_e f_e P_e` pushes probability away from overloaded experts:
#   trained with it, a skewed router spreads its tokens (max/mean load 3.25 -> 1.38 here, 2.41 without).
# * A shared expert runs on every token on every rank: more compute, no extra communication.

# %%
world.close()
