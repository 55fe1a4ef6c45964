"""Lane decoding: four Huffman bit streams of one coded segment, advanced in lockstep.

A coded segment holds :data:`~comm_codec.kernels.layout.LANES` independent lanes over
consecutive quarters of its symbols. :func:`decode_lanes` advances the four in lockstep
so that four table lookups are in flight at once (as huff0's 4-stream mode); one lane
alone is bound by the lookup -> shift dependency chain. Each lookup goes to a
multi-symbol table (:func:`multi_tables`, built once per book from its decode table and
cached by the codec) that holds up to six whole codes per 12-bit window: exponent codes
are 2-3 bits, so most windows hold several. Wider windows (13, 14 bits) make tables
that no longer fit in L1. Escapes and invalid windows take the one-symbol path, which
keeps the checks. A lookup's symbols go out as one 8-byte store into a byte row per
stream (the next step overwrites the unused slots); the elements are assembled from the
rows afterwards (:mod:`comm_codec.kernels.decode`).

The lane loop is bound by its lookups and the assembly by memory, so the lane loop asks
for the cache lines that the assembly will touch next, a few per round: the two phases
overlap.
"""

from __future__ import annotations

import numpy as np

from .intrinsics import address, load16, load64, prefetch_at, store8_at, store64, store64_at
from .jit import entry, inline, jit
from .layout import (DEC_ENTRIES, LANE_HEADER, LANES, STATUS_BAD_CODE, STATUS_BOOK, STATUS_OK, STATUS_OVERRUN,
                     STATUS_SIZE)

__all__ = ["MULTI_BITS", "multi_tables", "decode_lanes"]

MULTI_BITS = 12  # window of a multi-symbol lookup
_MULTI_SIZE = 1 << MULTI_BITS
_MULTI_MASK = np.uint64(_MULTI_SIZE - 1)
_MULTI_MAX = 6  # symbols per multi-symbol table entry; its store writes 8 bytes
_DEC_INDEX = DEC_ENTRIES - 1
_DEC_MASK = np.uint64(_DEC_INDEX)
_U64_0 = np.uint64(0)


@jit
def _get_u32(buf8, pos):
    return (np.int64(buf8[pos]) | (np.int64(buf8[pos + 1]) << 8)
            | (np.int64(buf8[pos + 2]) << 16) | (np.int64(buf8[pos + 3]) << 24))


@inline
def _peek(words, base, nwords, pos):
    """64 bits of a lane from bit pos; bits past the lane's last word read as zero."""
    w = pos >> 6
    off = np.uint64(pos & 63)
    lo = words[base + w] if w < nwords else _U64_0
    hi = words[base + w + 1] if w + 1 < nwords else _U64_0
    return (lo >> off) | ((hi << np.uint64(1)) << (np.uint64(63) - off))


@inline
def _step(buf, dec):
    """Decode one symbol from buf: (symbol, bits used); bits used 0 = no such code."""
    e = np.int64(dec[np.int64(buf & _DEC_MASK)])
    ln = (e >> 8) & 15
    sym = e & 255
    if e >= 0x8000 or ln == 0:  # escape or invalid: off the fast path
        if ln == 0:
            return 0, 0
        sym = np.int64(buf >> np.uint64(ln)) & 255
        ln += 8
    return sym, ln


@jit
def _multi_table(dec, multi):
    """Fill multi (uint64[4096]) with up to six whole codes per 12-bit window of dec.

    Entry: total length in bits 0-7 (a shift count as it stands: the decoder's window
    shift needs no extraction on its dependency chain), symbols in bits 8-15, 16-23, ...,
    48-55 (unused ones 0), symbol count in bits 56-58; 0 where the window starts with an
    escape or no code, so the decoder falls back to :func:`_step`. A code is taken only
    when all its bits lie inside the 12 known ones (a prefix code is decided by its own
    bits alone). Six, not four: exponent codes are 2-3 bits, and a 12-bit window held
    five or six of them often enough to pay for the wider store.
    """
    for x in range(_MULTI_SIZE):
        bits = np.int64(x)
        avail = np.int64(MULTI_BITS)
        entry = np.int64(0)
        total = np.int64(0)
        n = np.int64(0)
        while n < _MULTI_MAX:
            e = np.int64(dec[bits & _DEC_INDEX])
            ln = (e >> 8) & 15
            if e >= 0x8000 or ln == 0 or ln > avail:
                break
            entry |= (e & 255) << (8 + 8 * n)
            total += ln
            bits >>= ln
            avail -= ln
            n += 1
        multi[x] = (entry | total | (n << 56)) if n else 0


@inline
def _multi_step(buf, multi, dec, dst, i):
    """Decode up to six symbols from buf into dst[i:i+8]: (symbols done, bits used).

    Always writes eight bytes (the caller leaves room): slots past the symbols decoded
    are rewritten by the next step. Symbols are the codes' own bytes; stream 0's
    reference is added when the element is assembled.
    """
    e = np.int64(multi[np.int64(buf & _MULTI_MASK)])
    if e != 0:
        store64(dst, i, e >> 8)
        return (e >> 56) & 7, e & 63
    sym, ln = _step(buf, dec)
    if ln == 0:
        return 0, 0
    dst[i] = sym
    return 1, ln


