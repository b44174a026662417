"""Checked mode: every rank's call is compared with its peers' before any data moves.

Both the communicator's calls and the program's ``torch.distributed`` calls
are checked: on a real worker c10d's default group is a process group over
this transport (:mod:`real.checked_pg`), so ``dist.*``, DDP, FSDP2, DTensor
and the functional collectives reach the same primitives as ``comm.*``.

On real processes a mismatched collective is silent or slow: gloo returns
wrong data for a MAX on one rank and a SUM on another, a ``recv`` larger than
the ``send`` gets trailing garbage, one of another dtype gets raw bits, and
other mismatches end in a timeout. :class:`CheckedTransport` wraps a transport
(:class:`real.transport.DistTransport`) and, before each primitive runs,
compares what every rank of the group is about to do:

* a collective: its name, the tensor's shape and dtype, its root (``src``/``dst``)
  and reduction, and its other arguments (``dim``, ``groups`` ...); for
  an uneven all-to-all, that what rank i sends to rank j is what j expects
  from i (each collective's fields are its row's of :data:`simcomm.specs.SPECS`);
* a point-to-point pair: the shape and dtype of the n-th send from i to j and
  of the n-th recv on j from i.

A disagreement raises :class:`simcomm.CollectiveMismatchError` on every rank
involved, naming the ranks, their calls and their program lines, as the
simulator does; nothing has moved yet, so the process groups stay usable. A
rank waiting for a call that a peer never makes because its program returned
gets :class:`simcomm.DeadlockError` naming both, instead of a timeout; and
each rank notes what it is about to wait for (``w/<rank>``), so the parent
finds ranks that wait on each other (:func:`~real.checked_store.find_deadlock`) and raises
:class:`simcomm.DeadlockError` too.

How: each rank writes its call (pickled, with its program line) under a key
of a ``torch.distributed`` store and reads its peers' keys (a set and a
multi-get: about 0.1-0.2 ms on loopback, cheaper than an extra gloo
all-gather, which is what ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s
``ProcessGroupWrapper`` does: its fingerprint holds the op, shapes and dtypes
but not the root, the reduction, the program line or point-to-point calls).

The wrapper intercepts primitives by name through
:data:`~real.checked_calls.EXTRACTORS`, a table
of functions with the primitive's signature that return what to compare.
Names not in the table (``compute``, attributes, primitives added later) pass
through unchanged; a call whose arguments do not fit its extractor runs
unchecked. Consequences to know: a blocking ``send`` waits until its ``recv``
is posted (as on the simulator). An ``async_op=True`` collective, an
``isend``/``irecv`` and a ``batch_isend_irecv`` return at once: the check
completes on a thread of its own (with a store connection of its own), which
issues the call to the backend once the other ranks agree, so the program's
computation and its other groups go on as unchecked, and a mismatch moves no
data (both sides raise it in ``wait()``). A group's collectives, and a
channel's point-to-point calls, reach the backend in the program's order.
Such a call's input tensors are copied when the program makes the call, on its
own thread (``_taken_now``): the program may change or free its tensor at
once, as with an unchecked call, and the backend still gets what it passed;
the copies count on the rank (:mod:`simcomm.memory`) until the program waits,
as an unchecked call's copy does.

Three modules: :mod:`real.checked_calls` (what a call is compared on, the
table), :mod:`real.checked_store` (the comparisons through the store, the
deadlock finder) and this one (the wrapper and its deferred asynchronous calls).
"""
from __future__ import annotations

import contextlib
import copy
import sys
import threading
import time
from collections.abc import Sequence

import torch

from simcomm import memory
from simcomm.handles import Handle
from simcomm.reports import program_location
from simcomm.trace import current_phase, issued_as

from .checked_calls import EXTRACTORS, Call, batch_op_name, batch_op_tensor, describe
from .checked_store import Checker, group_key
from .call_memory import RELEASE_WAIT_S
from .dist_work import issuing_deferred
from .groups import GroupCache

