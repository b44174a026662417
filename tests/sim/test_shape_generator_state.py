"""A CPU generator's state on shape-only ranks after draws without values (a model's initialisation,
``randn``, dropout): the same as in a real-valued run, so a later index draw (a DataLoader's base
seed, a sampler's shuffle, ``randint``) has torchrun's values. The oracle is the same program on
real tensors without simcomm, bitwise. A draw whose consumption is not followed (or one too costly
to follow) still leaves the generator unknown, and reading a later draw is the named error."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import simcomm
from simcomm.errors import RankError, ShapeOnlyError
from simcomm.sim import shape_random

SIZES = (1, 3, 15, 16, 17, 33, 100, 1000, 65537, 1_000_000)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _noncontiguous(n, dtype):
    return torch.empty(n, 2, dtype=dtype)[:, 0]


#: each draw without values a script makes: (name, draw(n, dtype, generator or None))
DRAWS = {
    "normal_": lambda n, d, g: torch.empty(n, dtype=d).normal_(generator=g),
    "normal_(mean, std) not contiguous": lambda n, d, g: _noncontiguous(n, d).normal_(1.5, 0.2, generator=g),
    "uniform_": lambda n, d, g: torch.empty(n, dtype=d).uniform_(-2, 3, generator=g),
    "bernoulli_(p)": lambda n, d, g: torch.empty(n, dtype=d).bernoulli_(0.3, generator=g),
    "bernoulli_(tensor p)": lambda n, d, g: torch.empty(n, dtype=d).bernoulli_(torch.full((n,), 0.5, dtype=d),
                                                                                  generator=g),
    "bernoulli(p)": lambda n, d, g: torch.bernoulli(torch.full((n,), 0.25, dtype=d), generator=g),
    "exponential_": lambda n, d, g: torch.empty(n, dtype=d).exponential_(),
    "cauchy_": lambda n, d, g: torch.empty(n, dtype=d).cauchy_(),
    "geometric_": lambda n, d, g: torch.empty(n, dtype=d).geometric_(0.4),
    "log_normal_": lambda n, d, g: torch.empty(n, dtype=d).log_normal_(),
    "random_": lambda n, d, g: torch.empty(n, dtype=d).random_(generator=g),
    "random_(from, to)": lambda n, d, g: _noncontiguous(n, d).random_(3, 90, generator=g),
    "randint(float dtype)": lambda n, d, g: torch.randint(0, 200, (n,), dtype=d, generator=g),
    "randn": lambda n, d, g: torch.randn(n, dtype=d, generator=g),
    "rand": lambda n, d, g: torch.rand(n, dtype=d, generator=g),
    "randn_like (transposed)": lambda n, d, g: torch.randn_like(torch.empty(2, n, dtype=d).t()),
    "rand_like": lambda n, d, g: torch.rand_like(torch.empty(n, dtype=d)),
    "normal(mean tensor, std)": lambda n, d, g: torch.normal(torch.zeros(n, dtype=d), 2.0, generator=g),
    "normal(mean, std, size)": lambda n, d, g: torch.normal(0.0, 1.0, (n,), dtype=d, generator=g),
    "dropout": lambda n, d, g: F.dropout(torch.empty(n, dtype=d), 0.1, training=True),
    "nn.Dropout on a tensor that requires grad": lambda n, d, g: nn.Dropout(0.3)(torch.empty(n, dtype=d,
                                                                                          requires_grad=True)),
    "kaiming_uniform_": lambda n, d, g: nn.init.kaiming_uniform_(torch.empty(n, 1, dtype=d), a=5 ** 0.5,
                                                                 generator=g),
    "xavier_normal_": lambda n, d, g: nn.init.xavier_normal_(torch.empty(1, n, dtype=d), generator=g),
    "trunc_normal_": lambda n, d, g: nn.init.trunc_normal_(torch.empty(n, dtype=d), std=0.02, generator=g),
}


#: draws that take no generator, or that a fake tensor refuses to take one for (torch's fake mode
#: runs exponential_, cauchy_, geometric_ and log_normal_ through its references, which refuse one)
_DEFAULT_ONLY = ("randn_like (transposed)", "rand_like", "dropout", "nn.Dropout on a tensor that requires grad",
                 "exponential_", "cauchy_", "geometric_", "log_normal_")


def _reads(g) -> list:
    """What a script reads after its draws: index draws with values."""
    return [torch.randint(0, 2 ** 31, (3,), generator=g).tolist(),
            torch.empty((), dtype=torch.int64).random_(generator=g).item(),
            torch.randperm(7, generator=g).tolist()]


def _cases(draw, own_generator: bool) -> list:
    out = []
    for dtype in (DTYPES if not own_generator else DTYPES[:1]):     # a generator of its own: float32
        for n in SIZES:
            torch.manual_seed(n)
            g = torch.Generator().manual_seed(n + 1) if own_generator else None
            DRAWS[draw](n, dtype, g)
            out.append(_reads(g))
    return out


@pytest.mark.parametrize("draw", list(DRAWS))
def test_index_draws_after_a_draw_without_values_are_the_real_valued_runs(draw):
    own = draw not in _DEFAULT_ONLY
    for own_generator in ((False, True) if own else (False,)):
        shape = simcomm.World(1, tensors="shape").run(lambda comm: _cases(draw, own_generator))[0]
        with torch.random.fork_rng():
            expected = _cases(draw, own_generator)
        assert shape == expected, (draw, own_generator)


def _mixed(comm_or_none=None) -> list:
    """Draws that fill and empty the cached normal samples, and large and small ones, in one stream."""
    torch.manual_seed(5)
    out = []
    torch.empty(3).normal_()                    # the scalar path: a double normal sample left cached
    torch.empty(1000).normal_()                 # vectorised: takes uniforms, leaves the cache alone
    torch.empty(1, dtype=torch.float64).normal_()     # uses the cached sample
    torch.empty(5000, 3).t().normal_()          # not contiguous: the scalar path, element by element
    out.append(_reads(None))
    torch.empty(5).log_normal_()
    torch.empty(999, dtype=torch.bfloat16).normal_()
    torch.randn(7)
    out.append(_reads(None))
    state = torch.get_rng_state()               # saved and set again: activation checkpointing's way
    F.dropout(torch.empty(300), 0.5)
    torch.set_rng_state(state)
    F.dropout(torch.empty(300), 0.5)
    out.append(_reads(None))
    with torch.random.fork_rng():
        torch.randn(10_000)
    out.append(_reads(None))
    torch.randn(100)
    first = torch.get_rng_state()
    torch.randn(50)
    second = torch.get_rng_state()
    torch.set_rng_state(first)
    out.append(_reads(None))                    # the state saved first, worked out
    torch.set_rng_state(second)
    out.append(_reads(None))                    # and the one saved after it, from there
    for _ in range(2000):                       # a training loop's dropout masks
        F.dropout(torch.empty(64), 0.1)
    out.append(_reads(None))
    big = torch.randint(0, 10, (simcomm.sim.shape.RANDOM_INDEX_LIMIT + 1,))     # too large for values: followed
    out.append((big.shape[0], _reads(None)))
    return out


def test_the_cached_normal_samples_and_saved_states_are_followed_in_order():
    shape = simcomm.World(1, tensors="shape").run(_mixed)[0]
    with torch.random.fork_rng():
        expected = _mixed()
    assert shape == expected


class _Tiny(nn.Module):
    """A GPT-ish stack: embeddings, blocks of LayerNorm and Linear layers, dropout."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(500, 48)
        self.positions = nn.Parameter(torch.zeros(1, 16, 48))
        self.blocks = nn.Sequential(*[nn.Sequential(nn.LayerNorm(48), nn.Linear(48, 192), nn.GELU(),
                                                    nn.Linear(192, 48), nn.Dropout(0.1)) for _ in range(2)])
        self.head = nn.Linear(48, 500, bias=False)
        nn.init.normal_(self.positions, std=0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, index):
        return self.head(self.blocks(self.tokens(index) + self.positions))


