"""Every published Llama 3 training row beside the planner's figure and the ratio.

    python benchmarks/published_runs.py            # the table of docs/planning_llama.md
    python benchmarks/published_runs.py --ranking  # where each published layout ranks among the
                                                   # layouts the planner enumerates for its budget

Rows and sources: :mod:`simcomm.planning.published`. ``role`` says which rows
:func:`~simcomm.planning.published.calibrate` fits (``calibrate``) and which
are only compared (``validate``). First the calibration is re-run and checked
against the constants the planner holds. Throughput: TFLOPs per GPU in the
``6N + 12 L h s`` convention for the Llama 3 paper's rows (what it publishes),
tokens per GPU per second for torchtitan's; memory in GiB per GPU (the
maximum over GPUs, torchtitan's convention).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys

from simcomm.planning import planner, published
from simcomm.planning.planner import GiB


def table() -> list[str]:
    lines = ["| source | run | layout tp/cp/pp/dp | role | memory GiB: published | planner | ratio "
             "| throughput: published | planner | ratio | MFU (6N+12Lhs) | causal TFLOPs |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in published.published_runs():
        row = published.evaluate_run(run)
        memory = row["total"] / GiB
        if run["tflops"]:
            got, want, unit = row["tflops"], run["tflops"], "TFLOPs"
        else:
            got, want, unit = row["tokens_per_gpu_s"], run["tps"], "tok/s"
        mem = (f"{run['memory_gib']:.1f} | {memory:.1f} | {memory / run['memory_gib']:.2f}"
               if run["memory_gib"] else f"- | {memory:.1f} | -")
        source = ("paper " if run["source"] == published.PAPER else "torchtitan ") + run["source"].split(", ")[-1]
        lines.append(f"| {source} | {run['name']} | {'/'.join(map(str, run['layout']))} | {run['role']} "
                     f"| {mem} | {want:,} {unit} | {got:,.0f} | {got / want:.2f} | {row['mfu']:.1%} "
                     f"| {row['tflops_causal']:.0f} |")
    return lines


def memory_parts() -> list[str]:
    """The plan's memory of each published row by part (GiB), on the stage that needs the most."""
    lines = ["| run | stage | " + " | ".join(planner.LABELS) + " | total | published |",
             "|---|---|" + "---:|" * (len(planner.LABELS) + 2)]
    for run in published.published_runs():
        row = published.evaluate_run(run)
        lines.append(f"| {run['name']} | {row['stage']} | "
                     + " | ".join(f"{row[label] / GiB:.1f}" for label in planner.LABELS)
                     + f" | {row['total'] / GiB:.1f} | {run['memory_gib'] or '-'} |")
    return lines


PARTS = ("compute", "bubble", "tp_comm", "cp_comm", "pp_comm", "dp_exposed", "optimizer")


def _differences(mine: dict, best: dict) -> str:
    """The modelled parts of the step that differ between two rows, published minus fastest, largest
    first (the three largest; seconds)."""
    parts = sorted(PARTS, key=lambda part: -abs(mine[part] - best[part]))[:3]
    return ", ".join(f"{part} {mine[part] - best[part]:+.2f}" for part in parts
                     if abs(mine[part] - best[part]) >= 0.005)


def _bubble(run: dict, row: dict) -> str:
    """Where the pipeline bubble is the published layout's largest excess: its fraction of the compute."""
    if row["bubble"] <= 0 or row["bubble"] < max(row[part] for part in PARTS if part != "compute"):
        return ""
    pp, m, v = run["layout"][2], row["micro_batches"], row["virtual_stages"]
    return (f" (the {run['recipe'].schedule} bubble, (pp - 1) / (v m) = {pp - 1}/({v} x {m}) of the "
            f"micro-batch times with their exposed communication, is {row['bubble'] / row['compute']:.0%} "
            "of the compute)")


def ranking() -> tuple[list[str], list[str]]:
    """Where each published layout ranks among the planner's layouts for the same model, GPUs and
    recipe: among those that fit the GPU's memory, and by modelled step alone; beside the fastest
    fitting layout, the modelled parts that differ most (seconds, published layout minus fastest).
    Returns the table and, for each published layout outside the top 3 (or not fitting), a line
    saying with numbers which modelled cost puts it lower."""
    lines = ["| run | published layout | GiB (fits?) | rank among fitting | of | rank by step alone | of "
             "| fastest fitting | its step / published's | parts that differ most (s, published - fastest) |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---|"]
    notes = []
    seen = set()
    for run in published.published_runs():
        recipe, gpu = run["recipe"], run["gpu"]
        case = (run["model"].name, run["gpus"], recipe)
        if case in seen:
            continue
        seen.add(case)
        rows = sorted(planner.plan(run["model"], run["gpus"], recipe, gpu=gpu), key=lambda r: r["step_time"])
        fitting = [r for r in rows if r["total"] <= gpu.capacity]
        mine = next(r for r in rows if planner.key(r) == run["layout"])
        fit_keys = [planner.key(r) for r in fitting]
        rank = fit_keys.index(run["layout"]) + 1 if run["layout"] in fit_keys else "-"
        alone = [planner.key(r) for r in rows].index(run["layout"]) + 1
        layout = "/".join(map(str, run["layout"]))
        over = ""
        if not mine["fits"]:
            top = max(planner.LABELS, key=lambda label: mine[label])
            over = (f"does not fit: {mine['total'] / GiB:.1f} GiB on its {mine['stage']} stage against "
                    f"{gpu.capacity / GiB:.1f} GiB ({top} {mine[top] / GiB:.1f} GiB); ")
        if not fitting:
            lines.append(f"| {run['name']} | {layout} | {mine['total'] / GiB:.1f} (no) "
                         f"| - | 0 | {alone} | {len(rows)} | none fits | - | - |")
            notes.append(f"- {run['name']} ({layout}): {over}no layout of its {run['gpus']:,} GPUs fits the plan's "
                         f"memory; by step alone it ranks {alone} of {len(rows)}")
            continue
        best = fitting[0]
        differ = _differences(mine, best)
        lines.append(f"| {run['name']} | {layout} | {mine['total'] / GiB:.1f} "
                     f"({'yes' if mine['fits'] else 'no'}) | {rank} | {len(fitting)} | {alone} | {len(rows)} "
                     f"| {'/'.join(map(str, planner.key(best)))} | {best['step_time'] / mine['step_time']:.2f} "
                     f"| {differ or '-'} |")
        if rank == "-" or rank > 3:
            notes.append(f"- {run['name']} ({layout}): {over}rank {rank} of {len(fitting)} fitting; the fastest fitting "
                         f"layout {'/'.join(map(str, planner.key(best)))} takes {best['step_time']:.2f} s a step "
                         f"against its {mine['step_time']:.2f} s: {differ}{_bubble(run, mine)}")
    return lines, notes


