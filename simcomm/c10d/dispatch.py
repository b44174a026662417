"""The c10d ops of the "simcomm" backend's calls, seen by ``TorchDispatchMode``\\s as on gloo.

On a native backend, ``dist.all_reduce(t)`` reaches the C++ ``ProcessGroup``,
which calls the dispatcher's ``c10d.allreduce_`` op; its kernel then calls the
backend. A dispatch mode active on the thread (``CommDebugMode``, a user's
logging mode) sees that op. The "simcomm" process group is a Python subclass
of ``ProcessGroup``, so c10d's Python code calls its methods directly and no
op reaches the dispatcher; and a Python class cannot be the C++ ``Backend``
such a kernel calls.

So while a dispatch mode is active (and only then: the common path pays one
check, :func:`modes_active`), a call goes round through the dispatcher::

    SimcommProcessGroup.allreduce(tensors, opts)
      -> dispatched(group, "allreduce", (tensors, opts), run)
         -> proxy.allreduce(tensors, opts)         a plain C++ ProcessGroup of the same
                                                    rank, size and group name
            -> c10d.allreduce_                      every active mode sees it, outermost first
               -> _Interceptor, the innermost mode: runs ``run()``, the simulator's call
                  (which takes the place of the backend kernel), and returns its Work

A mode that answers the op itself, without passing it on, leaves the call
unissued, as it would on gloo. The op's ``process_group`` argument is the
proxy (``group_name`` resolves to the simcomm group). Shape-only runs do not
take this path (their fake tensors have no c10d kernels to stand in for).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["modes_active", "dispatched"]

modes_active: Callable[[], int] = torch._C._len_torch_dispatch_stack
"""The number of dispatch modes active on the calling thread (non-zero: route through the dispatcher)."""

_local = threading.local()    # .call: the simulator call the innermost mode is to run


class _Interceptor(TorchDispatchMode):
    """The innermost mode while a simcomm call goes through the dispatcher: the c10d op
    it expects runs the simulator's call instead of a backend kernel."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        call = getattr(_local, "call", None)
        if call is None or func.namespace != "c10d" or call[0]:
            return func(*args, **(kwargs or {}))
        call[0] = True
        work = call[1]()
        call[2] = work
        returns = len(func._schema.returns)
        if returns == 0:
            return None
        boxed = dist.Work.boxed(work)
        return (args[0], boxed) if returns == 2 else boxed


_INTERCEPTOR = _Interceptor()


def _proxy(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """The C++ ProcessGroup that stands for ``group`` in the dispatcher's ops (made once)."""
    name = group.group_name
    named = group.__dict__.get("_dispatch_proxy")
    if named is None or named[0] != name:
        proxy = dist.ProcessGroup(group.rank(), group.size())
        if name:
            proxy._set_group_name(name)
        named = group.__dict__["_dispatch_proxy"] = (name, proxy)
    return named[1]


def dispatched(group: dist.ProcessGroup, method: str, args: tuple, run: Callable[[], Any]) -> Any:
    """Call ``method`` of ``group``'s C++ proxy with c10d's ``args``, so the dispatcher's
    c10d op reaches every active dispatch mode; the innermost runs ``run()`` (the
    simulator's call, returning its Work). Returns that Work, or, when a mode answered
    the op itself, the Work the op returned."""
    stack = [torch._C._pop_torch_dispatch_stack(None) for _ in range(modes_active())][::-1]
    torch._C._push_on_torch_dispatch_stack(_INTERCEPTOR)
    for mode in stack:
        torch._C._push_on_torch_dispatch_stack(mode)
    call = [False, run, None]           # [run yet?, the simulator's call, its Work]
    outer = getattr(_local, "call", None)
    _local.call = call
    try:
        returned = getattr(_proxy(group), method)(*args)
    finally:
        _local.call = outer
        for _ in range(len(stack) + 1):
            torch._C._pop_torch_dispatch_stack(None)
        for mode in stack:
            torch._C._push_on_torch_dispatch_stack(mode)
    return call[2] if call[0] else returned
