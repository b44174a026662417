"""Helpers the lesson notebooks import, so their cells stay a few lines long.

* checks that turn a claim into an ``assert`` with a readable message
  (:func:`assert_close`, :func:`expect_error`);
* :func:`gradcheck_across_ranks`, a finite-difference check of the gradients
  every rank gets, through the real collectives;
* :func:`ring_all_reduce`, the ring algorithm written with ``send``/``recv``;
* one checker per exercise (``check_*``), each running on the simulator
  (an exercise checks the learner's understanding, whatever the backend;
  a placeholder that raises inside a rank would otherwise cost real
  workers a restart). A checker *returns* its verdict as text and never
  raises for anything the learner wrote, so a learner never meets a raw
  traceback: :data:`NOT_ANSWERED` for the untouched placeholder (``...``,
  or a function raising ``NotImplementedError``), so a notebook runs top to
  bottom before the learner has answered; a line starting with ``Not yet:``
  and a hint for a wrong, partial or malformed answer (or one that raised,
  deadlocked or broke a rule of the exercise); a line starting with
  ``Correct`` for a right one. :func:`is_correct` tells them apart.

Nothing here prints: the functions return text for the notebook to show.
Programs defined here are ordinary module-level functions, so the real
backend's workers can import them.
"""
from __future__ import annotations

import math

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import DeadlockError
from ..parallel.ring import ring_exchange, ring_schedule
from ..parallel.tensor import make_mlp, mlp, shard_mlp
from ..sim.world import World
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import judged_as_processes as _judged_as_processes
from .verdicts import reduce_scatter_traffic as _reduce_scatter_traffic
from .verdicts import NOT_ANSWERED, is_correct
from .verdicts import Forbidden as _Forbidden
from .verdicts import attempt as _attempt
from .verdicts import is_placeholder as _is_placeholder
from .verdicts import not_yet as _not_yet

__all__ = [
    "per_rank", "max_error", "assert_close", "expect_error", "gradcheck_across_ranks",
    "ring_all_reduce", "ring_schedule", "ring_exchange", "NOT_ANSWERED", "is_correct",
    "check_prediction", "check_count_ranks", "check_deadlocks", "check_shapes", "check_all_gather_backward",
    "check_ring_all_gather", "check_tp_mlp", "check_ulysses_gqa_bytes",
]



from .asserts import _format, assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank  # noqa: E402,F401


# -- the ring all-reduce, step by step ----------------------------------------------------------

def ring_all_reduce(comm, x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the group with the ring algorithm, using only ``send``/``recv``.

    Follows :func:`simcomm.parallel.ring.ring_schedule`; each step is one
    :func:`simcomm.parallel.ring.ring_exchange` with the neighbours. Returns a new
    tensor; ``x`` is not modified. ``x.numel()`` must be divisible by the
    world size. Blocks until the whole ring has run.
    """
    world_size, rank = comm.world_size, comm.rank
    if world_size == 1:
        return x.clone()
    chunks = list(x.detach().flatten().clone().chunk(world_size))  # world_size views of (numel/P,)
    for step, transfers in enumerate(ring_schedule(world_size)):
        _, _, send_chunk = transfers[rank]
        _, _, recv_chunk = transfers[(rank - 1) % world_size]
        incoming = ring_exchange(comm, chunks[send_chunk].clone())
        if step < world_size - 1:
            chunks[recv_chunk] = chunks[recv_chunk] + incoming   # reduce-scatter: accumulate
        else:
            chunks[recv_chunk] = incoming                        # all-gather: take the finished chunk
    return torch.cat(chunks).reshape(x.shape)


# -- what every checker shares: simcomm.lessons.verdicts -------------------------------------------------


def _as_numbers(value: Any, what: str) -> tuple[torch.Tensor | None, str | None]:
    """A float64 tensor of ``value`` (a number, a list of numbers or a tensor), or a verdict."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double(), None
    try:
        return torch.as_tensor(value, dtype=torch.float64), None
    except (TypeError, ValueError, RuntimeError):
        return None, _not_yet(f"{what}: {value!r} is not a number or a list of numbers")


# -- exercise checkers --------------------------------------------------------------------------

#: the collectives whose result lesson 01's second exercise asks to predict
PREDICTED_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast")


def _lesson01_collective(comm, op: str, kwargs: dict):
    x = 10.0 * comm.rank + torch.arange(4.0)          # lesson 01's inputs: rank r holds [10r, ..., 10r + 3]
    return getattr(comm, op)(x, **kwargs)


@_hint_on_request
def check_prediction(prediction: Any, op: str, kwargs: dict, rank: int, what: str, hint: str | None = None,
                     world_size: int = 4) -> str:
    """Compare a learner's predicted value (a number, list or tensor) with what ``comm.op(x, **kwargs)``
    returns on ``rank`` of ``world_size`` virtual ranks when rank ``r`` holds ``[10r, ..., 10r + 3]``
    (lesson 01's inputs). The checker runs the collective itself; it trusts no value from the caller.

    A wrong prediction is answered with what differs (how many numbers, or that
    the values differ) and ``hint``, not with the actual value.
    """
    if _is_placeholder(prediction):
        return NOT_ANSWERED
    if op not in PREDICTED_OPS:
        raise ValueError(f"check_prediction: op={op!r} is not one of {list(PREDICTED_OPS)}")
    if not (isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"check_prediction: rank={rank!r} is not a rank of {world_size}")
    predicted, problem = _as_numbers(prediction, what)
    if problem:
        return problem
    actual, _ = _as_numbers(World(world_size).run(_lesson01_collective, op, dict(kwargs))[rank], what)
    return _compare_prediction(predicted, actual, what, hint)


def _compare_prediction(predicted: torch.Tensor, actual: torch.Tensor, what: str, hint: str | None) -> str:
    if predicted.numel() != actual.numel():
        return _not_yet(f"{what} holds {actual.numel()} number(s); you gave {predicted.numel()}", hint)
    if not torch.allclose(predicted.flatten(), actual.flatten()):
        return _not_yet(f"{what} is not {_format(predicted.flatten())}", hint)
    return f"Correct: {what} is {_format(actual.flatten())}."


class _CommWithoutSize:
    """A communicator that refuses to tell its size: the exercise asks to find it with a collective."""

    _FORBIDDEN = ("world_size", "ranks", "group_size", "size")

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name: str):
        if name in self._FORBIDDEN:
            raise _Forbidden(f"your program read comm.{name}; the exercise asks you to count the ranks "
                             "with one comm.all_reduce instead")
        return getattr(self._comm, name)


