"""torch.distributed programs shared by the simulator and real-process tests, with their
single-device references. Each program takes the communicator first (as every simcomm
program does) and ignores it: it talks to torch.distributed only."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

WORLD = 4


def rank_input(rank: int, shape=(4, 3), dtype=torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank), dtype=dtype)


def split_rows(src: int, dst: int) -> int:
    """Rows rank ``src`` sends rank ``dst`` in the uneven all-to-all (1 to 3)."""
    return (src + 2 * dst) % 3 + 1


# -- dist.* collectives ----------------------------------------------------------------------

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}


def collectives_program(comm, reduce_ops=tuple(REDUCE_OPS)) -> dict[str, torch.Tensor]:
    """Every dist.* collective once; returns what this rank holds after each."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = rank_input(rank)
    out: dict[str, torch.Tensor] = {}
    for name in reduce_ops:
        t = x.clone()
        dist.all_reduce(t, op=REDUCE_OPS[name])
        out[f"all_reduce_{name}"] = t
    ints = torch.arange(6, dtype=torch.int32) + rank
    dist.all_reduce(ints)
    out["all_reduce_int32"] = ints
    pieces = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(pieces, x)
    out["all_gather"] = torch.stack(pieces)
    flat = torch.empty(world * x.shape[0], x.shape[1], dtype=x.dtype)
    dist.all_gather_into_tensor(flat, x)
    out["all_gather_into_tensor"] = flat
    big = rank_input(rank, (world * 2, 3))
    shard = torch.empty(2, 3, dtype=x.dtype)
    dist.reduce_scatter_tensor(shard, big)
    out["reduce_scatter_tensor"] = shard
    even = torch.empty(world * 2, 3, dtype=x.dtype)
    dist.all_to_all_single(even, big)
    out["all_to_all_single"] = even
    send_rows = [split_rows(rank, dst) for dst in range(world)]
    recv_rows = [split_rows(src, rank) for src in range(world)]
    mine = rank_input(rank, (sum(send_rows), 3))
    uneven = torch.empty(sum(recv_rows), 3, dtype=x.dtype)
    dist.all_to_all_single(uneven, mine, recv_rows, send_rows)
    out["all_to_all_single_uneven"] = uneven
    inputs = list(rank_input(rank, (world, 2)).unbind(0))
    outputs = [torch.empty(2, dtype=x.dtype) for _ in range(world)]
    dist.all_to_all(outputs, inputs)
    out["all_to_all"] = torch.stack(outputs)
    t = x.clone()
    dist.broadcast(t, src=2)
    out["broadcast"] = t
    t = x.clone()
    dist.reduce(t, dst=1)
    out["reduce"] = t if rank == 1 else torch.zeros(0)   # other ranks' buffers: unspecified (gloo scribbles)
    gathered = [torch.empty_like(x) for _ in range(world)] if rank == 3 else None
    dist.gather(x, gathered, dst=3)
    out["gather"] = torch.stack(gathered) if rank == 3 else torch.zeros(0)
    t = torch.empty_like(x)
    dist.scatter(t, [rank_input(10 + j) for j in range(world)] if rank == 1 else None, src=1)
    out["scatter"] = t
    dist.barrier()
    received = torch.empty_like(x)
    if rank % 2 == 0:
        dist.send(x, dst=(rank + 1) % world)
        dist.recv(received, src=(rank - 1) % world)
    else:
        dist.recv(received, src=(rank - 1) % world)
        dist.send(x, dst=(rank + 1) % world)
    out["send_recv"] = received
    return out


