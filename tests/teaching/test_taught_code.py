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


def lesson_cells(lesson: str, *names: str) -> str:
    """The source of the code cells of lesson ``lesson`` (``"03"``) that define ``names`` (a ``def`` or
    ``class`` at the top level, or a method added to a class with ``Class.name = name``), in order."""
    path = next(SOURCES.glob(f"{lesson}_*.py"))
    cells = re.split(r"^# %%.*$", path.read_text(), flags=re.M)
    found = [cell for cell in cells if any(re.search(rf"^(def|class) {name}\b", cell, flags=re.M)
                                           for name in names)]
    for name in names:
        assert sum(bool(re.search(rf"^(def|class) {name}\b", cell, flags=re.M)) for cell in found) == 1, \
            f"{path.name}: {name} is not defined in exactly one cell"
    return "\n".join(found)


def taught(lesson: str, name: str, *more: str, **namespace):
    """The lesson's own definition of ``name``: the cells defining it (and ``more``) executed in a
    namespace holding ``torch`` and ``namespace``."""
    scope = {"torch": torch, "__name__": f"lesson_{lesson}", **namespace}
    exec(compile(lesson_cells(lesson, name, *more), f"lesson {lesson}: {name}", "exec"), scope)
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


# -- lesson 05: Ulysses attention ------------------------------------------------------------------

def _ulysses_program(comm, attend, q, k, v, weights, causal):
    shard = q.shape[1] // comm.world_size
    mine = slice(comm.rank * shard, (comm.rank + 1) * shard)
    q, k, v = (t[:, mine].clone().requires_grad_() for t in (q, k, v))
    kept = [t.detach().clone() for t in (q, k, v)]
    out = attend(comm, q, k, v, causal=causal)
    assert all(torch.equal(t.detach(), c) for t, c in zip((q, k, v), kept)), "Ulysses modified its input"
    (out * weights[:, mine]).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_lesson05_ulysses_attention_is_the_library_one(world_size, causal):
    from simcomm.parallel.sequence import attention, make_qkv, ulysses_attention
    lesson = taught("05", "ulysses_attention", attention=attention)
    for seed, heads, seq in ((0, 4, 8), (1, 8, 4 * world_size)):
        q, k, v = make_qkv(2, seq, heads, 3, seed=seed)
        weights = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 5))
        a, b = World(world_size), World(world_size)
        got = a.run(_ulysses_program, lesson, q, k, v, weights, causal)
        want = b.run(_ulysses_program, ulysses_attention, q, k, v, weights, causal)
        for g, w in zip(got, want):
            assert all(torch.equal(x, y) for x, y in zip(g, w))
        assert _events(a.trace) == _events(b.trace)
        assert [(e.args, e.sent) for e in a.trace.events] == [(e.args, e.sent) for e in b.trace.events]
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out = attention(*ref, causal=causal)
        (ref_out * weights).sum().backward()
        for index, expected in enumerate([ref_out.detach()] + [t.grad for t in ref]):
            assert (torch.cat([o[index] for o in got], dim=1) - expected).abs().max() < 1e-12


def test_lesson05_ulysses_attention_refuses_indivisible_heads_as_the_library_does():
    from simcomm.errors import RankError
    from simcomm.parallel.sequence import attention, make_qkv, ulysses_attention
    lesson = taught("05", "ulysses_attention", attention=attention)
    q, k, v = make_qkv(1, 8, 6, 2)
    messages = []
    for attend in (lesson, ulysses_attention):
        with pytest.raises(RankError, match="not divisible by the world size 4") as error:
            World(4).run(_ulysses_program, attend, q, k, v, torch.ones(q.shape, dtype=torch.float64), False)
        messages.append(str(error.value).splitlines()[0])     # the error; the traceback names each file
    assert messages[0] == messages[1] and "all_to_all_4D" in messages[0]


# -- lesson 06: the bucketed reducer ----------------------------------------------------------------