def _count_ranks_program(comm, count_ranks: Callable):
    return count_ranks(_CommWithoutSize(comm))


@_hint_on_request
@_judged_as_processes
def check_count_ranks(count_ranks: Callable, *, world_sizes: Sequence[int] = (1, 2, 3, 5)) -> str:
    """Lesson 00: ``count_ranks(comm)`` must return the world size, found with an all-reduce.

    The program gets a communicator whose ``world_size`` (and ``ranks``) it
    may not read.
    """
    for world_size in world_sizes:
        world = World(world_size)
        outs, verdict = _attempt(lambda: world.run(_count_ranks_program, count_ranks))
        if verdict:
            return verdict
        for rank, out in enumerate(outs):
            value, problem = _as_numbers(out, f"rank {rank}'s result")
            if problem or value.numel() != 1:
                return _not_yet(f"on {world_size} ranks, rank {rank} returned {_format(out)}; return one "
                                "number (a Python number or a one-element tensor)")
            if value.item() != world_size:
                return _not_yet(f"on {world_size} ranks, rank {rank} returned {_format(value.item())}",
                                "if every rank contributes 1 to an all-reduce, what is the sum?")
        if world_size > 1 and not any(event.op == "all_reduce" for event in world.trace):
            return _not_yet("your program called no all_reduce", "count with one comm.all_reduce")
    return f"Correct: right on {', '.join(map(str, world_sizes))} ranks."


def _outcome(program: Callable, world_size: int) -> str:
    try:
        World(world_size).run(program)
    except DeadlockError:
        return "deadlock"
    except Exception:  # noqa: BLE001 - any other failure is "not a deadlock"
        return "error"
    return "finishes"


@_hint_on_request
def check_deadlocks(my_answer: Any, programs: dict[str, Callable], *, world_size: int = 4) -> str:
    """Lesson 00: ``my_answer`` names the programs (keys of ``programs``) that deadlock.

    Each program is run on ``world_size`` virtual ranks to find out; the answer
    is a set (or list) of names, empty if none deadlocks.
    """
    if _is_placeholder(my_answer):
        return NOT_ANSWERED
    if isinstance(my_answer, str):
        my_answer = {my_answer}
    if not isinstance(my_answer, (set, frozenset, list, tuple)):
        return _not_yet(f"write a set of program names, like {{'{next(iter(programs))}'}}, not {my_answer!r}")
    unknown = sorted(str(name) for name in my_answer if name not in programs)
    if unknown:
        return _not_yet(f"{unknown} is not one of the programs {sorted(programs)}")
    deadlocking = {name for name, program in programs.items() if _outcome(program, world_size) == "deadlock"}
    if set(my_answer) != deadlocking:
        wrong = len(set(my_answer) ^ deadlocking)
        return _not_yet(f"{wrong} of the {len(programs)} programs are classified wrongly",
                        "follow ranks 0 and 1 call by call: a send waits until its receiver calls recv, "
                        "and a collective waits until every rank of the group calls it")
    return f"Correct: {', '.join(sorted(deadlocking)) or 'none'} deadlock(s) on {world_size} ranks."


