"""Render the README's torch.distributed picture: the trace of FSDP2 on four virtual ranks.

    python docs/render_torch_distributed.py   # writes docs/torch_distributed_fsdp2.png

Uses :func:`render_gallery.render` (headless Chromium, nothing downloaded).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).parent))
from render_gallery import render  # noqa: E402

import simcomm  # noqa: E402
from simcomm.viz import timeline_figure  # noqa: E402


def program(comm):
    """The README's example."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    model(torch.randn(8, 16)).sum().backward()
    return dist.get_rank(), dist.get_backend()


def fsdp2_timeline():
    world = simcomm.World(4)
    world.run(program)      # the first run imports FSDP; the picture is of the second
    world.run(program)
    fig = timeline_figure(world.trace)
    fig.update_layout(width=fig.layout.width or 900, height=fig.layout.height or 360)
    return fig


if __name__ == "__main__":
    print(render({"torch_distributed_fsdp2.png": fsdp2_timeline}, Path(__file__).parent))
