"""What every exercise checker returns, and how a learner's error becomes feedback.

A checker *returns* a verdict as text and never raises for anything the
learner wrote: :data:`NOT_ANSWERED` while the placeholder (``...``, or a
function raising ``NotImplementedError``) is still there; ``"Not yet: ..."``
and a hint for a wrong, partial or malformed answer (or code that raised,
deadlocked or broke a rule of the exercise); ``"Correct ..."`` for a right
one. A verdict states the problem only; the hint (how to fix it) is a second
answer the learner asks for, by calling the checker again with
``show_hint=True`` (:func:`hint_on_request`). Every lesson's checker module
(:mod:`simcomm.lessons.lesson_00` ...) shares these.
"""
from __future__ import annotations

import copy
import dis
import functools
import math
import numbers
import re
import sys
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..errors import CollectiveMismatchError, DeadlockError, RankError
from ..reports import format_ranks

__all__ = ["NOT_ANSWERED", "HINT_OFFER", "is_correct", "not_yet", "hint_on_request", "is_placeholder",
           "as_number", "as_numbers", "as_int", "as_ints", "not_a_function", "called", "spelled_as", "keys_spelled_as", "TRAFFIC_RULE", "rank_traffic", "reduce_scatter_traffic",
           "Forbidden", "attempt", "RanksApart", "judged_apart", "shared_state_names",
           "SharedObjects", "shared_objects_verdict", "uses_helper", "helper_in_caller", "helper_verdict",
           "cheating_verdict", "judged_as_processes"]

#: what a checker returns while the exercise still holds its placeholder
NOT_ANSWERED = "Not answered yet: replace the ... (or the NotImplementedError) above, then run this cell again."


#: what replaces the hint of a ``Not yet`` verdict until the learner asks for it
HINT_OFFER = "(Stuck? Run the same check again with show_hint=True for a hint.)"


def is_correct(verdict: str) -> bool:
    """True for a checker's verdict on a right answer."""
    return verdict.startswith("Correct")


def not_yet(problem: str, hint: str | None = None) -> str:
    """The verdict on a wrong, partial or malformed answer: the problem, then a hint."""
    return f"Not yet: {problem}" + (f"\nHint: {hint}" if hint else "")


def hint_on_request(checker: Callable[..., str]) -> Callable[..., str]:
    """Give ``checker`` a keyword ``show_hint=False``: its ``Not yet`` verdict then says only what is
    wrong, and offers the hint (:data:`HINT_OFFER`); with ``show_hint=True`` it also gives the hint."""
    @functools.wraps(checker)
    def checked(*args: Any, show_hint: bool = False, **kwargs: Any) -> str:
        verdict = checker(*args, **kwargs)
        problem, marker, _ = verdict.partition("\nHint: ")
        return verdict if show_hint or not marker else f"{problem}\n{HINT_OFFER}"
    return checked


def as_number(answer: Any) -> float | None:
    """``answer`` as a float if it is one real number of any numeric type (``int``, ``float``,
    ``Fraction``, numpy scalars, 0-d and one-element tensors or arrays); ``None`` otherwise
    (``bool`` too: True/False is not a count)."""
    if isinstance(answer, bool) or getattr(answer, "dtype", None) is not None and str(answer.dtype) == "bool":
        return None
    if isinstance(answer, numbers.Real):
        return float(answer)
    if hasattr(answer, "numel") and hasattr(answer, "item"):           # torch tensors
        if answer.numel() != 1 or answer.is_complex():
            return None
        return float(answer.item())
    if hasattr(answer, "size") and hasattr(answer, "item") and hasattr(answer, "dtype"):   # numpy arrays
        if answer.size != 1 or answer.dtype.kind not in "iuf":
            return None
        return float(answer.item())
    return None


def is_placeholder(answer: Any) -> bool:
    """Not answered yet, the one rule every checker uses: the untouched ``...`` placeholder,
    alone or as a value of a dict, list or tuple. A checker answers it with
    :data:`NOT_ANSWERED`; anything else (``None`` too) is an answer, judged with a hint."""
    if answer is ...:
        return True
    values = answer.values() if isinstance(answer, dict) else answer if isinstance(answer, (list, tuple)) else ()
    return any(value is ... for value in values)


# -- reading an answer: what several lessons' checkers share ---------------------------------------

