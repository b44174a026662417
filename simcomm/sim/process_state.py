"""Per-rank process state: what each process of a real run has to itself, given to each virtual rank.

Virtual ranks are threads of one process, so everything a process keeps in
module globals is shared by them unless the simulator gives each rank its
own. Since the ranks take turns (:class:`simcomm.sim.scheduler.RunState`),
most of it can simply belong to the rank holding the turn: the rank handing
the turn on saves it (:meth:`RankProcessState.hand_off`), the rank taking it
loads its own (:meth:`RankProcessState.take_turn`). Swapped at each handoff:

* torch's default generators (:mod:`simcomm.sim.rank_random`, whose raw bytes
  :func:`~simcomm.sim.rank_random.cpu_raw` reads on the CPU);
* Python's ``random`` module state (the module-level functions draw from
  one hidden ``random.Random``) and NumPy's global ``np.random`` state (the
  legacy ``RandomState`` behind ``np.random.seed``/``rand``/``randn``);
* ``sys.argv`` and ``sys.modules["__main__"]``, so each rank may run its own
  ``__main__`` module with its own arguments (``python -m simcomm.run``).

Every rank starts every run from a seed of its own, rank ``r`` from
:func:`~simcomm.fresh_state.rank_seed` ``(S, r)`` of the run seed ``S``
(``SIMCOMM_SEED``, :mod:`simcomm.fresh_state`): torch's generators as after
``torch.manual_seed``, Python's ``random`` as after ``random.seed`` and NumPy's
as after ``np.random.seed`` with it, so unseeded numbers differ from rank to rank
as they do between processes (a new interpreter seeds them from the operating
system) and repeat from run to run; ``real`` workers seed themselves the same
way at the start of every run, so both backends draw the same numbers. A rank
is seeded in its first turn. ``sys.argv`` and ``__main__`` start as the
caller's. The caller's state is saved before a run and put back after it.

**Cost.** Python's and NumPy's own ``getstate``/``setstate`` are slow (about
10 and 100 us), and torch's ``get_state`` builds a 5 KB tensor (about 1 us), so
each state is saved and loaded as raw bytes, copied straight from and into the
generator's memory (the layout is checked against ``getstate``/``get_state``
once; about 0.1 to 1 us), and only for a rank that changed it: each generator
has a *fingerprint* (Python and NumPy: a few words of the raw state, the
position, two state words, the cached Gaussian: any draw, seeding or
``setstate`` changes them, but for chance collisions of 2**-64; torch's CPU
generator: its whole raw state, compared at once), and a rank whose fingerprint
is unchanged at handoff saves nothing; loading is skipped when the rank's saved
state is already the live one. Every rank hands off when it gives up the turn,
also when it finishes, so the live state is always known. A program that never
draws from them pays well under 1 us per handoff in all
(``benchmarks/launch_script.py`` measures it). Where the raw bytes cannot be
found (another interpreter, NumPy or torch layout, a CUDA World's device
generator), every handoff saves and loads with their own
``getstate``/``setstate``: correct, only slower.

**Threads a rank starts** belong to the rank, as a process's threads belong to
it (:func:`own_thread`, the ``rank-threads`` row of :mod:`simcomm.patches`):
``threading.Thread.start`` on a rank thread runs the new thread inside the
rank's thread-local state, which the modules holding it register
(:func:`inherit_thread_local`, :func:`inherit_on_threads`: the rank's
torch.distributed world, ``os.environ`` view, output tag, virtual GPU mode,
seed), and the scheduler lets it communicate as the rank. A thread made on
the rank's own thread without ``daemon=`` is waited for as the rank ends, as a
process waits for its non-daemon threads (its ``daemon`` flag still reads
True: a leftover thread never holds up the interpreter). What threads cannot
do: communicate two at a time for one rank (the second gets a
``WrongThreadError``), nor run while another rank holds the turn without
mixing with it: a rank's threads should wait (``join``) while one of them
waits in a collective.

**The working directory** is per rank (the ``rank-cwd`` row of
:mod:`simcomm.patches`): ``os.chdir`` on a rank's thread records the rank's
new directory, and from then on each handoff makes the process's working
directory the rank's (one ``chdir`` when it differs), so relative paths
resolve against the rank's own; the caller's is put back after the run. A
run in which no rank changes directory pays one ``None`` test per handoff.

**The process id** a rank sees (``os.getpid()``, the ``rank-pid`` row of
:mod:`simcomm.patches`) is its thread's Linux thread id
(``threading.get_native_id()``, shared by the threads the rank starts):
distinct per rank, stable for the run, and an id of this process to the
kernel (``os.kill(os.getpid(), 0)`` succeeds, ``/proc/<id>`` exists), so
pid-named files do not collide. C code's ``getpid()`` still sees the one
process id.

**Logging's configuration** is per rank (the ``rank-logging`` row of
:mod:`simcomm.patches`): the root logger's handler list and level, a copy of
the caller's in each rank's first turn, swapped at each handoff (two identity
tests when no rank changed them), so each rank's ``logging.basicConfig``
configures its own root logger, as in a process. Named loggers' own handlers
and levels stay shared.

**Global module and optimizer hooks** (``register_module_forward_hook`` and
the rest, the ``rank-hooks`` row of :mod:`simcomm.patches`) are per rank:
torch's hook dicts are swapped at each handoff (:mod:`simcomm.sim.rank_hooks`),
so a hook a rank registers fires for its own modules only, as CommDebugMode's
and MemTracker's module trackers expect.

**Once-per-process settings** (the ``rank-process-settings`` row of
:mod:`simcomm.patches`): multiprocessing's start method is chosen per rank
(each rank's first ``mp.set_start_method`` succeeds, a second raises as in a
process), and ``signal.signal``/``signal.getsignal`` on a rank thread set and
read the rank's own handler table (Python allows ``signal.signal`` only on the
main thread). The handlers are recorded, not installed: a signal sent to the
process runs the process's handler, not a rank's
(:func:`rank_signal_handler` reads them).

**Environment variables** are per rank through :func:`rank_environ`, a view
of ``os.environ`` that resolves to the calling rank thread's own copy (and to
the process's environment on every other thread). C code that calls
``getenv`` (inductor's ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR``, torch's
C++ settings, NCCL's and gloo's variables) and child processes started
without ``env=`` (``subprocess``, a shell's ``$RANK``, ``mp.spawn``) read the
process's one C environment instead, so it follows the rank holding the turn
(:func:`sync_c_environ`): for the variables that may differ from the
process's (those ``rank_environ`` gave and those a rank wrote), each handoff
to a rank whose variables are not the live ones puts the differing ones
(``os.putenv``/``os.unsetenv``), and a rank's own write reaches it at once.
The process's values are put back when the last block ends.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import multiprocessing.context
import os
import random as _random
import signal
import struct
import sys
import threading
import weakref
from collections.abc import Iterator, Mapping
from typing import Any, Callable, NamedTuple

import torch

from ..fresh_state import numpy_seed, rank_seed, run_seed
from .rank_hooks import RankHooks
from .rank_modules import RankModules
from .rank_warnings import RankWarnings
from .rank_random import RankRandomState, cpu_raw

__all__ = ["RankProcessState", "rank_environ", "rank_start_seed", "inherit_on_threads", "inherit_thread_local",
           "own_thread", "thread_owner", "waited_for_at_exit", "rank_signal_handler"]

_seed_local = threading.local()      # .seed: the seed the calling rank thread started this run from


def rank_start_seed() -> int | None:
    """The seed the calling rank thread's generators started this run from
    (:func:`simcomm.fresh_state.rank_seed`); ``None`` on any other thread."""
    return getattr(_seed_local, "seed", None)

try:
    import numpy as _np
except ImportError:   # NumPy is optional: then there is no NumPy state to keep per rank
    _np = None


# -- fingerprints: the raw bytes of a generator's state, read without building Python objects --

def _python_raw() -> _Raw | None:
    """Raw access to the state of ``random``'s hidden generator (CPython's ``RandomObject``:
    an int index, then 624 uint32 words, after the object header) and its cached
    ``gauss_next``; ``None`` if the layout is not what it should be."""
    inst = _random._inst
    if sys.implementation.name != "cpython":
        return None
    address, size = id(inst) + 2 * ctypes.sizeof(ctypes.c_void_p), 4 + 624 * 4
    state = inst.getstate()[1]
    raw = ctypes.string_at(address, size)
    if struct.unpack_from("i", raw)[0] != state[-1] or struct.unpack_from("624I", raw, 4) != state[:-1]:
        return None
    words = (ctypes.c_uint32 * 625).from_address(address)   # a live view: index, then the state
    view, everything = memoryview((ctypes.c_char * size).from_address(address)).cast("B"), slice(None)

    def get() -> tuple:
        return view.tobytes(), inst.gauss_next

    def set_(state: tuple) -> None:
        view[everything] = state[0]
        inst.gauss_next = state[1]

    # the index, the first two and the last state words: a draw moves the index, and every
    # 624 words the whole state is regenerated; seeding or setstate rewrites the words
    return _Raw(lambda: (words[0], words[1], words[2], words[624], inst.gauss_next), get, set_)


def _numpy_raw() -> _Raw | None:
    """Raw access to NumPy's global ``RandomState``: its MT19937 state (public:
    ``bit_generator.ctypes.state``, 624 words and a position) and the cached Gaussian of
    the legacy ``randn`` (found in the object by planting a known value); ``None`` if the
    layout is not what it should be."""
    if _np is None:
        return None
    legacy = _np.random.mtrand._rand
    generator = legacy._bit_generator
    if type(generator).__name__ != "MT19937":
        return None
    saved = legacy.get_state()
    try:
        key = _np.arange(624, dtype=_np.uint32)
        marker = 1.2345678901234e-300
        legacy.set_state(("MT19937", key, 5, 1, marker))
        blob = ctypes.string_at(id(legacy), type(legacy).__basicsize__)
        offset = blob.find(struct.pack("d", marker))
        if offset < 8 or struct.unpack_from("i", blob, offset - 8)[0] != 1:
            return None
        legacy.set_state(("MT19937", key, 5, 0, 0.0))
        blob = ctypes.string_at(id(legacy), type(legacy).__basicsize__)
        if struct.unpack_from("i", blob, offset - 8)[0] != 0:
            return None
    finally:
        legacy.set_state(saved)
    state_address = generator.ctypes.state.value
    cache_address = id(legacy) + offset - 8
    key = (ctypes.c_uint32 * 625).from_address(state_address)     # live views: key[624] is pos
    flag = ctypes.c_int.from_address(cache_address)
    gauss = ctypes.c_double.from_address(cache_address + 8)
    # the key and position, and the flag with the cached Gaussian (an int, padding, a double)
    words_view = memoryview((ctypes.c_char * (624 * 4 + 4)).from_address(state_address)).cast("B")
    cache_view = memoryview((ctypes.c_char * 16).from_address(cache_address)).cast("B")
    everything = slice(None)

    def get() -> tuple:
        return words_view.tobytes(), cache_view.tobytes()

    def set_(state: tuple) -> None:
        words_view[everything] = state[0]
        cache_view[everything] = state[1]

    # key[1], key[623] and the position (a draw moves it; every 624 words the key is
    # regenerated), and the cached Gaussian with its flag
    return _Raw(lambda: (key[1], key[623], key[624], flag.value, gauss.value), get, set_)


class _Raw(NamedTuple):
    """A generator's state read and written as raw bytes (microseconds, where its own
    ``getstate``/``setstate`` take 10 to 100), and its fingerprint."""

    fingerprint: Callable[[], Any]
    get: Callable[[], Any]
    set: Callable[[Any], None]


_RAW: dict[str, _Raw | None] = {}


def _torch_cpu_raw() -> _Raw | None:
    """Raw access to torch's default CPU generator (:func:`simcomm.sim.rank_random.cpu_raw`); its
    fingerprint is the whole state, 2544 bytes compared at once, so no collision can hide a draw."""
    raw = cpu_raw()
    return None if raw is None else _Raw(raw.get, raw.get, raw.set)


_BUILDERS: dict[str, Callable[[], _Raw | None]] = {
    "python": lambda: _python_raw(), "numpy": lambda: _numpy_raw(), "torch": lambda: _torch_cpu_raw(),
    "torch+cuda": lambda: None}    # a CUDA World: the device generator has no raw access here


def _raw(name: str) -> _Raw | None:
    if name not in _RAW:
        _RAW[name] = _BUILDERS[name]()
    return _RAW[name]


def _swapped(world_size: int, name: str, get: Callable, set_: Callable, seed: Callable[[int], None],
             seeds: Callable[[int], int]) -> _SwappedGenerator:
    """The generator ``name`` kept per rank: raw bytes and a fingerprint where the layout is
    known, its own ``get``/``set`` (every handoff) elsewhere. ``seed(n)`` seeds the live
    generator; ``seeds(rank)`` is the seed rank ``rank`` starts from."""
    raw = _raw(name)
    if raw is not None:
        get, set_ = raw.get, raw.set
    return _SwappedGenerator(world_size, get, set_, seed, seeds, raw.fingerprint if raw is not None else None)


_UNSEEDED = object()     # a rank's state before its first turn


class _SwappedGenerator:
    """One process-global generator kept per rank, saved only when a rank changed it.

    A rank's state is ``_UNSEEDED`` until its first turn, which seeds the live generator with the
    rank's seed and keeps the result: nothing is made for a rank before it runs."""

    __slots__ = ("states", "prints", "get", "set", "seed", "seeds", "fingerprint", "loaded", "loaded_print",
                 "caller")

    def __init__(self, world_size: int, get: Callable, set_: Callable, seed: Callable[[int], None],
                 seeds: Callable[[int], int], fingerprint: Callable[[], Any] | None):
        self.get, self.set, self.seed, self.seeds, self.fingerprint = get, set_, seed, seeds, fingerprint
        self.states: list = [_UNSEEDED] * world_size
        self.prints: list = [None] * world_size   # each saved state's fingerprint, taken as it was saved
        self.loaded = None            # the saved state that is live now (None: unknown)
        self.loaded_print = None
        self.caller = None

    def hand_off(self, rank: int) -> None:
        fingerprint = self.fingerprint
        if fingerprint is None:
            self.states[rank] = self.get()
            return
        now = fingerprint()
        if now != self.loaded_print:
            self.states[rank] = self.loaded = self.get()
            self.prints[rank] = self.loaded_print = now

    def take_turn(self, rank: int) -> None:
        state = self.states[rank]
        if state is _UNSEEDED:        # the rank's first turn: its own seed
            self.seed(self.seeds(rank))
            state = self.states[rank] = self.get()
            if self.fingerprint is not None:
                self.loaded = state
                self.prints[rank] = self.loaded_print = self.fingerprint()
        elif self.fingerprint is None:
            self.set(state)
        elif state is not self.loaded:   # every rank handed off before: the live state is known
            self.set(state)
            self.loaded = state
            self.loaded_print = self.prints[rank]


