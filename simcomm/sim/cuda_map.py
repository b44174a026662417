"""Virtual GPUs: ``World(n, map_cuda=True)`` (and ``python -m simcomm.run`` on a machine without
a GPU): a program's CUDA means the World's device, and ``torch.cuda`` / ``torch.accelerator``
answer as a machine with one GPU per rank, so a script written for GPUs runs unmodified on a CPU,
with real values.

Why a mapping and not fake CUDA tensors: on a torch built without CUDA, CUDA tensors cannot be
made, and fake ones have no device guard, so autograd aborts the process on them (see
:func:`simcomm.sim.shape.check_shape_device`). So the program's tensors are on the World's
device (``cpu``; fake on shape-only ranks) and every place a program names CUDA is mapped:

* **device arguments**, per rank thread (a ``TorchFunctionMode``, :class:`CudaAsDevice`):
  ``device="cuda"`` / ``"cuda:N"`` / ``torch.device("cuda", N)`` / an integer ``device=N`` in
  any torch function or method (factories, ``nn.Module(device=...)``, ``Tensor.to``,
  ``Tensor.to(local_rank)``), ``torch.device("cuda")`` and ``torch.device(N)`` themselves
  (made on the rank thread: they give the World's device), ``Tensor.cuda()``;
  ``pin_memory=True`` in a factory is dropped; ``Tensor.record_stream`` and
  ``Tensor.pin_memory`` are no-ops;
* ``Module.cuda()`` / ``Module.to("cuda")`` / ``Module.to(local_rank)`` on a rank thread return
  the module as it is (it is on the World's device; a dtype in ``to`` still converts);
* **torch.cuda's queries**, process-wide while the run lasts (:func:`cuda_answers`):
  ``is_available()`` is True, ``device_count()`` the GPUs of a node (``VirtualGPUs.per_node``:
  torchrun's ``LOCAL_WORLD_SIZE`` under ``simcomm.run``, else the world size), ``set_device`` /
  ``current_device`` / ``torch.cuda.device(...)`` per rank thread (an ordinal past the node's
  GPUs raises as CUDA does), ``get_device_name`` / ``get_device_properties`` describe the
  virtual GPU (:data:`GPUS`, by name), ``synchronize`` / ``empty_cache`` do nothing,
  ``Stream`` / ``Event`` / ``current_stream`` / ``stream()`` are stand-ins that order nothing
  (a rank's ops run one at a time, in program order), ``Event.elapsed_time`` is 0.0 (nothing
  ran on a device to time);
* **CUDA random state, per rank**: ``torch.cuda.manual_seed`` / ``manual_seed_all`` /
  ``seed`` / ``initial_seed`` / ``get_rng_state`` / ``set_rng_state`` (and their ``_all``
  forms) read and write a generator of the rank's own (a CPU ``torch.Generator``, starting
  from the rank's seed as its CPU generator does, :mod:`simcomm.fresh_state`). Draws "on cuda"
  (``torch.randn(n, device="cuda")``) are draws
  on the World's device and use its default generator, as the program's CPU twin does;
* **memory**: ``memory_allocated`` / ``max_memory_allocated`` / ``reset_peak_memory_stats`` /
  ``memory_reserved`` / ``mem_get_info`` / ``memory_stats`` / ``memory_summary`` answer from the
  rank's tracked bytes (:mod:`simcomm.memory`; ``World(memory=True)``, which ``simcomm.run``
  turns on with virtual GPUs; 0 when untracked), and a tracked rank whose live bytes pass the
  virtual GPU's capacity gets ``torch.OutOfMemoryError`` from the op that allocated them;
* ``torch.accelerator``'s queries answer the same (``current_accelerator()`` is
  ``device(type='cuda')``);
* ``torch.autocast("cuda", dtype=...)`` (``torch.amp.autocast``, ``torch.cuda.amp.autocast``)
  made on a rank thread is the World device's autocast with the same dtype (CUDA's default,
  float16, when none is given); ``torch.amp.GradScaler("cuda")`` works on the World's tensors
  as it is (torch.cuda.is_available() is True);
* ``DistributedDataParallel(module, device_ids=[k], output_device=k)`` on a rank thread, for a
  module on the World's device: the ids are checked against the node's GPUs and dropped, as
  DDP of a CPU module needs;
* ``DataLoader(pin_memory=True)`` gives its batches as they are (its pinning thread is not a
  rank's; nothing can be pinned here);
* ``torch.load(path, map_location="cuda:k")`` (or an int, or none) on a rank thread loads onto
  the World's device;
* ``init_process_group("nccl")`` joins the run's world as ``"gloo"`` does
  (:mod:`simcomm.sim.dist_world`); ``device_id=`` is accepted.

What a program can still tell (docs/torchrun.md, "Virtual GPUs"): its tensors report
``device.type == "cpu"`` and ``is_cuda`` False, kernels are the CPU's (no TF32, CPU autocast's
op lists), CUDA graphs (``torch.cuda.CUDAGraph``, ``graph``, ``graph_pool_handle``,
``make_graphed_callables``) raise a NotImplementedError that names them, and anything else of
``torch.cuda`` (``torch.cuda.nvtx``, custom kernels) raises as on a CPU-only build. ``torch.cuda`` is patched for the whole process during
the run: do not run two such Worlds at once in one process.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import importlib
import re
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .. import memory
from .process_state import inherit_on_threads, inherit_thread_local, rank_start_seed

__all__ = ["mesh_device_type", "CudaAsDevice", "on_virtual_gpu", "cuda_answers", "is_cuda_name", "GPU", "GPUS", "VirtualGPUs", "parse_bytes",
           "gpu_preset"]

_local = threading.local()     # per rank thread: .index (set_device), .mapped (the World's device), .generator
inherit_thread_local(_local, "generator")   # a rank's threads share its CUDA generators (not its device:
#                                              CUDA's current device is per thread, 0 on a new one)

GiB = 2 ** 30


@dataclasses.dataclass(frozen=True)
class GPU:
    """A GPU model as ``torch.cuda.get_device_properties`` describes one."""

    name: str                  # what get_device_name answers
    total_memory: int          # bytes: the virtual GPU's capacity unless VirtualGPUs.memory says otherwise
    major: int
    minor: int
    multi_processor_count: int
    L2_cache_size: int
    topology: str | None = None   # the cost model's preset of a node of these (simcomm.model.topology.PRESETS)


#: the virtual GPUs a run can have, by name (``--gpu H100``). ``total_memory`` is the card's
#: nominal size (80 GB cards: 80 GiB); a real card reports a little less (the driver's reserve)
GPUS: dict[str, GPU] = {
    "H100": GPU("NVIDIA H100 80GB HBM3", 80 * GiB, 9, 0, 132, 50 * 2 ** 20, "h100-nvswitch"),
    "H200": GPU("NVIDIA H200", 141 * GiB, 9, 0, 132, 50 * 2 ** 20, None),
    "A100": GPU("NVIDIA A100-SXM4-80GB", 80 * GiB, 8, 0, 108, 40 * 2 ** 20, "a100-nvswitch"),
    "A100-40GB": GPU("NVIDIA A100-SXM4-40GB", 40 * GiB, 8, 0, 108, 40 * 2 ** 20, None),
    "RTX4090": GPU("NVIDIA GeForce RTX 4090", 24 * GiB, 8, 9, 128, 72 * 2 ** 20, None),
}


def gpu_preset(name: str | GPU) -> GPU:
    """The :class:`GPU` named ``name`` (:data:`GPUS`, case and dashes ignored, or a cost-model
    topology preset such as ``"h100-nvswitch"``); a :class:`GPU` as it is."""
    if isinstance(name, GPU):
        return name
    if not isinstance(name, str):
        raise TypeError(f"virtual GPUs: gpu={name!r} must be a GPU name such as 'H100' or a simcomm.sim.cuda_map.GPU")
    key = name.strip().upper().replace("-", "").replace("_", "").replace(" ", "")
    for preset_name, gpu in GPUS.items():
        if key == preset_name.replace("-", "") or (gpu.topology and key == gpu.topology.upper().replace("-", "")):
            return gpu
    raise ValueError(f"virtual GPUs: no GPU named {name!r}; choose one of {list(GPUS)} "
                     f"(or a node preset: {[g.topology for g in GPUS.values() if g.topology]})")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)


def parse_bytes(value: int | str) -> int:
    """Bytes from ``8GiB``, ``512 MiB``, ``80GB`` (10**9), ``1.5TiB`` or an int of bytes."""
    if isinstance(value, bool):
        raise TypeError(f"a size: {value!r} is not a number of bytes")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.match(str(value))
        if match is None:
            raise ValueError(f"a size: {value!r} is not a size such as '8GiB', '512MiB', '80GB' or a number of bytes")
        number, unit = float(match.group(1)), (match.group(2) or "B").upper()
        scale = {"": 1, "B": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40,
                 "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40,
                 "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}.get(unit)
        if scale is None:
            raise ValueError(f"a size: {value!r} has an unknown unit {unit!r} (B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
        size = int(number * scale)
    if size <= 0:
        raise ValueError(f"a size: {value!r} must be more than 0 bytes")
    return size


@dataclasses.dataclass(frozen=True)
class VirtualGPUs:
    """The GPUs of a run on virtual GPUs: ``World(n, map_cuda=VirtualGPUs("A100", memory="8GiB"))``.

    ``gpu``: a name of :data:`GPUS` (or a :class:`GPU`); ``memory``: each GPU's capacity (bytes or
    ``"8GiB"``; default the GPU's ``total_memory``), enforced on ranks whose memory is tracked;
    ``per_node``: ``torch.cuda.device_count()`` (default: the world size)."""

    gpu: str | GPU = "H100"
    memory: int | str | None = None
    per_node: int | None = None

    def __post_init__(self) -> None:
        gpu_preset(self.gpu)
        if self.memory is not None:
            parse_bytes(self.memory)
        if self.per_node is not None and (isinstance(self.per_node, bool) or not isinstance(self.per_node, int)
                                          or self.per_node < 1):
            raise ValueError(f"VirtualGPUs: per_node={self.per_node!r} must be a positive int")

    @property
    def model(self) -> GPU:
        return gpu_preset(self.gpu)

    @property
    def capacity(self) -> int:
        """Each virtual GPU's bytes."""
        return self.model.total_memory if self.memory is None else parse_bytes(self.memory)

    def describe(self) -> str:
        """``H100 (80.0 GiB)``: for the launcher's announcement."""
        name = self.gpu if isinstance(self.gpu, str) else self.model.name
        return f"{name} ({_size(self.capacity)})"


