"""Shape-only virtual ranks: the program runs on fake tensors, communication is traced and checked.

``World(n, tensors="shape")`` runs every rank's program under a
``FakeTensorMode`` of its own (``torch._subclasses.fake_tensor``): every
tensor the program creates, parameters included, is a *fake* tensor that has
a shape, a dtype, strides and a device but no data, and every op computes
only the metadata of its result. Collectives check and produce shapes and
dtypes and record the same trace as a real-valued run; the program's control
flow, subgroups, send/recv, handles and autograd run as they do with data.
Compute is skipped, so a step of a 1024-rank program costs what its
communication and its ops' shape propagation cost, not its FLOPs.

**One mode per rank.** A ``FakeTensorMode`` keeps a stack of its entries
(``enter_stack``) and the dispatch mode stack is per thread, so one mode
shared by rank threads that enter and leave it in turns would pop each
other's entries. Each rank thread enters a mode of its own for its whole
program (:func:`rank_mode`). A fake tensor belongs to its mode, and torch
refuses ops that mix modes; so a tensor never crosses ranks as it is:

* the collective math of :mod:`simcomm.collectives` runs on *meta* tensors
  (:func:`compute_on_meta`: each rank's fake input becomes a meta tensor with
  the same shape, dtype and strides; the math yields meta outputs), and
* each rank turns what it receives into a fake tensor of its own mode
  (:func:`own`), on its own thread, where the memory tracker counts it.

**One dispatch cache for every rank.** The ranks of a group run the same ops
on the same shapes, dtypes and strides; torch's ``FakeTensorMode`` keeps its
dispatch cache on the class (``FakeTensorMode.cache``), keyed by the op, each
tensor argument's metadata (shape, dtype, strides, storage offset and size,
device, layout, memory format, requires_grad, conj/neg bits) and the
non-tensor arguments (with their types), not by mode: so the first rank to run
an op computes its result's metadata and every other rank's mode builds its own
output from that entry (a new fake tensor of the asking rank's mode, with its
own storage and version counter; for a view the asking rank's input storage,
for an in-place op the asking rank's input itself, as the op would).
:mod:`simcomm.sim.fake_cache` sits in front of it: the same entries, filed under a
key that is cheaper to build, answered before torch's Python dispatch code is
entered (a hit costs a rank a few microseconds instead of about 40).
:func:`dispatch_cache_info` counts the hits of both (``TORCH_FAKE_TENSOR_DISPATCH_CACHE=0``
turns both off; shapes and traces are the same either way, only slower);
:func:`dispatch_cache_clear` empties both.

**What comes back.** ``World.run`` returns what each rank's program returned:
tensors in it are fake tensors (``.shape``, ``.dtype``, ``.device`` work;
reading values does not). :func:`shapes` turns them into
``torch.Size`` objects.

**torch.distributed.** Programs that use torch.distributed run too: c10d
calls reach the simulator as with data; the functional collectives DTensor
uses (``torch.ops._c10d_functional``), which a fake mode would otherwise
answer with an empty output and no communication, are routed to the rank's
process group (:class:`FunctionalCollectives`); ``DeviceMesh`` keeps real
rank tensors (:func:`install_device_mesh_values`).

**Values of constants.** Scripts compute bookkeeping from constants: a grid of
ranks ``torch.arange(world).view(dp, pp, tp)`` searched with ``nonzero`` and
listed with ``tolist``, drop-path rates from a ``linspace`` read with
``.item()``, a DeviceMesh's ``mesh.tolist()``. A shape-only rank knows the
values of such tensors (:func:`_with_values`, in the rank's
:class:`FunctionalCollectives` mode), by one rule: an op's result has a value
when the op is an aten (or prims) op that is not seeded by a generator and
does not return uninitialised memory (``empty*``), every tensor it is given
has a value (a fake tensor that has one and does not require grad, or a real
CPU tensor, such as ``torch.tensor([...])``'s constant or DeviceMesh's ranks),
and every tensor involved has at most :data:`VALUE_LIMIT` (65,536) elements.
So factories of Python numbers (``arange``, ``linspace``, ``tensor(list)``,
``zeros``/``ones``/``full``, ``eye``) and ops on their results have values;
the op is computed again on the CPU on the values (seen by no dispatch mode
and no memory count), next to its fake result, and the value is kept on the
fake tensor. A view's value is the same view of its base's value, so an
in-place op through a view changes both, as with data. ``.item()``,
``.tolist()``, ``bool(t)``, ``int(t)``, ``nonzero``, boolean masks and
``torch.equal`` on tensors with values answer with those values, the same as
the real-valued run's (computed on the CPU: for a CUDA World, float results
as the CPU computes them). Everything else has no value: parameters (and any
tensor that requires grad), a random op's result (but for index draws, below), uninitialised memory, data
passed in, and a tensor a collective wrote; a value is lost when its storage
is written by an op without values (``x.data.uniform_()`` too) or by a
collective (:func:`forget_values`). The values cost memory on each rank (a
real copy of each such tensor while it lives).

**Values of random bookkeeping.** A shuffle's or a split's indices
(``random_split``, ``RandomSampler``, ``DistributedSampler``: ``randperm(n,
generator=g).tolist()``), a batch's ``randint`` and a sampler's or a
DataLoader's seed (``random_``) are index draws: an integer draw of at most
:data:`RANDOM_INDEX_LIMIT` elements from a CPU generator whose state is known
is computed for real with that generator, which advances as in a real-valued
run, so the values are torchrun's for the same seeds (:func:`_draw`).
Floating-point draws are data (a batch, a weight, dropout's mask): they have
no value, but what they take from the generator depends on their size, dtype
and layout only, so the generator's state is followed through them
(:mod:`simcomm.sim.shape_random`: ``normal_``, ``uniform_``, ``bernoulli_``,
``exponential_``, ``random_``, ``randn``/``rand`` and their ``_like``, the
``nn.init`` functions, dropout): the generator holds a stand-in state until a
value is needed, and is then given the real state, worked out by drawing as
many outputs for real. So a script that builds its model and then a
DataLoader gets torchrun's base seed and shuffle. A draw that is not followed
(one whose consumption depends on values, as ``multinomial``) leaves the
generator unknown until it is seeded again, and a read of a later draw from
it is the named error, saying why. ``FakeTensor.tolist`` answers a tensor
with a value at once, and a 0-dim tensor with a value formats as its number
(``f"{t:.4f}"``) as a plain tensor does (:func:`install_fake_tolist`).

**Loss scaling.** A ``GradScaler`` step on a shape-only rank is the step without overflow
(:mod:`simcomm.sim.shape_amp`): where the gradients have no values,
``_amp_foreach_non_finite_check_and_unscale_`` unscales them as fake tensors and leaves
``found_inf`` with the value it had (``GradScaler``'s constant 0), so ``step`` runs the optimizer
and ``_amp_update_scale_`` computes the scale and growth tracker with values, as a real-valued run
without overflow does; stderr says so once per run (:data:`simcomm.sim.shape_amp.AMP_NOTICE`).

**Conversions that change nothing.** torch swaps a module's fake parameters on
every conversion (``Module._apply``), and the swap fails when the fake mode
holds a weak reference to them ("Couldn't swap"), also for ``Module.to("cpu")``
of a module on the cpu. :func:`install_module_apply` (process-long, installed
with the DeviceMesh wrappers on the first shape-only run) lets a conversion that
returns every parameter and gradient as it is leave the module as torch does
without a swap (``simcomm.patches``: ``"module-apply"``).

**Truncated normal initialisation.** ``torch.nn.init.trunc_normal_`` redraws until
every value lies in its bounds, reading ``mask.any()`` of random data; on a fake tensor
it leaves the tensor as it is (:func:`install_trunc_normal`, process-long, installed with
the DeviceMesh wrappers; ``simcomm.patches``: ``"trunc-normal"``).

**Checkpoints.** ``torch.save`` of a shape-only rank's fake tensors writes meta tensors (shape,
dtype, strides, requires_grad; a fake Parameter as a meta Parameter; a DTensor over one as a
DTensor on the meta device), and ``torch.load`` gives them back; stderr says so once per run
(:func:`install_fake_pickling`, process-long, installed with the DeviceMesh wrappers;
``simcomm.patches``: ``"fake-pickling"``). ``dcp.save``/``dcp.load`` do not run shape-only
(their plans travel by object collectives): the ShapeOnlyError names them.

**Unsupported.** An op that needs values that a rank does not have
(``.item()``, ``.tolist()``, ``bool(t)``, ``torch.nonzero``, a data-dependent
split, on a tensor without a value; ``.numpy()`` on any fake tensor) raises
:class:`~simcomm.errors.ShapeOnlyError` naming the op and the rank (:func:`data_dependent_error`).
Such programs need the real-valued mode, or the value given as a Python
number. So does ``dist.all_to_all_single`` with uneven split sizes (the
simcomm c10d backend reads the longest split with ``.item()``). Changing a
module's dtype in place (``Module.double()``) works only when torch can swap
the fake parameters (it refuses when something holds a weak reference to
them, depending on torch's state in the process); its refusal is a
:class:`~simcomm.errors.ShapeOnlyError` too: create the module with ``dtype=`` instead.
``DistributedDataParallel`` of a module with fake tensors is
:class:`simcomm.sim.shape_ddp.ShapeOnlyDDP`: torch's C++ reads parameter and gradient data
(the check of parameter shapes across ranks, the reducer's buckets), so the same collectives
are issued from Python (:func:`install_device_mesh_values` installs it).
"""
from __future__ import annotations