def _attention_factor(run: dict, field: str, want: float) -> float:
    """The factor on the attention kernel's efficiency at which the planner's ``field`` for ``run``
    equals ``want`` (a what-if on that row alone, never fitted into the planner)."""
    low, high = 0.05, 4.0
    for _ in range(50):
        middle = (low + high) / 2
        recipe = dataclasses.replace(run["recipe"], attention_scale=middle)
        got = planner.evaluate(run["model"], run["layout"], recipe, gpu=run["gpu"])[field]
        low, high = (middle, high) if got < want else (low, middle)
    return low


def misses() -> list[str]:
    """Each validation row outside the targets (memory within 10 %, throughput within 15 %): what the
    plan holds for it and what would bring it in. Throughput: attention's share of the modelled compute,
    what the modelled ring attention (or CP all-gather) adds, and the factor on the attention kernel's
    efficiency that reproduces the published figure (a what-if on that row alone, never fitted into the
    planner); for a row whose kernel is assumed, the figure with the other published kernel. Memory:
    the GiB the plan lacks or adds and its largest parts."""
    lines = []
    for run in published.published_runs():
        if run["role"] != "validate":
            continue
        row = published.evaluate_run(run)
        field, want = ("tflops", run["tflops"]) if run["tflops"] else ("tokens_per_gpu_s", run["tps"])
        ratio = row[field] / want
        if not 0.85 <= ratio <= 1.15:
            plain = dataclasses.replace(run["recipe"], attention_scale=1e9)       # attention free
            share = 1 - planner.evaluate(run["model"], run["layout"], plain, gpu=run["gpu"])["compute"] / row["compute"]
            how = "ring attention" if run["recipe"].cp_ring else "the exposed K/V all-gather"
            line = (f"- {run['name']}: throughput {ratio:.2f} x published; attention is {share:.0%} of the modelled "
                    f"compute; {how} adds {row['cp_comm']:.2f} s of a {row['step_time']:.2f} s step; attention at "
                    f"{_attention_factor(run, field, want):.2f} x the kernel's published efficiency would match")
            if run["source"] == published.PAPER and run["recipe"].attention == "fa3":
                other = dataclasses.replace(run["recipe"], attention="fa2")
                got = planner.evaluate(run["model"], run["layout"], other, gpu=run["gpu"])[field]
                line += (f"; with FlashAttention-2's efficiency instead of the assumed FlashAttention-3 (the "
                         f"paper names no kernel) {got / want:.2f} x")
            lines.append(line)
        if run["memory_gib"] and not 0.9 <= row["total"] / GiB / run["memory_gib"] <= 1.1:
            lines.append(f"- {run['name']}: memory {row['total'] / GiB:.1f} GiB vs {run['memory_gib']} published "
                         f"({run['memory_gib'] - row['total'] / GiB:+.1f} GiB not modelled); the plan's largest "
                         f"parts: " + ", ".join(f"{label} {row[label] / GiB:.1f}" for label in
                                                sorted(planner.LABELS, key=lambda k: -row[k])[:3]))
    return lines or ["- none"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranking", action="store_true", help="also rank each published layout")
    args = parser.parse_args()
    fitted = published.calibrate()
    held = {"h100_sxm_gemm": planner.H100_SXM.gemm, "h100_hbm2e_gemm": planner.H100_HBM2E.gemm,
            "memory_overhead": planner.H100_HBM2E.memory_overhead}
    print("calibration (fitted on the 'calibrate' rows only):")
    for name, value in fitted.items():
        print(f"  {name}: fitted {value:.4f}, held by the planner {held[name]:.4f}")
        if abs(value - held[name]) > 0.001:
            print(f"  the planner's {name} is stale: set it to {value:.3f}", file=sys.stderr)
            return 1
    print()
    print("\n".join(table()))
    print()
    print("validation rows outside the targets (memory 10 %, throughput 15 %):")
    print("\n".join(misses()))
    print()
    print("the plan's memory by part, GiB:")
    print("\n".join(memory_parts()))
    if args.ranking:
        table_lines, notes = ranking()
        print()
        print("\n".join(table_lines))
        print()
        print("published layouts outside the planner's top 3, and the modelled cost that puts each lower:")
        print("\n".join(notes or ["- none"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
