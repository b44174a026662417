"""One collective, forward and backward, on provenance tensors: :func:`collective_figure`.

:func:`run_collective` runs the op in a :class:`~simcomm.World` on
provenance-coded inputs (:mod:`simcomm.viz.provenance`); each rank then calls
``y.backward(g)`` with an incoming gradient ``g`` that is itself coded (rank
``r``'s ``g`` holds ``r * base + position``), so the figure shows where every
element went forward and where every gradient element went backward.
:func:`collective_figure` draws the four stages side by side, one row per rank.

Panels whose values only moved between ranks are coloured by source rank;
values that combine several ranks (sums, averages, scaled gradients) are
drawn in one neutral colour, and each cell names the ranks combined
(``Σ0-3``). Figures taller than :data:`SCREEN_HEIGHT_PX` lay the ranks side by
side.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import plotly.graph_objects as go
import torch

from ..checks import reduce_op_name
from ..ops import canonical_op
from ..parallel.ring import ring_exchange
from ..sim.world import World
from .grids import Panel, draw_panels, grid_layout
from .provenance import provenance_base, provenance_tensor

__all__ = ["OPS", "CollectiveRun", "run_collective", "collective_figure"]

_ULYSSES_DIMS = ("batch", "seq", "heads", "head_dim")

#: the tallest figure that fits a projected screen below a notebook's toolbar, in px
SCREEN_HEIGHT_PX = 800


@dataclass(frozen=True)
class _Op:
    """How to run and explain one op. ``args`` are the op's arguments and their defaults."""

    call: Callable[[Any, torch.Tensor, dict], torch.Tensor | None]
    args: dict[str, Any]
    default_shape: Callable[[int, dict], tuple[int, ...]]
    forward_kind: Callable[[dict], str]            # what the output holds: one of _KINDS
    backward_kind: Callable[[dict], str] | None    # what the input grad holds; None: no backward
    forward: Callable[[dict], str]                 # expression for the output column
    backward: Callable[[dict], str]                # expression for the input-grad column
    title: Callable[[dict, int], str]              # the lesson, two lines
    replicated: bool = False                       # every rank holds the same input
    dim_names: tuple[str, ...] | None = None
    # the cell text of a coded element: (scatter dim of its source layout, source shape) -> labeller;
    # None: the provenance code
    label: Callable[[int, tuple[int, ...]], Callable[[int, tuple[int, ...]], str]] | None = None


def _split_shape(size_per_rank: int) -> Callable[[int, dict], tuple[int, ...]]:
    """Default shape ``(2, size_per_rank * world_size)`` along the op's ``dim`` (for ops that split)."""
    def shape(world_size: int, args: dict) -> tuple[int, ...]:
        return (size_per_rank * world_size, 2) if args.get("dim") in (0, -2) else (2, size_per_rank * world_size)
    return shape


def _token_head_label(scatter_dim: int, source_shape: tuple[int, ...]) -> Callable[[int, tuple[int, ...]], str]:
    """Cell text ``"t5<br>h2"`` (token 5, head 2) of an element of Ulysses' layout ``(b, s, h, d)``.

    ``scatter_dim=2``: the source holds sequence shards ``(b, s/P, h, d)``, so
    rank ``r``'s local token ``i`` is token ``r * s/P + i``; otherwise head
    shards ``(b, s, h/P, d)``, rank ``r``'s local head ``j`` is head ``r * h/P + j``.
    """
    tokens, heads = source_shape[1], source_shape[2]

    def label(rank: int, position: tuple[int, ...]) -> str:
        _, token, head, _ = position                       # position in (b, s_local, h_local, d)
        if scatter_dim == 2:
            return f"t{rank * tokens + token}<br>h{head}"
        return f"t{token}<br>h{rank * heads + head}"
    return label


