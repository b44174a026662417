"""Shape-only virtual ranks (simcomm.sim.shape): the trace of a run on fake tensors equals the
real-valued run's, errors are reported as with data, memory follows the fake tensors' sizes."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

import simcomm
import simcomm.sim.shape
from simcomm.errors import CollectiveMismatchError, DeadlockError, RankError
from simcomm.planning import cluster_step as t3d
from simcomm.parallel.mesh import Layout
from simcomm.parallel import sequence as sequence_parallel
from simcomm.parallel import tensor as tensor_parallel
from simcomm.parallel import zero
from simcomm.errors import ShapeOnlyError
from simcomm.sim.shape import shapes, trace_signature

WORLD_SIZES = (4, 8, 16)


# -- programs that run in both modes ----------------------------------------------------------

def tp_program(comm, params, x):
    shards = tensor_parallel.shard_mlp(params, comm.rank, comm.world_size)
    y = tensor_parallel.tp_mlp(comm, x, shards)
    y.pow(2).sum().backward()
    return y.detach(), shards["w1"].grad


def ulysses_program(comm, q, k, v):
    rows = q.shape[1] // comm.world_size
    mine = [t[:, comm.rank * rows:(comm.rank + 1) * rows].clone().requires_grad_() for t in (q, k, v)]
    out = sequence_parallel.ulysses_attention(comm, *mine, causal=True)     # (b, s/P, h, d)
    out.pow(2).sum().backward()
    return out.detach(), mine[0].grad


def zero_program(comm, stage):
    return zero.train(comm, stage, zero.MLP((6, 10, 8, 3)), steps=2, batch_size=48)


def fsdp2_program(comm):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.to_local().detach() for p in model.parameters()]


def dtensor_program(comm):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4 * dist.get_world_size()), nn.ReLU(), nn.Linear(4 * dist.get_world_size(), 4))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(5, 4).requires_grad_()
    model(x).pow(2).sum().backward()
    return x.grad


def _arguments(name: str, world_size: int) -> tuple:
    if name == "3d":
        return (Layout(tp=2, pp=2, dp=world_size // 4), t3d.Block(hidden=32, heads=4, seq=8, micro_batches=2, layers=2,
                                                          dtype=torch.float32))
    if name == "tp":
        return (tensor_parallel.make_mlp(8, 4 * world_size), torch.randn(5, 8, dtype=torch.float64))
    if name == "ulysses":
        return sequence_parallel.make_qkv(2, 2 * world_size, world_size, 4)
    if name.startswith("zero"):
        return (int(name[-1]),)
    return ()


PROGRAMS = {"tp": tp_program, "ulysses": ulysses_program, "zero1": zero_program, "zero3": zero_program,
            "fsdp2": fsdp2_program, "dtensor": dtensor_program, "3d": t3d.step}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", ["tp", "ulysses", "zero1", "zero3", "3d", "fsdp2", "dtensor"])
def test_shape_only_trace_equals_the_real_valued_trace(name, world_size):
    program, args = PROGRAMS[name], _arguments(name, world_size)
    real = simcomm.World(world_size)
    real_outs = real.run(program, *args)
    fake = simcomm.World(world_size, tensors="shape")
    fake_outs = fake.run(program, *args)
    real_signature, fake_signature = trace_signature(real.trace), trace_signature(fake.trace)
    assert sorted(fake_signature) == list(range(world_size))
    assert fake_signature == real_signature
    assert len(fake.trace) == len(real.trace) > 0
    # what the program returns has the real run's shapes and dtypes, and no data
    assert shapes(fake_outs) == shapes(real_outs)
    if name == "3d":      # returns its gradients' shapes, not tensors
        return
    leaves = [leaf for leaf in torch.utils._pytree.tree_leaves(fake_outs) if isinstance(leaf, torch.Tensor)]
    assert leaves and all(isinstance(leaf, FakeTensor) for leaf in leaves)
    real_dtypes = [leaf.dtype for leaf in torch.utils._pytree.tree_leaves(real_outs) if isinstance(leaf, torch.Tensor)]
    assert [leaf.dtype for leaf in leaves] == real_dtypes


def test_send_recv_handles_and_subgroups_run_shape_only():
    def program(comm):
        x = torch.randn(3, 2) + comm.rank
        pair = comm.subgroup([[0, 1], [2, 3]])
        handle = pair.all_gather(x, dim=0, async_op=True)
        peer = (comm.rank + 1) % comm.world_size
        sent = comm.isend(x, peer)
        got = comm.irecv((3, 2), torch.float32, (comm.rank - 1) % comm.world_size).wait()
        sent.wait()
        return handle.wait(), got

    real, fake = simcomm.World(4), simcomm.World(4, tensors="shape")
    real_outs, fake_outs = real.run(program), fake.run(program)
    assert trace_signature(fake.trace) == trace_signature(real.trace)
    assert shapes(fake_outs) == shapes(real_outs) == [(torch.Size([6, 2]), torch.Size([3, 2]))] * 4


def test_mismatch_is_reported_as_in_the_real_valued_run():
    def program(comm):
        return comm.all_reduce(torch.zeros(4 if comm.rank != 2 else 5))

    with pytest.raises(CollectiveMismatchError) as error:
        simcomm.World(4, tensors="shape").run(program)
    assert "rank 2 called all_reduce(shape=(5,)" in str(error.value)


def test_a_deadlock_at_1024_ranks_is_reported_with_grouped_ranks():
    def program(comm):
        x = torch.ones(8)
        if comm.rank == 700:
            comm.recv((8,), torch.float32, 3)          # nobody sends
        return comm.all_reduce(x)

    with pytest.raises(DeadlockError) as error:
        simcomm.World(1024, tensors="shape").run(program)
    message = str(error.value)
    assert "0-699" in message and "701-1023" in message, message
    assert "rank 700" in message and "recv" in message, message
    assert len(message) < 2000, message          # grouped, not one line per rank


@pytest.mark.slow
def test_memory_of_zero3_at_1024_ranks_equals_the_formula():
    """Every layer's size divides by 1024: no padding, so the formula holds exactly."""
    world_size, mlp = 1024, zero.MLP((1023, 1023, 8))   # layers 1023 x 1024 and 8 x 1024 elements
    world = simcomm.World(world_size, tensors="shape", memory=True)
    world.run(zero.train, 3, mlp, steps=1, batch_size=world_size)
    expected = zero.expected_bytes(3, mlp.numel, world_size)
    snaps = world.memory.at("after step 1")
    assert len(snaps) == world_size
    for snap in snaps:
        for name, want in expected.items():
            assert snap[name] == want, (snap.name, name, snap[name], want)
        assert snap["inputs"] == (1023 + 8) * 4          # one row of x and y per rank


