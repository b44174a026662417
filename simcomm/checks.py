"""Argument checks shared by every collective, in one place, with one wording.

Each check raises :class:`ValueError` (:class:`TypeError` for an argument of
the wrong type) naming the op, the rank, the argument and the value, so a
learner reading the message knows which call on which rank to fix. Both
backends call these before any communication, so a bad argument is reported
the same way on virtual ranks and on real processes.
"""
from __future__ import annotations

import marshal
import operator
import reprlib
from collections.abc import Iterable, Sequence

import torch
from torch.distributed import ReduceOp

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60


def check_tensor(op: str, value: object, rank: int, arg: str = "input_") -> torch.Tensor:
    """Check that ``value`` is a tensor; return it. Every communicator method calls this first."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{op}: {arg}={_short.repr(value)} on rank {rank} is a {type(value).__name__}, "
            f"not a torch.Tensor")
    return value


def check_rank_number(op: str, value: object, rank: int, arg: str) -> int:
    """``value`` as an int if it is an integer (``int``, a numpy or 0-d torch integer), not a bool;
    a float such as 0.7 or 1.0, a string such as "0", or True is refused rather than converted."""
    if isinstance(value, bool) or isinstance(value, (float, str, bytes)):
        number = None
    else:
        try:
            number = operator.index(value)
        except TypeError:
            number = None
    if number is None:
        raise ValueError(f"{op}: {arg} contains {value!r} ({type(value).__name__}) on rank {rank}; "
                         f"ranks must be ints")
    return number


def check_split_sizes(op: str, splits: object, size: int | None, rank: int, arg: str, world_size: int
                      ) -> list[int]:
    """Check a split-size list: ``world_size`` non-negative ints, summing to ``size`` when given."""
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    if isinstance(splits, (str, bytes)) or not isinstance(splits, Sequence):
        raise ValueError(f"{op}: {arg}={_short.repr(splits)} on rank {rank} must be a list of "
                         f"{world_size} ints")
    values = [check_rank_number(op, s, rank, arg) for s in splits]
    if len(values) != world_size or any(v < 0 for v in values):
        raise ValueError(f"{op}: {arg}={values} on rank {rank} must be {world_size} non-negative ints "
                         f"(one per rank of the group)")
    if size is not None and sum(values) != size:
        raise ValueError(f"{op}: {arg}={values} on rank {rank} sums to {sum(values)}, but dim 0 of the "
                         f"input has size {size}")
    return values


def check_even_split(op: str, tensor: torch.Tensor, world_size: int, rank: int, arg: str) -> int:
    """A split list ``arg`` given as ``None`` splits dim 0 evenly: check that it can; return the
    rows per rank."""
    rows = tensor.shape[0]
    if rows % world_size:
        raise ValueError(
            f"{op}: {arg}=None on rank {rank} splits dim 0 evenly over the {world_size} ranks, but "
            f"dim 0 has size {rows} (shape {tuple(tensor.shape)}), not divisible by {world_size}; "
            f"pass {arg} as a list of {world_size} ints summing to {rows}")
    return rows // world_size


def check_recv_spec(op: str, size: object, dtype: object, rank: int, size_arg: str = "size",
                    dtype_arg: str = "dtype") -> tuple[tuple[int, ...], torch.dtype]:
    """What a receive is told to expect: ``size`` a sequence (tuple, list, ``torch.Size``) of
    non-negative ints, ``dtype`` a ``torch.dtype``; returns ``(tuple(size), dtype)``.
    TypeError naming the op, the rank, the argument and the value otherwise."""
    if isinstance(size, (str, bytes)) or not isinstance(size, Sequence):
        hint = f", e.g. ({size},)" if isinstance(size, int) and not isinstance(size, bool) else ""
        raise TypeError(f"{op}: {size_arg}={_short.repr(size)} on rank {rank} is a {type(size).__name__}; "
                        f"it must be a sequence of ints (the shape to receive){hint}")
    dims = []
    for value in size:
        try:
            number = None if isinstance(value, (bool, float, str, bytes)) else operator.index(value)
        except TypeError:
            number = None
        if number is None or number < 0:
            raise TypeError(f"{op}: {size_arg}={_short.repr(size)} on rank {rank} contains {value!r} "
                            f"({type(value).__name__}); every size must be a non-negative int")
        dims.append(number)
    if not isinstance(dtype, torch.dtype):
        hint = f"; e.g. torch.{dtype}" if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None),
                                                                              torch.dtype) else ""
        raise TypeError(f"{op}: {dtype_arg}={_short.repr(dtype)} on rank {rank} is a {type(dtype).__name__}, "
                        f"not a torch.dtype{hint}")
    return tuple(dims), dtype


def normalize_dim(op: str, tensor: torch.Tensor, dim: int, rank: int, arg: str = "dim") -> int:
    """Return ``dim`` as a non-negative index into ``tensor``'s dimensions."""
    ndim = tensor.dim()
    if not isinstance(dim, int) or isinstance(dim, bool):
        raise ValueError(f"{op}: {arg}={dim!r} on rank {rank} must be an int")
    if ndim == 0:
        raise ValueError(f"{op}: rank {rank} passed a 0-d tensor; {arg}={dim} needs at least one dimension")
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{op}: {arg}={dim} is out of range for the {ndim}-D tensor of shape "
            f"{tuple(tensor.shape)} on rank {rank} (valid: {-ndim} to {ndim - 1})"
        )
    return dim % ndim


