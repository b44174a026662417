"""The small Llama as a 1F1B pipeline of tensor + sequence parallel stages, against one device in float64."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.models import llama
from simcomm.models import llama_pipeline as lp, llama_training as lt
from simcomm.parallel.mesh import Layout

CONFIG = llama.Config(layers=4)


def _program(comm, data, params, config, tp):
    layout = Layout(pp=comm.world_size // tp, tp=tp)
    stage, t = layout.coordinates(comm.rank)
    tensor = comm.subgroup(layout.groups("tp"))
    pipe = comm.subgroup(layout.groups("pp"))
    full = llama.shard_params(params, config, t, tp)
    shards = {n: full[n].requires_grad_() for n in lp.stage_names(config, stage, layout.pp)}
    loss = lp.stage_step(pipe, tensor, list(data), shards, config, global_batch=data.shape[0])
    return {"loss": loss, "grads": {n: p.grad for n, p in shards.items()}, "stage": stage, "t": t}


@pytest.mark.parametrize("tp, pp", [(1, 2), (2, 2), (1, 4)])
def test_pipeline_step_equals_one_device(tp, pp):
    data = lt.corpus(CONFIG, sequences=4, length=17)
    params = llama.init_params(CONFIG)
    leaves = {n: p.clone().requires_grad_() for n, p in params.items()}
    reference = sum(llama.loss(row, leaves, CONFIG) for row in data) / data.shape[0]
    reference.backward()
    outs = simcomm.World(tp * pp).run(_program, data, params, CONFIG, tp)
    last = [o for o in outs if o["stage"] == pp - 1]
    for out in last:
        torch.testing.assert_close(out["loss"], reference.detach().double(), rtol=0, atol=1e-12)
    assert all(o["loss"] == 0 for o in outs if o["stage"] != pp - 1)
    per_t = [{} for _ in range(tp)]
    for out in outs:
        per_t[out["t"]].update(out["grads"])
    grads = llama.assemble_grads(per_t)
    assert set(grads) == set(leaves)
    for name, p in leaves.items():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-12, msg=name)


def test_stage_names_split_the_layers():
    names = [lp.stage_names(CONFIG, s, 2) for s in range(2)]
    assert names[0][0] == "embed" and names[1][-2:] == ["final_norm", "output"]
    assert sorted(names[0] + names[1]) == sorted(llama.init_params(CONFIG))
    with pytest.raises(ValueError, match="layers=4 is not divisible by pp=3"):
        lp.stage_names(CONFIG, 0, 3)
