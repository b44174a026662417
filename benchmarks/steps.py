"""Timing a side of a step benchmark in a fresh process of its own (``fsdp_step.py``, ``virtual_gpus.py``).

A side is timed by :func:`worker` in its own process, started by :func:`measure`:
``torch.set_num_threads(1)`` (and ``OMP_NUM_THREADS=1``), one warm-up step, then three pairs of
runs with ``steps`` steps and with none; the figure is the difference of the minima over
``steps``, so start-up and model building cancel out. CPU time (``time.process_time``, all
threads) and wall time both.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(run_side: Callable[[str, int], None], side: str, steps: int) -> None:
    """Print ``{"cpu": s, "wall": s}`` per step of ``run_side(side, n)``: a run of ``steps`` minus a run of none."""
    import warnings

    import torch
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    run_side(side, 1)                                   # warm-up: imports, first-call caches
    base, full = [], []
    for _ in range(3):
        for samples, count in ((base, 0), (full, steps)):
            cpu, wall = time.process_time(), time.perf_counter()
            run_side(side, count)
            samples.append((time.process_time() - cpu, time.perf_counter() - wall))
    print(json.dumps({"cpu": (min(c for c, _ in full) - min(c for c, _ in base)) / steps,
                      "wall": (min(w for _, w in full) - min(w for _, w in base)) / steps}))


def measure(script: str, side: str, steps: int) -> dict[str, float]:
    """Run ``script --worker side steps`` in a fresh process; its figures (seconds per step)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, os.path.abspath(script), "--worker", side, str(steps)],
                          env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the {side} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def best_of(script: str, sides, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Each side measured ``rounds`` times, alternating side by side; the minimum of each, in ms per step."""
    samples: dict[str, list] = {side: [] for side in sides}
    for _ in range(rounds):
        for side in sides:
            samples[side].append(measure(script, side, steps))
    return {side: {key: min(s[key] for s in runs) * 1e3 for key in ("cpu", "wall")} for side, runs in samples.items()}


def command(argv, doc: str, sides, run_side: Callable[[str, int], None], script: str):
    """The benchmark's command line (``--rounds``, ``--steps``, ``--sides``, ``--json``): ``None`` in a
    worker process (it has printed its figures), otherwise ``(args, best)`` with :func:`best_of`'s figures."""
    import argparse
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per timed run")
    parser.add_argument("--sides", nargs="+", default=list(sides), choices=sides)
    parser.add_argument("--json", help="also write the figures (ms per step) to this file")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(run_side, args.worker[0], int(args.worker[1]))
        return None
    return args, best_of(script, args.sides, args.rounds, args.steps)
