"""Cost of a blocking 1 KiB all_reduce on virtual ranks: this checkout against another one.

Each measurement runs in a fresh process with ``torch.set_num_threads(1)``,
and the two checkouts alternate round by round, so both see the same load.
The figure is CPU time of the whole process (every rank thread) per rank per
call, the minimum over rounds: on a shared, busy machine CPU time varies far
less than wall time. Tracing is on, as in a lesson.

    python benchmarks/blocking_path.py --before /path/to/other/checkout
    python benchmarks/blocking_path.py --before ../main --world-sizes 8 64 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

_MEASURE = r"""
import sys, time, torch
torch.set_num_threads(1)
import simcomm
world_size, calls = int(sys.argv[1]), int(sys.argv[2])

def program(comm):
    x = torch.ones(256) * comm.rank          # 1 KiB of float32, allocated per rank
    for _ in range(calls):
        comm.all_reduce(x)                   # each call allocates its output

world = simcomm.World(world_size)
world.run(program)                           # warm-up
times = []
for _ in range(3):
    start = time.process_time()
    world.run(program)
    times.append(time.process_time() - start)
print(min(times) / calls / world_size * 1e6)
"""


def measure(checkout: str, world_size: int, calls: int) -> float:
    """Microseconds of CPU per rank per call, in a fresh process importing ``checkout``'s simcomm."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(world_size), str(calls)], env=env,
                          capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the other checkout (its folder holds simcomm/)")
    parser.add_argument("--after", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=16000, help="calls per rank x world size")
    args = parser.parse_args(argv)
    print(f"{'ranks':>5}  {'before us':>10}  {'after us':>9}  {'after/before':>12}")
    for world_size in args.world_sizes:
        calls = max(args.calls // world_size, 10)
        before, after = [], []
        for _ in range(args.rounds):
            before.append(measure(args.before, world_size, calls))
            after.append(measure(args.after, world_size, calls))
        print(f"{world_size:>5}  {min(before):>10.2f}  {min(after):>9.2f}  {min(after) / min(before):>12.2f}")


if __name__ == "__main__":
    main()