import contextlib
import functools
import os
import traceback
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
    UnsupportedFakeTensorException,
    is_fake,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import ShapeOnlyError
from . import fake_cache as _fake_cache
from . import shape_amp as _shape_amp
from . import shape_random as _shape_random
from . import shape_reads as _shape_reads

__all__ = ["TENSOR_MODES", "check_shape_device", "rank_mode", "dispatch_cache_info", "dispatch_cache_clear",
           "fake_arguments",
           "compute_on_meta", "own",
           "shapes", "is_shape_only", "data_dependent_error", "trace_signature", "FunctionalCollectives",
           "install_device_mesh_values", "install_module_apply", "install_fake_pickling", "install_trunc_normal", "install_fake_tolist", "SAVE_NOTICE", "value_of", "forget_values",
           "VALUE_LIMIT", "RANDOM_INDEX_LIMIT"]

#: the values of ``World(..., tensors=)``
TENSOR_MODES = ("real", "shape")

#: torch's errors for an op whose result depends on values a fake tensor does not have
_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException)


#: how a program reads values, by the aten op torch reports
_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
#: what a refused read adds: a floating-point value a program only prints can read nan instead
_STAND_IN_HINT = ("; a floating-point value the program only prints or logs (a loss) can read nan "
                  "instead: scalar_reads='nan' (python -m simcomm.run --scalar-reads nan)")
_VALUE_READS = {"aten._local_scalar_dense.default": "a value read (.item(), .tolist(), bool(t), int(t): "
                                                    "aten._local_scalar_dense)"}


def check_shape_device(device: torch.device) -> None:
    """Refuse a shape-only CUDA device where torch cannot fake one: raise :class:`~simcomm.errors.ShapeOnlyError`.

    A ``FakeTensorMode`` makes CUDA tensors on any machine (``torch.empty(n, device="cuda")``
    gives a fake tensor whose ``device`` is ``cuda:0``, and most ops run on it), but on a build
    of torch without CUDA (``torch.backends.cuda.is_built()`` false) there is no CUDA device
    guard: ``Tensor.copy_``, ``.cuda()``, ``.to("cuda")``, ``nn.init``'s ``uniform_`` fail, and
    autograd's engine, which asks for the device guard of every CUDA tensor that requires grad
    (``InputMetadata``), aborts the whole process (``std::terminate``, no Python exception).
    torch's own fallback (``torch._C._ensureCUDADeviceGuardSet``, called by ``FakeTensorMode``)
    does not install one on such a build. So a shape-only CUDA run needs a CUDA build of torch
    (torch's comment says one without a GPU gets a no-op guard; not verified here); on a CPU-only
    build use ``device="cpu", map_cuda=True`` (:mod:`simcomm.sim.cuda_map`).
    """
    if device.type == "cuda" and not torch.backends.cuda.is_built():
        raise ShapeOnlyError(
            f"World: tensors='shape' with device={str(device)!r} needs a CUDA build of torch, and this "
            f"torch {torch.__version__} is built without CUDA: its fake CUDA "
            f"tensors have no device guard, so Tensor.copy_/.cuda()/.to('cuda')/nn.init fail and "
            f"autograd aborts the process on a CUDA tensor that requires grad. Use device='cpu' with "
            f"map_cuda=True: the program's 'cuda' then means cpu and torch.cuda answers as one GPU per "
            f"rank (simcomm.sim.cuda_map; shapes, dtypes, trace, memory and FLOPs are the same; tensors "
            f"report device cpu)")


def rank_mode(scalar_reads: str = "error") -> FakeTensorMode:
    """A fresh ``FakeTensorMode`` for one rank thread (see the module docstring); ``scalar_reads``:
    the run's rule for reads of floating-point values the rank does not have
    (:mod:`simcomm.sim.shape_reads`)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    _shape_reads.set_scalar_reads(mode, scalar_reads)
    # copy.deepcopy of a fake tensor copies its __dict__, the fake mode with it: the copy of a rank's
    # tensor (a snapshot's state dict, dataclasses.asdict) belongs to the rank's own mode, as every
    # tensor a rank makes does (a copied mode would copy the rank's bookkeeping, real tensors among it)
    mode.__deepcopy__ = functools.partial(_same_mode, weakref.ref(mode))
    _RANK_MODES.add(mode)
    return mode


def _same_mode(mode: "weakref.ref[FakeTensorMode]", memo: dict) -> FakeTensorMode | None:
    return mode()


def dispatch_cache_info() -> dict[str, Any]:
    """The fake dispatch cache the shape-only ranks share (module docstring), for this process
    since it started or since :func:`dispatch_cache_clear`: ``hits`` (answered by
    :mod:`simcomm.sim.fake_cache` or by torch's cache behind it; ``shared_hits``: by the
    first), ``misses``, ``bypasses`` (ops torch does not cache, by reason), ``entries`` and
    ``hit_rate`` (hits over every dispatch that consulted a cache, bypassed ones included)."""
    info = FakeTensorMode.cache_info()
    front = _fake_cache.cache_info()
    hits = info.hits + front["hits"]
    bypasses = dict(info.bypasses)
    if front["computed"]:       # torch's negative entries, not looked up again (simcomm.sim.fake_cache)
        bypasses["negative entry (not looked up again)"] = front["computed"]
    consulted = hits + info.misses + sum(bypasses.values())
    return {"hits": hits, "shared_hits": front["hits"], "misses": info.misses, "bypasses": bypasses,
            "entries": info.size, "hit_rate": hits / consulted if consulted else 0.0}


def dispatch_cache_clear() -> None:
    """Empty torch's fake dispatch cache and simcomm's in front of it, with their counts."""
    FakeTensorMode.cache_clear()
    _fake_cache.cache_clear()


def is_shape_only() -> bool:
    """Whether this thread runs inside a fake mode (a shape-only rank)."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def fake_arguments(args: tuple, kwargs: dict, mode: FakeTensorMode, device: torch.device,
                   copy_other: Callable[[Any, dict], Any] | None = None) -> tuple[tuple, dict]:
    """One rank's arguments with every tensor (and every module's parameters and buffers)
    turned into a fake tensor of ``mode`` on ``device``. The caller's objects are not modified;
    no data is copied (a fake tensor holds metadata only). Any other leaf goes through
    ``copy_other(leaf, memo)`` (the rank's own copy of a mutable object) when it is given."""
    import copy

    def convert(tensor: torch.Tensor) -> torch.Tensor:
        fake = mode.from_tensor(tensor, static_shapes=True)
        if fake.device != device:
            with mode:
                fake = fake.to(device)
        if isinstance(tensor, torch.nn.Parameter) and not isinstance(fake, torch.nn.Parameter):
            fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
        return fake

    leaves, spec = pytree.tree_flatten((args, kwargs))
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            leaf = convert(leaf)
        elif isinstance(leaf, torch.nn.Module):
            # a module's structure is copied without its tensors' data: every tensor is swapped
            # for a fake one in the copy's own dicts
            memo: dict = {}
            for tensor in (*leaf.parameters(), *leaf.buffers()):
                memo[id(tensor)] = convert(tensor)
            leaf = copy.deepcopy(leaf, memo)
        elif copy_other is not None:
            leaf = copy_other(leaf, {})
        out.append(leaf)
    return pytree.tree_unflatten(out, spec)