@jit
def _lane_rest(words, base, nwords, pos, multi, dec, dst, i, end):
    """Decode dst[i:end] of one lane, three steps per refill while 20 slots remain."""
    while i + 20 <= end:  # 3 steps of up to 6 symbols, each writing 8 bytes
        b = _peek(words, base, nwords, pos)
        for r in range(3):
            n, ln = _multi_step(b, multi, dec, dst, i)
            if ln == 0:
                return STATUS_BAD_CODE, pos
            b >>= np.uint64(ln)
            pos += ln
            i += n
    while i < end:  # one symbol per refill
        sym, ln = _step(_peek(words, base, nwords, pos), dec)
        if ln == 0:
            return STATUS_BAD_CODE, pos
        pos += ln
        dst[i] = sym
        i += 1
    return STATUS_OK, pos


@inline
def _window(f, p):
    """At least 57 bits of the frame at address f from bit p on (the caller bounds p)."""
    return load64(f + (p >> 3)) >> np.uint64(p & 7)


@jit
def _slow_step(f, p, d, dec):
    """One symbol at bit p with the plain table at address dec, stored at address d:
    (bits used, 0 = no such code). Off the fast path (escapes), so not inlined."""
    w = _window(f, p)
    x = np.int64(load16(dec + 2 * np.int64(w & _DEC_MASK)))
    ln = (x >> 8) & 15
    sym = x & 255
    if x >= 0x8000 and ln != 0:  # escape: the symbol's 8 bits follow its code
        sym = np.int64(w >> np.uint64(ln)) & 255
        ln += 8
    store8_at(d, sym)
    return ln


@inline
def _fast_step(f, b, p, d, multi, dec):
    """One step of the fast loop: (window, bit position, output address).

    b is the window at bit p of the frame at address f (>= 12 valid bits guaranteed by
    the caller); d is where the next symbol goes; multi and dec are the tables'
    addresses. A multi-symbol entry stores its symbols (one 8-byte store) and shifts the
    window; anything else (an escape, or no code: rare) decodes one symbol from a fresh
    read at p and reloads the window there, so the fast path needs no more valid bits
    than 12. On a bit pattern that is no code the lane stalls (p and d stay) instead of
    raising a flag: a flag carried through the loop cost a register, and with 4 lanes
    x 3 values + 3 addresses the loop spilled its windows to the stack. The caller
    notices a lane that stopped moving, and the checked tail reports the bad code.
    """
    e = load64(multi + 8 * np.int64(b & _MULTI_MASK))
    if e != _U64_0:
        store64_at(d, np.int64(e >> np.uint64(8)))
        ln = np.int64(e) & 63  # the mask folds into the shift instruction
        return b >> np.uint64(ln), p + ln, d + (np.int64(e >> np.uint64(56)) & 7)
    ln = _slow_step(f, p, d, dec)
    p += ln
    return _window(f, p), p, d + np.int64(ln != 0)