def _all_of(fingerprints: list) -> Callable[[], tuple] | None:
    """One fingerprint of several generators (``None`` if one of them has none)."""
    if None in fingerprints:
        return None
    if len(fingerprints) == 3:
        first, second, third = fingerprints
        return lambda: (first(), second(), third())
    return lambda: tuple([fingerprint() for fingerprint in fingerprints])


class RankProcessState:
    """The per-rank process state of one run (see the module docstring).

    :meth:`take_turn` and :meth:`hand_off` are called by a rank's own thread
    while it holds the turn, so no lock is needed.
    """

    def __init__(self, world_size: int, device: torch.device, seed: int | None = None):
        #: the run seed (``SIMCOMM_SEED``, :func:`simcomm.fresh_state.run_seed`); rank r starts from
        #: ``rank_seed(seed, r)``
        self.seed = run_seed() if seed is None else seed
        seeds = functools.partial(rank_seed, self.seed)
        generators = RankRandomState(device)   # get_state/set_state/seed, CPU (and CUDA) together

        def seed_torch(value: int) -> None:
            generators.seed(value)
            _seed_local.seed = value          # the rank's virtual CUDA generators start from it too
        self._torch_generators = generators
        self.torch = _swapped(world_size, "torch+cuda" if device.type == "cuda" else "torch",
                              generators.get_state, generators.set_state, seed_torch, seeds)
        self.python = _swapped(world_size, "python", _random.getstate, _random.setstate, _random.seed, seeds)
        self.numpy = (None if _np is None else
                      _swapped(world_size, "numpy", _np.random.get_state, _np.random.set_state,
                               lambda value: _np.random.seed(numpy_seed(value)), seeds))
        self.argv: list = [sys.argv] * world_size
        self.main: list = [sys.modules.get("__main__")] * world_size
        self._caller_sys: tuple | None = None
        self._generators = [generator for generator in (self.torch, self.python, self.numpy)
                            if generator is not None]
        #: every generator's fingerprint at once (None if one has none), and its value when the live
        #: states were last saved or loaded: equal at handoff, no generator has anything to save
        self._fingerprint = _all_of([generator.fingerprint for generator in self._generators])
        self._live_print: Any = None
        #: each rank's working directory, once some rank changed its own (None until then: every
        #: rank's is the caller's), the one live now and the caller's (:func:`_chdir`)
        self.cwds: list[str] | None = None
        self.live_cwd: str | None = None
        self.caller_cwd: str | None = None
        _install_chdir()
        #: each rank's root logger: its handler list (a copy of the caller's, made in its first turn)
        #: and level; the caller's
        self.log_handlers: list = [None] * world_size
        self.log_levels: list = [None] * world_size
        self.caller_log: tuple | None = None
        #: the program's own modules, one copy per rank (simcomm.sim.rank_modules)
        self.modules = RankModules(world_size)
        #: the global module and optimizer hooks, one set per rank that registers any
        #: (simcomm.sim.rank_hooks)
        self.hooks = RankHooks(world_size)
        #: the warnings module's state, one per rank once a rank touched it (simcomm.sim.rank_warnings)
        self.warnings = RankWarnings(world_size)

    def hand_off(self, rank: int) -> None:
        """``rank`` hands the turn on: keep its state."""
        fingerprint = self._fingerprint
        if fingerprint is None or fingerprint() != self._live_print:
            for generator in self._generators:
                generator.hand_off(rank)
            if fingerprint is not None:
                self._live_print = fingerprint()
        self.argv[rank] = sys.argv
        self.main[rank] = sys.modules.get("__main__")
        root = logging.root
        self.log_handlers[rank], self.log_levels[rank] = root.handlers, root.level
        self.modules.hand_off(rank)
        self.hooks.hand_off(rank)
        self.warnings.hand_off(rank)

    def take_turn(self, rank: int) -> None:
        """``rank`` takes the turn: make its state the live one."""
        loaded = False
        generators = self._generators
        for generator in generators:
            if generator.states[rank] is not generator.loaded or generator.fingerprint is None:
                generator.take_turn(rank)
                loaded = True
        if loaded and self._fingerprint is not None:   # what self._fingerprint() reads now
            self._live_print = tuple([generator.loaded_print for generator in generators])
        argv = self.argv[rank]
        if sys.argv is not argv:
            sys.argv = argv          # simcomm.patches: "rank-argv-main"
        main = self.main[rank]
        if main is not None:
            sys.modules["__main__"] = main
        cwds = self.cwds
        if cwds is not None and cwds[rank] != self.live_cwd:
            self._enter(cwds[rank])
        if _c_values:                  # some rank's variables differ from the process's
            sync_c_environ()
        handlers = self.log_handlers[rank]
        if handlers is None:           # the first turn: the caller's configuration, a list of its own
            caller = self.caller_log or (logging.root.handlers, logging.root.level)
            handlers = self.log_handlers[rank] = list(caller[0])
            self.log_levels[rank] = caller[1]
        if logging.root.handlers is not handlers:
            logging.root.handlers = handlers   # simcomm.patches: "rank-logging"
        if logging.root.level != self.log_levels[rank]:
            logging.root.level = self.log_levels[rank]
            logging.root.manager._clear_cache()    # loggers cache what their level lets through
        self.modules.take_turn(rank)
        self.hooks.take_turn(rank)
        self.warnings.take_turn(rank)

    def _enter(self, folder: str) -> None:
        """Make ``folder`` the process's working directory (the rank holding the turn's)."""
        try:
            _original_chdir(folder)
        except OSError:       # removed meanwhile: the next relative path the rank uses says so
            pass
        self.live_cwd = folder

    def changed_cwd(self, rank: int, change: Callable[[], None]) -> None:
        """Rank ``rank`` (holding the turn) changes its working directory with ``change``."""
        if self.cwds is None:
            self.caller_cwd = self.live_cwd = os.getcwd()
            self.cwds = [self.caller_cwd] * len(self.argv)
        change()
        self.cwds[rank] = self.live_cwd = os.getcwd()

    def save_caller(self) -> None:
        """Before a run: remember the state of the thread that starts it."""
        self._torch_generators.save_caller()
        self.python.caller = _random.getstate()
        if self.numpy is not None:
            self.numpy.caller = _np.random.get_state()
        self._caller_sys = (sys.argv, sys.modules.get("__main__"))
        self.caller_log = (logging.root.handlers, logging.root.level)
        self.modules.start()
        self.hooks.start()
        self.warnings.start()

    def restore_caller(self) -> None:
        """After a run: the caller's state is as it was before it."""
        self.warnings.end()
        self.modules.end()
        self.hooks.end()
        self._torch_generators.restore_caller()
        if self.python.caller is not None:
            _random.setstate(self.python.caller)
        if self.numpy is not None and self.numpy.caller is not None:
            _np.random.set_state(self.numpy.caller)
        if self._caller_sys is not None:
            sys.argv, main = self._caller_sys
            if main is not None:
                sys.modules["__main__"] = main
        if self.cwds is not None and self.live_cwd != self.caller_cwd:
            self._enter(self.caller_cwd)
        if self.caller_log is not None:
            logging.root.handlers = self.caller_log[0]
            if logging.root.level != self.caller_log[1]:
                logging.root.level = self.caller_log[1]
                logging.root.manager._clear_cache()