def _to_meta(value: Any, made: dict) -> Any:
    """``value`` with every tensor replaced by a meta tensor of its shape, strides and dtype;
    ``made`` holds the meta tensors made so far by that metadata, and tensors alike get the
    same one (a meta tensor holds nothing a collective's math could change)."""
    if isinstance(value, torch.Tensor):
        key = (value.shape, value.stride(), value.dtype)
        meta = made.get(key)
        if meta is None:
            meta = made[key] = torch.empty_strided(value.shape, key[1], dtype=value.dtype, device="meta")
        return meta
    if isinstance(value, tuple):
        return tuple(_to_meta(item, made) for item in value)
    if isinstance(value, list):
        return [_to_meta(item, made) for item in value]
    return value


@contextlib.contextmanager
def _no_fake_mode() -> Iterator[None]:
    mode = torch._C._unset_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    try:
        yield
    finally:
        if mode is not None:
            torch._C._set_dispatch_mode(mode)


def compute_on_meta(compute: Callable[[list], list], inputs: list) -> list:
    """Run a collective's math (``compute``, a list of per-rank inputs in, a list out) on meta
    tensors with the metadata of ``inputs`` (fake tensors of several ranks' modes): the
    outputs are meta tensors of the shapes and dtypes a real-valued run produces. No dispatch
    mode sees the math (as no mode of a real process sees its backend's reduction): the rank's
    own modes would only pass meta tensors on. Inputs alike (the same shape, strides and
    dtype: every member of a data-parallel group) share one meta tensor, made once."""
    made: dict = {}
    with _no_fake_mode(), torch.no_grad(), torch._C._DisableTorchDispatch():
        return compute([_to_meta(entry, made) for entry in inputs])


_stack_length = torch._C._len_torch_dispatch_stack
_stack_at = torch._C._get_dispatch_stack_at
_get_dispatch_mode = torch._C._get_dispatch_mode


def _rank_fake_mode_alone() -> FakeTensorMode | None:
    """The rank's fake mode when it and the rank's :class:`FunctionalCollectives` above it are
    the only dispatch modes set (no program's own mode, memory tracker, tracing or inference
    mode); otherwise None."""
    # the stack counts the fake mode (set in its own slot, below every mode pushed) as one
    if _stack_length() != 2 or torch.is_inference_mode_enabled():
        return None
    top = _stack_at(1)
    mode = top.fake_mode if type(top) is FunctionalCollectives else None
    return mode if mode is not None and _get_dispatch_mode(_FAKE_KEY) is mode else None


def own(value: Any, device: torch.device) -> Any:
    """What a shape-only rank receives, as fake tensors of its own mode on ``device``.

    Meta tensors (a collective's outputs) and other ranks' fake tensors (a message
    in flight) are rebuilt from their metadata; anything else passes through.
    Called on the receiving rank's thread, inside its mode: what ``torch.empty_strided``
    returns there, built directly (:func:`simcomm.sim.fake_cache.empty`) while the rank's
    own two modes are all that is set, as a native backend makes its output where no
    Python mode sees it.
    """
    if isinstance(value, torch.Tensor):
        if value.is_meta or isinstance(value, FakeTensor):
            mode = _rank_fake_mode_alone() if device.type == "cpu" else None
            if mode is not None:
                return _fake_cache.empty(mode, value.shape, value.stride(), value.dtype, device)
            return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
        return value
    if isinstance(value, tuple):
        return tuple(own(item, device) for item in value)
    return value


def shapes(value: Any) -> Any:
    """``value`` with every tensor replaced by its ``torch.Size`` (lists, tuples, dicts kept)."""
    return pytree.tree_map(lambda leaf: leaf.shape if isinstance(leaf, torch.Tensor) else leaf, value)


def trace_signature(trace) -> dict[int, list[tuple]]:
    """What a trace says about communication, without times: per rank, in program order, each
    call's op, group, step, phase, shapes, dtype, bytes, root, bytes per peer and arguments.

    Equal for a shape-only and a real-valued run of the same program.
    """
    by_rank: dict[int, list[tuple]] = {}
    for event in trace.events:
        by_rank.setdefault(event.rank, []).append((
            event.op, event.group, event.step, event.phase, event.shape, event.out_shape, event.dtype,
            event.nbytes, event.root, event.async_op, tuple(sorted(event.sent.items())),
            tuple(sorted(event.received.items())), repr(sorted(event.args.items()))))
    return by_rank


def data_dependent_error(error: BaseException, rank: int) -> ShapeOnlyError | None:
    """A :class:`~simcomm.errors.ShapeOnlyError` naming the op and the rank when ``error`` (or what caused it)
    is torch's refusal to compute a value from a fake tensor; ``None`` otherwise. A refusal inside
    ``torch.distributed.checkpoint``'s save or load names ``dcp.save``/``dcp.load`` (:func:`_dcp_error`)."""
    refusal = _refusal(error, rank)
    return _dcp_error(error, rank, refusal) if refusal is not None else None


_DCP_CALLS = (("torch/distributed/checkpoint/state_dict_saver.py", "dcp.save"),
              ("torch/distributed/checkpoint/state_dict_loader.py", "dcp.load"))


def _dcp_error(error: BaseException, rank: int, refusal: ShapeOnlyError) -> ShapeOnlyError:
    """``refusal``, or, when ``error`` was raised inside dcp.save/dcp.load, a ShapeOnlyError that
    names that call and what to do."""
    files = [frame.filename.replace("\\", "/") for frame in traceback.extract_tb(error.__traceback__)]
    for suffix, call in _DCP_CALLS:
        if any(name.endswith(suffix) for name in files):
            return ShapeOnlyError(
                f"rank {rank}: torch.distributed.checkpoint ({call}) cannot run on shape-only ranks "
                f"(World(..., tensors='shape'), simcomm.run --tensors shape): it agrees on its plan "
                f"across ranks with object collectives (gather_object, broadcast_object_list), which "
                f"read pickled sizes and bytes from tensors, and fake tensors have no values. "
                f"Run this program with tensors='real', or save the full state dict with torch.save, "
                f"which on shape-only ranks writes meta tensors (shapes and dtypes only)")
    return refusal