def _ulysses_shape(world_size: int, args: dict) -> tuple[int, ...]:
    if args["scatter_dim"] == 2:  # sequence shards (b, s/P, h, d), h = P heads
        return (1, 2, world_size, 2)
    return (1, 2 * world_size, 1, 2)  # head shards (b, s, h/P, d), s = 2P positions


#: what a panel holds: ``coded`` values only moved; ``sum`` / ``avg``: the sum / mean over all ranks
#: of one position; ``scaled``: a code divided by the world size; ``coded_or_zero``: codes on the
#: rank(s) the gradient reaches, zeros elsewhere; ``mixed``: anything else (products)
_KINDS = ("coded", "sum", "avg", "scaled", "coded_or_zero", "mixed")

OPS: dict[str, _Op] = {
    "all_reduce": _Op(
        call=lambda comm, x, a: comm.all_reduce(x, a["reduce_op"]),
        args={"reduce_op": "sum"},
        default_shape=lambda n, a: (2, 3),
        forward_kind=lambda a: {"sum": "sum", "avg": "avg", "max": "coded", "min": "coded"}.get(a["reduce_op"], "mixed"),
        backward_kind=lambda a: {"sum": "sum", "avg": "avg", "max": "sum", "min": "sum"}.get(a["reduce_op"], "mixed"),
        forward=lambda a: f"all_reduce(x, {a['reduce_op']})",
        backward=lambda a: {
            "sum": "all_reduce(dL/dy)", "avg": "all_reduce(dL/dy) / n",
            "max": "all_reduce(dL/dy) on the max's rank", "min": "all_reduce(dL/dy) on the min's rank",
            "product": "all_reduce(dL/dy) x others' product"}[a["reduce_op"]],
        title=lambda a, n: {
            "sum": "all_reduce (sum) forward: every rank gets the elementwise sum of all ranks' inputs",
            "avg": "all_reduce (avg) forward: every rank gets the elementwise mean of all ranks' inputs",
            "max": f"all_reduce (max) forward: every rank gets the elementwise max (here rank {n - 1}'s codes)",
            "min": "all_reduce (min) forward: every rank gets the elementwise min (here rank 0's codes)",
            "product": "all_reduce (product) forward: every rank gets the elementwise product",
        }[a["reduce_op"]] + "<br>backward: " + {
            "sum": "every rank's input grad is the sum of all ranks' incoming grads (an all-reduce)",
            "avg": "every rank's input grad is the mean of all ranks' incoming grads",
            "max": f"the summed grad goes only to the rank holding the max (rank {n - 1}); the others get 0",
            "min": "the summed grad goes only to the rank holding the min (rank 0); the others get 0",
            "product": "the summed grad times the product of the other ranks' inputs",
        }[a["reduce_op"]]),
    "all_gather": _Op(
        call=lambda comm, x, a: comm.all_gather(x, a["dim"]),
        args={"dim": -1},
        default_shape=lambda n, a: (2, 2),
        forward_kind=lambda a: "coded",
        backward_kind=lambda a: "sum",
        forward=lambda a: f"all_gather(x, dim={a['dim']})",
        backward=lambda a: "reduce_scatter(dL/dy)",
        title=lambda a, n: (
            f"all_gather forward: rank r's output = concat of every rank's input along dim {a['dim']}"
            "<br>backward (reduce-scatter): rank r's input grad = sum over ranks of chunk r of their "
            "incoming grads")),
    "reduce_scatter": _Op(
        call=lambda comm, x, a: comm.reduce_scatter(x, a["dim"], a["reduce_op"]),
        args={"dim": -1, "reduce_op": "sum"},
        default_shape=_split_shape(2),
        forward_kind=lambda a: {"sum": "sum", "avg": "avg", "max": "coded", "min": "coded"}.get(a["reduce_op"], "mixed"),
        backward_kind=lambda a: {"sum": "coded", "avg": "scaled", "max": "coded_or_zero",
                                 "min": "coded_or_zero"}.get(a["reduce_op"], "mixed"),
        forward=lambda a: f"reduce_scatter(x, dim={a['dim']}, {a['reduce_op']})",
        backward=lambda a: "all_gather(dL/dy)" + ("" if a["reduce_op"] == "sum" else " x factor"),
        title=lambda a, n: (
            f"reduce_scatter forward: reduce ({a['reduce_op']}) over ranks, then rank r keeps chunk r along "
            f"dim {a['dim']}<br>backward (all-gather): rank r's input grad = concat of every rank's "
            "incoming grad" + ("" if a["reduce_op"] == "sum" else f", times the {a['reduce_op']} factor"))),
    "slice": _Op(
        call=lambda comm, x, a: comm.slice(x, a["dim"], scale_grad=a["scale_grad"]),
        args={"dim": -1, "scale_grad": False},
        default_shape=_split_shape(2),
        forward_kind=lambda a: "coded",
        backward_kind=lambda a: "scaled" if a["scale_grad"] else "coded",
        forward=lambda a: f"slice(x, dim={a['dim']})",
        backward=lambda a: "all_gather(dL/dy)" + (" / n" if a["scale_grad"] else ""),
        title=lambda a, n: (
            f"slice forward: every rank holds the same x and keeps chunk r along dim {a['dim']} "
            "(no communication)<br>backward (all-gather): rank r's input grad = concat of every rank's "
            "incoming grad" + (", divided by the world size" if a["scale_grad"] else "")),
        replicated=True),
    "all_to_all_4D": _Op(
        call=lambda comm, x, a: comm.all_to_all_4D(x, a["scatter_dim"], a["gather_dim"]),
        args={"scatter_dim": 2, "gather_dim": 1},
        default_shape=_ulysses_shape,
        forward_kind=lambda a: "coded",
        backward_kind=lambda a: "coded",
        forward=lambda a: f"all_to_all_4D(x, {a['scatter_dim']}, {a['gather_dim']})",
        backward=lambda a: f"all_to_all_4D(dL/dy, {a['gather_dim']}, {a['scatter_dim']})",
        title=lambda a, n: (
            ("all_to_all_4D forward (Ulysses): sequence shards (b, s/P, h, d) -> head shards (b, s, h/P, d)"
             "<br>rank r sends its head chunk j to rank j, which stacks what it gets along the sequence"
             if a["scatter_dim"] == 2 else
             "all_to_all_4D forward (Ulysses, inverse): head shards (b, s, h/P, d) -> sequence shards "
             "(b, s/P, h, d)<br>rank r sends its sequence chunk j to rank j, which stacks what it gets "
             "along the heads")
            + "<br>backward: the all-to-all with the dims swapped sends every gradient element back to "
              "where its input sat"),
        dim_names=_ULYSSES_DIMS, label=_token_head_label),
    "gather": _Op(
        call=lambda comm, x, a: comm.gather(x, a["dst"], a["dim"]),
        args={"dst": 0, "dim": -1},
        default_shape=lambda n, a: (2, 2),
        forward_kind=lambda a: "coded",
        backward_kind=None,
        forward=lambda a: f"gather(x, dst={a['dst']}, dim={a['dim']})",
        backward=lambda a: "",
        title=lambda a, n: (
            f"gather forward: rank {a['dst']} gets the concat of every rank's input along dim {a['dim']}; "
            "the other ranks get None<br>no backward: the other ranks hold no output to call backward on "
            "(use all_gather when gradients must flow)")),
    "broadcast": _Op(
        call=lambda comm, x, a: comm.broadcast(x, a["src"]),
        args={"src": 0},
        default_shape=lambda n, a: (2, 3),
        forward_kind=lambda a: "coded",
        backward_kind=lambda a: "sum",
        forward=lambda a: f"broadcast(x, src={a['src']})",
        backward=lambda a: f"sum of dL/dy onto rank {a['src']}",
        title=lambda a, n: (
            f"broadcast forward: every rank gets rank {a['src']}'s input<br>backward: the incoming grads "
            f"are summed onto rank {a['src']}; the other ranks' inputs get zero grad")),
    "send_recv": _Op(
        call=lambda comm, x, a: ring_exchange(comm, x),
        args={},
        default_shape=lambda n, a: (2, 3),
        forward_kind=lambda a: "coded",
        backward_kind=None,
        forward=lambda a: "recv(send(x) from rank r-1)",
        backward=lambda a: "",
        title=lambda a, n: (
            "send/recv forward: each rank sends its tensor to the next rank and receives the previous "
            "rank's<br>no backward: send and recv are not differentiable; pipeline code passes gradients "
            "by hand")),
    "copy_to_group": _Op(
        call=lambda comm, x, a: comm.copy_to_group(x),
        args={},
        default_shape=lambda n, a: (2, 3),
        forward_kind=lambda a: "coded",
        backward_kind=lambda a: "sum",
        forward=lambda a: "copy_to_group(x)",
        backward=lambda a: "all_reduce(dL/dy)",
        title=lambda a, n: (
            "copy_to_group (Megatron's f) forward: identity, each rank keeps its input<br>backward: "
            "all-reduce (sum) of the incoming grads")),
    "reduce_from_group": _Op(
        call=lambda comm, x, a: comm.reduce_from_group(x),
        args={},
        default_shape=lambda n, a: (2, 3),
        forward_kind=lambda a: "sum",
        backward_kind=lambda a: "coded",
        forward=lambda a: "reduce_from_group(x)",
        backward=lambda a: "dL/dy (identity)",
        title=lambda a, n: (
            "reduce_from_group (Megatron's g) forward: all-reduce (sum)<br>backward: identity, each "
            "rank's incoming grad passes through unchanged")),
}


