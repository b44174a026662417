"""Collectives issued with ``async_op=True``, isend/irecv and batch_isend_irecv: the promises
both backends keep (values and gradients against the single-device float64 reference, what
the handles return, the trace), each checked on virtual ranks and on gloo processes by the
``backend`` fixture. What only the simulator does (its deadlock and misuse errors) is in
``tests/sim/test_async.py``."""
from __future__ import annotations

import pytest
import torch

import simcomm
from real.cases import async_cases
from real.verify import evaluate, run_cases

WORLD_SIZES = [2, 3, 4]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_async_case_matches_the_single_device_reference(backend, world_size):
    names = [case.name for case in async_cases()]
    got = backend(world_size).run(run_cases, names)
    simulated = simcomm.World(world_size).run(run_cases, names) if backend.name == "real" else None
    rows = evaluate(world_size, list(got), simulated)
    failed = [row for row in rows if not row["passed"]]
    assert len(rows) == len(names) and not failed, failed


def _ring(comm):
    x = torch.arange(3, dtype=torch.float64) + 10 * comm.rank
    nxt, prev = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    send, recv = comm.batch_isend_irecv([simcomm.P2POp("isend", x, nxt),
                                         simcomm.P2POp("irecv", ((3,), torch.float64), prev)])
    return recv.wait(), send.wait()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_batch_ring_on_odd_and_even_world_sizes(backend, world_size):
    runner = backend(world_size)
    for rank, (got, sent) in enumerate(runner.run(_ring)):
        assert sent is None
        assert torch.equal(got, torch.arange(3, dtype=torch.float64) + 10 * ((rank - 1) % world_size))
    events = runner.trace.filter(op="recv").events
    assert len(events) == world_size
    assert all(e.async_op and e.start <= e.end <= e.waited and e.args == {} for e in events)


# -- a data-parallel step with bucketed async all-reduces in gradient hooks --------------

def _model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(5, 4, generator=gen, dtype=torch.float64),
            torch.randn(5, 3, generator=gen, dtype=torch.float64))


def _dp_step(comm, state_dict):
    """Each bucket is all-reduced (AVG) asynchronously as soon as its last gradient is ready."""
    model = _model()
    model.load_state_dict(state_dict)
    params = list(model.parameters())
    buckets = [params[2:], params[:2]]           # backward produces the last layer's grads first
    handles: list = []
    ready: dict[int, int] = {}

    def hook(param):
        index = next(i for i, bucket in enumerate(buckets) if any(p is param for p in bucket))
        ready[index] = ready.get(index, 0) + 1
        if ready[index] == len(buckets[index]):
            flat = torch.cat([p.grad.reshape(-1) for p in buckets[index]])   # (bucket numel,)
            handles.append((index, comm.all_reduce(flat, op="avg", async_op=True)))
            comm.compute(flops=4e6)          # the backward compute that overlaps this bucket

    for param in params:
        param.register_post_accumulate_grad_hook(hook)
    x, target = _batch(comm.rank)
    comm.compute(flops=1e6)
    torch.nn.functional.mse_loss(model(x), target).backward()
    for index, handle in handles:
        flat, offset = handle.wait(), 0
        for param in buckets[index]:
            param.grad = flat[offset:offset + param.numel()].view_as(param)   # (param shape)
            offset += param.numel()
    return [p.grad for p in params]


