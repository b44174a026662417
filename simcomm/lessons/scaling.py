"""Exercise checkers of lessons 09-12 (context, expert and 3-D parallelism, debugging).

Every checker takes what the learner wrote (a function, or a value) and
*returns* its verdict as one line; it never raises for anything the learner
wrote, so a learner never meets a raw traceback:

* :data:`NOT_ANSWERED` while the placeholder is untouched (``...`` or a
  function raising ``NotImplementedError``), so a notebook runs top to bottom;
* ``Not yet: <what is wrong> <hint>`` for a wrong, partial or malformed answer
  (or one that raised or deadlocked);
* ``Correct: <what was checked>`` for a right one.

Programs a checker runs go to the simulator (``World``), whatever the
configured backend: an exercise checks understanding, and a deadlocking
answer must fail at once, not after a real backend's timeout.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import DeadlockError, RankError, RunTimeoutError, SimcommError
from ..parallel.context import block_attention, chunk_ids, lse_merge, shard_sequence
from ..parallel.expert import keep_mask, rows_per_rank, switch_aux_loss
from ..planning.planner import fastest_fitting
from ..parallel.mesh import Layout
from ..sim.world import World
from .verdicts import helper_verdict as _helper_verdict
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import judged_as_processes as _judged_as_processes
from .verdicts import NOT_ANSWERED, as_number, attempt, is_correct, is_placeholder
from .verdicts import not_yet as _not_yet
from .verdicts import uses_helper as _uses_helper

__all__ = ["NOT_ANSWERED", "is_correct", "check_lse_merge", "check_zigzag_chunks", "check_split_sizes",
           "check_dropped", "check_aux_loss", "check_neighbour_exchange", "check_sp_layernorm", "check_mesh_coords",
           "check_layout_choice"]


def _call(function: Callable, *args: Any) -> tuple[Any, str | None]:
    """``(result, None)``, or ``(None, verdict)`` when the call raised (:func:`simcomm.lessons.verdicts.attempt`)."""
    return attempt(lambda: function(*args))


def _as_int(value: Any) -> int | None:
    """One whole number of any numeric type (``int``, numpy integers, 0-d tensors, ``2.0``), else ``None``."""
    number = as_number(value)
    return int(number) if number is not None and math.isfinite(number) and number.is_integer() else None


def _as_ints(value: Any) -> list[int] | None:
    """A list or tuple (or 1-d tensor or array) of whole numbers of any numeric type, else ``None``."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return None
    ints = [_as_int(v) for v in value]
    return None if any(v is None for v in ints) else ints


# -- lesson 09 ---------------------------------------------------------------------------------

def _blocks(seed: int, split: int, keys: int = 6):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 3, 2, 4, generator=gen, dtype=torch.float64) if i == 0 else
               torch.randn(1, keys, 2, 4, generator=gen, dtype=torch.float64) for i in range(3))
    whole = block_attention(q, k, v)
    return block_attention(q, k[:, :split], v[:, :split]), block_attention(q, k[:, split:], v[:, split:]), whole


