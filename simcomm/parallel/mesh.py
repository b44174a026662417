"""The one mesh of the parallel programs: named dimensions, one rank order, the groups along each.

A :class:`Layout` says how many ranks go to each dimension of parallelism,
by name and only by name::

    layout = Layout(pp=2, dp=2, tp=2)        # 8 ranks
    layout.coordinates(5)                    # (1, 0, 1): (pp, dp, tp) of rank 5
    layout.rank(pp=1, dp=0, tp=1)            # 5
    layout.groups("tp")                      # [[0, 1], [2, 3], [4, 5], [6, 7]]
    layout.group_of(5, "dp")                 # [5, 7]

**The rank order.** The dimensions always come in the order of :data:`DIMS`,
outermost first: pipeline, data (``dp``, or in its place ``dp_replicate``
then ``dp_shard``), context, tensor (torchtitan's mesh order, ``("pp",
"dp_replicate", "dp_shard", "cp", "tp")``). A layout holds the dimensions it was given,
in that order (``layout.dims``), with their sizes (``layout.shape``), and
numbers the ranks row-major over them, exactly as
``init_device_mesh(device, layout.shape, mesh_dim_names=layout.dims)`` does:
the last dimension (tensor parallelism) is innermost, so a tensor group is
``tp`` consecutive ranks (one NVLink node for ``tp = 8``), a data-parallel
peer is ``cp * tp`` ranks away and a pipeline peer ``dp * cp * tp``. For
``Layout(pp=2, dp=2, tp=2)``::

    rank = (p * dp + d) * tp + t

**The data dimension split for HSDP.** Instead of ``dp``, a layout may take
``dp_replicate`` and ``dp_shard`` (either or both; torchtitan's names): the
data-parallel ranks on the 2-D ``(replicate, shard)`` mesh of HSDP, the
replicate dimension outer of the shard dimension, so parameters are sharded
over ``dp_shard`` consecutive data-parallel ranks and replicated across the
``dp_replicate`` groups. The name ``dp`` then means the two flattened
(``layout.dp == dp_replicate * dp_shard``; the ``dp`` coordinate is
``replicate * dp_shard + shard``; ``group_of(rank, "dp")`` is
``mesh["dp_replicate", "dp_shard"]._flatten()``'s group). A layout given
plain ``dp`` holds replicas (``dp_replicate == dp``, ``dp_shard == 1``). For
``Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2)``::

    rank = ((p * dp_replicate + r) * dp_shard + s) * tp + t

Groups may vary any combination of dimensions (``groups("dp_replicate",
"cp")``, ``groups("dp", "cp")``): each is the flattened group over them.

A dimension that was not given has size 1 and coordinate 0 everywhere
(``layout.size("cp") == 1``), so code written for all four dimensions runs on
any layout. :meth:`Layout.device_mesh` builds torch's ``DeviceMesh`` of the
same shape and names inside a run, so ``mesh[dim].mesh`` and
``mesh.get_group(dim)`` give the ranks that :meth:`Layout.group_of` gives.

Sizes are keyword-only: a positional call is a ``TypeError`` that says how to
write it (earlier ``Layout`` classes took ``(tp, pp, dp)``, ``(tp, dp, pp)``
and ``(dp, pp, cp, tp, fsdp)``; the same numbers meant different meshes). Pure Python: no
communication, nothing here needs a run.
"""
from __future__ import annotations

import difflib
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DIMS", "DATA_SPLIT", "Layout"]

#: every dimension a layout may have, outermost first (the row-major order of the ranks); ``dp`` and
#: the pair :data:`DATA_SPLIT` are two ways to give the data dimension (one or the other)
DIMS: tuple[str, ...] = ("pp", "dp", "dp_replicate", "dp_shard", "cp", "tp")

#: the data dimension split for HSDP, replicate outer of shard (``dp`` is the two flattened)
DATA_SPLIT: tuple[str, ...] = ("dp_replicate", "dp_shard")

#: the dimensions the ranks are numbered over, outermost first (plain ``dp`` counts as ``dp_replicate``)
_ATOMIC: tuple[str, ...] = ("pp", "dp_replicate", "dp_shard", "cp", "tp")

_MEANING = {"pp": "pipeline stages", "dp": "data-parallel replicas", "cp": "context-parallel ranks",
            "tp": "tensor-parallel ranks", "dp_replicate": "HSDP replica groups",
            "dp_shard": "ranks each parameter is sharded over"}


