"""Lane decoding: four Huffman bit streams of one coded segment, advanced in lockstep.

A coded segment holds :data:`~comm_codec.kernels.layout.LANES` independent lanes over
consecutive quarters of its symbols. :func:`decode_lanes` advances the four in lockstep
so that four table lookups are in flight at once (as huff0's 4-stream mode); one lane
alone is bound by the lookup -> shift dependency chain. Each lookup goes to a
multi-symbol table (:func:`multi_tables`, built once per book from its decode table and
cached by the codec) that holds up to six whole codes per 12-bit window: exponent codes
are 2-3 bits, so most windows hold several. Wider windows (13, 14 bits) make tables
that no longer fit in L1. The fast loop has no branch per lookup: a window that starts
with an escape or with no code has the entry 0, which moves nothing, so its lane stalls
until the round ends; there the loop sees it and decodes that symbol alone (escapes are
rarer than 2**-13 a symbol each). A lookup's symbols go out as one 8-byte store into a
byte row per stream (the next step overwrites the unused slots); the elements are
assembled from the rows afterwards (:mod:`comm_codec.kernels.decode`), or, for 1-byte
integer types, the row is the output.

The lane loop is bound by its lookups and the assembly by memory, so the lane loop asks
for the cache lines that the assembly will touch next, a few per round: the two phases
overlap. For the same reason the rounds take the chunk's checksum along, a quad of words
a round (:func:`decode_lanes`). The lockstep rounds end when the first lane nears its
end; the other lanes go on in rounds of their own (:func:`_lane_alone`), and only each
lane's last few symbols take checked steps (:func:`_lane_rest`).
"""

from __future__ import annotations

import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros

from .intrinsics import address, load16, load64, prefetch_at, store8_at, store64_at
from .jit import entry, inline, jit
from .layout import (
    DEC_ENTRIES,
    HASH_MUL,
    LANE_HEADER,
    LANES,
    STATUS_BAD_CODE,
    STATUS_BOOK,
    STATUS_OK,
    STATUS_OVERRUN,
    STATUS_SIZE,
)

__all__ = ["MULTI_BITS", "multi_tables", "decode_lanes"]

MULTI_BITS = 12  # window of a multi-symbol lookup
_MULTI_SIZE = 1 << MULTI_BITS
_MULTI_MASK = np.uint64(_MULTI_SIZE - 1)
_MULTI_MAX = 6  # symbols per multi-symbol table entry; its store writes 8 bytes
_SYM_SHIFT = np.uint64(8)  # entry: total length in byte 0, symbols in bytes 1-6, count in byte 7
_COUNT_SHIFT = np.uint64(56)
_LEN_MASK = np.uint64(63)
_MARK = np.uint64(1) << np.uint64(63)  # the fast loop's end-of-window marker
_DEC_INDEX = DEC_ENTRIES - 1
_DEC_MASK = np.uint64(_DEC_INDEX)
_U64_0 = np.uint64(0)
_ONE = np.uint64(1)


@jit
def _get_u32(buf8, pos):
    return (
        np.int64(buf8[pos])
        | (np.int64(buf8[pos + 1]) << 8)
        | (np.int64(buf8[pos + 2]) << 16)
        | (np.int64(buf8[pos + 3]) << 24)
    )


@inline
def _peek_at(wa, nwords, pos):
    """64 bits of a lane, whose words lie at address wa, from bit pos; bits past its last
    word read as zero."""
    w = pos >> 6
    off = np.uint64(pos & 63)
    lo = load64(wa + 8 * w) if w < nwords else _U64_0
    hi = load64(wa + 8 * (w + 1)) if w + 1 < nwords else _U64_0
    return (lo >> off) | ((hi << _ONE) << (np.uint64(63) - off))


@inline
def _step_at(buf, dt):
    """Decode one symbol from buf with the plain table at address dt: (symbol, bits
    used); bits used 0 = no such code."""
    e = np.int64(load16(dt + 2 * np.int64(buf & _DEC_MASK)))
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
    shift needs no extraction on its dependency chain), symbols in bits 8-15, 16-23,
    ..., 48-55 (unused ones 0), symbol count in bits 56-63; 0 where the window starts
    with an escape or no code, so the decoder falls back to :func:`_step` (and an
    entry 0 moves nothing: length and count 0). A code is taken only when all its bits
    lie inside the 12 known ones (a prefix code is decided by its own bits alone). Six,
    not four: exponent codes are 2-3 bits, and a 12-bit window held five or six of
    them often enough to pay for the wider store.
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


