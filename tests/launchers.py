"""Running a script under a launcher (``torchrun`` or ``python -m simcomm.run``) in a subprocess.

torchrun is the reference side of many tests. Its gloo processes sometimes die by a signal in
their teardown after the script has finished (gloo's threads abort the process: ``terminate
called ...``, the agent then reports ``exitcode: -6`` and stops the other workers with SIGTERM).
Such a run says nothing about the script, so a reference run that ends that way is run again.
"""
from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).parents[1]
TORCHRUN = Path(sys.executable).parent / "torchrun"
REFERENCE_ATTEMPTS = 3


def killed_in_teardown(done: subprocess.CompletedProcess) -> bool:
    """Whether torchrun reports a worker that died by a signal (its exit code negative)."""
    return done.returncode != 0 and "(exitcode: -" in done.stderr + done.stdout


def launch(command: list[str], cwd: Path, *, reference: bool = False, env: dict | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``command`` in ``cwd`` with the project importable and one OpenMP thread per process.
    ``reference``: the torchrun side, run again (up to ``REFERENCE_ATTEMPTS`` times in all) while a
    gloo process dies by a signal."""
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    for _attempt in range(REFERENCE_ATTEMPTS if reference else 1):
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=environment)
        if not killed_in_teardown(done):
            break
    return done


def launch_ok(command: list[str], cwd: Path, **options) -> str:
    """``launch``, asserting the run ended with 0; its stdout and stderr together."""
    done = launch(command, cwd, **options)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


_REPORT = re.compile(r"rank(\d+): (.*?)(?=rank\d+: |$)")


def rank_reports(text: str) -> dict[int, str]:
    """Each rank's ``rankN: ...`` report line in a launcher's output, tagged (``[rank r]`` by
    simcomm.run) or not (torchrun). Two torchrun workers' lines can run together in the pipe
    ("...=Falserank1: ..."): each report ends where the next begins."""
    reports = {}
    for raw in text.splitlines():
        for match in _REPORT.finditer(raw):
            reports[int(match.group(1))] = match.group(2).rstrip()
    return reports


def torchrun_lines(script: Path, nproc: int, parse, *, cwd: Path = ROOT, env: dict | None = None) -> dict:
    """Each rank's report, ``parse(output)``, of ``script`` under ``torchrun --standalone`` on ``nproc``
    gloo processes. On a loaded machine a torchrun run now and then exits 0 without one worker's line
    reaching the pipe; such a run says nothing about the script, so it is run again."""
    for _attempt in range(REFERENCE_ATTEMPTS):
        lines = parse(launch_ok([str(TORCHRUN), "--standalone", "--nproc-per-node", str(nproc), str(script)],
                                cwd, reference=True, env=env))
        if len(lines) == nproc:
            break
    return lines


def default_sigint() -> None:
    """In the child, before exec: SIGINT's disposition and mask as a process a terminal starts has
    them (an ignored disposition and a blocked mask are inherited across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class _Sigaction(ctypes.Structure):
    """glibc's ``struct sigaction`` (its handler first), with room to spare for the rest."""
    _fields_ = [("sa_handler", ctypes.c_void_p), ("sa_mask", ctypes.c_ulong * 16),
                ("sa_flags", ctypes.c_int), ("sa_restorer", ctypes.c_void_p), ("spare", ctypes.c_char * 64)]


def _status_bit(path: str, field: str, signum: int) -> bool | None:
    try:
        with open(path) as status:
            for line in status:
                if line.startswith(field + ":"):
                    return bool(int(line.split(":")[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return None


def sigint_state() -> dict:
    """SIGINT in this process below Python, where ``signal.getsignal`` does not look: whether the
    kernel ignores it (``/proc/self/status`` SigIgn), whether the main thread blocks it (the main
    thread's SigBlk) and the handler C sees (``sigaction``: "SIG_DFL", "SIG_IGN" or an address).
    Python's ``signal.signal`` sets all three; a background job of a non-interactive shell starts
    with SIGINT ignored, and native code can change them behind Python's back."""
    handler: str | None = None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        old = _Sigaction()
        if libc.sigaction(signal.SIGINT, None, ctypes.byref(old)) == 0:
            handler = {0: "SIG_DFL", 1: "SIG_IGN"}.get(old.sa_handler or 0, hex(old.sa_handler or 0))
    except (OSError, AttributeError):
        pass
    main = threading.main_thread().native_id
    return {"ignored": _status_bit("/proc/self/status", "SigIgn", signal.SIGINT),
            "blocked_in_main_thread": _status_bit(f"/proc/self/task/{main}/status", "SigBlk", signal.SIGINT),
            "c_handler": handler}