def test_memory_labels_match_the_real_valued_tracker():
    real = simcomm.World(4, memory=True)
    real.run(zero.train, 2, zero.MLP((6, 10, 8, 3)), steps=2, batch_size=8)
    fake = simcomm.World(4, memory=True, tensors="shape")
    fake.run(zero.train, 2, zero.MLP((6, 10, 8, 3)), steps=2, batch_size=8)
    assert fake.memory.marks == real.memory.marks
    for mark in (*real.memory.marks, "peak"):
        assert [s.bytes for s in fake.memory.at(mark)] == [s.bytes for s in real.memory.at(mark)], mark
    assert fake.memory.peak == real.memory.peak


def test_an_op_that_needs_values_names_the_op_and_the_rank():
    def program(comm):
        total = comm.all_reduce(torch.ones(3)).sum()
        if comm.rank == 1:
            return total.item()
        return None

    with pytest.raises(RankError) as error:
        simcomm.World(4, tensors="shape").run(program)
    cause = error.value.__cause__
    assert isinstance(cause, ShapeOnlyError)
    assert "rank 1" in str(cause) and ".item()" in str(cause) and "_local_scalar_dense" in str(cause)
    assert "rank 1" in str(error.value)


def test_arguments_become_fake_and_the_caller_keeps_its_tensors():
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    module = nn.Linear(3, 2)

    def program(comm, x, module):
        assert isinstance(x, FakeTensor) and x.requires_grad and x.is_leaf
        assert all(isinstance(p, FakeTensor) for p in module.parameters())
        return module(x).shape

    assert simcomm.World(2, tensors="shape").run(program, x, module) == [torch.Size([2, 2])] * 2
    assert not isinstance(module.weight, FakeTensor) and x.grad is None
    assert torch.equal(x.detach(), torch.arange(6.0).reshape(2, 3))


