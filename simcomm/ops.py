"""The names of the operations, read from the rows of :data:`simcomm.specs.SPECS`: what a trace
records, what the cost model and ``real.bench`` measure, and the spellings people type for them.

* :data:`TRACE_OPS`: the ``op`` of a :class:`~simcomm.trace.TraceEvent`, one per transport
  call (``send`` and ``recv`` are the two ends of one message; ``compute`` is declared work).
* :data:`COST_OPS`: the operations the cost model (:mod:`simcomm.model.cost`) and ``real.bench``
  know, named as nccl-tests names its binaries: a message between two ranks is one
  ``send_recv``.
* :data:`ALIASES`: other spellings of those names (``allreduce``, ``all-reduce``,
  ``alltoall``, ``sendrecv``, ``send/recv``...).

:func:`canonical_op` turns a spelling into its canonical name and raises a ``ValueError``
that lists the known names (and the closest one) for anything else. It never maps one
operation to a different one: ``"all_to_all"`` is the all-to-all exchange, never the
Ulysses ``all_to_all_4D`` layout change, which a caller that means it must name.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable

from .specs import COST_SPECS, SPECS

__all__ = ["TRACE_OPS", "COST_OPS", "COLLECTIVE_OPS", "P2P_OPS", "ALIASES", "canonical_op", "cost_op"]

#: collectives: every rank of the group takes part in the same call
COLLECTIVE_OPS: tuple[str, ...] = tuple(name for name, spec in SPECS.items() if spec.kind == "collective")
#: the two ends of a point-to-point message
P2P_OPS: tuple[str, ...] = tuple(name for name, spec in SPECS.items() if spec.kind == "p2p" and spec.traced)
#: every ``op`` a trace event can carry
TRACE_OPS: tuple[str, ...] = tuple(name for name, spec in SPECS.items() if spec.traced)
#: what the cost model and ``real.bench`` measure (nccl-tests' operations)
COST_OPS: tuple[str, ...] = tuple(COST_SPECS)
#: the name both ends of a message are priced as
_PAIR = SPECS[P2P_OPS[0]].priced_as

#: other spellings of the canonical names (looked up after lower-casing, with ``-`` and spaces as ``_``)
ALIASES: dict[str, str] = {alias: spec.priced_as for spec in SPECS.values() for alias in spec.aliases}

_KNOWN = tuple(dict.fromkeys(TRACE_OPS + COST_OPS))


def canonical_op(name: str, allowed: Iterable[str] | None = None, *, where: str = "op") -> str:
    """The canonical name of ``name`` (an op name or one of its :data:`ALIASES`).

    ``allowed`` restricts the answer (e.g. :data:`COST_OPS`); by default every
    name of :data:`TRACE_OPS` and :data:`COST_OPS` is accepted. Where
    ``allowed`` names ``send_recv`` but not ``send``/``recv``, either end
    means the pair. ``where`` names
    the caller in the error (``"estimate"``, ``"real.bench --ops"``). Raises
    ``ValueError`` naming the value, the known names and the closest match.
    """
    choices = tuple(allowed) if allowed is not None else _KNOWN
    if not isinstance(name, str):
        raise ValueError(f"{where}: op must be a string, got {name!r} ({type(name).__name__})")
    if name in choices:                                 # exact, case kept (all_to_all_4D)
        return name
    key = name.strip().lower().replace("-", "_").replace(" ", "_")
    key = ALIASES.get(key, ALIASES.get(key.replace("_", ""), key))
    if key in choices:
        return key
    if key in P2P_OPS and _PAIR in choices:            # one end of a message, where only pairs are named
        return _PAIR
    spellings = sorted(alias for alias, op in ALIASES.items() if op in choices)
    close = difflib.get_close_matches(key, list(choices) + spellings, n=1)
    hint = f" (did you mean {ALIASES.get(close[0], close[0])!r}?)" if close else ""
    raise ValueError(f"{where}: unknown op {name!r}{hint}; known ops: {list(choices)}"
                     + (f", also spelled {spellings}" if spellings else ""))


def cost_op(trace_op: str) -> str:
    """The cost-model operation a traced call is timed as: ``send`` and ``recv`` are a ``send_recv``."""
    return _PAIR if trace_op in P2P_OPS else canonical_op(trace_op, COST_OPS, where="cost_op")
