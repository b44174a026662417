"""``python -m simcomm.run --nproc-per-node 4`` against ``torchrun --nproc-per-node 4`` of the same
small script, and what per-rank process state costs at each turn handoff; ratios in one run.

Launch (each command in a fresh process, rounds alternating between the two):

* ``first collective``: from starting the command to the moment the last rank's first
  ``dist.all_reduce`` returned (the script prints ``time.time()`` there);
* ``wall``: from starting the command to its exit;
* ``its CPU``: the ranks' CPU time up to that point (``time.process_time()`` in the
  script: simcomm.run's one process; the sum over torchrun's worker processes, without
  the launcher's own);
* ``CPU``: user + system time of the command and everything it waited for
  (``resource.getrusage(RUSAGE_CHILDREN)``), beside the wall time.

The script sets ``torch.set_num_threads(1)``, trains a tiny DDP model for ``--steps`` steps
and exits.

Handoff: a World of 4 ranks runs ``--barriers`` barriers (each is 4 turn handoffs), each case
in a fresh process with ``torch.set_num_threads(1)``: "torch only" puts back the handoff of
before (torch's generator alone), "per-rank process state" is the current one (torch, Python
``random`` and NumPy state, ``sys.argv``, ``__main__``), "... drawing" makes every rank draw
from Python's and NumPy's generators between barriers (so every handoff saves and loads them),
"... time.sleep(0)" makes every rank call ``time.sleep(0)`` before each barrier (each call hands
the turn on once more: simcomm.sim.waiting), "without global hooks" is the current handoff without
the swap of torch's global hooks (:mod:`simcomm.sim.rank_hooks`), and "each rank with a global hook"
has every rank register a module forward hook first, so every handoff swaps the hook dicts. Time per
barrier handoff: wall and CPU (``time.process_time``). ``--handoff-only`` skips the launch table.

    python benchmarks/launch_script.py                 # both tables
    python benchmarks/launch_script.py --rounds 5 --json out.json
    python benchmarks/launch_script.py --handoff-only --rounds 9
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = '''
import sys, time
import torch
torch.set_num_threads(1)
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
print(f"first_collective_at {time.time():.6f} cpu {time.process_time():.6f}", flush=True)
torch.manual_seed(0)
model = DistributedDataParallel(nn.Linear(16, 16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(int(sys.argv[1])):
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"loss {loss.item():.6e}")
dist.destroy_process_group()
'''

HANDOFF = '''
import json, random, sys, time
import torch
torch.set_num_threads(1)
import numpy as np
import simcomm
from simcomm.sim.process_state import RankProcessState
case, barriers = sys.argv[1], int(sys.argv[2])
if case == "torch only":
    def hand_off(self, rank):
        self.torch.hand_off(rank)
    def take_turn(self, rank):
        self.torch.take_turn(rank)
    RankProcessState.hand_off, RankProcessState.take_turn = hand_off, take_turn
if case == "without global hooks":
    from simcomm.sim.rank_hooks import RankHooks
    RankHooks.hand_off = RankHooks.take_turn = lambda self, rank: None
drawing = case.endswith("drawing")
hooked = case.endswith("global hook")
sleeping = case.endswith("time.sleep(0)")
def program(comm):
    if hooked:
        torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    for _ in range(barriers):
        if drawing:
            random.random(); np.random.rand()
        if sleeping:
            time.sleep(0)
        comm.barrier()
world = simcomm.World(4)
world.run(program)               # warm up
wall, cpu = time.perf_counter(), time.process_time()
world.run(program)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"wall_us": wall / (4 * barriers) * 1e6, "cpu_us": cpu / (4 * barriers) * 1e6}))
'''


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def launch_once(command: list[str], cwd: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cpu, start_epoch, start = _children_cpu(), time.time(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)
    wall, cpu = time.perf_counter() - start, _children_cpu() - cpu
    if done.returncode != 0:
        raise RuntimeError(f"{command} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    marks = [line.split("first_collective_at ", 1)[1].split() for line in
             (done.stdout + done.stderr).splitlines() if "first_collective_at" in line]
    firsts = [float(mark[0]) for mark in marks]
    cpus = [float(mark[2]) for mark in marks]
    # the ranks' CPU time up to their first collective: one process here, one per rank there
    first_cpu = max(cpus) if command[1:3] == ["-m", "simcomm.run"] else sum(cpus)
    return {"first_collective_s": max(firsts) - start_epoch, "first_collective_cpu_s": first_cpu,
            "wall_s": wall, "cpu_s": cpu, "ranks_reporting": len(firsts)}


def handoff_once(case: str, barriers: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", HANDOFF, case, str(barriers)], capture_output=True,
                          text=True, env=env, timeout=600, cwd=str(ROOT))
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--barriers", type=int, default=2000)
    parser.add_argument("--json", help="also write the numbers to this file")
    parser.add_argument("--handoff-only", action="store_true", help="only the handoff table")
    options = parser.parse_args()
    samples: dict[str, list[dict]] = {}
    medians: dict[str, dict] = {}
    if not options.handoff_only:
        samples, medians = launch_table(options)
    handoff_table(options, samples, medians)


def launch_table(options: argparse.Namespace) -> tuple[dict, dict]:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    launchers = {
        "simcomm.run": [sys.executable, "-m", "simcomm.run"],
        "torchrun": [torchrun, "--standalone"],
    }
    samples: dict[str, list[dict]] = {name: [] for name in launchers}
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "small_ddp.py"
        script.write_text(SCRIPT)
        for _ in range(options.rounds):
            for name, launcher in launchers.items():
                samples[name].append(launch_once(
                    [*launcher, "--nproc-per-node", str(options.nproc), str(script), str(options.steps)],
                    folder))
    medians = {name: {key: statistics.median(s[key] for s in runs) for key in
                      ("first_collective_s", "first_collective_cpu_s", "wall_s", "cpu_s")}
               for name, runs in samples.items()}
    print(f"launch: {options.nproc} ranks, {options.steps} DDP steps, median of {options.rounds} "
          f"rounds (seconds)")
    columns = (("first collective", "first_collective_s"), ("its CPU", "first_collective_cpu_s"),
               ("wall", "wall_s"), ("CPU", "cpu_s"))
    print(f"{'':14}" + "".join(f"{title:>18}" for title, _ in columns))
    for name, numbers in medians.items():
        print(f"{name:14}" + "".join(f"{numbers[key]:18.2f}" for _, key in columns))
    sim, ref = medians["simcomm.run"], medians["torchrun"]
    print(f"{'ratio':14}" + "".join(f"{sim[key] / ref[key]:18.2f}" for _, key in columns)
          + "   (simcomm.run / torchrun)")
    return samples, medians


def handoff_table(options: argparse.Namespace, samples: dict, medians: dict) -> None:
    cases = ["torch only", "without global hooks", "per-rank process state", "per-rank process state, drawing",
             "per-rank process state, time.sleep(0)", "each rank with a global hook"]
    handoff = {case: [] for case in cases}
    for _ in range(options.rounds):
        for case in cases:
            handoff[case].append(handoff_once(case, options.barriers))
    handoff_medians = {case: {key: statistics.median(s[key] for s in runs) for key in ("wall_us", "cpu_us")}
                       for case, runs in handoff.items()}
    print(f"\nhandoff: World(4), {options.barriers} barriers, median of {options.rounds} (us per handoff)")
    print(f"{'':40}{'wall':>8}{'CPU':>8}{'ratio':>8}")
    base = handoff_medians["torch only"]["wall_us"]
    for case, numbers in handoff_medians.items():
        print(f"{case:40}{numbers['wall_us']:8.1f}{numbers['cpu_us']:8.1f}{numbers['wall_us'] / base:8.2f}")
    if options.json:
        Path(options.json).write_text(json.dumps({"launch": samples, "launch_medians": medians,
                                                  "handoff": handoff, "handoff_medians": handoff_medians},
                                                 indent=1))


if __name__ == "__main__":
    main()
