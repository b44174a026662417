"""Shape-only ranks: a CPU generator's state followed through draws that have no values.

A shape-only rank gives values to index draws (``randperm``, ``randint``, ``random_``) from a CPU
generator whose state is the one a real-valued run has (:mod:`simcomm.sim.shape`, "Values of random
bookkeeping"). A floating-point draw into a fake tensor (a weight's initialisation, ``randn``,
dropout's mask) has no values, but what it takes from the generator depends only on the number
of elements, the dtype and whether the tensor is contiguous, never on values. So instead of the
values, the draw is *followed*: the generator is left in a *stand-in state* that names the real
state (the state before the first followed draw, then the draws in their order), and when a value
is needed from that generator (an index draw, or a real draw outside the fake mode), the real state
is worked out by drawing the same number of generator outputs for real, in chunks of bounded
memory, from the state before (:func:`settle`). Nothing is drawn for a program that never reads a
value after its model's initialisation.

**What torch draws** (torch 2.13's CPU generator, ``CPUGeneratorImpl``: a Mersenne Twister giving
32-bit outputs; a 64-bit draw takes two; and one cached normal sample of each precision). A
per-element kernel takes the same outputs for each element whatever the layout: ``uniform_``
(one output per element, two for float64: ``uniform_real_distribution`` uses ``random64`` for
double only), ``random_`` (the same), ``random_(from, to)`` (one per element, two where the range
is 2**32 or more), ``bernoulli_`` with a Python ``p`` (two: it compares a double uniform),
``bernoulli_`` with a tensor ``p`` and ``bernoulli(p)`` (one, two where ``p`` is float64),
``exponential_``, ``cauchy_``, ``geometric_`` (two), ``log_normal_`` (the scalar normal path
below). Such a draw is followed by drawing the same op for real into fresh tensors of the same
dtype, at most :data:`CHUNK` elements at a time: the same outputs in the same order.
``normal_`` of a contiguous tensor of at least 16 elements fills it with uniforms and turns each
block of 16 into normals (``normal_fill``), recomputing the last 16 when the size is not a
multiple of 16: ``n`` outputs (``n + 16`` where ``n % 16``) for float32, twice that for float64,
``n`` rounded up to a multiple of 16 for bfloat16 and float16; it leaves the cached samples as
they are, and is followed by that many float32 uniforms. Any other ``normal_`` (fewer than 16
elements, not contiguous) takes the scalar path: each element is one double normal sample, two
of them from four outputs with the second cached; it is followed by the same draw into
non-contiguous fresh tensors in chunks. ``randn``/``randn_like``/``normal(...)`` are ``normal_``
of their result, ``rand``/``rand_like`` ``uniform_``, ``randint`` with a floating-point or
integer dtype ``random_(from, to)``. tests/sim/test_shape_generator_state.py checks each against
the same draw on real tensors over sizes below, at and above 16, not multiples of 16, and a
million, in float32, float64, bfloat16 and float16. (The kernels: ``normal_kernel``,
``normal_fill`` and the serial kernels of ``aten/src/ATen/native/cpu/DistributionTemplates.h``,
the distributions of ``aten/src/ATen/core/DistributionsHelper.h``; the bfloat16 and float16
counts of ``normal_`` are measured on torch 2.13, whose reduced-precision fill differs from the
float32 one.)

``trunc_normal_`` redraws the values outside its bounds until none is left, so what it takes
depends on the values: it is followed by running it for real on a tensor of the same shape, up
to :data:`REPLAY_LIMIT` elements; a larger one leaves the state unknown.

**The stand-in state.** The generator's own state is set to a copy of its state with four of the
Mersenne Twister's words replaced by a random token, registered in the rank's fake mode with what
it stands for. ``get_state``/``set_state`` (``torch.random.fork_rng``, activation
checkpointing's ``preserve_rng_state``, a checkpoint of the RNG state) carry the token, so a state
saved and set again stands for the same real state, as in a real-valued run; ``manual_seed``
replaces it (known again). ``initial_seed()`` is kept. What differs: the bytes of ``get_state()``
after such a draw are the stand-in's, not torchrun's, until a value is needed. A rank keeps its
last :data:`KEEP` stand-ins (and those the draws since a worked-out state build on); a state saved
before those and set again is unknown (its token starts with a fixed word, so it is recognised:
the named error, never a wrong value). Draws that are counts of outputs (``normal_`` of a
contiguous tensor, ``uniform_``, ``bernoulli_``, ``exponential_``, ``cauchy_``, ``geometric_``)
in a row are one count, so a training loop's dropout masks do not grow the chain.

**Cost.** Following a draw costs its rank the state read, marked and set: about 17 us more per
draw than leaving the state unknown did (40 us against 23 us per ``uniform_`` of a fake tensor,
one rank, on a shared 2-core machine under load); working a state
out costs about 6 ns per generator output drawn (0.6 s for a 100M-parameter model's
initialisation), once per distinct start and chain of draws: the ranks of a data-parallel script,
seeded alike and building the same model, share the result (:data:`_WORKED_OUT`). A count of at
least :data:`simcomm.sim.mt_jump.JUMP_FROM` outputs (a training loop's dropout masks merge into
one) is not drawn but jumped over, in about 20 ms however large (:mod:`simcomm.sim.mt_jump`), so
a DataLoader's base seed read at the next epoch costs that, not minutes.

**Unknown.** A draw that is not followed (an op whose consumption depends on values, such as
``multinomial`` or ``poisson``, or a ``trunc_normal_`` too large to run again) leaves a stand-in
that names no state, so a later index draw from it has no value and reading it is the named
error, which says why (:func:`reason`); so is a followed state whose working out would draw
more than :data:`FOLLOW_LIMIT` generator outputs (a jumped count costs the threshold). A CUDA
generator (fake ``"cuda"`` tensors) is not followed; its draws leave the CPU generator as it is.
"""
from __future__ import annotations