__all__ = ["CheckedTransport"]


# -- the wrapper ----------------------------------------------------------------------------

class CheckedTransport:
    """``inner`` (a transport), with every primitive named in :data:`~real.checked_calls.EXTRACTORS`
    checked first.

    Everything else (attributes, ``compute``, unknown primitives) is ``inner``'s,
    unchanged. ``subgroup`` returns a checked transport of the subgroup.
    """

    def __init__(self, inner, checker: Checker):
        self._inner = inner
        self._checker = checker

    def __repr__(self) -> str:
        return f"CheckedTransport({self._inner!r})"

    @property
    def inner(self):
        """The transport that moves the data."""
        return self._inner

    @property
    def checker(self) -> Checker:
        """What compares this transport's calls with the peers' (shared by its subgroups)."""
        return self._checker

    def local_subgroup(self, part):
        """The inner transport's :meth:`~real.transport.DistTransport.local_subgroup`, checked."""
        out = self._inner.local_subgroup(part)
        self._checker.add_group(out)
        return CheckedTransport(out, self._checker)

    def __getattr__(self, name: str):
        if name in ("_inner", "_checker"):       # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        value = getattr(self._inner, name)
        extractor = EXTRACTORS.get(name)
        if extractor is None or not callable(value):
            return value

        def checked(*args, **kwargs):
            return self._call(name, value, extractor, args, kwargs)

        return checked

    def _call(self, name: str, method, extractor, args: tuple, kwargs: dict):
        try:
            calls = extractor(*args, **kwargs)
        except (TypeError, AttributeError):
            calls = None                         # a signature the table does not know: unchecked
        inner = self._inner
        if not calls or inner.world_size == 1:
            return method(*args, **kwargs)
        location = program_location(sys._getframe(2))
        if calls[0].kind == "collective":
            if kwargs.get("async_op", False):
                return self._deferred(name, method, args, kwargs, calls[0], location)
            self._checker.after_issued(inner)      # the group's earlier async calls go first
            self._checker.collective(inner, calls[0], location)
            out = method(*args, **kwargs)
            if name != "subgroup":
                return out
            self._checker.add_group(out)
            return CheckedTransport(out, self._checker)
        blocking = name in ("send", "recv") and not kwargs.get("async_op", False)
        posted = [self._checker.post(inner, call, location, blocking) if call.peer != inner.rank else None
                  for call in calls]
        checked = [item for item in posted if item is not None]
        if blocking:                             # both sides agree before data moves
            for item in checked:
                self._checker.after_issued(item.channel)   # the channel's earlier isend/irecv first
                self._checker.finish(item)
            return method(*args, **kwargs)
        # isend/irecv/batch: checked on a thread, issued once the other sides agree, so a
        # mismatched pair moves nothing and leaves both processes fit for the next run
        checker = self._checker
        previous = [checker.last_issue[item.channel] for item in checked if item.channel in checker.last_issue]
        args, kwargs, kept = _taken_now(inner, name, args, kwargs)
        issue = lambda: method(*args, **kwargs)   # noqa: E731

        def check(view: Checker) -> None:
            for item in checked:
                view.finish(item)

        if name == "batch_isend_irecv":
            check, issue = _op_by_op(method, args[0], kwargs, posted)
        work = _Deferred(checker, check, previous, issue,
                         lambda: checker.announce_pair(checked[0]) if checked else None,
                         _pending_of(inner), (" + ".join(describe(call) for call in calls), location), kept)
        for item in checked:
            checker.last_issue[item.channel] = work
        if name == "batch_isend_irecv":
            return [Handle(_Part(work, index)) for index in range(len(calls))]
        return Handle(work)


