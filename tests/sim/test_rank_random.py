"""Each virtual rank has its own random state, as each process of a real run has.

The oracle is a single process: ``torch.manual_seed(s)`` and the same draws
on a ``torch.Generator`` of this thread, with no other rank drawing in between.
"""
from __future__ import annotations

import pytest
import torch

import simcomm
from simcomm.fresh_state import DEFAULT_RUN_SEED, FRESH_SEED, SEED_VARIABLE, fresh_cpu_state


def reference_draws(seed: int | None, count: int, shape=(3,)) -> list[torch.Tensor]:
    gen = torch.Generator()
    if seed is not None:
        gen.manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(count)]


def seeded_program(comm):
    """Seed, draw, hand the turn around with collectives, draw again."""
    torch.manual_seed(0)
    first = torch.randn(3)
    comm.barrier()                                   # every other rank draws in between
    comm.all_reduce(torch.ones(1))
    second = torch.randn(3)
    return first, second


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_seeding_every_rank_alike_gives_every_rank_the_single_process_numbers(world_size):
    expected = reference_draws(0, 2)
    for rank, (first, second) in enumerate(simcomm.World(world_size).run(seeded_program)):
        assert torch.equal(first, expected[0]), rank
        assert torch.equal(second, expected[1]), rank


def test_one_rank_seeding_and_drawing_never_changes_another_ranks_numbers():
    def program(comm):
        torch.manual_seed(comm.rank)
        mine = []
        for step in range(3):
            # rank r draws r + 1 tensors per step; the others draw theirs in between
            mine.extend(torch.randn(2) for _ in range(comm.rank + 1))
            comm.barrier()
        return mine

    for rank, draws in enumerate(simcomm.World(3).run(program)):
        expected = reference_draws(rank, 3 * (rank + 1), shape=(2,))
        assert all(torch.equal(a, b) for a, b in zip(draws, expected, strict=True)), rank


def test_each_rank_starts_every_run_from_a_seed_of_its_own(monkeypatch):
    """Unseeded ranks draw different numbers, as the processes of a torchrun run do; rank r's are
    those of one process after torch.manual_seed(S + r), S the run seed, in every run."""
    monkeypatch.delenv(SEED_VARIABLE, raising=False)

    def program(comm):
        comm.barrier()
        return torch.randn(3), torch.initial_seed()

    world = simcomm.World(3)
    for run in range(2):   # the second run starts afresh too
        outs = world.run(program)
        for rank, (draw, seed) in enumerate(outs):
            assert seed == DEFAULT_RUN_SEED + rank, (run, rank)
            assert torch.equal(draw, reference_draws(DEFAULT_RUN_SEED + rank, 1)[0]), (run, rank)
        assert not torch.equal(outs[0][0], outs[1][0])
    # rank 0 at the default run seed: what a generator nobody has seeded draws
    assert torch.equal(world.run(program)[0][0], reference_draws(None, 1)[0])
    assert torch.equal(fresh_cpu_state(), torch.Generator().get_state()) and DEFAULT_RUN_SEED == FRESH_SEED


def test_simcomm_seed_picks_the_run_seed(monkeypatch):
    def program(comm):
        return torch.initial_seed(), torch.randn(2)

    monkeypatch.setenv(SEED_VARIABLE, "0x10")
    for rank, (seed, draw) in enumerate(simcomm.World(2).run(program)):
        assert seed == 16 + rank and torch.equal(draw, reference_draws(16 + rank, 1, shape=(2,))[0])
    monkeypatch.setenv(SEED_VARIABLE, str((1 << 64) - 1))          # wraps around for rank 1
    assert [seed for seed, _ in simcomm.World(2).run(program)] == [(1 << 64) - 1, 0]
    monkeypatch.setenv(SEED_VARIABLE, "random")
    first, second = simcomm.World(2).run(program), simcomm.World(2).run(program)
    assert first[1][0] == first[0][0] + 1 and first[0][0] != second[0][0]
    for bad in ("twelve", "-1", str(1 << 64), "1.5"):
        monkeypatch.setenv(SEED_VARIABLE, bad)
        with pytest.raises(ValueError, match=f"SIMCOMM_SEED={bad!r}"):
            simcomm.World(2).run(program)


def test_a_run_leaves_the_callers_random_state_unchanged():
    torch.manual_seed(123)
    expected = torch.randn(4)
    torch.manual_seed(123)
    simcomm.World(2).run(lambda comm: (torch.manual_seed(7), torch.randn(100)))
    assert torch.equal(torch.randn(4), expected)


def test_dropout_model_with_the_same_seed_on_every_rank_matches_one_process():
    """Data parallel with dropout: every rank seeds alike, so the replicated weights and
    every rank's dropout mask are those of the single-process model on that rank's batch."""
    world_size, batch, width = 3, 4, 6
    data = torch.randn(world_size * batch, width, dtype=torch.float64,
                       generator=torch.Generator().manual_seed(1))

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Dropout(0.5),
                                   torch.nn.Linear(width, 1)).double()

    def program(comm, data):
        model = build()
        comm.barrier()      # the other ranks build theirs in between: the turn passes
        out = model(data[comm.rank * batch:(comm.rank + 1) * batch])   # (batch, 1)
        out.sum().backward()
        grads = [comm.all_reduce(p.grad) for p in model.parameters()]
        return out.detach(), grads

    outs = simcomm.World(world_size).run(program, data)
    ref_grads = None
    for rank, (out, grads) in enumerate(outs):
        model = build()   # the reference: one process, the same seed, rank's batch
        ref_out = model(data[rank * batch:(rank + 1) * batch])
        ref_out.sum().backward()
        assert torch.equal(out, ref_out.detach()), rank
        rank_grads = [p.grad for p in model.parameters()]
        ref_grads = rank_grads if ref_grads is None else [a + b for a, b in zip(ref_grads, rank_grads)]
    for rank, (_, grads) in enumerate(outs):
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _real_program(comm):
    torch.manual_seed(0)
    first = torch.randn(3)
    comm.barrier()
    second = torch.randn(3)
    return first, second