def _refusal(error: BaseException, rank: int) -> ShapeOnlyError | None:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, _DATA_DEPENDENT):
            op = getattr(error, "func", None)
            name = str(op) if op is not None else type(error).__name__
            name = _VALUE_READS.get(name, name)
            return ShapeOnlyError(
                f"rank {rank}: {name} needs tensor values, which a shape-only run "
                f"(World(..., tensors='shape')) does not have (e.g. .item(), .tolist(), bool(t), "
                f"nonzero, or split sizes read from a tensor): it knows the values of small tensors "
                f"computed from constants only (arange, linspace, torch.tensor, zeros/ones/full, eye "
                f"and ops on them), not of data, parameters, random ops or what a collective wrote; "
                f"run this program with tensors='real', or compute the value from shapes or Python numbers"
                f"{_STAND_IN_HINT if op is _SCALAR_READ else ''}{getattr(error, 'simcomm_note', '')}")
        if isinstance(error, RuntimeError) and str(error).startswith(_NUMPY_REFUSAL):
            return ShapeOnlyError(
                f"rank {rank}: .numpy() needs tensor values, which a shape-only run "
                f"(World(..., tensors='shape')) does not have; run this program with tensors='real', "
                f"or keep the computation in torch (shapes and dtypes work)")
        if isinstance(error, RuntimeError) and str(error).startswith(_NO_DATA):
            return _no_data_error(error, rank)
        if isinstance(error, RuntimeError) and str(error).startswith("_apply(): Couldn't swap"):
            return ShapeOnlyError(
                f"rank {rank}: {error}: torch cannot change the dtype or device of a module's fake "
                f"parameters in place (Module.to/.double()/.half() on a shape-only rank); create the "
                f"module with dtype=/device= (or torch.set_default_dtype) instead")
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


_NUMPY_REFUSAL = ".numpy() is not supported for tensor subclasses"
_NO_DATA = "The tensor has a non-zero number of elements, but its data is not allocated yet"
_DDP_FILE = "torch/nn/parallel/distributed.py"


def _no_data_error(error: BaseException, rank: int) -> ShapeOnlyError:
    """torch's C++ code read the storage of a fake tensor: name who did, and what to do."""
    frames = traceback.extract_tb(error.__traceback__)
    if any(frame.filename.replace("\\", "/").endswith(_DDP_FILE) for frame in frames):
        return ShapeOnlyError(
            f"rank {rank}: DistributedDataParallel cannot run on shape-only ranks "
            f"(World(..., tensors='shape')): its C++ code (the parameter check across ranks and the "
            f"reducer's gradient buckets) reads tensor data, which fake tensors do not have; run it "
            f"with tensors='real', or plan with FSDP2 (fully_shard) or DTensor, which run shape-only")
    inside = [frame for frame in frames if "/torch/" in frame.filename.replace("\\", "/")]
    where = f" (in {inside[-1].name}, {inside[-1].filename.rsplit('site-packages/', 1)[-1]})" if inside else ""
    return ShapeOnlyError(
        f"rank {rank}: torch's C++ code read the data of a tensor{where}, which a shape-only run "
        f"(World(..., tensors='shape')) does not have; run this program with tensors='real'")


# -- torch.distributed's own bookkeeping tensors ------------------------------------------------

_OUTSIDE_FAKE_INSTALLED = False


def _outside_fake(function: Callable) -> Callable:
    def run(*args, **kwargs):
        with _no_fake_mode():
            return function(*args, **kwargs)
    run.__wrapped__ = function
    run.__name__, run.__qualname__, run.__doc__ = function.__name__, function.__qualname__, function.__doc__
    return run


def install_device_mesh_values() -> None:
    """Let ``DeviceMesh`` keep real rank tensors on shape-only ranks.

    A ``DeviceMesh`` holds the ranks of its dims in an integer tensor and reads
    them back with ``.tolist()``: bookkeeping, not model data. Its methods and
    ``init_device_mesh`` run with the rank's fake mode set aside, so that tensor
    holds values; fake ops that meet it turn it into a fake tensor
    (``allow_non_fake_inputs``). Installed once, on the first shape-only run;
    outside a fake mode the wrappers change nothing.
    """
    global _OUTSIDE_FAKE_INSTALLED
    if _OUTSIDE_FAKE_INSTALLED:
        return
    from torch.distributed import device_mesh

    mesh_class = device_mesh.DeviceMesh
    for name, value in list(vars(mesh_class).items()):
        if callable(value) and not isinstance(value, type) and not name.startswith("__") or name == "__init__":
            if isinstance(value, (staticmethod, classmethod)):
                continue
            setattr(mesh_class, name, _outside_fake(value))
    import sys

    import torch.distributed.fsdp  # noqa: F401  (modules that import init_device_mesh by name)
    import torch.distributed.tensor.parallel  # noqa: F401

    original = device_mesh.init_device_mesh
    wrapped = _outside_fake(original)
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(module, "init_device_mesh", None) is original:
            module.init_device_mesh = wrapped
    _OUTSIDE_FAKE_INSTALLED = True
    install_module_apply()      # the first shape-only run installs all four
    install_fake_pickling()
    install_trunc_normal()
    install_fake_tolist()
    from .shape_ddp import install_shape_ddp
    install_shape_ddp()         # DDP(...) of a module with fake tensors: the Python ShapeOnlyDDP


# -- a module conversion that changes nothing ----------------------------------------------------

_torch_module_apply: Callable | None = None


def _plain_tree(module: torch.nn.Module, recurse: bool) -> list[torch.nn.Module] | None:
    modules = list(module.modules()) if recurse else [module]
    return modules if all(type(each)._apply is _module_apply for each in modules) else None


def _module_apply(self: torch.nn.Module, fn: Callable, recurse: bool = True) -> torch.nn.Module:
    """``Module._apply`` (what ``Module.to``/``.cpu()``/``.float()``... call), where a conversion
    that changes no parameter also works on a shape-only rank.

    torch swaps every fake parameter for its converted one (``torch.utils.swap_tensors``), which
    fails when the fake mode holds a weak reference to it ("Couldn't swap"), even where the
    conversion returns the parameter itself (``Module.to("cpu")`` of a module on the cpu). When
    ``fn`` returns every parameter and gradient as it is, and no module of the tree overrides
    ``_apply``, the module is left as torch leaves it then (its buffers set to ``fn(buffer)``,
    its parameters unchanged) without a swap. Otherwise, and everywhere but on a shape-only
    rank, torch's own ``_apply`` runs (``fn`` is called once more on what was checked: the
    conversions ``_apply`` is given return a new tensor or the same one, and change nothing)."""
    if is_shape_only():
        modules = _plain_tree(self, recurse)
        if modules is not None:
            with torch.no_grad():
                unchanged = all(fn(tensor) is tensor for each in modules
                                for param in each._parameters.values() if param is not None
                                for tensor in ((param,) if param.grad is None else (param, param.grad)))
            if unchanged:
                for each in modules:
                    for key, buffer in each._buffers.items():
                        if buffer is not None:
                            each._buffers[key] = fn(buffer)
                return self
    return _torch_module_apply(self, fn, recurse)


def install_module_apply() -> None:
    """Put :func:`_module_apply` in ``torch.nn.Module._apply``'s place (once per process)."""
    global _torch_module_apply
    if _torch_module_apply is None:
        _torch_module_apply = torch.nn.Module._apply
        torch.nn.Module._apply = _module_apply      # simcomm.patches: "module-apply"


# -- a truncated normal initialisation of a fake tensor --------------------------------------------

_torch_trunc_normal: Callable | None = None