# -- the working directory per rank --------------------------------------------------------------

_original_chdir, _original_fchdir = os.chdir, os.fchdir
_chdir_installed = False


def _on_rank(change: Callable[[], None]) -> None:
    owner = getattr(_owner, "rank", None)
    if owner is None:
        change()
    else:
        owner[0].random.changed_cwd(owner[1], change)


def _chdir(path: Any) -> None:
    _on_rank(lambda: _original_chdir(path))


def _fchdir(fd: Any) -> None:
    _on_rank(lambda: _original_fchdir(fd))


_chdir.__doc__, _fchdir.__doc__ = _original_chdir.__doc__, _original_fchdir.__doc__


def _install_chdir() -> None:
    global _chdir_installed
    if not _chdir_installed:
        os.chdir, os.fchdir = _chdir, _fchdir      # simcomm.patches: "rank-cwd"
        _chdir_installed = True


# -- environment variables per rank ---------------------------------------------------------------

_env_local = threading.local()      # .environ: the calling rank thread's own variables
_env_lock = threading.Lock()
_env_users = 0
_real_environ: os._Environ | None = None

# The C environment (what getenv and child processes started without env= see) follows the rank
# holding the turn, for the variables that may differ from the process's: those rank_environ gave
# a rank and those a rank wrote. ``_c_values``: what the C environment holds for each of them now
# (None: unset); ``_c_for``: the rank's variables it was last made to agree with.
_c_values: dict[str, str | None] = {}
_c_for: dict | None = None
_putenv, _unsetenv = os.putenv, os.unsetenv


