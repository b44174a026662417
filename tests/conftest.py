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

from tests.launchers import sigint_state


def pytest_collection_modifyitems(items):
    for item in items:
        if item.get_closest_marker("real") or item.get_closest_marker("browser"):
            item.add_marker(pytest.mark.slow)


_SIGINT_AT_START: list[str] = []      # what pytest_configure found and put right, for the header


def pytest_configure(config):
    """SIGINT as a process a terminal starts has it: Python's handler, not ignored, not blocked.
    A pytest started as a background job of a non-interactive shell (``cmd &`` in a script,
    ``nohup cmd &``) inherits SIGINT ignored, so Python installs no handler: the Ctrl-C tests then
    fail and JupyterLab started by the browser tests ignores the SIGINT that stops it. The session
    puts SIGINT right and says so in its header."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        _SIGINT_AT_START.append(f"handler {signal.getsignal(signal.SIGINT)!r}")
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}):
        _SIGINT_AT_START.append("blocked")
    _SIGINT_AT_START.append(repr(sigint_state()))


def pytest_report_header(config):
    if len(_SIGINT_AT_START) > 1:
        return (f"SIGINT when pytest started: {', '.join(_SIGINT_AT_START[:-1])} (as in a background job "
                "of a non-interactive shell); Python's handler is installed for the session")
    return None


def _put_sigint_back(handler) -> None:
    signal.signal(signal.SIGINT, handler)        # sets the disposition below Python too
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.fixture(autouse=True)
def sigint_handler_kept(request):
    """Each test starts with SIGINT as the session has it, as a fresh process has it: the Ctrl-C
    tests and the JupyterLab teardowns depend on it. A test that leaves another Python handler is
    named in a warning and the handler is put back. A test after which SIGINT is ignored, blocked
    in the main thread or caught by a C handler other than Python's (below what
    ``signal.getsignal`` sees: native code) errors, naming what changed; SIGINT is put back."""
    before, below = signal.getsignal(signal.SIGINT), sigint_state()
    yield
    after, after_below = signal.getsignal(signal.SIGINT), sigint_state()
    if after is not before and after != before:
        _put_sigint_back(before)
        warnings.warn(f"{request.node.nodeid} left SIGINT's handler as {after!r} (put back)", stacklevel=1)
    elif after_below != below:
        _put_sigint_back(before)
        pytest.fail(f"{request.node.nodeid} left SIGINT changed below Python: {after_below} "
                    f"(before the test: {below}; put back)", pytrace=False)


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
