"""Encode kernels: plan every chunk (reference, zero mask, books, raw fallbacks, sizes), then write it.

Encoding over threads is two passes so that the frame is allocated once, at its exact
size: :func:`plan_range` sizes chunks' streams, the Python layer lays out the
header and offsets, and :func:`encode_range` writes the payloads (and their checksums);
threads each take a range of chunks (:mod:`comm_codec.core.parallel`). A chunk is a few hundred KiB at most, so its working set stays
in L2 while its streams are coded one by one. Where no threads would help (one chunk,
or a codec of one thread) :func:`encode_frame` does all of it, header and chunk table
included, in one call (for small tensors the host code between three calls cost more
than the coding), and without the sizing pass where it can: chunk after chunk, each
single-book stream is written where it goes, into a frame with room for every chunk
at its largest, and replaced by its raw bytes where it reaches their size (the same
decision the planned size makes; issue #26: the sizing was a third of the one-call
encode of TinyLM's bf16 weights).

Two habits of these loops: they run over 0-based views (``for i in range(view.size)``;
loops over ``range(lo, hi)`` compile to slower code), and the planner applies stream
0's reference to the 256 bytes of a chunk's histogram, not to its elements.

Stream 0, the one coded in every float type, is packed two symbols per table lookup:
each lane's symbols are first cut out of the elements into a byte buffer, reference
subtracted, by a vectorized loop (:func:`comm_codec.kernels.symbols.symbols0`), and
the packer reads them as uint16 pair indices into per-book tables of joined codes
(:func:`pair_tables`, 65536 entries per book, built once per codec and book group).
It writes bytes with unaligned 8-byte stores and no branch per flush, which makes
:func:`encode_chunks` about a fifth faster on real bf16 weights than one lookup per symbol
and a branch per 64-bit word. A lane of 1-byte integers is its
own symbol buffer (no reference: the packer reads the elements).

Every coded stream is sized from the chunk's lane histograms (one pass, four counting
tables in lockstep), on which each book of the stream's group is priced over the bytes
that occur; with one book too, where summing code lengths element by element cost
twice the histogram (planning a 1-byte exponent stream took half the time).
The histogram also counts the chunk's all-zero elements when its byte 0 is absent
(none), or when the element is one byte (byte 0 is the zero element), so the separate
count of zeros is left out (it was about a tenth of planning real bf16 weights).
"""

from __future__ import annotations

import numpy as np
from numba.extending import overload

from .histogram import lane_histograms
from .intrinsics import address, load16, prefetch, store64
from .jit import OVERLOAD_OPTIONS, entry, inline, jit
from .layout import CHUNK_MASK, CHUNK_RAW0, CHUNK_ZERO, LANE_HEADER, LANES, MIN_SAVING_SHIFT
from .plane import plane_bytes, write_plane
from .symbols import chunk_ref, count_zeros, element_layout, hash_words, stream_params, symbol, symbols0

__all__ = ["plan_range", "encode_range", "plan_chunks", "encode_chunks", "encode_frame", "encode_frame_into", "frame_room", "pair_tables", "PAIR_ENTRIES", "PAIR_SLOW"]

_U64_0 = np.uint64(0)
# Flags passed to helpers as typed values, not literals: numba compiles a helper again
# for every literal argument value it is called with.
_YES = np.bool_(True)
_NO = np.bool_(False)

# Stream 0's pair tables: entry a | b << 8 holds the codes of symbol a then symbol b, joined.
PAIR_ENTRIES = 1 << 16
# The length of a pair whose joined code does not fit its uint32 entry (an escape is
# 9 to 20 bits); any step that meets one takes the packer's symbol-by-symbol path.
PAIR_SLOW = 64
# Bits one step of the pair packer may add: after a flush at most 7 bits wait in the
# accumulator, so 57 more still fit its 64; 56 keeps the test a compare with a constant.
_STEP_BITS = 56
# Symbols that the pair packer leaves to its careful tail (see _pack_pairs).
_TAIL_SYMBOLS = 64
_TAIL_BYTES = 256  # (64 + 5 symbols) x 20 bits, plus an 8-byte store
# How far past its limit a coded segment written without a size (encode_frame) may
# store: a pair step's stores end 23 bytes past the position it checked, a lane's tail
# and padding 188 (the tail starts below the limit).
_OVERSHOOT = _TAIL_BYTES + 32


@jit
def _compact(src, kept):
    """Copy src's elements whose bits are not all zero to the front of kept; return how
    many (branch-free: half of a masked chunk's elements are zeros, unpredictably)."""
    j = 0
    for i in range(src.size):
        v = src[i]
        kept[j] = v
        j += np.int64(v != 0)
    return j


@inline
def _zero_cost(bits, exp_shift, split, ref, enc_len, raw_stream):
    """Bits an all-zero element costs in the streams, priced with each group's first book
    (8 for a raw stream; a split stream 0 adds its plane's bits): what the zero mask
    saves on each zero it covers."""
    cost = 0
    for s in range(enc_len.shape[0]):
        sh, sub, top, ra, mask = stream_params(bits, s, exp_shift, ref)
        cost += 8 if raw_stream[s] else enc_len[s, 0, symbol(0, sh, sub, top, ra, mask)] + (split if s == 0 else 0)
    return cost