def is_cuda_name(value: Any) -> bool:
    """Whether ``value`` names a CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``)."""
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:"))


def on_virtual_gpu() -> bool:
    """Whether the calling thread is a rank thread with virtual GPUs (inside :class:`CudaAsDevice`)."""
    return getattr(_local, "mapped", None) is not None


def _is_device_int(value: Any) -> bool:
    return type(value) is int


class CudaAsDevice(TorchFunctionMode):
    """On one rank thread: every CUDA (or integer) device argument becomes ``device``;
    ``.cuda()`` is ``.to(device)``; pinned memory is plain memory."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __enter__(self) -> CudaAsDevice:
        _local.mapped = self.device
        return super().__enter__()

    def __exit__(self, *exc_info) -> None:
        _local.mapped = None
        return super().__exit__(*exc_info)

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.device:                      # torch.device("cuda", 1), torch.device(0) itself
            first = args[0] if args else kwargs.get("type")
            if _is_device_int(first):
                return _ordinal_device(self.device, first)
            made = func(*args, **kwargs)
            return _ordinal_device(self.device, made.index) if made.type == "cuda" else made
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.cuda:
            return _moved(args[0], args[0].to(self.device))
        changed = False
        if kwargs:
            device = kwargs.get("device")
            if device is not None and (_is_device_int(device) or is_cuda_name(device)):
                kwargs = {**kwargs, "device": self.device}
                changed = True
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}
        if any(is_cuda_name(arg) for arg in args):
            args = tuple(self.device if is_cuda_name(arg) else arg for arg in args)
            changed = True
        elif func is torch.Tensor.to and len(args) > 1 and _is_device_int(args[1]):
            args = (args[0], self.device, *args[2:])
            changed = True
        out = func(*args, **kwargs)
        if func is torch.Tensor.to and changed:
            return _moved(args[0], out)
        return out


# the threads a rank starts see its virtual GPUs too
inherit_on_threads(lambda: CudaAsDevice(_local.mapped) if getattr(_local, "mapped", None) is not None else None)


_ORDINAL_DEVICES: dict[tuple[torch.device, int], torch.device] = {}


def _ordinal_device(device: torch.device, index: int | None) -> torch.device:
    """What ``torch.device("cuda", index)`` gives on a mapped rank thread: ``device`` (the
    World's), as an object of its own per ordinal, so that ``torch.cuda.set_device`` of it can
    still tell which GPU it named (``set_device(torch.device("cuda", local_rank))``)."""
    if index is None:
        return device
    key = (device, index)
    made = _ORDINAL_DEVICES.get(key)
    if made is None:
        made = _ORDINAL_DEVICES.setdefault(key, torch.device(device.type, device.index))
    return made


def _ordinal_of(device: torch.device) -> int | None:
    """The ordinal a device :func:`_ordinal_device` made stands for (``None``: none)."""
    for (_, index), made in list(_ORDINAL_DEVICES.items()):
        if made is device:
            return index
    return device.index


def _moved(tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """What a move to CUDA returns: ``out``, except that a fake tensor "moved" to the device it is
    on comes back as a new fake tensor, as a real move would (``Module.cuda()`` swaps a fake
    parameter with what the move returned, and cannot swap a tensor with itself); free, no data."""
    from torch._subclasses.fake_tensor import FakeTensor

    if out is tensor and isinstance(tensor, FakeTensor):
        return tensor.detach().clone()
    return out


class _Stream:
    """What ``torch.cuda.Stream()`` gives under the mapping: it orders nothing."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any):
        self.priority = priority
        self.device = _CUDA

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _Event:
        event = event if event is not None else _Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        """Never: CUDA graphs are not captured on virtual GPUs."""
        return False

    @property
    def device_index(self) -> int:
        return _current_device()

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc_info) -> None:
        return None