_SHAPE_HINTS = {
    "all_reduce": "all_reduce keeps the shape of its input",
    "all_gather": "all_gather concatenates world_size tensors along dim",
    "reduce_scatter": "reduce_scatter keeps one of world_size chunks along dim",
    "all_to_all": "all_to_all splits scatter_dim into world_size chunks and concatenates along gather_dim",
    "gather": "gather gives the concatenation to dst only",
    "broadcast": "broadcast keeps the shape",
    "slice": "slice keeps one of world_size chunks along dim",
}


def _shape_of(op: str, world_size: int, shape: tuple[int, ...], args: dict) -> tuple[int, ...] | None:
    def program(comm):
        out = getattr(comm, op)(torch.zeros(shape), **args)
        return None if out is None else tuple(out.shape)

    return World(world_size, trace=False).run(program)[0]


def _as_shape(value: Any) -> tuple[int, ...] | None | str:
    """A shape tuple, ``None``, or the string ``"malformed"``."""
    if value is None:
        return None
    if isinstance(value, (tuple, list, torch.Size)) and all(
            isinstance(size, int) and not isinstance(size, bool) for size in value):
        return tuple(value)
    return "malformed"


@_hint_on_request
def check_shapes(predictions: Any, *, world_size: int, shape: tuple[int, ...], args: dict[str, dict]) -> str:
    """Lesson 01: compare predicted output shapes (on rank 0) with what each collective returns.

    ``args`` maps every op of the exercise to the keyword arguments it is
    called with; ``predictions`` must map each of those ops to a shape tuple
    (``None`` where rank 0 gets nothing). Wrong shapes are named, with a
    hint, but not corrected.
    """
    if _is_placeholder(predictions):
        return NOT_ANSWERED
    if not isinstance(predictions, dict):
        return _not_yet(f"write a dict from op name to shape, like {{'all_reduce': (4, 8)}}, not {predictions!r}")
    unknown = sorted(str(op) for op in predictions if op not in args)
    if unknown:
        return _not_yet(f"{unknown} is not one of the calls {sorted(args)}")
    missing = [op for op in args if op not in predictions]
    if missing:
        return _not_yet(f"you predicted {len(predictions)} of {len(args)} calls; still missing: {missing}")
    malformed = [op for op in args if _as_shape(predictions[op]) == "malformed"]
    if malformed:
        op = malformed[0]
        return _not_yet(f"{op}: write a shape as a tuple of ints, like (4, 8), or None; not {predictions[op]!r}")
    wrong = [op for op in args if _as_shape(predictions[op]) != _shape_of(op, world_size, tuple(shape), args[op])]
    if wrong:
        return _not_yet(f"input {tuple(shape)} on {world_size} ranks: {len(wrong)} of {len(args)} shapes "
                        f"are wrong: {wrong}", "; ".join(_SHAPE_HINTS.get(op, op) for op in wrong))
    return f"Correct: all {len(args)} shapes."


def _all_gather_grads(comm, mine: Callable, shape: tuple[int, ...], dim: int):
    gen = torch.Generator().manual_seed(100 + comm.rank)
    x = torch.randn(shape, generator=gen, dtype=torch.float64, requires_grad=True)
    y = comm.all_gather(x, dim=dim)
    grad_out = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(grad_out)
    with torch.no_grad():
        return x.grad, mine(comm, grad_out, dim)


