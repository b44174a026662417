"""A torchrun script that sets up its process groups from a grid of ranks held in a tensor.

What picotron's process-group manager and ConvNeXt's model do with small tensors computed
from constants: the grid ``torch.arange(world).view(dp, pp, tp)`` searched with ``nonzero``
and listed with ``tolist`` for the groups, drop-path rates read from a ``linspace`` with
``.item()``, a DeviceMesh's ranks with ``tolist()``, and a model moved to the device it is on.
Run by tests/sim/test_shape_values.py with values and shape-only (``--tensors shape``): every
line it prints is the same. Under torchrun (``torchrun --nproc-per-node 8``, gloo) it prints the
reference.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
dp, pp, tp = 2, 2, world // 4
grid = torch.arange(world).view(dp, pp, tp)
dp_rank, pp_rank, tp_rank = (grid == rank).nonzero().flatten().tolist()
tp_group = dist.new_subgroups_by_enumeration([grid[d, p, :].tolist() for d in range(dp) for p in range(pp)])[0]
dp_group = dist.new_subgroups_by_enumeration([grid[:, p, t].tolist() for p in range(pp) for t in range(tp)])[0]
print("coordinates", dp_rank, pp_rank, tp_rank, "tp", dist.get_process_group_ranks(tp_group),
      "dp", dist.get_process_group_ranks(dp_group), "pp", grid[dp_rank, :, tp_rank].tolist())

rates = [round(rate.item(), 6) for rate in torch.linspace(0, 0.2, 6)]
print("rates", rates)

mesh = init_device_mesh("cpu", (dp * pp, tp), mesh_dim_names=("dp", "tp"))
print("mesh", mesh.mesh.tolist(), mesh["tp"].mesh.tolist())

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).to("cpu")
x = torch.randn(4, 8).to("cpu")
loss = model(x).sum()
dist.all_reduce(loss, group=tp_group)
loss.backward()
print("shapes", tuple(loss.shape), tuple(model[0].weight.grad.shape))
dist.destroy_process_group()