class _Event:
    """What ``torch.cuda.Event()`` gives under the mapping: recorded at once; times nothing."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 **kwargs: Any):
        self.enable_timing = enable_timing
        self.recorded = False

    def record(self, stream: Any = None) -> _Event:
        self.recorded = True
        return self

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, other: _Event) -> float:
        """0.0 ms: no kernel ran on a device between the two records (the rank's ops ran on
        the CPU, at once; docs/torchrun.md, "Virtual GPUs"). Raises as CUDA does for events
        not created with ``enable_timing=True`` or not recorded."""
        if not (self.enable_timing and getattr(other, "enable_timing", False)):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if not (self.recorded and getattr(other, "recorded", False)):
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return 0.0


_CUDA = torch.device("cuda")      # made here, outside any rank's mode (there it would be mapped)


def _current_device() -> int:
    return getattr(_local, "index", 0)


def _ordinal(device: Any) -> int | None:
    """The CUDA ordinal ``device`` names (``None``: the current one): ``"cuda:k"``, ``k``,
    ``torch.device("cuda", k)``, or the device that made on a mapped rank thread."""
    if device is None:
        return None
    if isinstance(device, str):
        if device == "cuda" or device.startswith("cuda:"):
            index = device.partition(":")[2]
            return int(index) if index else None
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type == "cuda":
            return device.index
        if device.type == _mapped_type():
            return _ordinal_of(device)
        raise ValueError(f"Expected a cuda device, but got: {device}")
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    raise ValueError(f"Expected a cuda device, but got: {device!r}")


def mesh_device_type(device_type: Any) -> Any:
    """The device type a ``DeviceMesh`` made on this thread gets for ``device_type``: on a rank
    thread with virtual GPUs, ``"cuda"`` is the World's device type (the mesh's tensors are there;
    DTensor moves a gradient to the mesh's device type in its backward); otherwise as given."""
    mapped = getattr(_local, "mapped", None)
    return mapped.type if mapped is not None and device_type == "cuda" else device_type