def _train_setup(rank: int, world: int) -> dict:
    """A training script's start: seed, model, a step with dropout, then its data loaders."""
    torch.manual_seed(1337)
    model = _Tiny()
    loss = model(torch.zeros(2, 16, dtype=torch.long)).sum()
    loss.backward()
    dataset = list(range(40))
    shuffled = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=0)
    loader_iter = iter(shuffled)
    out = {"base_seed": loader_iter._base_seed, "batches": [batch.tolist() for batch in loader_iter]}
    seed = torch.randint(0, 99, ()).item()
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    out["distributed"] = list(sampler)
    return out


def test_a_model_then_a_dataloader_on_two_shape_only_ranks_draws_what_a_valued_run_draws():
    def program(comm):
        return _train_setup(comm.rank, comm.world_size)

    shape = simcomm.World(2, tensors="shape").run(program)
    real = simcomm.World(2).run(program)
    with torch.random.fork_rng():
        alone = [_train_setup(rank, 2) for rank in range(2)]
    assert shape == real == alone
    assert shape[0]["distributed"] != shape[1]["distributed"]


def _refused(program, *args) -> str:
    with pytest.raises(RankError) as error:
        simcomm.World(1, tensors="shape").run(program, *args)
    cause = error.value.__cause__
    assert isinstance(cause, ShapeOnlyError), repr(cause)
    assert "aten._local_scalar_dense" in str(cause)
    return str(cause)


