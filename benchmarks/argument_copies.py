"""What each rank's own copy of the arguments costs ``World.run``.

``World.run(program, x)`` deep-copies ``x`` for every rank (as each process of a
real run unpickles its own). This times an empty program with and without one
argument of each size, in this process with ``torch.set_num_threads(1)``, and
prints the copy's cost per rank next to a plain ``x.clone()`` (the memory
bandwidth floor).

    python benchmarks/argument_copies.py
    python benchmarks/argument_copies.py --world-sizes 4 16 --sizes-mib 1 64 256
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import simcomm


def _empty(comm, *args):
    return None


def _median_seconds(call, repeats: int) -> float:
    call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[4, 16])
    parser.add_argument("--sizes-mib", nargs="+", type=float, default=[1, 64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{'ranks':>6}{'MiB':>8}{'run, no arg ms':>16}{'run, arg ms':>13}{'copy/rank ms':>14}"
          f"{'clone ms':>10}{'copy/clone':>12}")
    for world_size in args.world_sizes:
        world = simcomm.World(world_size, trace=False)
        bare = _median_seconds(lambda: world.run(_empty), args.repeats)
        for mib in args.sizes_mib:
            x = torch.randn(int(mib * (1 << 20)) // 4)
            with_arg = _median_seconds(lambda: world.run(_empty, x), args.repeats)
            clone = _median_seconds(lambda: x.clone(), args.repeats)
            per_rank = (with_arg - bare) / world_size
            print(f"{world_size:>6}{mib:>8g}{bare * 1e3:>16.2f}{with_arg * 1e3:>13.2f}{per_rank * 1e3:>14.2f}"
                  f"{clone * 1e3:>10.2f}{per_rank / clone:>12.2f}", flush=True)
            del x
    return 0


if __name__ == "__main__":
    sys.exit(main())