def collectives_reference(world: int = WORLD, reduce_ops=tuple(REDUCE_OPS)) -> list[dict[str, torch.Tensor]]:
    """What each rank of :func:`collectives_program` must hold, computed on one device."""
    xs = [rank_input(r) for r in range(world)]
    stacked = torch.stack(xs)  # (world, 4, 3)
    reduced = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.amax(0),
               "min": stacked.amin(0), "product": stacked.prod(0)}
    bigs = [rank_input(r, (world * 2, 3)) for r in range(world)]
    big_sum = torch.stack(bigs).sum(0)  # (world * 2, 3)
    refs = []
    for rank in range(world):
        ref = {f"all_reduce_{name}": reduced[name] for name in reduce_ops}
        ref["all_reduce_int32"] = sum(torch.arange(6, dtype=torch.int32) + r for r in range(world))
        ref["all_gather"] = stacked
        ref["all_gather_into_tensor"] = torch.cat(xs)
        ref["reduce_scatter_tensor"] = big_sum[2 * rank: 2 * rank + 2]
        ref["all_to_all_single"] = torch.cat([bigs[src][2 * rank: 2 * rank + 2] for src in range(world)])
        pieces = []
        for src in range(world):
            rows = [split_rows(src, dst) for dst in range(world)]
            pieces.append(rank_input(src, (sum(rows), 3)).split(rows)[rank])
        ref["all_to_all_single_uneven"] = torch.cat(pieces)
        ref["all_to_all"] = torch.stack([rank_input(src, (world, 2))[rank] for src in range(world)])
        ref["broadcast"] = xs[2]
        ref["reduce"] = reduced["sum"] if rank == 1 else torch.zeros(0)
        ref["gather"] = stacked if rank == 3 else torch.zeros(0)
        ref["scatter"] = rank_input(10 + rank)
        ref["send_recv"] = xs[(rank - 1) % world]
        refs.append(ref)
    return refs


# -- async_op=True, isend/irecv, batch_isend_irecv ----------------------------------------------

