"""``python -m real.bench``: nccl-tests-style bandwidth table, with the cost model beside it.

Times the raw ``torch.distributed`` collectives (no autograd, no copies) over
a range of sizes and prints, per op, nccl-tests' columns: size, count, type,
time, algbw, busbw and #wrong, the number of output elements that differ
from the values expected from every rank's known input.

    torchrun --nproc-per-node 8 -m real.bench -b 1M -e 1G -f 4 --model h100-nvswitch
    python -m real.bench --nproc 4 --backend gloo -b 1K -e 1M --json bench.json

Sizes follow nccl-tests (:func:`simcomm.model.cost.nccl_size`, the one place the
convention is written: the per-rank buffer for all_reduce, broadcast and
send_recv; the whole output of all_gather; the whole input of reduce_scatter;
each rank's send buffer of all_to_all), rounded down to whole elements per rank
(:func:`simcomm.model.cost.nccl_counts`). Op names and their other spellings
(``allreduce``, ``sendrecv``...) come from :mod:`simcomm.ops`. The reported time is the slowest
rank's average over ``-n`` iterations, between barriers, after ``-w`` warm-up
iterations. send_recv: every rank sends to the next rank and receives from the
previous one at once.

The exit status is 1 when any element is wrong. Setting the environment
variable ``SIMCOMM_BENCH_CORRUPT_RANK=<rank>`` adds 1 to that rank's input
before the correctness pass, to check that wrong results are caught.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from simcomm.model.cost import GB, PRESETS, busbw_factor, estimate, get_topology, nccl_counts
from simcomm.ops import canonical_op

__all__ = ["OPS", "parse_size", "sizes", "measure", "format_report", "main"]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")
DTYPES = {"float": torch.float32, "double": torch.float64, "int32": torch.int32}
CORRUPT_ENV = "SIMCOMM_BENCH_CORRUPT_RANK"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str | int) -> int:
    """``"8"``, ``"32K"``, ``"128M"``, ``"1G"`` (powers of 1024, as nccl-tests) to bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text).upper())
    if match is None:
        raise ValueError(f"real.bench: size {text!r} is not a number of bytes like 8, 32K, 128M or 1G")
    return int(match.group(1)) * _UNITS[match.group(2)]


