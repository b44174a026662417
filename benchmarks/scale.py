"""Shape-only virtual ranks at cluster scale: wall time and peak memory of one process.

Each measurement runs in its own fresh Python process with ``torch.set_num_threads(1)``:

* ``3d``: one training step of a 3-D parallel transformer (:mod:`simcomm.planning.cluster_step`,
  tensor x pipeline x data = 8 x 4 x 32 = 1024 ranks by default, GPT-2-medium
  blocks: hidden 1024, 16 heads, seq 1024, bf16) on ``World(1024, tensors="shape")``:
  wall and CPU time (``time.process_time``) of ``World.run``, the process's peak resident
  memory (``ru_maxrss``) and the share of fake dispatches the ranks' shared cache answered;
* ``dp``: 4096 ranks of a data-parallel step (a linear layer's forward and backward,
  then an all-reduce of its gradient), shape-only: the same figures;
* ``ratio``: the same 3-D program at 16 ranks (2 x 2 x 4; a small and a medium
  block, fp32) run shape-only and real-valued, each side in its own process
  and timed on its second run (the first warms imports and torch's caches),
  both allocating their outputs: the ratio of the median times. Shape-only
  costs per op, real-valued per flop: small blocks favour real values.

    python benchmarks/scale.py                         # all three (a few minutes on 2 cores)
    python benchmarks/scale.py --only ratio --rounds 5
    python benchmarks/scale.py --only 3d dp --before ../main   # beside another checkout, same run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = """
import json, resource, sys, time, torch
torch.set_num_threads(1)
import simcomm
from simcomm.planning import cluster_step as t3d
from simcomm.parallel.mesh import Layout
kind, ranks, tensors, layout, block, warm = json.loads(sys.argv[1])

def dp_step(comm, hidden):
    weight = torch.randn(hidden, hidden, requires_grad=True)
    x = torch.randn(8, hidden)
    (x @ weight.T).pow(2).mean().backward()
    return comm.all_reduce(weight.grad, "avg").shape

if "dtype" in block:
    block["dtype"] = getattr(torch, block["dtype"])
if kind == "dp":
    program, args = dp_step, (1024,)
else:
    program, args = t3d.step, (Layout(**layout), t3d.Block(**block))
world = simcomm.World(ranks, tensors=tensors)
if warm:                     # imports and torch's caches warmed by one run first
    world.run(program, *args)
start, cpu = time.perf_counter(), time.process_time()
world.run(program, *args)
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
from simcomm.sim.shape import dispatch_cache_info    # both caches, where the checkout has two
print(json.dumps({"seconds": seconds, "cpu": cpu, "events": len(world.trace), "hit_rate": dispatch_cache_info()["hit_rate"],
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

GPT2_MEDIUM = {"hidden": 1024, "heads": 16, "seq": 1024}
SMALL = {"hidden": 128, "heads": 4, "seq": 64, "dtype": "float32"}
MEDIUM = {"hidden": 512, "heads": 8, "seq": 512, "dtype": "float32"}


def measure(kind: str, ranks: int, tensors: str, layout: dict | None = None, block: dict | None = None,
            warm: bool = False, timeout: float = 900, checkout: str | None = None) -> dict:
    """One run in a fresh process (after a warm-up run of the same program if ``warm``):
    seconds, trace events and peak resident bytes. ``layout``: the sizes of the 3-D step's
    ``Layout`` by name (``{"tp": 2, "pp": 2, "dp": 4}``). ``checkout``: import simcomm from that
    folder (another checkout) instead of this one."""
    root = os.path.abspath(checkout or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _CHILD,
                          json.dumps([kind, ranks, tensors, layout or {"dp": ranks}, block or {}, warm])],
                         check=True, capture_output=True, text=True, timeout=timeout, cwd=root, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["3d", "dp", "ratio"], nargs="+", default=["3d", "dp", "ratio"])
    parser.add_argument("--layout", type=int, nargs=3, default=[8, 4, 32], metavar=("TP", "PP", "DP"))
    parser.add_argument("--dp-ranks", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the shape-only vs real ratio")
    parser.add_argument("--before", metavar="CHECKOUT",
                        help="also run 3d and dp with simcomm imported from this folder (the code before a change)")
    args = parser.parse_args(argv)
    out = sys.stdout.write
    sides = [("before", args.before), ("this", None)] if args.before else [("this", None)]
    out("code    measurement                                        ranks  seconds  CPU s  events  peak RSS  "
        "fake dispatch hits\n")
    cpu: dict[tuple[str, str], float] = {}
    if "3d" in args.only:
        tp, pp, dp = args.layout
        for side, checkout in sides:
            result = measure("3d", tp * pp * dp, "shape", {"tp": tp, "pp": pp, "dp": dp}, GPT2_MEDIUM,
                             checkout=checkout)
            cpu["3d", side] = result["cpu"]
            out(f"{side:6s}  3-D step {tp}x{pp}x{dp}, GPT-2-medium block, shape-only    {tp * pp * dp:5d}  "
                f"{result['seconds']:7.1f}  {result['cpu']:5.1f}  {result['events']:6d}  "
                f"{result['peak_rss'] / 2**30:.2f} GiB  {result['hit_rate']:.1%}\n")
    if "dp" in args.only:
        for side, checkout in sides:
            result = measure("dp", args.dp_ranks, "shape", checkout=checkout)
            cpu["dp", side] = result["cpu"]
            out(f"{side:6s}  DP all-reduce step (1024 x 1024 weight), shape-only  {args.dp_ranks:5d}  "
                f"{result['seconds']:7.1f}  {result['cpu']:5.1f}  {result['events']:6d}  "
                f"{result['peak_rss'] / 2**30:.2f} GiB  {result['hit_rate']:.1%}\n")
    for kind in ("3d", "dp"):
        if (kind, "before") in cpu and (kind, "this") in cpu:
            out(f"{kind}: CPU this / before = {cpu[kind, 'this'] / cpu[kind, 'before']:.2f}\n")
    if "ratio" in args.only:
        for name, block in (("hidden 128, seq 64", SMALL), ("hidden 512, seq 512", MEDIUM)):
            shape, real = [], []
            for _ in range(args.rounds):      # alternate the sides, each in a fresh process, warmed up
                layout = {"tp": 2, "pp": 2, "dp": 4}
                shape.append(measure("3d", 16, "shape", layout, block, warm=True)["seconds"])
                real.append(measure("3d", 16, "real", layout, block, warm=True)["seconds"])
            out(f"3-D step 2x2x4 ({name}, fp32): shape-only {statistics.median(shape):.3f} s, real-valued "
                f"{statistics.median(real):.3f} s (median of {args.rounds}, second run of each process); "
                f"shape-only / real = {statistics.median(shape) / statistics.median(real):.2f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
