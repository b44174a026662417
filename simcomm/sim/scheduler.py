"""The scheduler of virtual ranks: whose turn it is, who is blocked, and the run's first error.

Every rank of a :class:`simcomm.World` is a thread running the program, and
the ranks take turns (:class:`RunState`): exactly one runs until it blocks in
a communication call, pauses (``time.sleep``, a wait for a key of a script's own
store: :meth:`RunState.pause`) or finishes, then hands the turn to the next ready rank.
Because it sees every rank at once, the scheduler tells at once what real
NCCL shows as a hang:

* a rank about to block when every other unfinished rank is blocked too (or
  a rank finishing while all the others are blocked) raises
  :class:`~simcomm.errors.DeadlockError`, listing who waits for whom;
* every unfinished rank blocked or pausing, with nothing that could end the
  wait (:meth:`RunState._idle_verdict_locked`), raises it too, naming each
  rank's line;
* a communicator used after its run ended raises
  :class:`~simcomm.errors.CommunicatorClosedError`, and one used from a thread
  other than its rank's raises :class:`~simcomm.errors.WrongThreadError`
  (:meth:`RunState.lock_for`, the entry of every communication call).

That error, a :class:`~simcomm.errors.CollectiveMismatchError` found by the
transport, or a rank's own exception *aborts* the run: every blocked rank is
woken and unwinds with :class:`~simcomm.errors.Aborted`, and ``World.run`` raises the error.

**The lock.** ``RunState.lock`` guards the scheduler's tables (who is blocked,
who is ready, the slots and channels). Method names say what they do with it,
here and in :mod:`simcomm.sim.transport`:

* ``*_locked``: called with the lock held, return with it held;
* ``lock_for`` and ``*_and_hold``: take the lock and return holding it;
* ``release_and_wait`` and ``*_and_release``: called with it held, release it;
* every other method takes it itself.

It is a ``threading.RLock`` for one reason: it knows its owner. A timeout or
Ctrl-C stops the rank holding the turn by raising :class:`~simcomm.errors.Aborted` inside its
thread (``World``'s ``_interrupt``), and that exception can land anywhere,
also between taking the lock and the code that releases it. The rank thread
then still owns the lock; when it ends it gives it back
(:meth:`RunState.release_if_held`), and meanwhile its own unwinding
(``rank_failed``, ``rank_finished``) re-enters it instead of waiting forever.
No rank takes it twice on purpose.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch

from ..checks import PartitionTable
from ..errors import Aborted, CommunicatorClosedError, DeadlockError, WrongThreadError
from ..reports import format_ranks, program_location
from .process_state import RankProcessState, own_thread, thread_owner, waited_for_at_exit
from .rendezvous import Group
from .waiting import install_waits
from .waits import Wait, describe_deadlock, describe_ranks, describe_waits

__all__ = ["OneCpu", "RunState", "Pause", "idle_limit", "widen_futex_hash", "new_waiter", "handoff", "HANDOFF"]


_get_ident = threading.get_ident


def _locked() -> threading.Lock:
    """A waiter made of a Python lock: taken at once, so ``acquire()`` blocks until a ``release()``."""
    waiter = threading.Lock()
    waiter.acquire()
    return waiter


def _handoff_with_locks(wake, wait) -> None:
    wake.release()
    wait.acquire()


try:   # the compiled hand-off (simcomm/sim/_handoff.c, built at install where a C compiler is)
    from ._handoff import Waiter as _Waiter, handoff as _handoff

    _Waiter()   # unnamed POSIX semaphores work here (sem_init raises OSError where they do not)
except (ImportError, OSError):
    _Waiter, _handoff = None, None
if os.environ.get("SIMCOMM_HANDOFF") == "lock":   # to compare the two, or to rule the compiled one out
    _Waiter, _handoff = None, None

#: ``new_waiter()``: a rank's waiter, on which ``acquire()`` blocks until another thread calls
#: ``release()`` (one release per acquire); ``handoff(wake, wait)``: release ``wake``, then wait on
#: ``wait``. Compiled: a POSIX semaphore, and a hand-off that drops the interpreter lock before it
#: wakes the next rank, which so wakes once, to a free interpreter lock. With Python locks the next
#: rank wakes while the caller still holds the interpreter lock, sleeps on it, and wakes again when
#: the caller blocks (about twice the CPU time per hand-off: docs/benchmarks.md).
new_waiter = _Waiter if _Waiter is not None else _locked
handoff = _handoff if _handoff is not None else _handoff_with_locks
#: which hand-off this process uses: ``"semaphore"`` (compiled) or ``"lock"``
HANDOFF = "semaphore" if _Waiter is not None else "lock"

#: Linux's prctl for the process's own futex hash (kernel 6.16 on): its option and sub-options
_PR_FUTEX_HASH, _PR_FUTEX_HASH_SET_SLOTS, _PR_FUTEX_HASH_GET_SLOTS = 78, 1, 2
_MAX_FUTEX_SLOTS = 1 << 16


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's ``prctl`` on Linux, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def widen_futex_hash(waiters: int) -> int:
    """Give the process's futex hash at least ``2 * waiters`` slots (a power of two, at most
    65,536); the slots it has after (0: the kernel's global hash, or not Linux).

    Every waiting rank thread sleeps on a futex of its own, and waking one walks the hash
    bucket its futex falls in. Linux 6.16 on gives a process a private hash sized by its
    *CPUs*, not its threads (16 slots on 2 CPUs), so with thousands of ranks each hand-off
    walked hundreds of sleeping threads in the kernel: 16,384 shape-only ranks spent 40 % of
    their CPU time in ``futex_wake``. A larger hash costs 64 bytes a slot; it is never shrunk.
    Older kernels (one global hash of 256 slots per CPU) refuse the call, harmlessly.
    """
    prctl = _prctl()
    if prctl is None:
        return 0
    have = prctl(_PR_FUTEX_HASH, _PR_FUTEX_HASH_GET_SLOTS, 0, 0, 0)
    want = min(_MAX_FUTEX_SLOTS, 1 << max(4, (2 * waiters - 1).bit_length()))
    if 0 <= have < want:
        prctl(_PR_FUTEX_HASH, _PR_FUTEX_HASH_SET_SLOTS, want, 0, 0)
        have = prctl(_PR_FUTEX_HASH, _PR_FUTEX_HASH_GET_SLOTS, 0, 0, 0)
    return max(have, 0)


class OneCpu:
    """A block during which the calling thread, and every thread it starts, runs on one CPU
    only (the highest it may run on); the caller's own CPUs are set again after the block.
    Threads started inside keep that CPU for their lives.

    ``World.run`` starts the rank threads of a shape-only run inside it. One rank runs at a
    time, so a second CPU gains a run nothing, and it costs: each hand-off that wakes a rank on
    another CPU goes through that CPU (an inter-processor interrupt, in a virtual machine a
    trip through the hypervisor), and the woken rank finds the interpreter's data in the other
    CPU's cache. A 4096-rank data-parallel step took 30 % less CPU time with its ranks on one
    CPU (user and system time alike; ``docs/benchmarks.md``).

    A no-op where the platform has no ``os.sched_setaffinity`` or the caller may run on one
    CPU only. Visible to a program: ``os.sched_getaffinity(0)`` on a rank thread names that
    one CPU, and threads and processes the rank starts inherit it.
    """

    __slots__ = ("saved",)

    def __init__(self) -> None:
        self.saved: set[int] | None = None

    def __enter__(self) -> None:
        setaffinity = getattr(os, "sched_setaffinity", None)
        if setaffinity is None:
            return
        try:
            allowed = os.sched_getaffinity(0)
        except OSError:
            return
        if len(allowed) > 1:
            try:
                setaffinity(0, {max(allowed)})
            except OSError:
                return
            self.saved = allowed

    def __exit__(self, *exc_info) -> None:
        if self.saved is not None:
            saved, self.saved = self.saved, None
            try:
                os.sched_setaffinity(0, saved)
            except OSError:    # a CPU of the saved set went offline meanwhile: keep running
                pass


#: how long a rank whose program returned waits for the non-daemon threads it started
#: (:meth:`RunState.join_rank_threads`)
RANK_THREAD_GRACE_S = 10.0


def _is_executor_worker(thread: threading.Thread) -> bool:
    target = getattr(thread, "_target", None)
    return getattr(target, "__module__", None) == "concurrent.futures.thread"


_real_sleep = time.sleep

#: the longest piece of a real sleep of a pausing rank that holds the turn (an abort, or a rank
#: made ready by another thread, is seen within it)
PAUSE_SLICE_S = 0.02
#: the default of ``SIMCOMM_IDLE_S``: how long every rank may only poll with ``time.sleep``
#: (and wait) before the run is taken to wait forever (:meth:`RunState._idle_verdict_locked`)
IDLE_LIMIT_S = 10.0


def idle_limit() -> float:
    """``SIMCOMM_IDLE_S`` (seconds; ``inf`` never), else :data:`IDLE_LIMIT_S`."""
    text = os.environ.get("SIMCOMM_IDLE_S", "").strip()
    if not text:
        return IDLE_LIMIT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"SIMCOMM_IDLE_S={text!r} must be a positive number of seconds (or inf)")
    return value


@dataclass(slots=True)
class Pause:
    """A rank that waits without a collective (:meth:`RunState.pause`)."""

    deadline: float       # time.monotonic() when the pause ends
    what: str             # "time.sleep(0.1)", "TCPStore.get for key 'x'"
    frame: object
    store: bool           # a poll of a store wait; else a time.sleep
    number: int           # RunState.pause_count when it began


class _Quiet:
    """A stretch in which no rank made progress (:meth:`RunState._idle_verdict_locked`)."""

    __slots__ = ("since", "blocked", "running", "begun", "busy")

    def __init__(self, now: float, state: RunState):
        self.since = now
        self.blocked = dict(state.blocked)     # holds the Wait objects: identity is the test
        self.running = state.running
        self.begun = state.pause_count           # the pauses begun before the stretch
        self.busy = state.busy

    def holds(self, state: RunState) -> bool:
        blocked = state.blocked
        return (state.running == self.running and len(blocked) == len(self.blocked)
                and all(blocked.get(rank) is wait for rank, wait in self.blocked.items()))


class RunState:
    """Everything the ranks of one run share: the lock, whose turn it is, the first error.

    Ranks take turns: exactly one rank thread runs at a time, and it hands the
    turn on only when it blocks in a communication call, pauses (``time.sleep``,
    a poll of a script's own store: :meth:`pause`) or finishes. A rank
    woken by a completed collective joins the ``ready`` queue instead of
    running at once, so every handoff wakes exactly one thread and no two rank
    threads compete for the interpreter lock. Runs are therefore
    deterministic, and a deadlock is simply "nobody ready, everybody blocked".

    At each handoff the rank handing the turn on saves its process state
    (torch's, Python's and NumPy's random state, ``sys.argv``, ``__main__``) and
    the rank taking it loads its own
    (:class:`~simcomm.sim.process_state.RankProcessState`), so each rank draws
    from random streams of its own, as each process of a real run does.

    Lock discipline (see the module docstring): the scheduler's decisions are
    taken under ``lock``; waking another rank's thread and blocking on one's
    own waiter happen after it is released.
    """

    def __init__(self, world_size: int, device: torch.device, trace: bool):
        self.lock = threading.RLock()   # knows its owner: see the module docstring
        self.world_size = world_size
        self.device = device
        self.waiters = [new_waiter() for _ in range(world_size)]   # acquire() blocks until released
        self.threads: list[threading.Thread | None] = [None] * world_size
        self.thread_ids: list[int | None] = [None] * world_size
        self.started: set[int] = set()
        self.blocked: dict[int, Wait] = {}
        self.ready: deque[int] = deque()
        self.running = world_size
        self.finished: set[int] = set()
        #: ranks past the start of rank_finished, under ``exit_lock``: an interrupt raised into a
        #: rank thread from outside (World's timeout) is decided under that lock, which only a
        #: finishing rank takes, for a moment, so it never waits behind ranks contending for ``lock``
        self.exiting: set[int] = set()
        self.exit_lock = threading.Lock()
        self.error: BaseException | None = None
        self.rank_errors: list[tuple[int, BaseException]] = []
        self.closed = False
        self.woken_by_abort: set[int] = set()
        self.done = threading.Event()
        self.random = RankProcessState(world_size, device)
        self.events: list[tuple] | None = [] if trace else None
        self.clock_zero = time.perf_counter()
        self.world = Group(("world",), range(world_size))
        #: the partitions the run's subgroup calls accepted, one normalized copy for all ranks
        self.partitions = PartitionTable()
        #: fake tensors on every rank (simcomm.sim.shape): collective math on meta tensors
        self.shape_only = False
        self.scalar_reads = "error"     # shape-only ranks' reads of values they lack (shape_reads)
        #: after a rank fails, the others run on until none can make progress (each waits for
        #: the failed rank, or for a rank that does), as processes do until torchrun's agent
        #: stops them; False: the failure stops every rank at once (World.run's default)
        self.peers_run_on = False
        #: where each rank still running was when the run was aborted: ``file:line in function``
        self.stopped_at: dict[int, str] = {}
        #: the programs create their default group with init_process_group (torchrun scripts)
        self.explicit_init = False
        #: init_process_group(timeout=) of each rank that gave one, in seconds; while any is
        #: set, each rank's blocking waits are timed (``blocked_since``) and World ends the run
        #: when one lasts longer (:meth:`expired_wait_locked`)
        self.group_timeouts: dict[int, float] = {}
        self.blocked_since: dict[int, float] = {}
        #: the threads each rank started (and their threads): a rank ends once its non-daemon ones
        #: have, as a process exits once its non-daemon threads have
        self.rank_threads: list[list[threading.Thread]] = [[] for _ in range(world_size)]
        #: ranks that wait without a collective (``time.sleep``, a poll of a script's own store):
        #: :meth:`pause`. Touched only by pausing ranks, so a program that never sleeps pays nothing
        self.sleeping: dict[int, Pause] = {}
        #: pauses begun in the run (each Pause has its number), and the number at the last return
        #: of a time.sleep to its program (which may have changed anything since)
        self.pause_count = 0
        self.returned_at = 0
        #: seconds ranks spent in their programs between a time.sleep's return and their next pause
        #: (counted against the idle rule), and the rank whose time.sleep returned last, and when
        self.busy = 0.0
        self.resumed: tuple[int, float] | None = None
        self.quiet: _Quiet | None = None
        #: ranks a thread of which would communicate while the rank's own thread pauses, and those
        #: whose own thread then keeps the turn in a plain sleep (:meth:`_step_in_for`)
        self.step_aside: set[int] = set()
        self.stepped_aside: set[int] = set()
        self.idle_limit = idle_limit()
        #: the TCPStore servers the ranks created: port -> [clients joined + 1, world_size]
        self.tcp_servers: dict[int, list] = {}
        install_waits()

    # -- the run's life: called by World and by each rank thread (each takes the lock) --

    def start(self) -> None:
        """Give rank 0 the first turn; the others are ready in rank order."""
        with self.lock:
            self.ready.extend(range(1, self.world_size))
        self.waiters[0].release()

    def wait_turn(self, rank: int) -> None:
        """Called by rank ``rank``'s thread before its program: wait for the first turn."""
        self.threads[rank] = threading.current_thread()
        self.thread_ids[rank] = threading.get_ident()
        own_thread(self, rank)          # and the threads it starts (simcomm.sim.process_state)
        self.waiters[rank].acquire()
        if self.error is not None:
            raise Aborted
        self.started.add(rank)
        self.random.take_turn(rank)

    def rank_failed(self, rank: int, error: BaseException) -> None:
        """``rank``'s program raised ``error``: record it and abort the run (with
        ``peers_run_on``, the other ranks run on: the run ends when none can make progress)."""
        with self.lock:
            if self.error is None or self.rank_errors:
                self.rank_errors.append((rank, error))
            if not (self.peers_run_on and self.error is None):
                self.abort_locked(self.error or error)

    def adopt_thread(self, rank: int, thread: threading.Thread) -> None:
        """``thread``, being started by a thread of ``rank``, belongs to ``rank``."""
        self.rank_threads[rank].append(thread)

    def join_rank_threads(self, rank: int) -> None:
        """Called by ``rank``'s thread when its program has returned: wait for the non-daemon
        threads the rank started, as a process's exit does; they may communicate as the rank
        meanwhile. In short waits, so that an interrupt (a timeout) reaches this thread.

        Not waited for: the threads of a rank whose program failed (its failure is reported at
        once: the other ranks must learn of it), the worker threads of ``concurrent.futures``
        executors (a process's exit tells them to stop before it joins its threads; here the
        exit is the rank's, not the process's), and a thread still running
        :data:`RANK_THREAD_GRACE_S` seconds after its rank's program returned (a thread that
        waits for the main thread's end, say): the rank ends with a notice naming it and its
        line, instead of holding every rank up."""
        threads = self.rank_threads[rank]
        if any(failed == rank for failed, _ in self.rank_errors):
            threads.clear()
            return
        deadline = time.monotonic() + RANK_THREAD_GRACE_S
        while threads and self.error is None:
            thread = threads[-1]
            if (thread is threading.current_thread() or not thread.is_alive() or not waited_for_at_exit(thread)
                    or _is_executor_worker(thread)):
                threads.pop()
                continue
            if time.monotonic() > deadline:
                frame = sys._current_frames().get(thread.ident)
                where = f" at {frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else ""
                print(f"simcomm: rank {rank}'s program has returned, but a thread it started, {thread.name!r}, "
                      f"is still running{where} after {RANK_THREAD_GRACE_S:g} s; the rank ends without "
                      "waiting for it (a process would wait for it at exit)", file=sys.stderr, flush=True)
                threads.clear()
                return
            thread.join(0.05)

    def rank_finished(self, rank: int) -> None:
        """``rank``'s program returned (or unwound): hand the turn on, or end the run."""
        self.join_rank_threads(rank)
        with self.exit_lock:
            self.exiting.add(rank)
        with self.lock:
            self.running -= 1
            self.finished.add(rank)
            if self.running == 0:
                self.done.set()
                return
            if self.error is not None:
                return
            self.random.hand_off(rank)   # the next rank then knows what the live state is
            next_rank = self.ready.popleft() if self.ready else None
            if next_rank is None and len(self.blocked) == self.running:
                self.abort_locked(DeadlockError(self.describe_deadlock_locked()))
        if next_rank is not None:
            self.waiters[next_rank].release()

    def abort(self, error: BaseException) -> None:
        """Abort the run from outside it (a timeout, Ctrl-C)."""
        with self.lock:
            self.abort_locked(error)

    def close(self) -> None:
        """The run has ended: any later use of its communicators raises at once.

        Takes no lock (readers read the flag without it), so the caller never waits
        here on a rank thread that is still unwinding."""
        self.closed = True

    def release_if_held(self) -> None:
        """Called by a rank thread as it ends: give the lock back if this thread still
        holds it (an :class:`~simcomm.errors.Aborted` raised into it landed while it held the lock)."""
        while True:
            try:
                self.lock.release()
            except RuntimeError:   # not held by this thread: the usual case
                return

    # -- the entry of every communication call --

    def lock_for(self, rank: int, op: str) -> None:
        """Take the lock for a communication call ``op`` of rank ``rank``; return holding it.

        Raises instead, without the lock: :class:`~simcomm.errors.Aborted` on an aborted run's own
        rank thread; :class:`~simcomm.errors.CommunicatorClosedError` when the run
        has ended; :class:`~simcomm.errors.WrongThreadError` (and the run fails with
        it) when the caller is not rank ``rank``'s thread.
        """
        if _get_ident() != self.thread_ids[rank]:
            if thread_owner() != (self, rank) or self.closed:
                raise self._refusal(rank, op)
            if rank in self.sleeping:     # a thread the rank started, while the rank's own pauses
                self._step_in_for(rank)
        elif self.closed:
            raise self._refusal(rank, op)
        self.lock.acquire()
        if self.error is not None:
            self.lock.release()
            raise Aborted
        if rank in self.blocked:     # another thread of this rank waits in a communication call
            self.lock.release()
            error = WrongThreadError(
                f"{op} on rank {rank} from thread {threading.current_thread().name!r} while another "
                f"thread of rank {rank} waits in a communication call: on virtual ranks a rank's "
                f"threads communicate one at a time (join or wait for the other thread first)")
            self.rank_failed(rank, error)
            raise error

    def _refusal(self, rank: int, op: str) -> BaseException:
        """The error for a call of rank ``rank``'s communicator from a thread not its own."""
        caller = threading.current_thread()
        if self.error is not None and caller in self.threads:
            return Aborted()   # a rank thread of an aborted run, still unwinding
        if self.closed:
            return CommunicatorClosedError(
                f"{op} on rank {rank}: the run this communicator belongs to has ended, so no "
                f"rank is there to meet this call. A communicator works only inside its run; "
                f"if this is the backward of a tensor a program returned, call backward inside "
                f"the program or return the tensor's .detach()")
        error = WrongThreadError(
            f"{op} on rank {rank}: the communicator of rank {rank} was used from thread "
            f"{caller.name!r}; each rank's communicator must be used on its rank's thread "
            f"({self.threads[rank].name if self.threads[rank] else 'not started'!r})")
        if caller not in self.threads:
            self.rank_failed(rank, error)   # a helper thread's error would otherwise go unseen
        return error

    # -- blocking and waking: called by the transport with the lock held --

    def release_and_wait(self, rank: int, wait: Wait) -> None:
        """Block ``rank`` until woken. Called with the lock held; releases it.

        Under the lock: record the wait, pick the next ready rank, or see that
        nobody can run (a deadlock: abort). Then, released: wake the next rank,
        sleep on this rank's waiter, and on waking load this rank's random state.
        Raises :class:`~simcomm.errors.Aborted` if the run was aborted.
        """
        self.blocked[rank] = wait
        if self.group_timeouts:
            self.blocked_since[rank] = time.monotonic()
        random = self.random
        random.hand_off(rank)
        next_rank = self.ready.popleft() if self.ready else None
        deadlock = next_rank is None and len(self.blocked) == self.running
        if deadlock:
            self.abort_locked(DeadlockError(self.describe_deadlock_locked()))
        self.lock.release()
        if deadlock:
            raise Aborted
        if next_rank is not None:   # one wake-up: the next rank finds the interpreter lock free
            handoff(self.waiters[next_rank], self.waiters[rank])
        else:
            self.waiters[rank].acquire()
        if self.error is not None:
            raise Aborted
        random.take_turn(rank)

    # -- waiting without a collective: time.sleep, polls of a script's own store --

    def pause(self, rank: int, seconds: float, what: str, frame: object, store: bool = False) -> None:
        """Rank ``rank``'s thread, holding the turn, waits ``seconds`` without keeping the turn, as
        a sleeping process leaves the CPU to the others (``time.sleep`` on a rank thread, and each
        poll of a store wait: :mod:`simcomm.sim.waiting`).

        The rank joins the ready queue and hands the turn on; each time it gets the turn back it
        returns once ``seconds`` have passed, or passes the turn on again while other ranks are
        ready. ``pause(0)`` lets the ranks that are ready run once. When no rank but pausing ones
        can run, the one whose time ends first runs (a rank whose pause is over returns to its
        program); if that is the caller and its time has not ended, it sleeps for real (holding the turn,
        in short pieces, so that an abort or a rank woken by another thread is seen), and the
        scheduler looks whether the wait can end (:meth:`_idle_verdict_locked`): if it cannot,
        the run is aborted with a :class:`~simcomm.errors.DeadlockError` naming each rank's line.
        ``store``: a poll of a store wait (its keys are checked by the caller between pauses).
        Raises :class:`~simcomm.errors.Aborted` if the run is aborted meanwhile.
        """
        lock = self.lock
        deadline = time.monotonic() + seconds
        lock.acquire()
        held = True
        try:
            if self.error is not None:
                raise Aborted
            self.pause_count += 1
            self.sleeping[rank] = Pause(deadline, what, frame, store, self.pause_count)
            if self.resumed is not None:
                if self.resumed[0] == rank:
                    self.busy += deadline - seconds - self.resumed[1]
                self.resumed = None
            handed = False
            while True:
                now = time.monotonic()
                if rank in self.step_aside:
                    # a thread this rank started communicates as the rank: this thread keeps the
                    # turn and sleeps, as time.sleep did before pauses (the thread's wait then
                    # hands the turn on); a pause would share the rank's waiter with it
                    self.stepped_aside.add(rank)
                    lock.release()
                    held = False
                    while self.error is None and time.monotonic() < deadline:
                        _real_sleep(min(deadline - time.monotonic(), PAUSE_SLICE_S))
                    if self.error is not None:
                        raise Aborted
                    return
                if handed and now >= deadline:
                    if not store:
                        self.returned_at = self.pause_count
                        self.resumed = (rank, now)
                    return
                queued = set(self.ready)
                pausing = [r for r in self.sleeping if r in queued]   # the others wait in the queue
                if len(self.ready) > len(pausing):
                    # a rank that does not pause is ready: it runs first
                    self.ready.append(rank)
                    next_rank = self.ready.popleft()
                else:
                    # every unfinished rank is blocked or pauses: the one whose time ends first runs.
                    # A pausing rank neither here nor queued runs beside this one (its thread
                    # stepped aside for a thread of its own, :meth:`_step_in_for`): no verdict then
                    everyone = len(pausing) == len(self.sleeping) - 1
                    verdict = self._idle_verdict_locked(now) if everyone else None
                    if verdict is not None:
                        self.abort_locked(DeadlockError(verdict))
                        raise Aborted
                    next_rank = min([*pausing, rank], key=lambda r: self.sleeping[r].deadline)
                    if next_rank == rank:
                        if now >= deadline:
                            handed = True      # nobody else may run first: the pause is over
                            continue
                        lock.release()
                        held = False
                        _real_sleep(min(deadline - now, PAUSE_SLICE_S))
                        lock.acquire()
                        held = True
                        if self.error is not None:
                            raise Aborted
                        continue
                    self.ready.remove(next_rank)
                    self.ready.append(rank)
                self.random.hand_off(rank)
                lock.release()
                held = False
                handoff(self.waiters[next_rank], self.waiters[rank])
                if self.error is not None:
                    raise Aborted
                self.random.take_turn(rank)
                lock.acquire()
                held = True
                if self.error is not None:
                    raise Aborted
                handed = True
        finally:
            if not held:
                lock.acquire()
            self.sleeping.pop(rank, None)
            self.stepped_aside.discard(rank)
            lock.release()

    def _step_in_for(self, rank: int) -> None:
        """A thread rank ``rank`` started is about to communicate as the rank while the rank's own
        thread pauses: wait until that thread holds the turn and keeps it in a plain sleep
        (:meth:`pause`), or its pause has ended."""
        with self.lock:
            self.step_aside.add(rank)
        try:
            while self.error is None:
                with self.lock:
                    if rank not in self.sleeping or rank in self.stepped_aside:
                        return
                _real_sleep(0.001)
        finally:
            with self.lock:
                self.step_aside.discard(rank)

    def store_wait_ended(self) -> None:
        """A rank's store wait found its keys: the program made progress (the idle rule starts over)."""
        self.quiet = None

    def _idle_verdict_locked(self, now: float) -> str | None:
        """Called when every unfinished rank is blocked or pausing (the caller, holding the turn,
        pauses too): the DeadlockError message if the wait cannot end, else None.

        A *quiet stretch* begins at the first such moment and lasts while the same ranks are
        blocked in the same calls, none has finished, and no store wait has ended (a
        ``time.sleep`` returning to a poll loop that sleeps again does not end it). The wait is

        * certain never to end when every pausing rank waits for a store key (or a TCPStore's
          server or clients), each has looked again since the stretch began and since any
          ``time.sleep`` last returned to its program, and no rank has a thread of its own
          alive: only the ranks, which all wait, could set a key (the run's ranks are taken to
          be the store's only users), so the run ends at once;
        * taken as endless when every rank that pauses in ``time.sleep`` has woken and slept again
          within the stretch (it polls) and the stretch has lasted :attr:`idle_limit` seconds
          (``SIMCOMM_IDLE_S``), not counting the time ranks spent in their programs between
          polls: a poller may wait for something outside the run (a file another program
          writes, the clock), so this is a bound, not a certainty. One long ``time.sleep`` is
          never cut short, nor is a rank that works between short sleeps.
        """
        quiet = self.quiet
        if quiet is None or not quiet.holds(self):
            self.quiet = _Quiet(now, self)
            return None
        sleepers = self.sleeping
        if not all(pause.number > quiet.begun for pause in sleepers.values()):
            return None
        polls = [r for r in sleepers if not sleepers[r].store]
        if self.rank_errors:
            # a rank has failed (peers_run_on): the others wait for nothing but that rank, or poll;
            # the run ends with its failure, as torchrun's agent stops its workers
            head = "a rank has failed, and every other rank that has not finished waits or polls:"
        elif not polls:
            if not all(pause.number > self.returned_at for pause in sleepers.values()):
                return None
            if any(thread.is_alive() for threads in self.rank_threads for thread in threads):
                return None
            head = ("every rank that has not finished waits, and none can make progress (the ranks "
                    "that wait for a store key have each looked again since the others began to wait):")
        elif now - quiet.since - (self.busy - quiet.busy) >= self.idle_limit:
            head = (f"for {now - quiet.since:.1f} s no rank has made progress: every rank that has not "
                    f"finished is blocked or polls with time.sleep (taken as a wait nobody ends after "
                    f"SIMCOMM_IDLE_S={self.idle_limit:g} s of it; a poll for something outside the run "
                    f"needs a larger value):")
        else:
            return None
        lines = [head, *describe_waits(self.blocked, self.world_size)]
        lines.extend(describe_ranks({r: f"{'waits in' if p.store else 'polls with'} {p.what} at "
                                        f"{program_location(p.frame)}" for r, p in sleepers.items()},
                                    self.world_size))
        done = sorted(self.finished)
        if done:
            lines.append(f"  {'rank' if len(done) == 1 else 'ranks'} {format_ranks(done)} "
                         f"{'has' if len(done) == 1 else 'have'} finished")
        return "\n".join(lines)

    def abort_and_release(self, error: BaseException) -> NoReturn:
        """Abort the run with ``error``. Called with the lock held; releases it and
        raises :class:`~simcomm.errors.Aborted` to unwind the calling rank."""
        self.abort_locked(error)
        self.lock.release()
        raise Aborted

    def wake_locked(self, rank: int) -> None:
        """``rank`` may continue: it runs when the current rank hands on its turn."""
        del self.blocked[rank]
        self.ready.append(rank)

    def abort_locked(self, error: BaseException) -> None:
        """Record the run's first error and wake every blocked or ready rank to unwind.

        With ``peers_run_on`` after a rank failed, "nobody can make progress" is no
        deadlock of the program: the ranks left wait for the failed rank (or for ranks
        that do), and the run ends with that rank's failure."""
        if self.error is None:
            if self.rank_errors and isinstance(error, DeadlockError):
                error = self.rank_errors[0][1]
            self.error = error
            self._note_where_locked()
        for rank in [*self.blocked, *self.ready]:
            self.waiters[rank].release()
            self.woken_by_abort.add(rank)
        self.blocked.clear()
        self.ready.clear()
        self.done.set()

    def note_group_timeout(self, rank: int, timeout) -> None:
        """``rank``'s ``init_process_group(timeout=)`` (a ``timedelta`` or seconds)."""
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else timeout
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"init_process_group on rank {rank}: timeout={timeout!r} must be a "
                             f"positive datetime.timedelta")
        with self.lock:
            self.group_timeouts[rank] = float(seconds)

    def expired_wait_locked(self) -> tuple[int, float, float] | None:
        """A blocked rank that has waited longer than its group timeout: ``(rank, timeout,
        waited)``, or None."""
        now = time.monotonic()
        for rank in self.blocked:
            limit = self.group_timeouts.get(rank)
            since = self.blocked_since.get(rank)
            if limit is not None and since is not None and now - since > limit:
                return rank, limit, now - since
        return None

    def _note_where_locked(self) -> None:
        """Record in ``stopped_at`` the script line of every started, unfinished rank."""
        frames = sys._current_frames()
        for rank in self.started:
            if rank not in self.finished and rank not in self.exiting:
                ident = self.thread_ids[rank]
                self.stopped_at[rank] = program_location(frames.get(ident) if ident else None)

    # -- reports --

    def describe_deadlock_locked(self) -> str:
        return describe_deadlock(self.blocked, self.finished, self.world_size)

    def turn_holders(self) -> list[int]:
        """Unfinished ranks that were running program code, not waiting in the scheduler,
        when the run was aborted: the rank that held the turn. The abort woke every
        other rank, and those unwind by themselves."""
        with self.lock:
            return [rank for rank in self.started
                    if rank not in self.finished and rank not in self.woken_by_abort]

    def describe_ranks_locked(self, frames: dict[int, object]) -> list[str]:
        """Where each unfinished rank is (for the timeout message); ``frames`` maps
        thread ids to their current frames (``sys._current_frames()``)."""
        lines = describe_waits(self.blocked, self.world_size)
        others: dict[int, str] = {}
        for rank in range(self.world_size):
            if rank in self.blocked or rank in self.finished:
                continue
            thread = self.threads[rank]
            if rank not in self.started:
                others[rank] = "never started (waiting for a first turn)"
            elif rank in self.sleeping:
                pause = self.sleeping[rank]
                others[rank] = (f"{'waits in' if pause.store else 'sleeps in'} {pause.what} at "
                                + program_location(frames.get(thread.ident) if thread else None))
            elif rank in self.ready:
                others[rank] = ("is ready and waits for its turn at "
                                + program_location(frames.get(thread.ident) if thread else None))
            else:
                others[rank] = "computes at " + program_location(frames.get(thread.ident) if thread else None)
        lines.extend(describe_ranks(others, self.world_size))
        return lines

# -- the transport -----------------------------------------------------------------------