def as_numbers(value: Any, what: str) -> tuple[torch.Tensor | None, str | None]:
    """A float64 tensor of ``value`` (a number, a list of numbers or a tensor), or a verdict."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double(), None
    try:
        return torch.as_tensor(value, dtype=torch.float64), None
    except (TypeError, ValueError, RuntimeError):
        return None, not_yet(f"{what}: {value!r} is not a number or a list of numbers")


def _spelling(name: str) -> str:
    return re.sub(r"[\s\-_]+", "_", name.strip()).lower()


def spelled_as(name: Any, names: Iterable[str]) -> str | None:
    """The one of ``names`` that the string ``name`` spells, whatever its capitals, the spaces around it
    and whether its words are joined by spaces, hyphens or underscores (``"Optimizer state"`` is
    ``"optimizer_state"``); ``None`` if it spells none of them (or several)."""
    names = list(names)
    if not isinstance(name, str):
        return None
    if name in names:
        return name
    matches = [known for known in names if _spelling(known) == _spelling(name)]
    return matches[0] if len(matches) == 1 else None


def keys_spelled_as(answer: dict, names: Iterable[str]) -> dict:
    """``answer`` with every key that spells one of ``names`` (:func:`spelled_as`) written as that name;
    other keys stay as they are."""
    names = list(names)
    return {(spelled_as(key, names) or key): value for key, value in answer.items()}


def not_a_function(fn: Any, name: str) -> str | None:
    """:data:`NOT_ANSWERED` for the placeholder, a ``Not yet`` verdict naming ``name`` for an answer that
    is not a function, else ``None``."""
    if is_placeholder(fn):
        return NOT_ANSWERED
    if not callable(fn):
        return not_yet(f"{name} must be a function, got {type(fn).__name__}")
    return None


def called(function: Callable, *args: Any) -> tuple[Any, str | None]:
    """``(result, None)``, or ``(None, verdict)`` when the call raised (:func:`simcomm.lessons.verdicts.attempt`)."""
    return attempt(lambda: function(*args))


def as_int(value: Any) -> int | None:
    """One whole number of any numeric type (``int``, numpy integers, 0-d tensors, ``2.0``), else ``None``."""
    number = as_number(value)
    return int(number) if number is not None and math.isfinite(number) and number.is_integer() else None


def as_ints(value: Any) -> list[int] | None:
    """A list or tuple (or 1-d tensor or array) of whole numbers of any numeric type, else ``None``."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        return None
    ints = [as_int(v) for v in value]
    return None if any(v is None for v in ints) else ints


#: the one traffic rule, as the lessons state it (02's all-gather backward, 07's ZeRO-2 shard)
TRAFFIC_RULE = ("the backward of all-gather is a reduce-scatter, and it moves the fewest bytes: an all-reduce "
                "then a chunk has the right values but moves about twice the bytes, and a reduce to one rank "
                "then a scatter loads that rank's links")


def rank_traffic(trace: Any, rank: int, skip_first: int = 0) -> tuple[int, int]:
    """``(sent, received)``: the bytes ``rank`` sent and received in ``trace``'s forward-phase calls,
    after its first ``skip_first`` calls (a checker's own set-up collectives)."""
    calls = [e for e in trace.events if e.rank == rank and e.op != "compute"][skip_first:]
    forward = [e for e in calls if e.phase == "forward"]
    return sum(sum(e.sent.values()) for e in forward), sum(sum(e.received.values()) for e in forward)


def reduce_scatter_traffic(trace: Any, world_size: int, input_bytes: int, skip_first: int = 0) -> str | None:
    """The one traffic rule of the checkers (:data:`TRAFFIC_RULE`): ``None`` when every rank of
    ``trace`` sent and received no more than a reduce-scatter of ``input_bytes`` would,
    ``(P - 1) / P * input_bytes`` each way; otherwise the ``Not yet`` verdict naming every rank over
    that budget and how many bytes it moved. Every rank is counted: a reduce to rank 0 then a
    scatter keeps rank 0's *sent* bytes within budget while it receives ``P - 1`` whole tensors and
    the other ranks each send a whole one. Checkers judge the values first, then this."""
    budget = (world_size - 1) * input_bytes // world_size
    over: dict[str, list[int]] = {}           # what a rank moved beyond the budget -> those ranks
    for rank in range(world_size):
        sent, received = rank_traffic(trace, rank, skip_first)
        moved = " and ".join(f"{word} {count} B" for word, count in (("sent", sent), ("received", received))
                             if count > budget)
        if moved:
            over.setdefault(moved, []).append(rank)
    if not over:
        return None
    named = "; ".join(f"rank {ranks[0]} {moved}" if len(ranks) == 1 else f"ranks {format_ranks(ranks)} each {moved}"
                      for moved, ranks in over.items())
    return not_yet(f"right values, but more bytes than necessary: a reduce-scatter sends and receives {budget} B "
                   f"per rank, and {named}", TRAFFIC_RULE)