@_hint_on_request
def check_lse_merge(merge: Callable) -> str:
    """``merge(out1, lse1, out2, lse2) -> (out, lse)``: attention over two key blocks from each block's
    output ``(b, sq, h, d)`` and log-sum-exp ``(b, sq, h)``."""
    if is_placeholder(merge):
        return NOT_ANSWERED
    if not callable(merge):
        return _not_yet("merge must be a function merge(out1, lse1, out2, lse2) returning (out, lse)")
    helper = lse_merge if merge is lse_merge else _uses_helper(merge, lse_merge)
    if helper is not None:
        return _helper_verdict(helper, "the merge")
    cases = 0
    for seed, split in ((0, 2), (1, 5), (2, 1)):
        (out1, lse1), (out2, lse2), (out, lse) = _blocks(seed, split)
        result, verdict = _call(merge, out1, lse1, out2, lse2)
        if verdict:
            return verdict
        if not isinstance(result, tuple) or len(result) != 2 or not all(isinstance(t, torch.Tensor) for t in result):
            return _not_yet("return a pair (out, lse) of tensors; the lse is needed to merge the next block "
                            f"(got {type(result).__name__})")
        got_out, got_lse = result
        if got_out.shape != out.shape or got_lse.shape != lse.shape:
            return _not_yet(f"shapes {tuple(got_out.shape)} and {tuple(got_lse.shape)}; expected out "
                            f"{tuple(out.shape)} and lse {tuple(lse.shape)} (the inputs' shapes)")
        lse_ok = torch.allclose(got_lse, lse, atol=1e-10)
        out_ok = torch.allclose(got_out, out, atol=1e-10)
        if out_ok and not lse_ok:
            return _not_yet("the output is right but the lse is not",
                            "the merged lse is log(exp(lse1) + exp(lse2)), computed without overflow")
        if lse_ok and not out_ok:
            return _not_yet("the lse is right but the output is not", "weigh each block's output by "
                            "exp(lse_i - lse), its share of the whole softmax denominator")
        if not out_ok:
            return _not_yet("out and lse both differ from attention over both blocks", "each block's output is "
                            "normalised by its own sum exp(lse_i); renormalise both to the common sum")
        cases += 1
    (out1, lse1), (out2, lse2), (out, lse) = _blocks(4, 3)
    shift = 100.0 - float(torch.maximum(lse1, lse2).max())       # logits this large: lse up to 100
    large = [t.float() for t in (out1, lse1 + shift, out2, lse2 + shift)]
    result, verdict = _call(merge, *large)
    if verdict:
        return verdict
    if (not isinstance(result, tuple) or len(result) != 2 or not all(isinstance(t, torch.Tensor) for t in result)
            or not torch.isfinite(result[0]).all() or not torch.isfinite(result[1]).all()
            or not torch.allclose(result[0].double(), out, atol=1e-5)
            or not torch.allclose(result[1].double(), lse + shift, atol=1e-4)):
        return _not_yet("in float32 with large logits (lse up to 100) your merge is not finite or not right: "
                        "exp(100) overflows float32 (its largest value is about exp(88.7))",
                        "never exponentiate an lse itself: torch.logaddexp(lse1, lse2), or the larger lse plus "
                        "log1p(exp(smaller - larger)), stays finite")
    (out2, lse2) = _blocks(3, 2)[1]
    empty = torch.full_like(lse2, float("-inf"))
    result, verdict = _call(merge, torch.zeros_like(out2), empty, out2, lse2)
    if verdict:
        return verdict
    if (not isinstance(result, tuple) or len(result) != 2 or not torch.allclose(result[0], out2, atol=1e-12)
            or not torch.allclose(result[1], lse2, atol=1e-12)):
        return _not_yet("merging with an empty block (out 0, lse -inf), the start of the ring, must give the "
                        "other block unchanged", "torch.logaddexp handles -inf; lse1 + log1p(exp(lse2 - lse1)) "
                        "gives nan when lse1 is -inf")
    return (f"Correct: {cases} pairs of blocks merge to attention over both, large logits stay finite in float32, "
            "and an empty block changes nothing.")


@_hint_on_request
def check_zigzag_chunks(chunks: Callable) -> str:
    """``chunks(rank, world_size) -> [i, j]``: the two of the ``2P`` chunks rank holds in zig-zag sharding."""
    if is_placeholder(chunks):
        return NOT_ANSWERED
    helper = chunk_ids if chunks is chunk_ids else _uses_helper(chunks, chunk_ids, shard_sequence)
    if helper is not None:
        return _helper_verdict(helper, "the chunks of each rank")
    for world_size in (1, 2, 3, 4, 8):
        held = []
        for rank in range(world_size):
            result, verdict = _call(chunks, rank, world_size)
            if verdict:
                return verdict
            ids = _as_ints(result)
            if ids is None or len(ids) != 2:
                return _not_yet(f"chunks({rank}, {world_size}) returned {result!r}; return a list of two chunk "
                                "indices (whole numbers)")
            held.append(sorted(ids))
        flat = sorted(i for ids in held for i in ids)
        if flat != list(range(2 * world_size)):
            return _not_yet(f"with {world_size} ranks the chunks held are {held}; every one of the "
                            f"{2 * world_size} chunks must be held by exactly one rank")
        work = [sum(q + 1 for q in ids) for ids in held]        # key chunks at or before each query chunk
        if len(set(work)) != 1:
            return _not_yet(f"with {world_size} ranks your chunks give causal work (key chunks at or before "
                            f"each query chunk) {work} per rank: not balanced",
                            "pair a chunk from the head with one from the tail")
    return ("Correct: balanced chunks for 1 to 8 ranks: every rank does the same causal work, 2P + 1 "
            "blocks (zig-zag: one chunk from the head, one from the tail).")


