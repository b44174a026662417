"""The conformance cases of ``real.verify``: SPMD programs and their single-device references.

A :class:`Case` pairs a program (run on every rank of any backend; it returns
this rank's outputs and input gradients) with a reference that computes what
every rank should get on one device, in float64, without communication.
Inputs are seeded by (case, rank), so every process builds the same data, and
rounded to halves, so MAX/MIN see ties and PRODUCT sees zeros.

The per-rank programs sum their losses (the convention of simcomm's backward
rules); the model cases use the convention their model states.
"""
from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from simcomm import collectives as math
from simcomm.checks import REDUCE_OPS
from simcomm.communicator import Communicator
from simcomm.parallel.ring import ring_exchange

__all__ = ["Case", "collective_cases", "rooted_and_uneven_cases", "async_cases", "RankResult"]

#: (outputs, input gradients) of one rank; ``None`` for an output a rank does not get
RankResult = tuple[list, list]


@dataclass(frozen=True)
class Case:
    """``program(comm) -> RankResult`` on every rank; ``reference(world_size) -> [RankResult]``."""

    name: str
    program: Callable[[Communicator], RankResult]
    reference: Callable[[int], list[RankResult]]
    has_grads: bool = True


def _data(key: str, shape: tuple[int, ...], rank: int) -> torch.Tensor:
    """Seeded float64 data with many ties and zeros: multiples of 0.5 in [-2, 2]."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{key}/{rank}".encode()))
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 2).round().clamp(-4, 4) / 2


def smooth(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Seeded float64 normals for ``key`` (the same on every rank and process)."""
    gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def on_cpu(tensors: list) -> list:
    """The tensors of ``tensors`` detached and on the CPU, as results travel back."""
    return [t.detach().cpu() if isinstance(t, torch.Tensor) else t for t in tensors]


# -- collectives on per-rank inputs: loss_r = sum(y_r * w_r) ------------------------------

def _per_rank_program(key: str, shape_fn, forward, comm: Communicator) -> RankResult:
    x = _data(key, shape_fn(comm.world_size), comm.rank).to(comm.device).requires_grad_()
    y = forward(comm, x)
    (y * _data(key + "/w", tuple(y.shape), comm.rank).to(comm.device)).sum().backward()
    # an input with no path to any output (scatter off the source) has gradient zero
    return on_cpu([y]), on_cpu([x.grad if x.grad is not None else torch.zeros_like(x)])


def _per_rank_reference(key: str, shape_fn, forward_math, world_size: int) -> list[RankResult]:
    xs = [_data(key, shape_fn(world_size), r).requires_grad_() for r in range(world_size)]
    ys = forward_math(xs)
    sum((y * _data(key + "/w", tuple(y.shape), r)).sum() for r, y in enumerate(ys)).backward()
    # an input with no path to any output (broadcast off the source) has gradient zero
    grads = [x.grad if x.grad is not None else torch.zeros_like(x) for x in xs]
    return [([ys[r].detach()], [grads[r]]) for r in range(world_size)]


def _per_rank_case(name: str, shape_fn, forward, forward_math) -> Case:
    return Case(name, partial(_per_rank_program, name, shape_fn, forward),
                partial(_per_rank_reference, name, shape_fn, forward_math))


def _fixed(shape: tuple[int, ...], world_size: int) -> tuple[int, ...]:
    return shape


def _split(world_size: int) -> tuple[int, ...]:
    return (2 * world_size, 3, 2 * world_size)          # divisible along dims 0 and 2


def _seq_shards(world_size: int) -> tuple[int, ...]:
    return (2, 3, 2 * world_size, 4)                    # (b, s/P, h, d)


def _head_shards(world_size: int) -> tuple[int, ...]:
    return (2, 2 * world_size, 3, 4)                    # (b, s, h/P, d)


def _call(method: str, comm: Communicator, x: torch.Tensor, **kwargs) -> torch.Tensor:
    return getattr(comm, method)(x, **kwargs)