class _Deferred:
    """An async call whose check completes on a thread of its own, which then issues it.

    The program goes on at once, as with an unchecked ``async_op=True`` call: a rank may
    issue async collectives of two groups in an order another rank does not, and the data
    still moves only once every rank of the group has issued the same call (for
    ``isend``/``irecv``: once the other side has posted a matching call). Calls of one group
    (of one point-to-point channel) keep the program's order: each is issued after the
    ones ``previous`` names.

    ``check(checker)`` runs on the thread with a checker of its own store connection;
    ``issue()`` then makes the call; ``announce()`` writes the waiting record when the
    program waits before the call is issued. ``kept``: the copies ``_taken_now`` made of the
    call's inputs (one entry per op of a batch), held until the program waits on the call, so
    they are freed at that wait, as an unchecked call's are, and not whenever the thread
    happens to issue the call.
    """

    def __init__(self, checker: Checker, check, previous: Sequence[_Deferred], issue, announce,
                 pending: dict | None = None, what: tuple[str, str] | None = None,
                 kept: list | None = None):
        self._checker, self._check = checker, check
        self.kept = kept if kept is not None else []   # the call's copies of its inputs, until the wait
        self._pending = pending
        if pending is not None:              # unwaited until the program waits (GroupCache.pending)
            pending[id(self)] = what
        self._previous, self._issue, self._announce = list(previous), issue, announce
        self.issued = threading.Event()
        self._issued_as = (current_phase(), time.perf_counter())   # traced as the program issued it
        self.handle = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="simcomm-checked-call", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for earlier in self._previous:
                earlier.issued.wait()
            with self._checker.own_client() as checker:
                self._check(checker)
            with issuing_deferred(), issued_as(*self._issued_as):
                self.handle = self._issue()
        except BaseException as error:     # raised again by wait()
            self._error = error
        finally:
            # the call's arguments (a send's tensor) are the backend's now: this object, which the
            # checker keeps as the channel's last issue, must not keep them alive
            self._previous, self._issue, self._check = [], None, None
            self.issued.set()

    def join(self) -> None:
        """Block until the call is issued (or its check failed: raise that)."""
        if self._pending is not None:
            self._pending.pop(id(self), None)
        if not self.issued.is_set():
            self._announce()                 # the parent sees what this rank waits for
            self.issued.wait()
        if self._error is not None:
            raise self._error.with_traceback(self._error.__traceback__)

    def wait(self):
        self.join()
        self.kept = []           # the input copies are freed before the output counts, as unchecked
        output = self.handle.wait()
        self.handle = None       # the checker keeps this object as the group's last issue: not its output
        self.finished()
        return output

    def finished(self) -> None:
        """Wait (at most :data:`real.call_memory.RELEASE_WAIT_S`) until the issuing thread is gone:
        it has issued the call and only exits, but what it held (the call's output among it) is
        let go only as it exits, on that thread; the memory count would see it alive a moment
        after the program freed it (``Cluster(memory=True)``)."""
        self._thread.join(RELEASE_WAIT_S)

    def is_completed(self) -> bool:
        return self.issued.is_set() and (self._error is not None or self.handle is None
                                         or self.handle.is_completed())


def _op_by_op(method, ops: Sequence, kwargs: dict, posted: Sequence) -> tuple:
    """The check and issue of a checked ``batch_isend_irecv``: each op is issued to the backend
    as soon as its own pair agrees, in the batch's order, as gloo issues a batch's ops one by one.

    Checking the whole batch before issuing any op would hang a legitimate program: a batch of
    two isends whose receiver takes the first with a blocking recv and only then posts an irecv
    for the second (the second pair cannot agree before the first message has arrived). A
    mismatched op so moves nothing, and neither do the ops after it; the ops before it, which
    matched, have moved. ``posted[i]``: op ``i``'s pair record (None for an op to this rank)."""
    handles: list = []
    issued = (current_phase(), time.perf_counter())   # traced as the program issued it

    def check(view: Checker) -> None:
        for op, item in zip(ops, posted):
            if item is not None:
                view.finish(item)
            with issuing_deferred(), issued_as(*issued):
                handles.extend(method([op], **kwargs))

    return check, lambda: handles