def _mapped_type() -> str:
    mapped = getattr(_local, "mapped", None)
    return mapped.type if mapped is not None else "cuda"


_ERROR = getattr(torch, "AcceleratorError", RuntimeError)


def _no_cuda_graphs(name: str) -> NotImplementedError:
    """The error of ``torch.cuda.<name>`` (CUDA graph capture) on a virtual GPU."""
    return NotImplementedError(
        f"torch.cuda.{name}: CUDA graphs are not available on simcomm's virtual GPUs (virtual GPU "
        f"{_current_device()}): a virtual GPU runs the CPU's kernels, which cannot be captured and "
        f"replayed; turn the script's CUDA graphs off (its option for them), or run it on a real GPU")


class _CUDAGraph:
    """``torch.cuda.CUDAGraph`` on virtual GPUs: a class (``isinstance`` checks work) that no
    program can make."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise _no_cuda_graphs("CUDAGraph")


class _graph:  # noqa: N801 - torch.cuda.graph is a class used as a context manager
    """``torch.cuda.graph(...)`` on virtual GPUs: a named error (capture needs a CUDA runtime)."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise _no_cuda_graphs("graph")


def _graph_pool_handle() -> Any:
    raise _no_cuda_graphs("graph_pool_handle")


def _make_graphed_callables(*args: Any, **kwargs: Any) -> Any:
    raise _no_cuda_graphs("make_graphed_callables")


