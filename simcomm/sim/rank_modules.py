"""Per-rank modules: each virtual rank imports the program's own modules for itself.

Under ``torchrun`` every rank is a process with its own ``sys.modules``, so a
library's module-level state (accelerate's ``PartialState``, whose instances
share one class-level dict; a ``process_group_manager`` module holding the
process's groups in a global; a logger set up with the rank in its name) is
per rank. Virtual ranks are threads of one process; without this module they
would share one copy and rank 1 would see rank 0's state.

**The rule.** A module is *per rank* when

* it is first imported during the run (it was not in ``sys.modules`` when the
  run started, and neither was its top-level package), and
* its import came from the program: from ``__main__`` (the script; ``runpy``
  importing the package of ``-m package.module``), from the module holding a
  ``World`` program, or from another per-rank module, not
  from the standard library, torch, NumPy, simcomm or the packages they use
  (:data:`SHARED_TOP_LEVEL`: those are imported once and shared, as torch's own
  lazy imports must be), and
* it is Python code (source or bytecode). A C extension is shared: most
  cannot be loaded twice into one process, and they keep no Python-level
  state of their own.

Each rank then imports such a module itself, running its top-level code once
per rank, as each process of a real run does; the ranks' copies are swapped
into ``sys.modules`` at each turn handoff (:class:`RankModules`, called by
:class:`simcomm.sim.process_state.RankProcessState`). A module imported by the
caller before the run is shared by every rank (the caller's process has one
copy): import the library inside the program, or run the script with
``python -m simcomm.run``, which imports nothing of the script's before the run.

**What an import registers process-wide** (a ``torch.library`` op, a
``torch.distributed`` backend, a DTensor sharding rule, ``atexit`` hooks)
exists once in the process. Where a later rank's own import of a module raises
while the first rank's import of it succeeded, that module is taken to
register something the process already has: the rank uses the first rank's
copy of that module from then on, with one notice on stderr naming it (its
module-level state is then shared by those ranks).

**Cost.** A program that imports nothing new during the run pays one
``len(sys.modules)`` comparison per handoff. Otherwise, each rank runs each
per-rank module's top-level code once (the import time of the library, times
the number of ranks: about 1 ms per small module, a second or more for a large
library such as accelerate, so a run of thousands of ranks that imports one pays
for it thousands of times), and each handoff puts the rank's modules into
``sys.modules`` and takes them out again (about 0.1 us per module).

What it cannot cover: threads a rank starts itself run beside other ranks'
turns and see the ``sys.modules`` of whichever rank holds the turn; an
attribute of a shared module that a per-rank module sets (a hook installed into
torch, a handler added to the root logger) is one for the process.
"""
from __future__ import annotations

import importlib.machinery
import sys
import threading
from types import ModuleType
from typing import Any

__all__ = ["RankModules", "SHARED_TOP_LEVEL", "SharedModuleNotice"]

#: top-level packages that are never per rank: torch, NumPy, simcomm and the packages they import
#: (torch imports these lazily from its own code, and two copies of sympy's classes would not
#: compare equal), and the test and notebook harnesses that run programs
SHARED_TOP_LEVEL = frozenset({
    "torch", "functorch", "torchgen", "triton", "numpy", "simcomm", "real",
    "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "filelock", "fsspec", "typing_extensions",
    "optree", "opt_einsum", "setuptools", "pkg_resources", "_distutils_hack", "dill", "expecttest",
    "plotly", "kaleido", "pandas", "scipy", "PIL", "matplotlib", "packaging",
    "pytest", "_pytest", "pluggy", "iniconfig", "hypothesis", "xdist",
    "IPython", "ipykernel", "jupyter_client", "jupyter_core", "traitlets", "tornado", "zmq", "nbformat",
    "nbconvert", "nbclient", "jupytext",
}) | frozenset(sys.stdlib_module_names)

_EXTENSION_SUFFIXES = tuple(importlib.machinery.EXTENSION_SUFFIXES)
_IMPORT_MACHINERY = ("<frozen importlib", importlib.__file__)


