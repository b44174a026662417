"""Where stuck workers are: their Python stacks, read with :mod:`faulthandler`.

Each worker registers ``faulthandler`` on ``SIGUSR1`` with a file of its own.
When a run times out, the launcher signals the workers still running and reads
what they wrote, so the timeout error can say which line of the program each
rank is stuck on, the way :class:`simcomm.World` does for virtual ranks.
"""
from __future__ import annotations

import os
import signal
import time

__all__ = ["describe_stacks"]

#: frames from these folders are machinery, not the user's program
_MACHINERY = (os.sep + "torch" + os.sep, os.sep + "multiprocessing" + os.sep,
              os.sep + "real" + os.sep + "worker.py", os.sep + "real" + os.sep + "checked.py", '"<string>"')


def describe_stacks(workers, wait_s: float = 0.5, max_frames: int = 8) -> dict[int, list[str]]:
    """``{rank: frame lines, innermost first}`` for ``workers`` (objects with ``rank``,
    ``process`` and ``dump_path``); ranks whose stack could not be read are left out."""
    sizes = {}
    for worker in workers:
        try:
            sizes[worker.rank] = os.path.getsize(worker.dump_path)
            os.kill(worker.process.pid, signal.SIGUSR1)
        except (OSError, ProcessLookupError):
            continue
    stacks: dict[int, list[str]] = {}
    deadline = time.monotonic() + wait_s
    while len(stacks) < len(sizes) and time.monotonic() < deadline:
        time.sleep(0.02)
        for worker in workers:
            if worker.rank in stacks or worker.rank not in sizes:
                continue
            try:
                with open(worker.dump_path) as f:
                    f.seek(sizes[worker.rank])
                    text = f.read()
            except OSError:
                continue
            frames = [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]
            if frames:
                stacks[worker.rank] = _program_frames(frames, max_frames)
    return stacks


def _program_frames(frames: list[str], max_frames: int) -> list[str]:
    """The frames of the user's program (and simcomm's calls into torch, innermost first)."""
    kept = [frame for frame in frames if not any(part in frame for part in _MACHINERY)]
    return (kept or frames)[:max_frames]