@jit
def _lane_rest(wa, nwords, pos, mt, dt, d, i, end):
    """Decode symbols i..end-1 of one lane into address d + i: three steps per refill while
    20 slots remain, then a lookup per refill (a multi-symbol one where all its symbols
    are wanted: the bits used must end at the lane's last symbol, or a lane that ends
    near its last bit would look overrun); (status, bit position).

    wa, nwords: the lane's words (address, count); mt, dt: the multi-symbol and plain
    tables' addresses. Addresses, not arrays: an array argument costs a reference count
    taken and dropped on each call, four calls a chunk.
    """
    while i + 20 <= end:  # 3 steps of up to 6 symbols, each writing 8 bytes
        b = _peek_at(wa, nwords, pos)
        for _r in range(3):
            e = load64(mt + 8 * np.int64(b & _MULTI_MASK))
            n = np.int64(1)
            if e != _U64_0:
                store64_at(d + i, np.int64(e >> _SYM_SHIFT))
                n = np.int64(e >> _COUNT_SHIFT)
                ln = np.int64(e & _LEN_MASK)
            else:
                sym, ln = _step_at(b, dt)
                if ln == 0:
                    return STATUS_BAD_CODE, pos
                store8_at(d + i, sym)
            b >>= np.uint64(ln)
            pos += ln
            i += n
    while i < end:  # one lookup per refill, its symbols stored one by one
        b = _peek_at(wa, nwords, pos)
        e = load64(mt + 8 * np.int64(b & _MULTI_MASK))
        n = np.int64(e >> _COUNT_SHIFT)
        if e != _U64_0 and i + n <= end:  # all its symbols are the lane's (bits past them are not)
            for j in range(n):
                store8_at(d + i + j, np.int64(e >> np.uint64(8 + 8 * j)) & 255)
            pos += np.int64(e & _LEN_MASK)
            i += n
            continue
        sym, ln = _step_at(b, dt)
        if ln == 0:
            return STATUS_BAD_CODE, pos
        pos += ln
        store8_at(d + i, sym)
        i += 1
    return STATUS_OK, pos


@inline
def _window(q):
    """The 64 bits from bit address q (8 x byte address + bit) on, the top q & 7 of them
    zero, with an end marker set in bit 63 (the caller bounds q)."""
    return (load64(q >> 3) >> np.uint64(q & 7)) | _MARK


@jit
def _escape_step(q, d, dec):
    """Decode one symbol at bit address q with the plain table at address dec, storing
    it at address d; return the bits used (0: no such code). Off the fast path (an
    escape, or a bit pattern that is no code), so not inlined."""
    w = load64(q >> 3) >> np.uint64(q & 7)
    x = np.int64(load16(dec + 2 * np.int64(w & _DEC_MASK)))
    ln = (x >> 8) & 15
    sym = x & 255
    if x >= 0x8000 and ln != 0:  # escape: the symbol's 8 bits follow its code
        sym = np.int64(w >> np.uint64(ln)) & 255
        ln += 8
    store8_at(d, sym)
    return ln


@inline
def _fast_step(b, d, multi):
    """One step of the fast loop: (window, output address, entry).

    b is the lane's window (>= 12 valid bits guaranteed by the caller), d where its
    next symbol goes, multi the multi-symbol table's address. The entry's symbols go
    out as one 8-byte store (slots past them are rewritten by the next step) and its
    length shifts the window; the bits used are not counted here: the window's end
    marker tells them once a round (:func:`decode_lanes`). No branch: an entry 0 (an
    escape, or no code: rare) moves nothing, so the lane stalls on that window until
    the round ends, where the caller sees the last entry 0 and decodes that one symbol
    off the fast path. A branch to a one-symbol decoder inside the loop, even one
    never taken, and a bit count per step made LLVM spill the lanes' windows to the
    stack, which put a store and a load on every step's dependency chain (and + load
    + shift is all it holds now).
    """
    e = load64(multi + 8 * np.int64(b & _MULTI_MASK))
    store64_at(d, np.int64(e >> _SYM_SHIFT))
    return b >> (e & _LEN_MASK), d + np.int64(e >> _COUNT_SHIFT), e


