"""CPU time per virtual rank of one collective, beside a bare thread handoff and PyTorch's threaded group.

The figure is the whole process's CPU time (``time.process_time``: every
thread) of a run with K calls minus that of the same run with none, divided
by K x ranks: what one rank spends on one call, with start-up and teardown
cancelled out. On a shared, busy machine it moves far less than wall time,
which is printed beside it (same subtraction). Sides, each in a fresh
process of its own with ``torch.set_num_threads(1)``, alternating round by
round; each figure is the minimum over rounds. Every side's process gets the futex hash a
``World.run`` of as many ranks gives it (:func:`simcomm.sim.scheduler.widen_futex_hash`):


* ``ring``     - a bare handoff ring: one thread per rank, a lock each, a token
  passed round the ring K times (no torch): the floor of any simulator whose
  ranks take turns, one handoff per rank per collective;
* ``ring_sem`` - the same ring with the turn handed on by simcomm's compiled hand-off
  (:func:`simcomm.sim.scheduler.handoff`: the interpreter lock dropped before the next rank is
  woken, so it wakes once), the hand-off ``comm`` and ``dist`` use where it was built;
* ``rendezvous`` - the least a simulator whose ranks take turns does per collective, on the
  ring's threads and locks: each rank appends its 1 KiB tensor to a shared list under a lock and
  hands the turn on; the last to arrive sums the stack and gives every other rank a copy (one
  ``clone`` each) (no checks, trace, mismatch or deadlock detection, per-rank random state):
  how far below ``comm`` plain Python and torch calls allow;
* ``comm``     - ``comm.all_reduce`` of 1 KiB (float32) in ``World(n).run``;
* ``dist``     - ``dist.all_reduce`` of 1 KiB on the ``"simcomm"`` backend in
  ``World(n).run``;
* ``threaded`` - ``dist.all_reduce`` of 1 KiB on PyTorch's threaded process group
  (``torch.testing._internal.distributed.multi_threaded_pg``), one thread per rank;
* ``noop``     - ``dist.all_reduce`` of 1 KiB on a Python backend that does nothing (one rank,
  one completed Work for every call, as simcomm's blocking calls return): what torch's own
  ``dist.*`` wrapper and its call from C++ into a Python ``ProcessGroup`` cost, which
  ``dist`` pays on top of ``comm`` whatever the backend does (``(dist - comm) / noop``);
* ``fsdp``     - (``--fsdp``) one FSDP2 forward+backward of 4 x ``Linear(1024)``
  (batch 8 per rank, each layer and the root ``fully_shard``ed) on 4 ranks: per step,
  virtual ranks vs the threaded group, and wall time beside four single-rank steps
  of the per-rank batch (no sharding, no communication).

Tracing is on for the virtual ranks, as in a lesson.

    python benchmarks/cpu_per_rank.py                          # 8, 64, 256 ranks
    python benchmarks/cpu_per_rank.py --world-sizes 8 64 --rounds 3
    python benchmarks/cpu_per_rank.py --fsdp                   # the FSDP2 step too
    python benchmarks/cpu_per_rank.py --sides comm dist --baseline DIR   # DIR: another checkout
    python benchmarks/cpu_per_rank.py --breakdown              # one rank: the layers of one call
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import fsdp_step     # sibling modules: this file runs as a script
import threaded_pg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIDES = ("ring", "ring_sem", "rendezvous", "comm", "dist", "threaded", "noop")
NUMEL = 256                      # 1 KiB of float32


def _timed(run, *args) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    run(*args)
    return time.process_time() - cpu, time.perf_counter() - wall


# -- the sides: run(world_size, calls) does the whole run -------------------------------------

def ring_run(world_size: int, calls: int) -> None:
    locks = [threading.Lock() for _ in range(world_size)]
    for lock in locks:
        lock.acquire()

    def rank(me: int) -> None:
        mine, following = locks[me], locks[(me + 1) % world_size]
        for _ in range(calls):
            mine.acquire()             # wait for the token
            following.release()        # hand it on

    _pass_the_token(rank, world_size, locks[0] if calls else None)


def _pass_the_token(rank, world_size: int, first) -> None:
    """Run ``rank(me)`` on a thread per rank, give ``first`` (rank 0's waiter, or None) the token,
    and wait for every thread."""
    threads = [threading.Thread(target=rank, args=(me,)) for me in range(world_size)]
    for thread in threads:
        thread.start()
    if first is not None:
        first.release()
    for thread in threads:
        thread.join()


def ring_sem_run(world_size: int, calls: int) -> None:
    from simcomm.sim.scheduler import HANDOFF, handoff, new_waiter
    if HANDOFF != "semaphore":
        raise RuntimeError("simcomm's compiled hand-off is not built here (pip install -e . with a C compiler)")
    waiters = [new_waiter() for _ in range(world_size)]

    def rank(me: int) -> None:
        mine, following = waiters[me], waiters[(me + 1) % world_size]
        if not calls:
            return
        mine.acquire()                 # wait for the token
        for _ in range(calls - 1):
            handoff(following, mine)   # hand it on, wait for it again
        following.release()

    _pass_the_token(rank, world_size, waiters[0] if calls else None)


def rendezvous_run(world_size: int, calls: int) -> None:
    import torch
    from collections import deque
    waiters = [threading.Lock() for _ in range(world_size)]
    for waiter in waiters:
        waiter.acquire()
    lock, ready = threading.Lock(), deque(range(1, world_size))
    current = [[[], []]]                 # the open slot: [inputs, ranks waiting on it, (outputs)]

    def hand_on() -> None:
        with lock:
            following = ready.popleft() if ready else None
        if following is not None:
            waiters[following].release()

    def rank(me: int) -> None:
        waiters[me].acquire()
        x, out = torch.ones(NUMEL) * me, None
        for _ in range(calls):
            with lock:
                inputs, waiting = slot = current[0]
                inputs.append(x)
                last = len(inputs) == world_size
                if not last:
                    waiting.append(me)
            if not last:
                hand_on()
                waiters[me].acquire()    # woken (made ready) by the last rank
                out = slot[2][me]
                continue
            total = torch.stack(inputs).sum(0)
            outputs = [total.clone() for _ in range(world_size)]
            slot.append(outputs)
            with lock:
                ready.extend(waiting)
                current[0] = [[], []]
            out = outputs[me]            # this rank keeps the turn
        del out
        hand_on()

    current[0] = [[], []]
    threads = [threading.Thread(target=rank, args=(me,)) for me in range(world_size)]
    for thread in threads:
        thread.start()
    waiters[0].release()
    for thread in threads:
        thread.join()


def _comm_program(comm, calls: int) -> None:
    import torch
    x = torch.ones(NUMEL) * comm.rank
    for _ in range(calls):
        comm.all_reduce(x)             # allocates its output


def _dist_program(comm, calls: int) -> None:
    import torch
    import torch.distributed as dist
    x = torch.ones(NUMEL) * dist.get_rank()
    for _ in range(calls):
        dist.all_reduce(x)             # in place


_world = fsdp_step.world   # one World per world size for the process


def comm_run(world_size: int, calls: int) -> None:
    _world(world_size).run(_comm_program, calls)


def dist_run(world_size: int, calls: int) -> None:
    _world(world_size).run(_dist_program, calls)


def threaded_run(world_size: int, calls: int) -> None:
    threaded_pg.run(world_size, _dist_program, calls)


_NOOP_GROUP: list = []


def _noop_group():
    """A one-rank default group on a registered Python backend whose all_reduce does nothing."""
    if not _NOOP_GROUP:
        import datetime
        import torch.distributed as dist
        from torch._C._distributed_c10d import _create_work_from_future
        from torch.futures import Future

        finished = Future()
        finished.set_result([])
        work = _create_work_from_future(finished)

        class NoopGroup(dist.ProcessGroup):
            def allreduce(self, tensors, opts=None):
                return work

            def getBackendName(self) -> str:
                return "noop"

        dist.Backend.register_backend("noop", lambda store, rank, size, timeout: NoopGroup(rank, size),
                                     devices=["cpu"])
        dist.init_process_group("noop", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=60))
        _NOOP_GROUP.append(dist.group.WORLD)
    return _NOOP_GROUP[0]


def noop_run(world_size: int, calls: int) -> None:
    """``calls x world_size`` dist.all_reduce calls on the do-nothing backend (one thread)."""
    import torch
    import torch.distributed as dist
    _noop_group()
    x = torch.ones(NUMEL)
    for _ in range(calls * world_size):
        dist.all_reduce(x)


# -- FSDP2: one forward+backward on 4 ranks ---------------------------------------------------

# the program of benchmarks/fsdp_step.py (a sibling module), which also runs it on more sides
FSDP_RANKS, FSDP_HIDDEN, FSDP_BATCH = fsdp_step.RANKS, fsdp_step.HIDDEN, fsdp_step.BATCH
_mlp, _fsdp_program = fsdp_step.mlp, fsdp_step.fsdp_program


def fsdp_run(world_size: int, steps: int) -> None:
    _world(world_size).run(_fsdp_program, steps)


def fsdp_threaded_run(world_size: int, steps: int) -> None:
    threaded_pg.run(world_size, _fsdp_program, steps)


def fsdp_single_run(world_size: int, steps: int) -> None:
    """``world_size`` single-rank steps of the per-rank batch per step: no sharding."""
    import torch
    model = _mlp()
    x = torch.randn(FSDP_BATCH, FSDP_HIDDEN, generator=torch.Generator().manual_seed(0))
    for _ in range(steps * world_size):
        model(x).sum().backward()


# -- where one call's CPU time goes: layers peeled off on one rank (no handoff) ------------------

def _layers_program(comm, calls: int, layer: str) -> None:
    import torch
    x = torch.ones(NUMEL) * comm.rank
    transport = comm.transport
    if layer == "clone":
        for _ in range(calls):
            x.clone()
    elif layer == "transport":
        for _ in range(calls):
            transport.all_reduce(x, "sum")
    else:
        for _ in range(calls):
            comm.all_reduce(x)


def breakdown(calls: int = 20000) -> dict[str, float]:
    """CPU us per call on one rank (``World(1)``: no handoff) of ``comm.all_reduce``, of the
    transport call alone, of ``comm.all_reduce`` untraced, and of the output's own copy."""
    import simcomm
    import torch
    torch.set_num_threads(1)
    result = {}
    for name, world, layer in (("comm.all_reduce", simcomm.World(1), "comm"),
                               ("SimTransport.all_reduce", simcomm.World(1), "transport"),
                               ("comm.all_reduce, no trace", simcomm.World(1, trace=False), "comm"),
                               ("x.clone() (the output's copy)", simcomm.World(1), "clone")):
        world.run(_layers_program, 2, layer)
        best = []
        for _ in range(5):
            base = _timed(world.run, _layers_program, 0, layer)[0]
            best.append(_timed(world.run, _layers_program, calls, layer)[0] - base)
        result[name] = min(best) / calls * 1e6
    return result


RUNS = {"ring": ring_run, "ring_sem": ring_sem_run, "rendezvous": rendezvous_run, "comm": comm_run, "dist": dist_run, "threaded": threaded_run,
        "noop": noop_run, "fsdp": fsdp_run, "fsdp_threaded": fsdp_threaded_run, "fsdp_single": fsdp_single_run}


def worker(side: str, world_size: int, calls: int) -> None:
    """Print ``{"cpu": s, "wall": s}`` of a run with ``calls`` minus a run with none."""
    import torch
    torch.set_num_threads(1)
    try:        # every side's threads sleep in a futex hash of the same size (World.run widens it)
        from simcomm.sim.scheduler import widen_futex_hash
        widen_futex_hash(world_size)
    except ImportError:                                 # a checkout from before it
        pass
    run = RUNS[side]
    run(world_size, 2)                                  # warm-up: imports, first-call caches
    base, full = [], []
    for _ in range(3):
        base.append(_timed(run, world_size, 0))
        full.append(_timed(run, world_size, calls))
    cpu = min(c for c, _ in full) - min(c for c, _ in base)
    wall = min(w for _, w in full) - min(w for _, w in base)
    print(json.dumps({"cpu": cpu, "wall": wall}))


def measure(side: str, world_size: int, calls: int, root: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", side, str(world_size),
                           str(calls)], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"the {side} worker at {world_size} ranks failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _best(samples: list[dict]) -> dict[str, float]:
    return {key: min(sample[key] for sample in samples) for key in ("cpu", "wall")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=32768, help="calls x ranks per run (K = this / ranks)")
    parser.add_argument("--fsdp", action="store_true", help="also the FSDP2 step on 4 ranks")
    parser.add_argument("--fsdp-steps", type=int, default=10)
    parser.add_argument("--baseline", help="another checkout, measured as the sides 'comm@base', 'dist@base'")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--breakdown", action="store_true",
                        help="only: where one call's CPU time goes, on one rank (layers peeled off)")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.breakdown:
        print("comm.all_reduce of 1 KiB on one rank (World(1): no handoff), CPU us per call")
        for name, micros in breakdown().items():
            print(f"{name:<34}{micros:>7.2f}")
        return 0
    if args.worker:
        side, world_size, calls = args.worker
        worker(side, int(world_size), int(calls))
        return 0

    sides = [(side, ROOT) for side in args.sides]
    if args.baseline:
        sides += [(f"{side}@base", os.path.abspath(args.baseline)) for side in args.sides if side in ("comm", "dist")]
    rows: dict = {}
    print("1 KiB all_reduce: CPU and wall time per rank per call (us); each side in a fresh process")
    width = {name: max(14, len(name) + 6) for name, _ in sides}
    header = f"{'ranks':>5}" + "".join(f"{name + ' cpu':>{width[name]}}{'wall':>8}" for name, _ in sides)
    print(header)
    for world_size in args.world_sizes:
        calls = max(args.calls // world_size, 8)
        samples: dict[str, list] = {name: [] for name, _ in sides}
        for _ in range(args.rounds):
            for name, root in sides:
                samples[name].append(measure(name.split("@")[0], world_size, calls, root))
        row = {name: {k: v / (calls * world_size) * 1e6 for k, v in _best(s).items()} for name, s in samples.items()}
        rows[world_size] = row
        print(f"{world_size:>5}" + "".join(f"{row[name]['cpu']:>{width[name]}.1f}{row[name]['wall']:>8.1f}"
                                           for name, _ in sides), flush=True)
    ratios = [("comm", "threaded"), ("comm", "ring"), ("ring_sem", "ring"), ("comm", "ring_sem"),
              ("rendezvous", "ring"), ("comm", "rendezvous"),
              ("dist", "comm"), ("dist", "threaded"),
              ("comm", "comm@base"), ("dist", "dist@base")]
    names = {name for name, _ in sides}
    ratios = [(a, b) for a, b in ratios if a in names and b in names]
    if ratios:
        print("\nCPU ratios (wall ratios in brackets)")
        print(f"{'ranks':>5}" + "".join(f"{a + '/' + b:>22}" for a, b in ratios))
        for world_size, row in rows.items():
            print(f"{world_size:>5}" + "".join(
                f"{row[a]['cpu'] / row[b]['cpu']:>14.2f} ({row[a]['wall'] / row[b]['wall']:>5.2f})"
                for a, b in ratios))
    if {"dist", "comm", "noop"} <= names:
        print("\nwhat dist.* adds to comm.*, beside torch's own cost of a call into a Python backend (CPU us)")
        print(f"{'ranks':>5}{'dist - comm':>14}{'noop':>8}{'the rest':>10}")
        for world_size, row in rows.items():
            extra, floor = row["dist"]["cpu"] - row["comm"]["cpu"], row["noop"]["cpu"]
            print(f"{world_size:>5}{extra:>14.1f}{floor:>8.1f}{extra - floor:>10.1f}")
    result = {"all_reduce_1KiB": rows}
    if args.fsdp:
        fsdp_sides = ("fsdp", "fsdp_threaded", "fsdp_single")
        fsdp: dict[str, list] = {side: [] for side in fsdp_sides}
        for _ in range(args.rounds):
            for side in fsdp_sides:
                fsdp[side].append(measure(side, FSDP_RANKS, args.fsdp_steps, ROOT))
        best = {side: {k: v / args.fsdp_steps * 1e3 for k, v in _best(s).items()} for side, s in fsdp.items()}
        result["fsdp2_step_ms"] = best
        print(f"\nFSDP2 fwd+bwd, 4 x Linear({FSDP_HIDDEN}), batch {FSDP_BATCH} per rank, {FSDP_RANKS} ranks: "
              f"per step (ms)")
        print(f"{'side':<40}{'cpu ms':>9}{'wall ms':>9}")
        labels = {"fsdp": "virtual ranks", "fsdp_threaded": "threaded process group",
                  "fsdp_single": f"{FSDP_RANKS} single-rank steps, per-rank batch"}
        for side in fsdp_sides:
            print(f"{labels[side]:<40}{best[side]['cpu']:>9.1f}{best[side]['wall']:>9.1f}")
        print(f"virtual/threaded CPU {best['fsdp']['cpu'] / best['fsdp_threaded']['cpu']:.2f}; "
              f"virtual/single wall {best['fsdp']['wall'] / best['fsdp_single']['wall']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