def _pending_of(transport) -> dict | None:
    """The registry of unwaited calls of ``transport``'s process (None for a transport without one)."""
    cache = getattr(transport, "cache", None)
    return cache.pending if isinstance(cache, GroupCache) else None


class _Part:
    """The handle of one op of a deferred ``batch_isend_irecv``."""

    def __init__(self, work: _Deferred, index: int):
        self._work, self._index = work, index

    def wait(self):
        self._work.join()
        self._work.kept[self._index] = None      # as _Deferred.wait
        handles = self._work.handle
        output = handles[self._index].wait()
        handles[self._index] = None    # as _Deferred.wait: the checker keeps the batch, not its output
        self._work.finished()
        return output

    def is_completed(self) -> bool:
        if not self._work.issued.is_set() or self._work._error is not None:
            return self._work.issued.is_set()
        handle = self._work.handle[self._index]
        return handle is None or handle.is_completed()


def _taken_now(inner, name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict, list]:
    """``args`` and ``kwargs`` of an async call with each input tensor replaced by a private copy
    made now, on the program's thread, and the copies (one entry per op of a batch, ``None`` for
    an ``irecv``). The call reaches the backend later, from the thread of its check, and must move
    what the program passed, not what its tensor holds by then: the program may change its
    tensor at once (``comm.isend``, an ``async_op=True`` collective). A copy is made as the
    unchecked call makes its own (``inner._local_copy``), under the same label: a collective's
    under :func:`simcomm.memory.communicating`, a send's under the program's label."""
    local_copy = getattr(inner, "_local_copy", None) or (lambda tensor: tensor.detach().clone())
    if name == "batch_isend_irecv":
        ops = list(kwargs.pop("ops") if "ops" in kwargs else args[0])
        kept: list = []
        for index, op in enumerate(ops):
            tensor = batch_op_tensor(op) if "send" in batch_op_name(op) else None
            kept.append(None if tensor is None else local_copy(tensor))
            if tensor is not None:
                ops[index] = _with_tensor(op, kept[-1])
        return (ops,), kwargs, kept
    in_kwargs = "tensor" in kwargs
    tensor = kwargs["tensor"] if in_kwargs else (args[0] if args else None)
    if not isinstance(tensor, torch.Tensor):      # a recv, a barrier, a scatter off its source
        return args, kwargs, []
    with memory.communicating() if name != "send" else contextlib.nullcontext():
        private = local_copy(tensor)
    if in_kwargs:
        kwargs = {**kwargs, "tensor": private}
    else:
        args = (private, *args[1:])
    return args, kwargs, [private]


def _with_tensor(op, tensor: torch.Tensor):
    """The batch op ``op`` sending ``tensor`` instead (a :class:`simcomm.P2POp`, or an object
    with ``tensor`` or ``data``)."""
    field = "tensor" if isinstance(getattr(op, "tensor", None), torch.Tensor) else "data"
    if hasattr(op, "_replace"):
        return op._replace(**{field: tensor})
    op = copy.copy(op)
    setattr(op, field, tensor)
    return op


def _deferred(self, name: str, method, args: tuple, kwargs: dict, call: Call, location: str) -> Handle:
    checker, inner = self._checker, self._inner
    posted = checker.post_collective(inner, call, location)
    key = group_key(inner)
    previous = [checker.last_issue[key]] if key in checker.last_issue else []
    args, kwargs, kept = _taken_now(inner, name, args, kwargs)
    work = _Deferred(checker, lambda view: view.compare(posted), previous, lambda: method(*args, **kwargs),
                     lambda: checker.announce(posted), _pending_of(inner), (describe(call), location), kept)
    checker.last_issue[key] = work
    return Handle(work)


CheckedTransport._deferred = _deferred
