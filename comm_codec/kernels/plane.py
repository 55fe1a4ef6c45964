"""The raw plane of a split exponent segment: the bits under the exponent, k a symbol.

In a frame with split exponents (fp16, fp8; see ``comm_codec/core/frame_format.md``) a
coded stream-0 segment codes each symbol's top bits alone (``symbol >> k``, k the type's
``split_bits``: the exponent, and e4m3's top mantissa bit) in its four lanes, and after
them stores the symbol's low k bits (the mantissa bits, and fp8's sign, that share the
exponent's byte) uncoded: a *plane* of k
bits per present symbol, LSB first, in symbol order. Groups of 8 symbols fill k whole
bytes, so the plane is :func:`plane_bytes` long, the last group's unused bits zero.

Why: fp16's stream-0 byte ``[e5 m3]`` carries some 5.6 bits, coded in 4-10-bit codes
that the decoder takes one or two a table lookup (1.8 G symbols/s on MiniLM's word
embeddings as fp16); its exponent alone carries 2.7 bits in 1-4-bit codes, four to six
a lookup (4.1 G/s), and the three bits under it are nearly uniform, so storing them raw
costs 0.4-0.65 % of the frame.

Both directions move 8 symbols at a time through one 64-bit word: packing squeezes the
low k bits of 8 symbol bytes into 8k bits in three shift-or-mask steps (fields of k, 2k,
4k, 8k bits), unpacking spreads them back in the three steps reversed. For the k of the
supported types (3, every type that splits today; 4 also) four such words go through the steps
side by side in one 256-bit vector (:func:`_spread32`, :func:`_squeeze32`, written in
LLVM's vector IR since numba cannot vectorize the 3-byte stride): one word at a time,
the decoder's plane cost 0.14 ns a symbol, 3.5 times its whole assembly pass; four
at a time 0.03. Kernels call these inline; a cached kernel is only as new as its own
file (numba keys its cache on the calling module), so a change here must come with a
change to encode.py and decode.py.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .intrinsics import load8, load64, store8_at, store64_at
from .jit import inline

__all__ = ["plane_bytes", "write_plane", "or_plane"]

_ONES8 = np.uint64(0x0101010101010101)
_ONES16 = np.uint64(0x0001000100010001)
_ONES32 = np.uint64(0x0000000100000001)
_U64_0 = np.uint64(0)


def _masks(k):
    """_plane_masks' values as Python ints (for the vector code's constants)."""
    return (
        ((1 << k) - 1) * 0x0101010101010101,
        ((1 << 2 * k) - 1) * 0x0001000100010001,
        ((1 << 4 * k) - 1) * 0x0000000100000001,
        (1 << 8 * k) - 1,
    )


_V4 = ir.VectorType(ir.IntType(64), 4)
_V16 = ir.VectorType(ir.IntType(8), 16)
_V32 = ir.VectorType(ir.IntType(8), 32)


def _splat(value):
    return ir.Constant(_V4, [value] * 4)


def _lanes(count):
    return ir.VectorType(ir.IntType(32), count)


@intrinsic
def _spread32(typingctx, row, plane, k):
    """OR the 4 groups (32 symbols) of the plane at address plane into the 32 bytes at
    address row: reads 16 bytes of the plane (4k used), writes 32 of row; k literal."""
    if not isinstance(k, types.IntegerLiteral) or k.literal_value not in (3, 4):
        return None
    kk = k.literal_value
    m1, m2, m3, _ = _masks(kk)
    # Group j's k bytes to the low bytes of 64-bit word j; index 16 is a zero.
    picks = [i for j in range(4) for i in [kk * j + b for b in range(kk)] + [16] * (8 - kk)]

    def codegen(context, builder, signature, args):
        row_addr, plane_addr, _ = args
        src = builder.load(builder.inttoptr(plane_addr, _V16.as_pointer()), align=1)
        words = builder.bitcast(
            builder.shuffle_vector(src, ir.Constant(_V16, None), ir.Constant(_lanes(32), picks)), _V4
        )
        y = builder.and_(builder.or_(words, builder.shl(words, _splat(32 - 4 * kk))), _splat(m3))
        y = builder.and_(builder.or_(y, builder.shl(y, _splat(16 - 2 * kk))), _splat(m2))
        y = builder.and_(builder.or_(y, builder.shl(y, _splat(8 - kk))), _splat(m1))
        ptr = builder.inttoptr(row_addr, _V4.as_pointer())
        builder.store(builder.or_(builder.load(ptr, align=1), y), ptr, align=1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, k), codegen


@intrinsic
def _squeeze32(typingctx, sym, out, k):
    """Pack the 32 symbol bytes at address sym into 4 groups at address out: writes 16
    bytes (4k of the plane, zeros after them); k literal."""
    if not isinstance(k, types.IntegerLiteral) or k.literal_value not in (3, 4):
        return None
    kk = k.literal_value
    m1, m2, m3, m4 = _masks(kk)
    # Word j's low k bytes to bytes kj.., then zeros (byte 7 of word 0 is one).
    picks = [8 * j + b for j in range(4) for b in range(kk)] + [7] * (16 - 4 * kk)

    def codegen(context, builder, signature, args):
        sym_addr, out_addr, _ = args
        x = builder.load(builder.inttoptr(sym_addr, _V4.as_pointer()), align=1)
        y = builder.and_(x, _splat(m1))
        y = builder.and_(builder.or_(y, builder.lshr(y, _splat(8 - kk))), _splat(m2))
        y = builder.and_(builder.or_(y, builder.lshr(y, _splat(16 - 2 * kk))), _splat(m3))
        y = builder.and_(builder.or_(y, builder.lshr(y, _splat(32 - 4 * kk))), _splat(m4))
        b = builder.bitcast(y, _V32)
        packed = builder.shuffle_vector(b, b, ir.Constant(_lanes(16), picks))
        builder.store(packed, builder.inttoptr(out_addr, _V16.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, k), codegen


@inline
def plane_bytes(n, k):
    """Bytes of the plane of n symbols, k bits each: ceil(n / 8) groups of k bytes.

    Args:
        n: symbols (>= 0).
        k: bits a symbol (``spec.split_bits``, 1..7).

    Returns:
        The plane's size in bytes (not padded).
    """
    return k * ((n + 7) // 8)


@inline
def _plane_masks(k):
    """The masks that :func:`_pack8` and :func:`_unpack8` take.

    Args:
        k: bits a field (1..7).

    Returns:
        (m1, m2, m3, m4), uint64: 8 fields of k bits in bytes, 4 of 2k in 16-bit
        words, 2 of 4k in 32-bit words, and the 8k bits of a packed group.
    """
    m1 = np.uint64((1 << k) - 1) * _ONES8
    m2 = np.uint64((1 << (2 * k)) - 1) * _ONES16
    m3 = np.uint64((1 << (4 * k)) - 1) * _ONES32
    m4 = np.uint64((1 << (8 * k)) - 1)
    return m1, m2, m3, m4


@inline
def _pack8(x, k, m1, m2, m3, m4):
    """Pack the low k bits of x's 8 bytes: byte j's at bits k*j.. of the result.

    Args:
        x: uint64, 8 symbol bytes (their bits above k are ignored).
        k, m1, m2, m3, m4: field width and :func:`_plane_masks` (k).

    Returns:
        uint64 holding the 8k packed bits (the bits above them are 0).
    """
    y = x & m1
    y = (y | (y >> np.uint64(8 - k))) & m2
    y = (y | (y >> np.uint64(16 - 2 * k))) & m3
    return (y | (y >> np.uint64(32 - 4 * k))) & m4


@inline
def _unpack8(x, k, m1, m2, m3):
    """Undo :func:`_pack8`: field j of x's low 8k bits into the low bits of byte j.

    Args:
        x: uint64, a packed group in its low 8k bits (the bits above them are 0).
        k, m1, m2, m3: field width and the first three :func:`_plane_masks` (k).

    Returns:
        uint64 of 8 bytes, each holding its field in its low k bits.
    """
    y = (x | (x << np.uint64(32 - 4 * k))) & m3
    y = (y | (y << np.uint64(16 - 2 * k))) & m2
    return (y | (y << np.uint64(8 - k))) & m1


@inline
def write_plane(sym, n, k, out, end):
    """Write the plane of the n symbol bytes at address sym to address out.

    A group goes out as one 8-byte store (its bytes past the group's k are zeros, and
    the next group's store overwrites them) where the store ends at or before address
    end (the segment's padded end), byte by byte otherwise: nothing past end is
    written, as the next chunk may be another thread's. Reads whole 8-byte groups of
    sym: the caller's buffer has 7 bytes of slack past its n symbols, whose values do
    not matter (the last group's fields past n are cut off).

    Args:
        sym: address of the n symbol bytes (their low k bits go in the plane).
        n: symbols.
        k: bits a symbol (``spec.split_bits``).
        out: address of the plane (:func:`plane_bytes` (n, k) bytes).
        end: address nothing is written at or past.
    """
    groups = (n + 7) // 8
    g = 0
    if k == 3:  # four groups a step while their 16-byte store ends before end
        while g + 4 <= n // 8 and out + 3 * g + 16 <= end:
            _squeeze32(sym + 8 * g, out + 3 * g, 3)
            g += 4
    elif k == 4:
        while g + 4 <= n // 8 and out + 4 * g + 16 <= end:
            _squeeze32(sym + 8 * g, out + 4 * g, 4)
            g += 4
    m1, m2, m3, m4 = _plane_masks(k)
    for q in range(g, groups):
        x = load64(sym + 8 * q)
        if 8 * q + 8 > n:  # the last group: fields past n are zero
            x &= (np.uint64(1) << np.uint64(8 * (n - 8 * q))) - np.uint64(1)
        p = _pack8(x, k, m1, m2, m3, m4)
        at = out + k * q
        if at + 8 <= end:
            store64_at(at, np.int64(p))
        else:
            for b in range(k):
                store8_at(at + b, np.int64(p >> np.uint64(8 * b)))


@inline
def or_plane(row, plane, n, k, end):
    """OR the plane at address plane (n symbols, k bits each) into the low bits of the
    bytes at address row (the lanes' exponents, already shifted up by k).

    Reads stay below address end (the segment's padded end, inside the frame): a group
    is read with one 8-byte load where 8 bytes lie before end, byte by byte otherwise.
    Writes whole 8-byte words of row, up to 7 bytes past its n symbols: the caller's
    row has that slack.

    Args:
        row: address of the n decoded bytes (each an exponent shifted up by k).
        plane: address of the plane (n symbols of k bits).
        n: symbols.
        k: bits a symbol (``spec.split_bits``).
        end: address no read reaches.
    """
    groups = (n + 7) // 8
    g = 0
    if k == 3:  # four groups a step while their 16 bytes lie before end
        while g + 4 <= groups and plane + 3 * g + 16 <= end:
            _spread32(row + 8 * g, plane + 3 * g, 3)
            g += 4
    elif k == 4:
        while g + 4 <= groups and plane + 4 * g + 16 <= end:
            _spread32(row + 8 * g, plane + 4 * g, 4)
            g += 4
    m1, m2, m3, m4 = _plane_masks(k)
    for q in range(g, groups):
        at = plane + k * q
        if at + 8 <= end:
            x = load64(at) & m4
        else:
            x = _U64_0
            for b in range(k):
                x |= np.uint64(load8(at + b)) << np.uint64(8 * b)
        d = row + 8 * q
        store64_at(d, np.int64(load64(d) | _unpack8(x, k, m1, m2, m3)))