@_hint_on_request
@_judged_as_processes
def check_all_gather_backward(my_backward: Callable, *, world_size: int = 4,
                              shape: tuple[int, ...] = (2, 3), dims: Sequence[int] = (0, 1)) -> str:
    """Lesson 02: ``my_backward(comm, grad_out, dim)`` must return the gradient of an all-gather's input."""
    world = World(world_size)
    for dim in dims:
        per_rank_results, verdict = _attempt(lambda: world.run(_all_gather_grads, my_backward, shape, dim))
        if verdict:
            return verdict
        for rank, (autograd_grad, yours) in enumerate(per_rank_results):
            if not isinstance(yours, torch.Tensor) or tuple(yours.shape) != tuple(autograd_grad.shape):
                got = tuple(yours.shape) if isinstance(yours, torch.Tensor) else type(yours).__name__
                return _not_yet(f"dim={dim}, rank {rank}: your gradient is {got}; the input has shape "
                                f"{tuple(autograd_grad.shape)}", "the gradient has the shape of the input")
            error = max_error(yours, autograd_grad)
            if error > 1e-10:
                return _not_yet(f"dim={dim}, rank {rank}: your gradient differs from autograd's by {error:.3g}",
                                "every rank's output depends on this rank's input: whose gradients "
                                "must be added up?")
        traffic = _reduce_scatter_traffic(world.trace, world_size, world_size * math.prod(shape) * 8,
                                          skip_first=1)
        if traffic:
            return traffic
    return f"Correct: your backward equals autograd's on every rank, for dim in {tuple(dims)}."


def _ring_all_gather_program(comm, mine: Callable, base: float):
    x = base * comm.rank + torch.arange(3.0, dtype=torch.float64)   # (3,), this rank's shard
    before = x.clone()
    out = mine(comm, x)
    return out, torch.equal(x, before)


@_hint_on_request
@_judged_as_processes
def check_ring_all_gather(my_all_gather: Callable, *, world_sizes: Sequence[int] = (2, 3, 4, 5)) -> str:
    """Lesson 03: ``my_all_gather(comm, x)`` must all-gather along dim 0 with the ring.

    Rules: only ``comm.send``/``comm.recv`` (or :func:`ring_exchange`), each
    rank sends only to the next rank, ``world_size - 1`` sends of one shard
    each, the input is not modified; the result is every rank's ``x``
    concatenated in rank order on every rank.
    """
    deadlock_hint = "if every rank sends first, all wait; use lessons.ring_exchange(comm, chunk)"
    for world_size in world_sizes:
        world = World(world_size)
        outs, verdict = _attempt(lambda: world.run(_ring_all_gather_program, my_all_gather, 100.0),
                                 deadlock_hint)
        if verdict:
            return verdict
        expected = torch.cat([100.0 * rank + torch.arange(3.0, dtype=torch.float64)
                              for rank in range(world_size)])
        for rank, (out, untouched) in enumerate(outs):
            if not untouched:
                return _not_yet(f"rank {rank}'s input was modified", "work on copies (x.clone())")
            if not isinstance(out, torch.Tensor) or out.shape != expected.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                return _not_yet(f"on {world_size} ranks, rank {rank} returned {got}; expected shape "
                                f"{tuple(expected.shape)}", "concatenate the world_size shards in rank order")
            if not torch.equal(out.double(), expected):
                return _not_yet(f"on {world_size} ranks, rank {rank}'s result has the right shape but "
                                "wrong values or order", "after step s, rank r has just received the shard "
                                "of rank (r - 1 - s) mod world_size")
        collectives = sorted({event.op for event in world.trace} - {"send", "recv"})
        if collectives:
            return _not_yet(f"your program called {collectives}; the ring uses only send and recv")
        for event in world.trace.filter(op="send").events:
            if set(event.sent) - {(event.rank + 1) % world_size}:
                return _not_yet(f"on {world_size} ranks, rank {event.rank} sent to {sorted(event.sent)}; in "
                                "a ring each rank sends only to the next rank")
        sends = len(world.trace.filter(rank=0, op="send").events)
        if sends != world_size - 1:
            return _not_yet(f"on {world_size} ranks, rank 0 sent {sends} times; the ring needs world_size - 1 "
                            "sends of one shard each")
    return f"Correct: a ring all-gather on {', '.join(map(str, world_sizes))} ranks, neighbours only."


def _tp_mlp_grads(comm, layer: Callable, x: torch.Tensor, params: dict):
    shards = shard_mlp(params, comm.rank, comm.world_size)
    x = x.clone().requires_grad_()
    out = layer(comm, x, shards)
    out.pow(2).sum().backward()   # the same (replicated) loss on every rank
    return out.detach(), x.grad, {name: p.grad for name, p in shards.items()}