def check_divisible(op: str, tensor: torch.Tensor, dim: int, world_size: int, rank: int,
                    arg: str = "dim") -> int:
    """Check that ``tensor.shape[dim]`` splits into ``world_size`` equal shards; return the shard size."""
    size = tensor.shape[dim]
    if size % world_size:
        raise ValueError(
            f"{op}: size {size} of {arg}={dim} (shape {tuple(tensor.shape)}) on rank {rank} "
            f"is not divisible by the world size {world_size}; pad it or pick a divisible size"
        )
    return size // world_size


def check_peer(op: str, peer: int, world_size: int, rank: int, arg: str) -> int:
    """Check that ``peer`` is a rank of the group (group-local numbering)."""
    if not isinstance(peer, int) or isinstance(peer, bool) or not 0 <= peer < world_size:
        raise ValueError(
            f"{op}: {arg}={peer!r} on rank {rank} is not a rank of this group "
            f"(valid: 0 to {world_size - 1})"
        )
    return peer


def check_4d(op: str, tensor: torch.Tensor, rank: int) -> None:
    if tensor.dim() != 4:
        raise ValueError(
            f"{op}: expects a 4-D (batch, seq, heads, head_dim) tensor, got shape "
            f"{tuple(tensor.shape)} on rank {rank}"
        )


def check_partition(op: str, groups: Sequence[Sequence[int]], world_size: int, rank: int
                    ) -> tuple[tuple[int, ...], ...]:
    """Check that ``groups`` partitions ``range(world_size)``; return it as tuples, each sorted.

    Each group is sorted, as ``torch.distributed.new_group`` sorts its ranks:
    group-local rank ``i`` is the ``i``-th smallest member on both backends,
    so ``[[1, 0]]`` is the same group as ``[[0, 1]]``. Ranks must be ints
    (0.7, 1.9, "0" and True are refused, never converted).
    """
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Iterable):
        raise ValueError(f"{op}: groups={groups!r} on rank {rank} must be a list of lists of ranks")
    normalized = []
    named = None
    for group in groups:
        if isinstance(group, (str, bytes)) or not isinstance(group, Iterable):
            raise ValueError(f"{op}: groups={groups!r} on rank {rank} must be a list of lists of ranks")
        members = []
        for r in group:
            if type(r) is not int or not 0 <= r < world_size:   # the common case needs no message
                named = named or f"groups={groups!r}"           # formatted once, not once per rank
                r = check_rank_number(op, r, rank, named)
            members.append(r)
        normalized.append(tuple(sorted(members)))
    normalized = tuple(normalized)
    flat = sorted(r for group in normalized for r in group)
    if flat != list(range(world_size)) or any(len(group) == 0 for group in normalized):
        raise ValueError(
            f"{op}: groups={[list(g) for g in normalized]} on rank {rank} must partition the "
            f"ranks 0..{world_size - 1}: every rank in exactly one non-empty group"
        )
    return normalized


