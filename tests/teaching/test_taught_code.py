"""The algorithm a lesson teaches is written in the lesson, and behaves as the library's copy.

Each test takes the cell of ``notebooks/sources/NN_*.py`` that defines the taught function, runs
that cell's source alone (with the lesson's first imports), and compares the lesson's definition
with the library's on several inputs and world sizes: outputs, gradients where the algorithm is
differentiable, and the collectives it calls (the trace), so a lesson that drifted from the
library, or a library that drifted from the lesson, fails here.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from simcomm import World

SOURCES = Path(__file__).resolve().parents[2] / "notebooks" / "sources"


def lesson_cell(lesson: str, name: str) -> str:
    """The source of the one code cell of lesson ``lesson`` (``"03"``) that defines ``name``."""
    path = next(SOURCES.glob(f"{lesson}_*.py"))
    cells = re.split(r"^# %%.*$", path.read_text(), flags=re.M)
    found = [cell for cell in cells if re.search(rf"^(def|class) {name}\b", cell, flags=re.M)]
    assert len(found) == 1, f"{path.name}: {len(found)} cells define {name}"
    return found[0]


def taught(lesson: str, name: str, **namespace):
    """The lesson's own definition of ``name``: its cell executed in a namespace holding ``torch``
    and ``namespace``."""
    scope = {"torch": torch, "__name__": f"lesson_{lesson}", **namespace}
    exec(compile(lesson_cell(lesson, name), f"lesson {lesson}: {name}", "exec"), scope)
    return scope[name]


def ops(trace):
    """What every rank called, in order, and how many bytes (what the two copies must share)."""
    return [(e.rank, e.op, e.nbytes) for e in trace.events if e.op != "compute"]


# -- lesson 03: the ring all-reduce -----------------------------------------------------------------

def _ring_program(comm, fn, numel, seed):
    gen = torch.Generator().manual_seed(seed + comm.rank)
    x = torch.randn(numel, dtype=torch.float64, generator=gen)
    kept = x.clone()
    out = fn(comm, x)
    assert torch.equal(x, kept), "the ring modified its input"
    return out


@pytest.mark.parametrize("world_size, numel", [(1, 4), (2, 6), (3, 9), (4, 8), (5, 20)])
def test_lesson03_ring_all_reduce_is_the_library_ring(world_size, numel):
    from simcomm.lessons import foundations
    lesson = taught("03", "ring_all_reduce")
    for seed in (0, 1):
        mine, theirs = World(world_size), World(world_size)
        got = mine.run(_ring_program, lesson, numel, seed)
        want = theirs.run(_ring_program, foundations.ring_all_reduce, numel, seed)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert ops(mine.trace) == ops(theirs.trace)
        exact = sum(torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + r))
                    for r in range(world_size))
        assert all((g - exact).abs().max() < 1e-12 for g in got)


def test_lesson03_ring_exchange_is_the_library_exchange():
    from simcomm.parallel import ring
    lesson = taught("03", "ring_exchange")
    for world_size in (2, 3, 5):
        def program(comm, fn):
            return fn(comm, torch.full((3,), float(comm.rank)))
        mine, theirs = World(world_size), World(world_size)
        got, want = mine.run(program, lesson), theirs.run(program, ring.ring_exchange)
        assert all(torch.equal(g, w) for g, w in zip(got, want)) and ops(mine.trace) == ops(theirs.trace)


# -- lesson 04: the column/row-parallel MLP --------------------------------------------------------

def _tp_program(comm, shard_fn, layer, params, x, conjugate):
    shards = shard_fn(params, comm.rank, comm.world_size)
    x = x.clone().requires_grad_()
    out = layer(comm, x, shards, conjugate=conjugate)
    out.pow(2).sum().backward()
    return out.detach(), x.grad, {name: p.grad for name, p in shards.items()}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("conjugate", [True, False])
def test_lesson04_tp_mlp_and_shards_are_the_library_ones(world_size, conjugate):
    from simcomm.parallel import tensor
    shard_mlp, tp_mlp = taught("04", "shard_mlp"), taught("04", "tp_mlp")
    for seed in (0, 1):
        params = tensor.make_mlp(6, 8, seed=seed)
        x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 10))
        for rank in range(world_size):
            mine, theirs = shard_mlp(params, rank, world_size), tensor.shard_mlp(params, rank, world_size)
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
            assert all(p.requires_grad and p.is_leaf for p in mine.values())
        a, b = World(world_size), World(world_size)
        got = a.run(_tp_program, shard_mlp, tp_mlp, params, x, conjugate)
        want = b.run(_tp_program, tensor.shard_mlp, tensor.tp_mlp, params, x, conjugate)
        for (out, xg, grads), (out2, xg2, grads2) in zip(got, want):
            assert torch.equal(out, out2) and torch.equal(xg, xg2)
            assert all(torch.equal(grads[k], grads2[k]) for k in grads2)
        assert ops(a.trace) == ops(b.trace)
    with pytest.raises(ValueError, match="not divisible"):
        shard_mlp(tensor.make_mlp(6, 6, seed=0), 0, 4)
