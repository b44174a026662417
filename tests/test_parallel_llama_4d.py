"""The small Llama trained with FSDP/HSDP, a 1F1B pipeline, context and tensor parallelism, against one device.

Every step's loss is compared with :func:`simcomm.parallel.llama_training.reference_losses`
(one device, no communication, float64)."""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.parallel import llama, llama_fsdp
from simcomm.parallel import llama_training as lt

CONFIG = llama.Config()
TOLERANCE = 1e-12


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # the reference runs in this thread; 2 cores are shared
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def setup():
    data = lt.corpus(CONFIG, sequences=16, length=17)
    params = llama.init_params(CONFIG)
    return data, params


def _max_error(outs, reference) -> float:
    return max(float((out["losses"] - reference).abs().max()) for out in outs)


@pytest.mark.parametrize("world_size, kwargs", [
    (4, dict(tp=1, fsdp=4)),                     # FSDP over 4 data-parallel ranks
    (4, dict(tp=1, fsdp=2)),                     # HSDP: 2 replicas x 2 shards
    (8, dict(tp=2, fsdp=2)),                     # HSDP with tensor parallelism
    (4, dict(tp=1, pp=2, fsdp=1)),               # the 1F1B pipeline inside the training loop
])
def test_fsdp_hsdp_and_pipeline_training_equal_one_device(setup, world_size, kwargs):
    data, params = setup
    dp = world_size // (kwargs["tp"] * kwargs.get("pp", 1))
    reference = lt.reference_losses(data, params, CONFIG, dp=dp, steps=3, global_batch=4)
    outs = simcomm.World(world_size).run(lt.train, data, params, CONFIG, steps=3, global_batch=4, **kwargs)
    assert _max_error(outs, reference) < TOLERANCE
    if kwargs["fsdp"] > 1:         # each rank holds 1/fsdp of its parameters (and so of Adam's state)
        tensor_shards = llama.shard_params(params, CONFIG, 0, kwargs["tp"])
        assert outs[0]["held"] == sum(llama_fsdp.piece_numel(p.numel(), kwargs["fsdp"])
                                      for p in tensor_shards.values())
    layout = lt.Layout(dp, kwargs.get("pp", 1), 1, kwargs["tp"], kwargs["fsdp"])
    assert [out["held"] for out in outs] == [lt.held_numel(CONFIG, layout, rank) for rank in range(world_size)]


def test_all_four_on_16_virtual_ranks_equal_one_device_and_final_shards_assemble(setup):
    data, params = setup
    steps = 4
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=steps, global_batch=4)
    outs = simcomm.World(16).run(lt.train, data, params, CONFIG, tp=2, pp=2, cp=2, fsdp=2, steps=steps,
                                 global_batch=4)
    assert _max_error(outs, reference) < TOLERANCE
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
        d, _, c, t = out["coords"]
        if d == 0 and c == 0:
            per_t[t].update(out["shards"])
    trained = llama.assemble_grads(per_t)
    for name, leaf in leaves.items():
        expected = leaf.detach() * (2 if name.split(".")[-1] in llama.REPLICATED else 1)  # assemble sums norms
        torch.testing.assert_close(trained[name], expected, rtol=0, atol=1e-12, msg=name)


@pytest.mark.slow
def test_100_steps_in_4d_every_loss_equals_one_device(setup):
    data = lt.corpus(CONFIG, sequences=32, length=17)
    params = llama.init_params(CONFIG)
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=100, global_batch=4)
    outs = simcomm.World(16).run(lt.train, data, params, CONFIG, tp=2, pp=2, cp=2, fsdp=2, steps=100,
                                 global_batch=4)
    assert _max_error(outs, reference) < 1e-10
    assert reference[-10:].mean() < reference[:10].mean() - 0.5       # it learns


def test_dcp_checkpoint_of_the_4d_run_resumes_on_other_layouts_and_continues_exactly(setup, tmp_path):
    data, params = setup
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=6, global_batch=4)
    first = simcomm.World(16).run(lt.train, data, params, CONFIG, tp=2, pp=2, cp=2, fsdp=2, steps=3,
                                  global_batch=4, save=str(tmp_path / "step3"))
    assert _max_error(first, reference[:3]) < TOLERANCE
    for world_size, kwargs in ((4, dict(tp=2, fsdp=2)), (4, dict(tp=1, pp=2, fsdp=1)), (2, dict(tp=1, fsdp=2))):
        resumed = simcomm.World(world_size).run(lt.train, data, params, CONFIG, steps=3, global_batch=4,
                                                load=str(tmp_path / "step3"), first_step=3, **kwargs)
        assert _max_error(resumed, reference[3:]) < TOLERANCE, kwargs
    fresh = simcomm.World(2).run(lt.train, data, params, CONFIG, tp=1, fsdp=2, steps=3, global_batch=4,
                                 first_step=3)                                      # no checkpoint: differs
    assert _max_error(fresh, reference[3:]) > 1e-3


@pytest.mark.real
def test_the_4d_training_on_8_real_gloo_workers(gloo_cluster):
    data = lt.corpus(CONFIG, sequences=16, length=17)
    params = llama.init_params(CONFIG)
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=4, global_batch=4)
    outs = gloo_cluster(8).run(lt.train, data, params, CONFIG, tp=2, pp=2, fsdp=2, steps=4, global_batch=4)
    assert _max_error(outs, reference) < TOLERANCE


@pytest.mark.real
@pytest.mark.slow
def test_100_steps_of_the_4d_training_on_8_real_gloo_workers(gloo_cluster):
    data = lt.corpus(CONFIG, sequences=32, length=17)
    params = llama.init_params(CONFIG)
    reference = lt.reference_losses(data, params, CONFIG, dp=2, steps=100, global_batch=4)
    outs = gloo_cluster(8, timeout=900).run(lt.train, data, params, CONFIG, tp=2, pp=2, fsdp=2, steps=100,
                                            global_batch=4)
    assert _max_error(outs, reference) < 1e-10


def test_layout_numbers_ranks_as_init_device_mesh_and_rejects_bad_sizes():
    layout = lt.Layout(dp=2, pp=2, cp=2, tp=2, fsdp=2)
    grid = torch.arange(16).view(2, 2, 2, 2)                       # init_device_mesh's row-major order
    assert all(layout.rank(*layout.coords(r)) == r and grid[layout.coords(r)] == r for r in range(16))
    assert layout.groups("t")[0] == [0, 1] and layout.groups("p")[0] == [0, 4]
    assert layout.groups("s") == [grid[:, p, c, t].tolist() for p in range(2) for c in range(2) for t in range(2)]
    assert lt.Layout(dp=4, fsdp=2).groups("r") == [[0, 2], [1, 3]]    # HSDP: replicas of one shard
    with pytest.raises(ValueError, match="dp=4 is not divisible by fsdp=3"):
        lt.Layout(dp=4, fsdp=3)
    with pytest.raises(ValueError, match="pp=0 must be >= 1"):
        lt.Layout(pp=0)


def test_train_names_the_sizes_that_do_not_divide(setup):
    data, params = setup
    with pytest.raises(simcomm.errors.RankError, match="not divisible by pp \\* cp \\* tp = 2 \\* 1 \\* 2"):
        simcomm.World(6).run(lt.train, data, params, CONFIG, tp=2, pp=2, steps=1, global_batch=4)