import os
import struct
import threading
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable

import numpy
import torch

from . import mt_jump as _mt_jump

__all__ = ["CHUNK", "REPLAY_LIMIT", "FOLLOW_LIMIT", "KEEP", "follow", "follow_trunc_normal", "spoil", "known", "settle",
           "reason"]

#: the most elements a followed draw is worked out on at a time (:func:`settle`)
CHUNK = 1 << 20
#: the most elements of a value-dependent draw (``trunc_normal_``) followed by running it again
REPLAY_LIMIT = 1 << 22
#: the most generator outputs working a stand-in state out may draw (a jumped count costs
#: :data:`simcomm.sim.mt_jump.JUMP_FROM`)
FOLLOW_LIMIT = 2_000_000_000

#: real states worked out, by the state they started from and what was drawn after it: ranks that
#: seed alike and build the same model (every rank of a data-parallel script) work it out once
_WORKED_OUT: OrderedDict = OrderedDict()
_WORKED_OUT_SIZE = 64
_worked_out_lock = threading.Lock()
_VIRTUAL = "_simcomm_virtual_rng"      # a fake mode's attribute: {token: _Node}, the rank's stand-ins
#: every live stand-in by its token: a generator object the ranks share finds another rank's
_STAND_INS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_TOKEN_WORDS = 4
_MAGIC = b"\x5e\xed\x51\xc0"           # a stand-in's first token word (a real state has it 1 time in 2**32)
#: the most stand-ins a rank keeps resolvable (a state saved longer ago than this many followed
#: draws is unknown when it is set again: the named error, not a wrong value)
KEEP = 1024
_FAKE_KEY = torch._C._TorchDispatchModeKey.FAKE
_MT_WORDS = 624                        # the Mersenne Twister's state words, 8 bytes each in get_state()
_layout: list = []                     # [offset of the Mersenne Twister's words in get_state(), or None]


class _Node:
    """A generator state a stand-in stands for: the state ``parent`` stands for (or the real state
    ``base``) and one draw after it (``step``: a callable drawing from a generator), or ``unknown``
    (why). A chain, so that following a draw costs the same however many came before."""

    __slots__ = ("parent", "base", "step", "outputs", "unknown", "settled", "fingerprint", "__weakref__")

    def __init__(self, parent: "_Node | None", base: torch.Tensor | None, step: Callable | None, outputs: int,
                 unknown: str | None = None):
        self.parent, self.base, self.step, self.outputs, self.unknown = parent, base, step, outputs, unknown
        self.settled: torch.Tensor | None = None     # the real state, once worked out
        self.fingerprint = b""                         # its stand-in state's (:func:`_fingerprint`)