class Forbidden(Exception):
    """The learner's code used something the exercise rules out (its message is the verdict)."""


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def attempt(call: Callable[[], Any], deadlock_hint: str | None = None) -> tuple[Any, str | None]:
    """``(result, None)``, or ``(None, verdict)`` when the learner's code raised.

    The one place that recognises the placeholder (``NotImplementedError``,
    also when a rank raised it) and turns any other error into a short
    ``Not yet`` line instead of a traceback.
    """
    try:
        return call(), None
    except Exception as error:  # the learner's code: any error becomes feedback
        causes = list(_chain(error))
        if any(isinstance(cause, NotImplementedError) for cause in causes):
            return None, NOT_ANSWERED
        forbidden = next((cause for cause in causes if isinstance(cause, Forbidden)), None)
        if forbidden is not None:
            return None, not_yet(str(forbidden))
        if isinstance(error, DeadlockError):
            return None, not_yet("the ranks deadlocked: " + _summary(error), deadlock_hint)
        if isinstance(error, CollectiveMismatchError):
            return None, not_yet("the ranks called different collectives: " + _summary(error))
        where, cause = (f" on rank {error.rank}", error.__cause__ or error) if isinstance(error, RankError) \
            else ("", error)
        return None, not_yet(f"your code raised {type(cause).__name__}{where}: {_summary(cause)}")


def _summary(error: BaseException, most_lines: int = 8) -> str:
    """The first line of an error's message, and the lines it announces (a first line ending in ':',
    such as "ranks still running:" or "... none can make progress:", is followed by what it lists)."""
    lines = [line.rstrip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    if not lines[0].endswith(":"):
        return lines[0]
    listed = lines[1:most_lines + 1] + (["  ..."] if len(lines) > most_lines + 1 else [])
    return "\n".join([lines[0], *listed]) if listed else lines[0] + " (nothing listed)"


# -- ranks apart: what a learner's function does when every rank is its own process -----------

_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), range, frozenset, torch.dtype, torch.device,
              torch.Size)