def _check_ordinal(index: int, count: int) -> int:
    if index < 0 or index >= count:
        raise _ERROR(f"CUDA error: invalid device ordinal (device {index}; this node has {count} virtual "
                     f"GPUs, one per rank of the node: torch.cuda.device_count() == {count})")
    return index


class _DeviceContext:
    """``with torch.cuda.device(k):`` / ``with torch.accelerator.device_index(k):`` on a virtual GPU:
    the rank's current device is k inside, and what it was after. ``None`` (and, for
    ``torch.cuda.device``, a negative ordinal) changes nothing, as torch's do."""

    def __init__(self, answers: Any, idx: int | None, negative_is_none: bool = True):
        self.answers = answers
        self.idx = None if idx is not None and idx < 0 and negative_is_none else idx
        self.prev_idx = -1

    def __enter__(self) -> None:
        self.prev_idx = _current_device()
        if self.idx is not None:
            self.answers.set_device(self.idx)

    def __exit__(self, *exc_info) -> bool:
        _local.index = self.prev_idx
        return False


class _Answers:
    """Every answer of torch.cuda / torch.accelerator for one run (see the module docstring)."""

    def __init__(self, gpus: VirtualGPUs, world_size: int):
        self.gpus = gpus
        self.count = gpus.per_node or world_size
        gpu = gpus.model
        self.properties = types.SimpleNamespace(
            name=gpu.name, total_memory=gpus.capacity, major=gpu.major, minor=gpu.minor,
            multi_processor_count=gpu.multi_processor_count, is_integrated=False, is_multi_gpu_board=False,
            L2_cache_size=gpu.L2_cache_size, warp_size=32, max_threads_per_multi_processor=2048,
            gcnArchName="NULL", uuid="simcomm-virtual-gpu")
        self.default_stream = _Stream()

    # -- devices --------------------------------------------------------------------------------
    def device_count(self) -> int:
        return self.count

    def set_device(self, device: Any) -> None:
        index = _ordinal(device)
        if index is None:
            return
        _local.index = _check_ordinal(index, self.count)

    def get_device_properties(self, device: Any = None) -> Any:
        index = _ordinal(device)
        if index is not None:
            _check_ordinal(index, self.count)
        return self.properties

    # -- random state, per rank -----------------------------------------------------------------
    @staticmethod
    def generator() -> torch.Generator:
        generator = getattr(_local, "generator", None)
        if generator is None:
            generator = _local.generator = torch.Generator()
            seed = rank_start_seed()      # the rank's own, as its CPU generator's (simcomm.fresh_state)
            generator.manual_seed(_CUDA_DEFAULT_SEED if seed is None else seed)
        return generator

    def manual_seed(self, seed: int) -> None:
        self.generator().manual_seed(int(seed))

    def seed(self) -> None:
        self.generator().seed()

    def initial_seed(self) -> int:
        return self.generator().initial_seed()

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.generator().get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "cuda") -> None:
        self.generator().set_state(new_state)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        """The rank's one generator's state (one entry: the rank's GPU; the others are other ranks')."""
        return [self.get_rng_state()]

    def set_rng_state_all(self, new_states: list[torch.Tensor]) -> None:
        if new_states:
            self.set_rng_state(new_states[0])

    # -- memory ---------------------------------------------------------------------------------
    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return memory.current_bytes() or 0

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return memory.device_peak_bytes() or 0

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        memory.reset_device_peak()

    def capacity(self) -> int:
        return memory.capacity() or self.gpus.capacity

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        """The rank's GPU holds ``fraction`` of its capacity from now on (as CUDA's allocator
        limits a process), for ranks whose memory is tracked."""
        if not isinstance(fraction, float) or not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        memory.set_capacity(int(fraction * self.gpus.capacity))

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        total = self.capacity()
        return max(0, total - self.memory_allocated()), total

    def memory_stats(self, device: Any = None) -> dict[str, Any]:
        current, peak = self.memory_allocated(), self.max_memory_allocated()
        stats: dict[str, Any] = collections.OrderedDict()
        for kind in ("allocated_bytes", "active_bytes", "reserved_bytes", "requested_bytes"):
            for pool in ("all", "large_pool", "small_pool"):
                here = (current, peak) if pool == "all" else (0, 0)
                stats[f"{kind}.{pool}.current"], stats[f"{kind}.{pool}.peak"] = here
        stats["num_alloc_retries"] = stats["num_ooms"] = 0
        return stats

    def memory_summary(self, device: Any = None, abbreviated: bool = False) -> str:
        current, peak, total = self.memory_allocated(), self.max_memory_allocated(), self.capacity()
        by_label = memory.live_by_label()
        lines = [f"simcomm virtual GPU {_current_device()} ({self.properties.name}): memory of this rank's "
                 f"tracked tensors (simcomm.memory)",
                 f"  allocated now   {_size(current)}", f"  peak            {_size(peak)}",
                 f"  capacity        {_size(total)}", f"  free            {_size(max(0, total - current))}"]
        if by_label:
            lines.append("  by label now:")
            lines += [f"    {label:<16}{_size(nbytes)}" for label, nbytes in by_label.items()]
        if memory.current_bytes() is None:
            lines.append("  (this rank's memory is not tracked: World(memory=True) counts it)")
        return "\n".join(lines)

    def out_of_memory(self, tracker: Any, requested: int) -> BaseException:
        """``torch.OutOfMemoryError`` as CUDA's caching allocator words it, for a tracked rank
        whose live bytes passed its virtual GPU's capacity."""
        held = tracker.current - requested
        total = tracker.capacity
        labels = ", ".join(f"{label} {_size(nbytes)}" for label, nbytes in
                           sorted(tracker.live.items(), key=lambda item: -item[1]) if nbytes > 0)
        return torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {_size(requested)}. GPU {_current_device()} has a total "
            f"capacity of {_size(total)} of which {_size(max(0, total - held))} is free. Of the allocated "
            f"memory {_size(held)} is allocated by PyTorch. (simcomm virtual GPU of rank {tracker.rank}, a "
            f"{self.properties.name}: the rank's tracked tensors with this allocation: {labels}. "
            f"--gpu-memory SIZE / VirtualGPUs(memory=...) sets each virtual GPU's capacity)")

    # -- the tables -----------------------------------------------------------------------------
    def cuda(self) -> dict[str, Any]:
        answers = self
        properties = self.properties
        stream = self.default_stream

        return {
            "is_available": lambda: True,
            "init": lambda: None,
            "device_count": self.device_count,
            "current_device": _current_device,
            "set_device": self.set_device,
            "device": lambda device: _DeviceContext(answers, _ordinal(device)),
            "synchronize": lambda device=None: None,
            "empty_cache": lambda: None,
            "reset_peak_memory_stats": self.reset_peak_memory_stats,
            "reset_max_memory_allocated": self.reset_peak_memory_stats,
            "memory_allocated": self.memory_allocated,
            "max_memory_allocated": self.max_memory_allocated,
            "memory_reserved": self.memory_allocated,
            "max_memory_reserved": self.max_memory_allocated,
            "mem_get_info": self.mem_get_info,
            "set_per_process_memory_fraction": self.set_per_process_memory_fraction,
            "memory_stats": self.memory_stats,
            "memory_summary": self.memory_summary,
            "get_device_name": lambda device=None: self.get_device_properties(device).name,
            "get_device_properties": self.get_device_properties,
            "get_device_capability": lambda device=None: (properties.major, properties.minor),
            "is_bf16_supported": lambda including_emulation=True: True,
            "manual_seed": self.manual_seed,
            "manual_seed_all": self.manual_seed,
            "seed": self.seed,
            "seed_all": self.seed,
            "initial_seed": self.initial_seed,
            "get_rng_state": self.get_rng_state,
            "set_rng_state": self.set_rng_state,
            "get_rng_state_all": self.get_rng_state_all,
            "set_rng_state_all": self.set_rng_state_all,
            "Stream": _Stream,
            "Event": _Event,
            "current_stream": lambda device=None: stream,
            "default_stream": lambda device=None: stream,
            "stream": lambda stream=None: contextlib.nullcontext(stream),
            "CUDAGraph": _CUDAGraph,
            "graph": _graph,
            "graph_pool_handle": _graph_pool_handle,
            "make_graphed_callables": _make_graphed_callables,
        }

    def accelerator(self) -> dict[str, Any]:
        answers = self
        stream = self.default_stream

        return {
            "is_available": lambda: True,
            "current_accelerator": lambda check_available=False: _CUDA,
            "device_count": self.device_count,
            "set_device_index": self.set_device,
            "set_device_idx": self.set_device,
            "current_device_index": _current_device,
            "current_device_idx": _current_device,
            "device_index": lambda device, /: _DeviceContext(answers, device, negative_is_none=False),
            "synchronize": lambda device=None, /: None,
            "current_stream": lambda device=None, /: stream,
            "empty_cache": lambda: None,
            "memory_allocated": self.memory_allocated,
            "max_memory_allocated": self.max_memory_allocated,
            "memory_reserved": self.memory_allocated,
            "max_memory_reserved": self.max_memory_allocated,
            "reset_peak_memory_stats": self.reset_peak_memory_stats,
            "memory_stats": self.memory_stats,
            "get_memory_info": self.mem_get_info,
            "get_device_capability": lambda device=None, /: {"major": self.properties.major,
                                                              "minor": self.properties.minor},
        }