def _apply_math(function: str, xs: list, **kwargs) -> list:
    return getattr(math, function)(xs, **kwargs)


def collective_cases() -> list[Case]:
    """Every collective: each reduce op, several dims (negative too), both roots."""
    out = []
    for op in REDUCE_OPS:
        out.append(_per_rank_case(f"all_reduce[{op}]", partial(_fixed, (3, 4)),
                                  partial(_call, "all_reduce", op=op), partial(_apply_math, "all_reduce", op=op)))
    for dim in (0, 1, -1):
        out.append(_per_rank_case(f"all_gather[dim={dim}]", partial(_fixed, (2, 3, 4)),
                                  partial(_call, "all_gather", dim=dim), partial(_apply_math, "all_gather", dim=dim)))
    for dim in (0, -1):
        for op in REDUCE_OPS:
            out.append(_per_rank_case(
                f"reduce_scatter[dim={dim},{op}]", _split, partial(_call, "reduce_scatter", dim=dim, op=op),
                partial(_apply_math, "reduce_scatter", dim=dim, op=op)))
    for scatter_dim, gather_dim in ((0, 1), (2, 0), (-1, -2)):
        kwargs = {"scatter_dim": scatter_dim, "gather_dim": gather_dim}
        out.append(_per_rank_case(f"all_to_all[{scatter_dim}->{gather_dim}]", _split,
                                  partial(_call, "all_to_all", **kwargs), partial(_apply_math, "all_to_all", **kwargs)))
    for (scatter_dim, gather_dim), shape_fn in (((2, 1), _seq_shards), ((1, 2), _head_shards)):
        kwargs = {"scatter_dim": scatter_dim, "gather_dim": gather_dim}
        out.append(_per_rank_case(f"all_to_all_4D[{scatter_dim}->{gather_dim}]", shape_fn,
                                  partial(_call, "all_to_all_4D", **kwargs), partial(_apply_math, "all_to_all", **kwargs)))
    for src in ("first", "last"):
        out.append(Case(f"broadcast[src={src}]", partial(_root_program, "broadcast", src),
                        partial(_root_reference, "broadcast", src)))
    for dst in ("first", "last"):
        for dim in (0, -1):
            out.append(Case(f"gather[dst={dst},dim={dim}]", partial(_root_program, "gather", dst, dim=dim),
                            partial(_root_reference, "gather", dst, dim=dim), has_grads=False))
    for dim in (0, -1):
        for scale in (False, True):
            out.append(Case(f"slice[dim={dim},scale_grad={scale}]", partial(_slice_program, dim, scale),
                            partial(_slice_reference, dim, scale)))
    out.append(Case("send/recv[ring]", _ring_program, _ring_reference, has_grads=False))
    return out


def _root(which: str, world_size: int) -> int:
    return 0 if which == "first" else world_size - 1


def _root_program(op: str, which: str, comm: Communicator, **kwargs) -> RankResult:
    root = _root(which, comm.world_size)
    key = f"{op}/{which}"
    if op == "gather":
        x = _data(key, (2, 3), comm.rank).to(comm.device)
        return on_cpu([comm.gather(x, dst=root, **kwargs)]), []
    return _per_rank_program(key, partial(_fixed, (3, 4)), partial(_call, "broadcast", src=root), comm)


def _root_reference(op: str, which: str, world_size: int, **kwargs) -> list[RankResult]:
    root = _root(which, world_size)
    key = f"{op}/{which}"
    if op == "gather":
        xs = [_data(key, (2, 3), r) for r in range(world_size)]
        return [([y], []) for y in math.gather(xs, dst=root, **kwargs)]
    return _per_rank_reference(key, partial(_fixed, (3, 4)), partial(_apply_math, "broadcast", src=root),
                               world_size)