@_hint_on_request
@_judged_as_processes
def check_tp_mlp(layer: Callable, *, world_size: int = 4, batch: int = 3, hidden: int = 4, ffn: int = 8
                 ) -> str:
    """Lesson 04: ``layer(comm, x, shards)`` must be the tensor-parallel MLP for a replicated loss.

    Compares the output, the input gradient and every shard's gradient with
    the single-device MLP (:func:`simcomm.parallel.tensor.mlp`) in float64.
    """
    params = make_mlp(hidden, ffn, seed=7)
    x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    results, verdict = _attempt(lambda: World(world_size).run(_tp_mlp_grads, layer, x, params))
    if verdict:
        return verdict
    ref_params = {name: p.clone().requires_grad_() for name, p in params.items()}
    ref_x = x.clone().requires_grad_()
    ref_out = mlp(ref_x, ref_params)
    ref_out.pow(2).sum().backward()
    for rank, (out, x_grad, grads) in enumerate(results):
        expected = shard_mlp({name: p.grad for name, p in ref_params.items()}, rank, world_size)
        for what, got, want in [("output", out, ref_out),
                                *[(f"gradient of {name}", grads[name], expected[name]) for name in expected],
                                ("input gradient", x_grad, ref_x.grad)]:
            if not isinstance(got, torch.Tensor):
                return _not_yet(f"rank {rank}: no {what}", "is every parameter used, and the output a tensor?")
            if got.shape != want.shape:
                return _not_yet(f"rank {rank}: the {what} has shape {tuple(got.shape)}, not {tuple(want.shape)}")
            error = max_error(got, want)
            if error > 1e-10:
                ratio = (got.norm() / want.norm()).item() if want.norm() > 0 else float("nan")
                return _not_yet(f"rank {rank}: the {what} differs from the single-device MLP by {error:.3g} "
                                f"(yours / reference = {ratio:.3g})",
                                "a factor of world_size points at an all-reduce in the backward that should "
                                "not be there (or a bias added on every rank before the sum); a missing "
                                "input gradient at a missing all-reduce in the backward")
    return "Correct: output and every gradient equal the single-device MLP on every rank."


def _ulysses_gqa_forward(comm, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Ulysses attention with grouped-query attention: ``q`` has more heads than ``k`` and ``v``."""
    q, k, v = (comm.all_to_all_4D(t, scatter_dim=2, gather_dim=1) for t in (q, k, v))  # (b, s, h/P, d)
    group = q.shape[2] // k.shape[2]                       # query heads per kv head
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)   # (b, s, hq/P, d)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)  # (b, s, hq/P, d)
    return comm.all_to_all_4D(out, scatter_dim=1, gather_dim=2)                  # (b, s/P, hq, d)


@_hint_on_request
def check_ulysses_gqa_bytes(per_rank_bytes: Callable[..., float]) -> str:
    """Lesson 05: bytes one rank sends in the forward of Ulysses attention with grouped-query attention.

    ``per_rank_bytes(batch, seq, q_heads, kv_heads, head_dim, world_size, itemsize)``,
    checked against the trace of a run (four all-to-alls: q, k, v in, the
    output back) for several shapes and world sizes, float64.
    """
    if _is_placeholder(per_rank_bytes):
        return NOT_ANSWERED
    if not callable(per_rank_bytes):
        return _not_yet(f"give a function per_rank_bytes(batch, seq, q_heads, kv_heads, head_dim, world_size, "
                        f"itemsize); got {type(per_rank_bytes).__name__}")
    cases = [(1, 8, 4, 2, 2, 2), (2, 8, 8, 2, 3, 2), (1, 12, 6, 3, 2, 3), (1, 16, 8, 4, 4, 4)]
    for batch, seq, q_heads, kv_heads, head_dim, world_size in cases:
        answer, verdict = _attempt(lambda: per_rank_bytes(batch, seq, q_heads, kv_heads, head_dim, world_size, 8))
        if verdict:
            return verdict
        if _is_placeholder(answer):
            return NOT_ANSWERED
        value, problem = _as_numbers(answer, "your function's result")
        if problem or value.numel() != 1:
            return problem or _not_yet("return one number of bytes")
        gen = torch.Generator().manual_seed(0)
        shard = seq // world_size
        q = torch.randn(batch, shard, q_heads, head_dim, generator=gen, dtype=torch.float64)
        k, v = (torch.randn(batch, shard, kv_heads, head_dim, generator=gen, dtype=torch.float64) for _ in "kv")
        world = World(world_size)
        world.run(_ulysses_gqa_forward, q, k, v)
        sent = sum(sum(event.sent.values()) for event in world.trace.filter(rank=0, phase="forward"))
        if abs(value.item() - sent) > 1e-6:
            return _not_yet(f"batch={batch}, seq={seq}, q_heads={q_heads}, kv_heads={kv_heads}, "
                            f"head_dim={head_dim} on {world_size} ranks: rank 0 does not send "
                            f"{_format(value.item())} bytes",
                            "k and v have kv_heads heads, q and the output q_heads; each all-to-all keeps "
                            "1/world_size of the rank's shard and sends the rest")
    return f"Correct: bytes per rank for {len(cases)} shapes and world sizes."
