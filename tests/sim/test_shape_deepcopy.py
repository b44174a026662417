"""copy.deepcopy on shape-only ranks: a training snapshot (dataclasses.asdict of the model's and the
optimizer's state dicts, as minGPT-DDP saves) copies as on a real-valued rank: the same keys, shapes,
dtypes and the values a rank knows (an optimizer's step), each copy a tensor of the rank's own."""
from __future__ import annotations

import copy
import dataclasses

import torch

import simcomm


@dataclasses.dataclass
class Snapshot:
    model: dict
    optimizer: dict
    epoch: int


def _snapshot(comm) -> list:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    model.register_buffer("mask", torch.tril(torch.ones(4, 4)))
    optimizer = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        model(torch.randn(3, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    copied = dataclasses.asdict(Snapshot(model.state_dict(), optimizer.state_dict(), 2))
    clone = copy.deepcopy(model)
    rows = []
    for name, tensor in copied["model"].items():
        assert tensor is not model.state_dict()[name]
        rows.append((name, tuple(tensor.shape), tensor.dtype))
    steps = [state["step"].item() for state in copied["optimizer"]["state"].values()]
    moments = [(tuple(state["exp_avg"].shape), state["exp_avg"].dtype) for state in copied["optimizer"]["state"].values()]
    same_mode = all(getattr(tensor, "fake_mode", None) is getattr(model[0].weight, "fake_mode", None)
                    for tensor in copied["model"].values())
    return [rows, steps, moments, copied["model"]["mask"].tolist(), type(clone[0]).__name__, same_mode,
            copied["epoch"]]


def test_a_snapshot_deep_copies_as_on_a_real_valued_rank():
    shape = simcomm.World(2, tensors="shape").run(_snapshot)
    real = simcomm.World(2).run(_snapshot)
    assert shape == real
    assert shape[0][1] == [2.0] * 4 and shape[0][5] is True
