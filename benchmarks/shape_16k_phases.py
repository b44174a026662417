"""Where a shape-only rank's CPU goes in the 16,384-rank program, phase by phase.

The program of ``benchmarks/shape_16k.py --per-rank-partitions`` (TP 8 x PP 16 x DP, two
tensor-parallel MLP blocks of a Llama-3-405B shape per stage, each rank building its own two
partition lists), with each rank's thread CPU time (``time.thread_time``: the rank's own work,
not its waits) summed per phase over all ranks and printed per rank: the lists, the two
``subgroup`` calls, the weights, each line of the forward block (``copy_to_group``, the two
matmuls, SiLU, ``reduce_from_group``, the residual add), the messages between stages, the
backward (autograd's engine with the ops and the two tensor-group all-reduces it runs), and
the data-parallel all-reduces. Each size runs twice in one fresh process (the first run
imports and fills the caches); the second is printed. The program's results are not checked
here: ``benchmarks/shape_16k.py`` checks the same program's trace.

    python benchmarks/shape_16k_phases.py              # 1024 ranks
    python benchmarks/shape_16k_phases.py --dp 8 32    # 1024 and 4096 ranks
"""
from __future__ import annotations

import argparse
import collections
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[8])
    args = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    import simcomm

    tp, pp, layers, hidden, ffn, tokens = 8, 16, 2, 16384, 53248, 8192
    spent: collections.Counter = collections.Counter()
    clock = time.thread_time

    def step(comm):
        start = clock()
        groups = [list(range(base, base + tp)) for base in range(0, comm.world_size, tp)]
        built = clock()
        tensor = comm.subgroup(groups)
        called = clock()
        groups = [list(range(first, comm.world_size, tp * pp)) for first in range(tp * pp)]
        built2 = clock()
        data = comm.subgroup(groups)
        del groups
        now = clock()
        spent["the program's lists"] += built - start + built2 - called
        spent["subgroup calls"] += called - built + now - built2
        stage = comm.rank // tp % pp
        dtype = torch.bfloat16
        weights = [(torch.empty(ffn // tp, hidden, dtype=dtype).requires_grad_(),
                    torch.empty(hidden, ffn // tp, dtype=dtype).requires_grad_()) for _ in range(layers)]
        shape = (tokens, hidden)
        mark = clock()
        spent["weights"] += mark - now

        def phase(name):
            nonlocal mark
            now = clock()
            spent[name] += now - mark
            mark = now

        x = torch.empty(shape, dtype=dtype) if stage == 0 else comm.recv(shape, dtype, comm.rank - tp)
        inp = x.requires_grad_() if stage else x
        phase("messages between stages")
        for up, down in weights:
            copied = tensor.copy_to_group(x)
            phase("copy_to_group")
            h = copied @ up.T
            phase("matmul (up)")
            h = torch.nn.functional.silu(h)
            phase("silu")
            partial = h @ down.T
            phase("matmul (down)")
            reduced = tensor.reduce_from_group(partial)
            phase("reduce_from_group")
            x = x + reduced
            comm.compute(flops=2 * 2 * tokens * hidden * ffn // tp)
            phase("residual add")
        if stage < pp - 1:
            comm.send(x.detach(), comm.rank + tp)
            grad = comm.recv(shape, dtype, comm.rank + tp)
            phase("messages between stages")
            x.backward(grad)
        else:
            x.float().pow(2).mean().backward()
        phase("backward")
        comm.compute(flops=2 * 2 * 2 * tokens * hidden * ffn // tp * layers)
        if stage:
            comm.send(inp.grad, comm.rank - tp)
        phase("messages between stages")
        for up, down in weights:
            data.all_reduce(up.grad, "avg")
            data.all_reduce(down.grad, "avg")
        phase("data-parallel all-reduces")
        spent["program"] += clock() - start

    for dp in args.dp:
        ranks = tp * pp * dp
        for _ in range(2):
            spent.clear()
            world = simcomm.World(ranks, tensors="shape")
            cpu = time.process_time()
            world.run(step)
            cpu = time.process_time() - cpu
        program = spent.pop("program")
        sys.stdout.write(f"{ranks} ranks: run CPU {cpu / ranks * 1e6:.0f} us a rank, of it the program "
                         f"{program / ranks * 1e6:.0f} us (each rank's thread CPU):\n")
        for name, seconds in spent.most_common():
            sys.stdout.write(f"  {name:28s} {seconds / ranks * 1e6:7.0f} us\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