class SharedModuleNotice(UserWarning):
    """A per-rank module fell back to the first rank's copy (its import registers something
    process-wide)."""


def _top(name: str) -> str:
    return name.partition(".")[0]


def _is_python_code(module: Any) -> bool:
    """Source or bytecode (or a namespace package): a module a second import can copy."""
    if not isinstance(module, ModuleType):
        return False
    spec = getattr(module, "__spec__", None)
    if spec is None:
        return False
    origin = spec.origin
    if origin is None or origin == "namespace":
        return spec.submodule_search_locations is not None
    if origin in ("built-in", "frozen") or origin.endswith(_EXTENSION_SUFFIXES):
        return False
    return origin.endswith((".py", ".pyc", ".pyw"))


class _Finder:
    """On ``sys.meta_path`` for the length of a run: notes which imports come from the program
    (:meth:`RankModules.program_import`) and, for a rank importing a module another rank already
    has, watches its import for a process-wide registration that fails the second time."""

    def __init__(self, owner: RankModules):
        self.owner = owner
        self.local = threading.local()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if getattr(self.local, "busy", False):
            return None
        owner = self.owner
        if owner.decided.get(name) is None:
            owner.decided[name] = owner.program_import(name, sys._getframe(1))
        first = owner.first.get(name)
        if first is None or not owner.decided[name]:
            return None
        # a later rank's own import of a module the first rank has: find it as usual, and let a
        # failure fall back to the first copy (its import registers something the process has)
        self.local.busy = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        finally:
            self.local.busy = False
        loader = getattr(spec, "loader", None)
        if loader is not None and hasattr(loader, "exec_module"):
            self.watch(spec, loader, first)
        return spec

    def watch(self, spec: Any, loader: Any, first: ModuleType) -> None:
        run = loader.exec_module
        owner = self.owner
        rank = owner.current

        def exec_module(module: ModuleType) -> None:
            try:
                run(module)
            except Exception as error:
                owner.fall_back(spec.name, rank, first, error)
                sys.modules[spec.name] = first     # the import returns what sys.modules holds

        try:
            loader.exec_module = exec_module       # this spec's own loader instance
        except (AttributeError, TypeError):
            pass


