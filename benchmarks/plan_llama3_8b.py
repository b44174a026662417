"""Plan Llama 3.1 8B on 8 H100s before renting them: memory per rank and modelled throughput, shape-only.

One process, ``torch.set_num_threads(1)``: :func:`simcomm.planning.fsdp2_step.fsdp_train_step`
(FSDP2 on every block + norm/output + root, fp32 parameters, bf16 mixed precision, fp32
reduction with ``PREMUL_SUM(1.0)``, per-op selective activation checkpointing, AdamW) on
``World(8, tensors="shape", memory=True, count_flops=True)``, local batch 2, sequence 8192,
two steps (the second holds the optimizer state). Prints

1. the peak memory per rank by label (simcomm.memory) beside torchtitan's published
   figure for this configuration (torchtitan's docs/performance.md, Table 1: 82.4 GiB per H100
   for FSDP alone on 8 GPUs), and what simcomm.memory still counts of the unsharded parameters
   FSDP2 frees with ``untyped_storage().resize_(0)`` (0 once the tracker sees those frees);
2. the FLOPs the dispatcher counted per rank, torchtitan's model-FLOPs formula, and the
   modelled tokens per second per GPU at a stated MFU beside the published 5,762, plus the
   modelled timeline's step (compute lane from the counted FLOPs, FSDP's collectives on the
   H100 NVSwitch preset);
3. the planner's closed form (:mod:`simcomm.planning.planner`) for the same run beside the traced one;
4. wall time, CPU time (``time.process_time``) and the process's peak RSS.

    python benchmarks/plan_llama3_8b.py                       # the full 8B plan
    python benchmarks/plan_llama3_8b.py --layers 4 --seq 2048 # a smaller run of the same code
"""
from __future__ import annotations

import argparse
import dataclasses
import resource
import time

import torch