def _check_size(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Layout: {name}={value!r} must be a whole number >= 1 (the number of "
                         f"{_MEANING[name]})")
    return value


class Layout:
    """How many ranks each dimension of parallelism has, and where each rank sits (module docstring).

    ``Layout(pp=..., dp=..., cp=..., tp=...)``: any of them, by name, at least
    one; instead of ``dp`` the HSDP split ``dp_replicate=..., dp_shard=...``
    (module docstring; giving both ``dp`` and the split is a ``TypeError``).
    Immutable, hashable, equal when the dims and sizes are equal; pickles (it
    travels to real workers as a program argument). Iterating or indexing it is
    refused: read sizes by name (``layout.tp``).
    """

    __slots__ = ("_sizes", "_atomic")

    def __init__(self, *args: Any, **sizes: int) -> None:
        if args:
            raise TypeError(
                f"Layout takes its sizes by name only, e.g. Layout(pp=2, dp=2, tp=2); got the "
                f"positional arguments {args!r}. (The former cluster_step.Layout(tp, pp, dp) and "
                f"transformer3d.Layout(tp, dp, pp) read positions in different orders; name each size.)")
        for name in sizes:
            if name not in DIMS:
                close = difflib.get_close_matches(name, DIMS, n=1, cutoff=0.5)
                hint = f"; did you mean {close[0]!r}?" if close else "."
                raise TypeError(f"Layout: unknown dimension {name!r}{hint} The dimensions are {DIMS}.")
        if not sizes:
            raise TypeError(f"Layout needs at least one size by name, e.g. Layout(dp=4); dimensions: {DIMS}")
        split = [name for name in DATA_SPLIT if name in sizes]
        if "dp" in sizes and split:
            raise TypeError(f"Layout: give the data dimension as dp= or as dp_replicate= and dp_shard=, not both "
                            f"(got dp={sizes['dp']!r} and " + ", ".join(f"{n}={sizes[n]!r}" for n in split)
                            + "); e.g. Layout(dp_replicate=2, dp_shard=4) for dp = 8")
        ordered = tuple((name, _check_size(name, sizes[name])) for name in DIMS if name in sizes)
        object.__setattr__(self, "_sizes", ordered)
        given = dict(ordered)
        if "dp" in given:
            given["dp_replicate"] = given.pop("dp")          # plain data parallelism: replicas
        object.__setattr__(self, "_atomic", tuple((name, given.get(name, 1)) for name in _ATOMIC))

    # -- immutability, equality, pickling ----------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Layout is immutable; build a new one (tried to set {name!r})")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self._sizes == other._sizes

    def __hash__(self) -> int:
        return hash(self._sizes)

    def __repr__(self) -> str:
        return "Layout(" + ", ".join(f"{name}={size}" for name, size in self._sizes) + ")"

    def __reduce__(self) -> tuple:
        return (_rebuild, (dict(self._sizes),))

    def __iter__(self):
        raise TypeError(f"{self!r} is not a tuple of sizes: read them by name (layout.tp, layout.dp, ...) "
                        "or as layout.dims / layout.shape")

    # -- sizes -------------------------------------------------------------------------------------

    @property
    def dims(self) -> tuple[str, ...]:
        """The dimensions this layout was given, outermost first (a sub-sequence of :data:`DIMS`)."""
        return tuple(name for name, _ in self._sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes of :attr:`dims`, in the same order (``init_device_mesh``'s ``mesh_shape``)."""
        return tuple(size for _, size in self._sizes)

    @property
    def world_size(self) -> int:
        """The number of ranks: the product of the sizes."""
        return math.prod(self.shape)

    def size(self, dim: str) -> int:
        """The size of ``dim``; 1 for one of :data:`DIMS` this layout was not given (``dp``: the
        product of the split; ``dp_replicate`` of a plain ``dp``: ``dp``)."""
        self._check_dim(dim, "size")
        atomic = dict(self._atomic)
        return math.prod(atomic[name] for name in _expand(dim))

    @property
    def pp(self) -> int:
        """Pipeline stages (1 when not given)."""
        return self.size("pp")

    @property
    def dp(self) -> int:
        """Data-parallel ranks (1 when not given; ``dp_replicate * dp_shard`` for the HSDP split)."""
        return self.size("dp")

    @property
    def dp_replicate(self) -> int:
        """HSDP replica groups (``dp`` for a plain ``dp``; 1 when not given)."""
        return self.size("dp_replicate")

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks each parameter is sharded over (1 for a plain ``dp``, or when not given)."""
        return self.size("dp_shard")

    @property
    def cp(self) -> int:
        """Context-parallel ranks (1 when not given)."""
        return self.size("cp")

    @property
    def tp(self) -> int:
        """Tensor-parallel ranks (1 when not given)."""
        return self.size("tp")

    # -- rank <-> coordinates ----------------------------------------------------------------------

    def _check_dim(self, dim: Any, what: str) -> None:
        if dim not in DIMS:
            close = difflib.get_close_matches(str(dim), DIMS, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else "."
            raise ValueError(f"Layout.{what}: unknown dimension {dim!r}{hint} The dimensions are {DIMS}.")

    def _check_rank(self, rank: Any, what: str) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"Layout.{what}: rank={rank!r} is not a rank of {self!r} "
                             f"(0 to {self.world_size - 1})")

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """The coordinates of global ``rank`` along :attr:`dims`, outermost first (as
        ``DeviceMesh.get_coordinate()`` on that rank)."""
        self._check_rank(rank, "coordinates")
        out = []
        for size in reversed(self.shape):
            rank, index = divmod(rank, size)
            out.append(index)
        return tuple(reversed(out))

    def _atomic_coordinates(self, rank: int) -> dict[str, int]:
        out = {}
        for name, size in reversed(self._atomic):
            rank, out[name] = divmod(rank, size)
        return out

    def coordinate(self, rank: int, dim: str) -> int:
        """The index of global ``rank`` along ``dim`` (0 for a dimension this layout was not given;
        ``dp`` of the HSDP split: ``replicate * dp_shard + shard``, the flattened index)."""
        self._check_dim(dim, "coordinate")
        self._check_rank(rank, "coordinate")
        atomic, sizes, index = self._atomic_coordinates(rank), dict(self._atomic), 0
        for name in _expand(dim):
            index = index * sizes[name] + atomic[name]
        return index

    def rank(self, **coords: int) -> int:
        """The global rank at ``coords`` (by name; a dimension left out is at 0; ``dp`` may be given
        as the flattened index on the HSDP split, but not together with ``dp_replicate``/``dp_shard``)."""
        for dim, index in coords.items():
            self._check_dim(dim, "rank")
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.size(dim):
                raise ValueError(f"Layout.rank: {dim}={index!r} is outside 0..{self.size(dim) - 1} of {self!r}")
        if "dp" in coords and any(name in coords for name in DATA_SPLIT):
            raise ValueError(f"Layout.rank: give dp= or dp_replicate=/dp_shard=, not both (got {coords!r})")
        atomic = dict(coords)
        if "dp" in atomic:
            atomic["dp_replicate"], atomic["dp_shard"] = divmod(atomic.pop("dp"), self.dp_shard)
        rank = 0
        for dim, size in self._atomic:
            rank = rank * size + atomic.get(dim, 0)
        return rank

    # -- groups ------------------------------------------------------------------------------------

    def group_of(self, rank: int, *dims: str) -> list[int]:
        """The ranks that share every coordinate of ``rank`` but those of ``dims``, in row-major order
        over ``dims`` (a dimension's process group; several dims: the flattened group, as
        ``mesh[dims]._flatten()``). With no ``dims``: ``[rank]``."""
        self._check_rank(rank, "group_of")
        for dim in dims:
            self._check_dim(dim, "group_of")
        wanted = {name for dim in dims for name in _expand(dim)}
        varying = [name for name in _ATOMIC if name in wanted]
        fixed = self._atomic_coordinates(rank)
        sizes = dict(self._atomic)
        ranks: list[dict[str, int]] = [{}]
        for dim in varying:
            ranks = [{**c, dim: index} for c in ranks for index in range(sizes[dim])]
        return [self._atomic_rank({**fixed, **c}) for c in ranks]

    def _atomic_rank(self, coords: dict[str, int]) -> int:
        rank = 0
        for dim, size in self._atomic:
            rank = rank * size + coords[dim]
        return rank

    def groups(self, *dims: str) -> list[list[int]]:
        """The partition of all ranks into :meth:`group_of` groups along ``dims``, ordered by their
        first rank (the argument ``comm.subgroup`` takes)."""
        if not dims:
            raise ValueError(f"Layout.groups: name at least one dimension of {DIMS}")
        seen: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            group = self.group_of(rank, *dims)
            seen.setdefault(tuple(group), group)
        return sorted(seen.values())

    def partitions(self) -> dict[str, list[list[int]]]:
        """``{dim: groups(dim)}`` for each of :attr:`dims` (e.g. the ``groups`` of a timeline figure)."""
        return {dim: self.groups(dim) for dim in self.dims}

    def device_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """torch's ``init_device_mesh(device_type, self.shape, mesh_dim_names=self.dims)``: the same
        ranks in the same order. Collective (every rank calls it); needs torch.distributed initialised
        with ``world_size`` ranks (every rank of ``World.run`` or of a real worker is)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.dims)


def _expand(dim: str) -> tuple[str, ...]:
    """The dimensions the ranks are numbered over that ``dim`` names (``dp``: the split pair)."""
    return DATA_SPLIT if dim == "dp" else (dim,)


def _rebuild(sizes: dict[str, int]) -> Layout:
    return Layout(**sizes)