class RankModules:
    """The per-rank modules of one run (see the module docstring).

    :meth:`hand_off` and :meth:`take_turn` are called by the rank holding the
    turn, ``start()`` and ``end()`` by the thread that runs the World.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        #: each rank's own modules, by name (None: none yet)
        self.mine: list[dict[str, ModuleType] | None] = [None] * world_size
        #: the first copy of each per-rank module, for a later rank whose own import fails
        self.first: dict[str, ModuleType] = {}
        #: name -> whether the program imported it (None: not seen by the finder)
        self.decided: dict[str, bool] = {}
        self.shared: set[str] = set()        # names in sys.modules that every rank shares
        self.program_modules: set[str] = set()   # names of modules whose imports count as the program's
        self.fell_back: set[str] = set()
        self.current = 0
        self.any = False                     # some rank has a module of its own
        self._expected = -1                  # len(sys.modules) when the live state was last known
        self._finder: _Finder | None = None
        self._fixups: list[tuple[str, str]] = []   # (shared child, per-rank parent)

    # -- the run's start and end ------------------------------------------------------------

    def start(self) -> None:
        """The run starts: every module imported so far stays shared, and the finder goes first in
        ``sys.meta_path``."""
        self.shared = set(sys.modules)
        self._expected = len(sys.modules)
        self._finder = _Finder(self)
        sys.meta_path.insert(0, self._finder)   # simcomm.patches: "rank-modules"

    def end(self) -> None:
        """The run has ended: its per-rank modules leave ``sys.modules`` (the caller never imported
        them), and the finder leaves ``sys.meta_path``."""
        if self._finder is not None:
            try:
                sys.meta_path.remove(self._finder)
            except ValueError:
                pass
            self._finder = None
        self._scan(self.current)
        for mine in self.mine:
            for name, module in (mine or {}).items():
                if sys.modules.get(name) is module:
                    del sys.modules[name]
        for name in self.fell_back:                # shared by the ranks, still the run's own
            if sys.modules.get(name) is self.first.get(name):
                del sys.modules[name]
        self.mine = [None] * self.world_size
        self.first.clear()
        self.fell_back.clear()
        self.any = False

    # -- turns ------------------------------------------------------------------------------

    def hand_off(self, rank: int) -> None:
        """``rank`` hands the turn on: its new modules become its own; its modules leave ``sys.modules``."""
        if len(sys.modules) != self._expected:
            self._scan(rank)
        if self.any:
            mine = self.mine[rank]
            if mine:
                modules = sys.modules
                for name, module in mine.items():
                    if modules.get(name) is module:
                        del modules[name]
            self._expected = len(sys.modules)

    def take_turn(self, rank: int) -> None:
        """``rank`` takes the turn: its own modules go into ``sys.modules``."""
        self.current = rank
        if self.any:
            mine = self.mine[rank]
            if mine:
                sys.modules.update(mine)
                for child, parent in self._fixups:
                    module = mine.get(parent)
                    if module is not None and child in sys.modules:
                        setattr(module, child.rpartition(".")[2], sys.modules[child])
            self._expected = len(sys.modules)

    def _scan(self, rank: int) -> None:
        """Sort the names ``sys.modules`` gained during ``rank``'s turn: the program's own Python
        modules become ``rank``'s, everything else is shared."""
        mine = self.mine[rank]
        shared, decided = self.shared, self.decided
        for name, module in list(sys.modules.items()):
            if name in shared or (mine is not None and name in mine):
                continue
            top = _top(name)
            if (decided.get(name) and top not in shared and top not in SHARED_TOP_LEVEL
                    and name not in self.fell_back and _is_python_code(module)):
                if mine is None:
                    mine = self.mine[rank] = {}
                mine[name] = module
                self.first.setdefault(name, module)
                self.any = True
            else:
                shared.add(name)
                parent = name.rpartition(".")[0]
                if parent and decided.get(parent) and _top(parent) not in SHARED_TOP_LEVEL:
                    self._fixups.append((name, parent))   # e.g. a package's C extension
        self._expected = len(sys.modules)

    # -- who imports ------------------------------------------------------------------------

    def program_import(self, name: str, frame: Any) -> bool:
        """Whether the import of ``name`` that ``frame`` (inside the import machinery) runs comes
        from the program: the first frame outside importlib belongs to a module that is not
        shared by definition (:data:`SHARED_TOP_LEVEL`)."""
        top = _top(name)
        if top in SHARED_TOP_LEVEL or (top != name and top in self.shared and top not in self.decided):
            return False
        while frame is not None and frame.f_code.co_filename.startswith(_IMPORT_MACHINERY):
            frame = frame.f_back
        if frame is None:
            return False
        importer = frame.f_globals.get("__name__")
        if not isinstance(importer, str):
            return False
        if importer in ("__main__", "runpy") or self.decided.get(importer):   # runpy: `-m package.module`
            return True
        return _top(importer) not in SHARED_TOP_LEVEL

    def fall_back(self, name: str, rank: int, first: ModuleType, error: BaseException) -> None:
        """``rank``'s own import of ``name`` raised where the first rank's succeeded."""
        # shared from now on: the first copy stays in sys.modules for every rank
        self.shared.add(name)
        for mine in self.mine:
            if mine is not None:
                mine.pop(name, None)
        parent = name.rpartition(".")[0]
        if parent:
            self._fixups.append((name, parent))
        if name not in self.fell_back:
            self.fell_back.add(name)
            text = str(error).split("\n")[0]
            text = text if len(text) <= 160 else text[:157] + "..."
            print(f"simcomm: rank {rank}'s own import of module {name!r} raised "
                  f"{type(error).__name__}: {text}; the first rank's import of it succeeded, so it "
                  f"registers something the process already has (a torch.library op, a backend, ...). "
                  f"Rank {rank} and later ranks use the first rank's {name!r}: its module-level state "
                  f"is shared by them", file=sys.stderr)
