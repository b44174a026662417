"""Published large-scale Llama runs beside the planner (:mod:`simcomm.planning.planner`).

:func:`published_runs` lists every row of two sources, each with the
:class:`~simcomm.planning.planner.Recipe` that describes what the run did and a
``role``: ``"calibrate"`` (the three rows :func:`calibrate` fits the GPUs'
sustained GEMM fraction and the memory overhead on) or ``"validate"`` (never
used in any fitting; the planner's figure is compared only):

* **The Llama 3 paper** (Llama Team, AI @ Meta, "The Llama 3 Herd of Models",
  arXiv 2407.21783, section 3.3.2, Table 4): Llama 3 405B on H100 SXM 80GB (700 W),
  BF16, TFLOPs per GPU: 8K sequences on 8,192 GPUs (TP 8, PP 16, DP 64) 430, on
  16,384 (DP 128) 400; 128K sequences on 16,384 (TP 8, CP 16, PP 16, DP 8) 380;
  16M tokens a step. The paper's pipeline is an interleaved schedule; it trains 8K
  without activation checkpointing; its CP all-gathers K and V; its first and last
  stages hold one layer fewer ("balanced"). Assumed where the paper is silent: two layers per virtual stage (NeMo's Llama 3 405B recipe: 126
  layers, PP 8, 8 virtual stages), Megatron-style states (bf16 weights, fp32
  gradients (the paper reduce-scatters them in FP32), ZeRO-1 optimizer) and fused
  kernels (what Megatron-LM with Transformer Engine saves), FlashAttention-3-class attention.
* **torchtitan** ``docs/performance.md`` (github.com/pytorch/torchtitan, as of
  commit 820504e20d1149fbf0b98c567af24c4b0433b22d's parent, which moved it to
  ``benchmarks/``; measured with torchtitan 9dec370, torch 1963fc8, 2024-12):
  Llama 3.1 8B / 70B / 405B on H100 96GB HBM2e at 500 W, Tables 1-6: TPS/GPU and
  memory (GiB, the maximum over GPUs), with FSDP2, TP, PP, CP, torch.compile,
  Float8 and async TP as each row states. What torchtitan 9dec370 with torch 1963fc8 does
  whichever layout is planned: its Llama repeats the K/V heads before SDPA (``repeat_kv``),
  TP goes through DTensor with ``loss_parallel`` and Float8 inputs cast before their
  all-gather (``dtensor_tp``), and CP is ``context_parallel``'s ring attention (``cp_ring``).

``python benchmarks/published_runs.py`` prints the table of
``docs/planning_llama.md``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..models.llama import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B
from . import planner
from .planner import GPU, H100_HBM2E, H100_SXM, GiB, Recipe

__all__ = ["published_runs", "evaluate_run", "calibrate", "PAPER", "TORCHTITAN"]

PAPER = "Llama 3 paper, Table 4"
TORCHTITAN = "torchtitan docs/performance.md"


def _run(source, model, layout, recipe, gpu, *, memory_gib=None, tps=None, tflops=None, role="validate",
         name=""):
    return {"source": source, "name": name, "model": model, "gpus": layout[0] * layout[1] * layout[2] * layout[3],
            "layout": layout, "recipe": recipe, "gpu": gpu, "memory_gib": memory_gib, "tps": tps,
            "tflops": tflops, "role": role}


def published_runs() -> list[dict[str, Any]]:
    """Every published row (module docstring): ``source``, ``name``, ``model``, ``gpus``, ``layout``
    ``(tp, cp, pp, dp)``, ``recipe``, ``gpu``, ``memory_gib``, ``tps`` (tokens per GPU per second),
    ``tflops`` (per GPU) where published, and ``role``."""
    meta = Recipe(seq=8192, global_batch=2048, recompute="none", schedule="interleaved", states="megatron",
                  attention="fa3", kernels="fused", balanced=True)
    long = dataclasses.replace(meta, seq=131072, global_batch=128)
    runs = [
        _run(PAPER, LLAMA3_405B, (8, 1, 16, 128), meta, H100_SXM, tflops=400, role="calibrate",
             name="405B 8K, 16,384 GPUs"),
        _run(PAPER, LLAMA3_405B, (8, 1, 16, 64), meta, H100_SXM, tflops=430, name="405B 8K, 8,192 GPUs"),
        _run(PAPER, LLAMA3_405B, (8, 16, 16, 8), long, H100_SXM, tflops=380, name="405B 128K, 16,384 GPUs"),
    ]
    fsdp = Recipe(seq=8192, micro_batch=2, recompute="selective", states="fsdp2", attention="fa2", repeat_kv=True,
                  dtensor_tp=True, cp_ring=True)
    for table, gpus, figures in (("Table 1", 8, ((5762, 82.4), (6667, 77.0), (8532, 76.8))),
                                 ("Table 3", 128, ((5605, 67.0), (6514, 62.0), (8380, 61.8)))):
        for index, (label, compiled, float8) in enumerate((("FSDP", False, False),
                                                           ("FSDP + compile", True, False),
                                                           ("FSDP + compile + Float8", True, True))):
            tps, memory = figures[index]
            recipe = dataclasses.replace(fsdp, global_batch=2 * gpus, compiled=compiled, float8=float8)
            role = "calibrate" if (table, index) == ("Table 1", 0) else "validate"
            runs.append(_run(f"{TORCHTITAN}, {table}", LLAMA3_8B, (1, 1, 1, gpus), recipe, H100_HBM2E,
                             memory_gib=memory, tps=tps, role=role, name=f"8B {label}, {gpus} GPUs"))
    long8 = Recipe(micro_batch=1, recompute="full", states="fsdp2", attention="fa2", compiled=True, float8=True,
                   cp_ring=True, repeat_kv=True, dtensor_tp=True)
    for cp, seq, tps, memory in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                 (8, 262144, 548, 84.5)):
        runs.append(_run(f"{TORCHTITAN}, Table 2", LLAMA3_8B, (1, cp, 1, 8 // cp),
                         dataclasses.replace(long8, seq=seq, global_batch=8 // cp), H100_HBM2E,
                         memory_gib=memory, tps=tps, name=f"8B FSDP {8 // cp} CP {cp}, {seq // 1024}K"))
    two_d = Recipe(seq=8192, global_batch=512, micro_batch=16, recompute="full", states="fsdp2", attention="fa2",
                   compiled=True, float8=True, repeat_kv=True, dtensor_tp=True, cp_ring=True)
    for label, async_tp, tps, memory in (("2D", False, 829, 71.9), ("2D + async TP", True, 876, 67.6)):
        runs.append(_run(f"{TORCHTITAN}, Table 4", LLAMA3_70B, (8, 1, 1, 32),
                         dataclasses.replace(two_d, async_tp=async_tp), H100_HBM2E, memory_gib=memory, tps=tps,
                         name=f"70B {label}, 256 GPUs"))
    three_d = Recipe(seq=8192, global_batch=256, micro_batch=4, recompute="full", states="fsdp2", attention="fa2",
                     compiled=True, float8=True, async_tp=True, repeat_kv=True, dtensor_tp=True, cp_ring=True)
    for label, schedule, tps, memory in (("1F1B", "1f1b", 100, 82.5), ("interleaved 1F1B", "interleaved", 128, 72.7)):
        runs.append(_run(f"{TORCHTITAN}, Table 5", LLAMA3_405B, (8, 1, 8, 8),
                         dataclasses.replace(three_d, schedule=schedule, virtual_stages=2), H100_HBM2E,
                         memory_gib=memory, tps=tps, name=f"405B 3D {label}, 512 GPUs"))
    four_d = dataclasses.replace(three_d, micro_batch=1, schedule="1f1b")
    for cp, seq, tps, memory in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                                 (8, 262144, 16, 84.9)):
        dp = 8 // cp
        runs.append(_run(f"{TORCHTITAN}, Table 6", LLAMA3_405B, (8, cp, 8, dp),
                         dataclasses.replace(four_d, seq=seq, global_batch=8 * dp), H100_HBM2E,
                         memory_gib=memory, tps=tps, name=f"405B 4D FSDP {dp} CP {cp}, {seq // 1024}K"))
    return runs


def evaluate_run(run: dict[str, Any], gpu: GPU | None = None) -> dict[str, Any]:
    """The planner's row for ``run``'s layout and recipe (on ``gpu``, default the run's)."""
    return planner.evaluate(run["model"], run["layout"], run["recipe"], gpu=gpu or run["gpu"])


def _solve_gemm(run: dict[str, Any], gpu: GPU) -> float:
    """The ``gemm`` fraction at which the planner's throughput for ``run`` equals the published one."""
    target, field = (run["tflops"], "tflops") if run["tflops"] else (run["tps"], "tokens_per_gpu_s")
    low, high = 0.05, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        got = evaluate_run(run, dataclasses.replace(gpu, gemm=middle))[field]
        low, high = (middle, high) if got < target else (low, middle)
    return (low + high) / 2


def calibrate() -> dict[str, float]:
    """Fit, on the ``"calibrate"`` rows only: the H100 SXM's ``gemm`` fraction (the Llama 3 paper's 405B
    8K row on 16,384 GPUs), the torchtitan H100's ``gemm`` and both GPUs' ``memory_overhead`` (torchtitan's
    Table 1 FSDP row: published memory / counted memory - 1). Returns those three values; the
    planner's :data:`~simcomm.planning.planner.H100_SXM` and ``H100_HBM2E`` hold them rounded."""
    runs = [run for run in published_runs() if run["role"] == "calibrate"]
    paper = next(run for run in runs if run["source"] == PAPER)
    titan = next(run for run in runs if run["source"] != PAPER)
    bare = dataclasses.replace(titan["gpu"], memory_overhead=0.0)
    counted = evaluate_run(titan, bare)["total"]
    return {"h100_sxm_gemm": _solve_gemm(paper, paper["gpu"]), "h100_hbm2e_gemm": _solve_gemm(titan, titan["gpu"]),
            "memory_overhead": titan["memory_gib"] * GiB / counted - 1}