def _slice_program(dim: int, scale_grad: bool, comm: Communicator) -> RankResult:
    key = f"slice/{dim}/{scale_grad}"
    x = _data(key, _split(comm.world_size), 0).to(comm.device).requires_grad_()   # replicated
    y = comm.slice(x, dim, scale_grad=scale_grad)
    (y * _data(key + "/w", tuple(y.shape), comm.rank).to(comm.device)).sum().backward()
    return on_cpu([y]), on_cpu([x.grad])


def _slice_reference(dim: int, scale_grad: bool, world_size: int) -> list[RankResult]:
    key = f"slice/{dim}/{scale_grad}"
    x = _data(key, _split(world_size), 0).requires_grad_()                       # one shared leaf
    ys = math.scatter(x, world_size, dim)
    sum((y * _data(key + "/w", tuple(y.shape), r)).sum() for r, y in enumerate(ys)).backward()
    grad = x.grad / world_size if scale_grad else x.grad
    return [([ys[r].detach()], [grad]) for r in range(world_size)]


def _ring_program(comm: Communicator) -> RankResult:
    x = _data("ring", (2, 5), comm.rank).to(comm.device)
    if comm.world_size == 1:
        return [x.cpu()], []
    return on_cpu([ring_exchange(comm, x)]), []   # to the next rank, from the previous one


def _ring_reference(world_size: int) -> list[RankResult]:
    return [([_data("ring", (2, 5), (r - 1) % world_size)], []) for r in range(world_size)]


# -- reduce, scatter, differentiable gather, uneven all-to-all --------------------------------

def _rooted_call(method: str, which: str, arg: str, comm: Communicator, x: torch.Tensor,
                 **kwargs) -> torch.Tensor:
    return getattr(comm, method)(x, **{arg: _root(which, comm.world_size)}, **kwargs)


def _rooted_math(function, which: str, xs: list, **kwargs) -> list:
    return function(xs, _root(which, len(xs)), **kwargs)


def _gather_with_grad(xs: list, dst: int, dim: int) -> list:
    """What the differentiable gather returns: the concatenation on ``dst``, an empty
    slice (size 0 at ``dim``) of the rank's input elsewhere."""
    return [torch.cat(xs, dim) if r == dst else xs[r].narrow(dim, 0, 0) for r in range(len(xs))]


def _uneven_splits(world_size: int) -> list[list[int]]:
    """``splits[i][j]``: rows rank ``i`` sends rank ``j``; zeros among them from 2 ranks on."""
    return [[(i + 2 * j) % 3 for j in range(world_size)] for i in range(world_size)]


def _a2a_program(key: str, even: bool, comm: Communicator) -> RankResult:
    world = comm.world_size
    if even:
        out_splits = in_splits = None
        rows = 2 * world
    else:
        splits = _uneven_splits(world)
        in_splits = splits[comm.rank]
        out_splits = [splits[i][comm.rank] for i in range(world)]
        rows = sum(in_splits)
    x = _data(key, (rows, 3), comm.rank).to(comm.device).requires_grad_()
    y = comm.all_to_all_single(x, out_splits, in_splits)
    (y * _data(key + "/w", tuple(y.shape), comm.rank).to(comm.device)).sum().backward()
    return on_cpu([y]), on_cpu([x.grad])


def _a2a_reference(key: str, even: bool, world_size: int) -> list[RankResult]:
    splits = [[2] * world_size] * world_size if even else _uneven_splits(world_size)
    out_splits = [[splits[i][j] for i in range(world_size)] for j in range(world_size)]
    xs = [_data(key, (sum(splits[r]), 3), r).requires_grad_() for r in range(world_size)]
    ys = math.all_to_all_single(xs, out_splits, splits)
    sum((y * _data(key + "/w", tuple(y.shape), r)).sum() for r, y in enumerate(ys)).backward()
    return [([ys[r].detach()], [xs[r].grad]) for r in range(world_size)]


