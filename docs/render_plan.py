"""Render the README's "Plan a cluster" figure to ``docs/plan_a_cluster.png``.

    python docs/render_plan.py            # runs the 1024-rank shape-only example (about a minute)
    python docs/render_plan.py --out /tmp

Runs the README's example (a 3-D parallel GPT-2-medium step on 1024
shape-only ranks), draws :func:`simcomm.viz.cluster_plan.plan_figure` and
screenshots it with headless Chromium as ``docs/render_gallery.py`` does.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from render_gallery import render

import simcomm
from simcomm.planning import cluster_step as t3d
from simcomm.parallel.mesh import Layout
from simcomm.viz.cluster_plan import cluster, link_table, plan_figure


def plan():
    layout = Layout(pp=4, dp=32, tp=8)                            # 1024 ranks
    world = simcomm.World(layout.world_size, tensors="shape")     # fake tensors: shapes, no data
    world.run(t3d.step, layout, t3d.Block(layers=2, micro_batches=2))  # GPT-2-medium blocks, one step
    topology = cluster("h100-ndr-cluster", layout.world_size)     # the preset, grown to 128 nodes
    print(link_table(world.trace, topology))
    return plan_figure(world.trace, topology)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = parser.parse_args()
    for path in render({"plan_a_cluster.png": plan}, args.out):
        print(f"{path}  {path.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