_STALE = _Node(None, None, None, 0, f"it was given a state saved more than {KEEP:,} followed draws earlier "
                                    f"(or after the run that followed it), which is no longer known")


def _words_offset() -> int | None:
    """Where the Mersenne Twister's state words lie in ``Generator.get_state()`` (found once on a
    scratch generator, and checked: a state with a token there is set and read back as it is)."""
    if not _layout:
        offset = None
        try:
            with _no_dispatch():
                scratch = torch.Generator()
                scratch.manual_seed(0x5EED_1234_ABCD)
                raw = scratch.get_state().numpy().tobytes()
                found = raw.find(struct.pack("<Q", 0x1234_ABCD), 8)     # mt19937's first word: the seed's low half
                if found > 0 and found + 8 * (_TOKEN_WORDS + 1) <= len(raw):
                    marked = _with_token(scratch.get_state(), found, _wide(b"\x01" * 4 * _TOKEN_WORDS))
                    scratch.set_state(marked)
                    if torch.equal(scratch.get_state(), marked):
                        offset = found
        except Exception:
            offset = None
        _layout.append(offset)
    return _layout[0]


def _wide(token: bytes) -> bytes:
    """A token of 4-byte words as the Mersenne Twister's words lie in ``get_state()`` (8 bytes each)."""
    return b"".join(token[index:index + 4] + b"\x00" * 4 for index in range(0, len(token), 4))


def _with_token(state: torch.Tensor, offset: int, wide: bytes) -> torch.Tensor:
    marked = state.clone()
    marked.numpy()[offset + 8:offset + 8 + len(wide)] = numpy.frombuffer(wide, dtype=numpy.uint8)
    return marked


def _token_of(state: torch.Tensor, offset: int) -> bytes:
    return state.numpy()[offset + 8:offset + 8 + 8 * _TOKEN_WORDS].tobytes()


class _no_dispatch:
    """Outside the rank's fake mode and every dispatch mode: generator states are real tensors."""

    def __enter__(self):
        self._mode = torch._C._unset_dispatch_mode(_FAKE_KEY)
        self._disable = torch._C._DisableTorchDispatch()
        self._disable.__enter__()

    def __exit__(self, *exc):
        self._disable.__exit__(*exc)
        if self._mode is not None:
            torch._C._set_dispatch_mode(self._mode)


def _real_state(generator: torch.Generator) -> torch.Tensor:
    with _no_dispatch():
        return generator.get_state()


def _fingerprint(state: torch.Tensor, offset: int) -> bytes:
    """A stand-in state's header (seed, position in the Mersenne Twister's words), token and tail
    (the cached normal samples): a real draw from it changes them."""
    raw = state.numpy()
    return raw[:offset + 8 * (_TOKEN_WORDS + 1)].tobytes() + raw[offset + 8 * _MT_WORDS:].tobytes()


def _node(generator: torch.Generator, mode: Any, state: torch.Tensor | None = None) -> _Node | None:
    """What ``generator``'s state on this rank (``state``, where read already) stands for: None for a
    real state."""
    offset = _words_offset()
    if not _STAND_INS or offset is None:
        return None
    with _no_dispatch():                     # .numpy() of a tensor: no dispatch mode sees it
        if state is None:
            state = generator.get_state()
        token = _token_of(state, offset)
        node = _STAND_INS.get(token)
        if node is None or node.fingerprint != _fingerprint(state, offset):
            return _STALE if node is None and token.startswith(_MAGIC) else None
    return node