def _unseeded(comm):
    return torch.randn(3)


@pytest.mark.slow
@pytest.mark.real
def test_seeded_random_numbers_are_the_same_on_real_processes():
    real = pytest.importorskip("real")
    sim = simcomm.World(2).run(_real_program)
    got = real.run(_real_program, world_size=2, backend="gloo")
    for rank in range(2):
        assert torch.equal(got[rank][0], sim[rank][0]) and torch.equal(got[rank][1], sim[rank][1])


@pytest.mark.slow
@pytest.mark.real
def test_unseeded_random_numbers_are_the_same_on_real_processes():
    real = pytest.importorskip("real")
    sim = simcomm.World(2).run(_unseeded)
    got = real.run(_unseeded, world_size=2, backend="gloo")
    for rank in range(2):
        assert torch.equal(got[rank], sim[rank]), rank


# -- torch's CPU generator kept as raw bytes ---------------------------------------------------------

def test_torchs_cpu_generator_is_kept_as_raw_bytes_on_this_torch():
    """The layout check passes on the torch this project pins, so a handoff compares raw bytes
    instead of building a get_state tensor (the fallback stays correct, only slower)."""
    from simcomm.sim.rank_random import cpu_raw

    raw = cpu_raw()
    assert raw is not None
    saved, state = raw.get(), torch.get_rng_state()
    torch.randn(1, dtype=torch.float64)    # fills the cached normal sample
    torch.rand(700)
    assert raw.get() != saved
    raw.set(saved)
    assert torch.equal(torch.get_rng_state(), state)


def _torch_draws(generator=None) -> list:
    """Draws between barriers: a double normal (caches its second sample), one that uses the
    cached sample, a float normal, and enough integers to regenerate the 624-word state."""
    kw = {} if generator is None else {"generator": generator}
    return [lambda: torch.randn(1, dtype=torch.float64, **kw), lambda: torch.randn(1, dtype=torch.float64, **kw),
            lambda: torch.empty(2).normal_(**kw), lambda: torch.randint(0, 1 << 20, (700,), **kw)]


@pytest.mark.parametrize("raw", [True, False], ids=["raw bytes", "get_state fallback"])
def test_torch_cached_samples_and_seeds_stay_per_rank(raw, monkeypatch):
    """Every rank but rank 1 seeds with its rank (rank 1 draws from its own unseeded start); each draws
    between barriers, so a cached normal sample must survive the other ranks' draws. The oracle
    is one generator doing the same draws with nobody in between."""
    from simcomm.sim import process_state

    if not raw:
        monkeypatch.setattr(process_state, "_RAW", {"torch": None})

    def program(comm):
        if comm.rank != 1:
            torch.manual_seed(comm.rank)
        mine = []
        for _ in range(2):
            for draw in _torch_draws():
                mine.append(draw())
                comm.barrier()
        return mine

    for rank, mine in enumerate(simcomm.World(3).run(program)):
        generator = torch.Generator().manual_seed(rank if rank != 1 else DEFAULT_RUN_SEED + 1)
        expected = [draw() for _ in range(2) for draw in _torch_draws(generator)]
        assert all(torch.equal(a, b) for a, b in zip(mine, expected, strict=True)), rank


# -- Python's random and NumPy's global random state, sys.argv and __main__ ------------------------

@pytest.mark.parametrize("raw", [True, False], ids=["raw bytes", "getstate fallback"])
def test_python_and_numpy_seeding_on_one_rank_never_changes_another_ranks_numbers(raw, monkeypatch):
    """Each rank seeds with its rank and draws between barriers, the legacy Gaussians' cached
    second values included; the oracle is one process doing the same with nobody in between.
    Both ways of keeping the state: raw bytes, and the generators' own getstate/setstate
    (where the raw layout is unknown)."""
    import random

    from simcomm.sim import process_state

    if not raw:
        monkeypatch.setattr(process_state, "_RAW", {"python": None, "numpy": None})

    import numpy as np

    def draws():
        return [random.random(), random.gauss(0, 1), float(np.random.randn()), int(np.random.randint(9))]

    def program(comm):
        random.seed(comm.rank)
        np.random.seed(comm.rank)
        mine = []
        for _ in range(3):
            mine.extend(draws())
            comm.barrier()
        return mine

    for rank, mine in enumerate(simcomm.World(3).run(program)):
        random.seed(rank)
        np.random.seed(rank)
        assert mine == [value for _ in range(3) for value in draws()], rank


def test_sys_argv_and_main_are_per_rank_and_the_callers_come_back():
    import sys
    import types

    caller_argv, caller_main = sys.argv, sys.modules["__main__"]

    def program(comm):
        sys.argv = [f"rank{comm.rank}"]
        sys.modules["__main__"] = types.ModuleType(f"main{comm.rank}")
        comm.barrier()
        comm.all_reduce(torch.ones(1))
        return sys.argv, sys.modules["__main__"].__name__

    assert simcomm.World(3).run(program) == [([f"rank{r}"], f"main{r}") for r in range(3)]
    assert sys.argv is caller_argv and sys.modules["__main__"] is caller_main