#: (id of the live rank's variables, id of the next rank's): the tracked variables that differ
#: between them, and their values in the next rank's (ranks take turns in a cycle, so a handoff
#: puts only these); emptied when a rank writes a variable or a new one is tracked
_differences: dict[tuple[int, int], list[tuple[str, str | None]]] = {}


def _track(key: str) -> None:
    """``key`` may differ between ranks: keep the C environment's value of it in step."""
    _differences.clear()
    if key not in _c_values:
        _c_values[key] = _real_environ.get(key) if _real_environ is not None else None


def _set_c(key: str, value: str | None) -> None:
    if value is None:
        _unsetenv(key)
    else:
        _putenv(key, value)
    _c_values[key] = value


def sync_c_environ() -> None:
    """Make the C environment agree with the calling rank thread's variables (called as a rank
    takes the turn; nothing to do outside ``rank_environ``, or when it agrees already)."""
    global _c_for
    mine = getattr(_env_local, "environ", None)
    if mine is None or mine is _c_for:
        return
    pair = (id(_c_for), id(mine))
    changes = _differences.get(pair) if _c_for is not None else None
    if changes is None:
        get = mine.get
        changes = [(key, get(key)) for key, value in _c_values.items() if get(key) != value]
        if _c_for is not None:
            _differences[pair] = changes
    for key, value in changes:
        _set_c(key, value)
    _c_for = mine