def async_program(comm) -> dict[str, torch.Tensor]:
    """Every collective of :func:`collectives_program` issued with ``async_op=True`` before
    any is waited on, a batch_isend_irecv ring and an isend/irecv pair; then every Work
    waited on (``wait``, a polled ``is_completed`` or ``get_future``, which gloo's
    reduce_scatter_tensor lacks) and the buffers read."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = rank_input(rank)
    out: dict[str, torch.Tensor] = {}
    works: list[tuple[str, dist.Work]] = []
    out["all_reduce_sum"] = x.clone()
    works.append(("wait", dist.all_reduce(out["all_reduce_sum"], async_op=True)))
    out["all_gather_into_tensor"] = torch.empty(world * x.shape[0], x.shape[1], dtype=x.dtype)
    works.append(("poll", dist.all_gather_into_tensor(out["all_gather_into_tensor"], x, async_op=True)))
    big = rank_input(rank, (world * 2, 3))
    out["reduce_scatter_tensor"] = torch.empty(2, 3, dtype=x.dtype)
    works.append(("wait", dist.reduce_scatter_tensor(out["reduce_scatter_tensor"], big, async_op=True)))
    send_rows = [split_rows(rank, dst) for dst in range(world)]
    recv_rows = [split_rows(src, rank) for src in range(world)]
    out["all_to_all_single_uneven"] = torch.empty(sum(recv_rows), 3, dtype=x.dtype)
    works.append(("future", dist.all_to_all_single(out["all_to_all_single_uneven"],
                                                 rank_input(rank, (sum(send_rows), 3)), recv_rows,
                                                 send_rows, async_op=True)))
    out["broadcast"] = x.clone()
    works.append(("poll", dist.broadcast(out["broadcast"], src=2, async_op=True)))
    reduced = x.clone()
    works.append(("wait", dist.reduce(reduced, dst=1, async_op=True)))
    out["scatter"] = torch.empty_like(x)
    works.append(("future", dist.scatter(out["scatter"], [rank_input(10 + j) for j in range(world)]
                                         if rank == 1 else None, src=1, async_op=True)))
    works.append(("wait", dist.barrier(async_op=True)))
    out["ring"] = torch.empty_like(x)
    works += [("wait", work) for work in dist.batch_isend_irecv([
        dist.P2POp(dist.isend, x, (rank + 1) % world),
        dist.P2POp(dist.irecv, out["ring"], (rank - 1) % world)])]
    out["isend_irecv"] = torch.empty_like(x)
    partner = rank ^ 1                              # pairs (0, 1), (2, 3)
    if rank % 2 == 0:
        works.append(("wait", dist.isend(x, dst=partner)))
        works.append(("wait", dist.irecv(out["isend_irecv"], src=partner)))
    else:
        works.append(("wait", dist.irecv(out["isend_irecv"], src=partner)))
        works.append(("wait", dist.isend(x, dst=partner)))
    futures = []
    for how, work in works:
        if how == "wait":
            work.wait()
        elif how == "poll":
            while not work.is_completed():          # a poll lets the other ranks go on
                pass
        else:
            futures.append(work.get_future().then(lambda fut: fut.value()[0] * 1))
    out["future_values"] = torch.cat([future.wait().reshape(-1) for future in futures])
    if rank == 1:
        out["reduce"] = reduced
    return out


def async_reference(world: int = WORLD) -> list[dict[str, torch.Tensor]]:
    """What each rank of :func:`async_program` must hold, computed on one device."""
    blocking = collectives_reference(world, reduce_ops=("sum",))
    xs = [rank_input(r) for r in range(world)]
    refs = []
    for rank in range(world):
        want = blocking[rank]
        ref = {name: want[name] for name in ("all_reduce_sum", "all_gather_into_tensor",
                                             "reduce_scatter_tensor", "all_to_all_single_uneven",
                                             "broadcast", "scatter")}
        ref["ring"] = xs[(rank - 1) % world]
        ref["isend_irecv"] = xs[rank ^ 1]
        ref["future_values"] = torch.cat([want["all_to_all_single_uneven"].reshape(-1),
                                          want["scatter"].reshape(-1)])
        if rank == 1:
            ref["reduce"] = want["reduce"]
        refs.append(ref)
    return refs


def overlap_program(comm) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank 0 issues an all-reduce, then sends rank 1 the data that rank 1 needs before it
    can join that all-reduce: only an all-reduce that does not block rank 0 until every rank
    has joined lets this program finish."""
    rank = dist.get_rank()
    t = rank_input(rank)
    message = torch.empty_like(t)
    if rank == 0:
        work = dist.all_reduce(t, async_op=True)
        dist.send(rank_input(20), dst=1)
        work.wait()
    elif rank == 1:
        dist.recv(message, src=0)
        dist.all_reduce(t)
    else:
        dist.all_reduce(t)
    return t, message if rank == 1 else None


def overlap_reference(world: int = WORLD) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    total = torch.stack([rank_input(r) for r in range(world)]).sum(0)
    return [(total, rank_input(20) if rank == 1 else None) for rank in range(world)]


# -- models --------------------------------------------------------------------------------

def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).double()


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * step + rank))