def _lesson06():
    from simcomm.parallel import data as dp
    scope = {"dp": dp}
    every = ("bucket_plan", "BucketedReducer", "_ready", "finish", "bucketed_grads")
    return (taught("06", "bucket_plan", **scope), taught("06", "BucketedReducer", *every, **scope),
            taught("06", "bucketed_grads", *every, **scope))


def test_lesson06_bucket_plan_is_the_library_plan():
    from simcomm.parallel import data as dp
    plan = _lesson06()[0]
    for numels in ([3, 5, 7, 11], [100], [1, 1, 1, 1, 1, 1], [4096, 16, 4096, 16]):
        for bucket_bytes in (0, -1, 1, 8, 40, 100, 1 << 20):
            assert plan(numels, 8, bucket_bytes) == dp.bucket_plan(numels, 8, bucket_bytes)


def _accumulate(comm, reducer_class, x, y, microbatches, bucket_bytes):
    from simcomm.parallel import data as dp
    model = dp.make_model()
    reducer = reducer_class(comm, model, bucket_bytes)
    xs, ys = dp.rows(comm, x, y)
    pieces = list(zip(xs.chunk(microbatches), ys.chunk(microbatches)))
    with reducer.no_sync():
        for xm, ym in pieces[:-1]:
            (dp.sum_loss(model, xm, ym) / x.shape[0]).backward()
    (dp.sum_loss(model, *pieces[-1]) / x.shape[0]).backward()
    reducer.finish()
    return dp.grads_of(model)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("bucket_bytes", [1, 256 << 10, 1 << 20, 0])
def test_lesson06_bucketed_reducer_is_the_library_reducer(world_size, bucket_bytes):
    from simcomm.parallel import data as dp
    _, reducer, grads_fn = _lesson06()
    x, y = dp.make_data(16)
    a, b = World(world_size), World(world_size)
    got, want = a.run(grads_fn, x, y, bucket_bytes), b.run(dp.bucketed_grads, x, y, bucket_bytes)
    assert all(torch.equal(g, w) for gs, ws in zip(got, want) for g, w in zip(gs, ws))
    assert ops(a.trace) == ops(b.trace)
    assert [(e.op, e.phase, e.modelled) for e in a.trace.events] == [(e.op, e.phase, e.modelled) for e in b.trace.events]
    a, b = World(world_size), World(world_size)
    got, want = a.run(_accumulate, reducer, x, y, 2, bucket_bytes), b.run(_accumulate, dp.BucketedReducer, x, y, 2, bucket_bytes)
    assert all(torch.equal(g, w) for gs, ws in zip(got, want) for g, w in zip(gs, ws))
    assert ops(a.trace) == ops(b.trace)


def test_lesson06_reducer_refuses_a_second_synchronising_backward_as_the_library_does():
    from simcomm.errors import RankError
    from simcomm.parallel import data as dp
    _, reducer, _ = _lesson06()

    def twice(comm, reducer_class):
        model = dp.make_model()
        r = reducer_class(comm, model, 0)
        x, y = dp.make_data(4)
        for _ in range(2):
            dp.sum_loss(model, x, y).backward()
        r.finish()
    for cls in (reducer, dp.BucketedReducer):
        with pytest.raises(RankError, match="second synchronising"):
            World(2).run(twice, cls)


# -- lesson 07: ZeRO's steps ------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_lesson07_zero_steps_are_the_library_steps(stage, world_size):
    from simcomm.parallel import zero
    names = ("backward", "step_stage0", "step_stage1", "step_stage2", "step_stage3")
    step = taught("07", f"step_stage{stage}", *names, zero=zero)
    mlp = zero.MLP((6, 8, 8, 4))
    a, b = World(world_size, memory=True), World(world_size, memory=True)
    got = a.run(zero.train, stage, mlp, steps=2, batch_size=4, step=step)
    want = b.run(zero.train, stage, mlp, steps=2, batch_size=4)
    assert all(torch.equal(g, w) for gs, ws in zip(got, want) for g, w in zip(gs, ws))
    assert ops(a.trace) == ops(b.trace)
    for rank in range(world_size):                    # the same bytes under the same labels, every rank
        assert a.memory.at("after step 2")[rank] == b.memory.at("after step 2")[rank]


