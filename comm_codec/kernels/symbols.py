"""Element bits to stream symbols, the chunk's reference exponent, zero counts, the payload checksum.

The element bit layout is :mod:`comm_codec.kernels.layout`'s. numba compiles one
specialization per array type, so element width and rotation are compile-time constants
(:func:`element_layout`) and the bit shuffling in the hot loops folds into a few
instructions (with the layout as run-time parameters, the shifts and masks would be
computed in every iteration of the hot loops).
"""

from __future__ import annotations

import numpy as np
from numba.extending import overload

from .jit import OVERLOAD_OPTIONS, inline, jit
from .layout import HASH_MUL, HASH_SEED

__all__ = [
    "element_layout",
    "stream_params",
    "symbol",
    "symbol0",
    "symbols0",
    "rotated",
    "chunk_ref",
    "count_zeros",
    "hash_start",
    "hash_finish",
    "hash_words",
]


def element_layout(bits):
    """(width in bytes, rotate, all-ones mask) of an element-bits array; compile-time."""
    raise NotImplementedError  # only called from kernels, through the overload below


@overload(element_layout, jit_options=OVERLOAD_OPTIONS)
def _ol_element_layout(bits):
    width = bits.dtype.bitwidth // 8
    rotate = 1 if not bits.dtype.signed else 0
    mask = (1 << (8 * width)) - 1

    def impl(bits):
        return width, rotate, mask

    return impl


@inline
def stream_params(bits, s, exp_shift, ref):
    """(sh, sub, top, ra, mask) for :func:`symbol` of stream s of this array type."""
    width, ra, mask = element_layout(bits)
    sub = (np.int64(ref) << exp_shift) if (s == 0 and exp_shift >= 0) else np.int64(0)
    return np.int64(8 * (width - 1 - s)), sub, np.int64(8 * width), np.int64(ra), np.int64(mask)


@inline
def symbol(v, sh, sub, top, ra, mask):
    """One stream's symbol of element bits v.

    The element is rotated left by ra (1: sign to bit 0) within top bits, shifted right
    by sh (8 * (width - 1 - stream)) and, for an exponent stream, reduced by sub
    (ref << exp_shift) modulo 256.
    """
    x = np.int64(v) & mask
    return ((((x << ra) | (x >> (top - ra))) >> sh) - sub) & 255


def symbol0(v):
    """Stream 0's byte of element bits v (before any reference), with the layout of v's
    type folded into constants; compile-time, like :func:`element_layout`."""
    raise NotImplementedError  # only called from kernels, through the overload below


@overload(symbol0, jit_options=OVERLOAD_OPTIONS)
def _ol_symbol0(v):
    width = v.bitwidth // 8
    if v.signed:  # int8: the byte itself
        return lambda v: np.int64(v) & 255
    if width == 1:  # fp8: the byte rotated left by one
        return lambda v: ((np.int64(v) << 1) | (np.int64(v) >> 7)) & 255
    # wider floats: the sign rotated in lands in the last stream, so stream 0 is a
    # plain shift of the element (bf16: v >> 7)
    shift = 8 * width - 9
    return lambda v: (np.int64(v) >> shift) & 255


def symbols0(view, sub, out):
    """Write stream 0's symbols of view, relative to sub (``(byte - sub) mod 256``), to
    out[:view.size] (uint8); compile-time per element type, like :func:`symbol0`.

    The encoder's packer reads symbols from such a buffer, two at a time as one uint16
    index into its pair tables. For 2- and 4-byte elements the bytes are cut out of
    8-byte words (4 or 2 elements each) with shifts and masks in a loop the compiler
    vectorizes; element by element, with the arithmetic widened to int64, the same loop
    cost twice as much. The reference is subtracted inside each element: with the
    sign bit set first, the subtraction cannot borrow across elements, and bits below
    the byte are left alone.
    """
    raise NotImplementedError  # only called from kernels, through the overload below