def rooted_and_uneven_cases() -> list[Case]:
    """reduce (each op), scatter, the differentiable gather and all_to_all_single (even, and
    uneven with zero-sized splits), forward and backward; both roots."""
    out = []
    for op in REDUCE_OPS:
        for which in (("first", "last") if op == "sum" else ("last",)):
            out.append(_per_rank_case(
                f"reduce[dst={which},{op}]", partial(_fixed, (3, 4)),
                partial(_rooted_call, "reduce", which, "dst", op=op),
                partial(_rooted_math, math.reduce_to, which, op=op)))
    for which in ("first", "last"):
        for dim in (0, -1):
            out.append(_per_rank_case(
                f"scatter[src={which},dim={dim}]", _split, partial(_rooted_call, "scatter", which, "src", dim=dim),
                partial(_rooted_math, math.scatter_from, which, dim=dim)))
    for which, dim in (("first", -1), ("last", 0)):
        out.append(_per_rank_case(
            f"gather_grad[dst={which},dim={dim}]", partial(_fixed, (2, 3)),
            partial(_rooted_call, "gather", which, "dst", dim=dim),
            partial(_rooted_math, _gather_with_grad, which, dim=dim)))
    for even in (True, False):
        name = f"all_to_all_single[{'even' if even else 'uneven'}]"
        out.append(Case(name, partial(_a2a_program, name, even), partial(_a2a_reference, name, even)))
    return out
# -- asynchronous calls and batched point-to-point -----------------------------------------