def test_a_non_leaf_argument_is_refused_as_in_the_real_valued_run():
    x = torch.ones(3, requires_grad=True) * 2
    for tensors in ("real", "shape"):
        with pytest.raises(ValueError, match=r"argument args\[0\] requires grad and is not a leaf"):
            simcomm.World(2, tensors=tensors).run(lambda comm, x: x.shape, x)


def test_bad_tensors_argument_is_named():
    with pytest.raises(ValueError, match="tensors='meta'"):
        simcomm.World(2, tensors="meta")


def test_a_refused_module_dtype_change_is_a_clear_error():
    """torch refuses Module.double() on fake parameters when something holds a weak reference to
    them (whether it does depends on torch's state in the process): the refusal is named."""
    refusal = RuntimeError("_apply(): Couldn't swap Linear.weight")
    error = simcomm.sim.shape.data_dependent_error(refusal, 3)
    assert isinstance(error, ShapeOnlyError)
    assert "rank 3" in str(error) and "dtype=" in str(error) and "Linear.weight" in str(error)
    assert simcomm.sim.shape.data_dependent_error(RuntimeError("something else"), 3) is None


def _aliasing_program(comm):
    x = torch.empty(6, 4)
    w = torch.empty(3, 4, requires_grad=True)
    y = x @ w.T                                   # (6, 3): a fresh tensor
    view = y[1:].t()                              # (3, 5): a view of y's storage
    y.add_(1)                                     # in place on y: y and its view move to version 1
    y.sum().backward()
    return (y, view, w.grad, view._base is y, y._version, view._version,
            view.untyped_storage()._cdata == y.untyped_storage()._cdata)


def test_ranks_share_the_fake_dispatch_cache_and_get_tensors_of_their_own():
    info = {}
    for world_size in (1, 2, 8):
        simcomm.sim.shape.dispatch_cache_clear()
        outs = simcomm.World(world_size, tensors="shape").run(_aliasing_program)
        info[world_size] = simcomm.sim.shape.dispatch_cache_info()
    assert info[1]["misses"] > 0 and info[1]["hits"] == 0
    # every rank after the first adds hits only, the same number each: they dispatch what it cached
    assert info[8]["misses"] == info[2]["misses"] == info[1]["misses"]
    assert info[8]["hits"] == 7 * info[2]["hits"] > 0
    assert info[8]["shared_hits"] > 0.8 * info[8]["hits"]     # most answered in front of torch's cache
    assert info[8]["hit_rate"] > 0.8
    real = simcomm.World(8).run(_aliasing_program)
    for rank, out in enumerate(outs):
        y, view, grad, is_view, y_version, view_version, shares = out
        assert (y.shape, view.shape, grad.shape, view.stride()) == (real[rank][0].shape, real[rank][1].shape,
                                                                     real[rank][2].shape, real[rank][1].stride())
        assert (is_view, y_version, view_version, shares) == real[rank][3:] == (True, 1, 1, True)
        for other in outs[rank + 1:]:        # every rank's tensors are its own: no storage shared
            assert y.untyped_storage()._cdata != other[0].untyped_storage()._cdata
            assert y.fake_mode is not other[0].fake_mode


