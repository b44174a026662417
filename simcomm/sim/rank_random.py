"""Per-rank random state: each virtual rank draws from a default generator of its own.

On real processes every rank has its own default generators, so
``torch.manual_seed(0)`` then ``torch.randn(3)`` gives every rank the same
numbers whatever the others draw. Virtual ranks are threads of one process
and share torch's one default CPU generator (and one per CUDA device). Since
the ranks take turns (:class:`simcomm.sim.scheduler.RunState`), the generator belongs to
the rank holding the turn: a rank saves the generator's state when it hands
the turn on and loads its own state when it gets the turn back. Seeding or
drawing on one rank therefore never changes another rank's numbers.

**Where a rank starts.** Rank ``r`` starts every run from its own seed,
:func:`simcomm.fresh_state.rank_seed` of the run seed and ``r`` (``SIMCOMM_SEED``;
by default rank 0 starts where a fresh ``torch.Generator()`` does), on the CPU
and, in a CUDA World, on the World's device: unseeded numbers differ from rank to
rank as they do between the processes of a torchrun run (torch 2.13 seeds each
new interpreter from the operating system), and are the same in every run with
the same run seed. ``real`` seeds each worker with the same seed at the start of
every run. A rank's state is made in its first turn (:class:`RankRandomState`'s
``seed``), not up front, so a run of thousands of ranks allocates nothing for
ranks that never ran.

The caller's own generator state is saved before a run and put back after
it, so a run does not change the numbers the caller draws next.

**Cost.** ``get_state`` builds a new 5 KB tensor (about 1 us) and
``set_state`` parses one, at every handoff. :func:`cpu_raw` reads and writes
the CPU generator's state as raw bytes instead (its Mersenne Twister engine and
its two cached normal samples, 2544 bytes straight from the generator's memory,
about 0.1 us), so :class:`simcomm.sim.process_state.RankProcessState` compares a
rank's state with the live one and saves or loads only when a rank changed it.
The layout is found and checked on a scratch generator once (round trips through
``get_state`` after draws that fill and empty the cached samples); where it is
not what it should be, every handoff uses ``get_state``/``set_state``.
"""
from __future__ import annotations

import ctypes
import struct
from typing import Callable, NamedTuple

import torch


__all__ = ["RankRandomState", "RawState", "cpu_raw"]


class RankRandomState:
    """How to read, write and seed torch's default generators in one run.

    ``get_state()``/``set_state(state)`` read and write the CPU generator (and, in a CUDA
    World, the device's: each state then holds the CPU and the device state together);
    ``seed(n)`` seeds the live generators as ``torch.manual_seed(n)`` does (in a CUDA World
    only the World's device among the CUDA generators). The per-rank copies live in
    :class:`simcomm.sim.process_state.RankProcessState`, which uses these calls where
    :func:`cpu_raw` has no raw access (a CUDA World, an unknown layout): about 1 us per
    handoff on the CPU, a 5 KB state copied out and in. The caller's state is saved before
    a run and put back after it (:meth:`save_caller`, :meth:`restore_caller`).
    """

    __slots__ = ("get_state", "set_state", "seed", "caller")

    def __init__(self, device: torch.device):
        cpu = torch.default_generator
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.get_state = lambda: (cpu.get_state(), torch.cuda.get_rng_state(index))

            def set_state(state: tuple[torch.Tensor, torch.Tensor]) -> None:
                cpu.set_state(state[0])
                torch.cuda.set_rng_state(state[1], index)

            def seed(value: int) -> None:
                cpu.manual_seed(value)
                torch.cuda.default_generators[index].manual_seed(value)
            self.set_state, self.seed = set_state, seed
        else:
            self.get_state, self.set_state = cpu.get_state, cpu.set_state
            self.seed = cpu.manual_seed
        self.caller = None

    def save_caller(self) -> None:
        """Before a run: remember the state of the thread that starts it."""
        self.caller = self.get_state()

    def restore_caller(self) -> None:
        """After a run: the caller's generators are as they were before it."""
        if self.caller is not None:
            self.set_state(self.caller)


# -- the CPU generator's state as raw bytes -------------------------------------------------------

