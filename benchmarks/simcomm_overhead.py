"""Per-collective cost of the simulator, side by side with two anchors, in one run.

For each op (all_reduce, all_gather, reduce_scatter, all_to_all), world size and
per-rank message size, the time of one collective on each side:

* ``simcomm``  - ``World(n).run`` with a program calling the communicator (autograd
  Function, argument checks, trace recording, rendezvous), the way a lesson runs it;
* ``threaded`` - PyTorch's threaded process group
  (``torch.testing._internal.distributed.multi_threaded_pg``): one thread per rank,
  ``torch.distributed`` calls, each allocating its output as simcomm does;
* ``ideal``    - the same math on one stacked ``(world, ...)`` tensor with no threads,
  materialising every rank's output (the floor for any simulator);
* ``baseline`` - (with ``--baseline DIR``) simcomm imported from another checkout,
  e.g. ``git archive <commit> | tar -x -C DIR``: before vs after in the same run.

Each side runs in a fresh process of its own (started per configuration) with
``torch.set_num_threads(1)``; the parent alternates the sides round by round, so a
machine that speeds up or slows down affects them alike, and reports medians.
Printed as microseconds and as ratios; only ratios measured in the same run mean much.

    python benchmarks/simcomm_overhead.py                 # full table
    python benchmarks/simcomm_overhead.py --quick         # 1 KiB only, fewer repeats
    python benchmarks/simcomm_overhead.py --ops all_reduce --world-sizes 64 256 --sizes 1KiB \\
        --baseline /tmp/simcomm-before                    # before vs after
    python benchmarks/simcomm_overhead.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
SIZES = {"1KiB": 1 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
WORLD_SIZES = (2, 8, 64, 256)
MEMORY_BUDGET = 3 << 30   # bytes of inputs + outputs a configuration may allocate
TARGET_SECONDS = 0.25     # aim for this much timed work per measurement


def footprint(op: str, world_size: int, nbytes: int) -> int:
    outputs = world_size * world_size * nbytes if op == "all_gather" else world_size * nbytes
    return world_size * nbytes + outputs


# -- simcomm ----------------------------------------------------------------------------

def _sim_program(comm, op: str, numel: int, iters: int):
    x = torch.ones(numel) * comm.rank
    call = {
        "all_reduce": lambda: comm.all_reduce(x),
        "all_gather": lambda: comm.all_gather(x, dim=0),
        "reduce_scatter": lambda: comm.reduce_scatter(x, dim=0),
        "all_to_all": lambda: comm.all_to_all(x, scatter_dim=0, gather_dim=0),
    }[op]
    call()  # warm-up
    comm.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    comm.barrier()
    return time.perf_counter() - start


def time_simcomm(op: str, world_size: int, numel: int, iters: int) -> float:
    import simcomm
    world = simcomm.World(world_size)
    elapsed = world.run(_sim_program, op, numel, iters)
    return max(elapsed) / iters


# -- PyTorch's threaded process group -------------------------------------------------------

def time_threaded(op: str, world_size: int, numel: int, iters: int) -> float:
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # a process-group registry per thread
    mtpg._install_threaded_pg()
    store = dist.HashStore()
    elapsed = [0.0] * world_size
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            x = torch.ones(numel) * rank
            if op == "all_reduce":
                call = lambda: dist.all_reduce(x.clone())  # noqa: E731 - the clone is the output
            elif op == "all_gather":
                out = torch.empty(numel * world_size)
                call = lambda: dist.all_gather_into_tensor(out, x)  # noqa: E731
            elif op == "reduce_scatter":
                out = torch.empty(numel // world_size)
                call = lambda: dist.reduce_scatter_tensor(out, x)  # noqa: E731
            else:
                out = torch.empty(numel)
                call = lambda: dist.all_to_all_single(out, x)  # noqa: E731
            call()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                call()
            dist.barrier()
            elapsed[rank] = time.perf_counter() - start
            dist.destroy_process_group()
        except BaseException as error:  # reported by the caller
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mtpg._uninstall_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    return max(elapsed) / iters


# -- the stacked-tensor ideal ---------------------------------------------------------------

def time_ideal(op: str, world_size: int, numel: int, iters: int) -> float:
    stacked = torch.ones(world_size, numel)  # (world, numel): every rank's input

    def call():
        if op == "all_reduce":
            total = stacked.sum(0)                                            # (numel,)
            return [total] + [total.clone() for _ in range(world_size - 1)]   # a copy per rank
        if op == "all_gather":
            flat = stacked.reshape(-1)                                        # (world*numel,)
            return [flat.clone() for _ in range(world_size)]                  # a copy per rank
        if op == "reduce_scatter":
            return stacked.sum(0).reshape(world_size, numel // world_size)    # (world, numel/world)
        return stacked.reshape(world_size, world_size, -1).transpose(0, 1).contiguous()  # (dst, src, numel/world)

    call()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters


TIMERS = {"simcomm": time_simcomm, "threaded": time_threaded, "ideal": time_ideal}


# -- one fresh process per side ---------------------------------------------------------------

def worker(side: str) -> int:
    """Answer ``op world_size numel iters`` lines on stdin with per-call seconds."""
    torch.set_num_threads(1)
    timer = TIMERS["simcomm" if side == "baseline" else side]
    for line in sys.stdin:
        op, world_size, numel, iters = line.split()
        seconds = timer(op, int(world_size), int(numel), int(iters))
        print(json.dumps(seconds), flush=True)
    return 0


class Side:
    """A worker process measuring one side for one configuration."""

    def __init__(self, name: str, baseline: str | None):
        env = dict(os.environ)
        root = baseline if name == "baseline" else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.name = name
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", name],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def time(self, op: str, world_size: int, numel: int, iters: int) -> float:
        self.process.stdin.write(f"{op} {world_size} {numel} {iters}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker ended (exit code {self.process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def measure(op: str, world_size: int, numel: int, repeats: int, sides: list[str],
            baseline: str | None) -> dict[str, float]:
    """Median per-call seconds of each side over ``repeats`` rounds, each round sized to
    about TARGET_SECONDS per side; the sides alternate within a round."""
    workers = [Side(name, baseline) for name in sides]
    try:
        iters = {}
        for side in workers:
            probe = side.time(op, world_size, numel, 2)
            iters[side.name] = int(min(500, max(3, TARGET_SECONDS / max(probe, 1e-7))))
        samples: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(repeats):
            for side in workers:
                samples[side.name].append(side.time(op, world_size, numel, iters[side.name]))
    finally:
        for side in workers:
            side.close()
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 KiB only, one repeat")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--world-sizes", nargs="+", type=int, default=list(WORLD_SIZES))
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--baseline", help="a folder holding another simcomm to time side by side")
    parser.add_argument("--worker", choices=[*TIMERS, "baseline"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    sides = list(TIMERS) + (["baseline"] if args.baseline else [])
    sizes = ["1KiB"] if args.quick else args.sizes
    repeats = 1 if args.quick else args.repeats

    rows = []
    header = (f"{'op':<15}{'ranks':>6}{'size':>7}{'simcomm us':>12}{'threaded us':>13}{'ideal us':>10}"
              f"{'sim/threaded':>14}{'sim/ideal':>11}"
              + (f"{'baseline us':>13}{'sim/baseline':>14}" if args.baseline else ""))
    print(f"torch {torch.__version__}; each side in its own process with 1 intra-op thread")
    print(header)
    print("-" * len(header))
    for size_name in sizes:
        nbytes = SIZES[size_name]
        numel = nbytes // 4  # float32
        for op in args.ops:
            for world_size in args.world_sizes:
                if footprint(op, world_size, nbytes) > MEMORY_BUDGET:
                    print(f"{op:<15}{world_size:>6}{size_name:>7}   skipped: "
                          f"{footprint(op, world_size, nbytes) / 2**30:.0f} GiB of buffers")
                    continue
                times = measure(op, world_size, numel, repeats, sides, args.baseline)
                row = {"op": op, "world_size": world_size, "size": size_name,
                       **{f"{k}_us": v * 1e6 for k, v in times.items()},
                       "sim_over_threaded": times["simcomm"] / times["threaded"],
                       "sim_over_ideal": times["simcomm"] / times["ideal"]}
                extra = ""
                if args.baseline:
                    row["sim_over_baseline"] = times["simcomm"] / times["baseline"]
                    extra = f"{row['baseline_us']:>13.1f}{row['sim_over_baseline']:>14.2f}"
                rows.append(row)
                print(f"{op:<15}{world_size:>6}{size_name:>7}{row['simcomm_us']:>12.1f}"
                      f"{row['threaded_us']:>13.1f}{row['ideal_us']:>10.1f}"
                      f"{row['sim_over_threaded']:>14.2f}{row['sim_over_ideal']:>11.2f}{extra}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
