"""``python -m real.verify``: check a node's collectives against the single-device reference.

Every case of :mod:`real.cases` and :mod:`real.model_cases` (every collective of
``simcomm.specs.SPECS``, forward and backward, with each reduce op, several dims
including negative ones, both roots and uneven splits; the same issued with
``async_op=True``; point-to-point rings; a tensor-parallel MLP, Ulysses attention and a 2D
(tp x dp) subgroup program) runs on real processes; each rank's outputs and
gradients are compared with the same computation on one device in float64,
and with simcomm's simulator. The table lists, per case, the largest forward
and gradient error and whether the case passed; the exit status is non-zero
if any case failed.

Two ways to start it::

    torchrun --standalone --nproc-per-node <GPUs> -m real.verify        # NCCL, one GPU per rank
    torchrun --standalone --nproc-per-node 2 -m real.verify --backend gloo
    python -m real.verify --nproc 4 --backend gloo                      # spawns its own workers

Under ``torchrun`` (env:// rendezvous; multi-node through torchrun's own
flags) rank 0 gathers every rank's results, prints the table and tells the
other ranks the verdict.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback

import torch

from simcomm.communicator import Communicator
from simcomm.sim.world import World

from .cases import Case, async_cases, collective_cases, rooted_and_uneven_cases
from .faults import FAULTS, injected
from .model_cases import model_cases

__all__ = ["all_cases", "run_cases", "evaluate", "format_table", "main"]

FAULT_ENV = "SIMCOMM_VERIFY_FAULT"
#: float64 results may differ from the reference by reduction order only
TOLERANCE = 1e-9


def all_cases() -> list[Case]:
    return collective_cases() + rooted_and_uneven_cases() + async_cases() + model_cases()


def run_cases(comm: Communicator, names: list[str] | None = None, fault: str | None = None) -> dict:
    """The suite's SPMD program: ``{case: (outputs, grads)}`` for this rank, or ``{case: "error text"}``.

    ``fault`` names a wrong backward rule to use while the cases run
    (:mod:`real.faults`); the rules are restored afterwards.
    """
    results: dict = {}
    with injected(fault):
        for case in all_cases():
            if names is not None and case.name not in names:
                continue
            try:
                results[case.name] = case.program(comm)
            except Exception as error:
                results[case.name] = f"{type(error).__name__}: {error}"
    return results


def _max_error(actual: list, expected: list) -> float:
    if len(actual) != len(expected):
        return math.inf
    worst = 0.0
    for a, e in zip(actual, expected):
        if a is None or e is None:
            if a is not e:
                return math.inf
            continue
        if a.shape != e.shape:
            return math.inf
        if a.numel():
            worst = max(worst, (a.double() - e.double()).abs().max().item())
    return worst


def _scale(expected: list) -> float:
    return max([1.0] + [t.abs().max().item() for t in expected if t is not None and t.numel()])


def evaluate(world_size: int, real: list[dict], sim: list[dict] | None = None) -> list[dict]:
    """One row per case: max forward/gradient error over ranks, max |real - sim|, pass."""
    rows = []
    for case in all_cases():
        if case.name not in real[0]:
            continue
        row = {"case": case.name, "fwd_err": 0.0, "grad_err": 0.0 if case.has_grads else None,
               "sim_err": 0.0 if sim is not None else None, "passed": True, "error": None}
        try:
            reference = case.reference(world_size)
        except Exception as error:
            reference = None
            row["error"] = f"reference failed: {type(error).__name__}: {error}"
        for rank in range(world_size):
            got = real[rank].get(case.name)
            if isinstance(got, str) or reference is None:
                row["error"] = row["error"] or f"rank {rank}: {got}"
                row["fwd_err"] = math.inf
                continue
            (outs, grads), (ref_outs, ref_grads) = got, reference[rank]
            tolerance = TOLERANCE * max(_scale(ref_outs), _scale(ref_grads))
            fwd, grad = _max_error(outs, ref_outs), _max_error(grads, ref_grads)
            row["fwd_err"] = max(row["fwd_err"], fwd)
            if case.has_grads:
                row["grad_err"] = max(row["grad_err"], grad)
            passed = fwd <= tolerance and (grad <= tolerance or not case.has_grads)
            if sim is not None:
                simulated = sim[rank].get(case.name)
                diff = (math.inf if isinstance(simulated, str) else
                        max(_max_error(outs, simulated[0]), _max_error(grads, simulated[1])))
                row["sim_err"] = max(row["sim_err"], diff)
                passed = passed and diff <= tolerance
            row["passed"] = row["passed"] and passed
        row["passed"] = row["passed"] and row["error"] is None
        rows.append(row)
    return rows


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def format_table(rows: list[dict], header: str) -> str:
    width = max([len("case")] + [len(r["case"]) for r in rows]) + 2
    lines = [header, f"{'case':<{width}}{'max fwd err':>13}{'max grad err':>14}{'max |real-sim|':>16}  pass"]
    for r in rows:
        lines.append(f"{r['case']:<{width}}{_fmt(r['fwd_err']):>13}{_fmt(r['grad_err']):>14}"
                     f"{_fmt(r['sim_err']):>16}  {'ok' if r['passed'] else 'FAIL'}")
        if r["error"]:
            lines.append(f"    {r['error']}")
    passed = sum(r["passed"] for r in rows)
    lines.append(f"{passed}/{len(rows)} cases passed")
    return "\n".join(lines)


def _report(rows: list[dict], world_size: int, backend: str, device: str, json_path: str | None,
            fault: str | None) -> bool:
    header = (f"real.verify: {world_size} ranks, backend {backend}, device {device}; float64, compared with "
              f"the single-device reference and the simulator (tolerance {TOLERANCE:g} x scale)")
    if fault:
        header += f"\ninjected fault: {fault}"
    print(format_table(rows, header), flush=True)
    ok = bool(rows) and all(r["passed"] for r in rows)
    if json_path:
        def finite(v):
            return None if v is None or math.isinf(v) else v
        data = {"world_size": world_size, "backend": backend, "device": device, "fault": fault, "passed": ok,
                "cases": [{**r, "fwd_err": finite(r["fwd_err"]), "grad_err": finite(r["grad_err"]),
                           "sim_err": finite(r["sim_err"])} for r in rows]}
        with open(json_path, "w") as f:
            json.dump(data, f, indent=2)
    return ok


def _simulate(world_size: int, names: list[str] | None) -> list[dict]:
    return World(world_size, trace=False).run(run_cases, names, timeout=600)


def _standalone(args: argparse.Namespace, fault: str | None) -> bool:
    from .launcher import Cluster

    with Cluster(args.nproc, backend=args.backend, timeout=args.timeout, checked=False) as cluster:
        real = cluster.run(run_cases, args.cases, fault)
        device = ", ".join(sorted(set(cluster.devices)))
        backend = cluster.backend
    rows = evaluate(args.nproc, list(real), _simulate(args.nproc, args.cases))
    return _report(rows, args.nproc, backend, device, args.json, fault)


def _under_torchrun(args: argparse.Namespace, fault: str | None) -> bool:
    import torch.distributed as dist

    from .process_group import init_from_env

    comm = init_from_env(args.backend, timeout=args.timeout, trace=False)
    mine = run_cases(comm, args.cases, fault)
    gathered = [None] * comm.world_size if comm.rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    verdict = [False]
    if comm.rank == 0:
        try:
            rows = evaluate(comm.world_size, gathered, _simulate(comm.world_size, args.cases))
            verdict[0] = _report(rows, comm.world_size, str(dist.get_backend()), str(comm.device),
                                 args.json, fault)
        except Exception:
            traceback.print_exc()
    dist.broadcast_object_list(verdict, src=0)
    dist.barrier()                  # nobody closes its connections while a peer still reads from them
    dist.destroy_process_group()
    return verdict[0]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m real.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=None,
                        help="spawn this many worker processes (default under torchrun: its processes; "
                             "otherwise the number of GPUs, or 2)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                        help="default: nccl with a GPU per rank, else gloo")
    parser.add_argument("--json", metavar="PATH", help="also write the table as JSON to PATH")
    parser.add_argument("--cases", nargs="+", metavar="NAME", help="run only these cases")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a stuck run fails")
    parser.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)
    return parser


def chosen_fault(flag: str | None) -> str | None:
    """The wrong rule to inject: the hidden ``--inject-fault`` flag, else ``$SIMCOMM_VERIFY_FAULT``."""
    fault = flag or os.environ.get(FAULT_ENV) or None
    if fault is not None and fault not in FAULTS:
        raise SystemExit(f"real.verify: unknown fault {fault!r}; known: {sorted(FAULTS)}")
    return fault


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    known = [case.name for case in all_cases()]
    unknown = [name for name in args.cases or [] if name not in known]
    if unknown:
        parser.error(f"--cases: unknown case(s) {unknown}; known: {known}")
    fault = chosen_fault(args.inject_fault)
    torchrun = args.nproc is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if torchrun:
        ok = _under_torchrun(args, fault)
    else:
        if args.nproc is None:
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            args.nproc = gpus if gpus >= 2 else 2
        ok = _standalone(args, fault)
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    if "RANK" in os.environ:        # under torchrun: leave without the interpreter's teardown of
        sys.stdout.flush()          # torch and gloo's threads, which can abort a process at exit
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
