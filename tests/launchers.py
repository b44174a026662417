"""Running a script under a launcher (``torchrun`` or ``python -m simcomm.run``) in a subprocess.

torchrun is the reference side of many tests. Its gloo processes sometimes die by a signal in
their teardown after the script has finished (gloo's threads abort the process: ``terminate
called ...``, the agent then reports ``exitcode: -6`` and stops the other workers with SIGTERM).
Such a run says nothing about the script, so a reference run that ends that way is run again.
"""
from __future__ import annotations

import functools
import inspect
import os
import signal
import subprocess
import sys
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


FRESH_PROCESS = "SIMCOMM_TEST_IN_FRESH_PROCESS"


def default_sigint() -> None:
    """In the child, before exec: SIGINT's disposition and mask as a process a terminal starts has
    them (an ignored disposition and a blocked mask are inherited across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def in_fresh_process(test):
    """Run ``test`` in a fresh pytest process with SIGINT as a new process has it. For the Ctrl-C
    tests: native code an earlier test ran in the session's process (gloo, inductor's workers) may
    change SIGINT's disposition or mask below Python, which no fixture can see or put back."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        if os.environ.get(FRESH_PROCESS) == "1":
            return test(*args, **kwargs)
        node = f"{inspect.getsourcefile(test)}::{test.__name__}"
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node],
                              capture_output=True, text=True, timeout=300, cwd=ROOT,
                              env={**os.environ, FRESH_PROCESS: "1"}, preexec_fn=default_sigint)
        assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]
        return None
    return run