#: CUDA's default generator's seed before any manual_seed (c10's default_rng_seed_val)
_CUDA_DEFAULT_SEED = 67280421310721


def _size(nbytes: int) -> str:
    """Bytes as CUDA's allocator prints them (``20.00 MiB``)."""
    if nbytes < 1024:
        return f"{nbytes} bytes"
    for unit, scale in (("KiB", 2 ** 10), ("MiB", 2 ** 20), ("GiB", 2 ** 30)):
        if nbytes < scale * 1024 or unit == "GiB":
            return f"{nbytes / scale:.2f} {unit}"
    raise AssertionError("unreachable")


# -- modules, autocast and DDP on a mapped rank thread --------------------------------------------

_module_cuda, _module_to = torch.nn.Module.cuda, torch.nn.Module.to
_autocast_init = torch.amp.autocast_mode.autocast.__init__


def _means_cuda(value: Any) -> bool:
    return is_cuda_name(value) or _is_device_int(value)


def _mapped_module_cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
    """``Module.cuda()`` on a mapped rank thread: the module is on the World's device already
    (a move to the same device; on shape-only ranks torch could not swap the fake parameters)."""
    if getattr(_local, "mapped", None) is None:
        return _module_cuda(self, device)
    return self


def _mapped_module_to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
    """``Module.to(...)`` on a mapped rank thread: a CUDA or integer device is the World's (no
    move); a dtype still converts."""
    mapped = getattr(_local, "mapped", None)
    if mapped is None:
        return _module_to(self, *args, **kwargs)
    cuda = False
    if args and _means_cuda(args[0]):
        args, cuda = (_CUDA, *args[1:]), True
    if _means_cuda(kwargs.get("device")):
        kwargs, cuda = {**kwargs, "device": _CUDA}, True
    if not cuda:
        return _module_to(self, *args, **kwargs)
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    return self if dtype is None else _module_to(self, dtype)