def data_parallel_reference(steps: int = 2, world: int = WORLD, lr: float = 0.1) -> list[torch.Tensor]:
    """Parameters after ``steps`` SGD steps on one device with the loss averaged over the
    ranks' batches (what DDP and FSDP compute: gradients averaged over ranks)."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        loss = sum(model(batch(step, rank)).pow(2).sum() for rank in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def ddp_program(comm, steps: int = 2, lr: float = 0.1, hook: str | None = None) -> list[torch.Tensor]:
    """DDP training; ``hook="allreduce"`` registers DDP's default all-reduce comm hook (a
    future chained on the Work of ``dist.all_reduce(..., async_op=True)``)."""
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(mlp())
    if hook == "allreduce":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        model(batch(step, dist.get_rank())).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def fsdp_program(comm, steps: int = 2, lr: float = 0.1) -> list[torch.Tensor]:
    from torch.distributed.fsdp import fully_shard
    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        model(batch(step, dist.get_rank())).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().detach() for p in model.parameters()]


# -- DTensor ----------------------------------------------------------------------------------

def dtensor_matmul_program(comm, mesh_shape: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """A sharded matmul and every redistribution between Shard(0)/Replicate/Partial."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", mesh_shape)
    a = rank_input(0, (8, 6))   # the same full tensor on every rank
    b = rank_input(1, (6, 4))
    last = mesh.ndim - 1
    placements = {"shard0": Shard(0), "shard1": Shard(1), "replicate": Replicate()}
    out: dict[str, torch.Tensor] = {}
    row = [Replicate()] * last
    da = distribute_tensor(a, mesh, [*row, Shard(0)])
    db = distribute_tensor(b, mesh, [*row, Replicate()])
    out["matmul_rows"] = (da @ db).full_tensor()
    da = distribute_tensor(a, mesh, [*row, Shard(1)])
    db = distribute_tensor(b, mesh, [*row, Shard(0)])
    product = da @ db                   # partial sums over the sharded inner dim
    out["matmul_inner_placement"] = torch.tensor(float(product.placements[-1].is_partial()))
    out["matmul_inner"] = product.full_tensor()
    for src_name, src in placements.items():
        for dst_name, dst in placements.items():
            moved = distribute_tensor(a, mesh, [*row, src]).redistribute(mesh, [*row, dst])
            out[f"{src_name}->{dst_name}"] = moved.full_tensor()
    # redistributing *to* Partial is internal to DTensor; a Partial tensor is built from
    # per-rank partial sums that differ between ranks and add up to ``a``
    size, coordinate = mesh.size(last), mesh.get_local_rank(last)
    share = (coordinate + 1) / (size * (size + 1) / 2)
    partial = DTensor.from_local(a * share, mesh, [*row, Partial()])
    for dst_name, dst in placements.items():
        out[f"partial->{dst_name}"] = partial.redistribute(mesh, [*row, dst]).full_tensor()
    if mesh.ndim == 2:
        both = distribute_tensor(a, mesh, [Shard(0), Shard(1)])
        out["2d_shard_shard_local"] = both.to_local()
        out["2d_full"] = both.redistribute(mesh, [Replicate(), Replicate()]).to_local()
    return out


def dtensor_reference(mesh_shape: tuple[int, ...], rank: int) -> dict[str, torch.Tensor]:
    a, b = rank_input(0, (8, 6)), rank_input(1, (6, 4))
    names = ("shard0", "shard1", "replicate")
    out = {"matmul_rows": a @ b, "matmul_inner": a @ b, "matmul_inner_placement": torch.tensor(1.0)}
    out.update({f"{s}->{d}": a for s in names for d in names})
    out.update({f"partial->{d}": a for d in names})
    if len(mesh_shape) == 2:
        row, col = divmod(rank, mesh_shape[1])
        out["2d_shard_shard_local"] = a.chunk(mesh_shape[0], 0)[row].chunk(mesh_shape[1], 1)[col]
        out["2d_full"] = a
    return out


def tensor_parallel_program(comm) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """An MLP with ColwiseParallel then RowwiseParallel; output, input gradient and full
    parameter gradients (every rank computes the same replicated loss)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tp_mlp()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = rank_input(0, (5, 4)).requires_grad_()
    y = model(x)
    y.pow(2).sum().backward()
    return y.detach(), [x.grad, *(p.grad.full_tensor() for p in model.parameters())]


def tp_mlp() -> nn.Sequential:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).double()


def tensor_parallel_reference() -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = tp_mlp()
    x = rank_input(0, (5, 4)).requires_grad_()
    y = model(x)
    y.pow(2).sum().backward()
    return y.detach(), [x.grad, *(p.grad for p in model.parameters())]


# -- torch.distributed.nn.functional ------------------------------------------------------------

def nn_functional_program(comm, op_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and input gradient of dist.nn.functional.all_reduce with the loss
    ``(y * w_r).sum()`` on each rank (w_r differs per rank)."""
    import torch.distributed.nn.functional as dnn
    rank = dist.get_rank()
    x = rank_input(rank, (5,)).requires_grad_()
    y = dnn.all_reduce(x, op=REDUCE_OPS[op_name])
    (y * rank_input(50 + rank, (5,))).sum().backward()
    return y.detach(), x.grad


