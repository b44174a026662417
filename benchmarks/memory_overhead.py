"""What memory tracking costs: a ZeRO training step on virtual ranks, tracked vs not.

Each side runs in its own fresh Python process with ``torch.set_num_threads(1)``:
``World(ranks, memory=False)`` and ``World(ranks, memory=True)`` run the same
``simcomm.parallel.zero.train`` program (a small MLP, Adam, labels and marks called in
both). Rounds alternate the two sides; the table gives the median seconds per
training step and the ratio tracked / untracked.

    python benchmarks/memory_overhead.py                  # stage 0 and 3, 4 ranks
    python benchmarks/memory_overhead.py --stages 0 1 2 3 --ranks 8 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

_CHILD = """
import json, sys, time, torch
torch.set_num_threads(1)
import simcomm
from simcomm.parallel import zero
stage, ranks, steps, sizes, memory = json.loads(sys.argv[1])
mlp = zero.MLP(tuple(sizes))
world = simcomm.World(ranks, memory=memory)
world.run(zero.train, stage, mlp, steps=1, batch_size=8 * ranks)         # warm-up
start = time.perf_counter()
world.run(zero.train, stage, mlp, steps=steps, batch_size=8 * ranks)
print(json.dumps((time.perf_counter() - start) / steps))
"""


def time_side(stage: int, ranks: int, steps: int, sizes: list[int], memory: bool) -> float:
    """Seconds per training step in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([stage, ranks, steps, sizes, memory])],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 3])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 256, 16])
    args = parser.parse_args(argv)
    rows = []
    for stage in args.stages:
        off, on = [], []
        for _ in range(args.rounds):
            off.append(time_side(stage, args.ranks, args.steps, args.sizes, False))
            on.append(time_side(stage, args.ranks, args.steps, args.sizes, True))
        rows.append((stage, statistics.median(off), statistics.median(on)))
    sys.stdout.write(f"ZeRO step, MLP {args.sizes}, {args.ranks} ranks, median of {args.rounds} rounds "
                     f"x {args.steps} steps, each side in its own process, 1 thread\n")
    sys.stdout.write(f"{'stage':>5}  {'untracked ms':>12}  {'tracked ms':>10}  {'ratio':>5}\n")
    for stage, off, on in rows:
        sys.stdout.write(f"{stage:>5}  {off * 1e3:>12.2f}  {on * 1e3:>10.2f}  {on / off:>5.2f}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
