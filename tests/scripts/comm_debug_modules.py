"""CommDebugMode's module tracker around a tensor-parallel MLP's forward and backward.

CommDebugMode counts collectives per module with torch's ModTracker, which registers
process-wide module hooks (``register_module_forward_pre_hook`` ...). Each rank prints its
total count, its counts per collective and per module (forward and backward), and, from
MemTracker (another module tracker), the modules it saw: ``rankN: key=value ...``.
"""
import json

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 12, dtype=torch.float64)
        self.down = nn.Linear(12, 8, dtype=torch.float64)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP()
        self.head = nn.Linear(8, 4, dtype=torch.float64)

    def forward(self, x):
        return self.head(self.mlp(x))


def short(counts: dict) -> str:
    return json.dumps({str(op).split(".")[-1]: n for op, n in sorted(counts.items(), key=str)},
                      separators=(",", ":"))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)                                # the same weights on every rank
    model = parallelize_module(Net(), mesh, {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()})
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    comm_mode = CommDebugMode()
    with comm_mode:
        loss = model(x).sum()
        loss.backward()
    grad = x.grad.sum().item()
    per_module = comm_mode.comm_module_counts
    modules = {name: {"fwd": short(c["forward"]), "bwd": short(c["backward"])}
               for name, c in sorted(per_module.items()) if c["forward"] or c["backward"]}
    parents = sorted(comm_mode.advanced_module_tracker.parent_dict)

    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        model(x).sum().backward()
    seen = sorted(stats.mod_fqn for stats in tracker.memory_tracking.values())

    print(f"rank{rank}: total={comm_mode.get_total_counts()} counts={short(comm_mode.get_comm_counts())} "
          f"loss={loss.item():.12f} grad={grad:.12f} modules={json.dumps(modules, separators=(',', ':'))} "
          f"parents={','.join(parents)} mem_modules={','.join(seen)}", flush=True)
    dist.destroy_process_group()
