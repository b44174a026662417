"""torch.distributed on virtual ranks: the "simcomm" backend beside PyTorch's threaded process group.

Three measurements, each side in its own fresh process with ``torch.set_num_threads(1)``:

* ``all_reduce``  - ``dist.all_reduce`` of 1 KiB (float32, a fresh output every call)
  at 8 and 64 ranks: the simcomm backend inside ``World.run`` vs PyTorch's threaded
  process group (``torch.testing._internal.distributed.multi_threaded_pg``); per call.
* ``all_reduce_async`` - the same with ``async_op=True`` and ``wait()`` at once, at 8 ranks:
  what issuing and waiting on a Work costs on each side.
* ``fsdp``        - one FSDP2 (``fully_shard``) forward+backward of a 4-layer MLP
  (hidden 1024, batch 8 per rank) on 4 ranks: simcomm vs threaded, and the same
  step on one device for the whole batch (no sharding, no communication); on
  all cores and again pinned to one core.
* ``overhead``    - ``World(4).run`` of a program that never touches
  torch.distributed (one ``comm.all_reduce``), with the backend's per-rank hook
  vs with the hook replaced by a no-op: what the backend costs programs that do
  not use it.

Each side times CHUNKS chunks and keeps the fastest (the slower ones measure other
load on the machine); the sides alternate within each round and the table shows
medians over rounds. Only the ratios mean much.

    python benchmarks/torch_distributed.py            # the table
    python benchmarks/torch_distributed.py --quick    # fewer rounds
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import threaded_pg   # a sibling module: this file runs as a script

#: each measurement is split in this many chunks and the fastest chunk counts (as timeit
#: does): on a shared machine the slower chunks measure the other users, not the code
CHUNKS = 5

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the programs, the same on both backends ------------------------------------------------

def all_reduce_program(comm, iters: int) -> float:
    x = torch.ones(256) * dist.get_rank()        # 1 KiB of float32

    def call():
        t = x.clone()                            # all_reduce works in place: a fresh buffer per call
        dist.all_reduce(t)
        return t

    call()
    return _chunked(call, iters)


def all_reduce_async_program(comm, iters: int) -> float:
    x = torch.ones(256) * dist.get_rank()        # 1 KiB of float32

    def call():
        t = x.clone()
        dist.all_reduce(t, async_op=True).wait()  # issued, then waited: the Work's own cost
        return t

    call()
    return _chunked(call, iters)


def _chunked(call, iters: int) -> list[float]:
    """Per-call seconds of each of CHUNKS chunks of ``iters`` calls, between barriers."""
    times = []
    for _ in range(CHUNKS):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            call()
        dist.barrier()
        times.append((time.perf_counter() - start) / iters)
    return times


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(1024, 1024), nn.ReLU()]
    return nn.Sequential(*layers)


def fsdp_program(comm, iters: int) -> float:
    from torch.distributed.fsdp import fully_shard
    model = _mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step():
        model(x).sum().backward()

    step()
    return _chunked(step, iters)


def _world_run_program(comm) -> torch.Tensor:
    return comm.all_reduce(torch.ones(4))


PROGRAMS = {"all_reduce": all_reduce_program, "all_reduce_async": all_reduce_async_program,
            "fsdp": fsdp_program}


# -- one side, run in a fresh process -------------------------------------------------------

def run_simcomm(case: str, world_size: int, iters: int) -> float:
    import simcomm
    return _slowest_rank_fastest_chunk(simcomm.World(world_size).run(PROGRAMS[case], iters))


def _slowest_rank_fastest_chunk(per_rank: list[list[float]]) -> float:
    return min(max(chunk) for chunk in zip(*per_rank))


def run_threaded(case: str, world_size: int, iters: int) -> float:
    return _slowest_rank_fastest_chunk(threaded_pg.run(world_size, PROGRAMS[case], iters))


def run_single(case: str, world_size: int, iters: int) -> float:
    """The FSDP step's math on one device: the whole model, every rank's batch at once."""
    model = _mlp()
    x = torch.cat([torch.randn(8, 1024, generator=torch.Generator().manual_seed(rank))
                   for rank in range(world_size)])   # (world * 8, 1024)
    model(x).sum().backward()
    return min(_timed(lambda: model(x).sum().backward(), iters) for _ in range(CHUNKS))


def _timed(call, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - start) / iters


def run_world(hook: bool, world_size: int, iters: int) -> float:
    import simcomm
    import simcomm.sim.world
    if not hook:
        simcomm.sim.world.rank_process_group = lambda comm: contextlib.nullcontext()
    world = simcomm.World(world_size)
    world.run(_world_run_program)
    return min(_timed(lambda: world.run(_world_run_program), iters) for _ in range(CHUNKS))


def child(side: str, case: str, world_size: int, iters: int) -> float:
    torch.set_num_threads(1)
    if os.environ.get("SIMCOMM_BENCH_ONE_CORE"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    if case == "overhead":
        return run_world(side == "hook", world_size, iters)
    return {"simcomm": run_simcomm, "threaded": run_threaded, "single": run_single}[side](
        case, world_size, iters)


def spawn(side: str, case: str, world_size: int, iters: int, one_core: bool) -> float:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "SIMCOMM_BENCH_ONE_CORE": "1" if one_core else ""}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", __file__, "--child", side, case, str(world_size), str(iters)],
        check=True, capture_output=True, text=True, env=env, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- the table --------------------------------------------------------------------------------

ROWS = [  # (case, world size, iterations, sides, one core; the first side is the numerator of each ratio)
    ("all_reduce", 8, 100, ("simcomm", "threaded"), False),
    ("all_reduce", 8, 100, ("simcomm", "threaded"), True),
    ("all_reduce", 64, 10, ("simcomm", "threaded"), False),
    ("all_reduce_async", 8, 100, ("simcomm", "threaded"), False),
    ("fsdp", 4, 2, ("simcomm", "threaded", "single"), False),
    # virtual ranks take turns (deterministic, one rank runs at a time), while the threaded
    # group's ranks compute in parallel on every core: on one core both have one
    ("fsdp", 4, 2, ("simcomm", "threaded", "single"), True),
    ("overhead", 4, 60, ("hook", "nohook"), False),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one round instead of three")
    parser.add_argument("--child", nargs=4, metavar=("SIDE", "CASE", "WORLD", "ITERS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        side, case, world_size, iters = args.child
        print(json.dumps(child(side, case, int(world_size), int(iters))))
        return 0
    rounds = 1 if args.quick else 3
    print(f"{'case':<18}{'ranks':>6}  " + "  ".join(f"{s:>14}" for s in ("side 1 (us)", "side 2 (us)", "ratio 1/2",
                                                                          "side 3 (us)", "ratio 1/3")))
    for case, world_size, iters, sides, one_core in ROWS:
        samples: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(rounds):
            for side in sides:
                samples[side].append(spawn(side, case, world_size, iters, one_core))
        med = {side: statistics.median(values) for side, values in samples.items()}
        first = med[sides[0]]
        cells = [f"{sides[0]}={first * 1e6:.0f}", f"{sides[1]}={med[sides[1]] * 1e6:.0f}",
                 f"{first / med[sides[1]]:.2f}"]
        if len(sides) > 2:
            cells += [f"{sides[2]}={med[sides[2]] * 1e6:.0f}", f"{first / med[sides[2]]:.2f}"]
        label = case + (" (1 core)" if one_core else "")
        print(f"{label:<18}{world_size:>6}  " + "  ".join(f"{c:>14}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