class PartitionTable:
    """The partitions :func:`check_partition` accepted, shared by every rank that checks one.

    A subgroup call passes the whole partition on every rank (as
    ``new_subgroups_by_enumeration`` and ``DeviceMesh`` do), so checking and
    normalizing it on each rank costs ``O(world size)`` Python work and memory per rank,
    ``O(world size**2)`` for a run. :meth:`check` returns the *same* normalized tuple
    to every rank whose ``groups`` equals one accepted before: held once, compared
    in C. What counts as equal is strict, so the table never accepts what
    :func:`check_partition` refuses: the identical object (an immutable tuple of
    tuples, or the normalized tuple itself), or lists and tuples whose
    :func:`marshal.dumps` bytes (format 2: no back-references, so the bytes depend on
    the values alone) are those of an accepted partition. Those bytes encode each part's
    type and length and each entry's type and value: only an exact ``int`` is written as
    one, so ``True``, ``1.0`` or a numpy scalar never match an accepted ``1`` (``True == 1``
    and ``1.0 == 1`` in Python, but ``check_partition`` refuses both), and one pass of C code
    over the entries (no Python call per entry) both compares and type-checks them.
    Anything else is checked by :func:`check_partition` itself. One table per run
    of virtual ranks (or per process); it grows by one entry per distinct partition.
    """

    def __init__(self) -> None:
        # by (world size, number of parts, first part): (the object as given when it is an
        # immutable tuple of tuples, else None; its marshal bytes; its normalized form)
        self._known: dict[tuple, list[tuple[object, bytes, tuple[tuple[int, ...], ...]]]] = {}
        # id of an accepted normalized partition -> (the partition, kept alive; each rank's
        # (part index, position in the part)): built once, read by every rank of the partition
        self._members: dict[int, tuple[tuple[tuple[int, ...], ...], list[tuple[int, int]]]] = {}
        self.hits = 0
        self.misses = 0

    def membership(self, normalized: tuple[tuple[int, ...], ...], rank: int) -> tuple[int, int]:
        """``(index of the part holding rank, rank's position in it)`` in ``normalized`` (what
        :meth:`check` returned): an index built once per partition, so that every rank finds its
        part in O(1) rather than scanning the partition (``O(world size**2)`` for a run)."""
        entry = self._members.get(id(normalized))
        if entry is None or entry[0] is not normalized:
            where = [(0, 0)] * sum(len(part) for part in normalized)
            for index, part in enumerate(normalized):
                for position, member in enumerate(part):
                    where[member] = (index, position)
            entry = self._members[id(normalized)] = (normalized, where)
        return entry[1][rank]

    def check(self, op: str, groups: Sequence[Sequence[int]], world_size: int, rank: int
              ) -> tuple[tuple[int, ...], ...]:
        """:func:`check_partition`'s result for ``groups``, shared with every rank that passed
        an equal partition (see the class docstring); raises as :func:`check_partition` does."""
        # the bucket without _nested_sequences' look at every part's type: an accepted
        # partition's bytes encode each part's type (a list or a tuple), so bytes equal to them
        # are of lists and tuples alone; anything else misses and takes the whole check below
        bucket = _bucket_of_sequence(groups, world_size)
        known = self._known.get(bucket, ()) if bucket is not None else ()
        key = _UNWRITTEN
        for raw, raw_key, normalized in reversed(known):
            if groups is raw or groups is normalized:
                self.hits += 1
                return normalized
            if key is _UNWRITTEN:                # written once, compared with every entry
                key = _key(groups)
            if key == raw_key:
                self.hits += 1
                return normalized
        bucket = _bucket(groups, world_size)
        normalized = check_partition(op, groups, world_size, rank)
        self.misses += 1
        # the same partition given another way (tuples for lists, unsorted parts): one copy
        same = self._known.get(_bucket(normalized, world_size), ())
        normalized = next((entry for _raw, _key, entry in same if entry == normalized), normalized)
        if bucket is not None:
            key = _key(groups) if key is _UNWRITTEN else key   # None: entries marshal does not write
            if key is not None:
                # an immutable tuple of tuples of ints is kept as it is (the same object passed by
                # another rank is a hit at once); lists only as their bytes: the caller may change
                # them afterwards
                immutable = type(groups) is tuple and set(map(type, groups)) == {tuple}
                self._known.setdefault(bucket, []).append((groups if immutable else None, key, normalized))
        if _bucket(normalized, world_size) != bucket:
            self._known.setdefault(_bucket(normalized, world_size), []).append(
                (normalized, _key(normalized), normalized))
        return normalized


def _bucket(groups: object, world_size: int) -> tuple | None:
    """Where the table files ``groups``: its world size, number of parts and first part; ``None``
    for what it does not compare (not a list or tuple of lists and tuples of hashable entries)."""
    if not _nested_sequences(groups) or not groups:
        return None
    try:
        return (world_size, len(groups), tuple(groups[0]))
    except TypeError:
        return None


def _bucket_of_sequence(groups: object, world_size: int) -> tuple | None:
    """:func:`_bucket` of a list or tuple whose parts' types are not looked at (``None`` for what
    has no such bucket): where :meth:`PartitionTable.check` looks for an accepted partition. Only
    an accepted partition's own object or its bytes match there, so ``groups`` matches only if it
    is a list or tuple of lists and tuples too."""
    if type(groups) not in (list, tuple) or not groups:
        return None
    try:
        return (world_size, len(groups), tuple(groups[0]))
    except TypeError:
        return None


