"""How long one redraw of ``collective_figure`` takes, and where the time goes, in one run.

For each op and world size (2, 4, 8), the median of several redraws of:

* ``run``    - ``run_collective``: the op forward and backward on virtual ranks (a ``World``);
* ``figure`` - ``collective_run_figure``: building the plotly figure from the run;
* ``json``   - ``fig.to_json()``: what ``explore()`` sends to the browser on every change;
* ``total``  - the three together, what a learner waits for after moving a slider;

and the share of ``total`` spent in the World run, and the JSON size. The
machine is shared and noisy, so compare the columns of one run with each
other; the target is a total well under a second for 8 ranks.

    python benchmarks/viz_redraw.py             # the table
    python benchmarks/viz_redraw.py --repeats 3
"""
from __future__ import annotations

import argparse
import statistics
import time

from simcomm.viz import collective_run_figure, run_collective

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all_4D")
WORLD_SIZES = (2, 4, 8)


def measure(op: str, world_size: int, repeats: int) -> dict:
    runs, figures, jsons, size = [], [], [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        run = run_collective(op, world_size)
        ran = time.perf_counter()
        fig = collective_run_figure(run)
        drawn = time.perf_counter()
        text = fig.to_json()
        done = time.perf_counter()
        runs.append(ran - started)
        figures.append(drawn - ran)
        jsons.append(done - drawn)
        size = len(text)
    run_s, figure_s, json_s = (statistics.median(v) for v in (runs, figures, jsons))
    return {"op": op, "world_size": world_size, "run_ms": run_s * 1e3, "figure_ms": figure_s * 1e3,
            "json_ms": json_s * 1e3, "total_ms": (run_s + figure_s + json_s) * 1e3,
            "run_share": run_s / (run_s + figure_s + json_s), "json_kib": size / 1024,
            "panels": len(fig.data)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    run_collective("all_gather", 2)  # warm up torch, threads and plotly's validators once
    collective_run_figure(run_collective("all_gather", 2)).to_json()
    rows = [measure(op, n, args.repeats) for op in OPS for n in WORLD_SIZES]
    header = (f"{'op':<15}{'ranks':>6}{'panels':>8}{'run ms':>9}{'figure ms':>11}{'json ms':>9}"
              f"{'total ms':>10}{'run share':>11}{'json KiB':>10}{'total / 2 ranks':>17}")
    print(header)
    print("-" * len(header))
    for row in rows:
        two = next(r for r in rows if r["op"] == row["op"] and r["world_size"] == 2)
        print(f"{row['op']:<15}{row['world_size']:>6}{row['panels']:>8}{row['run_ms']:>9.1f}"
              f"{row['figure_ms']:>11.1f}{row['json_ms']:>9.1f}{row['total_ms']:>10.1f}"
              f"{row['run_share']:>10.0%}{row['json_kib']:>10.1f}{row['total_ms'] / two['total_ms']:>16.1f}x")
    worst = max(r["total_ms"] for r in rows if r["world_size"] == 8)
    print(f"\nslowest 8-rank redraw: {worst:.0f} ms (target: well under 1000 ms)")


if __name__ == "__main__":
    main()