@dataclass
class CollectiveRun:
    """What :func:`run_collective` ran and got, per rank.

    ``outputs[r]`` is ``None`` where the op gives rank ``r`` nothing (gather);
    ``grad_outputs`` and ``grad_inputs`` are ``None`` for ops without backward.
    """

    op: str
    args: dict
    world_size: int
    shape: tuple[int, ...]
    base: int
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor | None]
    grad_outputs: list[torch.Tensor] | None
    grad_inputs: list[torch.Tensor] | None
    trace: Any = field(repr=False, default=None)


def _resolve(function: str, op: str, op_args: dict) -> tuple[str, _Op, dict]:
    name = canonical_op(op, OPS, where=function)   # "all_to_all" is not all_to_all_4D: the error says so
    spec = OPS[name]
    if "op" in op_args:  # the communicator's name for the reduction
        if "reduce_op" in op_args:
            raise ValueError(f"{function}: give the reduction as reduce_op= or op=, not both")
        op_args = {("reduce_op" if k == "op" else k): v for k, v in op_args.items()}
    unknown = sorted(set(op_args) - set(spec.args))
    if unknown:
        takes = ", ".join(spec.args) or "no arguments"
        raise ValueError(f"{function}: {name} takes {takes}; got {', '.join(f'{k}={op_args[k]!r}' for k in unknown)}")
    args = {**spec.args, **op_args}
    if "reduce_op" in args:
        try:
            args["reduce_op"] = reduce_op_name(args["reduce_op"])
        except ValueError as error:
            raise ValueError(f"{function}: {name} reduce_op={args['reduce_op']!r}: {error}") from None
    return name, spec, args


