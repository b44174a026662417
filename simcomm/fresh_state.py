"""The fresh state every run starts from: on each virtual rank and on each real worker.

A new interpreter seeds torch's, Python's and NumPy's default generators from
the operating system, so unseeded numbers differ from process to process and
could not be compared between backends at all. Every run therefore starts every
rank from the same fixed state, on both backends: torch's generators as a fresh
``torch.Generator`` (:data:`FRESH_SEED`), Python's ``random`` seeded with
:data:`PYTHON_FRESH_SEED` and NumPy's global ``np.random`` with
:data:`NUMPY_FRESH_SEED`. The simulator keeps each rank's state apart
(:mod:`simcomm.sim.rank_random`, :mod:`simcomm.sim.process_state`); a real
worker resets its process to it at the start of every run (:mod:`real.worker`).
"""
from __future__ import annotations

import random as _random

import torch

__all__ = ["FRESH_SEED", "PYTHON_FRESH_SEED", "NUMPY_FRESH_SEED", "fresh_cpu_state",
           "reset_python_and_numpy"]

#: the seed of a generator nobody has seeded (c10's ``default_rng_seed_val``)
FRESH_SEED: int = torch.Generator().initial_seed()
#: the seed Python's ``random`` starts every run from, on virtual ranks and real workers
PYTHON_FRESH_SEED: int = FRESH_SEED
#: the seed NumPy's global ``np.random`` starts every run from (it takes 32 bits)
NUMPY_FRESH_SEED: int = FRESH_SEED & 0xFFFF_FFFF

try:
    import numpy as _np
except ImportError:   # NumPy is optional: then there is no NumPy state to reset
    _np = None


def fresh_cpu_state() -> torch.Tensor:
    """The default CPU generator state each rank starts a run with."""
    return torch.Generator().get_state()


def reset_python_and_numpy() -> None:
    """Seed Python's ``random`` and NumPy's global ``np.random`` as every run starts them."""
    _random.seed(PYTHON_FRESH_SEED)
    if _np is not None:
        _np.random.seed(NUMPY_FRESH_SEED)
