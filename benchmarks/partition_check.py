"""CPU time of one rank's ``PartitionTable.check`` of the two partitions of the 16,384-rank program.

``benchmarks/shape_16k.py --per-rank-partitions`` has every rank build its own two partitions
(2,048 tensor groups of 8 consecutive ranks; 128 data groups of ranks 128 apart) and pass each to
``comm.subgroup``, which checks it against the partition the first rank passed
(:class:`simcomm.checks.PartitionTable`). This times that check of one rank's fresh lists
(a hit) in one process, best of ``--rounds`` rounds; with ``--before DIR`` the table of another
checkout's ``simcomm/checks.py`` is timed in the same process, alternating with this one's, so
that both see the same load.

    python benchmarks/partition_check.py
    python benchmarks/partition_check.py --before ../main
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time


def _table_class(root: str):
    spec = importlib.util.spec_from_file_location(f"_checks_{abs(hash(root))}", os.path.join(root, "simcomm", "checks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PartitionTable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=16384)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--before", metavar="CHECKOUT", help="also time this checkout's PartitionTable")
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = [("this", here)] + ([("before", os.path.abspath(args.before))] if args.before else [])
    world, tp, pp = args.ranks, args.tp, args.pp
    builders = {"tensor groups": lambda: [list(range(base, base + tp)) for base in range(0, world, tp)],
                "data groups": lambda: [list(range(first, world, tp * pp)) for first in range(tp * pp)]}
    tables = {}
    for side, root in sides:
        table = tables[side] = _table_class(root)()
        for build in builders.values():
            table.check("subgroup", build(), world, 0)        # the first rank's: accepted
    best: dict = {}
    for _ in range(args.rounds):
        for name, build in builders.items():
            groups = build()                                  # a later rank's own lists
            for side, _root in sides:
                table = tables[side]
                start = time.process_time()
                for _ in range(5):
                    table.check("subgroup", groups, world, 1)
                spent = (time.process_time() - start) / 5
                best[side, name] = min(best.get((side, name), spent), spent)
    for side, table in tables.items():
        if table.misses != 2:
            raise SystemExit(f"{side}: {table.misses} misses, expected 2 (the first rank's)")
    sys.stdout.write(f"{world} ranks, PartitionTable.check of one rank's own lists, best of {args.rounds} "
                     f"(CPU us):\n")
    for name in builders:
        row = "  ".join(f"{side} {best[side, name] * 1e6:7.0f}" for side, _root in sides)
        ratio = (f"  this/before {best['this', name] / best['before', name]:.2f}" if args.before else "")
        sys.stdout.write(f"  {name:14s} {row}{ratio}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