def _program(comm, spec: _Op, args: dict, inputs: list[torch.Tensor], base: int, backward: bool):
    x = inputs[comm.rank].clone().requires_grad_(backward)
    y = spec.call(comm, x, args)
    if not backward or y is None:
        return (y.detach() if y is not None else None), None, None
    grad_output = provenance_tensor(comm.rank, y.shape, base=base)
    y.backward(grad_output)
    return y.detach(), grad_output, x.grad


def run_collective(op: str, /, world_size: int = 4, shape: Sequence[int] | None = None,
                   **op_args: Any) -> CollectiveRun:
    """Run ``op`` on ``world_size`` virtual ranks with provenance-coded inputs and incoming grads.

    ``shape`` is each rank's input shape (default: a small shape that suits the
    op and the world size). ``op_args`` are the op's arguments (``dim``,
    ``reduce_op`` (or ``op``), ``scatter_dim``/``gather_dim``, ``dst``, ``src``,
    ``scale_grad``).
    """
    return _run("run_collective", op, world_size, shape, op_args)


def _run(function: str, op: str, world_size: int, shape: Sequence[int] | None, op_args: dict,
         backward: bool = True) -> CollectiveRun:
    name, spec, args = _resolve(function, op, op_args)
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"{function}: world_size={world_size!r} must be a positive int")
    if name == "send_recv" and world_size < 2:
        raise ValueError(f"{function}: send_recv needs world_size >= 2, got world_size={world_size}")
    if shape is None:
        shape = spec.default_shape(world_size, args)
    if not isinstance(shape, Sequence) or not shape or not all(
            isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape):
        raise ValueError(f"{function}: shape={shape!r} must be a non-empty sequence of positive ints")
    shape = tuple(shape)
    numel = math.prod(shape)
    backward = backward and spec.backward_kind is not None
    # codes must tell every element of every coded tensor apart: the incoming grad of a gathered
    # output has n x numel elements; without a backward the inputs' numel suffices (labels 10r + i)
    base = provenance_base(numel * world_size if backward else numel)
    inputs = [provenance_tensor(0 if spec.replicated else rank, shape, base=base) for rank in range(world_size)]
    world = World(world_size)
    try:
        results = world.run(_program, spec, args, inputs, base, backward)
    except Exception as error:  # a bad dim or an indivisible shape: say which call of ours it was
        cause = error.__cause__ if error.__cause__ is not None else error
        if not isinstance(cause, ValueError):
            raise
        raise ValueError(f"{function}: {name} with shape={shape}, world_size={world_size}, "
                         f"{', '.join(f'{k}={v!r}' for k, v in args.items())} failed: {cause}") from error
    outputs = [result[0] for result in results]
    has_backward = backward
    return CollectiveRun(
        op=name, args=args, world_size=world_size, shape=shape, base=base, inputs=inputs, outputs=outputs,
        grad_outputs=[result[1] for result in results] if has_backward else None,
        grad_inputs=[result[2] for result in results] if has_backward else None, trace=world.trace)


