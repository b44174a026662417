"""Python's warnings state per virtual rank.

The ``warnings`` module keeps its state once per process: the filter list
(``warnings.filters``, changed by ``simplefilter``/``filterwarnings`` and by
``catch_warnings``), where shown warnings go (``warnings.showwarning`` and
``warnings._showwarnmsg_impl``, which ``catch_warnings(record=True)`` points at
its list), the default action and the ``"once"`` registry, and in each module's
globals a ``__warningregistry__`` of the warnings already shown from there
(``"default"`` shows a warning once per location). Under torchrun each rank is
a process with its own; on virtual ranks one rank's ``catch_warnings`` would
record, or silence, another rank's warnings, and a warning shown by one rank
would not be shown by the next.

:class:`RankWarnings` gives each rank its own (the ``rank-warnings`` row of
:mod:`simcomm.patches`), swapped at the turn handoff as the rest of a rank's
process state. It costs nothing until the program touches warnings: two
wrappers, installed for the run, count what changes the state
(``warnings._filters_mutated``, which every change of the filters calls, and
``warnings._showwarnmsg``, through which every shown warning passes). While the
count stands still a handoff compares one integer. Once it moved, each rank has
its own filter list (a copy of the caller's, made in its first turn), its own
``showwarning``/``_showwarnmsg_impl``/default action/``"once"`` registry, and,
for each module from which a warning was shown during the run, its own
``__warningregistry__``. The caller's state is put back when the run ends.

What stays shared: the version number the interpreter keeps for the filters
(every registry is stale once any filter list changes), so a rank that
changes its filters (``catch_warnings`` does on entry and exit) also makes
the other ranks show a ``"default"`` warning once more; when ranks whose filter
lists differ hand over, the version moves on too (a registry written under one
rank's filters, an ``"ignore"`` included, must not hide another rank's
warning). Registries of modules from which no warning was shown during the
run stay shared, and a module's registry is attributed by the frame the
warning names (a warning made with ``warn_explicit`` and a registry of its own
keeps that registry).
"""
from __future__ import annotations

import sys
import threading
import warnings
from typing import Any

__all__ = ["RankWarnings"]

_REGISTRY = "__warningregistry__"

#: the interpreter's own functions, taken at import
_filters_mutated = warnings._filters_mutated
_showwarnmsg = warnings._showwarnmsg

#: how many times, since the process started, a rank changed or used the warnings state while
#: the wrappers were installed (a rank's handoff compares it with what it saw)
_events = 0
#: how many of those changed a filter list (the comparisons of two ranks' lists hold until it moves)
_filter_changes = 0
#: the module globals from which a warning was shown while the wrappers were installed
_shown_from: dict[int, dict] = {}
_installs = 0
_install_lock = threading.Lock()


#: the runs whose ranks have warnings states now
_runs: set = set()


def _counted_filters_mutated() -> None:
    """``warnings._filters_mutated`` while a run is on: counted, then the interpreter's own.

    A filter added while a module is imported (``warnings._add_filter`` called from a module
    body that importlib runs: sympy's, a library's) is added to every rank's filters: the
    module is imported once for the process, where each torchrun process imports it."""
    global _events, _filter_changes
    _events += 1
    _filter_changes += 1
    caller = sys._getframe(1)
    if caller.f_code.co_name == "_add_filter" and caller.f_globals is vars(warnings):
        item, append = caller.f_locals.get("item"), caller.f_locals.get("append")
        frame = caller.f_back
        while frame is not None and frame.f_code.co_filename != "<frozen importlib._bootstrap>":
            frame = frame.f_back
        if item is not None and frame is not None:
            for run in list(_runs):
                run.add_everywhere(item, bool(append))
        del frame
    del caller
    _filters_mutated()


def _noted_showwarnmsg(msg: Any) -> None:
    """``warnings._showwarnmsg`` while a run is on: note the module globals whose registry the
    warning was written to (the frame at the file and line the warning names), then show it."""
    global _events
    _events += 1
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_lineno == msg.lineno and frame.f_code.co_filename == msg.filename:
            _shown_from.setdefault(id(frame.f_globals), frame.f_globals)
            break
        frame = frame.f_back
    del frame
    _showwarnmsg(msg)


def _install() -> None:
    global _installs
    with _install_lock:
        if _installs == 0:
            warnings._filters_mutated = _counted_filters_mutated   # simcomm.patches: "rank-warnings"
            warnings._showwarnmsg = _noted_showwarnmsg
        _installs += 1


def _uninstall() -> None:
    global _installs
    with _install_lock:
        _installs -= 1
        if _installs == 0:
            warnings._filters_mutated = _filters_mutated
            warnings._showwarnmsg = _showwarnmsg
            _shown_from.clear()


