"""Python's garbage collector around work that builds many long-lived objects.

A full collection (the oldest generation) walks every object the process has
tracked, and Python starts one each time the objects that survived the younger
generations grow by a quarter. Work that builds hundreds of thousands of
objects that all stay alive (the live frames and graphs of thousands of
shape-only ranks; a trace's events, their modelled timeline) meets one full
collection after another, each longer than the last, though none of them can
free anything the work built. :class:`FullCollectionsDeferred` holds them off
for the length of a ``with`` block; with ``young=`` it also makes the young
collections rarer: each one walks every young container still alive, so work
that keeps building and dropping containers (a shape-only rank's partition
lists, its ops' outputs) while thousands of others live pays them over and
over, though they find little to free.
"""
from __future__ import annotations

import gc

__all__ = ["DEFERRED_FULL_COLLECTIONS", "YOUNG_COLLECTIONS", "FullCollectionsDeferred"]

#: the oldest generation's threshold inside the block (Python's default is 10)
DEFERRED_FULL_COLLECTIONS = 10**6
#: the youngest generation's threshold inside a block with ``young=True`` (Python's default is
#: 700): a young collection still runs after this many more container allocations than
#: deallocations, so cycles among them are freed within a bounded number of objects
YOUNG_COLLECTIONS = 100_000


class FullCollectionsDeferred:
    """Defers Python's full garbage collections inside a ``with`` block by raising the oldest
    generation's threshold; the young generations collect as before and reference counting
    frees garbage at once, so only cycles that outlive the young collections wait, until the
    first full collection after the block. The previous thresholds are set again at the end
    of the block, unless something inside it changed them meanwhile. ``active=False``: a
    block that leaves the thresholds alone. ``young=True``: the youngest generation's threshold
    is raised too, to :data:`YOUNG_COLLECTIONS` (a threshold already above it stays). Blocks
    nest (an inner block finds the raised thresholds and keeps them)."""

    def __init__(self, active: bool = True, young: bool = False):
        self.active = active
        self.young = young
        self.saved: tuple[int, int, int] | None = None
        self.deferred: tuple[int, int, int] | None = None

    def __enter__(self) -> FullCollectionsDeferred:
        if self.active:
            first, second, third = gc.get_threshold()
            self.saved = (first, second, third)
            self.deferred = (max(first, YOUNG_COLLECTIONS) if self.young else first, second,
                             max(third, DEFERRED_FULL_COLLECTIONS))
            gc.set_threshold(*self.deferred)
        return self

    def __exit__(self, *exc_info) -> None:
        if self.saved is not None and gc.get_threshold() == self.deferred:
            gc.set_threshold(*self.saved)
        self.saved = None