def collective_figure(op: str, /, world_size: int = 4, shape: Sequence[int] | None = None, *,
                      show_values: bool | None = None, backward: bool = True, **op_args: Any) -> go.Figure:
    """Forward and backward of one collective on every rank, each element coloured by its source rank.

    One row per rank; columns, left to right: the input ``x``, the output
    ``y``, the incoming gradient ``dL/dy`` (coded: rank ``r``'s holds
    ``r * base + position``) and the resulting input gradient ``dL/dx``. Ops
    without a backward (``gather``, ``send_recv``) show the forward only, with
    a note in the title. Values that only moved are coloured by the rank they
    came from and hover names their original position; a value that combines
    ranks (a sum, a mean) is neutral and its cell names the ranks (``Σ0-3``).
    Numbers are drawn at 13 px or more, or only on hover when cells are too
    small; a figure taller than a screen puts the ranks side by side.
    ``all_to_all_4D`` cells are labelled by token and head (``t5 h2``).

    ``op`` is one of ``OPS``: ``all_reduce`` (``reduce_op=``), ``all_gather``
    (``dim=``), ``reduce_scatter`` (``dim=``, ``reduce_op=``), ``slice`` (``dim=``,
    ``scale_grad=``), ``all_to_all_4D`` (``scatter_dim=``, ``gather_dim=``;
    the Ulysses sequence <-> head re-sharding), ``gather`` (``dst=``,
    ``dim=``), ``broadcast`` (``src=``), ``send_recv``, ``copy_to_group``,
    ``reduce_from_group``. The reduction may also be given as ``op=``, the
    communicator's name for it: ``collective_figure("all_reduce", op="max")``.
    ``backward=False`` draws the forward columns only (before gradients are taught).
    """
    run = _run("collective_figure", op, world_size, shape, op_args, backward)
    return collective_run_figure(run, show_values=show_values, backward=backward)


