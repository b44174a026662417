"""Lesson 11 (Debugging distributed programs): its exercise checkers, written here, and the assertion helpers it uses.

A lesson imports this one module, ``import simcomm.lessons.lesson_11 as check``, and calls
``check.check_...`` and ``check.assert_close(...)``. The assertion helpers are written in
:mod:`simcomm.lessons.asserts`, the wording of every verdict and what every checker shares in
:mod:`simcomm.lessons.verdicts`. Every checker *returns* its verdict and never raises for what the
learner wrote; the programs it runs go to the simulator (``World``), whatever the backend the lesson
uses: an exercise checks understanding, and a deadlocking answer must fail at once.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import DeadlockError, RankError, RunTimeoutError, SimcommError
from ..sim.world import World
from .asserts import assert_close, expect_error, gradcheck_across_ranks, max_error, per_rank
from .debugging import assert_replicated, error_summary
from .verdicts import NOT_ANSWERED, is_correct, is_placeholder
from .verdicts import hint_on_request as _hint_on_request
from .verdicts import judged_as_processes as _judged_as_processes
from .verdicts import not_yet as _not_yet

__all__ = ['NOT_ANSWERED', 'is_correct', 'per_rank', 'max_error', 'assert_close', 'expect_error', 'gradcheck_across_ranks', 'check_neighbour_exchange', 'check_sp_layernorm', 'assert_replicated', 'error_summary', 'EXCHANGE_TIMEOUT_S']


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
