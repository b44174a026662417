"""A top-k routed mixture-of-experts layer, with its experts sharded over ranks (expert parallelism).

Every rank holds its own tokens ``x (T, hidden)``, the whole router, and
``E/P`` of the ``E`` experts (rank ``r``: experts ``r*E/P ... (r+1)*E/P - 1``).
One forward pass, :func:`expert_parallel_moe`:

1. **route**: softmax of ``x @ router.T + bias`` over all ``E`` experts; each
   token picks its top-k experts, weighted by their probabilities (the
   *gates*), which are not renormalised over the k chosen (Switch's top-1
   convention kept for any k; GShard renormalises its top-2, Mixtral takes a
   softmax of the top-k logits), so a token's gates sum to at most 1;
2. **capacity**: an expert takes at most ``capacity`` of a rank's assignments
   (``ceil(capacity_factor * T * k / E)``), filled in token order, then slot:
   token 0's second choice is kept before token 1's first (GShard fills every
   token's first choice before any second choice);
   the rest are *dropped*: they add nothing to the token's output;
3. **exchange counts**: an even ``all_to_all_single`` of the per-expert
   counts tells every rank how many rows it will receive from each rank;
4. **dispatch**: the kept assignments, sorted by expert, go to the experts'
   ranks with the uneven ``all_to_all_single`` (``input_split_sizes`` = rows
   for each rank, ``output_split_sizes`` = rows from each rank);
5. **experts** run on the rows they received;
6. **combine**: the reverse all-to-all (split lists swapped) brings each
   result back to its token, which adds it weighted by its gate.

A **shared expert** (DeepSeekMoE, Dai et al. 2024: experts every token goes
through, beside the routed ones; ``make_moe(..., shared_experts=S)``) is
replicated on every rank and applied to the rank's own tokens, with no
communication; its output is added with weight 1. Its gradient on each rank
comes from that rank's tokens, like the router's.

Training the router (:func:`train_router`): each rank's loss is its tokens'
task loss plus ``aux_weight / P`` times the Switch load-balancing loss of its
own tokens (:func:`load_balancing_loss`, computed per rank as Switch computes
it per device); the router's gradients are summed over ranks with an
all-reduce (data parallelism of the replicated router) and plain SGD steps
them. :func:`train_router_reference` is the same on one device.

The single-device reference, :func:`moe`, is the same layer on one device
with a loop over experts; with ``groups=P`` it applies the capacity per
group of ``T`` tokens, as each rank does. Gradients: the all-to-alls'
backward is the all-to-all with the split lists swapped, so token gradients
go home and expert gradients stay with the expert's rank; the router's
gradient on each rank comes from that rank's tokens (sum over ranks = the
single-device router gradient, as data parallelism would all-reduce it).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..communicator import Communicator

__all__ = ["make_moe", "route", "keep_mask", "capacity", "expert", "moe", "shard_experts",
           "expert_parallel_moe", "rows_per_rank", "tokens_per_expert", "load_balancing_loss", "switch_aux_loss",
           "shared_output", "train_router", "train_router_reference", "load_imbalance"]


def make_moe(hidden: int, ffn: int, num_experts: int, *, seed: int = 0, dtype: torch.dtype = torch.float64,
             shared_experts: int = 0) -> dict[str, torch.Tensor]:
    """Seeded parameters: ``router (E, hidden)``, ``bias (E,)`` (zeros), ``w1 (E, ffn, hidden)``,
    ``w2 (E, hidden, ffn)``; with ``shared_experts=S > 0`` also ``shared_w1 (S, ffn, hidden)`` and
    ``shared_w2 (S, hidden, ffn)`` (drawn after the others: the routed experts do not change)."""
    if shared_experts < 0:
        raise ValueError(f"make_moe: shared_experts={shared_experts} must be >= 0")
    gen = torch.Generator().manual_seed(seed)
    params = {
        "router": torch.randn(num_experts, hidden, generator=gen, dtype=dtype) / math.sqrt(hidden),
        "bias": torch.zeros(num_experts, dtype=dtype),
        "w1": torch.randn(num_experts, ffn, hidden, generator=gen, dtype=dtype) / math.sqrt(hidden),
        "w2": torch.randn(num_experts, hidden, ffn, generator=gen, dtype=dtype) / math.sqrt(ffn),
    }
    if shared_experts:
        params["shared_w1"] = torch.randn(shared_experts, ffn, hidden, generator=gen, dtype=dtype) / math.sqrt(hidden)
        params["shared_w2"] = torch.randn(shared_experts, hidden, ffn, generator=gen, dtype=dtype) / math.sqrt(ffn)
    return params


def route(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gates (T, k), experts (T, k))``: each token's top-k router probabilities and expert ids."""
    num_experts = router.shape[0]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"route: top_k={top_k} must be between 1 and the number of experts {num_experts}")
    probs = torch.softmax(x @ router.T + bias, dim=-1)          # (T, E)
    return probs.topk(top_k, dim=-1)


