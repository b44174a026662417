"""Jumping a CPU generator's Mersenne Twister ahead by many outputs without drawing them.

A shape-only rank follows a CPU generator through draws that have no values
(:mod:`simcomm.sim.shape_random`) and works the real state out when a value is needed. A
training loop's dropout masks take billions of outputs an epoch; drawing them costs about 6 ns
each, so a DataLoader's base seed read at the next epoch would cost minutes. Most of those draws
are counts of outputs (dropout's ``bernoulli_``, ``uniform_``, a contiguous ``normal_``): what
they do to the generator is to move its Mersenne Twister ahead by that many 32-bit outputs.
This module does that move in about a second whatever the count.

**The mathematics.** torch's CPU generator (``at::mt19937``) keeps a block of 624 32-bit words,
reads one per output and, when the block is used up, makes the next block from it
(``next_state``). Each word of the sequence ``w[k+624] = w[k+397] ^ twist(w[k], w[k+1])`` is a
linear function over GF(2) of the 624 words before it, so moving the window of 624 words ``J``
words ahead is a linear map ``T**J``. ``T`` is annihilated by ``x * phi(x)``, where ``phi`` (degree
19937) is the characteristic polynomial of the generator's 19937 state bits (``T`` ignores the low
31 bits of the window's first word, which adds the factor ``x``). So with ``x**J mod x*phi(x) =
sum(c_i x**i)``, the window ``J`` words ahead is the sum (exclusive or) of the windows ``i`` words
ahead for each ``c_i = 1``, ``i < 19938``: 20,562 words generated from the block and one
exclusive or of the chosen windows. ``phi`` is found once per process by Berlekamp-Massey from
39,874 bits of the generator's own output sequence (any bit of the words; the polynomial of
MT19937 is primitive, so every nonzero bit sequence has it as its minimal polynomial), and
``x**J`` by squaring, with the reduction a byte at a time.

**torch's bookkeeping.** ``get_state()`` holds ``left`` (an int32 at byte 8), ``next`` (a uint64 at
byte 16) and the 624 words (uint64 each from byte 24); an output first decrements ``left`` and
makes the next block when it reaches 0 (``left = 624``, ``next = 0``), then reads word ``next``.
The cached normal samples after the words are not touched by such draws, and stay as they are.
:func:`advance` checks the layout once on a scratch generator against real draws, and returns
False (the caller draws for real) where it differs.
"""
from __future__ import annotations

import struct
import threading

import numpy
import torch

__all__ = ["advance", "JUMP_FROM"]

#: the fewest outputs :func:`advance` jumps over (below it, drawing them is as quick)
JUMP_FROM = 1 << 22

_N, _M = 624, 397
_MATRIX_A = numpy.uint32(0x9908B0DF)
_UPPER = numpy.uint32(0x80000000)
_LOWER = numpy.uint32(0x7FFFFFFF)
_DEGREE = 19937
_LEFT, _NEXT, _WORDS = 8, 16, 24          # byte offsets in CPUGeneratorImpl's state
_lock = threading.Lock()
_cache: dict = {}                         # "poly": x*phi(x) as an int; "table": its byte reduction table; "ok"


def _twist(upper: numpy.ndarray, lower: numpy.ndarray) -> numpy.ndarray:
    y = (upper & _UPPER) | (lower & _LOWER)
    return (y >> numpy.uint32(1)) ^ numpy.where(y & numpy.uint32(1), _MATRIX_A, numpy.uint32(0))


def _next_block(old: numpy.ndarray) -> numpy.ndarray:
    """The 624 words ``next_state`` makes from the block ``old`` (uint32)."""
    new = numpy.empty(_N, dtype=numpy.uint32)
    k = _N - _M                                                     # 227
    new[:k] = old[_M:] ^ _twist(old[:k], old[1:k + 1])
    new[k:2 * k] = new[:k] ^ _twist(old[k:2 * k], old[k + 1:2 * k + 1])
    new[2 * k:_N - 1] = new[k:_N - 1 - k] ^ _twist(old[2 * k:_N - 1], old[2 * k + 1:_N])
    new[_N - 1] = new[_M - 1] ^ _twist(old[_N - 1:], new[:1])[0]
    return new


def _words_after(block: numpy.ndarray, count: int) -> numpy.ndarray:
    """The block followed by at least ``count`` more words of its sequence."""
    blocks = [block]
    while (len(blocks) - 1) * _N < count:
        blocks.append(_next_block(blocks[-1]))
    return numpy.concatenate(blocks)


def _berlekamp_massey(bits: list[int]) -> int:
    """The shortest linear recurrence of the GF(2) sequence ``bits``: its connection polynomial as an
    int (bit i: the coefficient of x**i, bit 0 set)."""
    n = len(bits)
    reversed_bits = int("".join(str(bit) for bit in bits), 2)     # bit n-1-k is bits[k]
    c, b = 1, 1
    length, shift = 0, 1
    for index in range(n):
        window = reversed_bits >> (n - 1 - index)                  # bit i: bits[index - i]
        if (c & window).bit_count() & 1:
            previous = c
            c ^= b << shift
            if 2 * length <= index:
                length, b, shift = index + 1 - length, previous, 1
                continue
        shift += 1
    return c