NN_OPS = ("all_gather", "reduce_scatter", "broadcast", "all_to_all")


def nn_functional_collective_program(comm, op: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One op of torch.distributed.nn.functional, forward and input gradient, with the loss
    ``(out * w_r).sum()`` on each rank; ``out`` is returned stacked ``(world, 3)`` or ``(3,)``."""
    import torch.distributed.nn.functional as dnn
    rank, world = dist.get_rank(), dist.get_world_size()
    if op == "reduce_scatter":
        x = rank_input(rank, (world, 3)).requires_grad_()
        out = dnn.reduce_scatter(torch.empty(3, dtype=torch.float64), list(x.unbind(0)))
    else:
        x = rank_input(rank, (3,) if op != "all_to_all" else (world, 3)).requires_grad_()
        if op == "all_gather":
            out = torch.stack(dnn.all_gather(x))
        elif op == "broadcast":
            out = dnn.broadcast(x, src=2)
        else:
            out = torch.stack(dnn.all_to_all([torch.empty(3, dtype=torch.float64) for _ in range(world)],
                                             list(x.unbind(0))))
    (out * rank_input(70 + rank, tuple(out.shape))).sum().backward()
    return out.detach(), x.grad


def nn_functional_collective_reference(op: str, world: int = WORLD):
    """Outputs and input gradients of every rank, from one device: the loss is the sum of
    the ranks' losses."""
    if op in ("reduce_scatter", "all_to_all"):
        xs = [rank_input(r, (world, 3)).requires_grad_() for r in range(world)]
    else:
        xs = [rank_input(r, (3,)).requires_grad_() for r in range(world)]
    if op == "all_gather":
        outs = [torch.stack(xs)] * world
    elif op == "broadcast":
        outs = [xs[2]] * world
    elif op == "reduce_scatter":
        outs = list(torch.stack(xs).sum(0).unbind(0))          # rank r: sum over ranks of x[r]
    else:
        outs = [torch.stack([xs[src][dst] for src in range(world)]) for dst in range(world)]
    sum((out * rank_input(70 + r, tuple(out.shape))).sum() for r, out in enumerate(outs)).backward()
    return [o.detach() for o in outs], [torch.zeros_like(x) if x.grad is None else x.grad for x in xs]


def batch_isend_irecv_ring(comm):
    """Each rank sends its input to the next rank and receives the previous one's, in one batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    received = torch.empty(4, 3, dtype=torch.float64)
    ops = [dist.P2POp(dist.isend, rank_input(rank), (rank + 1) % world),
           dist.P2POp(dist.irecv, received, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def zero_d_program(comm) -> dict[str, torch.Tensor]:
    """0-d tensors (a loss) through all_reduce, broadcast and reduce: each buffer keeps shape ()."""
    rank = dist.get_rank()
    value = lambda: torch.tensor(float(rank + 1), dtype=torch.float64)   # noqa: E731  (0-d)
    summed, broadcast, reduced = value(), value(), value()
    dist.all_reduce(summed)
    dist.broadcast(broadcast, src=2)
    dist.reduce(reduced, dst=1)
    return {"all_reduce": summed, "broadcast": broadcast, "reduce": reduced}


def zero_d_reference(world: int = WORLD) -> list[dict[str, torch.Tensor]]:
    """One device: rank r holds r + 1; the sum, rank 2's value, the sum on rank 1 only."""
    values = [torch.tensor(float(rank + 1), dtype=torch.float64) for rank in range(world)]
    total = sum(values)
    return [{"all_reduce": total, "broadcast": values[2], "reduce": total if rank == 1 else values[rank]}
            for rank in range(world)]
