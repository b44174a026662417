"""A thread that belongs to no rank, for tests of what such a thread may not do during a run."""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable


class ForeignThread:
    """Started by the test before a run (so no rank started it, and it is no rank's); runs the
    calls handed to it with :meth:`call`, one at a time."""

    def __init__(self, name: str):
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            function, outcome, done = job
            try:
                outcome["value"] = function()
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                outcome["error"] = error
            done.set()

    def call(self, function: Callable[[], Any], within: float = 5.0) -> dict:
        """``{"value": ...}`` or ``{"error": ...}``; fails if the call has not ended ``within`` seconds."""
        outcome: dict = {}
        done = threading.Event()
        self.jobs.put((function, outcome, done))
        assert done.wait(within), f"the call on thread {self.thread.name!r} hangs"
        return outcome

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(5)