def _restore_c_environ() -> None:
    """The last rank_environ block ended: the C environment is the process's again."""
    global _c_for
    for key, value in list(_c_values.items()):
        real = _real_environ.get(key)
        if value != real:
            _set_c(key, real)
    _c_values.clear()
    _differences.clear()
    _c_for = None


class _RankEnviron(os._Environ):
    """Stands in for ``os.environ``: the calling rank thread's own variables on a rank
    thread inside :func:`rank_environ`, the process's environment everywhere else.

    A rank's copy is a plain dict: setting a variable there changes what that
    rank's Python code reads (``os.environ``, ``os.getenv``), not the C
    environment, which the process has only one of.
    """

    def __init__(self, real: os._Environ):   # noqa: super().__init__ would copy the data
        self._real = real

    def _current(self) -> Any:
        mine = getattr(_env_local, "environ", None)
        return self._real if mine is None else mine

    def __getitem__(self, key):
        return self._current()[key]

    def __setitem__(self, key, value):
        mine = getattr(_env_local, "environ", None)
        if mine is None:
            self._real[key] = value
            return
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"str expected, not {type(key if not isinstance(key, str) else value).__name__}")
        _track(key)
        if mine is _c_for:              # the C environment follows this rank now: C code sees it at once
            _set_c(key, value)
        mine[key] = value

    def __delitem__(self, key):
        current = self._current()
        del current[key]
        if current is not self._real:
            _track(key)
            if current is _c_for:
                _set_c(key, None)

    def __iter__(self):
        return iter(list(self._current()))

    def __len__(self):
        return len(self._current())

    def __contains__(self, key):
        return key in self._current()

    def __repr__(self):
        mine = getattr(_env_local, "environ", None)
        return repr(self._real) if mine is None else f"environ({mine!r})"

    def copy(self):
        return dict(self._current())

    def setdefault(self, key, value):
        if key not in self:
            self[key] = value
        return self[key]

    def __ior__(self, other):
        self.update(other)
        return self

    def __or__(self, other):
        if not isinstance(other, Mapping):
            return NotImplemented
        merged = dict(self._current())
        merged.update(other)
        return merged

    def __ror__(self, other):
        if not isinstance(other, Mapping):
            return NotImplemented
        merged = dict(other)
        merged.update(self._current())
        return merged

    def __getattr__(self, name: str) -> Any:
        # os._Environ's encoders and raw data (os.get_exec_path, subprocess): the process's own
        if name == "_real":
            raise AttributeError(name)
        return getattr(self._real, name)


