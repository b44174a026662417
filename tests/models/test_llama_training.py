"""Training the small Llama on a data x tensor mesh: every step's loss equals one device's (float64)."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.models import llama
from simcomm.models import llama_training as lt
from simcomm.parallel.mesh import Layout

CONFIG = llama.Config()


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def test_every_step_equals_one_device_with_clipping_and_a_distributed_sampler():
    data = lt.corpus(CONFIG, sequences=16, length=17)
    params = llama.init_params(CONFIG)
    steps, global_batch = 6, 4
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=steps, global_batch=global_batch)
    outs = simcomm.World(4).run(lt.train, data, params, CONFIG, layout=Layout(dp=2, tp=2), steps=steps,
                                global_batch=global_batch)
    for out in outs:
        assert (out["losses"] - reference).abs().max() < 1e-12
    assert reference[-1] < reference[0]
    unclipped = lt.reference_losses(data, params, CONFIG, dp=2, steps=3, global_batch=global_batch, max_norm=1e9)
    assert (unclipped - reference[:3]).abs().max() > 1e-6        # the clipping changed the training


def test_batches_follow_the_distributed_sampler_and_cover_each_epoch():
    data = lt.corpus(CONFIG, sequences=8, length=5)
    per_rank = [lt.batches(data, 4, 4, 2, rank) for rank in range(2)]       # 2 steps = 1 epoch of 8
    first_epoch = torch.cat([b for rank in per_rank for b in rank[:2]])
    assert sorted(first_epoch.tolist()) == list(range(8))
    assert per_rank[0][2].tolist() != per_rank[0][0].tolist()                # reshuffled next epoch
    with pytest.raises(ValueError, match="global_batch=3 is not divisible by dp=2"):
        lt.batches(data, 1, 3, 2, 0)


def test_corpus_is_learnable_and_deterministic():
    a, b = lt.corpus(CONFIG, seed=3), lt.corpus(CONFIG, seed=3)
    assert torch.equal(a, b) and a.shape == (64, 17) and int(a.max()) < CONFIG.vocab
    pairs = {(x, y) for row in a.tolist() for x, y in zip(row, row[1:])}
    assert len(pairs) <= 4 * CONFIG.vocab                                     # at most 4 successors a token


def test_data_context_tensor_mesh_equals_one_device():
    data = lt.corpus(CONFIG, sequences=8, length=17)
    params = llama.init_params(CONFIG)
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=3, global_batch=2)
    outs = simcomm.World(8).run(lt.train, data, params, CONFIG, layout=Layout(dp=2, cp=2, tp=2), steps=3,
                                global_batch=2)
    for out in outs:
        assert (out["losses"] - reference).abs().max() < 1e-12


@pytest.mark.real
def test_the_same_training_on_real_gloo_workers(gloo_cluster):
    data = lt.corpus(CONFIG, sequences=8, length=17)
    params = llama.init_params(CONFIG)
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=4, global_batch=4)
    outs = gloo_cluster(4).run(lt.train, data, params, CONFIG, layout=Layout(dp=2, tp=2), steps=4,
                               global_batch=4)
    for out in outs:
        assert (out["losses"] - reference).abs().max() < 1e-12


@pytest.mark.parametrize("layout", [Layout(dp=4), Layout(tp=2)], ids=repr)
def test_dcp_checkpoint_resumes_on_another_layout_and_the_loss_continues_exactly(tmp_path, layout):
    data = lt.corpus(CONFIG, sequences=16, length=17)
    params = llama.init_params(CONFIG)
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=6, global_batch=4)
    first = simcomm.World(4).run(lt.train, data, params, CONFIG, layout=Layout(dp=2, tp=2), steps=3,
                                 global_batch=4, save=str(tmp_path / "step3"))                       # dp 2 x tp 2
    assert (first[0]["losses"] - reference[:3]).abs().max() < 1e-12
    resumed = simcomm.World(layout.world_size).run(lt.train, data, params, CONFIG, layout=layout, steps=3,
                                                   global_batch=4, load=str(tmp_path / "step3"), first_step=3)
    for out in resumed:
        assert (out["losses"] - reference[3:]).abs().max() < 1e-12
    fresh = simcomm.World(layout.world_size).run(lt.train, data, params, CONFIG, layout=layout, steps=3,
                                                 global_batch=4, first_step=3)                                  # no checkpoint: differs
    assert (fresh[0]["losses"] - reference[3:]).abs().max() > 1e-3