def _stand_in(generator: torch.Generator, node: _Node, mode: Any, state: torch.Tensor | None = None) -> bool:
    """Set ``generator`` (in ``state``, where read already) to a new stand-in state for ``node``; False
    where states have no known layout."""
    offset = _words_offset()
    if offset is None:
        return False
    table = getattr(mode, _VIRTUAL, None)
    if table is None:
        table = OrderedDict()
        setattr(mode, _VIRTUAL, table)
    token = _wide(_MAGIC + os.urandom(4 * _TOKEN_WORDS - len(_MAGIC)))
    with _no_dispatch():
        marked = _with_token(generator.get_state() if state is None else state, offset, token)
        generator.set_state(marked)
        node.fingerprint = _fingerprint(marked, offset)
    table[token] = _STAND_INS[token] = node
    while len(table) > KEEP:
        table.popitem(last=False)
    return True


def known(generator: torch.Generator, mode: Any) -> bool:
    """Whether ``generator``'s state on this rank is known: real, or a stand-in for a followed state."""
    node = _node(generator, mode)
    return node is None or node.unknown is None


def reason(generator: torch.Generator, mode: Any) -> str | None:
    """Why ``generator``'s state is unknown (None where it is known)."""
    node = _node(generator, mode)
    return None if node is None else node.unknown


def spoil(generator: torch.Generator, mode: Any, why: str) -> None:
    """A draw that is not followed took from ``generator``: its state is unknown from here on."""
    node = _node(generator, mode)
    if node is not None and node.unknown is not None:
        return
    if not _stand_in(generator, _Node(None, None, None, 0, why), mode):
        _legacy_spoil(generator, mode)


def _legacy_spoil(generator: torch.Generator, mode: Any) -> None:
    from .shape import _spoil
    _spoil(generator, mode)


def settle(generator: torch.Generator, mode: Any) -> bool:
    """Give ``generator`` the real state its stand-in stands for (drawing the followed outputs for
    real from the base state); True when its state is real now, False when it is unknown."""
    node = _node(generator, mode)
    if node is None:
        return True
    if node.unknown is not None:
        return False
    if node.settled is None:
        chain = []                           # the draws since the last real state, oldest first
        link = node
        while True:
            if link.settled is not None:     # worked out before: the state after its draw
                start = link.settled
                break
            chain.append(link.step)
            if link.parent is None:          # the first draw after a real state
                start = link.base
                break
            link = link.parent
        chain.reverse()
        with _no_dispatch():
            key = (start.numpy().tobytes(), tuple(step.key for step in chain))
            with _worked_out_lock:
                settled = _WORKED_OUT.get(key)
                if settled is not None:
                    _WORKED_OUT.move_to_end(key)
            if settled is None:
                generator.set_state(start)
                with warnings.catch_warnings():      # torch warned at the program's own draw already
                    warnings.simplefilter("ignore")
                    for step in chain:
                        step(generator)
                settled = generator.get_state()
                with _worked_out_lock:
                    _WORKED_OUT[key] = settled
                    while len(_WORKED_OUT) > _WORKED_OUT_SIZE:
                        _WORKED_OUT.popitem(last=False)
            else:
                generator.set_state(settled)
            node.settled = settled
        node.parent = node.base = None       # the draws before are worked out: let them go
    else:
        with _no_dispatch():
            generator.set_state(node.settled)
    return True


# -- what a draw takes from the generator -----------------------------------------------------------

_SERIAL = {"uniform_": "uniform_", "bernoulli_": "bernoulli_", "exponential_": "exponential_",
           "cauchy_": "cauchy_", "geometric_": "geometric_", "log_normal_": "log_normal_",
           "random_": "random_", "rand": "uniform_", "rand_like": "uniform_", "bernoulli": "bernoulli_"}
_NORMAL = frozenset(("normal_", "normal", "randn", "randn_like"))


def _chunks(numel: int):
    done = 0
    while done < numel:
        size = min(CHUNK, numel - done)
        yield size
        done += size


def _keyed(step: Callable, key: tuple) -> Callable:
    step.key = key        # what it draws: equal keys take the same outputs (:data:`_WORKED_OUT`)
    return step


