"""``World(n, map_cuda=True)``: a program's ``"cuda"`` means the World's device, and ``torch.cuda``
answers as a machine with one GPU per rank, so a script that hard-codes CUDA runs on a CPU.

Why a mapping and not fake CUDA tensors: on a torch built without CUDA, fake CUDA tensors have
no device guard and autograd aborts the process on them (see
:func:`simcomm.sim.shape.check_shape_device`). So the program's tensors are on the World's
device (``cpu``; fake on shape-only ranks) and every place a program names CUDA is mapped:

* **device arguments**, per rank thread (a ``TorchFunctionMode``, :class:`CudaAsDevice`):
  ``device="cuda"`` / ``"cuda:N"`` / ``torch.device("cuda", N)`` in any torch function or
  method (factories, ``nn.Module(device=...)``, ``Tensor.to``), ``torch.device("cuda")``
  itself (made on the rank thread), ``Tensor.cuda()``;
  ``Tensor.record_stream`` and ``Tensor.pin_memory`` are no-ops;
* ``Module.cuda()`` / ``Module.to("cuda")`` on a rank thread return the module as it is (it
  is on the World's device; a dtype in ``to`` still converts);
* **torch.cuda's queries**, process-wide while the run lasts (:func:`cuda_answers`):
  ``is_available()`` is True, ``device_count()`` the world size, ``set_device`` /
  ``current_device`` per rank thread, ``synchronize`` / ``empty_cache`` /
  ``reset_peak_memory_stats`` do nothing, ``Stream`` / ``Event`` / ``current_stream`` /
  ``stream()`` are stand-ins that order nothing (the simulator's ranks run one op at a time),
  ``Event.elapsed_time`` is 0.0, ``memory_allocated`` / ``max_memory_allocated`` are the
  rank's tracked bytes (:mod:`simcomm.memory`, ``World(memory=True)``; 0 otherwise),
  ``get_device_name`` / ``get_device_properties`` describe a virtual GPU.

What a program can still tell: its tensors report ``device.type == "cpu"`` and
``is_cuda`` False, and anything else of ``torch.cuda`` (``torch.cuda.amp``'s CUDA
kernels, CUDA graphs, ``torch.cuda.get_rng_state``) raises as on a CPU-only build.
``torch.cuda`` is patched for the whole process during the run: do not run two such Worlds
at once in one process.
"""
from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .. import memory

__all__ = ["CudaAsDevice", "cuda_answers", "is_cuda_name"]

_local = threading.local()     # .index: the rank thread's current CUDA device (set_device)


def is_cuda_name(value: Any) -> bool:
    """Whether ``value`` names a CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``)."""
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and (value == "cuda" or value.startswith("cuda:"))


class CudaAsDevice(TorchFunctionMode):
    """On one rank thread: every CUDA device argument becomes ``device``; ``.cuda()`` is ``.to(device)``."""

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
        if func is torch.device:                      # torch.device("cuda", 1) itself
            made = func(*args, **kwargs)
            return self.device if made.type == "cuda" else made
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.cuda:
            return _moved(args[0], args[0].to(self.device))
        mapped = pytree.tree_map(lambda leaf: self.device if is_cuda_name(leaf) else leaf, (args, kwargs))
        out = func(*mapped[0], **mapped[1])
        if func is torch.Tensor.to and mapped != (args, kwargs):
            return _moved(args[0], out)
        return out


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

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc_info) -> None:
        return None


class _Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> _Event:
        return self

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, other: _Event) -> float:
        return 0.0


def _current_device() -> int:
    return getattr(_local, "index", 0)


def _set_device(device: Any) -> None:
    if isinstance(device, (str, torch.device)):
        device = torch.device(device).index or 0
    _local.index = int(device)


def _answers(world_size: int) -> dict[str, Any]:
    default_stream = _Stream()
    properties = types.SimpleNamespace(name="simcomm virtual GPU", total_memory=80 * 2 ** 30, major=9, minor=0,
                                       multi_processor_count=132, is_integrated=False)
    return {
        "is_available": lambda: True,
        "device_count": lambda: world_size,
        "current_device": _current_device,
        "set_device": _set_device,
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda device=None: None,
        "reset_max_memory_allocated": lambda device=None: None,
        "memory_allocated": lambda device=None: memory.current_bytes() or 0,
        "max_memory_allocated": lambda device=None: memory.current_bytes() or 0,
        "memory_reserved": lambda device=None: memory.current_bytes() or 0,
        "max_memory_reserved": lambda device=None: memory.current_bytes() or 0,
        "get_device_name": lambda device=None: properties.name,
        "get_device_properties": lambda device=None: properties,
        "get_device_capability": lambda device=None: (properties.major, properties.minor),
        "is_bf16_supported": lambda including_emulation=True: True,
        "Stream": _Stream,
        "Event": _Event,
        "current_stream": lambda device=None: default_stream,
        "default_stream": lambda device=None: default_stream,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
    }


_module_cuda, _module_to = torch.nn.Module.cuda, torch.nn.Module.to


def _mapped_module_cuda(self: torch.nn.Module, device: Any = None) -> torch.nn.Module:
    """``Module.cuda()`` on a mapped rank thread: the module is on the World's device already
    (a move to the same device; on shape-only ranks torch could not swap the fake parameters)."""
    if getattr(_local, "mapped", None) is None:
        return _module_cuda(self, device)
    return self


def _mapped_module_to(self: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.nn.Module:
    """``Module.to(...)`` on a mapped rank thread: a CUDA device is the World's (no move); a dtype
    still converts."""
    mapped = getattr(_local, "mapped", None)
    if mapped is None:
        return _module_to(self, *args, **kwargs)
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
    if device is not None and device.type == "cuda":
        return self if dtype is None else _module_to(self, dtype)
    return _module_to(self, *args, **kwargs)


@contextlib.contextmanager
def cuda_answers(world_size: int) -> Iterator[None]:
    """Patch ``torch.cuda``'s queries (module docstring), and ``Module.cuda`` / ``Module.to`` on
    mapped rank threads, for the block; restore them after (simcomm.patches: "cuda-answers")."""
    saved = {name: getattr(torch.cuda, name) for name in _answers(world_size)}
    try:
        for name, value in _answers(world_size).items():
            setattr(torch.cuda, name, value)
        torch.nn.Module.cuda, torch.nn.Module.to = _mapped_module_cuda, _mapped_module_to
        yield
    finally:
        torch.nn.Module.cuda, torch.nn.Module.to = _module_cuda, _module_to
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
