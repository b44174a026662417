"""Starting worker processes: the forkserver they are forked from, their rendezvous store, their
interface, the folders of dead parents, and saying what is starting.

* :func:`worker_context`: :mod:`multiprocessing`'s forkserver (one per Python process),
  preloading torch and :mod:`real.worker`, so a worker costs a fork instead of an import
  of torch; the forkserver never touches CUDA. :func:`prestart` starts it without waiting.
  :func:`forget_forkserver`: a forked child (or a worker) lets go of its parent's forkserver.
* :func:`hide_main`: children do not re-run this process's ``__main__``.
* :func:`loopback_store`: a store server on 127.0.0.1, port chosen by the OS.
* :func:`clean_stale_tmpdirs`: ``simcomm-real-<pid>-*`` folders whose owner is gone.
* :func:`notice`: what is starting, logged, and on stderr in an interactive session.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["worker_context", "prestart", "hide_main", "loopback_store", "clean_stale_tmpdirs", "process_alive", "notice",
           "interactive", "default_ifname", "TMP_PREFIX", "forget_forkserver"]

logger = logging.getLogger("real")

TMP_PREFIX = "simcomm-real-"
_TMP_NAME = re.compile(re.escape(TMP_PREFIX) + r"(\d+)-")


def interactive() -> bool:
    """A Python prompt or a live IPython/Jupyter shell (not a script, not pytest)."""
    if hasattr(sys, "ps1"):
        return True
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    return get_ipython is not None and get_ipython() is not None


def notice(text: str, visible: bool) -> None:
    """Say what is starting: logged always; written to stderr too when ``visible`` in an
    interactive session (never to stdout: that is the program's)."""
    logger.info(text)
    if visible and interactive():
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


@contextlib.contextmanager
def hide_main() -> Iterator[None]:
    """Start workers without re-running the parent's ``__main__`` in them.

    :mod:`multiprocessing` normally imports the parent's main script in every
    child it does not fork directly (so a script without an ``if __name__ ==
    "__main__"`` guard would start clusters recursively). Workers receive their
    program by value and need nothing from ``__main__``, so its file and spec
    are hidden while the children start.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def worker_context(start_method: str):
    """The forkserver context, preloading torch and the worker's code (spawn where there is none,
    or when asked for), and what makes this start slow ("" when nothing does)."""
    if start_method == "spawn" or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn"), " (each imports torch: seconds)"
    context = multiprocessing.get_context("forkserver")
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    running = getattr(server, "_forkserver_pid", None) is not None
    if not running:
        preload = list(getattr(server, "_preload_modules", None) or [])
        context.set_forkserver_preload([name for name in preload if name != "__main__"] + ["real.worker"])
    return context, "" if running else " (the first start in this Python process imports torch once: seconds)"


def forget_forkserver() -> None:
    """Let go of the forkserver this process inherited (after ``os.fork()``, or in a worker).

    :mod:`multiprocessing` hands every process forked from its forkserver, and every
    ``os.fork()`` child of the process that started it, the write end of the forkserver's
    "alive" pipe, and the forkserver lives until every copy is closed: a child holding one
    would keep the parent's forkserver (and so, through ``PR_SET_PDEATHSIG``, the parent's
    workers) alive after the parent died, and could not start a forkserver of its own
    (``ChildProcessError``: the parent's forkserver is not its child). This closes this
    process's copy and clears the forkserver's address, so a later forkserver start here makes
    a new one. :mod:`multiprocessing` has no public call for this; it touches the attributes of
    ``multiprocessing.forkserver._forkserver`` that its own ``ensure_running`` resets.
    """
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if server is None:
        return
    alive_fd = getattr(server, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        try:
            os.close(alive_fd)
        except OSError:
            pass
    server._forkserver_alive_fd = None
    server._forkserver_address = None
    server._forkserver_pid = None


def prestart() -> None:
    """Start the workers' forkserver now, without waiting for it (it imports torch in the
    background), so the first :class:`real.Cluster` of this process starts in about the time of a
    later one. ``import real`` calls this in an interactive session (IPython, Jupyter, a prompt)."""
    context, slow = worker_context("forkserver")
    if slow and context.get_start_method() == "forkserver":
        with hide_main():
            multiprocessing.forkserver.ensure_running()


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one owned by another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_tmpdirs(directory: str | None = None) -> list[str]:
    """Remove the ``simcomm-real-<pid>-*`` folders of this user whose owner process is gone
    (a parent killed with ``kill -9`` cannot remove its own). Returns the paths removed."""
    directory = directory or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        match = _TMP_NAME.match(name)
        path = os.path.join(directory, name)
        if match is None or process_alive(int(match.group(1))):
            continue
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def loopback_store() -> dist.TCPStore:
    """A store server hosted by this process, listening on 127.0.0.1 only.

    The listening socket is bound here (port 0: the OS picks a free port, so no
    race with other jobs) and handed to the store, which owns and closes it.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False,
                         master_listen_fd=sock.detach())


def default_ifname() -> str | None:
    return "lo" if os.path.exists("/sys/class/net/lo") else None
