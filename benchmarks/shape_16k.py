"""16,384 shape-only ranks: a Llama-3-405B-shaped block stack on TP 8 x PP 16 x DP 128.

The program is written on the communicator's public API, as a planning script
would be: two ``comm.subgroup`` partitions (tensor groups of 8 consecutive
ranks, data groups of ranks ``tp * pp`` apart), each passed whole by every rank
(as ``new_subgroups_by_enumeration`` and ``DeviceMesh`` callers do): built once by
the script and given to every rank, or with ``--per-rank-partitions`` built by
every rank itself, each partition once, right before its call, and dropped after it, as
``DeviceMesh`` builds its groups (each rank's lists are ``O(ranks)``: 0.6 MB a partition
at 16,384 ranks; on
virtual ranks ``subgroup`` does not wait for the other ranks, so a rank's lists are
garbage before the next rank builds its own; a program that keeps its lists
for the whole step holds ``O(ranks**2)`` in one process, as it would hold
``O(ranks)`` in each real process); per pipeline
stage ``layers`` tensor-parallel MLP blocks (hidden 16384, ffn 53248, bf16,
8192 tokens: column-parallel up projection, SiLU, row-parallel down
projection ending in an all-reduce of the tensor group); activations and
gradients sent stage to stage with send/recv on the world communicator;
then a data-parallel all-reduce (average) of every weight's gradient.

Each measurement runs in a fresh process with ``torch.set_num_threads(1)``:
the run (traced and checked by the simulator), the trace's events counted
per rank against what the program issues, and the modelled timeline of the
trace on the ``h100-ndr-cluster`` preset, with as many of
its nodes as the run has ranks (costed). Printed per size: wall and
CPU seconds (``time.process_time``) of each phase, CPU/wall, the trace's
events, the process's peak resident memory, and the share of fake dispatches the
ranks' shared cache answered (:func:`simcomm.sim.shape.dispatch_cache_info`), the run's CPU per
rank and, with ``--per-rank-partitions``, the part of it spent in the program's own list building
(the ranks' thread CPU time around it: what each real process pays too), and a line of the run's
CPU per rank by part: the program's lists, its ``subgroup`` calls, the rest of the program (its
ops, autograd, communication, hand-offs), outside the program (each rank's thread start and end,
the first run's imports) and, within these, Python's garbage collections (``gc.callbacks``,
during ``World.run`` only). A watchdog in the child stops
it (exit 3) once its resident memory passes ``--max-rss`` GiB (default 12),
so a run that grows too large never reaches the kernel's OOM killer on a
shared machine.

    python benchmarks/shape_16k.py                      # 1024, 4096 and 16,384 ranks
    python benchmarks/shape_16k.py --dp 8 32            # 1024 and 4096 ranks only
    python benchmarks/shape_16k.py --before ../main     # beside another checkout (up to 4096 ranks)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = r"""
import json, os, resource, sys, threading, time
limit = float(sys.argv[2]) * 2**30

def watchdog():
    page = os.sysconf("SC_PAGE_SIZE")
    while True:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * page
        if rss > limit:
            sys.stderr.write(f"resident memory {rss / 2**30:.1f} GiB passed --max-rss; stopped\n")
            sys.stderr.flush()
            os._exit(3)
        time.sleep(0.05)

threading.Thread(target=watchdog, daemon=True).start()
import torch
torch.set_num_threads(1)
import simcomm
from simcomm.model.cost import modelled_timeline
from simcomm.model.topology import PRESETS
import dataclasses
tp, pp, dp, layers, hidden, ffn, tokens, per_rank = json.loads(sys.argv[1])

# CPU seconds, all ranks (each rank's thread time): the program's own list building, its subgroup
# calls, the whole program
lists, spent = [0.0], {"subgroup": 0.0, "program": 0.0}

def tensor_groups(world, tp):
    # rank = (d * pp + p) * tp + t: tensor groups are tp consecutive ranks
    return [list(range(base, base + tp)) for base in range(0, world, tp)]

def data_groups(world, tp, pp):
    # data groups: ranks tp * pp apart
    return [list(range(first, world, tp * pp)) for first in range(tp * pp)]