def _code_names(code: types.CodeType) -> set[str]:
    """Every global name ``code`` (and the functions and comprehensions nested in it) may read or write."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _stored_globals(code: types.CodeType) -> set[str]:
    """The global names ``code`` (or code nested in it) rebinds (``global x; x = ...``)."""
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _stored_globals(const)
    return names


def _is_state(value: Any) -> bool:
    """Whether a module-level value is data a program could keep between calls (not a module, class or
    function: those are the program, not its state)."""
    return not isinstance(value, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType,
                                  types.MethodType, *_IMMUTABLE))


def shared_state_names(fn: Any) -> list[str]:
    """The Python objects through which the virtual ranks running ``fn`` could pass data to each other
    without a collective: the module-level names ``fn`` (or a function of its module it calls)
    rebinds with ``global`` or reads holding mutable data, its closure's variables holding mutable
    data, and mutable default arguments. On real processes each rank has its own copy of these."""
    names: set[str] = set()
    seen: set[int] = set()

    def visit(function: Any) -> None:
        if not isinstance(function, types.FunctionType) or id(function) in seen:
            return
        seen.add(id(function))
        code, module = function.__code__, function.__globals__
        names.update(_stored_globals(code))
        code_names = _code_names(code)
        for name in code_names:
            if name not in module:
                continue
            value = module[name]
            if isinstance(value, types.FunctionType) and value.__globals__ is module:
                names.update(f"{name}.{attribute}" for attribute, held in vars(value).items()
                             if attribute in code_names and _is_state(held))     # `f.cache = ...`
                visit(value)
            elif _is_state(value):
                names.add(name)
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if isinstance(value, types.FunctionType):
                visit(value)
            elif _is_state(value):
                names.add(name)
        for value in (function.__defaults__ or ()) + tuple((function.__kwdefaults__ or {}).values()):
            if _is_state(value) and not isinstance(value, tuple):
                names.add("a mutable default argument")
    visit(fn)
    return sorted(names)


def _copy_state(value: Any, memo: dict) -> Any:
    """``value`` deep-copied, or ``value`` itself where it cannot be copied (a thread, a lock, a world)."""
    if not _is_state(value):
        return value
    try:
        return copy.deepcopy(value, memo)
    except Exception:  # an object that cannot be copied stays shared (a world, a generator, a lock)
        return value


def _rank_copy(fn: Any, memo: dict, module_copies: dict[int, dict]) -> Any:
    """``fn`` rebuilt over its own copy of its module's state (and of the functions of that module it
    calls), its closure and its defaults: what one process would have of them."""
    if not isinstance(fn, types.FunctionType):
        return _copy_state(fn, memo)
    if id(fn) in memo:
        return memo[id(fn)]
    source = fn.__globals__
    module = module_copies.get(id(source))
    first = module is None
    if first:
        module = module_copies[id(source)] = dict(source)
    cells = tuple(types.CellType() for _ in fn.__closure__ or ())
    copied = types.FunctionType(fn.__code__, module, fn.__name__, None, cells or None)
    memo[id(fn)] = copied
    for cell, old in zip(cells, fn.__closure__ or ()):
        try:
            contents = old.cell_contents
        except ValueError:
            continue
        cell.cell_contents = _rank_copy(contents, memo, module_copies)
    copied.__defaults__ = _copy_state(fn.__defaults__, memo) if fn.__defaults__ else fn.__defaults__
    copied.__kwdefaults__ = _copy_state(fn.__kwdefaults__, memo) if fn.__kwdefaults__ else fn.__kwdefaults__
    copied.__dict__.update(_copy_state(dict(fn.__dict__), memo))
    copied.__qualname__, copied.__module__, copied.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    for name in _code_names(fn.__code__):
        if name in source and name in module and module[name] is source[name]:
            value = source[name]
            if isinstance(value, types.FunctionType) and value.__globals__ is source:
                module[name] = _rank_copy(value, memo, module_copies)
            else:
                module[name] = _copy_state(value, memo)
    return copied


class RanksApart:
    """``fn`` as it runs on real processes: each rank (thread) that calls it gets its own copy of
    the Python state ``fn`` reaches (:func:`shared_state_names`), taken when this object is made, so
    data can move between ranks only through the communicator's collectives. Made once before a
    checker's runs, it hands every rank of every run a fresh copy of that snapshot.

    What no copy can separate (attributes of modules, classes, functions and ``builtins``) is
    watched instead (:class:`SharedObjects`): a function that writes there is refused."""

    def __init__(self, fn: Any):
        self.fn = fn
        functools.update_wrapper(self, fn, updated=())
        self._template = _rank_copy(fn, {}, {})
        self._copies: dict[threading.Thread, Any] = {}
        self._lock = threading.Lock()

    def _mine(self) -> Any:
        thread = threading.current_thread()
        with self._lock:
            if thread not in self._copies:
                self._copies[thread] = _rank_copy(self._template, {}, {})
            return self._copies[thread]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._mine()(*args, **kwargs)


# -- objects no copy can give each rank: modules, classes, functions, builtins ----------------------

_PROGRAM = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
            types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType,
            types.GetSetDescriptorType, types.MemberDescriptorType, classmethod, staticmethod, property)
_LIBRARY_PREFIXES = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix})


def _string_constants(code: types.CodeType) -> set[str]:
    """The identifier-like strings ``code`` (or code nested in it) holds: attribute names a program may
    pass to ``setattr``, ``getattr`` or ``vars(...)[...]``."""
    found = {const for const in code.co_consts if isinstance(const, str) and const.isidentifier()}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _string_constants(const)
    return found


def _is_learners(function: Any) -> bool:
    """Whether ``function`` is the learner's code (a notebook cell, a module of their own), not a library
    or simcomm: only the learner's code is followed into the functions it calls."""
    if not isinstance(function, types.FunctionType):
        return False
    filename = function.__code__.co_filename
    module = function.__globals__.get("__name__") or ""
    return not (module == "simcomm" or module.startswith("simcomm.") or filename.startswith("<frozen")
                or any(filename.startswith(prefix) for prefix in _LIBRARY_PREFIXES))