def _mapped_autocast_init(self: Any, device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                          cache_enabled: bool | None = None) -> None:
    """``torch.autocast("cuda", dtype)`` made on a mapped rank thread: the World device's
    autocast, with the dtype CUDA's would use (float16 when none is given)."""
    mapped = getattr(_local, "mapped", None)
    if mapped is not None and device_type == "cuda":
        device_type = mapped.type
        dtype = torch.float16 if dtype is None else dtype
    _autocast_init(self, device_type, dtype, enabled, cache_enabled)


_torch_load = torch.load


def _mapped_load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
    """``torch.load`` on a mapped rank thread: a ``map_location`` naming CUDA (``"cuda:k"``, an
    int, a dict's CUDA values) means the World's device, and so does none (a checkpoint saved on
    a real GPU restores onto the rank's device, as onto its GPU)."""
    mapped = getattr(_local, "mapped", None)
    if mapped is not None:
        if map_location is None or _means_cuda(map_location):
            map_location = mapped
        elif isinstance(map_location, dict):
            map_location = {key: (str(mapped) if _means_cuda(value) else value)
                            for key, value in map_location.items()}
    return _torch_load(f, map_location, *args, **kwargs)


_get_device_module = torch.get_device_module


def _mapped_get_device_module(device: Any = None) -> Any:
    """``torch.get_device_module`` on a mapped rank thread: ``"cuda"``, ``"cuda:k"``, a CUDA
    ``torch.device`` and none (the current accelerator, a virtual GPU) give ``torch.cuda``, as on a
    GPU machine (torch's own would read ``torch.device("cuda")``, which is the World's device here,
    and keep the answer in its cache for the process)."""
    if getattr(_local, "mapped", None) is not None:
        if device is None or (isinstance(device, torch.device) and device.type == "cuda") or (
                isinstance(device, str) and device.split(":")[0] == "cuda"):
            return torch.cuda
    return _get_device_module(device)