@contextlib.contextmanager
def rank_environ(variables: Mapping[str, str]) -> Iterator[None]:
    """For the calling thread, for the length of the block: ``os.environ`` (and
    ``os.getenv``) read and write ``variables``, a copy of the process's environment
    with this rank's variables on top. Other threads keep the real environment."""
    global _env_users, _real_environ
    with _env_lock:
        if _env_users == 0:
            _real_environ = os.environ
            os.environ = _RankEnviron(_real_environ)   # simcomm.patches: "rank-environ"
        _env_users += 1
        mine = dict(_real_environ)
        _differences.clear()        # keyed by ids of rank dicts: a new one may reuse an old one's
        for key, value in variables.items():
            if _real_environ.get(key) != value:
                _track(key)
    mine.update(variables)
    _env_local.environ = mine
    sync_c_environ()
    try:
        yield
    finally:
        _env_local.environ = None
        with _env_lock:
            _env_users -= 1
            if _env_users == 0 and isinstance(os.environ, _RankEnviron):
                os.environ = _real_environ
                _restore_c_environ()


# -- threads a rank starts belong to the rank ---------------------------------------------------

#: ``.rank``: ``(run, rank)`` on a rank thread and on every thread it (or such a thread) started;
#: ``run`` is the run's :class:`simcomm.sim.scheduler.RunState`
_owner = threading.local()
#: what a thread started by a rank takes from the thread that started it: functions called on the
#: starting thread, each returning a context manager the new thread runs inside (or None)
_captures: list[Callable[[], Any]] = []
_original_start = threading.Thread.start