def _call_async(method: str, comm: Communicator, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """The collective issued with ``async_op=True``; the handle's output (autograd flows through it)."""
    return getattr(comm, method)(x, async_op=True, **kwargs).wait()


def _overlap_program(comm: Communicator) -> RankResult:
    """Two async collectives in flight at once, waited in the reverse order of issue."""
    a = _data("overlap/a", (2, 3), comm.rank).to(comm.device).requires_grad_()
    b = _data("overlap/b", (2, 3), comm.rank).to(comm.device).requires_grad_()
    first = comm.all_reduce(a, async_op=True)
    second = comm.all_gather(b, dim=0, async_op=True)
    gathered, reduced = second.wait(), first.wait()
    loss = (reduced * _data("overlap/wa", (2, 3), comm.rank).to(comm.device)).sum()
    loss = loss + (gathered * _data("overlap/wb", tuple(gathered.shape), comm.rank).to(comm.device)).sum()
    loss.backward()
    return on_cpu([reduced, gathered]), on_cpu([a.grad, b.grad])


def _overlap_reference(world_size: int) -> list[RankResult]:
    a = [_data("overlap/a", (2, 3), r).requires_grad_() for r in range(world_size)]
    b = [_data("overlap/b", (2, 3), r).requires_grad_() for r in range(world_size)]
    reduced, gathered = math.all_reduce(a, "sum"), math.all_gather(b, 0)
    sum((reduced[r] * _data("overlap/wa", (2, 3), r)).sum()
        + (gathered[r] * _data("overlap/wb", tuple(gathered[r].shape), r)).sum()
        for r in range(world_size)).backward()
    return [([reduced[r].detach(), gathered[r].detach()], [a[r].grad, b[r].grad]) for r in range(world_size)]


def _batch_ring_program(comm: Communicator) -> RankResult:
    """Every rank sends to both neighbours and receives from both in one batch (receives listed first)."""
    from simcomm.handles import P2POp
    x = _data("batch", (2, 3), comm.rank).to(comm.device)
    if comm.world_size == 1:
        return [x.cpu(), x.cpu()], []
    nxt, prev = (comm.rank + 1) % comm.world_size, (comm.rank - 1) % comm.world_size
    spec = ((2, 3), torch.float64)
    handles = comm.batch_isend_irecv([P2POp("irecv", spec, prev), P2POp("irecv", spec, nxt),
                                      P2POp("isend", x, nxt), P2POp("isend", 2 * x, prev)])
    from_prev, from_next, *sent = [handle.wait() for handle in handles]
    assert sent == [None, None]
    return on_cpu([from_prev, from_next]), []


def _batch_ring_reference(world_size: int) -> list[RankResult]:
    if world_size == 1:
        return [([_data("batch", (2, 3), 0)] * 2, [])]
    return [([_data("batch", (2, 3), (r - 1) % world_size),
              2 * _data("batch", (2, 3), (r + 1) % world_size)], []) for r in range(world_size)]


def _isend_first_program(comm: Communicator) -> RankResult:
    """Every rank isends before it receives: deadlocks with blocking sends, not with isend."""
    x = _data("isend", (3,), comm.rank).to(comm.device)
    if comm.world_size == 1:
        return [x.cpu()], []
    sent = comm.isend(x)
    got = comm.recv((3,), torch.float64)
    sent.wait()
    return on_cpu([got]), []


def _isend_first_reference(world_size: int) -> list[RankResult]:
    return [([_data("isend", (3,), (r - 1) % world_size)], []) for r in range(world_size)]


def async_cases() -> list[Case]:
    """Collectives issued with ``async_op=True`` (forward and backward through ``wait()``),
    two calls in flight at once, ``batch_isend_irecv`` and ``isend`` rings."""
    out = []
    for op in REDUCE_OPS:
        out.append(_per_rank_case(f"async all_reduce[{op}]", partial(_fixed, (3, 4)),
                                  partial(_call_async, "all_reduce", op=op),
                                  partial(_apply_math, "all_reduce", op=op)))
    for dim in (0, -1):
        out.append(_per_rank_case(f"async all_gather[dim={dim}]", partial(_fixed, (2, 3, 4)),
                                  partial(_call_async, "all_gather", dim=dim),
                                  partial(_apply_math, "all_gather", dim=dim)))
    for op in ("sum", "avg", "max"):
        out.append(_per_rank_case(f"async reduce_scatter[dim=-1,{op}]", _split,
                                  partial(_call_async, "reduce_scatter", dim=-1, op=op),
                                  partial(_apply_math, "reduce_scatter", dim=-1, op=op)))
    kwargs = {"scatter_dim": 0, "gather_dim": 1}
    out.append(_per_rank_case("async all_to_all[0->1]", _split, partial(_call_async, "all_to_all", **kwargs),
                              partial(_apply_math, "all_to_all", **kwargs)))
    kwargs = {"scatter_dim": 2, "gather_dim": 1}
    out.append(_per_rank_case("async all_to_all_4D[2->1]", _seq_shards,
                              partial(_call_async, "all_to_all_4D", **kwargs),
                              partial(_apply_math, "all_to_all", **kwargs)))
    out.append(Case("async broadcast[src=last]", partial(_async_root_program, "broadcast"),
                    partial(_root_reference, "broadcast", "last")))
    out.append(Case("async gather[dst=last]", partial(_async_root_program, "gather"),
                    partial(_root_reference, "gather", "last", dim=0), has_grads=False))
    out.append(Case("async overlap[all_reduce+all_gather]", _overlap_program, _overlap_reference))
    out.append(Case("batch_isend_irecv[both neighbours]", _batch_ring_program, _batch_ring_reference,
                    has_grads=False))
    out.append(Case("isend/recv[ring]", _isend_first_program, _isend_first_reference, has_grads=False))
    return out


def _async_root_program(op: str, comm: Communicator) -> RankResult:
    root = comm.world_size - 1
    key = f"{op}/last"
    if op == "gather":
        x = _data(key, (2, 3), comm.rank).to(comm.device)
        return on_cpu([comm.gather(x, dst=root, dim=0, async_op=True).wait()]), []
    return _per_rank_program(key, partial(_fixed, (3, 4)), partial(_call_async, "broadcast", src=root), comm)