def _live() -> tuple:
    return (warnings.filters, warnings.showwarning, warnings._showwarnmsg_impl, warnings._defaultaction,
            warnings._onceregistry)


def _make_live(state: tuple) -> None:
    (warnings.filters, warnings.showwarning, warnings._showwarnmsg_impl, warnings._defaultaction,
     warnings._onceregistry) = state


class RankWarnings:
    """The warnings state of each rank of one run (see the module docstring).

    :meth:`hand_off` and :meth:`take_turn` are called by a rank's own thread while it holds the
    turn; :meth:`start` before the run's ranks start, :meth:`end` after they ended.
    """

    def __init__(self, world_size: int):
        #: each rank's (filters, showwarning, _showwarnmsg_impl, _defaultaction, _onceregistry), None
        #: until its first turn after the state was first touched
        self.states: list[tuple | None] = [None] * world_size
        #: each rank's registry of each module the run showed a warning from (by id of its globals)
        self.registries: list[dict[int, dict]] = [{} for _ in range(world_size)]
        #: whether some rank touched the warnings state during the run (until then all share it)
        self.active = False
        self._seen = 0
        self._caller: tuple | None = None
        self._caller_filters: list = []
        self._caller_registries: dict[int, tuple[dict, Any]] = {}
        self._started = False
        self._comparisons: dict[tuple[int, int], bool] = {}
        self._compared_at = -1

    def start(self) -> None:
        """Before the run: remember the caller's state, count from now."""
        _install()
        self._started = True
        self._seen = _events
        self._caller = _live()
        self._caller_filters = list(warnings.filters)
        _runs.add(self)

    def add_everywhere(self, item: tuple, append: bool) -> None:
        """A filter a module's import added to the live list: add it to every rank's list too
        (as ``warnings._add_filter`` adds it) and to the caller's."""
        live = warnings.filters
        for filters in [self._caller_filters] + [state[0] for state in self.states if state is not None]:
            if filters is live:
                continue
            if not append:
                if item in filters:
                    filters.remove(item)
                filters.insert(0, item)
            elif item not in filters:
                filters.append(item)

    def hand_off(self, rank: int) -> None:
        """``rank`` hands the turn on: keep its warnings state (nothing while none was touched)."""
        if not self.active:
            if _events == self._seen:
                return
            self.active = True
        self.states[rank] = _live()
        mine = self.registries[rank]
        for key, module_globals in list(_shown_from.items()):
            registry = module_globals.get(_REGISTRY)
            if key not in self._caller_registries:      # the first rank showing a warning from there
                self._caller_registries[key] = (module_globals, dict(registry) if registry is not None else None)
            if registry is not None:
                mine[key] = registry

    def take_turn(self, rank: int) -> None:
        """``rank`` takes the turn: make its warnings state the live one."""
        if not self.active:
            return
        state = self.states[rank]
        if state is None:     # its first turn since the state was touched: a copy of the caller's
            caller = self._caller
            state = self.states[rank] = (list(self._caller_filters), caller[1], caller[2], caller[3], {})
        live_filters = warnings.filters
        _make_live(state)
        if state[0] is not live_filters and self._differ(state[0], live_filters):
            _filters_mutated()         # registries written under other filters are stale
        mine = self.registries[rank]
        for key, module_globals in list(_shown_from.items()):
            registry = mine.get(key)
            if registry is None:
                registry = mine[key] = {}
            if module_globals.get(_REGISTRY) is not registry:
                module_globals[_REGISTRY] = registry

    def _differ(self, mine: list, live: list) -> bool:
        """Whether two ranks' filter lists differ (remembered until a filter list changes)."""
        if self._compared_at != _filter_changes:
            self._comparisons.clear()
            self._compared_at = _filter_changes
        key = (id(mine), id(live)) if id(mine) < id(live) else (id(live), id(mine))
        differ = self._comparisons.get(key)
        if differ is None:
            differ = self._comparisons[key] = mine != live
        return differ

    def end(self) -> None:
        """After the run: the caller's state as it was before it (also after an error)."""
        if not self._started:
            return
        self._started = False
        _runs.discard(self)
        try:
            caller_filters = self._caller[0]
            if self.active or _events != self._seen or warnings.filters is not caller_filters:
                if caller_filters != self._caller_filters:    # a rank changed the caller's list in place
                    caller_filters[:] = self._caller_filters
                _make_live(self._caller)
                _filters_mutated()
            for key, (module_globals, registry) in self._caller_registries.items():
                if registry is None:
                    module_globals.pop(_REGISTRY, None)
                else:
                    module_globals[_REGISTRY] = registry
        finally:
            _uninstall()
