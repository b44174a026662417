"""Per-rank global hooks: a module or optimizer hook registered by a rank applies to that rank.

torch keeps its *global* hooks in module-level dicts of
``torch.nn.modules.module`` (``register_module_forward_pre_hook``,
``register_module_forward_hook``, ``register_module_full_backward_hook``,
``register_module_full_backward_pre_hook``, the buffer, module and parameter
registration hooks, the ``_global_*`` dicts they write, and the
``_global_is_full_backward_hook`` flag) and of ``torch.optim.optimizer``
(``register_optimizer_step_pre_hook``/``_post_hook``). Every process of a
torchrun run has its own; virtual ranks are threads of one process, so
without this module a hook registered by rank 0 would fire for rank 1's
modules too. Module trackers are built on them: ``CommDebugMode``'s per-module
counts and torch's ``ModTracker``, ``MemTracker``, ``FSDPMemTracker``; on
shared dicts rank 1's forward entered rank 0's tracker ("The Module hierarchy
tracking is wrong").

Since the ranks take turns, the dicts are swapped at each turn handoff
(:class:`RankHooks`, called by :class:`simcomm.sim.process_state.RankProcessState`;
the ``rank-hooks`` row of :mod:`simcomm.patches`): a run starts with one
*shared* set of empty dicts in place of the caller's, and the first rank
whose turn leaves something in them keeps that set as its own (the
``RemovableHandle`` a registration returns refers to the dict it was put in,
so it removes the hook from the rank's own dict whoever holds the turn); the
other ranks go on with a new empty set. From then on each handoff to a rank
whose set is not the live one puts the rank's set in (twelve attribute
assignments). A caller that holds global hooks of its own when the run starts
gives each rank a copy of them in its first turn, as each process of a real
run would have registered them itself. The caller's dicts are put back after
the run, untouched.

**Cost.** A program that registers no global hook pays one truthiness test of
nine dicts and one identity test per handoff (about 0.2 us with the calls). One
that does pays twelve assignments at each handoff between ranks whose sets
differ (``python benchmarks/launch_script.py``: its handoff table has the
cases "without global hooks" and "each rank with a global hook").

What it cannot cover: threads a rank starts itself, and threads no rank
started, see the hooks of whichever rank holds the turn.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch.nn.modules.module as _module
import torch.optim.optimizer as _optimizer

__all__ = ["RankHooks", "HOOK_DICTS"]

#: the module globals holding global hooks: (module, name); the first nine are those a registration
#: writes first (the other three are written only together with one of them)
HOOK_DICTS: tuple[tuple[Any, str], ...] = (
    (_module, "_global_forward_pre_hooks"),
    (_module, "_global_forward_hooks"),
    (_module, "_global_backward_pre_hooks"),
    (_module, "_global_backward_hooks"),
    (_module, "_global_buffer_registration_hooks"),
    (_module, "_global_module_registration_hooks"),
    (_module, "_global_parameter_registration_hooks"),
    (_optimizer, "_global_optimizer_pre_hooks"),
    (_optimizer, "_global_optimizer_post_hooks"),
    (_module, "_global_forward_hooks_always_called"),
    (_module, "_global_forward_hooks_with_kwargs"),
)
_WRITTEN_FIRST = 9
_FLAG = "_global_is_full_backward_hook"     # a bool (or None) in torch.nn.modules.module


def _live() -> tuple:
    return tuple(getattr(module, name) for module, name in HOOK_DICTS)


def _fresh(like: tuple | None = None) -> tuple:
    """A new set of hook dicts, empty or a copy of ``like``."""
    if like is None:
        return tuple(OrderedDict() for _ in HOOK_DICTS)
    return tuple(OrderedDict(each) for each in like)


def _install(dicts: tuple, flag: Any) -> None:
    for (module, name), each in zip(HOOK_DICTS, dicts):   # simcomm.patches: "rank-hooks"
        if module is _module:
            setattr(_module, name, each)
        else:
            setattr(_optimizer, name, each)
    if getattr(_module, _FLAG) is not flag:
        _module._global_is_full_backward_hook = flag


class RankHooks:
    """The global hooks of one run's ranks (see the module docstring); called by a rank's own
    thread while it holds the turn, so no lock is needed."""

    def __init__(self, world_size: int):
        #: each rank's own set of dicts and its backward-hook flag (None: the rank has none of its
        #: own and uses the shared set)
        self.own: list[tuple | None] = [None] * world_size
        self.flags: list[Any] = [None] * world_size
        self.shared: tuple = ()
        self.written_first: tuple = ()
        self.live: tuple = ()
        self.caller: tuple | None = None
        self.caller_flag: Any = None
        self.copy_caller = False           # the caller holds global hooks: each rank starts with a copy

    def start(self) -> None:
        """Before the run: keep the caller's hooks and put a shared empty set in their place."""
        self.caller, self.caller_flag = _live(), getattr(_module, _FLAG)
        self.copy_caller = any(self.caller[:_WRITTEN_FIRST])
        self._share(_fresh())
        self.live = self.shared
        _install(self.shared, None)

    def _share(self, dicts: tuple) -> None:
        self.shared = dicts
        self.written_first = dicts[:_WRITTEN_FIRST]   # what a registration writes into

    def hand_off(self, rank: int) -> None:
        """``rank`` hands the turn on; if it registered into the shared set, the set is its own now."""
        live = self.live
        if live is self.shared:
            if not any(self.written_first):
                return
            self.own[rank] = live
            self._share(_fresh())
        self.flags[rank] = getattr(_module, _FLAG)

    def take_turn(self, rank: int) -> None:
        """``rank`` takes the turn: make its hooks the live ones."""
        own = self.own[rank]
        if own is None:
            if self.copy_caller:
                own = self.own[rank] = _fresh(self.caller)     # the caller's hooks, a copy of its own
                self.flags[rank] = self.caller_flag
            else:
                own = self.shared
        if own is not self.live:
            _install(own, self.flags[rank] if own is not self.shared else None)
            self.live = own

    def end(self) -> None:
        """After the run: the caller's hooks, as they were."""
        if self.caller is not None:
            _install(self.caller, self.caller_flag)
            self.caller = None
        self.live = ()
