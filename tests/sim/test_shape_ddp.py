"""DistributedDataParallel on shape-only ranks (simcomm.sim.shape_ddp) against torch's own DDP
on the same World with real values: the same collectives on every rank (op, shape, dtype,
bytes, group, root, arguments, in order), the same parameter shapes and dtypes, the same
state_dict keys; a different model on one rank is an error naming the rank and parameter."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import simcomm
from simcomm.errors import ShapeOnlyError
from simcomm.sim.shape_ddp import ShapeOnlyDDP


def _mlp():
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


class _Block(nn.Module):
    """A small transformer-ish model: embedding, attention, layer norms (with a buffer), MLP,
    a head tied to the embedding."""

    def __init__(self, vocab=50, width=32, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("positions", torch.arange(8))

    def forward(self, tokens):
        x = self.embed(tokens)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def _batch(kind):
    if kind is _Block:
        return (torch.arange(16).reshape(2, 8) % 50,)
    return (torch.ones(8, 16),)


def _program(kind, no_sync, cap):
    def program(comm):
        torch.manual_seed(0)
        model = DDP(kind(), bucket_cap_mb=cap)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            if no_sync:
                with model.no_sync():
                    model(*_batch(kind)).float().sum().backward()
            model(*_batch(kind)).float().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return (type(model) is ShapeOnlyDDP, [(tuple(p.shape), p.dtype) for p in model.parameters()],
                list(model.state_dict()), type(model.module).__name__, isinstance(model, DDP))
    return program


def _collectives(world, rank):
    return [(e.op, e.shape, e.dtype, e.nbytes, e.group, e.root, e.args, e.out_shape, e.async_op)
            for e in world.trace.events if e.rank == rank]


@pytest.mark.parametrize("kind", [_mlp, _Block], ids=["mlp", "transformer"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("no_sync", [False, True], ids=["sync", "no_sync"])
def test_shape_only_ddp_issues_the_collectives_torch_ddp_does(kind, world_size, no_sync):
    cap = 0.01                     # several buckets after the rebuild
    real, shape = simcomm.World(world_size), simcomm.World(world_size, tensors="shape")
    real_results = real.run(_program(kind, no_sync, cap))
    shape_results = shape.run(_program(kind, no_sync, cap))
    assert all(not r[0] for r in real_results) and all(r[0] for r in shape_results)
    assert [r[1:] for r in real_results] == [r[1:] for r in shape_results]
    assert shape_results[0][2][0].startswith("module.") and shape_results[0][4]
    reduces = [e for e in _collectives(real, 0) if e[0] == "all_reduce"]
    assert len(reduces) >= 3, reduces      # one bucket, then at least two after the rebuild
    for rank in range(world_size):
        assert _collectives(real, rank) == _collectives(shape, rank), rank


def test_default_buckets_first_one_megabyte_then_25():
    """bucket_cap_mb left out: after the rebuild the first bucket closes at
    dist._DEFAULT_FIRST_BUCKET_BYTES, the next ones at 25 MiB."""
    def program(comm):
        model = DDP(nn.Sequential(*[nn.Linear(512, 512) for _ in range(30)]))
        for _ in range(2):
            model(torch.ones(2, 512)).sum().backward()
    real, shape = simcomm.World(2), simcomm.World(2, tensors="shape")
    real.run(program)
    shape.run(program)
    assert _collectives(real, 1) == _collectives(shape, 1)
    sizes = [e[3] for e in _collectives(shape, 0) if e[0] == "all_reduce"]
    layer = (512 * 512 + 512) * 4
    # before the rebuild one bucket; after it, in reverse order, the first closes once it
    # reaches 1 MiB (one layer: 1 MiB of weight + its bias), the next at 25 MiB (25 layers)
    assert sizes == [30 * layer, layer, 25 * layer, 4 * layer], sizes
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 1024 * 1024


def test_gradients_keep_their_shapes_and_the_module_attribute():
    def program(comm):
        model = DDP(_mlp(), device_ids=None)
        model(torch.ones(4, 16)).sum().backward()
        return [p.grad.shape == p.shape for p in model.parameters()], model.module[0].in_features
    assert simcomm.World(2, tensors="shape").run(program)[1] == ([True] * 6, 16)


def test_a_different_model_on_one_rank_names_the_rank_and_parameter():
    def program(comm):
        width = 64 if comm.rank != 1 else 65
        DDP(nn.Sequential(nn.Linear(16, width), nn.Linear(width, 4)))
    with pytest.raises(Exception) as caught:
        simcomm.World(2, tensors="shape").run(program)
    text = str(caught.value)
    assert "Rank 1" in text and "0.weight" in text and "[65, 16]" in text, text


def test_a_different_parameter_count_names_the_ranks():
    def program(comm):
        layers = 2 if comm.rank == 0 else 3
        DDP(nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)]))
    with pytest.raises(Exception) as caught:
        simcomm.World(2, tensors="shape").run(program)
    assert "params" in str(caught.value) and "inconsistent" in str(caught.value), str(caught.value)


@pytest.mark.parametrize("argument", [{"find_unused_parameters": True}, {"static_graph": True}])
def test_options_not_simulated_are_named(argument):
    def program(comm):
        DDP(_mlp(), **argument)
    with pytest.raises(Exception) as caught:
        simcomm.World(2, tensors="shape").run(program)
    name = next(iter(argument))
    assert name in str(caught.value) and "tensors='real'" in str(caught.value), str(caught.value)
    assert isinstance(caught.value, ShapeOnlyError) or isinstance(caught.value.__cause__, ShapeOnlyError)


def test_real_valued_ranks_keep_torchs_ddp():
    def program(comm):
        return type(DDP(_mlp())) is DDP
    assert simcomm.World(2).run(program) == [True, True]


@pytest.mark.parametrize("as_view", [False, True])
def test_the_bucket_buffers_count_in_a_ranks_memory_as_torchs(as_view):
    """torch's reducer keeps a flat gradient buffer per bucket for the model's life: a rank's
    memory after construction and one no_sync backward (no collective in flight) is the same
    shape-only as real-valued."""
    def program(comm):
        model = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]), gradient_as_bucket_view=as_view)
        with model.no_sync():
            model(torch.ones(4, 256)).sum().backward()
        model.zero_grad()
    peaks = []
    for tensors in ("real", "shape"):
        world = simcomm.World(2, tensors=tensors, memory=True)
        world.run(program)
        peaks.append(world.memory.ranks[1].peak)
    parameters = 4 * (256 * 256 + 256) * 4
    assert peaks[0] == peaks[1] and peaks[1] >= 3 * parameters, peaks   # parameters, buckets, grads


def test_a_subgroup_broadcasts_from_its_first_rank():
    def program(comm):
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        model = DDP(_mlp(), process_group=groups[comm.rank // 2], bucket_cap_mb=0.01)
        for _ in range(2):
            model(torch.ones(8, 16)).sum().backward()
    real, shape = simcomm.World(4), simcomm.World(4, tensors="shape")
    real.run(program)
    shape.run(program)
    for rank in range(4):
        assert _collectives(real, rank) == _collectives(shape, rank), rank
    ddp_ops = [e for e in _collectives(shape, 3) if e[0] in ("all_gather", "broadcast", "all_reduce")]
    assert {e[4] for e in ddp_ops} == {(2, 3)} and len(ddp_ops) >= 6, ddp_ops
    assert {e[5] for e in _collectives(shape, 3) if e[0] == "broadcast"} == {2}
