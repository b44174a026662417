"""Stress check of ``World.run(timeout=...)``: the run always ends with an error in time.

Eight ranks loop on ``comm.all_reduce`` forever; each run is stopped by
``timeout`` (0.05 s by default), over and over. The promise of ``World.run`` is
a :class:`~simcomm.errors.RunTimeoutError` within ``timeout`` +
``STOP_GRACE_S`` (1 s), always. The runs happen in a child process with
``torch.set_num_threads(1)``; a run that takes longer than ``--hang-s``
counts as a hang: the child prints every thread's stack (faulthandler) and
exits, and a fresh child goes on with the remaining runs.

Reported: hangs (must be 0), late runs (error later than timeout + 1 s, must
be 0), and the time from the timeout to the error (median, 99th percentile,
maximum), in wall time, with the CPU time of the child processes beside it.
A garbage collection of the whole heap stops every thread of the process
(hundreds of milliseconds on a loaded machine); for a late run the longest
collection during it is printed, so a late run can be told from a slow stop.

    python benchmarks/timeout_loop.py                 # 1000 runs
    python benchmarks/timeout_loop.py --runs 200 --world-size 16 --timeout 0.02
    python benchmarks/timeout_loop.py --checkout ../main --hang-s 10   # another checkout's simcomm
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import faulthandler, gc, json, sys, time
import torch
torch.set_num_threads(1)
from simcomm import World
from simcomm.errors import RunTimeoutError

runs, world_size, timeout, hang_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])

def program(comm):
    x = torch.ones(4)
    while True:                       # never ends by itself: only the timeout stops it
        x = comm.all_reduce(x) / comm.world_size

pauses = {"start": 0.0, "longest": 0.0}   # garbage collections stop every thread: reported apart

def on_gc(phase, info):
    now = time.monotonic()
    if phase == "start":
        pauses["start"] = now
    else:
        pauses["longest"] = max(pauses["longest"], now - pauses["start"])

gc.callbacks.append(on_gc)
world = World(world_size)
for index in range(runs):
    pauses["longest"] = 0.0
    faulthandler.dump_traceback_later(hang_s, exit=True)   # a hang: every stack, then exit 1
    start, cpu = time.monotonic(), time.process_time()
    try:
        world.run(program, timeout=timeout)
        outcome = "returned"
    except RunTimeoutError as error:
        outcome = "stuck" if "could not be stopped" in str(error) else "timeout"
    except BaseException as error:
        outcome = type(error).__name__
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps({"wall": time.monotonic() - start, "cpu": time.process_time() - cpu,
                      "outcome": outcome, "gc": pauses["longest"]}), flush=True)
"""


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=0.05)
    parser.add_argument("--hang-s", type=float, default=30.0,
                        help="a run longer than this is a hang (default 30 s)")
    parser.add_argument("--checkout", default=None,
                        help="the checkout whose simcomm runs (default: this one)")
    options = parser.parse_args()
    root = os.path.abspath(options.checkout or os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    records: list[dict] = []
    hangs = 0
    while len(records) + hangs < options.runs:
        left = options.runs - len(records) - hangs
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, str(left), str(options.world_size), str(options.timeout),
             str(options.hang_s)], capture_output=True, text=True, env=env, cwd=root)
        done = [json.loads(line) for line in child.stdout.splitlines() if line.startswith("{")]
        records.extend(done)
        if child.returncode != 0:
            hangs += 1
            print(f"hang at run {len(records) + hangs} (exit {child.returncode}); stacks:\n"
                  f"{child.stderr[-6000:]}", file=sys.stderr)
    late_s = [record["wall"] - options.timeout for record in records]
    outcomes: dict[str, int] = {}
    for record in records:
        outcomes[record["outcome"]] = outcomes.get(record["outcome"], 0) + 1
    grace = 1.0
    late = sum(1 for value in late_s if value > grace)
    late_gc = [record["gc"] for record in records if record["wall"] - options.timeout > grace]
    print(f"checkout {root}")
    print(f"runs {options.runs}  world_size {options.world_size}  timeout {options.timeout} s")
    print(f"hangs {hangs}  late (> timeout + {grace} s) {late}  outcomes {outcomes}")
    if late_gc:
        print(f"longest garbage collection (which stops every thread) in each late run, s: "
              f"{', '.join(f'{pause:.3f}' for pause in late_gc)}")
    if late_s:
        cpu = [record["cpu"] for record in records]
        print(f"timeout -> error, wall s: median {_percentile(late_s, 0.5):.4f}  "
              f"p99 {_percentile(late_s, 0.99):.4f}  max {max(late_s):.4f}")
        print(f"CPU s per run (caller's process): median {_percentile(cpu, 0.5):.4f}  "
              f"max {max(cpu):.4f}  (wall per run: median {_percentile([r['wall'] for r in records], 0.5):.4f})")
    sys.exit(1 if hangs or late else 0)


if __name__ == "__main__":
    main()