def assert_single_device_gradients(outs: list, state: dict, world_size: int) -> None:
    """Every rank's gradients of :func:`_dp_step` equal one device's for the whole batch: the
    mean of the per-rank mean losses, the gradient data parallelism computes."""
    reference = _model()
    reference.load_state_dict(state)
    xs, targets = zip(*(_batch(r) for r in range(world_size)))
    sum(torch.nn.functional.mse_loss(reference(x), t) for x, t in zip(xs, targets)).div(world_size).backward()
    for grads in outs:
        for got, param in zip(grads, reference.parameters()):
            torch.testing.assert_close(got, param.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bucketed_data_parallel_step_equals_single_device_gradient(backend, world_size):
    state = _model().state_dict()
    runner = backend(world_size)
    assert_single_device_gradients(runner.run(_dp_step, state), state, world_size)
    reduces = runner.trace.filter(op="all_reduce").events
    assert len(reduces) == 2 * world_size
    assert all(e.phase == "forward" and e.args == {"op": "avg"} for e in reduces)
    for event in reduces:
        assert event.async_op and event.start < event.end <= event.waited
    for rank in range(world_size):
        ops = [e.op for e in runner.trace.filter(rank=rank).events]
        assert ops.count("compute") == 3 and ops.count("all_reduce") == 2
    # the first bucket was issued before the second bucket's compute marker and waited after it
    first = min((e for e in reduces if e.rank == 0), key=lambda e: e.start)
    marks = [e for e in runner.trace.filter(rank=0, op="compute").events]
    assert any(first.start < m.start < first.waited for m in marks)
    if backend.name == "real":      # the same records on both backends
        world = simcomm.World(world_size)
        world.run(_dp_step, state)

        def fields(trace):
            return sorted((e.rank, e.step, e.op, e.phase, e.async_op, e.nbytes, str(e.args)) for e in trace)

        assert fields(runner.trace) == fields(world.trace)


def _changed_after_the_call(comm):
    """Every async call's input changed (and freed) right after the call, before any wait: what
    moves is what the program passed at the call. Rank 1 is slow, so checked mode's checks are
    still pending on rank 0 when it changes its tensors."""
    import time
    world, rank = comm.world_size, comm.rank
    if rank == 1:
        time.sleep(0.2)
    x = torch.full((4,), float(rank + 1), dtype=torch.float64)
    handles = [comm.all_reduce(x, async_op=True), comm.all_gather(x, dim=0, async_op=True),
               comm.reduce_scatter(x.repeat(world), dim=0, async_op=True),
               comm.broadcast(x, src=0, async_op=True),
               comm.isend(x, (rank + 1) % world), comm.irecv((4,), torch.float64, (rank - 1) % world)]
    ring = comm.batch_isend_irecv([simcomm.P2POp("isend", x * 10, (rank + 1) % world),
                                   simcomm.P2POp("irecv", ((4,), torch.float64), (rank - 1) % world)])
    x.fill_(-1.0)
    del x
    return [h.wait() for h in handles + ring]


@pytest.mark.real
@pytest.mark.timeout(300)
@pytest.mark.parametrize("checked", [True, False], ids=["checked", "unchecked"])
def test_an_async_call_moves_what_the_program_passed_at_the_call(checked):
    import real

    world = 3
    want = simcomm.World(world).run(_changed_after_the_call)
    total = sum(range(1, world + 1))
    for rank, outs in enumerate(want):       # the single-process values, from what each rank passed
        left = (rank - 1) % world + 1.0
        assert torch.equal(outs[0], torch.full((4,), float(total), dtype=torch.float64))
        assert torch.equal(outs[1], torch.arange(1, world + 1, dtype=torch.float64).repeat_interleave(4))
        assert torch.equal(outs[2], torch.full((4,), float(total), dtype=torch.float64))
        assert torch.equal(outs[3], torch.ones(4, dtype=torch.float64))
        assert outs[4] is None and outs[6] is None
        assert torch.equal(outs[5], torch.full((4,), left, dtype=torch.float64))
        assert torch.equal(outs[7], torch.full((4,), 10 * left, dtype=torch.float64))
    with real.Cluster(world, backend="gloo", checked=checked) as cluster:
        for _ in range(2):
            got = cluster.run(_changed_after_the_call)
            for rank in range(world):
                for index, (g, w) in enumerate(zip(got[rank], want[rank], strict=True)):
                    assert (g is None and w is None) or torch.equal(g, w), (rank, index, g, w)