# -- lesson 08: the pipeline schedules and the step --------------------------------------------------

def test_lesson08_schedules_are_the_library_schedules():
    from simcomm.parallel import pipeline as pp
    schedule = taught("08", "schedule", pp=__import__("simcomm.parallel.pipeline", fromlist=["pipeline"]))
    for name in pp.SCHEDULES:
        for stages in (1, 2, 3, 4, 6):
            for microbatches in (1, 2, 3, 4, 8):
                assert schedule(name, stages, microbatches) == pp.schedule(name, stages, microbatches)
    with pytest.raises(ValueError, match="schedules are"):
        schedule("zigzag", 2, 2)


def _point_to_point(trace):
    return [(e.rank, e.op, e.nbytes, e.phase) for e in trace.events if e.op in ("send", "recv", "isend", "irecv")]


@pytest.mark.parametrize("stages", [1, 2, 4])
@pytest.mark.parametrize("name", ["naive", "gpipe", "1f1b"])
def test_lesson08_pipeline_step_is_the_library_step(stages, name):
    from simcomm.parallel import data as dp, pipeline as pp
    step = taught("08", "pipeline_step", "schedule", "forward_action", "backward_action", dp=dp, pp=pp)
    x, y = dp.make_data(16, pp.PIPE_SIZES)
    for microbatches in (1, 4, 8):
        a, b = World(stages), World(stages)
        got, want = a.run(step, x, y, name, microbatches), b.run(pp.pipeline_step, x, y, name, microbatches)
        for g, w in zip(got, want):
            assert all(torch.equal(p, q) for p, q in zip(g["grads"], w["grads"])) and g["held"] == w["held"]
            assert (g["loss"] is None) == (w["loss"] is None) and (g["loss"] is None or torch.equal(g["loss"], w["loss"]))
        assert _point_to_point(a.trace) == _point_to_point(b.trace)
        assert [e.op for e in a.trace.events if e.op == "compute"] == [e.op for e in b.trace.events if e.op == "compute"]


# -- lesson 09: ring attention ------------------------------------------------------------------------

def _lesson09_ring_attention():
    from simcomm import P2POp
    from simcomm.parallel.context import block_attention, chunk_ids, lse_merge
    from simcomm.trace import backward_phase
    import math
    return taught("09", "ring_attention", "send_to_next", "received", "pairs", "block_flops", "ring_forward",
                  "block_grads", "ring_backward", "RingAttention", P2POp=P2POp, block_attention=block_attention,
                  chunk_ids=chunk_ids, lse_merge=lse_merge, backward_phase=backward_phase, math=math)


def _ring_attention_program(comm, attend, q, k, v, weights, causal, layout):
    from simcomm.parallel.context import shard_sequence
    q, k, v = (shard_sequence(t, comm.rank, comm.world_size, layout).requires_grad_() for t in (q, k, v))
    kept = [t.detach().clone() for t in (q, k, v)]
    out = attend(comm, q, k, v, causal=causal, layout=layout)
    assert all(torch.equal(t.detach(), c) for t, c in zip((q, k, v), kept)), "the ring modified its input"
    (out * shard_sequence(weights, comm.rank, comm.world_size, layout)).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _events(trace):
    return [(e.rank, e.op, e.nbytes, e.phase, e.args.get("flops")) for e in trace.events]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_lesson09_ring_attention_is_the_library_ring(world_size, layout, causal):
    from simcomm.parallel.context import ring_attention, unshard_sequence
    from simcomm.parallel.sequence import attention, make_qkv
    lesson = _lesson09_ring_attention()
    for seed, heads in ((0, 2), (1, 3)):
        q, k, v = make_qkv(2, 4 * world_size, heads, 4, seed=seed)
        weights = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 5))
        a, b = World(world_size), World(world_size)
        got = a.run(_ring_attention_program, lesson, q, k, v, weights, causal, layout)
        want = b.run(_ring_attention_program, ring_attention, q, k, v, weights, causal, layout)
        for g, w in zip(got, want):
            assert all(torch.equal(x, y) for x, y in zip(g, w))
        assert _events(a.trace) == _events(b.trace)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        ref_out = attention(*ref, causal=causal)
        (ref_out * weights).sum().backward()
        for index, expected in enumerate([ref_out.detach()] + [t.grad for t in ref]):
            assert (unshard_sequence([o[index] for o in got], layout) - expected).abs().max() < 1e-12