def _characteristic() -> tuple[int, list[int]] | None:
    """``x*phi(x)`` as an int, and the table that reduces by it a byte at a time."""
    if "poly" not in _cache:
        scratch = numpy.arange(1, _N + 1, dtype=numpy.uint32) * numpy.uint32(2654435761)
        words = _words_after(scratch, 2 * _DEGREE + 8)[_N:]
        connection = _berlekamp_massey([int(word >> 31) for word in words[:2 * _DEGREE]])
        if connection.bit_length() - 1 != _DEGREE:
            _cache["poly"] = None
            return None
        # the connection polynomial is phi's reciprocal: reverse its bits
        phi = int(bin(connection)[2:].zfill(_DEGREE + 1)[::-1], 2)
        poly = phi << 1                                            # x * phi(x)
        degree = poly.bit_length() - 1
        table = [0] * 256
        for multiplier in range(256):
            product = 0
            for bit in range(8):
                if multiplier >> bit & 1:
                    product ^= poly << bit
            table[product >> degree] = product
        _cache["poly"], _cache["table"] = poly, table
    poly = _cache["poly"]
    return None if poly is None else (poly, _cache["table"])


#: each byte with a zero bit put after each of its bits (bit i moves to bit 2i): squaring a
#: polynomial over GF(2) spreads its coefficients so, since the cross terms cancel in pairs
_SPREAD = numpy.array([int(bin(byte)[2:].replace("", "0")[:-1] or "0", 2) for byte in range(256)],
                      dtype=numpy.uint16)


def _square(value: int) -> int:
    """``value(x)**2`` over GF(2): each bit moves to twice its position."""
    raw = numpy.frombuffer(value.to_bytes((value.bit_length() + 7) // 8 or 1, "little"), dtype=numpy.uint8)
    return int.from_bytes(_SPREAD[raw].astype("<u2").tobytes(), "little")


def _reduce(value: int, poly: int, table: list[int]) -> int:
    degree = poly.bit_length() - 1
    while value.bit_length() > degree:
        shift = value.bit_length() - degree - 8
        if shift >= 0:
            value ^= table[value >> (degree + shift)] << shift
        else:
            value ^= poly << (value.bit_length() - 1 - degree)
    return value


def _x_power(exponent: int, poly: int, table: list[int]) -> int:
    result = 1
    for bit in bin(exponent)[2:]:
        result = _reduce(_square(result), poly, table)
        if bit == "1":
            result = _reduce(result << 1, poly, table)
    return result


def _jump_block(block: numpy.ndarray, words: int) -> numpy.ndarray | None:
    """The block of 624 words that starts ``words`` words after ``block``'s first."""
    found = _characteristic()
    if found is None:
        return None
    poly, table = found
    degree = poly.bit_length() - 1
    coefficients = _x_power(words, poly, table)
    sequence = _words_after(block, degree)
    windows = numpy.lib.stride_tricks.sliding_window_view(sequence, _N)[:degree]
    chosen = numpy.frombuffer(coefficients.to_bytes((degree + 7) // 8, "little"), dtype=numpy.uint8)
    chosen = numpy.unpackbits(chosen, bitorder="little")[:degree].astype(bool)
    if not chosen.any():
        return numpy.zeros(_N, dtype=numpy.uint32)
    return numpy.bitwise_xor.reduce(windows[chosen], axis=0)


def _jumped(state: torch.Tensor, outputs: int) -> torch.Tensor | None:
    """``state`` (a CPU generator's) after ``outputs`` 32-bit outputs."""
    raw = bytearray(state.numpy().tobytes())
    left = struct.unpack_from("<i", raw, _LEFT)[0]
    position = struct.unpack_from("<Q", raw, _NEXT)[0]
    if not 1 <= left <= _N or position > _N:
        return None
    if outputs <= left - 1:
        struct.pack_into("<i", raw, _LEFT, left - outputs)
        struct.pack_into("<Q", raw, _NEXT, position + outputs)
    else:
        remaining = outputs - (left - 1)                  # the first of these makes the next block
        blocks = (remaining - 1) // _N + 1
        last = remaining - _N * (blocks - 1)              # outputs read from the final block: 1..624
        words = numpy.frombuffer(bytes(raw[_WORDS:_WORDS + 8 * _N]), dtype="<u8").astype(numpy.uint32)
        block = _jump_block(words, _N * blocks)
        if block is None:
            return None
        raw[_WORDS:_WORDS + 8 * _N] = block.astype("<u8").tobytes()
        struct.pack_into("<i", raw, _LEFT, _N + 1 - last)
        struct.pack_into("<Q", raw, _NEXT, last)
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


def _layout_holds() -> bool:
    """Whether jumping a scratch generator gives what drawing gives (checked once per process)."""
    if "ok" not in _cache:
        ok = False
        try:
            scratch = torch.Generator()
            scratch.manual_seed(20_261_206)
            torch.empty(5, dtype=torch.float32).uniform_(generator=scratch)
            for outputs in (3, 619, 620, 624 * 40 + 17):
                start = scratch.get_state()
                jumped = _jumped(start, outputs)
                torch.empty(outputs, dtype=torch.float32).uniform_(generator=scratch)
                ok = jumped is not None and torch.equal(jumped, scratch.get_state())
                if not ok:
                    break
        except Exception:
            ok = False
        _cache["ok"] = ok
    return _cache["ok"]


def advance(generator: torch.Generator, outputs: int) -> bool:
    """Move the CPU ``generator`` ahead by ``outputs`` 32-bit outputs, as drawing that many float32
    uniforms would; False (nothing changed) where this torch's state layout is not the one checked."""
    with _lock:
        if not _layout_holds():
            return False
        jumped = _jumped(generator.get_state(), outputs)
    if jumped is None:
        return False
    generator.set_state(jumped)
    return True
