"""The cost of checked mode for torch.distributed calls on real gloo workers, and the misuse table.

``python benchmarks/checked_mode.py``: ``dist.all_reduce`` of 1 KiB (256 float32)
on 2 and 4 gloo ranks, checked vs unchecked (both through simcomm's c10d
process group) and raw (gloo's own group), each configuration in its own
fresh process and its own fresh Cluster (``torch.set_num_threads(1)``),
timed inside the program on every rank: wall time (``time.perf_counter``)
and CPU time (``time.process_time``) per call, and their ratios.
``python benchmarks/checked_mode.py misuse``: the outcome and time of each
torch.distributed misuse of tests/real/test_dist_checked.py on the simulator
and on real gloo workers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

CALLS = 300


def _all_reduces(comm, calls: int, raw: bool):
    import time

    import torch
    import torch.distributed as dist
    x = torch.ones(256)                       # 1 KiB
    # raw: gloo's own group, past simcomm's c10d process group (neither checked nor traced)
    group = dist.group.WORLD.data_group if raw else None
    for _ in range(20):                       # warm-up
        dist.all_reduce(x, group=group)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        dist.all_reduce(x, group=group)
    return (time.perf_counter() - wall) / calls, (time.process_time() - cpu) / calls


def measure(world_size: int, mode: str) -> dict:
    import torch
    torch.set_num_threads(1)
    import real
    with real.Cluster(world_size, backend="gloo", checked=mode == "checked", threads=1, timeout=300) as cluster:
        outs = cluster.run(_all_reduces, CALLS, mode == "raw")
    return {"wall_us": 1e6 * max(w for w, _ in outs), "cpu_us": 1e6 * max(c for _, c in outs)}


def misuse() -> None:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    import real
    import simcomm
    from tests.real.test_dist_checked import MISUSES, WORLD
    print("| misuse | simulator | time (s) | real gloo | time (s) |\n|---|---|---|---|---|")
    with real.Cluster(WORLD, backend="gloo", timeout=60) as cluster:
        cluster.run(lambda comm: None)
        for name, (program, _, _) in MISUSES.items():
            cells = []
            for run in (simcomm.World(WORLD).run, cluster.run):
                start = time.perf_counter()
                try:
                    run(program)
                    outcome = "no error"
                except Exception as error:   # noqa: BLE001 - the outcome is what is measured
                    outcome = type(error).__name__
                cells += [outcome, f"{time.perf_counter() - start:.3f}"]
            print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "misuse":
        misuse()
        return
    if len(sys.argv) > 2 and sys.argv[1] == "one":
        print(json.dumps(measure(int(sys.argv[2]), sys.argv[3])))
        return
    print(f"dist.all_reduce 1 KiB, {CALLS} calls, slowest rank, per call")
    print("| ranks | raw gloo wall (us) | unchecked wall (us) | checked wall (us) | checked/unchecked wall | "
          "raw CPU (us) | unchecked CPU (us) | checked CPU (us) | checked/unchecked CPU |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for world_size in (2, 4):
        results = {}
        for mode in ("raw", "unchecked", "checked"):     # each in a fresh process with a fresh Cluster
            out = subprocess.run([sys.executable, __file__, "one", str(world_size), mode],
                                 capture_output=True, text=True, check=True)
            results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        raw, plain, checked = results["raw"], results["unchecked"], results["checked"]
        print(f"| {world_size} | {raw['wall_us']:.0f} | {plain['wall_us']:.0f} | {checked['wall_us']:.0f} | "
              f"{checked['wall_us'] / plain['wall_us']:.1f} | {raw['cpu_us']:.0f} | {plain['cpu_us']:.0f} | "
              f"{checked['cpu_us']:.0f} | {checked['cpu_us'] / plain['cpu_us']:.1f} |")


if __name__ == "__main__":
    main()
