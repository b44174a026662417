"""The state every run starts from: each virtual rank and each real worker a seed of its own.

A new interpreter seeds torch's, Python's and NumPy's default generators from
the operating system (torch 2.13: ``torch.initial_seed()`` differs on every
start), so under ``torchrun`` every process draws different unseeded numbers,
and a program that forgets to seed, or to broadcast its initial weights, starts
its ranks from different values. Every rank of a simcomm run starts from a seed
of its own too, but reproducibly: rank ``r`` of a run with *run seed* ``S``
starts from :func:`rank_seed` ``(S, r) = S + r`` (modulo 2**64), as if the
program had begun with::

    torch.manual_seed(S + r)          # the CPU generator, and every CUDA generator
    random.seed(S + r)
    numpy.random.seed((S + r) % 2**32)

Unseeded draws therefore differ from rank to rank, as between processes, and
are the same in every run with the same run seed, on virtual ranks and on
``real`` workers alike (the simulator keeps each rank's state apart,
:mod:`simcomm.sim.rank_random` and :mod:`simcomm.sim.process_state`; a real
worker seeds its process at the start of every run, :mod:`real.worker`).

**Picking the run seed.** The environment variable ``SIMCOMM_SEED`` of the
process that starts a run (``World.run``, ``real.run``, ``python -m
simcomm.run``): a decimal or ``0x`` integer in ``[0, 2**64)``, or ``random``
for a seed drawn from the operating system at each run (unrepeatable, as under
torchrun). Unset: :data:`DEFAULT_RUN_SEED`, the seed torch gives a generator
nobody has seeded (c10's ``default_rng_seed_val``), so rank 0 draws what a
fresh ``torch.Generator()`` draws::

    SIMCOMM_SEED=1234 python -m simcomm.run --nproc-per-node 2 train.py
"""
from __future__ import annotations

import os
import random as _random
import secrets

import torch

__all__ = ["FRESH_SEED", "DEFAULT_RUN_SEED", "SEED_VARIABLE", "run_seed", "rank_seed", "numpy_seed",
           "fresh_cpu_state", "seed_process"]

#: the seed of a generator nobody has seeded (c10's ``default_rng_seed_val``)
FRESH_SEED: int = torch.Generator().initial_seed()
#: the run seed when ``SIMCOMM_SEED`` is unset
DEFAULT_RUN_SEED: int = FRESH_SEED
#: the environment variable that picks the run seed
SEED_VARIABLE = "SIMCOMM_SEED"

try:
    import numpy as _np
except ImportError:   # NumPy is optional: then there is no NumPy state to seed
    _np = None


def run_seed() -> int:
    """The seed of a run started now: ``SIMCOMM_SEED`` as the module docstring says, else
    :data:`DEFAULT_RUN_SEED`. Raises ``ValueError`` naming the variable for a value that is
    neither an integer in ``[0, 2**64)`` nor ``random``."""
    text = os.environ.get(SEED_VARIABLE, "").strip()
    if not text:
        return DEFAULT_RUN_SEED
    if text.lower() == "random":
        return secrets.randbits(63)
    try:
        seed = int(text, 0)
    except ValueError:
        seed = -1
    if not 0 <= seed < 1 << 64:
        raise ValueError(f"{SEED_VARIABLE}={text!r}: the run seed must be an integer in [0, 2**64) "
                         f"(decimal or 0x...) or 'random'")
    return seed


def rank_seed(seed: int, rank: int) -> int:
    """The seed rank ``rank`` of a run with run seed ``seed`` starts its generators from."""
    return (seed + rank) % (1 << 64)


def numpy_seed(seed: int) -> int:
    """What NumPy's global generator is seeded with for ``seed`` (it takes 32 bits)."""
    return seed & 0xFFFF_FFFF


def fresh_cpu_state() -> torch.Tensor:
    """The state of a CPU generator nobody has seeded (rank 0's at the default run seed)."""
    return torch.Generator().get_state()


def seed_process(seed: int) -> None:
    """Seed this process's generators as a rank whose :func:`rank_seed` is ``seed`` starts:
    torch's (CPU and every CUDA device), Python's ``random``, NumPy's global ``np.random``."""
    torch.manual_seed(seed)
    _random.seed(seed)
    if _np is not None:
        _np.random.seed(numpy_seed(seed))