class RawState(NamedTuple):
    """A generator's state read and written as raw bytes (``get() -> bytes``, ``set(bytes)``)."""

    get: Callable[[], bytes]
    set: Callable[[bytes], None]


#: ``at::mt19937`` (seed u64, left i32, seeded bool, next u32, 624 u32 words), then the generator's
#: ``optional<float>`` and ``optional<double>`` cached normal samples: CPUGeneratorImpl's own fields
_ENGINE_BYTES = 8 + 4 + 4 + 4 + 624 * 4
_RAW_BYTES = 2544
#: the generator object's fields before the engine lie within these first bytes (c10::GeneratorImpl)
_SEARCH_BYTES = 256


def _engine_offset(generator: torch.Generator) -> int | None:
    """Where the engine of CPU ``generator`` starts, found from a distinctive seed and checked
    against the 624 words ``get_state`` reports (the legacy layout: seed, left, seeded, next, then
    the words as u64); ``None`` when nothing matches."""
    seed = 0x5EED_C0DE_2544_0001
    generator.manual_seed(seed)
    torch.rand(3, generator=generator)   # moves left/next off their seeded values
    state = bytes(generator.get_state().numpy())
    if len(state) < 24 + 624 * 8:
        return None
    _, left, _, next_ = struct.unpack_from("=QiiQ", state, 0)
    words = struct.unpack_from("=624Q", state, 24)
    address = generator._cdata
    head = ctypes.string_at(address, _SEARCH_BYTES)
    offset = head.find(struct.pack("=Q", seed))
    while 0 <= offset <= _SEARCH_BYTES - 8:
        if offset % 8 == 0:
            raw = ctypes.string_at(address + offset, _ENGINE_BYTES)
            raw_seed, raw_left, raw_next = struct.unpack_from("=Qi4xI", raw, 0)
            if (raw_seed, raw_left, raw_next) == (seed, left, next_) and \
                    struct.unpack_from("=624I", raw, 20) == tuple(word & 0xFFFF_FFFF for word in words):
                return offset
        offset = head.find(struct.pack("=Q", seed), offset + 1)
    return None


def _round_trips(generator: torch.Generator, get: Callable[[], bytes], set_: Callable[[bytes], None]) -> bool:
    """Whether saving and loading raw bytes gives back exactly what ``get_state`` reports, after
    draws that leave the cached normal samples full and empty."""
    draws = [lambda: torch.randn(1, generator=generator, dtype=torch.float64),   # caches a double sample
             lambda: torch.empty(1).normal_(generator=generator),                # uses it / a float one
             lambda: torch.randn(20, generator=generator),
             lambda: torch.randint(0, 1 << 30, (700,), generator=generator),     # past one 624-word block
             lambda: torch.randn(1, generator=generator, dtype=torch.float64)]
    saved = [(get(), generator.get_state())]
    for draw in draws:
        draw()
        saved.append((get(), generator.get_state()))
    for raw, state in saved + saved[::-1]:
        set_(raw)
        if not torch.equal(generator.get_state(), state):
            return False
    return len({raw for raw, _ in saved}) == len(saved)


def _raw_at(generator: torch.Generator, offset: int) -> RawState:
    # a byte view of the generator's own memory: reading and writing it costs about 0.1 us
    view = memoryview((ctypes.c_char * _RAW_BYTES).from_address(generator._cdata + offset)).cast("B")
    everything = slice(None)

    def set_(raw: bytes) -> None:
        view[everything] = raw
    set_.generator = generator    # keeps a scratch generator alive as long as its view

    return RawState(view.tobytes, set_)


_CPU_RAW: list = []


def cpu_raw() -> RawState | None:
    """Raw access to ``torch.default_generator``'s state (see the module docstring), or ``None``
    where the generator's layout is not the one checked here."""
    if not _CPU_RAW:
        found = None
        try:
            scratch = torch.Generator()
            offset = _engine_offset(scratch)
            if offset is not None and _round_trips(scratch, *_raw_at(scratch, offset)):
                found = _raw_at(torch.default_generator, offset)
        except (AttributeError, TypeError, ValueError, RuntimeError, struct.error):
            found = None
        _CPU_RAW.append(found)
    return _CPU_RAW[0]