# -- lesson 10 ---------------------------------------------------------------------------------

def _routings() -> list[tuple[torch.Tensor, int, int]]:
    gen = torch.Generator().manual_seed(7)
    cases = [(torch.randint(0, 8, (10, 2), generator=gen), 8, 4),
             (torch.randint(0, 6, (7, 1), generator=gen), 6, 3),
             (torch.tensor([[0, 1], [1, 0], [0, 1]]), 4, 2),      # nothing for rank 1's experts
             (torch.tensor([[5, 2], [5, 4]]), 6, 6)]
    return cases


@_hint_on_request
def check_split_sizes(split_sizes: Callable) -> str:
    """``split_sizes(experts (T, k), num_experts, world_size) -> list``: rows this rank sends to each rank
    (``input_split_sizes``), experts sharded in contiguous blocks of ``E/P``."""
    if is_placeholder(split_sizes):
        return NOT_ANSWERED
    helper = _uses_helper(split_sizes, rows_per_rank)
    if helper is not None:
        return _helper_verdict(helper, "the rows for each rank")
    for experts, num_experts, world_size in _routings():
        result, verdict = _call(split_sizes, experts.clone(), num_experts, world_size)
        if verdict:
            return verdict
        expected = torch.bincount(experts.flatten() // (num_experts // world_size), minlength=world_size).tolist()
        got = _as_ints(result)
        where = f"for experts {experts.tolist()} ({num_experts} experts on {world_size} ranks)"
        if got is None:
            return _not_yet(f"return a list of {world_size} whole numbers {where}; got {result!r}")
        if len(got) == num_experts and num_experts != world_size:
            return _not_yet(f"{got} has one entry per expert {where}; all_to_all_single needs one per rank",
                            "add up the counts of the experts each rank holds")
        if len(got) != world_size:
            return _not_yet(f"{len(got)} entries {where}; input_split_sizes has one per rank ({world_size})")
        if sum(got) != experts.numel():
            return _not_yet(f"your sizes add up to {sum(got)} {where}, but {experts.numel()} rows are sent "
                            f"(one per token per chosen expert)")
        if got != expected:
            return _not_yet(f"{got} {where} is not it", "rank r holds experts r*E/P to (r+1)*E/P - 1")
    return "Correct: split sizes for 4 routings, including a rank that receives nothing."


@_hint_on_request
def check_dropped(dropped: Callable) -> str:
    """``dropped(experts (T, k), num_experts, capacity) -> int``: assignments beyond each expert's capacity
    (the first ``capacity`` in token order are kept)."""
    if is_placeholder(dropped):
        return NOT_ANSWERED
    helper = _uses_helper(dropped, keep_mask)
    if helper is not None:
        return _helper_verdict(helper, "which copies each expert keeps")
    for experts, num_experts, _ in _routings():
        for limit in (0, 1, 2, 5):
            result, verdict = _call(dropped, experts.clone(), num_experts, limit)
            if verdict:
                return verdict
            count = _as_int(result)
            if count is None:
                return _not_yet(f"return the number of dropped assignments, a whole number; got {result!r}")
            expected = int((~keep_mask(experts, num_experts, limit)).sum())
            if count != expected:
                per_expert = torch.bincount(experts.flatten(), minlength=num_experts).tolist()
                return _not_yet(f"{count} dropped for tokens per expert {per_expert} and capacity {limit} is "
                                "not it", "each expert drops max(0, count - capacity), summed over experts")
    return "Correct: dropped assignments for 4 routings and capacities 0, 1, 2, 5."


def _aux_cases() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Router probabilities ``(T, E)`` (float64) and their top-k choices: top-2 and top-1, balanced and
    skewed, with an expert nobody chooses."""
    gen = torch.Generator().manual_seed(11)
    cases = []
    for tokens, num_experts, top_k, skew in ((12, 8, 2, 0.0), (9, 4, 1, 0.0), (10, 6, 2, 3.0)):
        logits = torch.randn(tokens, num_experts, generator=gen, dtype=torch.float64)
        logits[:, 0] += skew
        probs = torch.softmax(logits, dim=-1)
        cases.append((probs, probs.topk(top_k, dim=-1).indices))
    return cases


@_hint_on_request
def check_aux_loss(aux_loss: Callable) -> str:
    """``aux_loss(probs (T, E), experts (T, k)) -> 0-d tensor``: Switch Transformer's load-balancing loss
    ``E * sum_e f_e * P_e`` (``f_e``: share of the ``T * k`` assignments that go to ``e``; ``P_e``: mean
    router probability of ``e``). Its value and its gradient with respect to ``probs`` must equal the
    formula's (float64) for three routings."""
    if is_placeholder(aux_loss):
        return NOT_ANSWERED
    if not callable(aux_loss):
        return _not_yet(f"aux_loss must be a function, got {type(aux_loss).__name__}")
    for probs, experts in _aux_cases():
        tokens, num_experts = probs.shape
        where = f"for {tokens} tokens, {num_experts} experts, top-{experts.shape[1]}"
        leaf = probs.clone().requires_grad_()
        result, verdict = _call(aux_loss, leaf, experts.clone())
        if verdict:
            return verdict
        if not isinstance(result, torch.Tensor):
            value = as_number(result)
            if value is None:
                return _not_yet(f"{where}: return a 0-d tensor; got {result!r}")
            return _not_yet(f"{where}: you returned a plain number ({value:g}); the router learns from this "
                            "loss, so it must stay a tensor autograd can differentiate",
                            "no .item(), float() or .tolist() on the way")
        if result.numel() != 1:
            return _not_yet(f"{where}: the loss has shape {tuple(result.shape)}; it must be one number",
                            "sum over the experts")
        want = switch_aux_loss(probs, experts)
        value = float(result.detach())
        if abs(value - float(want)) > 1e-9 * max(1.0, abs(float(want))):
            ratio = value / float(want) if float(want) else math.nan
            if abs(ratio * num_experts - 1) < 1e-6:
                return _not_yet(f"{where}: {value:.4f} is the formula divided by E = {num_experts}",
                                "multiply by the number of experts: then a uniform router scores 1")
            if abs(ratio - experts.shape[1]) < 1e-6:
                return _not_yet(f"{where}: {value:.4f} is k = {experts.shape[1]} times the formula",
                                "f_e is a share of the T * k assignments, not of the T tokens")
            return _not_yet(f"{where}: {value:.4f} is not E * sum_e f_e * P_e = {float(want):.4f}",
                            "f_e: bincount of the chosen experts over T * k; P_e: probs.mean(0)")
        if not result.requires_grad:
            return _not_yet(f"{where}: the value is right but no gradient reaches probs",
                            "P_e must be computed from probs, not from a detached copy or the counts")
        grads, verdict = attempt(lambda: torch.autograd.grad(result.sum(), [leaf], allow_unused=True))
        if verdict:
            return verdict
        grad, want_grad = grads[0], _aux_gradient(probs, experts)
        if grad is None or not torch.allclose(grad, want_grad, atol=1e-12, rtol=0):
            return _not_yet(f"{where}: the value is right, but its gradient with respect to probs is not the "
                            "formula's", "f_e is a count (no gradient); the gradient flows through P_e only")
    return "Correct: the load-balancing loss and its gradient for 3 routings (top-2, top-1, a skewed router)."


def _aux_gradient(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    leaf = probs.clone().requires_grad_()
    (grad,) = torch.autograd.grad(switch_aux_loss(leaf, experts), [leaf])
    return grad


# -- lesson 11 ---------------------------------------------------------------------------------

def _exchange_program(comm, exchange: Callable):
    x = torch.full((2,), float(comm.rank))
    return exchange(comm, x)


#: how long lesson 11's exchange may run on the checker's virtual ranks (seconds)
EXCHANGE_TIMEOUT_S = 10.0


@_hint_on_request
@_judged_as_processes
def check_neighbour_exchange(exchange: Callable) -> str:
    """``exchange(comm, x) -> (from_left, from_right)``: every rank gets ``x`` of rank - 1 and rank + 1
    (cyclic), with blocking ``send``/``recv`` only (``comm.send``/``comm.recv`` or ``dist.send``/``dist.recv``;
    no collective, no ``isend``/``irecv``/``batch_isend_irecv``), and no deadlock."""
    if is_placeholder(exchange):
        return NOT_ANSWERED
    for world_size in (2, 3, 4, 5):
        world = World(world_size)
        try:
            outs = world.run(_exchange_program, exchange, timeout=EXCHANGE_TIMEOUT_S)
        except DeadlockError as error:
            waits = re.findall(r"rank (\d+) waits in (\w+)", str(error))
            blocked = ", ".join(f"rank {rank} in {op}" for rank, op in waits) or _first_line(error)
            return _not_yet(f"it deadlocks on {world_size} ranks: every rank is blocked ({blocked})",
                            "a blocking send waits for its receiver: if every rank sends first, nobody receives. "
                            "Let even ranks send first and odd ranks receive first")
        except RunTimeoutError:
            return _not_yet(f"on {world_size} ranks the exchange was still running after {EXCHANGE_TIMEOUT_S:g} s "
                            "(an endless loop?)", "each rank needs exactly two sends and two receives")
        except RankError as error:
            if isinstance(error.__cause__, NotImplementedError):
                return NOT_ANSWERED
            return _not_yet(f"on {world_size} ranks {_first_line(error)}")
        except SimcommError as error:
            return _not_yet(f"on {world_size} ranks {_first_line(error)}")
        used = sorted({f"{e.op} (non-blocking)" if e.async_op else e.op for e in world.trace.events
                       if e.op != "compute" and (e.op not in ("send", "recv") or e.async_op)})
        if used:
            return _not_yet(f"the exercise allows blocking send and recv only; your exchange used {used}",
                            "order the blocking sends and receives so that every send meets a receive")
        for rank, out in enumerate(outs):
            if not isinstance(out, tuple) or len(out) != 2 or not all(isinstance(t, torch.Tensor) for t in out):
                return _not_yet(f"return a pair (from_left, from_right) of tensors; rank {rank} returned {out!r}")
            left, right = (rank - 1) % world_size, (rank + 1) % world_size
            got = [t.flatten().tolist() for t in out]
            if got != [[float(left)] * 2, [float(right)] * 2]:
                return _not_yet(f"on {world_size} ranks, rank {rank} got {got}; expected rank {left}'s x then "
                                f"rank {right}'s x")
    return "Correct: the exchange finishes on 2 to 5 ranks and every rank gets both neighbours' tensors."


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    return lines[0].rstrip(":") + (f" ({lines[1]})" if lines[0].endswith(":") and len(lines) > 1 else "")


def _layernorm_program(comm, step: Callable, x, weight, bias, probe):
    shard = x.shape[0] // comm.world_size
    mine = slice(comm.rank * shard, (comm.rank + 1) * shard)
    return step(comm, x[mine].clone(), weight.clone().requires_grad_(), bias.clone().requires_grad_(),
                probe[mine])


def _layernorm_grads(x: torch.Tensor, probe: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-device gradients of ``sum(layer_norm(x) * probe)`` with respect to weight and bias."""
    leaves = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    (F.layer_norm(x, x.shape[-1:], *leaves) * probe).sum().backward()
    return leaves[0].grad, leaves[1].grad


@_hint_on_request
@_judged_as_processes
def check_sp_layernorm(step: Callable, world_size: int = 4) -> str:
    """``step(comm, x_shard, weight, bias, probe_shard) -> (weight_grad, bias_grad)``: LayerNorm on this
    rank's sequence shard, loss ``sum(out * probe)``, gradients of the replicated weight and bias as
    the single-device LayerNorm over the whole sequence gives them, on every rank."""
    if is_placeholder(step):
        return NOT_ANSWERED
    gen = torch.Generator().manual_seed(11)
    x, probe = (torch.randn(8, 6, generator=gen, dtype=torch.float64) for _ in range(2))
    weight = 1 + 0.1 * torch.randn(6, generator=gen, dtype=torch.float64)
    bias = torch.randn(6, generator=gen, dtype=torch.float64)
    expected = _layernorm_grads(x, probe, weight, bias)
    shares = [_layernorm_grads(part_x, part_p, weight, bias)             # each rank's shard alone
              for part_x, part_p in zip(x.chunk(world_size), probe.chunk(world_size))]
    try:
        outs = World(world_size).run(_layernorm_program, step, x, weight, bias, probe, timeout=30)
    except RankError as error:
        if isinstance(error.__cause__, NotImplementedError):
            return NOT_ANSWERED
        return _not_yet(_first_line(error))
    except SimcommError as error:
        return _not_yet(_first_line(error))
    for rank, out in enumerate(outs):
        if (not isinstance(out, (tuple, list)) or len(out) != 2
                or not all(isinstance(t, torch.Tensor) and t.shape == (6,) for t in out)):
            return _not_yet(f"return (weight_grad, bias_grad), two tensors of shape (6,); rank {rank} "
                            f"returned {out!r}")
        for index, name in enumerate(("weight", "bias")):
            got, want = out[index].detach().double(), expected[index]
            if torch.allclose(got, want, atol=1e-10):
                continue
            if torch.allclose(got, shares[rank][index], atol=1e-10):
                return _not_yet(f"rank {rank}'s {name} gradient is only its own shard's share",
                                f"the replicated LayerNorm {name} needs the sum over the sequence shards: "
                                "all-reduce it")
            if torch.allclose(got, want * world_size, atol=1e-10):
                return _not_yet(f"rank {rank}'s {name} gradient is {world_size} times too large",
                                "summed twice? one SUM all-reduce of the shards' gradients is the whole sum")
            if torch.allclose(got, want / world_size, atol=1e-10):
                return _not_yet(f"rank {rank}'s {name} gradient is 1/{world_size} of the single-device one: the "
                                "shards' gradients were averaged, not summed",
                                "lesson 06 averaged because each rank's loss was a mean over its rows; here the "
                                "loss is a sum over the whole sequence, so its gradient is the SUM of the shards'")
            return _not_yet(f"rank {rank}'s {name} gradient differs from the single-device LayerNorm's",
                            "each rank's gradient of the replicated weight and bias covers only its shard")
    return (f"Correct: on {world_size} ranks every rank's LayerNorm weight and bias gradients equal the "
            f"single-device ones.")


# -- lesson 12 ---------------------------------------------------------------------------------

@_hint_on_request
def check_mesh_coords(coords: Callable) -> str:
    """``coords(rank, pp=..., dp=..., tp=...) -> (stage, d, t)``: the coordinates of
    :class:`simcomm.parallel.mesh.Layout` (pipeline outermost, tensor parallelism innermost)."""
    if is_placeholder(coords):
        return NOT_ANSWERED
    if _uses_helper(coords, Layout) is not None:
        return _not_yet("Layout computes the coordinates for you: the exercise asks you to work them out from "
                        "the rank and the sizes", "the tensor index changes fastest, then the data index, "
                        "then the stage")
    for sizes in (dict(pp=2, dp=2, tp=2), dict(pp=1, dp=2, tp=4), dict(pp=2, dp=4, tp=1), dict(pp=4, dp=1, tp=2),
                  dict(pp=1, dp=2, tp=3)):
        layout = Layout(**sizes)
        named = ", ".join(f"{dim}={size}" for dim, size in sizes.items())
        for rank in range(layout.world_size):
            result, verdict = _call(lambda r, sizes=sizes: coords(r, **sizes), rank)
            if verdict:
                return verdict
            got = _as_ints(result)
            if got is None or len(got) != 3:
                return _not_yet(f"coords({rank}, {named}) returned {result!r}; return "
                                "(stage, d, t), three whole numbers")
            expected = list(layout.coordinates(rank))
            if got != expected:
                return _not_yet(f"rank {rank} with {named}: {tuple(got)} is not its (stage, d, t)",
                                "the tp ranks are neighbours (rank % tp), then dp, then the stage")
    return "Correct: mesh coordinates for 5 layouts, every rank."


#: the exercise's table: the 8-rank layouts of section 3, of which this many fit the memory limit
LAYOUT_EXERCISE = {"world_size": 8, "layouts": 7, "fitting": 5,
                   "topologies": ("NVLink node", "InfiniBand cluster"), "topology": "InfiniBand cluster"}


def _not_the_table(rows: Any, memory_limit: Any, topology: Any) -> str | None:
    """What makes ``rows``, ``memory_limit`` and ``topology`` not the exercise's (the checker does not
    trust a table the learner's cell passes in: a shorter or edited one would make any answer right)."""
    want = LAYOUT_EXERCISE
    if topology != want["topology"]:
        return f"the exercise asks about the {want['topology']}; the check was called with {topology!r}"
    if not isinstance(rows, list) or len(rows) != want["layouts"] or not all(isinstance(row, dict) for row in rows):
        return f"rows must be the table of section 3, {want['layouts']} layouts of {want['world_size']} ranks"
    keys = {"pp", "dp", "tp", "peak_bytes", *want["topologies"]}
    if any(not keys <= set(row) for row in rows) or \
            any(row["pp"] * row["dp"] * row["tp"] != want["world_size"] for row in rows) or \
            len({(row["pp"], row["dp"], row["tp"]) for row in rows}) != want["layouts"]:
        return f"rows must be the table of section 3, {want['layouts']} different layouts of {want['world_size']} ranks"
    fitting = sum(row["peak_bytes"] <= memory_limit for row in rows) if isinstance(memory_limit, (int, float)) else -1
    if fitting != want["fitting"]:
        return (f"with memory_limit = {memory_limit!r}, {fitting} layouts fit; the exercise's limit lets "
                f"{want['fitting']} of the {want['layouts']} fit")
    return None


@_hint_on_request
def check_layout_choice(choice: Any, rows: list[dict], memory_limit: int, topology: str) -> str:
    """``choice``: the ``Layout(pp=, dp=, tp=)`` with the shortest ``topology`` step time whose peak memory
    per rank fits ``memory_limit`` bytes, read from ``rows``
    (:func:`simcomm.planning.layout_choice.layout_table`)."""
    if is_placeholder(choice):
        return NOT_ANSWERED
    if not isinstance(choice, Layout) or choice.cp != 1:
        return _not_yet(f"give the layout by name, as Layout(pp=..., dp=..., tp=...); got {choice!r}",
                        "a row's own row['layout'] is one")
    name = lambda pp, dp, tp: Layout(pp=pp, dp=dp, tp=tp)   # noqa: E731  one spelling for every message
    problem = _not_the_table(rows, memory_limit, topology)
    if problem:
        return _not_yet(problem, "keep the checker's call as the lesson wrote it: rows, memory_limit and the "
                        "topology of section 3 and exercise 2")
    by_layout = {(row["pp"], row["dp"], row["tp"]): row for row in rows}
    got = (choice.pp, choice.dp, choice.tp)
    if got not in by_layout:
        return _not_yet(f"{name(*got)!r} is not a layout of the table; pick one of "
                        f"{', '.join(repr(name(*key)) for key in sorted(by_layout))}")
    best = fastest_fitting(rows, memory_limit, topology)
    row = by_layout[got]
    if row["peak_bytes"] > memory_limit:
        return _not_yet(f"{name(*got)!r} needs {row['peak_bytes']:,} bytes per rank, more than the limit "
                        f"{memory_limit:,}", "shard more (larger tp or pp)")
    if name(*got) != best:
        return _not_yet(f"{name(*got)!r} fits, but another layout that fits is faster on the {topology} "
                        f"({row[topology] * 1e6:.1f} us for yours)", "compare the step times of the rows that fit")
    return (f"Correct: {name(*got)!r} is the fastest layout on the {topology} within {memory_limit:,} bytes "
            "per rank.")