@overload(symbols0, jit_options=OVERLOAD_OPTIONS)
def _ol_symbols0(view, sub, out):
    width = view.dtype.bitwidth // 8
    if view.dtype.signed or width == 1:

        def impl_bytes(view, sub, out):
            for i in range(view.size):
                out[i] = (symbol0(view[i]) - sub) & 255

        return impl_bytes
    shift = np.uint64(8 * width - 9)  # stream 0 is (v >> shift) & 255 (see symbol0)
    per = 8 // width
    signs = np.uint64(0x8000800080008000 if width == 2 else 0x8000000080000000)
    ones = np.uint64(0x0001000100010001 if width == 2 else 0x0000000100000001)
    field = np.uint64(0x00FF00FF00FF00FF if width == 2 else 0x000000FF000000FF)

    def impl(view, sub, out):
        n = view.size
        q = n // per
        words = view[: per * q].view(np.uint64)
        minus = (np.uint64(sub) << shift) * ones
        if per == 4:
            dst4 = out[: 4 * q].view(np.uint32)
            for k in range(q):
                y = (((words[k] | signs) - minus) >> shift) & field  # the 4 symbols in the words' low bytes
                y = (y | (y >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
                dst4[k] = np.uint32((y | (y >> np.uint64(16))) & np.uint64(0xFFFFFFFF))
        else:
            dst2 = out[: 2 * q].view(np.uint16)
            for k in range(q):
                y = (((words[k] | signs) - minus) >> shift) & field
                dst2[k] = np.uint16((y | (y >> np.uint64(24))) & np.uint64(0xFFFF))
        for i in range(per * q, n):
            out[i] = (symbol0(view[i]) - sub) & 255

    return impl


@inline
def rotated(table, sub):
    """table re-indexed by the absolute byte: out[b] = table[(b - sub) mod 256].

    Stream 0's reference folded into a copy of its tables once per chunk costs 256
    lookups; subtracting it from every element would cost one per symbol.
    """
    out = np.empty(256, dtype=table.dtype)
    for b in range(256):
        out[b] = table[(b - sub) & 255]
    return out


@jit
def chunk_ref(bits, lo, hi, exp_shift):
    """Reference exponent of a chunk: the mode of a strided sample of its exponents.

    Every ``max(1, n // 256)``-th element from the chunk's first; exact zeros are left
    out (they are masked or rare); ties go to the smaller exponent. A poor reference
    only costs bits, never correctness. 0 when ``exp_shift < 0`` (integers).
    """
    if exp_shift < 0:
        return 0
    hist = np.zeros(256, dtype=np.int64)
    step = max(1, (hi - lo) // 256)
    sh, _, top, ra, mask = stream_params(bits, 0, -1, 0)
    for i in range(lo, hi, step):
        if bits[i] != 0:
            hist[symbol(bits[i], sh, 0, top, ra, mask) >> exp_shift] += 1
    best = 0
    for e in range(256):
        if hist[e] > hist[best]:
            best = e
    return best


@jit
def count_zeros(view):
    """How many elements of view are all-zero bits (a vectorized pass of its own: counting
    them inside a histogram's loop cost a quarter of its time)."""
    z = np.int64(0)
    for i in range(view.size):
        z += np.int64(view[i] == 0)
    return z


@inline
def _quads(view, h0, h1, h2, h3):
    """The chains after view's whole quads of words (word k into chain k mod 4)."""
    q = view.size // 4
    for k in range(q):
        h0 = (h0 ^ view[4 * k]) * HASH_MUL
        h1 = (h1 ^ view[4 * k + 1]) * HASH_MUL
        h2 = (h2 ^ view[4 * k + 2]) * HASH_MUL
        h3 = (h3 ^ view[4 * k + 3]) * HASH_MUL
    return h0, h1, h2, h3


@inline
def _fold(tail, h0, h1, h2, h3):
    """The checksum from the chains and the last words (fewer than 4): combined, folded to 32 bits."""
    r = tail.size
    if r > 0:
        h0 = (h0 ^ tail[0]) * HASH_MUL
    if r > 1:
        h1 = (h1 ^ tail[1]) * HASH_MUL
    if r > 2:
        h2 = (h2 ^ tail[2]) * HASH_MUL
    h = (((h0 ^ h1) * HASH_MUL ^ h2) * HASH_MUL ^ h3) * HASH_MUL
    return np.uint32((h >> np.uint64(32)) ^ (h & np.uint64(0xFFFFFFFF)))


@jit
def hash_words(words, start, nwords, seed):
    """Checksum of words[start:start+nwords]: four multiply-xor chains, then combined.

    Four chains (over words k = j mod 4) keep four multiplications in flight; one chain
    is bound by the multiply's latency. The 64-bit result is folded to 32 bits.
    """
    base = HASH_SEED ^ np.uint64(seed)
    view = words[start : start + nwords]
    h0, h1, h2, h3 = _quads(view, base, base ^ np.uint64(1), base ^ np.uint64(2), base ^ np.uint64(3))
    return _fold(view[4 * (view.size // 4) :], h0, h1, h2, h3)


@jit
def hash_start(hs, start, nwords, seed):
    """Set hs (uint64[layout.HASH_STATE]) to :func:`hash_words`' state before any word of
    words[start:start+nwords]: the four chains at their seeds, the next word, the end of
    the whole quads.

    The decoder's lane loops take quads into the chains while they decode
    (:func:`comm_codec.kernels.lanes.decode_lanes`); :func:`hash_finish` takes the rest.
    """
    base = HASH_SEED ^ np.uint64(seed)
    hs[0] = base
    hs[1] = base ^ np.uint64(1)
    hs[2] = base ^ np.uint64(2)
    hs[3] = base ^ np.uint64(3)
    hs[4] = np.uint64(start)
    hs[5] = np.uint64(start + 4 * (nwords // 4))


@jit
def hash_finish(words, hs, start, nwords):
    """:func:`hash_words` of words[start:start+nwords] from hs, whose chains have taken the
    quads before word hs[4] (:func:`hash_start`): the quads left, the last words, folded."""
    end4 = start + 4 * (nwords // 4)
    h0, h1, h2, h3 = _quads(
        words[np.int64(hs[4]) : end4], np.uint64(hs[0]), np.uint64(hs[1]), np.uint64(hs[2]), np.uint64(hs[3])
    )
    return _fold(words[end4 : start + nwords], h0, h1, h2, h3)