def test_a_draw_that_is_not_followed_leaves_the_generator_unknown():
    def program(comm, what):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(3)
        if what == "multinomial":        # takes as many outputs as its values need
            torch.multinomial(torch.ones(10), 4, generator=g)
        elif what == "poisson":
            torch.poisson(torch.ones(10), generator=g)
        elif what == "large trunc_normal_":
            nn.init.trunc_normal_(torch.empty(shape_random.REPLAY_LIMIT + 1), generator=g)
        return torch.randint(0, 9, (3,), generator=g).tolist()

    for what in ("multinomial", "poisson", "large trunc_normal_"):
        _refused(program, what)
    assert "trunc_normal_" in _refused(program, "large trunc_normal_")


def test_a_state_too_costly_to_work_out_is_the_named_error_saying_why(monkeypatch):
    monkeypatch.setattr(shape_random, "FOLLOW_LIMIT", 10_000)

    def program(comm):
        torch.manual_seed(0)
        nn.Linear(100, 100)
        return torch.randperm(10).tolist()

    message = _refused(program)
    assert "too costly" in message and "10,000" in message


def test_a_reseeded_generator_is_known_again_and_other_ranks_are_not_touched():
    def program(comm):
        torch.manual_seed(comm.rank)
        torch.multinomial(torch.ones(10), 4)          # unknown
        if comm.rank == 0:
            torch.manual_seed(42)
            torch.randn(100)
            return torch.randperm(6).tolist()
        return torch.randperm(6)                      # rank 1: no value, but it is not read

    out = simcomm.World(2, tensors="shape").run(program)
    with torch.random.fork_rng():
        torch.manual_seed(42)
        torch.randn(100)
        assert out[0] == torch.randperm(6).tolist()


def test_a_state_saved_too_many_followed_draws_ago_is_the_named_error_not_a_wrong_value(monkeypatch):
    monkeypatch.setattr(shape_random, "KEEP", 4)

    def program(comm, draws):
        torch.manual_seed(0)
        torch.randn(100)
        saved = torch.get_rng_state()
        torch.randn(3)
        torch.randint(0, 5, (2,)).tolist()      # worked out: the draws before it are let go
        for _ in range(draws):
            torch.randn(3)
        torch.set_rng_state(saved)
        return torch.randperm(5).tolist()

    assert "followed draws earlier" in _refused(program, 10)
    out = simcomm.World(1, tensors="shape").run(program, 1)[0]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        torch.randn(100)
        assert out == torch.randperm(5).tolist()


def _attention_then_reads() -> list:
    """Draws that take nothing from the generator: the CPU's flash attention (dropout_p 0, what
    nanoGPT's default config runs) and dropout outside training, between followed draws."""
    torch.manual_seed(3)
    nn.Linear(16, 16)
    q = torch.randn(2, 2, 8, 16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    torch.ops.aten.native_dropout(torch.randn(5), 0.5, False)
    return _reads(None)


def test_draws_that_take_nothing_leave_the_generator_followed():
    shape = simcomm.World(1, tensors="shape").run(lambda comm: _attention_then_reads())[0]
    with torch.random.fork_rng():
        assert shape == _attention_then_reads()
