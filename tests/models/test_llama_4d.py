"""The small Llama trained with FSDP/HSDP, a 1F1B pipeline, context and tensor parallelism, against one device.

Every step's loss is compared with :func:`simcomm.models.llama_training.reference_losses`
(one device, no communication, float64)."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.models import llama
from simcomm.parallel import llama_fsdp
from simcomm.models import llama_training as lt
from simcomm.parallel.mesh import Layout

CONFIG = llama.Config()
TOLERANCE = 1e-12
LAYOUT_4D = Layout(pp=2, dp_replicate=1, dp_shard=2, cp=2, tp=2)     # 16 ranks, FSDP over the 2 data ranks
LAYOUT_REAL = Layout(pp=2, dp_replicate=1, dp_shard=2, tp=2)         # 8 gloo processes


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def setup():
    data = lt.corpus(CONFIG, sequences=16, length=17)
    params = llama.init_params(CONFIG)
    return data, params


def _max_error(outs, reference) -> float:
    return max(float((out["losses"] - reference).abs().max()) for out in outs)


@pytest.mark.parametrize("layout", [
    Layout(dp_shard=4),                          # FSDP over 4 data-parallel ranks
    Layout(dp_replicate=2, dp_shard=2),          # HSDP: 2 replicas x 2 shards
    Layout(dp_replicate=2, dp_shard=2, tp=2),    # HSDP with tensor parallelism
    Layout(pp=2, dp=2),                          # the 1F1B pipeline inside the training loop
], ids=repr)
def test_fsdp_hsdp_and_pipeline_training_equal_one_device(setup, layout):
    data, params = setup
    reference = lt.reference_losses(data, params, CONFIG, dp=layout.dp, steps=3, global_batch=4)
    outs = simcomm.World(layout.world_size).run(lt.train, data, params, CONFIG, layout=layout, steps=3,
                                                global_batch=4)
    assert _max_error(outs, reference) < TOLERANCE
    if layout.dp_shard > 1:         # each rank holds 1/dp_shard of its parameters (and so of Adam's state)
        tensor_shards = llama.shard_params(params, CONFIG, 0, layout.tp)
        assert outs[0]["held"] == sum(llama_fsdp.piece_numel(p.numel(), layout.dp_shard)
                                      for p in tensor_shards.values())
    assert [out["held"] for out in outs] == [lt.held_numel(CONFIG, layout, rank)
                                             for rank in range(layout.world_size)]
    assert [out["coords"] for out in outs] == [{dim: layout.coordinate(rank, dim) for dim in ("pp", "dp", "cp", "tp")}
                                               for rank in range(layout.world_size)]


def test_all_four_on_16_virtual_ranks_equal_one_device_and_final_shards_assemble(setup):
    data, params = setup
    steps = 4
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=steps, global_batch=4)
    outs = simcomm.World(16).run(lt.train, data, params, CONFIG, layout=LAYOUT_4D, steps=steps, global_batch=4)
    assert _max_error(outs, reference) < TOLERANCE
    assert [out["coords"]["pp"] for out in outs] == [0] * 8 + [1] * 8          # pipeline outermost
    # the trained parameters: rank (0, p, 0, t)'s shards assembled = one device's after the same steps
    leaves = {n: p.clone().requires_grad_() for n, p in params.items()}
    optimizer = torch.optim.Adam(leaves.values(), lr=1e-2)
    per_rank = [lt.batches(data, steps, 4, 2, rank) for rank in range(2)]
    for step in range(steps):
        optimizer.zero_grad()
        rows = torch.cat([per_rank[r][step] for r in range(2)]).tolist()
        (sum(llama.loss(data[i], leaves, CONFIG) for i in rows) / 4).backward()
        torch.nn.utils.clip_grad_norm_(leaves.values(), 1.0)
        optimizer.step()
    per_t = [{}, {}]
    for out in outs:
        if out["coords"]["dp"] == 0 and out["coords"]["cp"] == 0:
            per_t[out["coords"]["tp"]].update(out["shards"])
    trained = llama.assemble_grads(per_t)
    for name, leaf in leaves.items():
        expected = leaf.detach() * (2 if name.split(".")[-1] in llama.REPLICATED else 1)  # assemble sums norms
        torch.testing.assert_close(trained[name], expected, rtol=0, atol=1e-12, msg=name)


@pytest.mark.slow
def test_100_steps_in_4d_every_loss_equals_one_device(setup):
    data = lt.corpus(CONFIG, sequences=32, length=17)
    params = llama.init_params(CONFIG)
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=100, global_batch=4)
    outs = simcomm.World(16).run(lt.train, data, params, CONFIG, layout=LAYOUT_4D, steps=100, global_batch=4)
    assert _max_error(outs, reference) < 1e-10
    assert reference[-10:].mean() < reference[:10].mean() - 0.5       # it learns


def test_dcp_checkpoint_of_the_4d_run_resumes_on_other_layouts_and_continues_exactly(setup, tmp_path):
    data, params = setup
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=6, global_batch=4)
    first = simcomm.World(16).run(lt.train, data, params, CONFIG, layout=LAYOUT_4D, steps=3, global_batch=4,
                                  save=str(tmp_path / "step3"))
    assert _max_error(first, reference[:3]) < TOLERANCE
    for layout in (Layout(dp_shard=2, tp=2), Layout(pp=2, dp=2), Layout(dp_shard=2),
                   Layout(pp=2, dp_replicate=2, dp_shard=2)):
        resumed = simcomm.World(layout.world_size).run(lt.train, data, params, CONFIG, layout=layout, steps=3,
                                                       global_batch=4, load=str(tmp_path / "step3"), first_step=3)
        assert _max_error(resumed, reference[3:]) < TOLERANCE, layout
    fresh = simcomm.World(2).run(lt.train, data, params, CONFIG, layout=Layout(dp_shard=2), steps=3, global_batch=4,
                                 first_step=3)                                      # no checkpoint: differs
    assert _max_error(fresh, reference[3:]) > 1e-3


@pytest.mark.real
def test_the_4d_training_on_8_real_gloo_workers(gloo_cluster):
    data = lt.corpus(CONFIG, sequences=16, length=17)
    params = llama.init_params(CONFIG)
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=4, global_batch=4)
    outs = gloo_cluster(8).run(lt.train, data, params, CONFIG, layout=LAYOUT_REAL, steps=4, global_batch=4)
    assert _max_error(outs, reference) < TOLERANCE


@pytest.mark.real
@pytest.mark.slow
def test_100_steps_of_the_4d_training_on_8_real_gloo_workers(gloo_cluster):
    data = lt.corpus(CONFIG, sequences=32, length=17)
    params = llama.init_params(CONFIG)
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=100, global_batch=4)
    outs = gloo_cluster(8, timeout=900).run(lt.train, data, params, CONFIG, layout=LAYOUT_REAL, steps=100,
                                            global_batch=4)
    assert _max_error(outs, reference) < 1e-10


def test_train_names_a_layout_that_does_not_fit_the_world(setup):
    data, params = setup
    with pytest.raises(simcomm.errors.RankError,
                       match=r"llama_training.train: rank \d: layout=Layout\(pp=2, tp=2\) has 4 ranks, the world 6"):
        simcomm.World(6).run(lt.train, data, params, CONFIG, layout=Layout(pp=2, tp=2), steps=1, global_batch=4)
    with pytest.raises(simcomm.errors.RankError, match=r"layout=\(2, 2\) must be a simcomm.parallel.mesh.Layout"):
        simcomm.World(4).run(lt.train, data, params, CONFIG, layout=(2, 2), steps=1, global_batch=4)