def step(comm, tp, pp, dp, layers, hidden, ffn, tokens, parts=None):
    if parts is not None:
        clock = time.thread_time()
        tensor, data = comm.subgroup(parts[0]), comm.subgroup(parts[1])
        spent["subgroup"] += time.thread_time() - clock
    else:   # each rank builds each partition itself, as DeviceMesh does, and keeps none after its call
        clock = time.thread_time()
        groups = tensor_groups(comm.world_size, tp)
        built = time.thread_time()
        tensor = comm.subgroup(groups)
        called = time.thread_time()
        groups = data_groups(comm.world_size, tp, pp)
        built2 = time.thread_time()
        data = comm.subgroup(groups)
        lists[0] += built - clock + built2 - called
        spent["subgroup"] += called - built + time.thread_time() - built2
        del groups
    stage = comm.rank // tp % pp
    dtype = torch.bfloat16
    weights = [(torch.empty(ffn // tp, hidden, dtype=dtype).requires_grad_(),     # column-parallel
                torch.empty(hidden, ffn // tp, dtype=dtype).requires_grad_())     # row-parallel
               for _ in range(layers)]
    shape = (tokens, hidden)
    x = torch.empty(shape, dtype=dtype) if stage == 0 else comm.recv(shape, dtype, comm.rank - tp)
    inp = x.requires_grad_() if stage else x
    for up, down in weights:
        h = torch.nn.functional.silu(tensor.copy_to_group(x) @ up.T)              # (tokens, ffn/tp)
        x = x + tensor.reduce_from_group(h @ down.T)                             # (tokens, hidden)
        comm.compute(flops=2 * 2 * tokens * hidden * ffn // tp)
    if stage < pp - 1:
        comm.send(x.detach(), comm.rank + tp)
        x.backward(comm.recv(shape, dtype, comm.rank + tp))
    else:
        x.float().pow(2).mean().backward()
    comm.compute(flops=2 * 2 * 2 * tokens * hidden * ffn // tp * layers)
    if stage:
        comm.send(inp.grad, comm.rank - tp)
    for up, down in weights:
        data.all_reduce(up.grad, "avg")
        data.all_reduce(down.grad, "avg")
    return None

world = simcomm.World(tp * pp * dp, tensors="shape")
times = {}
wall, cpu = time.perf_counter(), time.process_time()
# the partitions built once and passed to every rank (a planning script's mesh), as tuples; or
# built by every rank itself (each rank's lists are alive while it waits in subgroup: O(ranks) each)
parts = None if per_rank else tuple(tuple(map(tuple, part)) for part in (tensor_groups(tp * pp * dp, tp),
                                                                         data_groups(tp * pp * dp, tp, pp)))
def timed(comm, *args):
    clock = time.thread_time()
    try:
        return step(comm, *args)
    finally:
        spent["program"] += time.thread_time() - clock

collector = [0.0, 0, 0.0]          # CPU seconds in garbage collections during the run, their number

def on_collection(phase, info):
    if phase == "start":
        collector[2] = time.process_time()
    else:
        collector[0] += time.process_time() - collector[2]
        collector[1] += 1

import gc
gc.callbacks.append(on_collection)
world.run(timed, tp, pp, dp, layers, hidden, ffn, tokens, parts)
gc.callbacks.remove(on_collection)
times["run"] = (time.perf_counter() - wall, time.process_time() - cpu)
wall, cpu = time.perf_counter(), time.process_time()
per_rank = {}
for event in world.trace.events:
    if event.op != "compute":
        per_rank[event.rank] = per_rank.get(event.rank, 0) + 1
stages = {}
for rank, count in per_rank.items():
    stages.setdefault(rank // tp % pp, set()).add(count)
# subgroup x2; per layer 2 all-reduces of the tensor group (forward, and backward except on
# stage 0's first block, whose input needs no gradient) and 2 of the data group; 2 p2p per neighbour
expected = {p: {2 + 4 * layers - (p == 0) + 2 * ((p > 0) + (p < pp - 1))} for p in range(pp)}
if len(per_rank) != tp * pp * dp or stages != expected:
    raise SystemExit(f"trace check failed: events per rank by stage {stages}, expected {expected}")
times["check"] = (time.perf_counter() - wall, time.process_time() - cpu)
wall, cpu = time.perf_counter(), time.process_time()
preset = PRESETS["h100-ndr-cluster"]          # as many of its nodes as the run has ranks
timeline = modelled_timeline(world.trace, dataclasses.replace(preset, nodes=tp * pp * dp // preset.gpus_per_node))
step_s = max(end for _event, _start, end in timeline)
times["cost"] = (time.perf_counter() - wall, time.process_time() - cpu)
try:                                      # the caches every rank's mode consults
    from simcomm.sim.shape import dispatch_cache_info
    hit_rate = dispatch_cache_info()["hit_rate"]
except ImportError:                       # a checkout from before it
    from torch._subclasses.fake_tensor import FakeTensorMode
    cache = FakeTensorMode.cache_info()
    hit_rate = cache.hits / max(cache.hits + cache.misses + sum(cache.bypasses.values()), 1)
print(json.dumps({"times": times, "lists_cpu": lists[0], "subgroup_cpu": spent["subgroup"],
                  "program_cpu": spent["program"], "collections": collector[:2], "events": len(world.trace), "modelled_step_s": step_s,
                  "hit_rate": hit_rate,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def measure(tp: int, pp: int, dp: int, layers: int, hidden: int, ffn: int, tokens: int,
            max_rss_gib: float, timeout: float = 1800, checkout: str | None = None,
            per_rank: bool = False) -> dict:
    """One run in a fresh process: wall and CPU seconds of run, check and cost, events,
    modelled step seconds and peak resident bytes; ``{"error": ...}`` when it failed.
    ``checkout``: import simcomm from that folder (another checkout) instead of this one."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    root = os.path.abspath(checkout or here)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps([tp, pp, dp, layers, hidden, ffn, tokens, per_rank]),
                          str(max_rss_gib)], capture_output=True, text=True, timeout=timeout, cwd=root, env=env)
    if out.returncode:
        return {"error": f"exit {out.returncode}: {out.stderr.strip().splitlines()[-1:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--dp", type=int, nargs="+", default=[8, 32, 128], help="one run per value")
    parser.add_argument("--layers", type=int, default=2, help="MLP blocks per pipeline stage")
    parser.add_argument("--hidden", type=int, default=16384)
    parser.add_argument("--ffn", type=int, default=53248)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--max-rss", type=float, default=12.0, help="GiB; the child stops beyond it")
    parser.add_argument("--per-rank-partitions", action="store_true",
                        help="every rank builds its own partition lists (default: built once, passed to all)")
    parser.add_argument("--before", metavar="CHECKOUT",
                        help="also run each size with simcomm imported from this folder (the code before a change)")
    parser.add_argument("--before-max", type=int, default=4096,
                        help="ranks: larger sizes are not run --before (it held O(ranks**2) memory)")
    args = parser.parse_args(argv)
    out = sys.stdout.write
    out(f"TP {args.tp} x PP {args.pp} x DP, {args.layers} MLP blocks per stage, hidden {args.hidden}, "
        f"ffn {args.ffn}, {args.tokens} tokens, bf16, shape-only\n")
    out("code    ranks  run wall  run CPU  CPU/wall  check wall  check CPU  cost wall  cost CPU  total wall  "
        "total CPU  events    peak RSS  modelled step  fake dispatch hits  run CPU per rank  "
        "of it the program's lists\n")
    for dp in args.dp:
        ranks = args.tp * args.pp * dp
        sides = [("before", args.before)] if args.before and ranks <= args.before_max else []
        for side, checkout in [*sides, ("this", None)]:
            result = measure(args.tp, args.pp, dp, args.layers, args.hidden, args.ffn, args.tokens, args.max_rss,
                             checkout=checkout, per_rank=args.per_rank_partitions)
            if "error" in result:
                out(f"{side:6s}  {ranks:5d}  {result['error']}\n")
                continue
            (run_w, run_c), (check_w, check_c), (cost_w, cost_c) = (result["times"][k] for k in ("run", "check", "cost"))
            out(f"{side:6s}  {ranks:5d}  {run_w:8.1f}  {run_c:7.1f}  {run_c / run_w:8.2f}  {check_w:10.1f}  "
                f"{check_c:9.1f}  {cost_w:9.1f}  {cost_c:8.1f}  {run_w + check_w + cost_w:10.1f}  "
                f"{run_c + check_c + cost_c:9.1f}  {result['events']:7d}  "
                f"{result['peak_rss'] / 2**30:6.2f} GiB  {result['modelled_step_s'] * 1e3:9.1f} ms  "
                f"{result['hit_rate']:18.1%}  {run_c / ranks * 1e6:13.0f} us  "
                f"{result.get('lists_cpu', 0.0) / ranks * 1e6:22.0f} us\n")
            if "program_cpu" in result:
                lists, sub, program = (result[k] / ranks * 1e6 for k in ("lists_cpu", "subgroup_cpu", "program_cpu"))
                collected, collections = result["collections"]
                out(f"        per rank: the program's own lists {lists:.0f} us, its subgroup calls {sub:.0f} us, the rest "
                    f"of the program {program - lists - sub:.0f} us, outside the program {run_c / ranks * 1e6 - program:.0f} us "
                    f"(thread start and end, imports, the run's set-up); within all these, garbage collections "
                    f"{collected / ranks * 1e6:.0f} us ({collections} collections)\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