def sizes(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """``minbytes, minbytes*factor, ...`` up to ``maxbytes`` (nccl-tests' -b/-e/-f)."""
    if minbytes < 1 or maxbytes < minbytes:
        raise ValueError(f"real.bench: need 1 <= -b <= -e, got -b {minbytes} -e {maxbytes}")
    if factor < 2:
        raise ValueError(f"real.bench: -f (step factor) must be >= 2, got {factor}")
    out, size = [], minbytes
    while size <= maxbytes:
        out.append(size)
        size *= factor
    return out


# --- the worker side: buffers, expected values, timing ------------------------------------------

def _pattern(rank: int, count: int, dtype: torch.dtype, device, offset: int = 0) -> torch.Tensor:
    """Rank ``rank``'s known input: small integers, exact in every supported dtype and in sums."""
    index = torch.arange(offset, offset + count, device=device, dtype=torch.int64)
    return ((rank + 1) * 16 + index % 13).to(dtype)  # (count,)


def _shape(op: str, size: int, world_size: int, itemsize: int) -> tuple[int, int]:
    """(elements in the nccl-tests size, elements of one rank's input) for ``size`` bytes."""
    return nccl_counts(op, size, world_size, itemsize)


# flat-buffer all-gather / reduce-scatter: the newer names where torch has them
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Case:
    """Buffers and the call of one op at one size on this rank, and its expected output."""

    def __init__(self, op: str, size: int, dtype: torch.dtype, group, device):
        self.op, self.group = op, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        n, rank = self.world_size, self.rank
        self.count, in_count = _shape(op, size, n, torch.empty((), dtype=dtype).element_size())
        self.nbytes = self.count * torch.empty((), dtype=dtype).element_size()
        self.input = _pattern(rank, in_count, dtype, device)
        chunk = self.count // n
        if op == "all_reduce":
            self.expected = sum(_pattern(r, in_count, dtype, device) for r in range(n))
            self.output = self.input                      # in place
        elif op == "all_gather":
            self.expected = torch.cat([_pattern(r, in_count, dtype, device) for r in range(n)])
            self.output = torch.empty(self.count, dtype=dtype, device=device)
        elif op == "reduce_scatter":
            self.expected = sum(_pattern(r, chunk, dtype, device, offset=rank * chunk) for r in range(n))
            self.output = torch.empty(chunk, dtype=dtype, device=device)
        elif op == "all_to_all":
            # chunk j of rank r goes to rank j: rank r receives chunk r of every rank
            self.expected = torch.cat([_pattern(r, chunk, dtype, device, offset=rank * chunk)
                                       for r in range(n)])
            self.output = torch.empty(self.count, dtype=dtype, device=device)
        elif op == "broadcast":
            self.expected = _pattern(0, in_count, dtype, device)
            self.output = self.input                      # in place, from group rank 0
        elif op == "send_recv":
            self.expected = _pattern((rank - 1) % n, in_count, dtype, device)
            self.output = torch.empty(in_count, dtype=dtype, device=device)
        else:
            raise ValueError(f"real.bench: unknown op {op!r}; ops: {list(OPS)}")
        self.root = dist.get_global_rank(group, 0) if group is not None else 0
        self.next = dist.get_global_rank(group, (rank + 1) % n) if group is not None else (rank + 1) % n
        self.prev = dist.get_global_rank(group, (rank - 1) % n) if group is not None else (rank - 1) % n

    def call(self) -> None:
        """One raw collective on the current buffers (blocking)."""
        op, group = self.op, self.group
        if op == "all_reduce":
            dist.all_reduce(self.input, group=group)
        elif op == "all_gather":
            _all_gather_flat(self.output, self.input, group=group)
        elif op == "reduce_scatter":
            _reduce_scatter_flat(self.output, self.input, group=group)
        elif op == "all_to_all":
            dist.all_to_all_single(self.output, self.input, group=group)
        elif op == "broadcast":
            dist.broadcast(self.input, src=self.root, group=group)
        elif op == "send_recv":
            requests = dist.batch_isend_irecv([
                dist.P2POp(dist.isend, self.input, self.next, group),
                dist.P2POp(dist.irecv, self.output, self.prev, group)])
            for request in requests:
                request.wait()

    def count_wrong(self, corrupt: bool) -> int:
        """Run once on fresh inputs; the number of output elements that differ from expected."""
        self.input.copy_(_pattern(self.rank, self.input.numel(), self.input.dtype, self.input.device))
        if corrupt:
            self.input += 1
        self.call()
        return int((self.output != self.expected).sum())


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(ops: Sequence[str], byte_sizes: Sequence[int], *, dtype: torch.dtype = torch.float32,
            iters: int = 20, warmup: int = 5, check: bool = True, group=None, device="cpu",
            corrupt_rank: int | None = None) -> list[dict]:
    """Time every op at every size on this rank's process group; the same rows on every rank.

    Each row: op, size (bytes, nccl-tests convention), count, type, time_us
    (slowest rank's mean), algbw and busbw (GB/s), wrong (elements, summed
    over ranks; ``None`` without ``check``). Must be called by every rank.
    """
    world_size = dist.get_world_size(group)
    rank = dist.get_rank(group)
    type_name = next(name for name, value in DTYPES.items() if value == dtype)
    rows = []
    for op in ops:
        for size in byte_sizes:
            case = _Case(op, size, dtype, group, device)
            wrong = None
            if check:
                local = torch.tensor([case.count_wrong(corrupt_rank == rank)], dtype=torch.int64,
                                     device=device)
                dist.all_reduce(local, group=group)
                wrong = int(local.item())
            for _ in range(warmup):
                case.call()
            _sync(device)
            dist.barrier(group=group)
            start = time.perf_counter()
            for _ in range(iters):
                case.call()
            _sync(device)
            elapsed = torch.tensor([(time.perf_counter() - start) / max(iters, 1)],
                                   dtype=torch.float64, device=device)
            dist.barrier(group=group)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
            seconds = float(elapsed.item())
            algbw = case.nbytes / seconds / GB if seconds > 0 else float("inf")
            rows.append({"op": op, "size": case.nbytes, "count": case.count, "type": type_name,
                         "time_us": seconds * 1e6, "algbw": algbw,
                         "busbw": algbw * busbw_factor(op, world_size), "wrong": wrong})
    return rows


def _with_model(rows: list[dict], world_size: int, preset: str | None) -> list[dict]:
    if preset is None:
        return rows
    topology = get_topology(preset)
    for row in rows:
        model = estimate(row["op"], row["size"], world_size, topology)
        row["model"] = {"preset": topology.name, "algorithm": model.algorithm,
                        "time_us": model.time * 1e6, "busbw": model.busbw / GB}
    return rows


def format_report(rows: list[dict], meta: dict) -> str:
    """The nccl-tests-style table of ``rows`` (one section per op) as text."""
    model = meta.get("model")
    lines = [f"# real.bench  nranks {meta['world_size']}  backend {meta['backend']}  "
             f"iters {meta['iters']}  warmup {meta['warmup']}  check {int(meta['check'])}"
             + (f"  model {model}" if model else "")]
    head = f"#{'size':>12} {'count':>12} {'type':>7} {'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}"
    unit = f"#{'(B)':>12} {'(elements)':>12} {'':>7} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}"
    if model:
        head += f"  | {'algo':>6} {'model':>10} {'busbw':>8} {'ratio':>7}"
        unit += f"  | {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(t/m)':>7}"
    for op in dict.fromkeys(row["op"] for row in rows):
        lines += ["#", f"# {op}", head, unit]
        for row in (r for r in rows if r["op"] == op):
            wrong = "N/A" if row["wrong"] is None else str(row["wrong"])
            line = (f" {row['size']:>12} {row['count']:>12} {row['type']:>7} {row['time_us']:>10.2f} "
                    f"{row['algbw']:>8.3f} {row['busbw']:>8.3f} {wrong:>7}")
            if "model" in row:
                m = row["model"]
                line += (f"  | {m['algorithm']:>6} {m['time_us']:>10.2f} {m['busbw']:>8.3f} "
                         f"{row['time_us'] / m['time_us']:>7.1f}")
            lines.append(line)
    wrong_total = sum(row["wrong"] or 0 for row in rows)
    checked = any(row["wrong"] is not None for row in rows)
    verdict = "N/A" if not checked else ("OK" if wrong_total == 0 else "FAILED")
    average = sum(row["busbw"] for row in rows) / max(len(rows), 1)
    lines += ["#", f"# Out of bounds values : {wrong_total} {verdict}",
              f"# Avg bus bandwidth    : {average:.4f} GB/s", "#"]
    return "\n".join(lines)


# --- launching ------------------------------------------------------------------------------

def _worker(comm, config: dict) -> list[dict]:
    """Runs in each process started by :func:`real.run`: the raw collectives on its group."""
    return measure(config["ops"], config["sizes"], dtype=DTYPES[config["dtype"]],
                   iters=config["iters"], warmup=config["warmup"], check=config["check"],
                   group=comm.transport.group, device=comm.transport.device,
                   corrupt_rank=config["corrupt_rank"])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m real.bench",
        description="nccl-tests-style bandwidth table of the raw torch.distributed collectives.")
    parser.add_argument("-b", "--minbytes", default="1K", help="smallest size (e.g. 8, 32K, 1M; default 1K)")
    parser.add_argument("-e", "--maxbytes", default="1M", help="largest size (default 1M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier (default 4)")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (default 20)")
    parser.add_argument("-w", "--warmup_iters", type=int, default=5, help="warm-up iterations (default 5)")
    parser.add_argument("-c", "--check", type=int, default=1, help="check results: 1 (default) or 0")
    parser.add_argument("-d", "--datatype", default="float", choices=sorted(DTYPES))
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma-separated (default {','.join(OPS)})")
    parser.add_argument("--nproc", type=int, default=None,
                        help="standalone: start this many processes (default 2 when not under torchrun)")
    parser.add_argument("--backend", default=None, choices=["gloo", "nccl"],
                        help="default: nccl with a GPU per rank, else gloo")
    parser.add_argument("--model", default=None, choices=sorted(PRESETS),
                        help="print the cost model's prediction for this topology preset beside each row")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--timeout", type=float, default=600.0, help="standalone: seconds before giving up")
    parser.add_argument("--corrupt-rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def _config(args: argparse.Namespace) -> dict:
    ops = []
    for op in (op.strip() for op in args.ops.split(",") if op.strip()):
        try:
            ops.append(canonical_op(op, OPS, where="real.bench --ops"))
        except ValueError as error:
            raise SystemExit(f"real.bench: unknown --ops {op!r}: {error}") from None
    if args.iters < 1 or args.warmup_iters < 0:
        raise SystemExit(f"real.bench: need -n >= 1 and -w >= 0, got -n {args.iters} -w {args.warmup_iters}")
    corrupt = args.corrupt_rank
    if corrupt is None and os.environ.get(CORRUPT_ENV, "") != "":
        corrupt = int(os.environ[CORRUPT_ENV])
    try:
        byte_sizes = sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    return {"ops": ops, "sizes": byte_sizes, "dtype": args.datatype, "iters": args.iters,
            "warmup": args.warmup_iters, "check": bool(args.check), "corrupt_rank": corrupt}


def _check_model(preset: str | None, world_size: int) -> None:
    if preset is not None and world_size > PRESETS[preset].max_ranks:
        raise SystemExit(f"real.bench: --model {preset} has {PRESETS[preset].max_ranks} GPUs; "
                         f"the bench runs {world_size} ranks")


def main(argv: Sequence[str] | None = None, *, out: Callable[[str], None] = print) -> int:
    """Run the bench; print the table (rank 0 only under torchrun). Returns the exit status."""
    args = _parser().parse_args(argv)
    config = _config(args)
    under_torchrun = args.nproc is None and "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        from .process_group import init_from_env

        comm = init_from_env(args.backend, trace=False)
        world_size, rank = comm.world_size, comm.rank
        _check_model(args.model, world_size)
        backend = str(dist.get_backend()).lower()
        rows = _worker(comm, config)
    else:
        from .launcher import run

        world_size, rank = args.nproc or 2, 0
        if world_size < 2:
            raise SystemExit(f"real.bench: --nproc must be >= 2, got {world_size}")
        _check_model(args.model, world_size)
        from .process_group import pick_backend

        backend = pick_backend(world_size, args.backend)
        rows = run(_worker, config, world_size=world_size, backend=backend, timeout=args.timeout)[0]
    rows = _with_model(rows, world_size, args.model)
    meta = {"world_size": world_size, "backend": backend, "iters": config["iters"],
            "warmup": config["warmup"], "check": config["check"], "dtype": config["dtype"],
            "model": args.model, "torch": torch.__version__}
    if rank == 0:
        out(format_report(rows, meta))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**meta, "rows": rows}, f, indent=1)
    if under_torchrun:
        dist.destroy_process_group()
    return 1 if any(row["wrong"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