def _serial_step(method: str, dtype: torch.dtype, numel: int, args: tuple, p_dtype: torch.dtype | None) -> Callable:
    def step(generator: torch.Generator) -> None:
        for size in _chunks(numel):
            fresh = torch.empty(size, dtype=dtype)
            if p_dtype is not None:          # bernoulli_ with a tensor p: its values do not change the draws
                getattr(fresh, method)(torch.zeros(size, dtype=p_dtype), generator=generator)
            else:
                getattr(fresh, method)(*args, generator=generator)
    return _keyed(step, ("serial", method, dtype, numel, args, p_dtype))


def _uniform_outputs(count: int) -> Callable:
    def step(generator: torch.Generator) -> None:
        if count >= _mt_jump.JUMP_FROM and _mt_jump.advance(generator, count):
            return                           # many outputs: jumped over (simcomm.sim.mt_jump)
        for size in _chunks(count):
            torch.empty(size, dtype=torch.float32).uniform_(generator=generator)
    return _keyed(step, ("outputs", count))


def _scalar_normal_step(dtype: torch.dtype, numel: int) -> Callable:
    def step(generator: torch.Generator) -> None:
        for size in _chunks(numel):          # not contiguous: torch's scalar path, element by element
            torch.empty((size, 2), dtype=dtype)[:, 0].normal_(generator=generator)
    return _keyed(step, ("scalar normal", dtype, numel))


