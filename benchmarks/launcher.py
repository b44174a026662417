"""What running on real processes costs: a Cluster's first run before and after the forkserver, a
further run, and the checked mode, measured side by side in one run (gloo, 2 and 4 ranks).

Start-up (each case in a fresh Python process, so no case inherits another's warm forkserver):

* ``spawn: first run``       - the old way: ``Cluster(n, start_method="spawn")`` and its first
  ``run``; every worker is a fresh interpreter that imports torch;
* ``forkserver: first run``  - the new way, in a fresh process: starting the forkserver (one
  import of torch) is part of it;
* ``prestarted: first run``  - the new way as in a notebook: ``import real`` starts the
  forkserver in the background (:func:`real.prestart`), the first Cluster comes 5 s later;
* ``forkserver: next Cluster`` - a second Cluster's first run in that process (forkserver warm:
  what every Cluster after the first pays, e.g. after a close or a failed run);
* ``Cluster.run``            - a further run on a warm Cluster (median).

Checked mode: one run of ``--calls`` 1 KiB all-reduces, timed inside the ranks (the slowest
rank's mean per call), on a checked and an unchecked Cluster whose rounds alternate; workers
use one thread each. The machine is shared and noisy: only ratios measured in one run mean much.

    python benchmarks/launcher.py                 # the tables
    python benchmarks/launcher.py --rounds 3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

import real

_STARTUP = """
import json, statistics, sys, time
import torch
torch.set_num_threads(1)
import real
world_size, method = int(sys.argv[1]), sys.argv[2]
if method == "prestart":          # what `import real` does in a notebook, then a pause to read a cell
    real.prestart()
    time.sleep(5)
    method = "forkserver"
program = lambda comm: comm.all_reduce(torch.ones(4) * comm.rank)
times = {}
start = time.perf_counter()
with real.Cluster(world_size, backend="gloo", start_method=method, threads=1) as cluster:
    cluster.run(program)
    times["first"] = time.perf_counter() - start
    further = []
    for _ in range(10):
        start = time.perf_counter()
        cluster.run(program)
        further.append(time.perf_counter() - start)
    times["further"] = statistics.median(further)
start = time.perf_counter()
with real.Cluster(world_size, backend="gloo", start_method=method, threads=1) as cluster:
    cluster.run(program)
    times["next"] = time.perf_counter() - start
print(json.dumps(times))
"""


def time_startup(world_size: int, method: str) -> dict[str, float]:
    """First run, further run and next Cluster's first run, in a fresh Python process."""
    done = subprocess.run([sys.executable, "-c", _STARTUP, str(world_size), method], check=True,
                          capture_output=True, text=True, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _all_reduces(comm, calls: int) -> float:
    """Mean seconds per 1 KiB all-reduce on this rank (after a short warm-up)."""
    x = torch.ones(256)                          # 256 float32 = 1 KiB
    for _ in range(10):
        comm.all_reduce(x)
    start = time.perf_counter()
    for _ in range(calls):
        comm.all_reduce(x)
    return (time.perf_counter() - start) / calls


def time_checked(world_size: int, calls: int, rounds: int) -> dict[str, float]:
    """Median over rounds of the slowest rank's mean per call, checked and unchecked, alternating."""
    samples: dict[str, list[float]] = {"unchecked": [], "checked": []}
    with real.Cluster(world_size, backend="gloo", threads=1, checked=False, trace=False) as plain, \
            real.Cluster(world_size, backend="gloo", threads=1, checked=True, trace=False) as checked:
        for _ in range(rounds):
            for name, cluster in (("unchecked", plain), ("checked", checked)):
                samples[name].append(max(cluster.run(_all_reduces, calls)))
    return {name: statistics.median(values) for name, values in samples.items()}


def _shown(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of the checked-mode table")
    parser.add_argument("--calls", type=int, default=200, help="all-reduces per round and rank")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows = []
    for world_size in (2, 4):
        old = time_startup(world_size, "spawn")
        new = time_startup(world_size, "forkserver")
        prestarted = time_startup(world_size, "prestart")
        rows += [
            {"ranks": world_size, "case": "spawn: first run", "seconds": old["first"]},
            {"ranks": world_size, "case": "forkserver: first run", "seconds": new["first"]},
            {"ranks": world_size, "case": "prestarted: first run", "seconds": prestarted["first"]},
            {"ranks": world_size, "case": "forkserver: next Cluster", "seconds": new["next"]},
            {"ranks": world_size, "case": "spawn: Cluster.run", "seconds": old["further"]},
            {"ranks": world_size, "case": "forkserver: Cluster.run", "seconds": new["further"]},
        ]
        for row in rows[-6:]:
            row["vs_spawn_first"] = row["seconds"] / old["first"]
    print(f"{'ranks':>5}  {'start-up case':<28}{'time':>10}{'x spawn first run':>20}")
    for row in rows:
        print(f"{row['ranks']:>5}  {row['case']:<28}{_shown(row['seconds']):>10}{row['vs_spawn_first']:>20.3g}")

    checked_rows = []
    for world_size in (2, 4):
        times = time_checked(world_size, args.calls, args.rounds)
        checked_rows.append({"ranks": world_size, **times, "ratio": times["checked"] / times["unchecked"]})
    print(f"\n{'ranks':>5}  {'1 KiB all_reduce':<18}{'unchecked':>12}{'checked':>12}{'checked/unchecked':>20}")
    for row in checked_rows:
        print(f"{row['ranks']:>5}  {'per call':<18}{_shown(row['unchecked']):>12}{_shown(row['checked']):>12}"
              f"{row['ratio']:>20.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"startup": rows, "checked": checked_rows}, f, indent=2)


if __name__ == "__main__":
    main()