def _panel(tensor: torch.Tensor | None, name: str, rank: int, kind: str, source_shape: tuple[int, ...],
           note: str = "", label: Callable[[int, tuple[int, ...]], str] | None = None) -> Panel:
    if kind not in _KINDS:
        raise ValueError(f"collective_figure: panel {name} on rank {rank} has kind={kind!r}, not one of {_KINDS}")
    if kind == "coded_or_zero":  # the gradient reached this rank unchanged, or not at all
        kind = "coded" if tensor is not None and bool(tensor.any()) else "sum"
    return Panel(tensor, name, rank, coded=kind == "coded", mixed=kind if kind != "coded" else "",
                 source_shape=source_shape, note=note, label=label)


def collective_run_figure(run: CollectiveRun, *, show_values: bool | None = None,
                          backward: bool = True) -> go.Figure:
    """The figure of :func:`collective_figure` for a :class:`CollectiveRun` already made."""
    spec, args = OPS[run.op], run.args
    with_grads = backward and run.grad_outputs is not None
    out_shape = next((tuple(y.shape) for y in run.outputs if y is not None), run.shape)
    columns = ["x<br>(input)", f"y =<br>{spec.forward(args)}"]
    forward_label = grad_label = None
    if spec.label is not None:     # values from the input's layout; gradients from the output's (dims swapped)
        forward_label = spec.label(args["scatter_dim"], run.shape)
        grad_label = spec.label(args["gather_dim"], out_shape)
    rows = []
    for rank in range(run.world_size):
        row = [_panel(run.inputs[rank], "x", rank, "coded", run.shape, label=forward_label),
               _panel(run.outputs[rank], "y", rank, spec.forward_kind(args), run.shape,
                      note=f"None: only rank {args.get('dst')} receives", label=forward_label)]
        if with_grads:
            row += [_panel(run.grad_outputs[rank], "dL/dy", rank, "coded", out_shape, label=grad_label),
                    _panel(run.grad_inputs[rank], "dL/dx", rank, spec.backward_kind(args), out_shape,
                           label=grad_label)]
        rows.append(row)
    if with_grads:
        columns += ["dL/dy<br>(incoming grad, coded)", f"dL/dx =<br>{spec.backward(args)}"]
    layout = grid_layout(run.shape, spec.dim_names)
    subtitle = f"{run.world_size} ranks, input shape {run.shape} per rank"
    if len(run.shape) != 2:
        subtitle += f"; grids: {layout}"
    title = spec.title(args, run.world_size)
    if not backward:
        title = title.split("<br>backward")[0].split("<br>no backward")[0]
    title += f"<br><sup>{subtitle}</sup>"
    rank_names = [f"rank {rank}" for rank in range(run.world_size)]
    fig = draw_panels(rows, world_size=run.world_size, base=run.base, title=title, column_titles=columns,
                      row_titles=rank_names, show_values=show_values, function="collective_figure")
    if fig.layout.height <= SCREEN_HEIGHT_PX:
        return fig
    # too tall for a screen (tall outputs, many ranks): ranks side by side, stages one under another
    stages = [list(stage) for stage in zip(*rows)]
    across = draw_panels(stages, world_size=run.world_size, base=run.base, title=title, column_titles=rank_names,
                         row_titles=[column.split("<br>")[0].rstrip(" =") for column in columns], show_values=show_values,
                         function="collective_figure")
    return across if across.layout.height < fig.layout.height else fig