@inline
def _round(q0, q1, q2, q3, a0, a1, a2, a3, mt):
    """One round of the fast loop: each lane's window, 4 steps a lane, the bits used.

    Returns the lanes' bit and output addresses and the last step's entries (0: that
    lane sits on an escape or on no code).
    """
    b0 = _window(q0)
    b1 = _window(q1)
    b2 = _window(q2)
    b3 = _window(q3)
    b0, a0, t0 = _fast_step(b0, a0, mt)
    b1, a1, t1 = _fast_step(b1, a1, mt)
    b2, a2, t2 = _fast_step(b2, a2, mt)
    b3, a3, t3 = _fast_step(b3, a3, mt)
    b0, a0, t0 = _fast_step(b0, a0, mt)
    b1, a1, t1 = _fast_step(b1, a1, mt)
    b2, a2, t2 = _fast_step(b2, a2, mt)
    b3, a3, t3 = _fast_step(b3, a3, mt)
    b0, a0, t0 = _fast_step(b0, a0, mt)
    b1, a1, t1 = _fast_step(b1, a1, mt)
    b2, a2, t2 = _fast_step(b2, a2, mt)
    b3, a3, t3 = _fast_step(b3, a3, mt)
    b0, a0, t0 = _fast_step(b0, a0, mt)
    b1, a1, t1 = _fast_step(b1, a1, mt)
    b2, a2, t2 = _fast_step(b2, a2, mt)
    b3, a3, t3 = _fast_step(b3, a3, mt)
    q0 += np.int64(leading_zeros(b0))
    q1 += np.int64(leading_zeros(b1))
    q2 += np.int64(leading_zeros(b2))
    q3 += np.int64(leading_zeros(b3))
    return q0, q1, q2, q3, a0, a1, a2, a3, t0, t1, t2, t3


@inline
def _rounds(
    n,
    q0,
    q1,
    q2,
    q3,
    a0,
    a1,
    a2,
    a3,
    mt,
    hp,
    h0,
    h1,
    h2,
    h3,
    pf_in,
    pf_in_end,
    pf_out,
    pf_out_end,
    hashing,
    prefetching,
):
    """Up to n rounds (:func:`_round`), ending after one where a lane stalled.

    hashing: each round also takes the checksum quad at hp into the chains h0..h3;
    prefetching: each round asks for 2 lines at pf_in and 4 at pf_out (see
    :func:`decode_lanes`). Both are constants where it is called, so each call
    compiles to a loop of its own. Returns the lanes' addresses, the last step's
    entries (1 where n is 0: no stall), hp, the chains and the prefetch addresses.
    """
    t0 = t1 = t2 = t3 = _ONE
    for _ in range(n):
        if hashing:
            h0 = (h0 ^ np.uint64(load64(hp))) * HASH_MUL
            h1 = (h1 ^ np.uint64(load64(hp + 8))) * HASH_MUL
            h2 = (h2 ^ np.uint64(load64(hp + 16))) * HASH_MUL
            h3 = (h3 ^ np.uint64(load64(hp + 24))) * HASH_MUL
            hp += 32
        if prefetching:
            prefetch_at(pf_in, 0)
            prefetch_at(pf_in + 64, 0)
            prefetch_at(pf_out, 1)
            prefetch_at(pf_out + 64, 1)
            prefetch_at(pf_out + 128, 1)
            prefetch_at(pf_out + 192, 1)
            pf_in = min(pf_in + 128, pf_in_end)
            pf_out = min(pf_out + 256, pf_out_end)
        q0, q1, q2, q3, a0, a1, a2, a3, t0, t1, t2, t3 = _round(q0, q1, q2, q3, a0, a1, a2, a3, mt)
        if t0 == _U64_0 or t1 == _U64_0 or t2 == _U64_0 or t3 == _U64_0:
            break
    return q0, q1, q2, q3, a0, a1, a2, a3, t0, t1, t2, t3, hp, h0, h1, h2, h3, pf_in, pf_out


@inline
def _escape_heavy_step(b, q, d, multi, dec):
    """One step of :func:`_escape_heavy_rounds`: (window, bit address, output address).

    A multi-symbol entry goes as in :func:`_fast_step`; anything else (an escape, or no
    code) decodes one symbol at q and reloads the window there, so a lane never waits
    for the round's end. On no code the lane stalls (q and d stay).
    """
    e = load64(multi + 8 * np.int64(b & _MULTI_MASK))
    if e != _U64_0:
        store64_at(d, np.int64(e >> _SYM_SHIFT))
        ln = np.int64(e & _LEN_MASK)
        return b >> np.uint64(ln), q + ln, d + np.int64(e >> _COUNT_SHIFT)
    ln = _escape_step(q, d, dec)
    q += ln
    return load64(q >> 3) >> np.uint64(q & 7), q, d + np.int64(ln != 0)