def _normal(target: torch.Tensor) -> tuple[Callable, int]:
    numel, dtype = target.numel(), target.dtype
    if numel >= 16 and target.is_contiguous():
        if dtype == torch.float32:
            count = numel + (16 if numel % 16 else 0)
        elif dtype == torch.float64:
            count = 2 * (numel + (16 if numel % 16 else 0))
        else:                                  # bfloat16, float16: filled in blocks of 16
            count = -(-numel // 16) * 16
        return _uniform_outputs(count), count
    return _scalar_normal_step(dtype, numel), 2 * numel + 4


_FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _step(func, args: tuple, kwargs: dict, target: Any) -> tuple[Callable, int] | None:
    """The draw ``func`` makes into ``target``, as a step that takes the same outputs from a
    generator, and how many outputs at most; None where it is not followed."""
    if not isinstance(target, torch.Tensor) or target.layout != torch.strided:
        return None
    name, overload = func.__name__.split(".")[0], func._overloadname
    args = tuple(argument for argument in args if not isinstance(argument, torch.Generator))
    numel, dtype = target.numel(), target.dtype
    if name in _NORMAL:
        return _normal(target) if dtype in _FLOATS else None
    if name in ("randint", "random_"):
        if dtype.is_complex or dtype == torch.bool:
            return None
        if name == "random_" and overload == "default":
            bounds: tuple = ()
        else:
            numbers = [argument for argument in (args[1:] if name == "random_" else args[:2])
                       if not isinstance(argument, (list, tuple, torch.Size))]
            if name == "randint" and overload in ("default", "generator"):
                numbers = numbers[:1]
            if not all(type(number) is int for number in numbers) or not numbers:
                return None
            bounds = tuple(numbers) if len(numbers) == 2 else (0, numbers[0])
            if name == "random_" and overload == "to":
                bounds = (0, numbers[0])
        return _serial_step("random_", dtype, numel, bounds, None), 2 * numel
    method = _SERIAL.get(name)
    if method is None or dtype not in _FLOATS:
        return None
    p_dtype = None
    extra: tuple = ()
    if name == "bernoulli" and overload == "default":           # p is the input's values
        p_dtype = args[0].dtype
    elif name == "bernoulli" and overload == "p":
        extra = (args[1],) if len(args) > 1 else (kwargs.get("p", 0.5),)
    elif name == "bernoulli_":
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        if isinstance(p, torch.Tensor):
            if p.dtype not in _FLOATS or p.numel() != 1 and p.shape != target.shape:
                return None
            p_dtype = p.dtype
            if p.numel() == 1 and target.numel() != 1:
                return None
        else:
            extra = (p,)
    elif name in ("geometric_",):
        extra = (args[1] if len(args) > 1 else kwargs.get("p"),)
    if any(isinstance(value, torch.Tensor) for value in extra) or None in extra:
        return None
    if method in ("uniform_", "bernoulli_", "exponential_", "cauchy_", "geometric_"):    # a count of outputs
        if method == "uniform_":
            per_element = 2 if dtype == torch.float64 else 1
        elif method == "bernoulli_" and p_dtype is not None:
            per_element = 2 if p_dtype == torch.float64 else 1
        else:                                 # a double uniform per element
            per_element = 2
        return _uniform_outputs(per_element * numel), per_element * numel
    return _serial_step(method, dtype, numel, extra, p_dtype), 2 * numel


def _takes_nothing(func, args: tuple, kwargs: dict) -> bool:
    """Whether the seeded op ``func`` takes no output from a CPU generator with these arguments:
    the CPU's flash attention (it refuses ``dropout_p > 0``) and dropout outside training."""
    name = func.__name__.split(".")[0]
    if name == "_scaled_dot_product_flash_attention_for_cpu":
        return True
    if name == "native_dropout":
        train = args[2] if len(args) > 2 else kwargs.get("train")
        return train is False
    return False


def follow(func, args: tuple, kwargs: dict, target: Any, generator: torch.Generator, mode: Any) -> bool:
    """Follow the draw ``func`` (into ``target``, a fake tensor) from ``generator`` on this rank;
    False where it is not followed (the caller then makes the state unknown)."""
    if _takes_nothing(func, args, kwargs):
        return True
    found = _step(func, args, kwargs, target)
    if found is None:
        return False
    step, outputs = found
    return _follow_step(generator, mode, step, outputs)


def _cost(step: Callable, outputs: int) -> int:
    """What working ``step`` out costs, in generator outputs drawn: a count of at least
    :data:`simcomm.sim.mt_jump.JUMP_FROM` outputs is jumped over, at a fixed cost."""
    return min(outputs, _mt_jump.JUMP_FROM) if step.key[0] == "outputs" else outputs


def _follow_step(generator: torch.Generator, mode: Any, step: Callable, outputs: int) -> bool:
    state = _real_state(generator)
    node = _node(generator, mode, state)
    if node is not None and node.unknown is not None:
        return True                         # unknown stays unknown
    cost = _cost(step, outputs)
    if node is None:
        new = _Node(None, state, step, cost)
    elif node.settled is not None:
        new = _Node(None, node.settled, step, cost)
    elif node.step.key[0] == "outputs" and step.key[0] == "outputs":     # one count: the chain does not grow
        merged = _uniform_outputs(node.step.key[1] + step.key[1])
        new = _Node(node.parent, node.base, merged,
                    node.outputs - _cost(node.step, node.step.key[1]) + _cost(merged, merged.key[1]))
    else:
        new = _Node(node, None, step, node.outputs + cost)
    if new.outputs > FOLLOW_LIMIT:
        new = _Node(None, None, None, 0, f"the generator's state after more than {FOLLOW_LIMIT:,} outputs of draws "
                                 f"without values (a model's initialisation) is too costly to work out")
    return _stand_in(generator, new, mode, state)


def follow_trunc_normal(replay: Callable, tensor: torch.Tensor, args: tuple, kwargs: dict,
                        mode: Any) -> None:
    """``trunc_normal_`` of the fake ``tensor``: followed by running ``replay`` (torch's own) on a real
    tensor of the same shape and dtype up to :data:`REPLAY_LIMIT` elements, else unknown."""
    generator = kwargs.get("generator", args[4] if len(args) > 4 else None)
    if generator is None:
        if tensor.device.type != "cpu":
            return
        generator = torch.default_generator
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        return
    shape, stride, dtype = tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype
    numbers = args[:4] if len(args) >= 4 else None
    if tensor.numel() > REPLAY_LIMIT or numbers is None or not all(isinstance(n, (int, float)) for n in numbers):
        spoil(generator, mode, "trunc_normal_ redraws as many times as its values need, and this one "
                               "was too large to run again")
        return

    def step(g: torch.Generator) -> None:
        replay(torch.empty_strided(shape, stride, dtype=dtype), *numbers, generator=g)

    _follow_step(generator, mode, _keyed(step, ("trunc_normal_", shape, stride, dtype, tuple(numbers))),
                 4 * tensor.numel())