@jit
def decode_lanes(frame8, frame64, pos, size, count, dec, multi, dst, pf_in, pf_in_end, pf_out, pf_out_end):
    """Decode one coded segment (4 lanes) of count symbols into dst (uint8); return status.

    While it decodes (bound by its lookups, not by memory) it asks for the addresses
    [pf_in, pf_in_end) and [pf_out, pf_out_end) to be brought into cache, 2 and 4 lines
    a round (a round makes ~64 symbols): the bytes that the assembly of the chunk reads
    next (its raw streams) and the output it writes (read for ownership first). Hints
    only: any addresses are safe.
    """
    if size < LANE_HEADER:
        return STATUS_SIZE
    lb0 = _get_u32(frame8, pos)
    lb1 = _get_u32(frame8, pos + 4)
    lb2 = _get_u32(frame8, pos + 8)
    lb3 = _get_u32(frame8, pos + 12)
    n0 = (lb0 + 7) // 8
    n1 = (lb1 + 7) // 8
    n2 = (lb2 + 7) // 8
    n3 = (lb3 + 7) // 8
    if LANE_HEADER + 8 * (n0 + n1 + n2 + n3) != size:
        return STATUS_SIZE
    w0 = (pos + LANE_HEADER) // 8
    w1 = w0 + n0
    w2 = w1 + n1
    w3 = w2 + n2
    e0 = count // LANES
    e1 = 2 * count // LANES
    e2 = 3 * count // LANES
    e3 = count
    i0 = np.int64(0)
    i1 = e0
    i2 = e1
    i3 = e2
    # Fast loop on absolute bit positions of the frame. A round reads each lane's next
    # 57+ bits with one unaligned load and takes 4 steps from each (up to 6 symbols and
    # 12 bits a step; an escape reloads). Instead of checking every round, run as many
    # rounds as no lane can go wrong in: 24 symbols a round, and the 8-byte store of the
    # last step (from up to 18 symbols in), must fit before the lane's end, and 4 x 20
    # bits (4 escapes) a round must leave an 8-byte read inside the frame. Valid lanes
    # never read past their own end there; a corrupt one may read its neighbour's bits
    # and then fails the overrun check below.
    if multi.size != _MULTI_SIZE or dec.size != DEC_ENTRIES or dst.size < count:  # the codec's tables; trust nothing
        return STATUS_BOOK
    f = address(frame8)
    mt = address(multi)
    dt = address(dec)
    d0 = address(dst)
    q0 = 64 * w0
    q1 = 64 * w1
    q2 = 64 * w2
    q3 = 64 * w3
    lim = 8 * (frame8.size - 8)
    while True:
        rounds = min(min((e0 - i0 - 2) // 24, (e1 - i1 - 2) // 24), min((e2 - i2 - 2) // 24, (e3 - i3 - 2) // 24))
        rounds = min(rounds, (lim - max(max(q0, q1), max(q2, q3))) // 80)
        if rounds <= 0:
            break
        start0 = q0
        start1 = q1
        start2 = q2
        start3 = q3
        a0 = d0 + i0
        a1 = d0 + i1
        a2 = d0 + i2
        a3 = d0 + i3
        for _ in range(rounds):
            b0 = _window(f, q0)
            b1 = _window(f, q1)
            b2 = _window(f, q2)
            b3 = _window(f, q3)
            prefetch_at(pf_in, 0)
            prefetch_at(pf_in + 64, 0)
            prefetch_at(pf_out, 1)
            prefetch_at(pf_out + 64, 1)
            prefetch_at(pf_out + 128, 1)
            prefetch_at(pf_out + 192, 1)
            pf_in = min(pf_in + 128, pf_in_end)
            pf_out = min(pf_out + 256, pf_out_end)
            b0, q0, a0 = _fast_step(f, b0, q0, a0, mt, dt)
            b1, q1, a1 = _fast_step(f, b1, q1, a1, mt, dt)
            b2, q2, a2 = _fast_step(f, b2, q2, a2, mt, dt)
            b3, q3, a3 = _fast_step(f, b3, q3, a3, mt, dt)
            b0, q0, a0 = _fast_step(f, b0, q0, a0, mt, dt)
            b1, q1, a1 = _fast_step(f, b1, q1, a1, mt, dt)
            b2, q2, a2 = _fast_step(f, b2, q2, a2, mt, dt)
            b3, q3, a3 = _fast_step(f, b3, q3, a3, mt, dt)
            b0, q0, a0 = _fast_step(f, b0, q0, a0, mt, dt)
            b1, q1, a1 = _fast_step(f, b1, q1, a1, mt, dt)
            b2, q2, a2 = _fast_step(f, b2, q2, a2, mt, dt)
            b3, q3, a3 = _fast_step(f, b3, q3, a3, mt, dt)
            b0, q0, a0 = _fast_step(f, b0, q0, a0, mt, dt)
            b1, q1, a1 = _fast_step(f, b1, q1, a1, mt, dt)
            b2, q2, a2 = _fast_step(f, b2, q2, a2, mt, dt)
            b3, q3, a3 = _fast_step(f, b3, q3, a3, mt, dt)
        i0 = a0 - d0
        i1 = a1 - d0
        i2 = a2 - d0
        i3 = a3 - d0
        if q0 == start0 or q1 == start1 or q2 == start2 or q3 == start3:
            break  # a lane stalled on a bad code all along: the tail below reports it
    p0 = q0 - 64 * w0
    p1 = q1 - 64 * w1
    p2 = q2 - 64 * w2
    p3 = q3 - 64 * w3
    if p0 > 8 * lb0 or p1 > 8 * lb1 or p2 > 8 * lb2 or p3 > 8 * lb3:
        return STATUS_OVERRUN
    st, p0 = _lane_rest(frame64, w0, n0, p0, multi, dec, dst, i0, e0)
    if st == STATUS_OK:
        st, p1 = _lane_rest(frame64, w1, n1, p1, multi, dec, dst, i1, e1)
    if st == STATUS_OK:
        st, p2 = _lane_rest(frame64, w2, n2, p2, multi, dec, dst, i2, e2)
    if st == STATUS_OK:
        st, p3 = _lane_rest(frame64, w3, n3, p3, multi, dec, dst, i3, e3)
    if st == STATUS_OK and (p0 > 8 * lb0 or p1 > 8 * lb1 or p2 > 8 * lb2 or p3 > 8 * lb3):
        return STATUS_OVERRUN
    return st


@entry
def multi_tables(dec_tables, multi):
    """Fill multi (uint64[ns, nbooks, 4096]) from dec_tables (uint16[ns, nbooks, 4096]).

    Built once per set of books (the codec caches them): 4096 lookups per book.
    """
    for s in range(dec_tables.shape[0]):
        for k in range(dec_tables.shape[1]):
            _multi_table(dec_tables[s, k], multi[s, k])