def inherit_on_threads(capture: Callable[[], Any]) -> Callable[[], Any]:
    """Register ``capture``: called on a rank thread (or a thread of its) as it starts a thread,
    it returns a context manager the new thread runs its target inside, or ``None``. This is how
    per-rank thread-local state (the rank's torch.distributed world, environment, output tag,
    virtual GPU) reaches the threads a rank starts, as a process's threads share its state."""
    _captures.append(capture)
    return capture


#: the thread-locals whose attributes the threads a rank starts inherit, and which attributes
_inherited_locals: dict[weakref.ref, tuple[str, ...]] = {}


def inherit_thread_local(local: Any, *names: str) -> None:
    """Threads a rank starts get ``local``'s attributes ``names`` (``local``: a ``threading.local``)
    as the starting thread has them
    (the same objects: a rank's threads share them, as a process's threads share its globals).
    Forgotten when ``local`` is."""
    _inherited_locals[weakref.ref(local, lambda ref: _inherited_locals.pop(ref, None))] = names


def _capture_locals() -> Any:
    values = []
    for reference, names in list(_inherited_locals.items()):
        local = reference()
        if local is not None:
            values.extend((local, name, getattr(local, name)) for name in names if hasattr(local, name))
    return _LocalValues(values) if values else None


class _LocalValues:
    """Sets thread-locals' attributes for the length of a block on the calling thread."""

    __slots__ = ("values",)

    def __init__(self, values: list):
        self.values = values

    def __enter__(self) -> None:
        for local, name, value in self.values:
            setattr(local, name, value)

    def __exit__(self, *exc_info) -> None:
        for local, name, _ in self.values:
            with contextlib.suppress(AttributeError):
                delattr(local, name)


def own_thread(run: Any, rank: int) -> None:
    """The calling thread is rank ``rank``'s thread of ``run`` (so are the threads it starts)."""
    _owner.rank = (run, rank)
    _owner.pid = threading.get_native_id()
    _install_thread_start()


def thread_owner() -> tuple[Any, int] | None:
    """``(run, rank)`` of the calling thread: a rank thread or a thread a rank started; else None."""
    return getattr(_owner, "rank", None)


def _start(self: threading.Thread) -> None:
    owner = getattr(_owner, "rank", None)
    if owner is not None and "run" not in self.__dict__:
        contexts = [context for context in (capture() for capture in _captures) if context is not None]
        target = self.run
        pid = getattr(_owner, "pid", None)

        def run_as_rank() -> None:
            _owner.rank, _owner.pid = owner, pid
            with contextlib.ExitStack() as stack:
                for context in contexts:
                    stack.enter_context(context)
                target()
        self.run = run_as_rank
        owner[0].adopt_thread(owner[1], self)
    if getattr(self, "_simcomm_waited_for", False):
        # made daemon after construction: not waited for; either way it runs as a daemon thread of
        # the process, so that a leftover thread never holds up the interpreter's exit
        self._simcomm_waited_for = not self._daemonic
        self._daemonic = True
    _original_start(self)


_start.__doc__ = _original_start.__doc__
_original_init = threading.Thread.__init__


def _init(self: threading.Thread, *args: Any, **kwargs: Any) -> None:
    _original_init(self, *args, **kwargs)
    owner = getattr(_owner, "rank", None)
    if owner is not None and kwargs.get("daemon") is None:
        # made on a rank's own thread (a daemon thread of World's) without daemon=: on a process's
        # main thread it would be a non-daemon thread, which the process waits for as it exits
        run, rank = owner
        waited_for = threading.current_thread() is run.threads[rank] or \
            getattr(threading.current_thread(), "_simcomm_waited_for", False)
        if waited_for:
            # until start() it reads as a process's would (not a daemon), so that a library that
            # makes it a daemon after construction (multiprocessing's queue feeder) is seen to
            self._daemonic = False
            self._simcomm_waited_for = True


_init.__doc__ = _original_init.__doc__
_thread_start_installed = False


_original_getpid = os.getpid


def _getpid() -> int:
    pid = getattr(_owner, "pid", None)
    return _original_getpid() if pid is None else pid


_getpid.__doc__ = _original_getpid.__doc__


def _forget_pid_in_child() -> None:
    """A child a rank forks (a DataLoader worker, a multiprocessing.Process) is a process of its own:
    its ``os.getpid()`` is its real pid, as under torchrun, not the rank's."""
    _owner.pid = None