def _reached(fn: Any) -> tuple[set[str], dict[int, Any]]:
    """The names the learner's function ``fn`` may use as attribute names (its code's names and string
    constants, and those of the learner's functions and methods it reaches), and the modules, classes
    and functions it reaches by those names (whose every attribute it could write)."""
    names: set[str] = set()
    holders: dict[int, Any] = {}
    seen: set[int] = set()

    def reach(value: Any, attributes: set[str] = frozenset()) -> None:
        if isinstance(value, types.MethodType):
            value = value.__func__
        if isinstance(value, (types.ModuleType, type, types.FunctionType)):
            if id(value) in holders:
                return
            holders[id(value)] = value
        if isinstance(value, types.ModuleType):   # `helper.record(...)`, `argparse.Namespace`, `torch.nn.x`
            for attribute in attributes & set(vars(value)):
                reach(vars(value)[attribute], attributes)
        if isinstance(value, type) and id(value) not in seen:
            seen.add(id(value))
            for member in list(vars(value).values()):
                member = getattr(member, "__func__", member)
                if _is_learners(member):
                    visit(member)
        if _is_learners(value):
            visit(value)

    def visit(function: types.FunctionType) -> None:
        if id(function) in seen:
            return
        seen.add(id(function))
        code = function.__code__
        own = _code_names(code) | _string_constants(code)
        names.update(own)
        module = sys.modules.get(function.__globals__.get("__name__", ""))
        if module is not None and vars(module) is function.__globals__:   # the module the function writes with `global`
            reach(module)
        namespace = dict(function.__globals__)
        for name, cell in zip(code.co_freevars, function.__closure__ or ()):
            try:
                namespace[name] = cell.cell_contents
            except ValueError:
                continue
        for name in own | set(code.co_freevars):
            if name not in namespace:
                continue
            value = namespace[name]
            reach(value, own)
        for value in (function.__defaults__ or ()) + tuple((function.__kwdefaults__ or {}).values()):
            reach(value)

    reach(getattr(fn, "__func__", fn))
    return names, holders


def _fingerprint(value: Any, depth: int = 3) -> Any:
    """What a write to ``value`` would change: ``None`` for the program (modules, classes, functions),
    else its identity, and for containers (to ``depth`` levels) and tensors what they hold."""
    if isinstance(value, _PROGRAM):
        return None
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if depth and isinstance(value, (list, tuple)):
        return (id(value), tuple(_fingerprint(item, depth - 1) for item in value))
    if depth and isinstance(value, (set, frozenset)):
        return (id(value), frozenset(id(item) for item in value))
    if depth and isinstance(value, dict):
        return (id(value), tuple((id(key), _fingerprint(item, depth - 1)) for key, item in value.items()))
    if depth and isinstance(value, types.SimpleNamespace):
        return (id(value), _fingerprint(vars(value), depth - 1))
    return (id(value),)


class SharedObjects:
    """The attributes a learner's function could use to pass data between virtual ranks without a
    collective, because all the ranks (threads of one process) share the objects that hold them and
    no per-rank copy can separate them: attributes of the loaded modules (an imported module,
    ``builtins``, ``sys.modules["__main__"]``) and of the classes and functions the function reaches
    (class attributes, ``f.cache = ...``). Watched: every attribute of the modules, classes and
    functions the function names (also through attributes, ``torch.nn.x``), of the modules its own
    functions live in, of ``builtins`` and of ``__main__``; the values under the names its code
    uses are followed into the lists, dicts and sets they hold. Made before a checker runs the function,
    :meth:`written` then names those that were bound, rebound or changed in place: on real processes
    each rank would have written its own copy, and no other rank would have seen it. (A module the
    function reaches only through a name built at run time escapes the watch.)"""

    def __init__(self, fn: Any):
        self._names, reached = _reached(fn)
        for always in (sys.modules.get("builtins"), sys.modules.get("__main__")):
            if always is not None:
                reached.setdefault(id(always), always)
        self._holders = [holder for holder in reached.values()
                         if isinstance(getattr(holder, "__dict__", None), (dict, types.MappingProxyType))]
        self._before = self._snapshot()

    def _snapshot(self) -> dict[tuple[int, str], Any]:
        prints = {}
        with warnings.catch_warnings():     # a deprecated attribute warns when its class is read
            warnings.simplefilter("ignore")
            for holder in self._holders:
                for name, value in list(vars(holder).items()):
                    prints[id(holder), name] = _fingerprint(value, 3 if name in self._names else 0)
        return prints

    def written(self) -> list[str]:
        """``holder.name`` for every watched attribute that was bound, rebound or changed since."""
        after = self._snapshot()
        changed = {key for key in set(self._before) | set(after) if self._before.get(key) != after.get(key)}
        labels = set()
        for holder in self._holders:
            for key, name in changed:
                if key == id(holder):
                    owner = holder.__name__ if isinstance(holder, types.ModuleType) else holder.__qualname__
                    labels.add(f"{owner}.{name}")
        return sorted(labels)


