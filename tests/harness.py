"""Run one collective on every rank and on the single-device reference, forward and backward."""
from __future__ import annotations

import torch

import simcomm

from . import reference as ref


def make_inputs(world_size: int, shape, *, seed: int = 0, dtype=torch.float64) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(world_size)]


def split_sizes(world_size: int, seed: int) -> list[list[int]]:
    """An uneven ``all_to_all_single``: ``[i][j]`` is the rows rank i sends rank j, 0 to 2 (zeros among them)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 3, (world_size, world_size), generator=gen).tolist()


def non_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous layout (a transposed view of a copy)."""
    if tensor.dim() < 2:
        return tensor.repeat_interleave(2)[::2]
    return tensor.transpose(0, -1).contiguous().transpose(0, -1)


def call(comm, op: str, x: torch.Tensor, **kw) -> torch.Tensor:
    if op == "all_reduce":
        return comm.all_reduce(x, op=kw.get("reduce", "sum"))
    if op == "all_gather":
        return comm.all_gather(x, dim=kw["dim"])
    if op == "reduce_scatter":
        return comm.reduce_scatter(x, dim=kw["dim"], op=kw.get("reduce", "sum"))
    if op == "slice":
        return comm.slice(x, dim=kw["dim"], scale_grad=kw.get("scale_grad", False))
    if op == "all_to_all_4D":
        return comm.all_to_all_4D(x, kw["scatter_dim"], kw["gather_dim"])
    if op == "broadcast":
        return comm.broadcast(x, src=kw["src"])
    if op == "reduce":
        return comm.reduce(x, dst=kw["dst"], op=kw.get("reduce", "sum"))
    if op == "scatter":
        return comm.scatter(x, src=kw["src"], dim=kw["dim"])   # off src: values ignored, zero grad
    if op == "gather":
        return comm.gather(x, dst=kw["dst"], dim=kw["dim"])
    if op == "all_to_all_single":
        outputs, inputs = kw["output_split_sizes"], kw["input_split_sizes"]
        return comm.all_to_all_single(x, outputs[comm.rank] if outputs is not None else None,
                                      inputs[comm.rank] if inputs is not None else None)
    raise ValueError(op)


def even_splits(inputs: list[torch.Tensor]) -> list[list[int]]:
    """The split lists ``None`` stands for: dim 0 split evenly over the ranks."""
    return [[x.shape[0] // len(inputs)] * len(inputs) for x in inputs]


def reference(op: str, inputs: list[torch.Tensor], **kw) -> list[torch.Tensor]:
    world_size = len(inputs)
    if op == "all_reduce":
        return ref.all_reduce(inputs, kw.get("reduce", "sum"))
    if op == "all_gather":
        return ref.all_gather(inputs, kw["dim"])
    if op == "reduce_scatter":
        return ref.reduce_scatter(inputs, kw["dim"], kw.get("reduce", "sum"))
    if op == "slice":
        return ref.slice_(inputs[0], world_size, kw["dim"])
    if op == "all_to_all_4D":
        return ref.all_to_all_4d(inputs, kw["scatter_dim"], kw["gather_dim"])
    if op == "broadcast":
        return ref.broadcast(inputs, kw["src"])
    if op == "reduce":
        return ref.reduce(inputs, kw["dst"], kw.get("reduce", "sum"))
    if op == "scatter":
        return ref.scatter(inputs, kw["src"], kw["dim"])
    if op == "gather":
        return ref.gather_with_grad(inputs, kw["dst"], kw["dim"])
    if op == "all_to_all_single":
        outputs, inputs_ = kw["output_split_sizes"], kw["input_split_sizes"]
        return ref.all_to_all_single(inputs, outputs if outputs is not None else even_splits(inputs),
                                     inputs_ if inputs_ is not None else even_splits(inputs))
    raise ValueError(op)


def run_both(op: str, inputs: list[torch.Tensor], grads: list[torch.Tensor] | None = None, *,
             contiguous: bool = True, world=None, **kw):
    """(outputs, input grads) on every rank, and the same from the reference.

    The objective is the sum over ranks of ``(y_r * grads[r]).sum()``. For
    ``slice`` every rank holds the same tensor ``inputs[0]``. An input with no
    path to the objective (scatter off its source) has gradient zero.
    """
    world_size = len(inputs)
    if op == "slice":
        inputs = [inputs[0]] * world_size

    def program(comm):
        x = inputs[comm.rank].clone()
        x = (x if contiguous else non_contiguous(x)).detach().requires_grad_()
        y = call(comm, op, x, **kw)
        if grads is not None:
            (y * grads[comm.rank]).sum().backward()
        return y.detach(), x.grad if x.grad is not None or grads is None else torch.zeros_like(x)

    world = world or simcomm.World(world_size)
    outs = world.run(program)
    leaves = [t.clone().requires_grad_() for t in (inputs[:1] if op == "slice" else inputs)]
    ref_outs = reference(op, leaves if op != "slice" else leaves * world_size, **kw)
    ref_grads = None
    if grads is not None:
        sum(((y * g).sum() for y, g in zip(ref_outs, grads))).backward()
        ref_grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                     for leaf in leaves] * (world_size if op == "slice" else 1)
    return ([o for o, _ in outs], [g for _, g in outs]), ([o.detach() for o in ref_outs], ref_grads)