# -- lesson 10: MoE dispatch and combine --------------------------------------------------------------

def test_lesson10_route_is_the_library_route():
    from simcomm.parallel import expert as ep
    route = taught("10", "route")
    params = ep.make_moe(8, 16, 8, seed=0)
    x = torch.randn(12, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for top_k in (1, 2, 8):
        args = (x, params["router"], params["bias"], top_k)
        got, want = route(*args), ep.route(*args)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def _lesson10_layer():
    from simcomm.parallel import expert as ep
    names = ("capacity", "expert", "keep_mask", "rows_per_rank", "shared_output", "tokens_per_expert")
    return taught("10", "expert_parallel_moe", "route", "run_experts", **{n: getattr(ep, n) for n in names})


def _moe_program(comm, layer, x, probe, params, top_k, factor):
    from simcomm.parallel.expert import shard_experts
    tokens = x.shape[0] // comm.world_size
    mine = slice(comm.rank * tokens, (comm.rank + 1) * tokens)
    xr = x[mine].clone().requires_grad_()
    shards = shard_experts(params, comm.rank, comm.world_size)
    kept = {name: p.detach().clone() for name, p in shards.items()}
    out, stats = layer(comm, xr, shards, top_k, capacity_factor=factor)
    assert torch.equal(xr.detach(), x[mine]) and all(torch.equal(shards[n].detach(), kept[n]) for n in kept)
    (out * probe[mine]).sum().backward()
    return out.detach(), xr.grad, {name: p.grad for name, p in shards.items()}, stats


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("factor", [None, 1.25, 0.5])
@pytest.mark.parametrize("shared", [0, 1])
def test_lesson10_expert_parallel_moe_is_the_library_layer(world_size, factor, shared):
    from simcomm.parallel import expert as ep
    layer = _lesson10_layer()
    for seed, top_k, bias in ((0, 2, 0.0), (1, 1, 0.0), (2, 3, 3.0)):
        params = ep.make_moe(6, 10, 8, seed=seed, shared_experts=shared)
        params["bias"][0] = bias                                   # a skewed router: a rank receives most
        gen = torch.Generator().manual_seed(seed + 7)
        x, probe = (torch.randn(world_size * 6, 6, dtype=torch.float64, generator=gen) for _ in range(2))
        a, b = World(world_size), World(world_size)
        got = a.run(_moe_program, layer, x, probe, params, top_k, factor)
        want = b.run(_moe_program, ep.expert_parallel_moe, x, probe, params, top_k, factor)
        for (out, xg, grads, stats), (out2, xg2, grads2, stats2) in zip(got, want):
            assert torch.equal(out, out2) and torch.equal(xg, xg2) and stats == stats2
            assert grads.keys() == grads2.keys() and all(torch.equal(grads[k], grads2[k]) for k in grads)
        assert _events(a.trace) == _events(b.trace)
        assert [(e.args, e.sent) for e in a.trace.events] == [(e.args, e.sent) for e in b.trace.events]   # the splits
        leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
        xr = x.clone().requires_grad_()
        ref = ep.moe(xr, leaves, top_k, capacity_factor=factor, groups=world_size)
        (ref * probe).sum().backward()
        assert (torch.cat([g[0] for g in got]) - ref.detach()).abs().max() < 1e-12
        assert (torch.cat([g[1] for g in got]) - xr.grad).abs().max() < 1e-12
        assert (sum(g[2]["router"] for g in got) - leaves["router"].grad).abs().max() < 1e-12


def _lesson10_train_router():
    from simcomm.parallel import expert as ep
    names = ("capacity", "expert", "keep_mask", "rows_per_rank", "shared_output", "tokens_per_expert",
             "shard_experts", "load_balancing_loss")
    return taught("10", "train_router", "expert_parallel_moe", "route", "run_experts",
                  **{n: getattr(ep, n) for n in names})


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("factor", [None, 1.0])
def test_lesson10_train_router_is_the_library_training(world_size, factor):
    from simcomm.parallel import expert as ep
    train_router = _lesson10_train_router()
    params = ep.make_moe(8, 16, 8, seed=0, shared_experts=1)
    params["bias"][0] = 2.0
    gen = torch.Generator().manual_seed(5)
    x, target = (torch.randn(world_size * 8, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    for weight in (0.0, 1.0):
        kwargs = dict(steps=3, lr=2.0, aux_weight=weight, capacity_factor=factor)
        a, b = World(world_size), World(world_size)
        got = a.run(train_router, x, target, params, 2, **kwargs)
        want = b.run(ep.train_router, x, target, params, 2, **kwargs)
        for g, w in zip(got, want):
            assert g.keys() == w.keys() and g["per_expert"] == w["per_expert"] and g["aux"] == w["aux"]
            assert torch.equal(g["router"], w["router"]) and torch.equal(g["bias"], w["bias"])
        assert _events(a.trace) == _events(b.trace)
        assert [(e.args, e.sent) for e in a.trace.events] == [(e.args, e.sent) for e in b.trace.events]
        one = ep.train_router_reference(x, target, params, 2, groups=world_size, **kwargs)
        assert got[0]["per_expert"] == one["per_expert"]
        assert (got[0]["router"] - one["router"]).abs().max() < 1e-12
    assert got[0]["per_expert"][0] != got[0]["per_expert"][-1]        # the router moved


# -- lesson 12: the 3-D step ----------------------------------------------------------------------------

def _lesson12_step():
    import math
    import torch.nn.functional as F
    from simcomm import memory
    from simcomm.models.transformer import SHARDING, shard_block
    return taught("12", "block_step", "heads_attention", "sharded_attention", "sharded_mlp", "run_stages", "sync",
                  "sync_grads", math=math, F=F, memory=memory, SHARDING=SHARDING, shard_block=shard_block)


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_lesson12_block_step_is_the_library_step(world_size):
    from simcomm.models import transformer as tf
    step = _lesson12_step()
    batch, seq, hidden, ffn, heads = 4, 8, 16, 32, 4
    params = tf.make_block(hidden, ffn, seed=3)
    gen = torch.Generator().manual_seed(4)
    x, weights = (torch.randn(batch, seq, hidden, dtype=torch.float64, generator=gen) for _ in range(2))
    leaves = {name: p.clone().requires_grad_() for name, p in params.items()}
    reference = tf.loss(x, weights, leaves, heads)
    reference.backward()
    layouts = [layout for layout in tf.layouts(world_size) if layout.tp <= 4 and layout.dp <= batch]
    assert len(layouts) >= min(world_size, 3)
    for layout in layouts:
        a, b = World(world_size, memory=True), World(world_size, memory=True)
        got = a.run(step, x, weights, params, heads, layout)
        want = b.run(tf.block_step, x, weights, params, heads, layout)
        for g, w in zip(got, want):
            assert g["coords"] == w["coords"] and torch.equal(g["loss"], w["loss"])
            assert g["grads"].keys() == w["grads"].keys()
            assert all(torch.equal(g["grads"][k], w["grads"][k]) for k in g["grads"])
        assert _events(a.trace) == _events(b.trace), layout
        assert [e.group for e in a.trace.events] == [e.group for e in b.trace.events]
        assert [r.peak_bytes for r in a.memory.ranks] == [r.peak_bytes for r in b.memory.ranks], layout
        assert (sum(g["loss"] for g in got) - reference).abs() < 1e-9
        grads = tf.assemble_grads(got, layout)
        assert all((grads[k] - leaves[k].grad).abs().max() < 1e-9 for k in grads)


# -- lesson 13: mixed-precision training ------------------------------------------------------------------

def _lesson13_train():
    from simcomm import memory
    from simcomm.parallel import mixed_precision as mp
    from simcomm.parallel.zero import MLP, Adam, make_batch, padded, shard
    return taught("13", "train", "keep_states", "backward", "sum_gradients", "master_step", "LossScaler",
                  memory=memory, mp=mp, MLP=MLP, Adam=Adam, make_batch=make_batch, padded=padded, shard=shard)


def _compare_mixed_precision(world_size, stage, **kwargs):
    from simcomm.parallel import mixed_precision as mp
    train = _lesson13_train()
    a, b = World(world_size, memory=True), World(world_size, memory=True)
    got, want = a.run(train, stage, **kwargs), b.run(mp.train, stage, **kwargs)
    for g, w in zip(got, want):
        assert g.keys() == w.keys() and torch.equal(g["losses"], w["losses"])
        assert all(torch.equal(m, n) for m, n in zip(g["master"], w["master"]))
        assert g.get("history") == w.get("history")
    assert ops(a.trace) == ops(b.trace)
    assert [(e.op, e.phase, e.args) for e in a.trace.events] == [(e.op, e.phase, e.args) for e in b.trace.events]
    for k in range(1, kwargs["steps"] + 1):                # the same bytes under the same labels, every rank
        assert a.memory.at(f"after step {k}") == b.memory.at(f"after step {k}")
    assert [r.peak_bytes for r in a.memory.ranks] == [r.peak_bytes for r in b.memory.ranks]
    return got


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("gradients", ["16-bit", "fp32 main_grad"])
def test_lesson13_mixed_precision_training_is_the_library_training(world_size, stage, gradients):
    from simcomm.parallel import mixed_precision as mp
    got = _compare_mixed_precision(world_size, stage, gradients=gradients, steps=2, micro_batches=2, seed=1)
    error = ((got[0]["losses"] - mp.reference_losses(steps=2, seed=1)).abs() / mp.reference_losses(steps=2, seed=1))
    assert 0 < error.max() < 2.0 ** -9                     # bf16: close to float64, not equal to it


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 2])
def test_lesson13_loss_scaling_is_the_library_loss_scaling(world_size, stage):
    got = _compare_mixed_precision(world_size, stage, dtype=torch.float16, loss_scale=2.0 ** 24, growth_interval=2,
                                   steps=10)
    overflowed = [over for _, _, over in got[0]["history"]]
    assert any(overflowed) and not all(overflowed)           # skipped, halved, applied and grown: every branch


def test_lesson13_exercise3_refuses_the_library_decision_the_lesson_trains_with():
    import simcomm.lessons.lesson_13 as check
    from simcomm.parallel import mixed_precision as mp
    assert "mp.any_overflow(comm, mine)" in lesson_cells("13", "train")
    for answer in (mp.any_overflow, lambda comm, grads: mp.any_overflow(comm, grads)):
        verdict = check.check_skip_step(answer)
        assert verdict.startswith("Not yet") and "mixed_precision.any_overflow" in verdict, verdict


def test_lesson13_loss_scaler_is_the_library_scaler():
    from simcomm.parallel.mixed_precision import LossScaler
    lesson = _lesson13_train().__globals__["LossScaler"]
    flags = [True, True, False, False, False, True, False, False, False, False, False]
    for interval in (1, 2, 3):
        mine, theirs = lesson(2.0 ** 10, interval), LossScaler(2.0 ** 10, interval)
        for step, flag in enumerate(flags):
            mine.update(step, flag)
            theirs.update(step, flag)
            assert mine.scale == theirs.scale and mine.good_steps == theirs.good_steps
        assert mine.history == theirs.history and len({s for _, s, _ in mine.history}) > 2


# -- lesson 14: the 4-D training -------------------------------------------------------------------------

def _lesson14_train():
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from simcomm.models import llama, llama_pipeline, llama_training as lt
    from simcomm.parallel import llama_fsdp
    from simcomm.parallel.mesh import Layout
    return taught("14", "train", "mesh_groups", "stage_leaves", "train_step", "save_checkpoint", "load_checkpoint",
                  llama=llama, llama_pipeline=llama_pipeline, lt=lt, llama_fsdp=llama_fsdp, dcp=dcp,
                  DTensor=DTensor, Replicate=Replicate, Shard=Shard, Layout=Layout)


def _compare_llama_training(layout, steps, tmp_path=None):
    from simcomm.models import llama, llama_training as lt
    train = _lesson14_train()
    config = llama.Config()
    data, params = lt.corpus(config, sequences=16, length=9), llama.init_params(config)
    saves = (tmp_path / "a", tmp_path / "b") if tmp_path else (None, None)    # equal lengths: equal bytes
    a, b = World(layout.world_size), World(layout.world_size)
    got = a.run(train, data, params, config, layout=layout, steps=steps, global_batch=4,
                save=saves[0] and str(saves[0]))
    want = b.run(lt.train, data, params, config, layout=layout, steps=steps, global_batch=4,
                 save=saves[1] and str(saves[1]))
    for g, w in zip(got, want):
        assert torch.equal(g["losses"], w["losses"]) and g["coords"] == w["coords"] and g["held"] == w["held"]
        assert g["shards"].keys() == w["shards"].keys()
        assert all(torch.equal(g["shards"][k], w["shards"][k]) for k in g["shards"])
    assert ops(a.trace) == ops(b.trace)
    assert [e.group for e in a.trace.events] == [e.group for e in b.trace.events]
    reference = lt.reference_losses(data, params, config, dp=layout.dp, steps=steps, global_batch=4)
    assert (got[0]["losses"] - reference).abs().max() < 1e-10
    return saves, data, params, config


@pytest.mark.parametrize("sizes", [dict(tp=2), dict(dp_shard=2, tp=2), dict(pp=2, cp=2),
                                   dict(pp=2, dp_replicate=2, dp_shard=2), dict(pp=2, dp_shard=2, cp=2, tp=2)])
def test_lesson14_train_is_the_library_training(sizes):
    from simcomm.parallel.mesh import Layout
    _compare_llama_training(Layout(**sizes), steps=2)


@pytest.mark.parametrize("saved, resume", [(dict(pp=2, dp_shard=2, tp=2), dict(dp_replicate=2, tp=2)),
                                           (dict(dp_replicate=2, cp=2), dict(pp=2, dp_shard=2))])
def test_lesson14_checkpoint_and_resume_are_the_library_ones(tmp_path, saved, resume):
    from simcomm.models import llama_training as lt
    from simcomm.parallel.mesh import Layout
    (mine, theirs), data, params, config = _compare_llama_training(Layout(**saved), 2, tmp_path)
    train, resume = _lesson14_train(), Layout(**resume)
    kwargs = dict(layout=resume, steps=2, global_batch=4, first_step=2)
    runs, traces = [], []
    for fn, path in ((train, mine), (lt.train, theirs), (train, theirs), (lt.train, mine)):   # and crossed
        world = World(resume.world_size)
        runs.append(world.run(fn, data, params, config, load=str(path), **kwargs))
        traces.append(ops(world.trace))
    for run in runs[1:]:
        for g, w in zip(runs[0], run):
            assert torch.equal(g["losses"], w["losses"]) and g["held"] == w["held"]
            assert all(torch.equal(g["shards"][k], w["shards"][k]) for k in w["shards"])
    assert all(trace == traces[0] for trace in traces)
    reference = lt.reference_losses(data, params, config, dp=resume.dp, steps=4, global_batch=4)
    assert (runs[0][0]["losses"] - reference[2:]).abs().max() < 1e-10          # steps 3 and 4: the checkpoint's
