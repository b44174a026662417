"""What virtual GPUs cost: a DDP step and an FSDP2 step written for GPUs, on virtual GPUs, beside
the same program written for the CPU device, on virtual ranks.

The GPU program is what published scripts do: ``torch.cuda.set_device(rank)``, the model
``.to(rank)``, ``DDP(device_ids=[rank])``, batches made with ``device="cuda"``; it runs in
``World(RANKS, map_cuda=VirtualGPUs(), memory=True)``, what ``python -m simcomm.run`` gives a
script on a machine without GPUs (memory tracking is on: the virtual GPUs' memory statistics
and out-of-memory errors need it). The CPU program is the same with ``"cpu"`` and no device ids,
in ``World(RANKS)``. Sides, each in a fresh process of its own with ``torch.set_num_threads(1)``,
alternating round by round; each figure is the minimum over rounds of (a run with K steps minus
a run with none) / K, so start-up and model building cancel out. CPU time
(``time.process_time``, all threads) and wall time are printed, and the ratios in one run:

* ``ddp_*``  - DDP forward+backward+SGD of 4 x ``Linear(HIDDEN)``, batch 8 per rank;
* ``fsdp_*`` - the same model, each layer and the root ``fully_shard``ed;
* ``*_cpu`` the CPU program, ``*_cpumem`` the CPU program with memory tracking (``World(memory=True)``:
  what of the cost is the tracking), ``*_gpu`` the GPU program on virtual GPUs.

    python benchmarks/virtual_gpus.py                  # 3 rounds, 8 steps per run
    python benchmarks/virtual_gpus.py --rounds 5 --steps 10 --json out.json
"""
from __future__ import annotations

import json
import sys

import steps as step_timing   # a sibling module: this file runs as a script

RANKS, HIDDEN, BATCH = 4, 512, 8
SIDES = ("ddp_cpu", "ddp_cpumem", "ddp_gpu", "fsdp_cpu", "fsdp_cpumem", "fsdp_gpu")


def program(comm, kind: str, gpu: bool, steps: int) -> None:
    """``steps`` training steps of this rank; ``gpu``: written as a GPU script writes it."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    rank = dist.get_rank()
    if gpu:
        torch.cuda.set_device(rank)
    device = "cuda" if gpu else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(4)]).to(rank if gpu else "cpu")
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[rank] if gpu else None)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.ones(BATCH, HIDDEN, device=device) * (rank + 1)
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    if gpu:
        torch.cuda.synchronize()


_WORLDS: dict = {}


def run_side(side: str, steps: int) -> None:
    import simcomm
    from simcomm.sim.cuda_map import VirtualGPUs
    kind, target = side.split("_")
    if target not in _WORLDS:
        _WORLDS[target] = (simcomm.World(RANKS, map_cuda=VirtualGPUs(per_node=RANKS), memory=True)
                           if target == "gpu" else simcomm.World(RANKS, memory=target == "cpumem"))
    _WORLDS[target].run(program, kind, target == "gpu", steps)


def main(argv: list[str] | None = None) -> int:
    parsed = step_timing.command(argv, __doc__, SIDES, run_side, __file__)
    if parsed is None:
        return 0
    args, best = parsed
    print(f"4 x Linear({HIDDEN}), batch {BATCH} per rank, {RANKS} ranks: ms per step "
          f"(min of {args.rounds} rounds, each side in a fresh process, one thread)")
    print(f"{'side':<12}{'cpu':>9}{'wall':>9}")
    for side in args.sides:
        print(f"{side:<12}{best[side]['cpu']:>9.2f}{best[side]['wall']:>9.2f}")
    print()
    for kind in ("ddp", "fsdp"):
        for a, b, what in (("gpu", "cpu", "virtual GPUs / CPU device"),
                           ("cpumem", "cpu", "memory tracking / CPU device"),
                           ("gpu", "cpumem", "virtual GPUs / CPU device, both tracked")):
            x, y = best.get(f"{kind}_{a}"), best.get(f"{kind}_{b}")
            if x and y:
                print(f"{kind}: {what}: cpu {x['cpu'] / y['cpu']:.2f}x, wall {x['wall'] / y['wall']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(best, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
