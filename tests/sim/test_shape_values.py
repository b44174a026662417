"""Shape-only ranks know the values of small tensors computed from constants, and nothing else.

Scripts compute bookkeeping from constants: an ``arange`` reshaped into a grid of
ranks and searched with ``nonzero`` (picotron's process-group setup), a
``linspace`` read with ``.item()`` (ConvNeXt's drop-path rates), a mesh's
``tolist()``. On shape-only ranks those tensors have their values (the same as in
the real-valued run: the oracle here), while a tensor that depends on data, a
parameter, a random op or a collective stays fake, and reading it is the same
ShapeOnlyError naming the op as before. A conversion that changes nothing
(``Module.to("cpu")`` of a module on the cpu) works on shape-only ranks.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh   # by name, before any shape-only run

import simcomm
from simcomm import RankError
from simcomm.errors import ShapeOnlyError
from simcomm.run import run_script
from simcomm.sim.shape import VALUE_LIMIT
from tests.launchers import TORCHRUN, launch_ok


def bookkeeping_program(comm) -> dict:
    """Values a script computes from constants, read back as Python values."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    grid = torch.arange(world).view(2, world // 2)
    out["coordinates"] = (grid == rank).nonzero().flatten().tolist()
    out["row"] = grid[rank // (world // 2)].tolist()
    out["rates"] = [rate.item() for rate in torch.linspace(0, 0.3, 7)]
    out["rate_sum"] = torch.linspace(0, 0.3, 7).sum().item()
    out["masked"] = torch.arange(20)[torch.arange(20) % 3 == 0].tolist()
    out["sorted"] = torch.tensor([5, 1, 4, 2]).sort().indices.tolist()
    out["constants"] = [torch.zeros(3).sum().item(), torch.ones(2, 2).sum().item(),
                        torch.full((3,), 7).tolist(), torch.eye(3).diagonal().tolist()]
    out["bool"] = bool(torch.arange(4).sum() > 5)
    out["int"] = int(torch.tensor(3) * 4)
    out["equal"] = torch.equal(torch.arange(3), torch.tensor([0, 1, 2]))
    written = torch.arange(6.0)
    written[:3].mul_(10)                       # in place through a view: the base sees it
    out["written"] = written.tolist()
    module = nn.Module()
    module.register_buffer("positions", torch.arange(8))
    out["buffer"] = module.positions[3:5].tolist()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    out["mesh"] = mesh.mesh.tolist()
    out["mesh_rank"] = mesh.get_coordinate()
    out["at_limit"] = torch.arange(VALUE_LIMIT).sum().item()
    return out


def test_bookkeeping_from_constants_has_the_real_valued_runs_values():
    shape = simcomm.World(4, tensors="shape").run(bookkeeping_program)
    real = simcomm.World(4).run(bookkeeping_program)
    assert shape == real
    assert real[3]["coordinates"] == [1, 1] and real[0]["mesh"] == [[0, 1], [2, 3]]


def _refused(program, world_size: int = 2) -> str:
    with pytest.raises(RankError) as error:
        simcomm.World(world_size, tensors="shape").run(program)
    cause = error.value.__cause__
    assert isinstance(cause, ShapeOnlyError), repr(cause)
    return str(cause)


def _after_all_reduce():
    x = torch.arange(4.0)
    dist.all_reduce(x)
    return x.tolist()


def _view_after_all_reduce():
    x = torch.arange(4.0)
    view = x[1:]
    dist.all_reduce(x)
    return view.tolist()


def _lifted_constant_after_all_reduce():
    x = torch.tensor([float(dist.get_rank() + 1)])   # a constant the fake mode itself keeps
    dist.all_reduce(x)
    return x.item()


def _lifted_constant_after_recv():
    x = torch.tensor([1.0, 2.0])
    if dist.get_rank() == 0:
        dist.send(torch.ones(2), 1)
    else:
        dist.recv(x, 0)
    return x.tolist()


def _after_all_gather_into_tensor():
    out = torch.zeros(2 * dist.get_world_size())
    dist.all_gather_into_tensor(out, torch.arange(2.0))
    return out.tolist()


def _after_recv():
    x = torch.arange(3.0)
    if dist.get_rank() == 0:
        dist.send(torch.ones(3), 1)
    else:
        dist.recv(x, 0)
    return x.tolist()


def _random_mix():
    return (torch.arange(4.0) + torch.rand(4)).sum().item()


def _written_with_random_values_through_data():
    x = torch.arange(4.0)
    x.data.uniform_()            # an alias torch makes without an op: the storage is what counts
    return x.tolist()


def _parameter():
    return nn.LayerNorm(3).weight.sum().item()


def _uninitialised():
    return torch.empty(3).tolist()


def _data_mask():
    x = torch.randn(10)
    return x[x > 0].shape


def _over_the_limit():
    return torch.arange(VALUE_LIMIT + 1).sum().item()


@pytest.mark.parametrize("read", [_after_all_reduce, _view_after_all_reduce, _lifted_constant_after_all_reduce,
                                  _lifted_constant_after_recv, _after_all_gather_into_tensor,
                                  _after_recv, _random_mix, _written_with_random_values_through_data,
                                  _parameter, _uninitialised, _over_the_limit],
                         ids=lambda read: read.__name__.strip("_"))
def test_a_read_of_what_depends_on_data_is_still_the_named_error(read):
    text = _refused(lambda comm: read())
    assert "_local_scalar_dense" in text and "tensors='real'" in text, text
    simcomm.World(2).run(lambda comm: read())         # a program that runs with values


def test_a_data_dependent_shape_is_still_the_named_error():
    text = _refused(lambda comm: _data_mask())
    assert "aten.nonzero" in text and "tensors='real'" in text, text


def picotron_program(comm, dp: int, pp: int, tp: int) -> tuple:
    """picotron's process-group setup: the grid of ranks as a tensor, this rank's coordinates found
    with nonzero, its groups listed with tolist, then a collective in each group."""
    rank = dist.get_rank()
    grid = torch.arange(dist.get_world_size()).view(dp, pp, tp)
    dp_rank, pp_rank, tp_rank = (grid == rank).nonzero().flatten().tolist()
    tp_group = dist.new_subgroups_by_enumeration(
        [grid[d, p, :].tolist() for d in range(dp) for p in range(pp)])[0]
    dp_group = dist.new_subgroups_by_enumeration(
        [grid[:, p, t].tolist() for p in range(pp) for t in range(tp)])[0]
    pp_ranks = grid[dp_rank, :, tp_rank].tolist()
    dist.all_reduce(torch.ones(8), group=tp_group)
    dist.all_reduce(torch.ones(4), group=dp_group)
    return (dp_rank, pp_rank, tp_rank, dist.get_process_group_ranks(tp_group),
            dist.get_process_group_ranks(dp_group), pp_ranks)


def test_picotron_style_group_setup_runs_shape_only_at_64_ranks():
    shape_world, real_world = simcomm.World(64, tensors="shape"), simcomm.World(64)
    shape = shape_world.run(picotron_program, 4, 2, 8, timeout=120)
    real = real_world.run(picotron_program, 4, 2, 8, timeout=120)
    assert shape == real
    assert real[37][:3] == (2, 0, 5) and real[37][3] == list(range(32, 40))
    assert simcomm.sim.shape.trace_signature(shape_world.trace) == \
        simcomm.sim.shape.trace_signature(real_world.trace)


def conversion_program(comm) -> list:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    weight, running_mean = model[0].weight, model[1].running_mean
    model(torch.ones(3, 4)).sum().backward()     # gradients too
    x = torch.ones(3)
    results = [model.to("cpu") is model, model.cpu() is model, model.float() is model,
               model.to(torch.float32) is model, model.to("cpu", non_blocking=True) is model,
               model[0].weight is weight, model[1].running_mean is running_mean,
               model[0].weight.grad is not None, x.to("cpu") is x, x.float() is x]
    return results


def test_a_conversion_that_changes_nothing_works_shape_only_as_with_values():
    shape = simcomm.World(2, tensors="shape").run(conversion_program)
    assert shape == simcomm.World(2).run(conversion_program)
    assert all(shape[0])


def test_a_conversion_that_changes_the_dtype_is_still_torchs_own():
    """A dtype change is torch's own _apply: with values it converts; shape-only it converts
    or, where torch cannot swap the fake parameters, is the named ShapeOnlyError."""
    def program(comm):
        model = nn.Linear(4, 4)
        model.to(torch.float64)
        return model.weight.dtype

    assert simcomm.World(2).run(program) == [torch.float64] * 2
    try:
        dtypes = simcomm.World(2, tensors="shape").run(program)
    except RankError as error:
        assert isinstance(error.__cause__, ShapeOnlyError) and "dtype=" in str(error.__cause__)
    else:
        assert dtypes == [torch.float64] * 2


# -- a torchrun script, unmodified, with --tensors shape ---------------------------------------------

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "grid_bookkeeping.py"


def _lines(text: str) -> dict[int, list[str]]:
    """Each rank's lines: ``[rank r] line`` (simcomm.run) or ``[defaultr]:line`` (torchrun --tee 3)."""
    lines: dict[int, list[str]] = {}
    for raw in text.splitlines():
        match = re.match(r"^\[(?:rank |default)(\d+)\]:? ?((?:coordinates|rates|mesh|shapes).*)$", raw)
        if match:
            lines.setdefault(int(match.group(1)), []).append(match.group(2))
    return lines


def test_a_grid_bookkeeping_script_prints_the_same_shape_only_as_with_values(capsys):
    shape = run_script(SCRIPT, 8, tensors="shape")
    shape_lines = _lines(capsys.readouterr().out)
    real = run_script(SCRIPT, 8)
    real_lines = _lines(capsys.readouterr().out)
    assert shape.returncode == 0 and real.returncode == 0, (shape.summary(), real.summary())
    assert shape_lines == real_lines and len(real_lines) == 8
    assert real_lines[5][0] == "coordinates 1 0 1 tp [4, 5] dp [1, 5] pp [5, 7]"
    assert simcomm.sim.shape.trace_signature(shape.trace) == simcomm.sim.shape.trace_signature(real.trace)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_grid_bookkeeping_script_prints_what_torchrun_prints(tmp_path, capsys):
    text = launch_ok([str(TORCHRUN), "--standalone", "--tee", "3", "--nproc-per-node", "8", str(SCRIPT)], tmp_path,
                     reference=True, timeout=240)
    shape = run_script(SCRIPT, 8, tensors="shape")
    assert shape.returncode == 0, shape.summary()
    assert _lines(capsys.readouterr().out) == _lines(text)
