"""CPU time of one hit of the shape-only ranks' shared fake cache (``simcomm.sim.fake_cache.dispatch_op``).

Four ops of the 16,384-rank program's MLP block (``t`` and ``detach``: views; ``mm`` and
``add``: new tensors) on fake tensors of its shapes, each answered from the cache (the first
call files torch's entry), timed in one process: CPU time (``time.process_time``) per call,
best of ``--rounds`` rounds. With ``--before DIR`` another checkout's ``fake_cache.py`` is timed
in the same process, alternating with this one's, so that both see the same load.

    python benchmarks/fake_dispatch_hit.py
    python benchmarks/fake_dispatch_hit.py --before ../main
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time


def _module(root: str, name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "simcomm", "sim", "fake_cache.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--before", metavar="CHECKOUT", help="also time this checkout's fake_cache")
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    from torch._subclasses.fake_tensor import FakeTensorMode
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sides = [("this", _module(here, "_fake_cache_this"))]
    if args.before:
        sides.append(("before", _module(os.path.abspath(args.before), "_fake_cache_before")))
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(8192, 16384, dtype=torch.bfloat16)
        up = torch.empty(6656, 16384, dtype=torch.bfloat16).requires_grad_()
    aten = torch.ops.aten
    cases = {"t": (aten.t.default, (up,)), "detach": (aten.detach.default, (up,)),
             "mm": (aten.mm.default, (x, up.detach().t())), "add": (aten.add.Tensor, (x, x))}
    best: dict = {}
    with mode:
        for _side, module in sides:
            for func, inputs in cases.values():
                module.dispatch_op(func, None, inputs, {}, mode)       # first sight: filed
        for _ in range(args.rounds):
            for name, (func, inputs) in cases.items():
                for side, module in sides:
                    dispatch = module.dispatch_op
                    start = time.process_time()
                    for _ in range(args.calls):
                        dispatch(func, None, inputs, {}, mode)
                    spent = (time.process_time() - start) / args.calls
                    best[side, name] = min(best.get((side, name), spent), spent)
    for side, module in sides:
        counts = module.cache_info()
        if counts["hits"] != args.rounds * args.calls * len(cases):
            raise SystemExit(f"{side}: {counts} (every timed call should be a hit)")
    sys.stdout.write(f"one hit of the shared fake cache, best of {args.rounds} rounds (CPU us a call):\n")
    for name in cases:
        row = "  ".join(f"{side} {best[side, name] * 1e6:6.2f}" for side, _module_ in sides)
        ratio = f"  this/before {best['this', name] / best['before', name]:.2f}" if args.before else ""
        sys.stdout.write(f"  {name:7s} {row}{ratio}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