@inline
def _mask_pays(zeros, count, zero_cost):
    """Whether a chunk takes the zero mask: it costs a bit per element, and pays where the
    zeros cost more in the streams."""
    return zeros * zero_cost > count + 64


@inline
def _min_saving(s, n):
    """Bytes stream s of a chunk of n present elements must save to be coded: one for
    stream 0, 1/2**MIN_SAVING_SHIFT of them for a later stream (see layout.py)."""
    return np.int64(1) if s == 0 else max(np.int64(1), n >> MIN_SAVING_SHIFT)


@jit
def _sample_zeros(bits, lo, hi):
    """All-zero elements among the strided sample that :func:`chunk_ref` reads."""
    step = max(1, (hi - lo) // 256)
    z = 0
    for i in range(lo, hi, step):
        z += np.int64(bits[i] == 0)
    return z, (hi - lo + step - 1) // step


@jit
def _segment_plan(hist, sub, lens, nbooks, priced, fold):
    """Pick stream s's book for a chunk from its lane histograms; return (bytes, book).

    The book is the one with the fewest coded bits over the chunk (ties to the lower
    index); bytes is the coded segment's size with it, lane header and padding included.
    Only the bytes that occur are priced: a chunk of weights holds some 30 of the 256,
    so a group of 16 books costs 16 x 30 products instead of 16 x 256. With ``fold``
    (a split stream 0's raw bits), the lengths depend on ``byte >> fold`` alone, so the
    histograms are summed over the bytes of each such group first: fp16 weights hold
    some 150 bytes a chunk, but a dozen exponents. ``priced`` (int64[3, 256]) is scratch:
    the bytes (or groups) that occur, their symbols and counts.
    """
    if fold:
        per = 1 << fold
        groups = 256 >> fold
        folded = np.zeros((LANES, groups), dtype=np.int64)
        for k in range(LANES):
            for g in range(groups):
                t = np.int64(0)
                for b in range(per * g, per * g + per):
                    t += hist[k, b]
                folded[k, g] = t
        hist = folded
    else:
        groups = 256
    m = 0
    for b in range(groups):  # branch-free: whether a byte occurs is not predictable
        t = hist[0, b] + hist[1, b] + hist[2, b] + hist[3, b]
        priced[0, m] = b
        priced[1, m] = ((b << fold) - sub) & 255  # a group's symbols share its first byte's length
        priced[2, m] = t
        m += np.int64(t != 0)
    best = 0
    if nbooks > 1:
        best_bits = np.int64(-1)
        for k in range(nbooks):
            row = lens[k]
            bits = np.int64(0)
            for j in range(m):
                bits += priced[2, j] * np.int64(row[priced[1, j]])
            if best_bits < 0 or bits < best_bits:
                best_bits = bits
                best = k
    row = lens[best]
    seg = np.int64(LANE_HEADER)
    for k in range(LANES):
        bits = np.int64(0)
        for j in range(m):
            bits += hist[k, priced[0, j]] * np.int64(row[priced[1, j]])
        seg += (((bits + 7) // 8) + 7) & ~7
    return seg, best


@jit
def _size_stream(src, lo, hi, s, exp_shift, split, ref, lens, nbooks, hist, priced):
    """(coded segment bytes, book of its group) of stream s over src[lo:hi], from its lane
    histograms (left in hist for the caller); a split stream 0's plane included."""
    lane_histograms(src, lo, hi, s, hist)
    _, sub, _, _, _ = stream_params(src, s, exp_shift, ref)
    fold = split if s == 0 else 0
    seg, best = _segment_plan(hist, sub, lens, nbooks, priced, fold)
    if fold:
        seg += plane_bytes(hi - lo, split)
    return seg, best


@jit
def _plan_chunk(bits, lo, hi, c, exp_shift, split, enc_len, nbooks, raw_stream, cflags, refs, books, sizes):
    """Plan chunk c, elements bits[lo:hi], into entry c of the outputs (see :func:`plan_chunks`)."""
    ns = enc_len.shape[0]
    count = hi - lo
    ref = chunk_ref(bits, lo, hi, exp_shift)
    refs[c] = ref
    books[c] = 0
    hist = np.empty((LANES, 256), dtype=np.int64)
    priced = np.empty((3, 256), dtype=np.int64)
    first = -1
    for s in range(ns):
        if not raw_stream[s]:
            first = s
            break
    # Unless the reference's sample saw zeros, the first coded stream is sized as if
    # there were no mask, in the same pass that brings the chunk's elements in from
    # memory (the sizing loop prefetches); a chunk that then takes the mask is sized
    # again.
    sz, sn = _sample_zeros(bits, lo, hi)
    early = first >= 0 and sz * 16 <= sn
    seg0 = np.int64(0)
    k0 = 0
    if early:
        seg0, k0 = _size_stream(bits, lo, hi, first, exp_shift, split, ref, enc_len[first], nbooks[first], hist,
                                priced)
    width, _, _ = element_layout(bits)
    byte0 = hist[0, 0] + hist[1, 0] + hist[2, 0] + hist[3, 0] if early else np.int64(-1)
    if byte0 == 0 or (byte0 > 0 and width == 1):
        # An all-zero element's bytes are all 0, so byte 0 of stream `first` counts
        # every zero element (and only those, where the element is that one byte).
        zeros = byte0
    else:
        zeros = count_zeros(bits[lo:hi])
    if zeros == count:
        cflags[c] = CHUNK_ZERO
        for s in range(ns):
            sizes[c, s] = 0
        return
    use_mask = _mask_pays(zeros, count, _zero_cost(bits, exp_shift, split, ref, enc_len, raw_stream))
    present = count - zeros if use_mask else count
    flags = CHUNK_MASK if use_mask else 0
    src = bits
    slo = lo
    if use_mask:  # size the present elements, compacted, with the same code as a dense chunk
        src = np.empty(count, dtype=bits.dtype)
        _compact(bits[lo:hi], src)
        slo = 0
    shi = slo + present
    chosen = 0
    for s in range(ns):
        seg = present
        k = 0
        if raw_stream[s]:
            pass
        elif s == first and early and not use_mask:
            seg = seg0
            k = k0
        else:
            seg, k = _size_stream(src, slo, shi, s, exp_shift, split, ref, enc_len[s], nbooks[s], hist, priced)
        if seg > present - _min_saving(s, present):
            flags |= CHUNK_RAW0 << s
            sizes[c, s] = present
        else:
            sizes[c, s] = seg
            chosen |= k << (4 * s)
    cflags[c] = flags
    books[c] = chosen


@entry
def plan_range(bits, chunk_elems, exp_shift, split, enc_len, nbooks, raw_stream, cflags, refs, books, sizes, c0, c1):
    """Choose chunk c0..c1-1's's reference, zero handling, books and raw fallbacks; size its streams.

    Args:
        bits: element bits (typed as :mod:`comm_codec.kernels.layout` describes).
        chunk_elems: elements per chunk.
        exp_shift: the exponent's position in stream 0 (-1: no relative coding).
        split: the low bits of stream 0's byte that its coded segments store in a plane
            (a frame with split exponents: :mod:`comm_codec.kernels.plane`), or 0;
            stream 0's tables are then the exponent code's
            (:func:`comm_codec.core.huffman.split_tables`).
        enc_len: uint8[nstreams, nbooks_max, 256] code lengths (escape included) per
            stream and book of its group.
        nbooks: int64[nstreams], the size of each stream's group.
        raw_stream: bool[nstreams], streams whose book is raw.
        cflags, refs, books, sizes: outputs, uint8[nchunks], uint8[nchunks],
            uint16[nchunks] (book of stream s in bits 4s..4s+3), uint32[nchunks, ns].
        c0, c1: the chunks to plan (threads each plan a range).
    """
    n = bits.size
    for c in range(max(0, c0), min(c1, cflags.size)):
        lo = c * chunk_elems
        _plan_chunk(bits, lo, min(n, lo + chunk_elems), c, exp_shift, split, enc_len, nbooks, raw_stream, cflags, refs,
                    books, sizes)


def plan_chunks(bits, chunk_elems, exp_shift, split, enc_len, nbooks, raw_stream, cflags, refs, books, sizes):
    """Plan every chunk on the calling thread: :func:`plan_range` over all of them."""
    plan_range(bits, chunk_elems, exp_shift, split, enc_len, nbooks, raw_stream, cflags, refs, books, sizes, 0,
               cflags.size)


@inline
def _emit(acc, nb, w, code, ln, out64):
    """Append ln bits of code to the accumulator; flush a full 64-bit word to out64[w]."""
    acc |= code << np.uint64(nb)
    nb += ln
    if nb >= 64:
        out64[w] = acc
        w += 1
        nb -= 64
        acc = code >> np.uint64(ln - nb)
    return acc, nb, w


@inline
def _pack(view, sh, sub, top, ra, mask, codes, lens, out64, w, wlimit):
    """Bit-pack one stream of view LSB-first into out64 from word w; return bits, or -1
    (nothing more written) where a word at or past ``wlimit`` would be stored.

    Three symbols are joined before they are appended (at most 3 x 20 bits, so one
    accumulator step still suffices): the accumulator's dependency chain, which bounds
    the loop, gets a third as long.
    """
    acc = _U64_0
    nb = 0
    total = 0
    n = view.size
    for k in range(n // 3):
        s0 = symbol(view[3 * k], sh, sub, top, ra, mask)
        s1 = symbol(view[3 * k + 1], sh, sub, top, ra, mask)
        s2 = symbol(view[3 * k + 2], sh, sub, top, ra, mask)
        l0 = np.int64(lens[s0])
        l01 = l0 + np.int64(lens[s1])
        ln = l01 + np.int64(lens[s2])
        code = (np.uint64(codes[s0]) | (np.uint64(codes[s1]) << np.uint64(l0))
                | (np.uint64(codes[s2]) << np.uint64(l01)))
        total += ln
        acc |= code << np.uint64(nb)
        nb += ln
        if nb >= 64:
            if w >= wlimit:
                return -1
            out64[w] = acc
            w += 1
            nb -= 64
            acc = code >> np.uint64(ln - nb)
    for i in range(3 * (n // 3), n):
        if w >= wlimit:
            return -1
        s0 = symbol(view[i], sh, sub, top, ra, mask)
        ln = np.int64(lens[s0])
        total += ln
        acc, nb, w = _emit(acc, nb, w, np.uint64(codes[s0]), ln, out64)
    if nb > 0:
        if w >= wlimit:
            return -1
        out64[w] = acc
    return total


@entry
def pair_tables(enc_code, enc_len, pair_code, pair_len):
    """Fill the pair tables of a stream's books: entry ``a | b << 8`` codes a, then b.

    Args:
        enc_code, enc_len: uint32/uint8[nbooks, 256], the books' codes and lengths.
        pair_code, pair_len: uint32/uint8[nbooks, PAIR_ENTRIES] outputs: the joined code
            (a's bits first) and its length, or 0 and :data:`PAIR_SLOW` where the
            joined code is longer than 32 bits.
    """
    for k in range(min(pair_code.shape[0], enc_code.shape[0])):
        codes = enc_code[k]
        lens = enc_len[k]
        for b in range(256):
            lb = np.int64(lens[b])
            cb = np.uint64(codes[b])
            pc = pair_code[k, 256 * b:256 * (b + 1)]
            pl = pair_len[k, 256 * b:256 * (b + 1)]
            for a in range(256):
                la = np.int64(lens[a])
                fits = la + lb <= 32
                pc[a] = np.uint32(np.uint64(codes[a]) | (cb << np.uint64(la))) if fits else 0
                pl[a] = la + lb if fits else PAIR_SLOW


@jit
def _pack_singles(sym, j0, j1, codes, lens, out8, p, acc, nb):
    """Append sym[j0:j1] one symbol at a time (a step with a long pair in it)."""
    for j in range(j0, j1):
        x = np.int64(sym[j]) & 255  # sym may be a 1-byte integer lane itself
        acc |= np.uint64(codes[x]) << np.uint64(nb)
        nb += np.int64(lens[x])
        store64(out8, p, acc)
        p += nb >> 3
        acc >>= np.uint64(nb & 56)
        nb &= 7
    return p, acc, nb


@jit
def _pack_tail(sym, j0, n, codes, lens, out8, p, acc, nb, pos, tail):
    """Append sym[j0:n] and finish the lane: return its bits.

    The 8-byte stores of the main loop may only run while they end inside the lane's
    bytes; the last symbols go through ``tail`` (scratch), and exactly the lane's
    remaining bytes are copied out, so nothing past the lane is written (the next
    chunk's payload may be another thread's).
    """
    t, acc, nb = _pack_singles(sym, j0, n, codes, lens, tail, np.int64(0), acc, nb)
    bits = 8 * (p - pos + t) + nb
    if nb > 0:
        store64(tail, t, acc)
        t += 1
    for j in range(t):
        out8[p + j] = tail[j]
    return bits


@jit
def _pack_pairs(sym, n, codes, lens, pair_code, pair_len, out8, pos, tail, limit):
    """Bit-pack the symbols sym[:n] LSB-first into out8 from byte pos; return the bits,
    or -1 once the lane has reached byte ``limit`` (stores end at most
    :data:`_OVERSHOOT` bytes past it).

    Six symbols per step, as three pair lookups (sym's even positions start pairs), are
    joined and appended to the accumulator; then its whole bytes are stored (one
    unaligned 8-byte store) and shifted out, without a branch. A step whose joined
    code would not fit (a pair with an escape, or more than 56 bits) goes symbol by
    symbol. The last :data:`_TAIL_SYMBOLS` symbols (at least 64 bits) are left to
    :func:`_pack_tail`, so every 8-byte store of this loop ends inside the lane. Writes
    exactly the lane's ``ceil(bits / 8)`` bytes.
    """
    at = address(sym)  # pairs read with 2-byte loads of any alignment (sym may be a lane of int8 elements)
    acc = _U64_0
    nb = 0
    p = pos
    steps = max(0, n - _TAIL_SYMBOLS) // 6
    for k in range(steps):
        if p >= limit:
            return -1
        i0 = np.int64(load16(at + 6 * k))
        i1 = np.int64(load16(at + 6 * k + 2))
        i2 = np.int64(load16(at + 6 * k + 4))
        l0 = np.int64(pair_len[i0])
        l01 = l0 + np.int64(pair_len[i1])
        ln = l01 + np.int64(pair_len[i2])
        if ln > _STEP_BITS:
            p, acc, nb = _pack_singles(sym, 6 * k, 6 * k + 6, codes, lens, out8, p, acc, nb)
            continue
        code = (np.uint64(pair_code[i0]) | (np.uint64(pair_code[i1]) << np.uint64(l0))
                | (np.uint64(pair_code[i2]) << np.uint64(l01)))
        acc |= code << np.uint64(nb)
        nb += ln
        store64(out8, p, acc)
        p += nb >> 3
        acc >>= np.uint64(nb & 56)
        nb &= 7
    if p >= limit:
        return -1
    return _pack_tail(sym, 6 * steps, n, codes, lens, out8, p, acc, nb, pos, tail)


@inline
def _put_u32(out8, pos, value):
    for k in range(4):
        out8[pos + k] = (value >> (8 * k)) & 255


@jit
def _write_mask(src, out8, pos):
    """Write the LSB-first nonzero bitmap of src at pos (zero-padded to 8 bytes)."""
    count = src.size
    mbytes = (count + 7) // 8
    for k in range(pos + mbytes, pos + ((mbytes + 7) & ~7)):
        out8[k] = 0
    for k in range(count // 8):
        byte = 0
        for j in range(8):
            byte |= np.int64(src[8 * k + j] != 0) << j
        out8[pos + k] = byte
    if count % 8:
        byte = 0
        for j in range(count % 8):
            byte |= np.int64(src[8 * (count // 8) + j] != 0) << j
        out8[pos + count // 8] = byte
    return pos + ((mbytes + 7) & ~7)


@jit
def _raw_bytes(src, s, sub, dst):
    """dst[i] = stream s's symbol of src[i], for a stream stored raw.

    Stream 0 is :func:`comm_codec.kernels.symbols.symbols0`'s (reference subtracted);
    the others of 2- and 4-byte floats are cut out of 8-byte words of 4 or 2 elements
    with constant shifts, in loops the compiler vectorizes (a mantissa byte stored raw,
    as weights' are, cost a fifth of bf16's encode element by element with the shifts as
    run-time values).
    """
    width, ra, _ = element_layout(src)
    if s == 0:
        symbols0(src, sub, dst)
        return
    n = src.size
    sh, _, top, _, mask = stream_params(src, s, -1, 0)
    q = 0
    if ra == 1 and width == 2:  # stream 1: the low byte, rotated left by one (the sign to bit 0)
        q = n // 4
        words = src[:4 * q].view(np.uint64)
        d4 = dst[:4 * q].view(np.uint32)
        for k in range(q):
            x = words[k]
            y = ((x << np.uint64(1)) & np.uint64(0x00FE00FE00FE00FE)) | ((x >> np.uint64(15))
                                                                        & np.uint64(0x0001000100010001))
            y = (y | (y >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
            d4[k] = np.uint32((y | (y >> np.uint64(16))) & np.uint64(0xFFFFFFFF))
    elif ra == 1 and width == 4:
        q = n // 2
        words = src[:2 * q].view(np.uint64)
        d2 = dst[:2 * q].view(np.uint16)
        if s == 3:  # the low byte, rotated
            for k in range(q):
                x = words[k]
                y = ((x << np.uint64(1)) & np.uint64(0x000000FE000000FE)) | ((x >> np.uint64(31))
                                                                            & np.uint64(0x0000000100000001))
                d2[k] = np.uint16((y | (y >> np.uint64(24))) & np.uint64(0xFFFF))
        else:  # a middle byte: one bit lower in the element than in the rotated element
            shift = np.uint64(sh - 1)
            for k in range(q):
                y = (words[k] >> shift) & np.uint64(0x000000FF000000FF)
                d2[k] = np.uint16((y | (y >> np.uint64(24))) & np.uint64(0xFFFF))
    per = 8 // width
    for i in range(per * q, n):
        dst[i] = symbol(src[i], sh, 0, top, ra, mask)


@jit
def _write_raw(src, s, exp_shift, ref, out8, pos, size):
    """Write stream s of src uncoded at pos, zero-padded to 8 bytes."""
    _, sub, _, _, _ = stream_params(src, s, exp_shift, ref)
    count = src.size
    dst = out8[pos:pos + ((size + 7) & ~7)]
    _raw_bytes(src, s, sub, dst)
    for k in range(count, dst.size):
        dst[k] = 0


def _lane_symbols(view, sub, sym):
    """Stream 0's symbols of view relative to sub: sym[:view.size] filled by
    :func:`~comm_codec.kernels.symbols.symbols0`, or, for 1-byte integers without a
    reference, the elements' own bytes (no copy); compile-time per element type."""
    raise NotImplementedError  # only called from kernels, through the overload below


@overload(_lane_symbols, jit_options=OVERLOAD_OPTIONS)
def _ol_lane_symbols(view, sub, sym):
    if view.dtype.signed and view.dtype.bitwidth == 8:
        def impl_bytes(view, sub, sym):
            if sub == 0:
                return view.view(np.uint8)
            symbols0(view, sub, sym)
            return sym[:view.size]

        return impl_bytes

    def impl(view, sub, sym):
        symbols0(view, sub, sym)
        return sym[:view.size]

    return impl


@jit
def _count_value(sym, v):
    """How many of sym's bytes are v (a vectorized pass over a lane's symbols)."""
    c = np.int64(0)
    for i in range(sym.size):
        c += np.int64(sym[i] == v)
    return c


@jit
def _write_segment(src, s, exp_shift, split, ref, codes, lens, pair_code, pair_len, out8, out64, pos, limit, zeros0):
    """Write stream s of src as a coded segment (lane lengths, lanes, a split stream 0's
    plane) at pos.

    Returns (the segment's bytes, or -1 where it would reach byte ``limit``, and then
    ends there; elements whose stream-0 byte is 0, counted only with ``zeros0``, over
    the lanes written). Stores end at most :data:`_OVERSHOOT` bytes past ``limit``.
    """
    count = src.size
    wpos = pos + LANE_HEADER
    sh, sub, top, ra, mask = stream_params(src, s, exp_shift, ref)
    byte0 = np.int64(0)
    if s == 0:
        width, _, _ = element_layout(src)
        for j in range(0, count, 64 // width):
            prefetch(src, count + j)  # the next chunk (a hint: past the array's end is fine)
        # A split stream's lanes leave their symbols side by side, for its plane to take
        # them all afterwards (8 bytes of slack for its 8-symbol reads); otherwise each
        # lane's symbols reuse one lane's room, which stays in L1.
        sym = np.empty((count if split else count // LANES) + 8, dtype=np.uint8)
        tail = np.empty(_TAIL_BYTES, dtype=np.uint8)
        for k in range(LANES):
            if wpos >= limit:
                return -1, byte0
            view = src[k * count // LANES: (k + 1) * count // LANES]
            lane = _lane_symbols(view, sub, sym[k * count // LANES:] if split else sym)
            if zeros0:
                byte0 += _count_value(lane[:view.size], (-sub) & 255)  # the symbol of byte 0
            bits = _pack_pairs(lane, view.size, codes, lens, pair_code, pair_len, out8, wpos, tail, limit)
            if bits < 0:
                return -1, byte0
            nbytes = (bits + 7) // 8
            for j in range(wpos + nbytes, wpos + ((nbytes + 7) & ~7)):
                out8[j] = 0
            _put_u32(out8, pos + 4 * k, nbytes)
            wpos += (nbytes + 7) & ~7
        if split:
            end = wpos + plane_bytes(count, split)
            if end > limit:
                return -1, byte0
            write_plane(address(sym), count, split, address(out8) + wpos, address(out8) + ((end + 7) & ~7))
            for j in range(end, (end + 7) & ~7):
                out8[j] = 0
            wpos = end
    else:
        wlimit = (limit + 7) // 8
        for k in range(LANES):
            view = src[k * count // LANES: (k + 1) * count // LANES]
            bits = _pack(view, sh, sub, top, ra, mask, codes, lens, out64, wpos // 8, wlimit)
            if bits < 0:
                return -1, byte0
            nbytes = (bits + 7) // 8
            _put_u32(out8, pos + 4 * k, nbytes)
            wpos += (nbytes + 7) & ~7
    return wpos - pos, byte0


@jit
def _encode_chunk(src, c, flags, ref, chosen, sizes, pos, exp_shift, split, enc_code, enc_len, pair_code, pair_len,
                  out8, out64):
    """Write one chunk's payload from byte pos; return the end position."""
    if flags & CHUNK_ZERO:
        return pos
    if flags & CHUNK_MASK:
        pos = _write_mask(src, out8, pos)
        kept = np.empty(src.size, dtype=src.dtype)
        src = kept[:_compact(src, kept)]
    for s in range(enc_len.shape[0]):
        size = np.int64(sizes[c, s])
        if flags & (CHUNK_RAW0 << s):
            _write_raw(src, s, exp_shift, ref, out8, pos, size)
        else:
            k = (chosen >> (4 * s)) & 15
            kp = k if s == 0 else 0  # pair tables are stream 0's
            _write_segment(src, s, exp_shift, split, ref, enc_code[s, k], enc_len[s, k], pair_code[kp], pair_len[kp],
                           out8, out64, pos, pos + size, _NO)
        pos += (size + 7) & ~7
    return pos


@entry
def encode_range(bits, chunk_elems, exp_shift, split, enc_code, enc_len, pair_code, pair_len, cflags, refs, books,
                 sizes, offsets, out8, out64, checksums, do_checksum, c0, c1):
    """Write chunk c0..c1-1's payload at its offset (as planned by :func:`plan_chunks`).

    Args:
        bits, chunk_elems, exp_shift, split: as for :func:`plan_chunks`.
        enc_code, enc_len: uint32/uint8[nstreams, nbooks_max, 256] encoder tables.
        pair_code, pair_len: stream 0's pair tables (:func:`pair_tables` of
            ``enc_code[0]``, ``enc_len[0]``), one row per book of its group.
        cflags, refs, books, sizes: the plan.
        offsets: int64[nchunks], byte offset of each payload (multiples of 8).
        out8, out64: the frame as uint8 and as uint64 (same memory).
        checksums: uint32[nchunks] output.
        do_checksum: whether to compute checksums (0 is stored otherwise).
        c0, c1: the chunks to write (threads each write a range).
    """
    n = bits.size
    for c in range(max(0, c0), min(c1, cflags.size)):
        lo = c * chunk_elems
        hi = min(n, lo + chunk_elems)
        end = _encode_chunk(bits[lo:hi], c, cflags[c], np.int64(refs[c]), np.int64(books[c]), sizes,
                            offsets[c], exp_shift, split, enc_code, enc_len, pair_code, pair_len, out8, out64)
        start = offsets[c] // 8
        checksums[c] = hash_words(out64, start, end // 8 - start, c) if do_checksum else 0


def encode_chunks(bits, chunk_elems, exp_shift, split, enc_code, enc_len, pair_code, pair_len, cflags, refs, books,
                  sizes, offsets, out8, out64, checksums, do_checksum):
    """Write every chunk's payload on the calling thread: :func:`encode_range` over all of them."""
    encode_range(bits, chunk_elems, exp_shift, split, enc_code, enc_len, pair_code, pair_len, cflags, refs, books, sizes,
                 offsets, out8, out64, checksums, do_checksum, 0, cflags.size)


def _crc_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.uint32)
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0xEDB88320 if c & 1 else c >> 1
        table[i] = c
    return table


_CRC_TABLE = _crc_table()  # CRC-32 (zlib's), a byte at a time: a header is a few dozen bytes

# Where the header (comm_codec/core/frame.py) keeps what encode_frame fills in.
_VERSION_AT = 4
_NUMEL_AT = 8
_NCHUNKS_AT = 20


@jit
def _crc32(data):
    crc = np.uint32(0xFFFFFFFF)
    for i in range(data.size):
        crc = _CRC_TABLE[(crc ^ data[i]) & 255] ^ (crc >> np.uint32(8))
    return crc ^ np.uint32(0xFFFFFFFF)


@jit
def _write_chunk(bits, lo, hi, c, exp_shift, split, enc_code, enc_len, nbooks, raw_stream, pair_code, pair_len, cflags,
                 refs, books, sizes, out8, out64, pos):
    """Write chunk c, elements bits[lo:hi], at pos, with its entry of the plan; return the end.

    The same decisions and bytes as :func:`_plan_chunk` then :func:`_encode_chunk`,
    without sizing the coded streams first: each is written where it goes, up to the
    size its raw bytes would take, and is replaced by them where it reaches that (the
    encoder's raw fallback, decided on the written size, which is the planned one).
    Stream 0's lanes count the elements whose byte is 0, as the planner's histogram did,
    so zeros need a pass of their own only where some element has it. A chunk planned
    first: stream 0 raw, a stream with a group of books (the choice needs the
    histogram), or a sample whose zeros say the mask may pay, or that the count
    shows is better masked (it is written again).
    """
    ns = enc_len.shape[0]
    count = hi - lo
    direct = not raw_stream[0]
    for s in range(ns):
        direct = direct and (raw_stream[s] or nbooks[s] == 1)
    src = bits[lo:hi]
    ref = np.int64(0)
    seg0 = np.int64(-1)
    zero_cost = 0
    if direct:
        ref = np.int64(chunk_ref(bits, lo, hi, exp_shift))
        zero_cost = _zero_cost(src, exp_shift, split, ref, enc_len, raw_stream)
        # Written at once unless the sample's zeros say the mask will pay: the XOR of two
        # checkpoints' weights is some 12 % zeros at ~4 bits each, and sizing it first
        # took a second pass. The check below (_mask_pays) is the exact one; the sample
        # only saves a write that would be thrown away (1/4 of margin for its noise).
        sz, sn = _sample_zeros(bits, lo, hi)
        direct = 4 * sz * zero_cost <= 3 * sn
    if direct:
        seg0, byte0 = _write_segment(src, 0, exp_shift, split, ref, enc_code[0, 0], enc_len[0, 0], pair_code[0],
                                     pair_len[0], out8, out64, pos, pos + count, _YES)
        width, _, _ = element_layout(src)
        if seg0 >= 0 and (byte0 == 0 or width == 1):
            zeros = byte0  # an all-zero element's bytes are all 0 (and it is that byte alone)
        else:
            zeros = count_zeros(src)
        direct = zeros < count and not _mask_pays(zeros, count, zero_cost)
    if not direct:
        _plan_chunk(bits, lo, hi, c, exp_shift, split, enc_len, nbooks, raw_stream, cflags, refs, books, sizes)
        return _encode_chunk(bits[lo:hi], c, cflags[c], np.int64(refs[c]), np.int64(books[c]), sizes, pos, exp_shift,
                             split, enc_code, enc_len, pair_code, pair_len, out8, out64)
    refs[c] = ref
    books[c] = 0
    flags = 0
    for s in range(ns):
        seg = seg0
        if raw_stream[s]:
            seg = -1
        elif s > 0:
            seg, _ = _write_segment(src, s, exp_shift, split, ref, enc_code[s, 0], enc_len[s, 0], pair_code[0],
                                    pair_len[0], out8, out64, pos, pos + count, _NO)
        if seg < 0 or seg > count - _min_saving(s, count):
            flags |= CHUNK_RAW0 << s
            seg = count
            _write_raw(src, s, exp_shift, ref, out8, pos, seg)
        sizes[c, s] = seg
        pos += (seg + 7) & ~7
    cflags[c] = flags
    return pos


@entry
def frame_room(n, chunk_elems, ns, head_bytes):
    """Bytes :func:`encode_frame_into` needs for a frame of n elements: every chunk at
    its largest (mask and raw streams), its table, and a coded segment's overshoot,
    since nothing is sized before it is written (n = 0: the header alone)."""
    nchunks = (n + chunk_elems - 1) // chunk_elems
    entry_bytes = (8 + 4 * ns + 7) & ~7
    room = head_bytes + nchunks * entry_bytes + 8 + _OVERSHOOT
    last = n - (nchunks - 1) * chunk_elems
    for k, m in ((nchunks - 1, chunk_elems), (1, last)):
        room += k * ((((m + 7) // 8 + 7) & ~7) + ns * ((m + 7) & ~7))
    return room


def encode_frame(bits, chunk_elems, exp_shift, split, enc_code, enc_len, nbooks, raw_stream, pair_code, pair_len, head,
                 version_books, do_checksum):
    """Plan and write a whole frame in one call, without threads; return it.

    :func:`encode_frame_into` into an array of its own (a Python function: a kernel of
    its own would compile the whole encoder again, for a call it does not speed up).

    Returns:
        The frame, uint8[]: the front of an array with room for the largest frame of
        these elements, or an array of its own where that is under half the room (a
        frame never holds more than twice its size).
    """
    room = frame_room(bits.size, chunk_elems, enc_len.shape[0], head.size)
    out8 = np.empty((room + 7) // 8, dtype=np.uint64).view(np.uint8)[:room]  # 8-byte aligned
    pos = encode_frame_into(bits, chunk_elems, exp_shift, split, enc_code, enc_len, nbooks, raw_stream, pair_code,
                            pair_len, head, version_books, do_checksum, out8)
    # The frame is the front of the room; a frame under half of it (zeros) gets an array
    # of its own, so that it never holds more than twice its size.
    return out8[:pos] if 2 * pos >= room else out8[:pos].copy()


@entry
def encode_frame_into(bits, chunk_elems, exp_shift, split, enc_code, enc_len, nbooks, raw_stream, pair_code, pair_len,
                      head, version_books, do_checksum, out8):
    """Plan and write a whole frame into out8 in one call, without threads; return its size.

    The same bytes as :func:`plan_chunks`, :func:`encode_chunks` and the frame header
    (:func:`comm_codec.core.frame.write_header`) make together, without the host code
    between them (a checkpoint writer codes hundreds of small tensors per save, and for
    each the host work around three calls, scratch arrays, offsets, the structured chunk
    table, the header, cost more than coding it) and without the planning pass over
    the elements: chunks are written as :func:`_write_chunk` says, single-book streams
    without being sized first.

    Args:
        bits: element bits (none: a frame of the header alone).
        chunk_elems, exp_shift, split, enc_len, nbooks, raw_stream: as for :func:`plan_chunks`.
        enc_code, pair_code, pair_len: as for :func:`encode_chunks`.
        head: uint8[24 + 8 * nstreams], the header and book ids that ``write_header``
            writes for a frame of no chunks (version 1, or 3 with split exponents); the
            element count and chunk count are filled in here, and the version where a
            chunk names a book.
        version_books: the version byte of a frame in which some chunk names a book
            (3 with split exponents, else 2).
        do_checksum: whether to compute the chunks' checksums (0 is stored otherwise).
        out8: uint8[], 8-byte aligned, of at least :func:`frame_room` bytes.

    Returns:
        The frame's size in bytes (its first bytes of out8), or -1 when out8 is too
        small or not aligned (nothing written).
    """
    n = bits.size
    ns = enc_len.shape[0]
    nchunks = (n + chunk_elems - 1) // chunk_elems
    if out8.size < frame_room(n, chunk_elems, ns, head.size) or out8.ctypes.data % 8:
        return -1
    cflags = np.zeros(nchunks, dtype=np.uint8)
    refs = np.zeros(nchunks, dtype=np.uint8)
    books = np.zeros(nchunks, dtype=np.uint16)
    sizes = np.zeros((nchunks, ns), dtype=np.uint32)
    entry_bytes = (8 + 4 * ns + 7) & ~7
    pos = head.size + nchunks * entry_bytes + 8  # the first payload
    out64 = out8[:out8.size // 8 * 8].view(np.uint64)
    out8[:head.size] = head
    for k in range(8):
        out8[_NUMEL_AT + k] = (n >> (8 * k)) & 255
    _put_u32(out8, _NCHUNKS_AT, nchunks)
    named = False
    at = head.size  # the chunk table
    for c in range(nchunks):
        lo = c * chunk_elems
        start = pos
        pos = _write_chunk(bits, lo, min(n, lo + chunk_elems), c, exp_shift, split, enc_code, enc_len, nbooks,
                           raw_stream, pair_code, pair_len, cflags, refs, books, sizes, out8, out64, pos)
        checksum = hash_words(out64, start // 8, (pos - start) // 8, c) if do_checksum else np.uint32(0)
        named |= books[c] != 0
        out8[at] = cflags[c]
        out8[at + 1] = refs[c]
        out8[at + 2] = books[c] & 255
        out8[at + 3] = books[c] >> 8
        _put_u32(out8, at + 4, checksum)
        for s in range(ns):
            _put_u32(out8, at + 8 + 4 * s, sizes[c, s])
        for k in range(at + 8 + 4 * ns, at + entry_bytes):
            out8[k] = 0
        at += entry_bytes
    if named:
        out8[_VERSION_AT] = version_books
    _put_u32(out8, at, _crc32(out8[:at]))
    _put_u32(out8, at + 4, 0)
    return pos
