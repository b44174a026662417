"""The process groups one worker process has made, and the books that let a Cluster reuse them.

:class:`GroupCache` makes every subgroup of a run a gloo (or NCCL) group of its
own and keeps it for the life of the process; it counts each completed call
(:func:`books_agree` compares the ranks' counts after a program raised) and the
async calls of a run not waited on yet. :func:`hide_from_program` takes a
worker's own groups out of the c10d tables a program can read.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from simcomm.errors import UnwaitedHandleError
from simcomm.reports import unwaited_message

__all__ = ["GroupCache", "hide_from_program", "books_agree"]

class GroupCache:
    """The process groups one process has created, by their global ranks.

    ``torch.distributed`` names a group created with
    ``use_local_synchronization=True`` after its ranks, so creating the same
    set of ranks twice would collide in the rendezvous store. The cache makes
    every set of ranks a single process group for the life of the process
    (reused across :meth:`real.transport.DistTransport.subgroup` calls and across runs of a
    :class:`real.Cluster`). It also remembers which (op, reduction) pairs the
    backend turned down, so the fallback is chosen once.

    And it keeps the books a :class:`real.Cluster` needs to reuse its workers
    after a program raised: how many collectives this process completed on
    each group, how many tensors it sent to and received from each peer, and
    whether a call into the backend ever failed (``broken``). When every rank
    raised and the books of all ranks agree, no message is half delivered and
    the process groups can serve the next run.
    """

    def __init__(self, world_group: dist.ProcessGroup | None = None):
        self.world_group = world_group if world_group is not None else dist.group.WORLD
        self._groups: dict[tuple[tuple[int, ...], int], dist.ProcessGroup] = {}
        self._made: Counter[tuple[int, ...]] = Counter()
        self.unsupported: set[tuple[str, str]] = set()
        #: the async calls of this run not waited on yet: id -> (what, where)
        self.pending: dict[int, tuple[str, str]] = {}
        self.calls: Counter[tuple] = Counter()
        #: how many groups made by their members only each set of ranks has had (their meetings' steps)
        self.local_groups: Counter[tuple[int, ...]] = Counter()
        self.broken = False

    @contextlib.contextmanager
    def calling(self, key: tuple) -> Iterator[None]:
        """Count one completed backend call under ``key``; a call that raises marks the cache broken."""
        try:
            yield
        except BaseException:
            self.broken = True
            raise
        self.calls[key] += 1

    def books(self) -> tuple[bool, dict[tuple, int]]:
        """``(broken, calls)``: what :func:`books_agree` compares across ranks."""
        return self.broken, dict(self.calls)

    def begin_run(self) -> None:
        """A run starts: its subgroups take the cached groups from the first again."""
        self._made.clear()
        self.pending.clear()

    def check_all_waited(self, rank: int) -> None:
        """Raise :class:`~simcomm.errors.UnwaitedHandleError` if this run issued an async call
        (a handle, a c10d Work) that was never waited on, as the simulator does."""
        if self.pending:
            raise UnwaitedHandleError(unwaited_message(rank, list(self.pending.values())))

    def group(self, ranks: tuple[int, ...]) -> tuple[dist.ProcessGroup, str]:
        """A process group of exactly ``ranks`` (global, any order) of its own, and its name.

        The n-th group of a run with these ranks is the n-th cached one (created on first
        use), so every subgroup of a run is a group of its own, also one with the same
        ranks as another or as the world, and a Cluster's later runs reuse them: creating
        groups in every run leaks nothing. Only the members call this (they alone meet in
        the store), so a subgroup of a subgroup needs no cooperation from the rest of the world.
        """
        key = tuple(sorted(ranks))
        ordinal = self._made[key]
        self._made[key] += 1
        name = "simcomm:" + ".".join(map(str, key)) + f":{ordinal}"
        group = self._groups.get((key, ordinal))
        if group is None:
            group = self._groups[(key, ordinal)] = self._create(key, name)
        return group, name

    def _create(self, ranks: tuple[int, ...], name: str) -> dist.ProcessGroup:
        world = self.world_group
        backend = dist.get_backend(world)
        store = c10d._world.pg_map[world][1]
        saved = c10d._world.default_pg
        c10d._world.default_pg = world      # a run's own default group must not see this
        try:
            group, _ = c10d._new_process_group_helper(
                len(ranks), ranks.index(dist.get_rank(world)), list(ranks), backend, store, name,
                timeout=c10d._get_default_timeout(backend), device_id=world.bound_device_id)
        finally:
            c10d._world.default_pg = saved
        c10d._world.pg_group_ranks[group] = {rank: index for index, rank in enumerate(ranks)}
        hide_from_program(group)
        return group

    def close(self) -> None:
        """Shut down the groups this cache made and its world group: after a program destroyed
        the default group, whose ``destroy_process_group`` shuts down only the groups a program
        can see (:func:`hide_from_program`)."""
        for group in [*self._groups.values(), self.world_group]:
            with contextlib.suppress(Exception):
                group.shutdown()
        self._groups.clear()


def hide_from_program(group: dist.ProcessGroup) -> None:
    """Take a worker's own process group out of the c10d tables a program can read.

    A program under torchrun sees its own groups only, and it can tell: torch names a
    ``new_group(..., use_local_synchronization=True)`` after the number of groups in
    ``_world.pg_names`` (``group.group_name``), and the functional collectives pick a group
    for a list of ranks from ``_world.tags_to_pg``. The group stays in the tables that
    ``dist.*`` calls on it read (``pg_map``, ``pg_group_ranks``, ``pg_backend_config``).
    """
    world = c10d._world
    world.pg_names.pop(group, None)
    tag = world.pg_to_tag.pop(group, None)
    for key in {tag, ""} - {None}:
        tagged = world.tags_to_pg.get(key)
        if tagged is not None and group in tagged:
            tagged.remove(group)
            if not tagged:
                del world.tags_to_pg[key]


def books_agree(books: dict[int, tuple[bool, dict[tuple, int]]]) -> bool:
    """Whether the ranks' :meth:`GroupCache.books` show no half-finished communication.

    ``books`` maps every global rank to its books. True when no call failed,
    every member of each group completed as many collectives on it as the
    others, and every rank received from each peer as many tensors as that
    peer sent it.
    """
    if any(broken for broken, _ in books.values()):
        return False
    for rank, (_, calls) in books.items():
        for (group, kind, peer), count in calls.items():
            if kind == "collective":
                if any(books[member][1].get((group, kind, None), 0) != count for member in group):
                    return False
            elif kind == "send":
                if books[peer][1].get((group, "recv", rank), 0) != count:
                    return False
            elif kind == "recv":
                if books[peer][1].get((group, "send", rank), 0) != count:
                    return False
    return True