def _nested_sequences(groups: object) -> bool:
    """Whether ``groups`` is a list or tuple of lists and tuples (what the table compares)."""
    return type(groups) in (list, tuple) and set(map(type, groups)) <= {list, tuple}


_UNWRITTEN = object()   # check's key before it is written


def _key(groups: Sequence) -> bytes | None:
    """``groups`` as :func:`marshal.dumps` writes it in format 2 (deterministic: no references
    between objects, so equal values of equal types give equal bytes), or ``None`` when an entry
    is something marshal does not write (a numpy scalar, a tensor, an ``int`` subclass)."""
    try:
        return marshal.dumps(groups, 2)
    except (ValueError, TypeError):
        return None


# -- reductions and the ranks' arguments checked against each other ------------------------

#: The reductions every backend supports, by canonical name.
REDUCE_OPS = ("sum", "avg", "max", "min", "product")
#: The reduction that carries an argument: ``ReduceOp.PREMUL_SUM(factor)`` (or
#: ``torch.distributed._make_nccl_premul_sum(factor)``) sums ``factor * x`` over the ranks, each
#: rank multiplying its own input by its own factor before the sum, as NCCL does. Not in
#: :data:`REDUCE_OPS`: a name alone does not make it.
PREMUL_SUM = "premul_sum"
#: The bitwise reductions (``ReduceOp.BAND``, ``BOR``, ``BXOR``): gloo and c10d's other CPU
#: backends take them for integer and bool tensors only. Not in :data:`REDUCE_OPS`.
BITWISE_OPS = ("band", "bor", "bxor")
_ALIASES = {"mean": "avg", "prod": "product"}


_NAMES: dict = {**{getattr(ReduceOp, name.upper()): name for name in (*REDUCE_OPS, PREMUL_SUM, *BITWISE_OPS)},
                **{name: name for name in (*REDUCE_OPS, PREMUL_SUM, *BITWISE_OPS)}}


def reduce_op_name(op: ReduceOp | str) -> str:
    """The canonical name (``"sum"``, ``"avg"``, ``"max"``, ``"min"``, ``"product"``,
    ``"premul_sum"``, or a bitwise ``"band"``, ``"bor"``, ``"bxor"``) of ``op``.

    Accepts ``torch.distributed.ReduceOp`` members, ``ReduceOp`` objects (such as
    ``ReduceOp.PREMUL_SUM(0.5)``) and their names as strings. The factor of a
    PREMUL_SUM is read by :func:`reduce_op_and_factor`.
    """
    try:
        return _NAMES[op]
    except (KeyError, TypeError):
        pass
    if isinstance(op, str):
        name = _ALIASES.get(op.lower(), op.lower())
        if name in _NAMES:
            return name
    else:
        for name in (*REDUCE_OPS, PREMUL_SUM, *BITWISE_OPS):
            if op == getattr(ReduceOp, name.upper()):
                return name
    raise ValueError(f"unsupported reduce op {op!r}; use one of ReduceOp.SUM, AVG, MAX, MIN, PRODUCT, "
                     f"BAND, BOR, BXOR or ReduceOp.PREMUL_SUM(factor)")


def check_bitwise_dtype(call: str, tensor: torch.Tensor, op: str, rank: int | None = None) -> None:
    """A bitwise reduction (:data:`BITWISE_OPS`) of a tensor that is not integer or bool raises
    RuntimeError, as gloo does ("Cannot use ReduceOp.BAND with non-integral dtype")."""
    if op in BITWISE_OPS and (tensor.is_floating_point() or tensor.is_complex()):
        where = f" on rank {rank}" if rank is not None else ""
        raise RuntimeError(f"{call}{where}: cannot use ReduceOp.{op.upper()} with non-integral dtype "
                           f"{tensor.dtype}; the bitwise reductions take integer or bool tensors")