GIB = 2 ** 30
PUBLISHED_GIB = 82.4          # torchtitan docs/performance.md (Table 1), Llama 3.1 8B, FSDP, 8x H100
PUBLISHED_TPS = 5762          # tokens / s / GPU, same row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--mfu", type=float, default=0.40, help="model FLOPs utilisation to state throughput at")
    parser.add_argument("--no-checkpoint", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import simcomm
    from simcomm.model import cost, topology
    from simcomm.models import llama
    from simcomm.planning import fsdp2_step

    config = llama.LLAMA3_8B.scaled(layers=args.layers)
    world = simcomm.World(args.ranks, tensors="shape", memory=True, count_flops=True)
    wall, cpu = time.perf_counter(), time.process_time()
    world.run(fsdp2_step.fsdp_train_step, config, args.batch, args.seq, steps=args.steps,
              checkpoint=not args.no_checkpoint)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB

    report = world.memory
    rank = report[0]
    params = llama.parameter_count(config)
    block = (params - 2 * config.vocab * config.hidden - config.hidden) // config.layers
    after = rank.at(f"step {args.steps} backward")
    end = rank.at(f"step {args.steps}")
    # simcomm.memory does not see untyped_storage().resize_(0), with which FSDP2 frees its unsharded
    # parameters: once all-gathered they stay counted (as activations, the label active then). After
    # the last step FSDP2 has freed every one of them, so what is still counted as activations then is
    # what the tracker missed (measured). At the peak (the start of the backward) FSDP2 truly holds the
    # root's (embedding; norm and output, not resharded after forward) and at most two blocks unsharded.
    unseen = end["activations"]
    live_at_peak = (2 * config.vocab * config.hidden + config.hidden + min(2, config.layers) * block) * 2
    correction = max(0, unseen - live_at_peak)
    print(f"Llama 3.1 8B shape ({params / 1e9:.2f} B parameters, {config.layers} layers), FSDP2 on "
          f"{args.ranks} virtual ranks, local batch {args.batch}, sequence {args.seq}, "
          f"{'no' if args.no_checkpoint else 'per-op selective'} AC, AdamW, {args.steps} steps")
    print()
    print("1. memory of rank 0 by label (GiB): at the peak of the run | after the last backward")
    for name in report.labels:
        print(f"   {name:<16} {rank.peak_bytes.get(name, 0) / GIB:8.2f} | {after[name] / GIB:8.2f}")
    print(f"   {'total':<16} {rank.peak / GIB:8.2f} | {after.total / GIB:8.2f}")
    print(f"   unsharded bf16 parameters FSDP2 freed with resize_(0), still counted after the last step: "
          f"{unseen / GIB:.2f} GiB (all {params * 2 / GIB:.2f} GiB of them)")
    print(f"   {'corrected peak':<16} {(rank.peak - correction) / GIB:8.2f}   (minus {correction / GIB:.2f} GiB: "
          f"all but the root's and two blocks' unsharded parameters were freed at the peak)")
    print(f"   {'published':<16} {PUBLISHED_GIB:8.2f}   (torchtitan, 8x H100, FSDP; measured on the GPU: adds "
          f"the allocator's reserve and fragmentation, NCCL buffers, the CUDA context)")
    print(f"   peaks of all ranks (GiB): {[round(p / GIB, 2) for p in report.peak]}")
    print()
    counted = world.flops[0]
    tokens = args.batch * args.seq * args.steps
    formula = fsdp2_step.flops_per_token(config, args.seq)
    peak = topology.H100_NVSWITCH.compute_flops
    print("2. FLOPs and modelled throughput per GPU (H100 dense BF16 peak "
          f"{peak / 1e12:.0f} TFLOP/s, simcomm.model.topology.H100_NVSWITCH)")
    print(f"   counted per token (rank 0, with recomputation) {counted / tokens:.3e}")
    print(f"   torchtitan's model FLOPs per token (6N + 12 L H Q T) {formula:.3e}")
    print(f"   recomputation share of the counted FLOPs {1 - formula / (counted / tokens):.1%}")
    implied = PUBLISHED_TPS * formula / peak
    print(f"   published {PUBLISHED_TPS} tokens/s/GPU is an MFU of {implied:.1%} by that formula")
    print(f"   modelled at MFU {args.mfu:.0%}: {args.mfu * peak / formula:,.0f} tokens/s/GPU "
          f"(model FLOPs), {args.mfu * peak / (counted / tokens):,.0f} tokens/s/GPU if the recomputed "
          f"FLOPs run at the same rate")
    slowed = dataclasses.replace(topology.H100_NVSWITCH, compute_flops=peak * args.mfu)
    timeline = cost.modelled_timeline(world.trace, slowed)
    step_s = max(r.end for r in timeline.ranks.values()) / args.steps
    summary = timeline.ranks[0]
    print(f"   modelled timeline (compute at {args.mfu:.0%} of peak, NVSwitch collectives): "
          f"{step_s * 1e3:.0f} ms per step, {args.batch * args.seq / step_s:,.0f} tokens/s/GPU; rank 0 "
          f"compute {summary.compute / args.steps * 1e3:.0f} ms, communication "
          f"{summary.communication / args.steps * 1e3:.0f} ms, exposed {summary.exposed / args.steps * 1e3:.0f} "
          f"ms per step")
    print()
    from simcomm.planning import planner
    recipe = planner.Recipe(seq=args.seq, micro_batch=args.batch, global_batch=args.batch * args.ranks,
                            recompute="none" if args.no_checkpoint else "selective", states="fsdp2", attention="fa2")
    closed = planner.evaluate(config, (1, 1, 1, args.ranks), recipe, gpu=planner.H100_HBM2E)
    counted = closed["total"] - closed["overhead"]
    print("3. the planner's closed form for the same run (simcomm.planning.planner, FSDP2 states, "
          "torchtitan's H100 as calibrated)")
    print("   " + ", ".join(f"{label} {closed[label] / GIB:.2f}" for label in planner.LABELS) + " GiB")
    print(f"   counted before the allocator overhead {counted / GIB:.2f} GiB (traced peak above: "
          f"{rank.peak / GIB:.2f}, ratio {counted / rank.peak:.2f}); with the calibrated overhead "
          f"{closed['total'] / GIB:.2f} GiB; published {PUBLISHED_GIB}")
    print(f"   modelled {closed['tokens_per_gpu_s']:,.0f} tokens/s/GPU (MFU {closed['mfu']:.1%}); published "
          f"{PUBLISHED_TPS:,}")
    print()
    print(f"4. this run: wall {wall:.1f} s, CPU {cpu:.1f} s (ratio {cpu / wall:.2f}), peak RSS {rss_gib:.2f} GiB, "
          f"{len(world.trace.events)} trace events")


if __name__ == "__main__":
    main()
