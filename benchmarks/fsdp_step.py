"""One FSDP2 step on virtual ranks beside PyTorch's threaded process group, single-rank steps and FSDP2's own floor.

The step: ``fully_shard`` on each of 4 x ``Linear(1024)`` and on the root, one
forward and backward of a batch of 8 rows per rank, on 4 ranks. Sides, each in
a fresh process of its own with ``torch.set_num_threads(1)``, alternating round
by round; each figure is the minimum over rounds of (a run with K steps minus a
run with none) / K, so start-up, model building and ``fully_shard`` cancel out:

* ``virtual``  - the step on 4 virtual ranks (``World(4).run``, tracing on, as in a lesson);
* ``threaded`` - the same program on PyTorch's threaded process group, 4 rank threads;
* ``single``   - 4 plain steps of the per-rank batch on one device: no FSDP2, no
  communication (the issue's yardstick for wall time);
* ``floor``    - 4 steps of the same FSDP2 program on a world of ONE virtual rank: every
  hook, parameter swap and copy-in/copy-out of torch's FSDP2 runs, with collectives
  of one rank. Virtual ranks take turns on the CPU, so a 4-rank step can take no less
  wall time than this; ``floor_threaded`` is the same on the threaded group.

CPU time (``time.process_time``, all threads) and wall time are both printed, and
the ratios in one run.

    python benchmarks/fsdp_step.py                 # 3 rounds, 8 steps per run
    python benchmarks/fsdp_step.py --rounds 5 --steps 10 --json out.json
"""
from __future__ import annotations

import json
import sys

import steps as step_timing   # sibling modules: this file runs as a script
import threaded_pg

RANKS, HIDDEN, BATCH = 4, 1024, 8
SIDES = ("virtual", "threaded", "single", "floor", "floor_threaded")
LABELS = {"virtual": "virtual ranks (4)", "threaded": "threaded process group (4)",
          "single": f"{RANKS} single-rank steps, no FSDP2", "floor": f"FSDP2 on 1 virtual rank, {RANKS} steps",
          "floor_threaded": f"FSDP2 on 1 threaded rank, {RANKS} steps"}


def mlp():
    """The model of every side: 4 x ``Linear(HIDDEN)``, seeded."""
    import torch
    import torch.nn as nn
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(4)])


def fsdp_program(comm, steps: int) -> None:
    """``steps`` FSDP2 forward+backward steps of this rank's batch (the same program on every side)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    model = mlp()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    x = torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(steps):
        model(x).sum().backward()


_WORLDS: dict = {}


def world(world_size: int):
    """One ``simcomm.World`` per world size for the whole process (runs reuse it)."""
    import simcomm
    if world_size not in _WORLDS:
        _WORLDS[world_size] = simcomm.World(world_size)
    return _WORLDS[world_size]


def run_side(side: str, steps: int) -> None:
    """Run ``steps`` steps of ``side`` (a step of the 4-rank program, or its 4-step equivalent)."""
    if side == "virtual":
        world(RANKS).run(fsdp_program, steps)
    elif side == "threaded":
        threaded_pg.run(RANKS, fsdp_program, steps)
    elif side == "floor":
        world(1).run(fsdp_program, steps * RANKS)
    elif side == "floor_threaded":
        threaded_pg.run(1, fsdp_program, steps * RANKS)
    elif side == "single":
        import torch
        model = mlp()
        x = torch.randn(BATCH, HIDDEN, generator=torch.Generator().manual_seed(0))
        for _ in range(steps * RANKS):
            model(x).sum().backward()
    else:
        raise ValueError(f"unknown side {side!r}; use one of {list(SIDES)}")


def main(argv: list[str] | None = None) -> int:
    parsed = step_timing.command(argv, __doc__, SIDES, run_side, __file__)
    if parsed is None:
        return 0
    args, best = parsed
    print(f"FSDP2 forward+backward, 4 x Linear({HIDDEN}), batch {BATCH} per rank, {RANKS} ranks: ms per step "
          f"(min of {args.rounds} rounds, each side in a fresh process)")
    print(f"{'side':<40}{'cpu':>9}{'wall':>9}")
    for side in args.sides:
        print(f"{LABELS[side]:<40}{best[side]['cpu']:>9.1f}{best[side]['wall']:>9.1f}")
    ratios = [("virtual", "threaded", "cpu"), ("virtual", "threaded", "wall"), ("virtual", "single", "wall"),
              ("floor", "single", "wall"), ("virtual", "floor", "wall"), ("floor", "floor_threaded", "cpu")]
    print()
    for a, b, key in ratios:
        if a in best and b in best:
            print(f"{a}/{b} {key}: {best[a][key] / best[b][key]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