def reduce_op_and_factor(call: str, op: ReduceOp | str, rank: int | None = None
                         ) -> tuple[str, float | torch.Tensor | None]:
    """``(canonical name, factor)`` of ``op`` for the collective ``call`` on ``rank``.

    The factor is ``None`` except for PREMUL_SUM, whose factor is a Python number
    or a one-element floating-point tensor (``ReduceOp.factor``, as
    ``torch.distributed._make_nccl_premul_sum`` stores it). A PREMUL_SUM
    without a factor (``ReduceOp.PREMUL_SUM`` itself, or the string
    ``"premul_sum"``) raises ``ValueError``, as torch does.
    """
    try:
        name = _NAMES[op]    # the usual case, one lookup (reduce_op_name does the rest)
    except (KeyError, TypeError):
        name = reduce_op_name(op)
    if name != PREMUL_SUM:
        return name, None
    where = f" on rank {rank}" if rank is not None else ""
    factor = getattr(op, "factor", None) if isinstance(op, ReduceOp) else None
    if factor is None:
        raise ValueError(f"{call}: op={op!r}{where} is PREMUL_SUM without a factor; make it with "
                         f"ReduceOp.PREMUL_SUM(factor) or torch.distributed._make_nccl_premul_sum(factor)")
    return name, check_premul_factor(call, factor, rank)


def check_premul_factor(call: str, factor: object, rank: int | None = None,
                        tensor: torch.Tensor | None = None) -> float | torch.Tensor:
    """Check a PREMUL_SUM factor: a real Python number, or a one-element real floating tensor
    (with ``tensor``: of ``tensor``'s dtype, or its real dtype for a complex ``tensor``, as NCCL
    reads it). Returns the factor (a number as ``float``)."""
    where = f" on rank {rank}" if rank is not None else ""
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1 or not factor.is_floating_point():
            raise ValueError(f"{call}: the PREMUL_SUM factor{where} is a {factor.dtype} tensor of shape "
                             f"{tuple(factor.shape)}; it must be one floating-point element")
        if tensor is not None:
            expected = tensor.real.dtype if tensor.is_complex() else tensor.dtype
            if factor.dtype != expected:
                raise ValueError(f"{call}: the PREMUL_SUM factor{where} is a {factor.dtype} tensor but "
                                 f"the input is {tensor.dtype}; NCCL reads a tensor factor in the input's "
                                 f"dtype: pass factor.to({expected}) or a Python float")
        return factor
    if isinstance(factor, bool) or not isinstance(factor, (int, float)):
        raise ValueError(f"{call}: the PREMUL_SUM factor{where} is {_short.repr(factor)} "
                         f"({type(factor).__name__}); it must be a Python float or a one-element tensor")
    return float(factor)


def to_reduce_op(name: str) -> ReduceOp:
    """The ``torch.distributed.ReduceOp`` member for a canonical name."""
    return getattr(ReduceOp, reduce_op_name(name).upper())


def check_same(op: str, inputs: Sequence[torch.Tensor]) -> None:
    """Raise ``ValueError`` unless every rank's tensor has the same shape and dtype."""
    if not inputs:
        raise ValueError(f"{op}: needs at least one rank's tensor")
    first = inputs[0]
    for rank, tensor in enumerate(inputs):
        if tensor.shape != first.shape or tensor.dtype != first.dtype:
            raise ValueError(
                f"{op}: rank {rank} has {tensor.dtype} {tuple(tensor.shape)} but rank 0 has "
                f"{first.dtype} {tuple(first.shape)}; every rank must pass the same shape and dtype"
            )


def check_avg_dtype(op: str, tensor: torch.Tensor, reduction: str, rank: int | None = None) -> None:
    """Raise ``ValueError`` for ``ReduceOp.AVG`` or ``PREMUL_SUM`` of a tensor that is not floating
    point (or complex), at every world size, with one wording for both backends (NCCL refuses
    PREMUL_SUM of integers too)."""
    if reduction in ("avg", PREMUL_SUM) and not (tensor.is_floating_point() or tensor.is_complex()):
        where = f" on rank {rank}" if rank is not None else ""
        raise ValueError(f"{op}: ReduceOp.{reduction.upper()}{where} needs a floating-point dtype, "
                         f"got {tensor.dtype}")


def check_splits(op: str, input_splits: Sequence[Sequence[int]], output_splits: Sequence[Sequence[int]]
                 ) -> None:
    """Raise ``ValueError`` unless what rank ``i`` sends to rank ``j``
    (``input_splits[i][j]``) is what rank ``j`` expects from rank ``i``
    (``output_splits[j][i]``), naming the first pair that disagrees and both lists."""
    world_size = len(input_splits)
    for sender in range(world_size):
        for receiver in range(world_size):
            sent, expected = input_splits[sender][receiver], output_splits[receiver][sender]
            if sent != expected:
                raise ValueError(
                    f"{op}: rank {sender} sends {sent} rows to rank {receiver} "
                    f"(input_split_sizes={list(input_splits[sender])} on rank {sender}) but rank "
                    f"{receiver} expects {expected} from rank {sender} "
                    f"(output_split_sizes={list(output_splits[receiver])} on rank {receiver})")