def shared_objects_verdict(written: list[str]) -> str:
    """The verdict on a function that kept data on objects every virtual rank shares."""
    return not_yet(f"your function keeps data on {', '.join(written)}, which all the virtual ranks share: they "
                   "are threads of one process, so one rank can read what another stored there, but real "
                   "processes each have their own copy, and there no other rank would see it",
                   "a value another rank needs must travel in a collective (all_reduce, all_gather, "
                   "broadcast, send/recv); keep a rank's own data in local variables; comm.barrier() only "
                   "waits, it moves no data")


def _same_verdict(one: str, other: str) -> bool:
    """Whether two verdicts on the same function say the same, but for the objects' addresses."""
    address = re.compile(r"0x[0-9a-fA-F]+")
    return address.sub("0x", one) == address.sub("0x", other)


def judged_apart(fn: Any, judge: Callable[[Any], str | None]) -> str | None:
    """Judge a learner's distributed function by what it does on real processes.

    ``judge(f)`` runs the checker's cases with ``f`` as the learner's function and returns ``None``
    if all pass, else the verdict. ``fn`` is judged as :class:`RanksApart` (each rank its own Python
    state). Only when that fails is it run once more as the virtual ranks share one process: if it
    passes there, or fails otherwise while it reaches Python state (:func:`shared_state_names`), the
    verdict names the mistake, data passed between ranks through Python objects. A function that
    writes attributes of objects no copy separates (:class:`SharedObjects`) is refused, naming them."""
    watch = SharedObjects(fn)
    apart = RanksApart(fn)
    verdict = judge(apart)
    written = watch.written()
    if written and verdict != NOT_ANSWERED:
        return shared_objects_verdict(written)
    if verdict is None or verdict == NOT_ANSWERED:
        return verdict
    shared = judge(fn)
    if shared is not None and (_same_verdict(shared, verdict) or not shared_state_names(fn)):
        return verdict
    return cheating_verdict(fn, verdict)


# -- the lesson's own helpers are not an answer --------------------------------------------------

def _imported_modules(code: types.CodeType) -> set[str]:
    """The modules ``code`` (or code nested in it) imports (``import x.y``, ``from x.y import z``)."""
    found = {ins.argval for ins in dis.get_instructions(code) if ins.opname == "IMPORT_NAME"}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _imported_modules(const)
    return found


def _refers_to(code: types.CodeType, namespace: dict, helpers: tuple, seen: set[int],
               extra_names: set[str] = frozenset()) -> Any:
    """The helper among ``helpers`` that ``code`` reaches through ``namespace`` (directly, as an
    attribute of a module it names, or through a function of the same namespace), or ``None``."""
    names = _code_names(code) | extra_names
    imported = _imported_modules(code)
    for helper in helpers:                    # imported inside the function: `from ... import ...`
        module = getattr(helper, "__module__", "")
        if getattr(helper, "__name__", None) in names and (
                module in imported or module.rpartition(".")[2] in names and module.rpartition(".")[0] in imported):
            return helper
    for name in names:
        if name not in namespace:
            continue
        value = namespace[name]
        if any(value is helper for helper in helpers):
            return value
        if isinstance(value, types.ModuleType):
            for helper in helpers:
                if getattr(helper, "__name__", None) in names and getattr(value, helper.__name__, None) is helper:
                    return helper
        if isinstance(value, types.FunctionType) and id(value) not in seen:
            seen.add(id(value))
            found = _refers_to(value.__code__, value.__globals__, helpers, seen)
            if found is not None:
                return found
    return None


