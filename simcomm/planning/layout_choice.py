"""Choosing a 3-D layout: memory per rank and modelled step time for each ``Layout(pp=, dp=, tp=)``.

:func:`measure_layout` runs one training step of the transformer block
(:func:`simcomm.models.transformer.block_step`) on virtual ranks with memory
tracking, checks its loss and gradients against the single-device block, and
reads from that one run

* the peak bytes any rank held (``simcomm.memory``: parameters, activations,
  gradients, received buffers; the program's arguments are not counted), and
* the modelled step time on each topology: the trace's calls and declared
  compute laid out by :func:`simcomm.model.cost.modelled_timeline`, until the last
  rank finishes.

Two topologies: :data:`NVLINK_NODE` (one H100 NVSwitch node: every group
inside NVLink) and :data:`IB_CLUSTER` (the H100 NDR cluster with the 8 ranks
spread 2 per node, one NIC each: a group of ranks ``2i, 2i+1`` stays inside a
node, anything larger crosses InfiniBand). The fastest layout that fits a memory
limit is :func:`simcomm.planning.planner.fastest_fitting` of the rows, with a
topology name as the time (``fastest_fitting(rows, limit, "NVLink node")``).
"""
from __future__ import annotations

import dataclasses

import torch

from ..model import cost
from ..model.topology import Topology, get_topology
from ..models.transformer import assemble_grads, block_step, layouts, loss
from ..parallel.mesh import Layout
from ..sim.world import World

__all__ = ["NVLINK_NODE", "IB_CLUSTER", "TOPOLOGIES", "measure_layout", "layout_table"]

#: one H100 NVSwitch node: every group inside NVLink
NVLINK_NODE: Topology = get_topology("h100-nvswitch")
#: the H100 NDR cluster with the ranks spread 2 per node, one NIC each
IB_CLUSTER: Topology = dataclasses.replace(
    get_topology("h100-ndr-cluster"), name="h100-ndr-2-per-node", gpus_per_node=2, nics_per_node=2, nodes=64,
    reference=None)
#: display name -> topology, in table order
TOPOLOGIES: dict[str, Topology] = {"NVLink node": NVLINK_NODE, "InfiniBand cluster": IB_CLUSTER}


def _modelled_end(trace, topology: Topology | str) -> float:
    """Seconds until the last rank's last call ends on the modelled timeline of ``trace``."""
    timeline = cost.modelled_timeline(trace, topology)
    return max(summary.end for summary in timeline.ranks.values())


def _max_error(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    return max((got[name] - expected[name]).abs().max().item() for name in expected)


def measure_layout(x: torch.Tensor, weights: torch.Tensor, params: dict[str, torch.Tensor], heads: int,
                   layout: Layout, *, atol: float = 1e-9) -> dict:
    """One step of ``layout`` (a :class:`simcomm.parallel.mesh.Layout`) on virtual ranks: checked, with
    memory and modelled times.

    Returns ``{"layout", "tp", "dp", "pp", "peak_bytes", "<topology name>" (seconds) ...,
    "max_error", "trace"}``. Raises ``AssertionError`` when the loss or a
    gradient differs from the single-device block by more than ``atol``.
    """
    if not isinstance(layout, Layout):
        raise TypeError(f"measure_layout: layout={layout!r} must be a simcomm.parallel.mesh.Layout with its "
                        "sizes by name, e.g. Layout(pp=2, dp=2, tp=2)")
    world = World(layout.world_size, memory=True)
    outs = world.run(block_step, x, weights, params, heads, layout)
    leaves = {name: value.detach().clone().requires_grad_() for name, value in params.items()}
    expected = loss(x, weights, leaves, heads)
    expected.backward()
    error = max(_max_error(assemble_grads(outs, layout), {k: v.grad for k, v in leaves.items()}),
                abs(sum(o["loss"] for o in outs).item() - expected.item()))
    if not error <= atol:
        raise AssertionError(f"measure_layout: layout {layout!r} differs from the single-device block "
                             f"by {error:.3g} (tolerance {atol:g})")
    row = {"layout": layout, "tp": layout.tp, "dp": layout.dp, "pp": layout.pp,
           "peak_bytes": max(world.memory.peak)}
    for name, topology in TOPOLOGIES.items():
        row[name] = _modelled_end(world.trace, topology)
    row["max_error"] = error
    row["trace"] = world.trace
    return row


def layout_table(x: torch.Tensor, weights: torch.Tensor, params: dict[str, torch.Tensor], heads: int,
                 world_size: int = 8) -> list[dict]:
    """:func:`measure_layout` for every layout of ``world_size`` ranks that fits the block's sizes."""
    batch, seq, _ = x.shape
    ffn = params["w1"].shape[0]
    fitting = [lay for lay in layouts(world_size)
               if batch % lay.dp == 0 and seq % lay.tp == 0 and heads % lay.tp == 0 and ffn % lay.tp == 0]
    return [measure_layout(x, weights, params, heads, lay) for lay in fitting]