def _unpinned(data: Any, device: Any = None) -> Any:
    """DataLoader's ``pin_memory(data, device)`` on virtual GPUs: the batch as it is (there is
    no pinned memory on this machine; DataLoader pins on its own thread, not a rank's)."""
    return data


def _ddp_class() -> Any:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def _mapped_ddp_init(ddp_init: Any, count: int) -> Any:
    def __init__(self: Any, module: torch.nn.Module, device_ids: Any = None, output_device: Any = None,
                 *args: Any, **kwargs: Any) -> None:
        """DDP on a mapped rank thread: ``device_ids`` / ``output_device`` naming the rank's
        virtual GPUs are checked and dropped (the module is on the World's device, where DDP
        takes no device ids)."""
        if getattr(_local, "mapped", None) is not None:
            for value in [*(device_ids or ()), *([output_device] if output_device is not None else [])]:
                index = _ordinal(value)
                if index is not None:
                    _check_ordinal(index, count)
            device_ids = output_device = None
        ddp_init(self, module, device_ids, output_device, *args, **kwargs)

    return __init__


@contextlib.contextmanager
def cuda_answers(gpus: VirtualGPUs | int, world_size: int | None = None) -> Iterator[_Answers]:
    """Patch ``torch.cuda``'s and ``torch.accelerator``'s queries (module docstring),
    ``Module.cuda`` / ``Module.to``, autocast's constructor and DDP's on mapped rank threads, for
    the block; restore them after (simcomm.patches: "cuda-answers", "accelerator-answers",
    "virtual-gpu-wrappers"). ``cuda_answers(world_size)`` is ``VirtualGPUs()``."""
    if isinstance(gpus, int):
        gpus, world_size = VirtualGPUs(), gpus
    answers = _Answers(gpus, world_size or 1)
    from .sdpa_cpu import install as install_sdpa_sharding
    install_sdpa_sharding()                      # once per process (simcomm.patches: "sdpa-cpu-sharding")
    cuda, accelerator = answers.cuda(), answers.accelerator()
    _ddp_class()                                 # torch.nn.parallel imported
    saved_cuda = {name: getattr(torch.cuda, name) for name in cuda}
    saved_accelerator = {name: getattr(torch.accelerator, name) for name in accelerator}
    ddp_init = torch.nn.parallel.DistributedDataParallel.__init__
    importlib.import_module("torch.utils.data._utils.pin_memory")      # DataLoader's pinning
    pin_batch = torch.utils.data._utils.pin_memory.pin_memory
    try:
        for name, value in cuda.items():
            setattr(torch.cuda, name, value)
        for name, value in accelerator.items():
            setattr(torch.accelerator, name, value)
        torch.nn.Module.cuda, torch.nn.Module.to = _mapped_module_cuda, _mapped_module_to
        setattr(torch.amp.autocast_mode.autocast, "__init__", _mapped_autocast_init)
        torch.nn.parallel.DistributedDataParallel.__init__ = _mapped_ddp_init(ddp_init, answers.count)
        torch.load = _mapped_load
        torch.get_device_module = _mapped_get_device_module
        torch.utils.data._utils.pin_memory.pin_memory = _unpinned
        yield answers
    finally:
        torch.utils.data._utils.pin_memory.pin_memory = pin_batch
        torch.get_device_module = _get_device_module
        torch.load = _torch_load
        torch.nn.parallel.DistributedDataParallel.__init__ = ddp_init
        setattr(torch.amp.autocast_mode.autocast, "__init__", _autocast_init)
        torch.nn.Module.cuda, torch.nn.Module.to = _module_cuda, _module_to
        for name, value in saved_accelerator.items():
            setattr(torch.accelerator, name, value)
        for name, value in saved_cuda.items():
            setattr(torch.cuda, name, value)
