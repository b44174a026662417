"""torch.save on shape-only ranks writes meta tensors: shapes and dtypes, no data.

A script that trains and then saves a checkpoint (``torch.save`` of a state dict
of FSDP2 DTensors, full tensors or plain tensors) finishes shape-only: each fake
tensor is written as a meta tensor of its shape, dtype, strides and
requires_grad, a DTensor as a DTensor on the meta device, and ``torch.load``
(``weights_only=True`` too) gives them back with the real-valued run's
structure, shapes and dtypes (the oracle: the same program with values). Stderr
says once per run that such checkpoints hold shapes and dtypes only. A value
read is still the named ShapeOnlyError, and ``dcp.save`` is refused by name.
"""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh   # by name, before any shape-only run
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import simcomm
from simcomm import RankError
from simcomm.errors import ShapeOnlyError
from simcomm.sim.shape import SAVE_NOTICE


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1 = nn.Linear(8, 16)
        self.lin2 = nn.Linear(16, 4, dtype=torch.float64)

    def forward(self, x):
        return self.lin2(torch.relu(self.lin1(x)).double())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _train_step(model: nn.Module) -> torch.optim.Optimizer:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(3, 8)
    model(x).sum().backward()
    optimizer.step()
    return optimizer


def fsdp_save_program(comm, folder: str) -> None:
    """FSDP2 training step, then torch.save of the sharded and the full state dicts."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model()
    fully_shard(model.lin1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = _train_step(model)
    sharded = model.state_dict()
    full = {name: value.full_tensor() for name, value in sharded.items()}
    torch.save({"model": sharded, "optim": optimizer.state_dict()}, f"{folder}/sharded_{comm.rank}.pt")
    if comm.rank == 0:
        torch.save(full, f"{folder}/full.pt")
        torch.save({"weight": model.lin2.weight, "column": full["lin1.weight"].t()[1:]}, f"{folder}/odd.pt")


def plain_save_program(comm, folder: str) -> None:
    """No distribution: a training step and torch.save of the state dict and a Parameter."""
    model = _model()
    optimizer = _train_step(model)
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(),
                "parameter": nn.Parameter(torch.ones(2, 3)), "step": 1},
               f"{folder}/plain_{comm.rank}.pt")


def _describe(value):
    """What a loaded checkpoint holds, without values or devices."""
    if isinstance(value, DTensor):
        return ("DTensor", tuple(value.shape), value.dtype, value.stride(), value.requires_grad,
                tuple(value.placements), _describe(value._local_tensor))
    if isinstance(value, torch.Tensor):
        return (type(value).__name__, tuple(value.shape), value.dtype, value.stride(), value.requires_grad)
    if isinstance(value, dict):
        return {key: _describe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)([_describe(item) for item in value])
    return value


def _devices(value) -> set[str]:
    found = set()
    if isinstance(value, DTensor):
        found |= {value.device.type} | _devices(value._local_tensor)
    elif isinstance(value, torch.Tensor):
        found.add(value.device.type)
    elif isinstance(value, dict):
        for item in value.values():
            found |= _devices(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            found |= _devices(item)
    return found


def _run_both(program, tmp_path, names):
    loaded = {}
    for tensors in ("shape", "real"):
        folder = tmp_path / tensors
        folder.mkdir()
        simcomm.World(2, tensors=tensors).run(program, str(folder))
        loaded[tensors] = {name: torch.load(folder / name, weights_only=True) for name in names}
    return loaded


def test_an_fsdp2_checkpoint_saved_shape_only_loads_as_meta_with_the_real_runs_shapes(tmp_path):
    names = ["sharded_0.pt", "sharded_1.pt", "full.pt", "odd.pt"]
    loaded = _run_both(fsdp_save_program, tmp_path, names)
    for name in names:
        assert _describe(loaded["shape"][name]) == _describe(loaded["real"][name]), name
        assert _devices(loaded["shape"][name]) == {"meta"}, name
        assert _devices(loaded["real"][name]) == {"cpu"}, name
    sharded = loaded["shape"]["sharded_0.pt"]["model"]["lin1.weight"]
    assert isinstance(sharded, DTensor) and sharded.to_local().shape == (8, 8)
    assert loaded["shape"]["odd.pt"]["column"].stride() == (1, 8)   # a transposed view's strides


def test_a_plain_checkpoint_saved_shape_only_loads_as_meta_with_the_real_runs_shapes(tmp_path):
    names = ["plain_0.pt", "plain_1.pt"]
    loaded = _run_both(plain_save_program, tmp_path, names)
    for name in names:
        assert _describe(loaded["shape"][name]) == _describe(loaded["real"][name]), name
        assert _devices(loaded["shape"][name]) == {"meta"}
    parameter = loaded["shape"]["plain_0.pt"]["parameter"]
    assert isinstance(parameter, nn.Parameter) and parameter.is_meta and parameter.requires_grad
    assert loaded["shape"]["plain_0.pt"]["model"]["lin2.weight"].dtype == torch.float64


def test_the_notice_is_one_line_once_per_run(tmp_path, capfd):
    capfd.readouterr()
    for run in range(2):
        folder = tmp_path / str(run)
        folder.mkdir()
        simcomm.World(2, tensors="shape").run(fsdp_save_program, str(folder))
        err = capfd.readouterr().err
        assert err.count(SAVE_NOTICE) == 1, err
        assert [line for line in err.splitlines() if "shapes and dtypes only" in line] == [SAVE_NOTICE]
    simcomm.World(2).run(plain_save_program, str(tmp_path / "0"))        # with values: no notice
    assert SAVE_NOTICE not in capfd.readouterr().err


def _save_then_read(comm, folder: str) -> float:
    model = _model()
    optimizer = _train_step(model)
    torch.save(model.state_dict(), f"{folder}/{comm.rank}.pt")
    del optimizer
    return model.lin1.weight.sum().item()


def test_a_value_read_after_a_save_is_still_the_named_error(tmp_path):
    with pytest.raises(RankError) as error:
        simcomm.World(2, tensors="shape").run(_save_then_read, str(tmp_path))
    cause = error.value.__cause__
    assert isinstance(cause, ShapeOnlyError), repr(cause)
    assert "_local_scalar_dense" in str(cause) and "tensors='real'" in str(cause), str(cause)
    assert torch.load(tmp_path / "0.pt")["lin1.weight"].is_meta      # the save before it was written


def _dcp_save(comm, folder: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model()
    fully_shard(model, mesh=mesh)
    dcp.save({"model": model.state_dict()}, checkpoint_id=folder)


def test_dcp_save_is_refused_by_name_on_shape_only_ranks(tmp_path):
    with pytest.raises(RankError) as error:
        simcomm.World(2, tensors="shape").run(_dcp_save, str(tmp_path / "shape"))
    cause = error.value.__cause__
    assert isinstance(cause, ShapeOnlyError), repr(cause)
    assert "dcp.save" in str(cause) and "tensors='real'" in str(cause) and "torch.save" in str(cause)
    simcomm.World(2).run(_dcp_save, str(tmp_path / "real"))                # with values it saves
    assert (tmp_path / "real" / ".metadata").exists()


def test_other_fake_tensors_pickle_as_torch_pickles_them():
    simcomm.World(1, tensors="shape").run(lambda comm: None)             # the hook is installed
    with FakeTensorMode():
        tensor = torch.empty(2, 3)
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        pickle.dumps(tensor)
    assert pickle.loads(pickle.dumps(torch.ones(2))).tolist() == [1.0, 1.0]