def switch_aux_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` (0-d) from the router's probabilities ``probs (T, E)`` and the chosen experts
    ``experts (T, k)``: ``f_e`` the share of the ``T * k`` assignments that go to ``e`` (a count: no
    gradient), ``P_e`` the mean of ``probs[:, e]`` (the gradient flows through it)."""
    num_experts = probs.shape[-1]
    fraction = torch.bincount(experts.flatten(), minlength=num_experts).to(probs.dtype) / experts.numel()  # (E,)
    return num_experts * (fraction * probs.mean(0)).sum()


def load_balancing_loss(x: torch.Tensor, router: torch.Tensor, bias: torch.Tensor, top_k: int) -> torch.Tensor:
    """The Switch Transformer's auxiliary loss ``E * sum_e f_e * P_e`` (0-d): ``f_e`` the fraction of the
    ``T * k`` assignments that go to expert ``e``, ``P_e`` the router's mean probability of ``e`` over the
    ``T`` tokens. It is 1 when routing is uniform and ``E`` when every token goes to one expert; its
    gradient (through ``P_e``; ``f_e`` is a count) pushes probability away from overloaded experts.
    Production routers add it, times a small coefficient (0.01 in Switch), to the training loss."""
    probs = torch.softmax(x @ router.T + bias, dim=-1)                         # (T, E)
    return switch_aux_loss(probs, probs.topk(top_k, dim=-1).indices)


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float | None) -> int | None:
    """Assignments one expert takes from ``tokens`` tokens: ``ceil(factor * tokens * k / E)``."""
    if capacity_factor is None:
        return None
    if not capacity_factor > 0:
        raise ValueError(f"capacity: capacity_factor={capacity_factor!r} must be > 0 (or None: no limit)")
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def keep_mask(experts: torch.Tensor, num_experts: int, limit: int | None) -> torch.Tensor:
    """``(T, k)`` bools: the assignments within each expert's first ``limit`` (token order, then slot)."""
    if limit is None:
        return torch.ones_like(experts, dtype=torch.bool)
    flat = experts.flatten()                                     # (T*k,) in token-then-slot order
    one_hot = F.one_hot(flat, num_experts)                       # (T*k, E)
    position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1         # how many came before, per expert
    return (position < limit).view_as(experts)


def expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert: ``gelu(x @ w1.T) @ w2.T`` on ``(rows, hidden)``."""
    return F.gelu(x @ w1.T) @ w2.T


def shared_output(x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The shared experts' summed output on ``x (T, hidden)`` (zeros when ``params`` has none)."""
    if "shared_w1" not in params:
        return torch.zeros_like(x)
    return sum(expert(x, w1, w2) for w1, w2 in zip(params["shared_w1"], params["shared_w2"], strict=True))


def moe(x: torch.Tensor, params: dict[str, torch.Tensor], top_k: int, *,
        capacity_factor: float | None = None, groups: int = 1) -> torch.Tensor:
    """The single-device MoE layer on ``x (T, hidden)``; capacity applies per group of ``T/groups`` tokens.
    Shared experts, if ``params`` has them, are added for every token."""
    num_experts = params["router"].shape[0]
    out = shared_output(x, params)
    for rows in torch.arange(x.shape[0], device=x.device).chunk(groups):
        gates, experts = route(x[rows], params["router"], params["bias"], top_k)
        kept = keep_mask(experts, num_experts, capacity(len(rows), top_k, num_experts, capacity_factor))
        for e in range(num_experts):
            token, slot = torch.nonzero((experts == e) & kept, as_tuple=True)
            y = expert(x[rows][token], params["w1"][e], params["w2"][e])           # (n_e, hidden)
            out = out.index_add(0, rows[token], y * gates[token, slot].unsqueeze(-1))
    return out


def shard_experts(params: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s leaf parameters: the whole router and bias, and its ``E/P`` experts."""
    num_experts = params["router"].shape[0]
    if num_experts % world_size:
        raise ValueError(f"shard_experts: {num_experts} experts are not divisible by the world size {world_size}")
    local = slice(rank * num_experts // world_size, (rank + 1) * num_experts // world_size)
    shards = {"router": params["router"].clone().requires_grad_(), "bias": params["bias"].clone().requires_grad_(),
              "w1": params["w1"][local].clone().requires_grad_(),      # (E/P, ffn, hidden)
              "w2": params["w2"][local].clone().requires_grad_()}      # (E/P, hidden, ffn)
    for name in ("shared_w1", "shared_w2"):                            # replicated, like the router
        if name in params:
            shards[name] = params[name].clone().requires_grad_()
    return shards


def tokens_per_expert(experts: torch.Tensor, kept: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``(E,)`` int64: how many kept assignments go to each expert."""
    return torch.bincount(experts[kept], minlength=num_experts)


def rows_per_rank(per_expert: torch.Tensor, world_size: int) -> list[int]:
    """Rows for each rank from counts per expert ``(E,)`` (``(P * E/P,)`` after the counts' all-to-all):
    the counts of the ``E/P`` experts each rank holds (contiguous blocks), added up, as ``P`` ints."""
    return per_expert.view(world_size, -1).sum(1).tolist()


def expert_parallel_moe(comm: Communicator, x: torch.Tensor, shards: dict[str, torch.Tensor], top_k: int, *,
                        capacity_factor: float | None = None) -> tuple[torch.Tensor, dict]:
    """The MoE layer on this rank's tokens ``x (T, hidden)``, experts sharded over the group.

    ``shards``: :func:`shard_experts` of this rank (with its shared experts, if any, applied locally).
    Returns ``(out (T, hidden), stats)``;
    ``stats``: ``sent`` and ``received`` (rows per rank, the two split lists),
    ``per_expert`` (this rank's kept assignments per expert, a list of E) and
    ``dropped`` (assignments over capacity). Blocks on three all-to-alls;
    inputs are not modified; gradients reach ``x`` and every shard.
    """
    world_size = comm.world_size
    local_experts = shards["w1"].shape[0]
    num_experts = local_experts * world_size
    if shards["router"].shape[0] != num_experts:
        raise ValueError(f"expert_parallel_moe: rank {comm.rank} holds {local_experts} experts x {world_size} "
                         f"ranks, but the router has {shards['router'].shape[0]} rows")
    gates, experts = route(x, shards["router"], shards["bias"], top_k)          # (T, k) each
    kept = keep_mask(experts, num_experts, capacity(x.shape[0], top_k, num_experts, capacity_factor))
    token, slot = torch.nonzero(kept, as_tuple=True)                            # kept assignments
    order = torch.argsort(experts[token, slot], stable=True)                    # sorted by expert
    token, slot = token[order], slot[order]
    per_expert = tokens_per_expert(experts, kept, num_experts)                  # (E,)
    sent = rows_per_rank(per_expert, world_size)                                # rows to each rank
    from_each = comm.all_to_all_single(per_expert)                              # (P * E/P,): counts for my experts
    received = rows_per_rank(from_each, world_size)                             # rows from each rank
    arrived = comm.all_to_all_single(x[token], received, sent)                  # (sum(received), hidden)
    local_id = torch.arange(local_experts, device=x.device).repeat(world_size)     # (P * E/P,) expert of each count
    local_id = local_id.repeat_interleave(from_each)                               # (rows,) expert of each row
    grouped = torch.argsort(local_id, stable=True)                              # rows grouped by expert
    counts = torch.bincount(local_id, minlength=local_experts).tolist()
    outputs = [expert(rows, shards["w1"][e], shards["w2"][e])
               for e, rows in enumerate(arrived[grouped].split(counts))]
    results = torch.cat(outputs)[torch.argsort(grouped)]                        # back in arrival order
    back = comm.all_to_all_single(results, sent, received)                      # (kept, hidden), sorted order
    out = shared_output(x, shards).index_add(0, token, back * gates[token, slot].unsqueeze(-1))
    stats = {"sent": sent, "received": received, "per_expert": per_expert.tolist(),
             "dropped": int((~kept).sum())}
    return out, stats


def load_imbalance(per_expert) -> float:
    """The busiest expert's load over the mean load: 1 when balanced, ``E`` when one expert takes all."""
    counts = torch.as_tensor(per_expert, dtype=torch.float64)
    return float(counts.max() / counts.mean())


def _task_loss(x: torch.Tensor, out: torch.Tensor, target: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """Squared error of the residual stream ``x + out`` against ``target``, summed over this rank's
    tokens and divided by all ranks' tokens: the ranks' losses add up to the mean over the batch."""
    return (x + out - target).pow(2).sum() / total_tokens


def train_router(comm: Communicator, x: torch.Tensor, target: torch.Tensor, params: dict[str, torch.Tensor],
                 top_k: int, *, steps: int, lr: float, aux_weight: float,
                 capacity_factor: float | None = None) -> dict:
    """``steps`` SGD steps of the router and its bias (the experts stay fixed) on the expert-parallel layer.

    ``x``, ``target``: the whole batch ``(P * T, hidden)``; rank ``r`` takes rows ``r*T ... (r+1)*T - 1``.
    Each rank's loss: ``_task_loss`` of its tokens plus ``aux_weight / P`` times the
    :func:`load_balancing_loss` of its tokens; the router's gradients are all-reduced (summed) before
    each step. Returns ``{"per_expert": assignments kept per expert over all ranks, before each step and
    after the last (steps + 1 lists of E), "aux": the mean over ranks of the load-balancing loss before
    each step, "router", "bias": the trained values}``. Collective; blocks.
    """
    world_size, rank = comm.world_size, comm.rank
    tokens = x.shape[0] // world_size
    if tokens * world_size != x.shape[0]:
        raise ValueError(f"train_router: rank {rank}: {x.shape[0]} tokens do not split over {world_size} ranks")
    mine = slice(rank * tokens, (rank + 1) * tokens)
    xr, target_r = x[mine], target[mine]
    router, bias = params["router"].clone(), params["bias"].clone()
    history: dict[str, list] = {"per_expert": [], "aux": []}
    for step in range(steps + 1):
        shards = shard_experts({**params, "router": router, "bias": bias}, rank, world_size)
        out, stats = expert_parallel_moe(comm, xr, shards, top_k, capacity_factor=capacity_factor)
        counts = comm.all_reduce(torch.tensor(stats["per_expert"], dtype=torch.int64))    # (E,) over all ranks
        history["per_expert"].append(counts.tolist())
        aux = load_balancing_loss(xr, shards["router"], shards["bias"], top_k)
        history["aux"].append(float(comm.all_reduce(aux.detach()) / world_size))
        if step == steps:
            break
        loss = _task_loss(xr, out, target_r, x.shape[0]) + aux_weight / world_size * aux
        grads = torch.autograd.grad(loss, [shards["router"], shards["bias"]])
        with torch.no_grad():
            router = router - lr * comm.all_reduce(grads[0])
            bias = bias - lr * comm.all_reduce(grads[1])
    history.update(router=router, bias=bias)
    return history


def train_router_reference(x: torch.Tensor, target: torch.Tensor, params: dict[str, torch.Tensor], top_k: int,
                           *, steps: int, lr: float, aux_weight: float, groups: int,
                           capacity_factor: float | None = None) -> dict:
    """:func:`train_router` on one device: the layer is :func:`moe` with ``groups`` groups (one per rank),
    the load-balancing loss the mean over the groups of each group's. Same result dict."""
    router, bias = params["router"].clone(), params["bias"].clone()
    history: dict[str, list] = {"per_expert": [], "aux": []}
    num_experts = router.shape[0]
    for step in range(steps + 1):
        leaves = {**params, "router": router.clone().requires_grad_(), "bias": bias.clone().requires_grad_()}
        out = moe(x, leaves, top_k, capacity_factor=capacity_factor, groups=groups)
        counts = torch.zeros(num_experts, dtype=torch.int64)
        auxes = []
        for rows in torch.arange(x.shape[0]).chunk(groups):
            _, experts = route(x[rows], leaves["router"], leaves["bias"], top_k)
            kept = keep_mask(experts, num_experts, capacity(len(rows), top_k, num_experts, capacity_factor))
            counts += tokens_per_expert(experts, kept, num_experts)
            auxes.append(load_balancing_loss(x[rows], leaves["router"], leaves["bias"], top_k))
        aux = torch.stack(auxes).mean()
        history["per_expert"].append(counts.tolist())
        history["aux"].append(float(aux.detach()))
        if step == steps:
            break
        loss = _task_loss(x, out, target, x.shape[0]) + aux_weight * aux
        grads = torch.autograd.grad(loss, [leaves["router"], leaves["bias"]])
        router, bias = router - lr * grads[0], bias - lr * grads[1]
    history.update(router=router, bias=bias)
    return history
