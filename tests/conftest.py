"""Shared fixtures and the test tiers.

Tiers: ``python -m pytest -q -m "not slow"`` is the developers' quick check
(the library and its figures, under two minutes); ``python -m pytest -q``, what
CI runs, adds the slow tier: real worker processes (marker ``real``), lessons
under nbval, the handout and the browser tests (``browser``). Every test marked
``real`` or ``browser`` is slow.
"""
from __future__ import annotations

import signal
import warnings

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("real") or item.get_closest_marker("browser"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def sigint_handler_kept(request):
    """Each test starts with the SIGINT handler the session had, as a fresh process has Python's:
    the Ctrl-C tests depend on it. A test that leaves another one behind is named in a warning and
    the handler is put back."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before and after != before:
        signal.signal(signal.SIGINT, before)
        warnings.warn(f"{request.node.nodeid} left SIGINT's handler as {after!r} (put back)", stacklevel=1)


@pytest.fixture(scope="session")
def gloo_cluster():
    """``gloo_cluster(world_size, timeout=120.0)``: a running gloo :class:`real.Cluster`, one per
    ``(world_size, timeout)`` for the whole session, so its workers start once. A test that
    breaks or closes it leaves it usable: a Cluster restarts dead workers on its next run."""
    import real

    clusters: dict[tuple[int, float], real.Cluster] = {}

    def get(world_size: int, timeout: float = 120.0) -> real.Cluster:
        key = (world_size, timeout)
        if key not in clusters:
            clusters[key] = real.Cluster(world_size, backend="gloo", timeout=timeout)
        return clusters[key]

    yield get
    for cluster in clusters.values():
        cluster.close()


@pytest.fixture(params=["sim", pytest.param("real", marks=[pytest.mark.real, pytest.mark.timeout(300)])])
def backend(request, gloo_cluster):
    """``backend(world_size)``: what runs a test's program on both backends, for the tests of a
    promise both keep: a fresh :class:`simcomm.World` (``"sim"``) or the session's gloo
    :class:`real.Cluster` (``"real"``, slow tier). Both have ``run(program, *args)``, ``trace``
    and ``world_size``; ``backend.name`` says which one a test got."""
    import simcomm

    def launch(world_size: int):
        return simcomm.World(world_size) if request.param == "sim" else gloo_cluster(world_size)

    launch.name = request.param
    return launch


@pytest.fixture
def one_thread():
    """torch computes with one thread during the test: a float64 single-device reference in the
    test's own thread would otherwise share this machine's cores with the ranks."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