os.register_at_fork(after_in_child=_forget_pid_in_child)


# -- once-per-process settings: multiprocessing's start method, signal handlers -----------------

def _rank_table(name: str) -> dict | None:
    """The calling rank's entries in the run's table ``name`` (None off rank threads)."""
    owner = getattr(_owner, "rank", None)
    if owner is None:
        return None
    run, rank = owner
    tables = run.__dict__.setdefault("process_settings", {})
    return tables.setdefault((name, rank), {})


class _RankDefaultContext(multiprocessing.context.DefaultContext):
    """multiprocessing's default context whose chosen start method is per rank on rank threads (a
    fresh process has none chosen, so each rank's first ``set_start_method`` succeeds)."""

    @property
    def _actual_context(self) -> Any:
        mine = _rank_table("start-method")
        return self.__dict__.get("_actual_context") if mine is None else mine.get("context")

    @_actual_context.setter
    def _actual_context(self, context: Any) -> None:
        mine = _rank_table("start-method")
        if mine is None:
            self.__dict__["_actual_context"] = context
        else:
            mine["context"] = context


_original_signal, _original_getsignal = signal.signal, signal.getsignal

#: the signals torchrun's agent catches itself (``TORCHELASTIC_SIGNALS_TO_HANDLE``) before it starts
#: its workers, so that a worker never inherits them ignored
_AGENT_CAUGHT = frozenset(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
                          if hasattr(signal, name))


def _inherited(number: signal.Signals) -> Any:
    """A rank's handler for ``number`` before the rank sets one: the process's, except a signal
    the process ignores that torchrun's agent catches, which a worker starts with as a fresh
    Python process has it (SIGINT: ``signal.default_int_handler``). A process started as a
    background job of a non-interactive shell ignores SIGINT; torchrun's workers there do not."""
    handler = _original_getsignal(number)
    if handler == signal.SIG_IGN and number in _AGENT_CAUGHT:
        return signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL
    return handler


def _signal(signalnum: Any, handler: Any) -> Any:
    mine = _rank_table("signal") if threading.current_thread() is not threading.main_thread() else None
    if mine is None:
        return _original_signal(signalnum, handler)
    number = signal.Signals(signalnum)          # ValueError for a number that is no signal
    if number in (signal.SIGKILL, signal.SIGSTOP):
        raise OSError(22, "Invalid argument")
    if not callable(handler) and handler not in (signal.SIG_IGN, signal.SIG_DFL):
        raise TypeError("signal handler must be signal.SIG_IGN, signal.SIG_DFL, or a callable object")
    previous = mine.get(number, _inherited(number))
    mine[number] = handler
    return previous


def _getsignal(signalnum: Any) -> Any:
    mine = _rank_table("signal") if threading.current_thread() is not threading.main_thread() else None
    if mine is None:
        return _original_getsignal(signalnum)
    number = signal.Signals(signalnum)
    return mine.get(number, _inherited(number))


_signal.__doc__, _getsignal.__doc__ = _original_signal.__doc__, _original_getsignal.__doc__


def rank_signal_handler(run: Any, rank: int, signalnum: int) -> Any:
    """The handler rank ``rank`` of ``run`` set for ``signalnum`` (None if it set none)."""
    return run.__dict__.get("process_settings", {}).get(("signal", rank), {}).get(signal.Signals(signalnum))


def _install_thread_start() -> None:
    global _thread_start_installed
    if not _thread_start_installed:
        threading.Thread.start = _start        # simcomm.patches: "rank-threads"
        threading.Thread.__init__ = _init
        os.getpid = _getpid                     # simcomm.patches: "rank-pid"
        # simcomm.patches: "rank-process-settings"
        multiprocessing.context._default_context.__class__ = _RankDefaultContext
        signal.signal, signal.getsignal = _signal, _getsignal
        _thread_start_installed = True


def waited_for_at_exit(thread: threading.Thread) -> bool:
    """Whether a rank waits for ``thread`` as it ends: a thread that would not be a daemon thread
    in a process (its ``daemon`` flag reads True on virtual ranks, so that a leftover thread never
    holds up the interpreter's exit)."""
    return not thread.daemon or getattr(thread, "_simcomm_waited_for", False)


class _BackwardOnThisThread:
    """Rank threads run backward on their own thread (World: autograd's device threads would be
    shared by every rank); so do the threads a rank starts."""

    def __enter__(self) -> None:
        torch.autograd.set_multithreading_enabled(False)

    def __exit__(self, *exc_info) -> None:
        pass


def _autograd_threads() -> Any:
    return None if torch.autograd.is_multithreading_enabled() else _BackwardOnThisThread()


inherit_on_threads(_autograd_threads)
inherit_on_threads(_capture_locals)
inherit_thread_local(_env_local, "environ")
inherit_thread_local(_seed_local, "seed")
