"""What running on real processes costs: time to the first result, a further run, a raw baseline.

In one run, for 2 and 4 ranks on gloo:

* ``real.run``          - a fresh ``real.run(program)``: spawn the workers, join the
  process group, ship the program, run it, return the results, shut down;
* ``Cluster first run`` - ``Cluster(n)`` and its first ``run``: the same start-up, but
  the workers stay up;
* ``Cluster.run``       - a further run on the warm Cluster (median of repeats);
* ``mp.spawn baseline`` - ``torch.multiprocessing.spawn`` of ``n`` processes that call
  ``init_process_group`` (TCP rendezvous on 127.0.0.1), run one all-reduce and exit:
  the least a fresh multi-process job pays.

The program is the same small one everywhere (an all-reduce of 4 floats). Ratios
are against the baseline of the same world size; the machine is shared and noisy,
so only ratios measured in one run mean much.

    python benchmarks/launcher.py                 # the table
    python benchmarks/launcher.py --repeats 20 --json out.json
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import real


def _program(comm):
    return comm.all_reduce(torch.ones(4) * comm.rank)


def _baseline_worker(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    dist.all_reduce(torch.ones(4) * rank)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def time_baseline(world_size: int) -> float:
    start = time.perf_counter()
    mp.spawn(_baseline_worker, args=(world_size, _free_port()), nprocs=world_size, join=True)
    return time.perf_counter() - start


def time_real_run(world_size: int) -> float:
    start = time.perf_counter()
    outs = real.run(_program, world_size=world_size, backend="gloo")
    elapsed = time.perf_counter() - start
    assert outs[0].tolist() == [sum(range(world_size))] * 4
    return elapsed


def time_cluster(world_size: int, repeats: int) -> tuple[float, float, float]:
    """(first run including start-up, median further run, best further run) in seconds."""
    start = time.perf_counter()
    with real.Cluster(world_size, backend="gloo") as cluster:
        cluster.run(_program)
        first = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            cluster.run(_program)
            times.append(time.perf_counter() - start)
    return first, statistics.median(times), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="further Cluster.run calls to time")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args()

    rows = []
    for world_size in (2, 4):
        baseline = time_baseline(world_size)
        fresh = time_real_run(world_size)
        first, further, best = time_cluster(world_size, args.repeats)
        rows += [
            {"ranks": world_size, "case": "mp.spawn baseline", "seconds": baseline},
            {"ranks": world_size, "case": "real.run", "seconds": fresh},
            {"ranks": world_size, "case": "Cluster first run", "seconds": first},
            {"ranks": world_size, "case": f"Cluster.run (median of {args.repeats})", "seconds": further},
            {"ranks": world_size, "case": f"Cluster.run (best of {args.repeats})", "seconds": best},
        ]
        for row in rows[-5:]:
            row["vs_baseline"] = row["seconds"] / baseline

    print(f"{'ranks':>5}  {'case':<28}{'time':>12}{'x baseline':>12}")
    for row in rows:
        seconds = row["seconds"]
        shown = f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
        print(f"{row['ranks']:>5}  {row['case']:<28}{shown:>12}{row['vs_baseline']:>12.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