@pytest.mark.parametrize("tensors", ["real", "shape"])
def test_immutable_arguments_reach_every_rank_as_they_are(tensors):
    # not rebuilt per rank: a partition of the world passed as tuples costs nothing per rank
    parts = tuple(tuple(range(base, base + 2)) for base in range(0, 8, 2))
    outs = simcomm.World(8, tensors=tensors).run(lambda comm, parts: (id(parts), comm.subgroup(parts).ranks), parts)
    assert {out[0] for out in outs} == {id(parts)}
    assert [tuple(out[1]) for out in outs] == [parts[rank // 2] for rank in range(8)]


@pytest.mark.parametrize("tensors", ["real", "shape"])
def test_full_garbage_collections_wait_while_shape_only_ranks_run_and_the_thresholds_come_back(tensors):
    import gc

    before = gc.get_threshold()
    seen = simcomm.World(4, tensors=tensors).run(lambda comm: gc.get_threshold())
    if tensors == "shape":
        # full collections deferred, young ones rarer (simcomm.collector)
        assert all(threshold[0] >= max(before[0], 100_000) and threshold[1] == before[1]
                   and threshold[2] >= 10**6 for threshold in seen)
    else:   # a real-valued program sees the thresholds of a process
        assert seen == [before] * 4
    assert gc.get_threshold() == before

    def failing(comm):
        raise RuntimeError(f"rank {comm.rank} fails")

    with pytest.raises(simcomm.errors.RankError):
        simcomm.World(4, tensors=tensors).run(failing)
    assert gc.get_threshold() == before


def test_a_run_of_many_ranks_gives_the_process_a_futex_hash_for_its_threads():
    """Each waiting rank thread sleeps on a futex of its own; Linux 6.16 on sizes a process's
    futex hash by its CPUs (16 slots on 2), so waking a rank walked hundreds of sleeping ones.
    A run widens the hash to twice its ranks (a power of two); elsewhere nothing changes."""
    import ctypes
    import sys

    from simcomm.sim import scheduler

    if not sys.platform.startswith("linux"):
        assert scheduler.widen_futex_hash(300) == 0
        return
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    if prctl(scheduler._PR_FUTEX_HASH, scheduler._PR_FUTEX_HASH_GET_SLOTS, 0, 0, 0) < 0:
        pytest.skip("this kernel has no per-process futex hash (before Linux 6.16): its global one serves")
    assert simcomm.World(300, tensors="shape").run(lambda comm: comm.rank) == list(range(300))
    slots = prctl(scheduler._PR_FUTEX_HASH, scheduler._PR_FUTEX_HASH_GET_SLOTS, 0, 0, 0)
    assert slots >= 1024 and slots & (slots - 1) == 0, slots
    assert scheduler.widen_futex_hash(10) == slots           # never shrunk


def test_a_shape_only_run_keeps_its_rank_threads_on_one_cpu_and_the_caller_on_its_own():
    """One rank runs at a time, and a hand-off that wakes a rank on another CPU costs an
    interrupt and that CPU's cold cache: a shape-only run starts its rank threads on one CPU
    (the highest the caller may use) and sets the caller's CPUs again. A real-valued run's
    ranks run where a process would, on every CPU the caller may use (their compute uses
    torch's threads, which inherit a rank thread's CPUs)."""
    import os

    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs os.sched_setaffinity and two CPUs to run on")
    caller = os.sched_getaffinity(0)

    def cpus(comm):
        return sorted(os.sched_getaffinity(0))

    assert simcomm.World(4, tensors="shape").run(cpus) == [[max(caller)]] * 4
    assert os.sched_getaffinity(0) == caller
    assert simcomm.World(4).run(cpus) == [sorted(caller)] * 4
    assert os.sched_getaffinity(0) == caller

    def fails(comm):
        raise ValueError(comm.rank)

    with pytest.raises(simcomm.RankError):
        simcomm.World(3, tensors="shape").run(fails)
    assert os.sched_getaffinity(0) == caller


def test_one_cpu_is_a_no_op_where_the_caller_has_one_cpu(monkeypatch):
    import os

    from simcomm.sim.scheduler import OneCpu

    if not hasattr(os, "sched_setaffinity"):
        with OneCpu():
            pass
        return
    calls = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append(cpus))
    with OneCpu():
        pass
    assert calls == []