@jit
def _escape_heavy_rounds(q0, q1, q2, q3, a0, a1, a2, a3, l0, l1, l2, l3, lim, mt, dt):
    """The lanes' rounds where escapes are common: each step branches to the
    one-symbol decoder on an escape instead of stalling its lane until the round ends.

    l0..l3 are the lanes' output ends (addresses), lim the last bit address an 8-byte
    read may start at. Returns the lanes' bit and output addresses where it stopped:
    when a lane nears its end, or on no code (that lane stops moving). Not inlined: its
    branches would cost :func:`decode_lanes`' loop its registers.
    """
    while True:
        rounds = min(min((l0 - a0 - 2) // 24, (l1 - a1 - 2) // 24), min((l2 - a2 - 2) // 24, (l3 - a3 - 2) // 24))
        rounds = min(rounds, (lim - max(max(q0, q1), max(q2, q3))) // 80)  # 4 escapes a round: 4 x 20 bits
        if rounds <= 0:
            break
        start0 = q0
        start1 = q1
        start2 = q2
        start3 = q3
        for _ in range(rounds):
            b0 = load64(q0 >> 3) >> np.uint64(q0 & 7)
            b1 = load64(q1 >> 3) >> np.uint64(q1 & 7)
            b2 = load64(q2 >> 3) >> np.uint64(q2 & 7)
            b3 = load64(q3 >> 3) >> np.uint64(q3 & 7)
            for _ in range(4):
                b0, q0, a0 = _escape_heavy_step(b0, q0, a0, mt, dt)
                b1, q1, a1 = _escape_heavy_step(b1, q1, a1, mt, dt)
                b2, q2, a2 = _escape_heavy_step(b2, q2, a2, mt, dt)
                b3, q3, a3 = _escape_heavy_step(b3, q3, a3, mt, dt)
        if q0 == start0 or q1 == start1 or q2 == start2 or q3 == start3:
            break  # a lane stalled on no code all along: the caller's checked tail reports it
    return q0, q1, q2, q3, a0, a1, a2, a3


@jit
def _lane_alone(q, a, end, lim, mt, dt):
    """Go on with one lane after the lockstep rounds: (bit address, output address).

    The lockstep rounds stop when the first lane nears its end; the others can still
    have hundreds of symbols left (lanes of one chunk use different numbers of bits),
    and :func:`_lane_rest`'s checked steps cost several times a fast step. This runs
    the fast loop's rounds on one lane, under the same bounds (end: the lane's output
    end, lim: the last bit address an 8-byte read may start at), then single steps
    while a step's 8-byte store stays inside the lane, so that under 8 symbols are left
    for the checked steps; an escape is decoded where it stops a round or a step. It
    stops near the lane's end, or on no code (where :func:`_lane_rest` then reports it).
    """
    while True:
        rounds = min((end - a - 2) // 24, (lim - q) // 48)
        if rounds > 0:
            t = _U64_0
            for _ in range(rounds):
                b = _window(q)
                b, a, t = _fast_step(b, a, mt)
                b, a, t = _fast_step(b, a, mt)
                b, a, t = _fast_step(b, a, mt)
                b, a, t = _fast_step(b, a, mt)
                q += np.int64(leading_zeros(b))
                if t == _U64_0:
                    break
            if t != _U64_0:
                continue
        elif a + 8 <= end and q <= lim:
            e = load64(mt + 8 * np.int64(_window(q) & _MULTI_MASK))
            if e != _U64_0:
                store64_at(a, np.int64(e >> _SYM_SHIFT))
                q += np.int64(e & _LEN_MASK)
                a += np.int64(e >> _COUNT_SHIFT)
                continue
        else:
            break
        # Stopped on an escape (or no code): that symbol alone.
        ln = _escape_step(q, a, dt)
        if ln == 0:
            break
        q += ln
        a += 1
    return q, a


@jit
def decode_lanes(frame8, frame64, pos, size, count, dec, multi, dst, pf_in, pf_in_end, pf_out, pf_out_end, hs):
    """Decode one coded segment (4 lanes) of count symbols into dst (uint8); return status.

    While it decodes (bound by its lookups, not by memory) it asks for the addresses
    [pf_in, pf_in_end) and [pf_out, pf_out_end) to be brought into cache, 2 and 4 lines
    a round (a round makes ~64 symbols): the bytes that the assembly of the chunk reads
    next (its raw streams) and the output it writes (read for ownership first). Hints
    only: any addresses are safe.

    It also goes on with the chunk's checksum (hs: uint64[HASH_STATE] from
    :func:`comm_codec.kernels.symbols.hash_start`): one quad of words (a word into each
    of the four chains of :func:`comm_codec.kernels.symbols.hash_words`) a round while
    quads are left. The
    multiplications run beside the lookups' dependency chains, where they cost a
    fraction of a pass of their own over the payload, which is bound by the
    multiplications' latency. The caller finishes the hash (the quads left, the tail).
    """
    if size < LANE_HEADER:
        return STATUS_SIZE
    hw = np.int64(hs[4])
    hw_end = np.int64(hs[5])
    if hw < 0 or hw > hw_end or hw_end > frame64.size:  # the caller's state; trust nothing
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
    if multi.size != _MULTI_SIZE or dec.size != DEC_ENTRIES or dst.size < count:  # the codec's tables; trust nothing
        return STATUS_BOOK
    # Fast loop on bit addresses (8 x byte address + bit) into the frame. A round
    # reads each lane's next 57+ bits with one unaligned load, sets an end marker in
    # bit 63 and takes 4 steps (up to 6 symbols and 12 bits each); the bits used are
    # then the marker's distance from the top (leading zeros). Instead of checking
    # every round, run as many rounds as no lane can go wrong in: 24 symbols a round,
    # and the 8-byte store of the last step (from up to 18 symbols in), must fit
    # before the lane's end, and 48 bits a round must leave an 8-byte read inside the
    # frame. Valid lanes never read past their own end there; a corrupt one may read
    # its neighbour's bits and then fails the overrun check below. A lane whose last
    # step of a round moved nothing sits on an escape or on no code: the rounds stop,
    # that symbol is decoded alone, and they go on; where that ends more than one round
    # in four (a stream whose data the book fits badly), the rest goes through
    # _escape_heavy_rounds, which branches per step instead.
    d0 = address(dst)
    mt = address(multi)
    dt = address(dec)
    base = 8 * address(frame8)
    q0 = base + 64 * w0
    q1 = base + 64 * w1
    q2 = base + 64 * w2
    q3 = base + 64 * w3
    lim = base + 8 * (frame8.size - 8)
    a0 = d0
    a1 = d0 + e0
    a2 = d0 + e1
    a3 = d0 + e2
    hp = address(frame64) + 8 * hw  # the checksum's next quad and the end of the quads (addresses)
    hp_end = hp + 32 * ((hw_end - hw) // 4)
    h0 = np.uint64(hs[0])
    h1 = np.uint64(hs[1])
    h2 = np.uint64(hs[2])
    h3 = np.uint64(hs[3])
    stalls = np.int64(0)  # round-ending stalls, to tell escape-heavy lanes
    prefetching = pf_in < pf_in_end or pf_out < pf_out_end
    while True:
        rounds = min(
            min((d0 + e0 - a0 - 2) // 24, (d0 + e1 - a1 - 2) // 24),
            min((d0 + e2 - a2 - 2) // 24, (d0 + e3 - a3 - 2) // 24),
        )
        rounds = min(rounds, (lim - max(max(q0, q1), max(q2, q3))) // 48)
        if rounds <= 0:
            break
        if stalls >= 16 and 32 * stalls > a0 - d0:
            # Escapes end more than one round in four or so (a round makes up to 8
            # symbols a lane on such data; counted from lane 0's output, not per round:
            # a counter in the rounds cost 3 %): a stalled lane idles for the rest of its
            # round, so the lanes go on with a branch per step instead.
            q0, q1, q2, q3, a0, a1, a2, a3 = _escape_heavy_rounds(
                q0, q1, q2, q3, a0, a1, a2, a3, d0 + e0, d0 + e1, d0 + e2, d0 + e3, lim, mt, dt
            )
            break
        # Rounds that also hash a quad of the checksum while quads are left, then
        # plain ones; each kind with prefetches only where there is something to
        # prefetch (a 1-byte chunk's lanes write its output: nothing), as the hints
        # cost the loop registers.
        hashed = min(rounds, (hp_end - hp) // 32)
        if prefetching:
            (q0, q1, q2, q3, a0, a1, a2, a3, t0, t1, t2, t3, hp, h0, h1, h2, h3, pf_in, pf_out) = _rounds(
                hashed,
                q0,
                q1,
                q2,
                q3,
                a0,
                a1,
                a2,
                a3,
                mt,
                hp,
                h0,
                h1,
                h2,
                h3,
                pf_in,
                pf_in_end,
                pf_out,
                pf_out_end,
                True,
                True,
            )
            if t0 != _U64_0 and t1 != _U64_0 and t2 != _U64_0 and t3 != _U64_0:
                (q0, q1, q2, q3, a0, a1, a2, a3, t0, t1, t2, t3, hp, h0, h1, h2, h3, pf_in, pf_out) = _rounds(
                    rounds - hashed,
                    q0,
                    q1,
                    q2,
                    q3,
                    a0,
                    a1,
                    a2,
                    a3,
                    mt,
                    hp,
                    h0,
                    h1,
                    h2,
                    h3,
                    pf_in,
                    pf_in_end,
                    pf_out,
                    pf_out_end,
                    False,
                    True,
                )
        else:
            (q0, q1, q2, q3, a0, a1, a2, a3, t0, t1, t2, t3, hp, h0, h1, h2, h3, pf_in, pf_out) = _rounds(
                hashed,
                q0,
                q1,
                q2,
                q3,
                a0,
                a1,
                a2,
                a3,
                mt,
                hp,
                h0,
                h1,
                h2,
                h3,
                pf_in,
                pf_in_end,
                pf_out,
                pf_out_end,
                True,
                False,
            )
            if t0 != _U64_0 and t1 != _U64_0 and t2 != _U64_0 and t3 != _U64_0:
                (q0, q1, q2, q3, a0, a1, a2, a3, t0, t1, t2, t3, hp, h0, h1, h2, h3, pf_in, pf_out) = _rounds(
                    rounds - hashed,
                    q0,
                    q1,
                    q2,
                    q3,
                    a0,
                    a1,
                    a2,
                    a3,
                    mt,
                    hp,
                    h0,
                    h1,
                    h2,
                    h3,
                    pf_in,
                    pf_in_end,
                    pf_out,
                    pf_out_end,
                    False,
                    False,
                )
        # A lane on an escape (or no code): decode that symbol alone. The rounds left
        # q <= lim and the lane's output 2 slots short of its end at least.
        ln0 = _escape_step(q0, a0, dt) if t0 == _U64_0 else -1
        ln1 = _escape_step(q1, a1, dt) if t1 == _U64_0 else -1
        ln2 = _escape_step(q2, a2, dt) if t2 == _U64_0 else -1
        ln3 = _escape_step(q3, a3, dt) if t3 == _U64_0 else -1
        if ln0 == 0 or ln1 == 0 or ln2 == 0 or ln3 == 0:
            break  # no code: the checked tail below reports it
        stalls += 1
        if ln0 > 0:
            q0 += ln0
            a0 += 1
        if ln1 > 0:
            q1 += ln1
            a1 += 1
        if ln2 > 0:
            q2 += ln2
            a2 += 1
        if ln3 > 0:
            q3 += ln3
            a3 += 1
    hs[0] = h0
    hs[1] = h1
    hs[2] = h2
    hs[3] = h3
    hs[4] = np.uint64((hp - address(frame64)) // 8)
    # The lanes that the rounds left far from their ends go on alone; all stay bounded
    # by lim, so a corrupt lane still fails the overrun check below.
    q0, a0 = _lane_alone(q0, a0, d0 + e0, lim, mt, dt)
    q1, a1 = _lane_alone(q1, a1, d0 + e1, lim, mt, dt)
    q2, a2 = _lane_alone(q2, a2, d0 + e2, lim, mt, dt)
    q3, a3 = _lane_alone(q3, a3, d0 + e3, lim, mt, dt)
    p0 = q0 - base - 64 * w0
    p1 = q1 - base - 64 * w1
    p2 = q2 - base - 64 * w2
    p3 = q3 - base - 64 * w3
    i0 = a0 - d0
    i1 = a1 - d0
    i2 = a2 - d0
    i3 = a3 - d0
    if p0 > 8 * lb0 or p1 > 8 * lb1 or p2 > 8 * lb2 or p3 > 8 * lb3:
        return STATUS_OVERRUN
    wa = address(frame64)
    st, p0 = _lane_rest(wa + 8 * w0, n0, p0, mt, dt, d0, i0, e0)
    if st == STATUS_OK:
        st, p1 = _lane_rest(wa + 8 * w1, n1, p1, mt, dt, d0, i1, e1)
    if st == STATUS_OK:
        st, p2 = _lane_rest(wa + 8 * w2, n2, p2, mt, dt, d0, i2, e2)
    if st == STATUS_OK:
        st, p3 = _lane_rest(wa + 8 * w3, n3, p3, mt, dt, d0, i3, e3)
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