def uses_helper(fn: Any, *helpers: Any) -> Any:
    """The helper among ``helpers`` (the lesson's library functions that compute an exercise's answer)
    that the learner's function ``fn`` calls, or ``None``."""
    if not isinstance(fn, types.FunctionType):
        return None
    closure = {}
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            closure[name] = cell.cell_contents
        except ValueError:
            continue
    return _refers_to(fn.__code__, {**fn.__globals__, **closure}, helpers, {id(fn)},
                      extra_names=set(fn.__code__.co_freevars))     # closure variables read like globals


def helper_in_caller(*helpers: Any) -> Any:
    """The helper among ``helpers`` that the code calling the checker (the learner's cell: the first
    frame outside :mod:`simcomm.lessons`) refers to, or ``None``. A value the learner computed with the
    lesson's helper is the helper's answer, not the learner's."""
    frame = sys._getframe(1)
    try:
        while frame is not None and (frame.f_globals.get("__name__", "").startswith("simcomm.lessons")
                                     or frame.f_code.co_filename == functools.__file__):
            frame = frame.f_back
        if frame is None:
            return None
        return _refers_to(frame.f_code, {**frame.f_globals, **frame.f_locals}, helpers, set())
    finally:
        del frame


def helper_verdict(helper: Any, what: str) -> str:
    """The verdict on an answer computed by the lesson's own ``helper``."""
    name = f"{helper.__module__.rpartition('.')[2]}.{helper.__name__}"
    return not_yet(f"{name} is the lesson's own answer, not yours: the exercise asks you to work out {what} "
                   f"without it", f"write the computation out from what the lesson showed; {name} is there to "
                   "check you, after you have answered")


def cheating_verdict(fn: Any, verdict: str) -> str:
    """The verdict on a function that passes on virtual ranks only because they share Python objects:
    ``verdict`` is what it gets when each rank has its own (as on real processes)."""
    names = shared_state_names(fn)
    through = f" ({', '.join(names)})" if names else ""
    problem = verdict.removeprefix("Not yet: ").partition("\nHint: ")[0]
    return not_yet(f"your function passes data from rank to rank through Python objects{through}, not "
                   "through a collective: virtual ranks are threads of one process and see each other's "
                   "objects, but real processes each have their own copy, and there it fails: " + problem,
                   "a value another rank needs must travel in a collective (all_reduce, all_gather, "
                   "broadcast, send/recv); comm.barrier() only waits, it moves no data")


def judged_as_processes(checker: Callable[..., str]) -> Callable[..., str]:
    """Make ``checker`` (whose first argument is the learner's distributed function) judge that function
    as real processes would run it: it gets :class:`RanksApart` of the function. Only a failing
    verdict costs a second run, with the function as the threads share it: if that one passes, or
    fails otherwise while the function reaches Python state, the verdict names the mistake
    (:func:`cheating_verdict`). A function that writes attributes of objects no copy separates
    (:class:`SharedObjects`) is refused, naming them. Apply it under :func:`hint_on_request`."""
    @functools.wraps(checker)
    def judged(fn: Any, *args: Any, **kwargs: Any) -> str:
        if is_placeholder(fn):
            return NOT_ANSWERED
        if not callable(fn):
            own = checker(fn, *args, **kwargs)                # the checker's own words, unless it crashed
            return own if own.startswith("Not yet: ") and " raised " not in own else \
                not_yet(f"give a function (def ...); got {type(fn).__name__} {fn!r:.60}")
        watch = SharedObjects(fn)
        verdict = checker(RanksApart(fn), *args, **kwargs)
        written = watch.written()
        if written and verdict != NOT_ANSWERED:
            return shared_objects_verdict(written)
        if is_correct(verdict) or verdict == NOT_ANSWERED:
            return verdict
        shared = checker(fn, *args, **kwargs)
        if not is_correct(shared) and (_same_verdict(shared, verdict) or not shared_state_names(fn)):
            return verdict
        return cheating_verdict(fn, verdict)
    return judged