def _trunc_normal(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """torch's ``torch.nn.init._no_grad_trunc_normal_`` (what ``trunc_normal_`` calls), where
    a fake tensor is left as it is.

    torch's draws, then redraws the values outside ``[a, b]`` until none is left, reading
    ``mask.any()`` each time: a value of random data, which a shape-only rank does not have
    (ShapeOnlyError), though the result is a tensor of the same shape whose values a shape-only
    rank never has either. Any other tensor (real values, on every thread) gets torch's own."""
    if is_fake(tensor):
        if type(tensor) is FakeTensor:
            _shape_random.follow_trunc_normal(_torch_trunc_normal, tensor, args, kwargs, tensor.fake_mode)
        return tensor
    return _torch_trunc_normal(tensor, *args, **kwargs)


def install_trunc_normal() -> None:
    """Put :func:`_trunc_normal` in ``torch.nn.init._no_grad_trunc_normal_``'s place (once per
    process), where torch's ``trunc_normal_`` looks it up on each call."""
    global _torch_trunc_normal
    if _torch_trunc_normal is None and hasattr(torch.nn.init, "_no_grad_trunc_normal_"):
        _torch_trunc_normal = torch.nn.init._no_grad_trunc_normal_
        torch.nn.init._no_grad_trunc_normal_ = _trunc_normal      # simcomm.patches: "trunc-normal"


# -- saving fake tensors: meta tensors in the file ----------------------------------------------

_RANK_MODES: weakref.WeakSet = weakref.WeakSet()     # the fake modes rank_mode made
_torch_fake_reduce_ex: Callable | None = None
_torch_rebuild_tensor: Callable | None = None

SAVE_NOTICE = ("simcomm: checkpoints written by shape-only ranks (tensors='shape') hold shapes and "
               "dtypes only: torch.save wrote each fake tensor as a meta tensor, and torch.load gives "
               "meta tensors")


def _fake_reduce_ex(self: torch.Tensor, proto: int):
    """``FakeTensor.__reduce_ex__``: a fake tensor of a shape-only rank pickles (``torch.save``,
    ``pickle``) as the meta tensor of its shape, dtype, strides and ``requires_grad`` (torch's
    own reduction of a meta tensor; ``torch.load`` gives that meta tensor); any other fake
    tensor as torch pickles it."""
    if self.fake_mode in _RANK_MODES:
        _shape_reads.notice_once(SAVE_NOTICE)
        if getattr(self, "_is_param", False):       # a fake nn.Parameter: a meta Parameter
            with _no_fake_mode(), torch._C._DisableTorchDispatch():
                data = torch.empty_strided(self.size(), self.stride(), dtype=self.dtype, device="meta")
            return (torch._utils._rebuild_parameter, (data, self.requires_grad, OrderedDict()))
        return (torch._utils._rebuild_meta_tensor_no_storage,
                (self.dtype, tuple(self.size()), self.stride(), self.requires_grad))
    return _torch_fake_reduce_ex(self, proto)


def _dtensor_reduce_ex(self: torch.Tensor, proto: int):
    """``DTensor.__reduce_ex__``: torch's own reduction of a DTensor, where a DTensor whose local
    tensor is a shape-only rank's fake tensor is rebuilt on the meta device, as its local tensor
    is (:func:`_fake_reduce_ex`): torch's reduction names the DTensor's own device."""
    reduced = torch.Tensor.__reduce_ex__(self, proto)
    local = getattr(self, "_local_tensor", None)
    if isinstance(local, FakeTensor) and local.fake_mode in _RANK_MODES:
        function, (rebuild, cls, args, state) = reduced
        if function is torch._tensor._rebuild_from_type_v2 and rebuild is torch._utils._rebuild_wrapper_subclass:
            args = (*args[:6], torch.device("meta"), *args[7:])
            return function, (rebuild, cls, args, state)
    return reduced


def _rank_mode_here() -> FakeTensorMode | None:
    """The fake mode of the shape-only rank this thread runs, where it is set; else None."""
    mode = _get_fake_mode(_FAKE_KEY)
    return mode if mode is not None and mode in _RANK_MODES else None


def _fake_deepcopy(self: torch.Tensor, memo: dict) -> torch.Tensor:
    """``FakeTensor.__deepcopy__``: torch's (``Tensor.__deepcopy__``: a clone, then a deep copy of
    the tensor's ``__dict__``), where the real constant a shape-only rank's fake tensor keeps (a
    scalar made from a Python number, as an optimizer's ``step``) is copied outside the rank's fake
    mode: under it, the copy of a real tensor's storage fails ("set the storage of a tensor on
    device meta"), so ``copy.deepcopy`` of an optimizer's state dict did. Any other fake tensor:
    torch's own."""
    constant = self.__dict__.get("constant")
    if self.fake_mode in _RANK_MODES and isinstance(constant, torch.Tensor) and id(constant) not in memo:
        with _no_fake_mode(), torch._C._DisableTorchDispatch():
            memo[id(constant)] = constant.clone()
    return torch.Tensor.__deepcopy__(self, memo)


def _rebuild_tensor_received(cls: type, storage: Any, metadata: Any) -> torch.Tensor:
    """``torch.multiprocessing.reductions.rebuild_tensor``: a tensor another process sent (a
    DataLoader worker's batch, on shared memory) is data, and on a shape-only rank it is rebuilt
    as the real tensor it is, outside the rank's fake mode (torch's own, under the fake mode,
    fails to set a fake tensor's storage to the real shared one); the program then meets it as
    it meets any real tensor it made outside its ranks."""
    if _rank_mode_here() is None:
        return _torch_rebuild_tensor(cls, storage, metadata)
    with _no_fake_mode():
        return _torch_rebuild_tensor(cls, storage, metadata)


def _leave_rank_mode_in_child() -> None:
    """In a process a shape-only rank forks (a DataLoader worker): the child is a process of its
    own, whose dataset reads and collates real data, as under torchrun; the rank's fake mode,
    set on the forking thread, is not set in it."""
    if _rank_mode_here() is not None:
        torch._C._unset_dispatch_mode(_FAKE_KEY)


def install_fake_pickling() -> None:
    """Put :func:`_fake_reduce_ex` in ``FakeTensor.__reduce_ex__``'s place,
    :func:`_dtensor_reduce_ex` in ``DTensor.__reduce_ex__``'s, :func:`_fake_deepcopy` as
    ``FakeTensor.__deepcopy__`` and :func:`_rebuild_tensor_received` in ``torch.multiprocessing.reductions.rebuild_tensor``'s,
    and have a child a shape-only rank forks leave its fake mode (:func:`_leave_rank_mode_in_child`;
    once per process)."""
    global _torch_fake_reduce_ex, _torch_rebuild_tensor
    if _torch_fake_reduce_ex is None:
        from torch.distributed.tensor import DTensor
        from torch.multiprocessing import reductions

        _torch_fake_reduce_ex = FakeTensor.__reduce_ex__
        FakeTensor.__reduce_ex__ = _fake_reduce_ex      # simcomm.patches: "fake-pickling"
        DTensor.__reduce_ex__ = _dtensor_reduce_ex      # simcomm.patches: "fake-pickling"
        FakeTensor.__deepcopy__ = _fake_deepcopy        # simcomm.patches: "fake-pickling"
        _torch_rebuild_tensor = reductions.rebuild_tensor
        # pickled by name: the stand-in is found as torch's function is, in a process that has it or not
        _rebuild_tensor_received.__module__ = reductions.__name__
        _rebuild_tensor_received.__qualname__ = _rebuild_tensor_received.__name__ = "rebuild_tensor"
        reductions.rebuild_tensor = _rebuild_tensor_received   # simcomm.patches: "fake-pickling"
        os.register_at_fork(after_in_child=_leave_rank_mode_in_child)


# -- functional collectives ----------------------------------------------------------------------

def _group(name: Any):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    return name if isinstance(name, dist.ProcessGroup) else c10d._resolve_process_group(name)


def _reduce_op(name: str):
    import torch.distributed as dist

    return getattr(dist.ReduceOp, {"prod": "PRODUCT", "mean": "AVG"}.get(name.lower(), name.upper()))


def _functional(func, args: tuple, kwargs: dict):
    """One ``_c10d_functional`` op on the rank's process group, through torch.distributed's
    c10d API (the path the op's own kernel takes on a real backend): issued asynchronously,
    as a functional collective is, and waited at once, so the trace matches the real-valued
    run's (``async_op`` set); the order of the calls is the same."""
    import torch.distributed as dist

    name = func._overloadpacket.__name__
    bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
    if name == "wait_tensor":
        return bound["tensor"]
    group = _group(bound["group_name"])
    if name in ("all_reduce", "all_reduce_"):
        out = bound["input"] if name == "all_reduce_" else bound["input"].clone()
        dist.all_reduce(out, op=_reduce_op(bound["reduce_op"]), group=group, async_op=True).wait()
        return out
    if name == "all_reduce_coalesced":
        outs = [tensor.clone() for tensor in bound["inputs"]]
        for out in outs:
            dist.all_reduce(out, op=_reduce_op(bound["reduce_op"]), group=group, async_op=True).wait()
        return outs
    if name in ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"):
        inputs = bound["inputs"] if name.endswith("coalesced") else [bound["input"]]
        outs = [bound["out"]] if name.endswith("_out") else [
            tensor.new_empty((bound["group_size"] * tensor.shape[0], *tensor.shape[1:])) for tensor in inputs]
        for out, tensor in zip(outs, inputs):
            dist.all_gather_into_tensor(out, tensor.contiguous(), group=group, async_op=True).wait()
        return outs if name.endswith("coalesced") else outs[0]
    if name in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        inputs = bound["inputs"] if name.endswith("coalesced") else [bound["input"]]
        outs = []
        for tensor in inputs:
            out = tensor.new_empty((tensor.shape[0] // bound["group_size"], *tensor.shape[1:]))
            dist.reduce_scatter_tensor(out, tensor.contiguous(), op=_reduce_op(bound["reduce_op"]), group=group, async_op=True).wait()
            outs.append(out)
        return outs if name.endswith("coalesced") else outs[0]
    if name == "all_to_all_single":
        tensor = bound["input"]
        out_splits, in_splits = list(bound["output_split_sizes"]), list(bound["input_split_sizes"])
        rows = sum(out_splits) if out_splits else tensor.shape[0]
        out = tensor.new_empty((rows, *tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), out_splits or None, in_splits or None, group=group, async_op=True).wait()
        return out
    if name in ("broadcast", "broadcast_"):
        out = bound["input"] if name == "broadcast_" else bound["input"].clone()
        dist.broadcast(out, group_src=bound["src"], group=group, async_op=True).wait()
        return out
    raise ShapeOnlyError(f"{func} is not supported on shape-only ranks (World(..., tensors='shape')); "
                         f"use the torch.distributed call it stands for")


_get_fake_mode = torch._C._get_dispatch_mode
_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
_PRIM_DEVICE = torch.ops.prim.device.default
_META = torch.device("meta")
_QUERIES = _fake_cache.QUERIES


class FunctionalCollectives(TorchDispatchMode):
    """Runs torch's functional collectives (``torch.ops._c10d_functional``, what DTensor and
    ``torch.distributed._functional_collectives`` call) on the rank's process group.

    Under a fake mode those ops would otherwise get their fake kernels: an output of the
    right shape, no communication, nothing traced. Pushed above the rank's fake mode
    ``fake_mode``, every other op goes through the ranks' shared dispatch cache
    (:func:`simcomm.sim.fake_cache.dispatch`) on its way to that mode, while that mode is
    the thread's fake mode; otherwise (no ``fake_mode``, or another fake mode set, or none)
    straight on. On the way it keeps the values of small tensors computed from constants
    (:func:`_with_values`; module docstring, "Values of constants"), also for the rank's fake
    tensors met while its fake mode is set aside (DeviceMesh's bookkeeping).
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo (a few us per op, a
        # seventh of a shape-only rank's time in ops) unless the mode declines. The wrapper only
        # keeps torch.compile from tracing into this method, and this project compiles nothing on
        # shape-only ranks
        return False

    def __init__(self, fake_mode: FakeTensorMode | None = None):
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        fake_mode = self.fake_mode
        if fake_mode is not None and _get_fake_mode(_FAKE_KEY) is not fake_mode:
            fake_mode = None           # another fake mode, or none, is set (the program's own, or
            #                            DeviceMesh's bookkeeping outside it): torch decides
        if fake_mode is not None:
            if func is _PRIM_DEVICE and type(args[0]) is FakeTensor and len(args) == 1:
                # autograd asks the device of every tensor it meets: most calls. What the fake
                # mode's own handler answers (fake_tensor._device_handler), without the call
                tensor = args[0]
                return _META if tensor.fake_mode.in_kernel_invocation else tensor._fake_device
            query = _QUERIES.get(func)    # aten.size, aten.stride, ...
            if query is not None:
                return query(args)
        if func.namespace == "_c10d_functional":
            return _functional(func, args, kwargs or {})
        if fake_mode is not None:
            return _with_values(func, types, args, kwargs or {}, fake_mode)
        if self.fake_mode is not None and _get_fake_mode(_FAKE_KEY) is None:
            # the rank's fake tensors met outside its fake mode (DeviceMesh's bookkeeping): they
            # keep their values there too
            return _with_values(func, types, args, kwargs or {}, self.fake_mode, outside=True)
        return func(*args, **(kwargs or {}))


# -- values of small tensors computed from constants ---------------------------------------------

#: the most elements a tensor with a value may have (:func:`_with_values`)
VALUE_LIMIT = 65536

_VALUE = "_simcomm_value"          # a fake tensor's attribute: (value, storage key, token)


class _ValueEntry(tuple):
    """A fake tensor's value, its storage's key and token. ``copy.deepcopy`` of the tensor copies its
    ``__dict__``; the copy has a storage of its own, so this entry (kept as it is, not copied: its
    value is a real tensor, which cannot be copied under the fake mode) does not match it, and the
    copy has no value, as a copy made by an op without values."""

    __slots__ = ()

    def __deepcopy__(self, memo: dict) -> "_ValueEntry":
        return self


_LIVE = "_simcomm_values"          # a fake mode's attribute: {storage key: token} of valid values
_NO_VALUE_OPS = frozenset({
    # uninitialised memory: no values to know
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
    torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.new_empty_strided.default, torch.ops.aten.empty_permuted.default,
    torch.ops.aten.resize_.default, torch.ops.aten.set_.source_Storage_storage_offset,
    torch.ops.aten.set_.source_Tensor, torch.ops.aten.set_.default,
})
_RULES: dict = {}


class _Rule:
    """What an op means for values: whether it can give any (``valued``: an aten or prims op, not
    seeded by a generator, not uninitialised memory), which arguments it writes
    (``mutated``: (position, name) pairs) and whether its outputs are views of its inputs."""

    __slots__ = ("valued", "mutated", "seeded", "without_values")

    def __init__(self, func):
        #: a random op: it draws from a generator (:func:`_draw`)
        self.seeded = torch.Tag.nondeterministic_seeded in func.tags
        self.valued = (func.namespace in ("aten", "prims") and func not in _NO_VALUE_OPS
                       and not self.seeded)
        self.mutated = tuple((index, argument.name) for index, argument in enumerate(func._schema.arguments)
                             if argument.alias_info is not None and argument.alias_info.is_write)
        #: what the op writes where its tensors have no values, by a rule (shape_amp: GradScaler)
        self.without_values = _shape_amp.WITHOUT_OVERFLOW.get(func)


def _rule(func) -> _Rule:
    rule = _RULES.get(func)
    if rule is None:
        rule = _RULES[func] = _Rule(func)
    return rule


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


def value_of(tensor: Any) -> torch.Tensor | None:
    """The value a shape-only rank knows for ``tensor`` (a real CPU tensor), or None: a fake tensor
    computed from constants only (module docstring, "Values of constants"), whose storage has not been
    written since by anything without a value."""
    entry = getattr(tensor, _VALUE, None) if type(tensor) is FakeTensor else None
    if entry is None:
        return None
    live = getattr(tensor.fake_mode, _LIVE, None)
    return entry[0] if live is not None and live.get(entry[1]) is entry[2] else None


def forget_values(tensor: Any) -> None:
    """``tensor``'s storage was written by something that is no op (a collective's output buffer):
    every tensor on that storage loses its value."""
    if type(tensor) is FakeTensor:
        live = getattr(tensor.fake_mode, _LIVE, None)
        if live:
            live.pop(_storage_key(tensor), None)
        if tensor.constant is not None:      # the fake mode's own copy of a lifted constant
            tensor.constant = None


def _set_value(tensor: torch.Tensor, value: torch.Tensor, mode: FakeTensorMode) -> None:
    live = getattr(mode, _LIVE, None)
    if live is None:
        live = {}
        setattr(mode, _LIVE, live)
    key = _storage_key(tensor)
    token = live.get(key)
    if token is None:
        token = live[key] = object()
    setattr(tensor, _VALUE, _ValueEntry((value, key, token)))


class _NoValue(Exception):
    """An argument has no value (internal)."""


def _input_value(argument: Any) -> Any:
    if isinstance(argument, torch.Tensor):
        if type(argument) is FakeTensor:
            value = value_of(argument) if not argument.requires_grad else None
        elif (type(argument) is torch.Tensor and argument.device.type == "cpu" and not argument.requires_grad
              and argument.numel() <= VALUE_LIMIT):
            value = argument          # a real tensor (DeviceMesh's ranks, torch.tensor's constant)
        else:
            value = None
        if value is None:
            raise _NoValue
        return value
    if type(argument) in (list, tuple):
        return type(argument)(_input_value(item) for item in argument)
    return argument


def _values_in(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The arguments with every tensor replaced by its value (devices by cpu), or None when a
    tensor has none."""
    for argument in args:       # most ops: a fake tensor without a value, found at once
        if type(argument) is FakeTensor and _VALUE not in argument.__dict__:
            return None
    try:
        values = tuple(_input_value(argument) for argument in args)
        kwargs = {name: _input_value(argument) for name, argument in kwargs.items()}
    except _NoValue:
        return None
    if "device" in kwargs:
        kwargs["device"] = torch.device("cpu")
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return values, kwargs


def _compute(func, values: tuple, kwargs: dict) -> Any:
    """``func`` on values, on the CPU, seen by no dispatch mode (as the fake mode's own work)."""
    with _no_fake_mode(), torch._C._DisableTorchDispatch(), torch.no_grad():
        return func(*values, **kwargs)


def _small(outputs: Any) -> bool:
    return all(leaf.numel() <= VALUE_LIMIT for leaf in pytree.tree_leaves(outputs)
               if isinstance(leaf, torch.Tensor))


def _attach(outputs: Any, values: Any, mode: FakeTensorMode) -> None:
    fakes, values = pytree.tree_leaves(outputs), pytree.tree_leaves(values)
    if len(fakes) != len(values):
        return
    for fake, value in zip(fakes, values):
        if (type(fake) is FakeTensor and isinstance(value, torch.Tensor) and fake.shape == value.shape
                and fake.dtype == value.dtype):
            _set_value(fake, value, mode)


def _forget_mutated(rule: _Rule, args: tuple, kwargs: dict) -> None:
    for index, name in rule.mutated:
        target = args[index] if index < len(args) else kwargs.get(name)
        for tensor in (target if isinstance(target, (list, tuple)) else (target,)):
            forget_values(tensor)


def _writes_fakes_only(rule: _Rule, args: tuple, kwargs: dict) -> bool:
    for index, name in rule.mutated:
        target = args[index] if index < len(args) else kwargs.get(name)
        for tensor in (target if isinstance(target, (list, tuple)) else (target,)):
            if isinstance(tensor, torch.Tensor) and type(tensor) is not FakeTensor:
                return False
    return True


def _device_of(args: tuple, kwargs: dict, mode: FakeTensorMode) -> torch.device:
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    for leaf in pytree.tree_leaves((args, kwargs)):
        if type(leaf) is FakeTensor:
            return leaf.fake_device
    return torch.device("cpu")


def _fake_like(value: Any, device: torch.device, mode: FakeTensorMode) -> Any:
    """A data-dependent op's result, computed on values: its tensors as fake tensors of the rank's
    mode with those values (a Python number passes through)."""
    if isinstance(value, torch.Tensor):
        with contextlib.ExitStack() as stack:
            if _get_fake_mode(_FAKE_KEY) is None:
                torch._C._set_dispatch_mode(mode)
                stack.callback(torch._C._unset_dispatch_mode, _FAKE_KEY)
            fake = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=device)
        if value.numel() <= VALUE_LIMIT:
            _set_value(fake, value, mode)
        return fake
    if isinstance(value, (list, tuple)):
        return type(value)(_fake_like(item, device, mode) for item in value)
    return value


def _with_values(func, types, args: tuple, kwargs: dict, mode: FakeTensorMode, outside: bool = False) -> Any:
    """One op on a shape-only rank: the fake result, and for a result computed from values only,
    its value too (module docstring, "Values of constants"). A data-dependent op on tensors with values is
    computed on them; on any other tensor it raises as before. ``outside``: the rank's fake mode
    is set aside (the op goes to torch as it is; tensors made there are real)."""
    rule = _rule(func)
    if rule.seeded:
        return _draw(rule, func, types, args, kwargs, mode, outside)
    inputs = _values_in(args, kwargs) if rule.valued else None
    if inputs is not None and rule.mutated and not _writes_fakes_only(rule, args, kwargs):
        inputs = None       # the fake mode writes a fake copy of a real tensor: so do the values
    if inputs is None:
        if func is _SCALAR_READ and not outside:
            stand_in = _shape_reads.stand_in(func, args, mode)   # scalar_reads="nan" (shape_reads)
            if stand_in is not None:
                return stand_in
        try:
            out = func(*args, **kwargs) if outside else _fake_cache.dispatch_op(func, types, args, kwargs, mode)
        except _DATA_DEPENDENT as refusal:
            if getattr(mode, _RANDOM_WHY, None):
                _note_refusal(refusal, args, mode)
            raise
        if rule.without_values is not None and not outside:
            rule.without_values(args, kwargs)       # module docstring, "Loss scaling"
        elif rule.mutated and getattr(mode, _LIVE, None):
            _forget_mutated(rule, args, kwargs)
        return out
    try:
        out = func(*args, **kwargs) if outside else _fake_cache.dispatch_op(func, types, args, kwargs, mode)
    except _DATA_DEPENDENT as refusal:
        try:
            value = _compute(func, *inputs)
        except Exception:
            raise refusal from None
        return _fake_like(value, _device_of(args, kwargs, mode), mode)
    if _small(out):
        try:
            _attach(out, _compute(func, *inputs), mode)
            return out
        except Exception:          # the op refuses these values on the CPU: no values then
            pass
    if rule.mutated:
        _forget_mutated(rule, args, kwargs)
    return out


# -- values of random bookkeeping ----------------------------------------------------------------

#: the most elements a random integer tensor drawn with values may have (:func:`_draw`)
RANDOM_INDEX_LIMIT = 1 << 22
#: the draws of index bookkeeping (a shuffle's or a split's ``randperm``, a batch's ``randint``, a
#: sampler's seed ``random_``), with values when their result is an integer tensor
_INDEX_DRAWS = frozenset(("randperm", "randint", "random_"))
_SPOILED = "_simcomm_spoiled"      # a fake mode's attribute: {id(generator): (generator, its state)}
#: a fake mode's attribute: {storage key: (weakref to an index draw, why it has no value)}
_RANDOM_WHY = "_simcomm_random_why"


def _generator_state(generator: torch.Generator) -> torch.Tensor:
    with _no_fake_mode(), torch._C._DisableTorchDispatch():
        return generator.get_state()


def _known(generator: torch.Generator, mode: FakeTensorMode) -> bool:
    """Whether ``generator``'s state on this rank is the one a real-valued run has: no random op
    without values drew from it since it was last given a state (seeded, set) other than the one
    it had then."""
    entry = getattr(mode, _SPOILED, {}).get(id(generator))
    if entry is None or entry[0] is not generator:
        return _shape_random.known(generator, mode)
    with _no_fake_mode(), torch._C._DisableTorchDispatch():
        return not torch.equal(entry[1], generator.get_state()) and _shape_random.known(generator, mode)


def _spoil(generator: torch.Generator, mode: FakeTensorMode) -> None:
    spoiled = getattr(mode, _SPOILED, None)
    if spoiled is None:
        spoiled = {}
        setattr(mode, _SPOILED, spoiled)
    spoiled[id(generator)] = (generator, _generator_state(generator))


def _note_unknown_draw(target: torch.Tensor, why: str, mode: FakeTensorMode) -> None:
    """An index draw into ``target`` has no value because its generator's state is unknown: a read
    of it (or of a view of it) says why (:func:`_refusal`)."""
    notes = getattr(mode, _RANDOM_WHY, None)
    if notes is None:
        notes = {}
        setattr(mode, _RANDOM_WHY, notes)
    notes[_storage_key(target)] = (weakref.ref(target), why)


def _note_refusal(refusal: BaseException, args: tuple, mode: FakeTensorMode) -> None:
    notes = getattr(mode, _RANDOM_WHY, None)
    for argument in args:
        if type(argument) is FakeTensor:
            entry = notes.get(_storage_key(argument))
            if entry is not None and entry[0]() is not None:
                refusal.simcomm_note = (f"; this tensor is a random draw from a generator whose state is "
                                        f"unknown here: {entry[1]}")
                return


def _generator_of(args: tuple, kwargs: dict) -> torch.Generator | None:
    """The generator a random op is given (by name or by position), or None."""
    generator = kwargs.get("generator")
    if generator is None:
        for argument in args:
            if isinstance(argument, torch.Generator):
                return argument
    return generator


def _draw(rule: _Rule, func, types, args: tuple, kwargs: dict, mode: FakeTensorMode, outside: bool) -> Any:
    """A random op on a shape-only rank (module docstring, "Values of random bookkeeping").

    Its fake result, and where the op is an index draw (``randperm``, ``randint``, ``random_``)
    of an integer tensor of at most :data:`RANDOM_INDEX_LIMIT` elements that requires no grad,
    from a CPU ``torch.Generator`` whose state is known (:func:`_known`), and every other tensor
    it is given has a value, its value too: the op is computed on the CPU with that generator,
    which advances as in a real-valued run (from the real state a stand-in state stands for:
    :func:`simcomm.sim.shape_random.settle`). Every other draw (floating-point draws are data: a
    batch, a weight, dropout's mask) has no value; its generator's state is followed through it
    where what it takes is known (:func:`simcomm.sim.shape_random.follow`), and is unknown from
    then on otherwise (a later draw from it has no value) until it is given another."""
    generator = _generator_of(args, kwargs)
    if generator is None and _device_of(args, kwargs, mode).type == "cpu":
        generator = torch.default_generator
    if outside:            # real tensors: torch draws for real, from the real state a stand-in stands for
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu":
            _shape_random.settle(generator, mode)
        return func(*args, **kwargs)
    out = _fake_cache.dispatch(func, types, args, kwargs, mode)
    if rule.mutated and getattr(mode, _LIVE, None):
        _forget_mutated(rule, args, kwargs)
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        return out
    target = args[0] if rule.mutated else out
    inputs = None
    if (func.__name__.split(".")[0] in _INDEX_DRAWS and type(target) is FakeTensor
            and not target.dtype.is_floating_point and not target.dtype.is_complex
            and not target.requires_grad and target.numel() <= RANDOM_INDEX_LIMIT
            and (not rule.mutated or (target._base is None and target is out)) and _known(generator, mode)):
        inputs = _values_in(args[1:] if rule.mutated else args, kwargs)
    if inputs is None:
        if func.__name__.split(".")[0] in _INDEX_DRAWS and type(target) is FakeTensor:
            why = _shape_random.reason(generator, mode)     # its state before this draw
            if why is not None:
                _note_unknown_draw(target, why, mode)
        if not _shape_random.follow(func, args, kwargs, target, generator, mode):
            _shape_random.spoil(generator, mode, f"{func} drew from it without values, and what it takes "
                                                 f"from the generator is not followed")
        return out
    if not _shape_random.settle(generator, mode):     # the real state a stand-in stands for
        return out
    values, options = inputs
    if (any(argument.name == "generator" for argument in func._schema.arguments)
            and not any(value is generator for value in values)):
        options["generator"] = generator      # else the op draws from the default generator itself
    try:
        with _no_fake_mode(), torch._C._DisableTorchDispatch(), torch.no_grad():
            if rule.mutated:       # the op writes every element: a fresh tensor of the same layout
                fresh = torch.empty_strided(target.shape, target.stride(), dtype=target.dtype)
                value = func(fresh, *values, **options)
            else:
                value = func(*values, **options)
    except Exception:
        _spoil(generator, mode)
        return out
    if isinstance(value, torch.Tensor) and value.shape == target.shape and value.dtype == target.dtype:
        _set_value(target, value, mode)
    return out


_torch_fake_tolist: Callable | None = None


def _fake_tolist(self: torch.Tensor) -> Any:
    """``FakeTensor.tolist``: a tensor with a value (module docstring, "Values of constants")
    answers with its value's list at once; torch's own reads element by element."""
    value = value_of(self)
    if value is not None:
        return value.tolist()
    return _torch_fake_tolist(self)


def _fake_format(self: torch.Tensor, format_spec: str) -> str:
    """``FakeTensor.__format__``: a 0-dim tensor formats as its number, as torch formats a plain
    tensor (``f"{loss:.4f}"``: ``.item()``), where it has a value or a format spec is given (then
    a tensor without a value is a value read: the named error); torch formats any other fake
    tensor as an object (a format spec: ``TypeError``)."""
    if self.dim() == 0 and (format_spec or value_of(self) is not None):
        return self.detach().item().__format__(format_spec)
    return _torch_fake_format(self, format_spec)


_torch_fake_format: Callable | None = None


def install_fake_tolist() -> None:
    """Put :func:`_fake_tolist` in ``FakeTensor.tolist``'s place and :func:`_fake_format` in
    ``FakeTensor.__format__``'s (once per process)."""
    global _torch_fake_tolist, _torch_fake_format
    if _torch_fake_tolist is None:
        _torch_fake_tolist = FakeTensor.tolist
        FakeTensor.tolist = _fake_tolist      # simcomm.patches: "fake-tolist"
        _torch_fake_format = FakeTensor.__format__
        FakeTensor.__format__ = _fake_format      # simcomm.patches: "fake-tolist"
