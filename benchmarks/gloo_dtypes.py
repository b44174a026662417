"""Measure which dtype x op calls gloo accepts: the table simcomm.dtypes holds.

``python benchmarks/gloo_dtypes.py`` runs every call of :data:`CALLS` with every
dtype of :data:`DTYPES` on 2 gloo ranks, straight on gloo's process group
(through torch.distributed, not simcomm), and prints, for each call, the
dtypes gloo refuses and the error (class and message) it raises. Re-run it
after a torch upgrade and update simcomm/dtypes.py when the table changes.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
          "complex64", "complex128")
CALLS = ("all_reduce:sum", "all_reduce:avg", "all_reduce:max", "all_reduce:min", "all_reduce:product",
         "reduce:sum", "reduce:max", "reduce_scatter:sum", "reduce_scatter:max", "reduce_scatter:avg", "all_gather", "broadcast", "gather", "scatter",
         "all_to_all_single", "send_recv")


def probe(comm, calls, dtypes):
    import torch
    import torch.distributed as dist
    group = getattr(dist.group.WORLD, "data_group", dist.group.WORLD)   # gloo's own group
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
    table = {}
    for call in calls:
        name, _, op = call.partition(":")
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            x = torch.ones(4, dtype=dtype)
            try:
                if name == "all_reduce":
                    dist.all_reduce(x, op=ops[op], group=group)
                elif name == "reduce":
                    dist.reduce(x, dst=0, op=ops[op], group=group)
                elif name == "reduce_scatter":
                    dist.reduce_scatter_tensor(torch.empty(2, dtype=dtype), x, op=ops[op], group=group)
                elif name == "all_gather":
                    dist.all_gather_into_tensor(torch.empty(4 * world, dtype=dtype), x, group=group)
                elif name == "broadcast":
                    dist.broadcast(x, src=0, group=group)
                elif name == "gather":
                    dist.gather(x, [torch.empty_like(x) for _ in range(world)] if rank == 0 else None, dst=0,
                                group=group)
                elif name == "scatter":
                    dist.scatter(torch.empty_like(x), [x.clone() for _ in range(world)] if rank == 0 else None,
                                 src=0, group=group)
                elif name == "all_to_all_single":
                    dist.all_to_all_single(torch.empty_like(x), x, group=group)
                elif name == "send_recv":
                    if rank == 0:
                        dist.send(x, 1, group=group)
                    else:
                        dist.recv(x, 0, group=group)
                table[f"{call}/{dtype_name}"] = None
            except Exception as error:   # noqa: BLE001 - what gloo raises is what is measured
                table[f"{call}/{dtype_name}"] = (type(error).__name__, str(error).splitlines()[0][:160])
    return table


def main() -> None:
    import real
    with real.Cluster(2, backend="gloo", checked=False, timeout=120) as cluster:
        tables = cluster.run(probe, CALLS, DTYPES)
    assert tables[0].keys() == tables[1].keys()
    refused = {}
    for key, outcome in tables[0].items():
        other = tables[1][key]
        if outcome is not None or other is not None:
            refused[key] = {"rank 0": outcome, "rank 1": other}
    print(json.dumps(refused, indent=1))


if __name__ == "__main__":
    main()
