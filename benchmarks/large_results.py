"""What bringing large results back from real workers costs: time and the parent's peak memory.

Each case runs in its own fresh Python process with ``torch.set_num_threads(1)``:

* ``in process``    - the reference: the same program computed for every rank in one process,
  no workers (what the results cost to make, at memory speed);
* ``Cluster.run``   - a warm gloo :class:`real.Cluster` whose every rank returns a float32
  tensor of the given size (``2 x 384 MiB``: two ranks, 384 MiB each).

For each: wall time and CPU time (``time.process_time``, of the measuring process; the workers'
CPU time is theirs) of the call, and how far the process's peak resident memory rose during it
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``; the current RSS from psutil too when it is
installed). Every result is checked against the values the program wrote. The ratio column is
``Cluster.run / in process``. The 2 GiB case is skipped when the machine's available memory is
below what it needs (about four copies of the results).

    python benchmarks/large_results.py                      # 2 x 384 MiB and 2 x 2 GiB
    python benchmarks/large_results.py --sizes 64 384 --json out.json

Numbers, one run (``--baseline``: the code before results moved to shared memory, exported with
``git archive 1cb0abf``), a shared 2-core machine with 24 GiB under a load average of 7-14, so
wall times are noisy; parent CPU and peak memory are not:

================  ===========  ========  ========  ==============  ============
results           case         wall      CPU       peak RSS rise   x in process
================  ===========  ========  ========  ==============  ============
2 x 384 MiB       in process     1.06 s    0.49 s        867 MiB   1
2 x 384 MiB       Cluster.run    4.33 s    0.08 s        867 MiB   4.1
2 x 384 MiB       before        18.34 s    3.12 s       1925 MiB   17.4
2 x 2 GiB         in process     7.07 s    2.44 s       4611 MiB   1
2 x 2 GiB         Cluster.run   20.99 s    0.35 s       4611 MiB   2.97
2 x 2 GiB         before        skipped (needs about 25 GiB; the issue measured 110 s and
                                 a 10.5 GiB peak rise)
================  ===========  ========  ========  ==============  ============

The parent now holds one copy of the results (the same peak as computing them in process)
instead of 2.5, and spends almost no CPU on them; what remains of the wall time is the
workers making the tensors and copying them once into shared memory. In a quiet moment a warm
Cluster made and returned 2 x 384 MiB in 0.66 s, of which 0.24 s was making the tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_MIB = 1 << 20

_CASE = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(1)
try:
    import psutil
except ImportError:
    psutil = None
mode, world_size, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
numel = mib * (1 << 20) // 4

def program(comm, numel):
    return torch.full((numel,), float(comm.rank + 1))

class Rank:                       # what a program sees of its communicator here: its rank
    def __init__(self, rank):
        self.rank = rank

def peak_kib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

def rss_mib():
    return psutil.Process().memory_info().rss / (1 << 20) if psutil is not None else None

if mode == "cluster":
    import real
    cluster = real.Cluster(world_size, backend="gloo", threads=1, timeout=1800)
    cluster.run(program, 1)                      # workers up, everything imported
else:
    program(Rank(0), 1)
before_peak, before_rss = peak_kib(), rss_mib()
wall, cpu = time.perf_counter(), time.process_time()
if mode == "cluster":
    outs = cluster.run(program, numel)
else:
    outs = [program(Rank(rank), numel) for rank in range(world_size)]
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
after_rss = rss_mib()
for rank, out in enumerate(outs):                # the values came back, every element
    assert out.shape == (numel,) and bool((out == rank + 1).all()), f"rank {rank}: wrong result"
peak_rise_mib = (peak_kib() - before_peak) / 1024
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "peak_rise_mib": peak_rise_mib,
                  "rss_rise_mib": None if after_rss is None else after_rss - before_rss,
                  "real": sys.modules["real"].__file__ if "real" in sys.modules else None}))
if mode == "cluster":
    del outs
    cluster.close()
"""


def available_mib() -> float:
    """MemAvailable of /proc/meminfo (Linux), in MiB; infinity where it cannot be read."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")


def measure(mode: str, world_size: int, mib: int, code: str | None = None) -> dict[str, float]:
    """One case in a fresh Python process (importing ``real`` from the checkout ``code`` if given)."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = code + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", _CASE, mode, str(world_size), str(mib)], check=True,
                          capture_output=True, text=True, timeout=1800, env=env,
                          cwd=code)            # `python -c` puts the working folder first on sys.path
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[384, 2048], help="MiB per rank")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--copies", type=float, default=4.0,
                        help="copies of all results the machine must have free to run a size")
    parser.add_argument("--baseline", metavar="CHECKOUT",
                        help="also time Cluster.run with the real package of another checkout (e.g. "
                             "`git archive <commit> | tar -x -C DIR`), as the 'before' row")
    parser.add_argument("--baseline-copies", type=float, default=6.0,
                        help="copies of all results the machine must have free to run the baseline")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    rows = []
    for mib in args.sizes:
        label = f"{args.world_size} x {mib} MiB"
        need = args.copies * args.world_size * mib + 1024
        if available_mib() < need:
            print(f"{label}: skipped, {available_mib():.0f} MiB available, {need:.0f} MiB needed")
            continue
        cases = [("in process", measure("in_process", args.world_size, mib)),
                 ("Cluster.run", measure("cluster", args.world_size, mib, here))]
        if args.baseline is not None:
            baseline_need = args.baseline_copies * args.world_size * mib + 1024
            if available_mib() >= baseline_need:
                cases.append(("before", measure("cluster", args.world_size, mib, args.baseline)))
            else:
                print(f"{label}: baseline skipped, {available_mib():.0f} MiB available, "
                      f"{baseline_need:.0f} MiB needed")
        reference = cases[0][1]
        for case, row in cases:
            rows.append({"results": label, "case": case, **row,
                         "ratio": row["wall_s"] / reference["wall_s"]})
    print(f"{'results':<16}{'case':<14}{'wall':>9}{'CPU':>9}{'peak RSS rise':>15}{'RSS rise':>11}"
          f"{'x in process':>14}")
    for row in rows:
        rss = "-" if row["rss_rise_mib"] is None else f"{row['rss_rise_mib']:.0f} MiB"
        print(f"{row['results']:<16}{row['case']:<14}{row['wall_s']:>8.2f}s{row['cpu_s']:>8.2f}s"
              f"{row['peak_rise_mib']:>11.0f} MiB{rss:>11}{row['ratio']:>14.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
