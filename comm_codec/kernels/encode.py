"""Encode kernels: plan every chunk (reference, zero mask, books, raw fallbacks, sizes), then write it.

Encoding is two passes so that the frame is allocated once, at its exact size:
:func:`plan_chunks` sizes every chunk's streams, the Python layer lays out the header
and offsets, and :func:`encode_chunks` writes the payloads (and their checksums) in
parallel over chunks. A chunk is a few hundred KiB at most, so its working set stays in
L2 while its streams are coded one by one.

Two habits of these loops: they run over 0-based views (``for i in range(view.size)``;
loops over ``range(lo, hi)`` compile to slower code), and stream 0's reference is
folded into a rotated copy of its tables once per chunk
(:func:`comm_codec.kernels.symbols.rotated`) instead of being subtracted per element.

A stream may have a group of books (``nbooks[s] > 1``): the planner then takes the
chunk's lane histograms once and prices every book on them (a 4 x 256 dot product per
book), instead of summing code lengths element by element as it does for one book.
"""

from __future__ import annotations

import numpy as np
from numba import prange

from .histogram import lane_histograms
from .intrinsics import prefetch
from .jit import inline, jit, parallel_entry
from .layout import CHUNK_MASK, CHUNK_RAW0, CHUNK_ZERO, LANE_HEADER, LANES
from .symbols import chunk_ref, count_zeros, hash_words, rotated, stream_params, symbol, symbol0

__all__ = ["plan_chunks", "encode_chunks"]

_U64_0 = np.uint64(0)


@inline
def _view_bits(view, sh, sub, top, ra, mask, lens):
    """Coded bits of view."""
    total = 0
    for i in range(view.size):
        total += lens[symbol(view[i], sh, sub, top, ra, mask)]
    return total


@jit
def _view_bits0(view, lens):
    """:func:`_view_bits` of stream 0, the reference folded into lens (a function of its
    own with the layout as constants, like :func:`_pack0`)."""
    total = 0
    n = view.size
    for j in range(0, n, 16):
        prefetch(view, 4 * n + j)  # the next chunk's lane, as the histogram of stream 0 does
        for i in range(j, min(n, j + 16)):
            total += lens[symbol0(view[i])]
    return total


@inline
def _segment_size(lane_bits):
    """Bytes of a coded segment whose lanes hold lane_bits[k] bits: header, padded lanes."""
    total = LANE_HEADER
    for k in range(LANES):
        total += (((lane_bits[k] + 7) // 8) + 7) & ~7
    return total


@jit
def _segment_bytes(src, lo, hi, s, exp_shift, ref, lens):
    """Bytes of the coded segment of stream s over src[lo:hi] with one book, lane header included."""
    lane = np.zeros(LANES, dtype=np.int64)
    present = hi - lo
    if s == 0:
        _, sub, _, _, _ = stream_params(src, 0, exp_shift, ref)
        rlens = rotated(lens, sub)
        for k in range(LANES):
            lane[k] = _view_bits0(src[lo + k * present // LANES: lo + (k + 1) * present // LANES], rlens)
    else:
        sh, sub, top, ra, mask = stream_params(src, s, exp_shift, ref)
        for k in range(LANES):
            view = src[lo + k * present // LANES: lo + (k + 1) * present // LANES]
            lane[k] = _view_bits(view, sh, sub, top, ra, mask, lens)
    return _segment_size(lane)


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


@jit
def _sample_zeros(bits, lo, hi):
    """All-zero elements among the strided sample that :func:`chunk_ref` reads."""
    step = max(1, (hi - lo) // 256)
    z = 0
    for i in range(lo, hi, step):
        z += np.int64(bits[i] == 0)
    return z, (hi - lo + step - 1) // step


@jit
def _segment_plan(hist, sub, lens, nbooks, total):
    """Pick stream s's book for a chunk from its lane histograms; return (bytes, book).

    The book is the one with the fewest coded bits over the chunk (ties to the lower
    index); bytes is the coded segment's size with it, lane header and padding included.
    ``total`` (int64[256]) is scratch.
    """
    best = 0
    if nbooks > 1:
        for b in range(256):
            total[(b - sub) & 255] = hist[0, b] + hist[1, b] + hist[2, b] + hist[3, b]
        best_bits = np.int64(-1)
        for k in range(nbooks):
            row = lens[k]
            bits = np.int64(0)
            for x in range(256):
                bits += total[x] * np.int64(row[x])
            if best_bits < 0 or bits < best_bits:
                best_bits = bits
                best = k
    row = lens[best]
    seg = np.int64(LANE_HEADER)
    for k in range(LANES):
        bits = np.int64(0)
        for b in range(256):
            bits += hist[k, b] * np.int64(row[(b - sub) & 255])
        seg += (((bits + 7) // 8) + 7) & ~7
    return seg, best


@jit
def _size_stream(src, lo, hi, s, exp_shift, ref, lens, nbooks, hist, total):
    """(coded segment bytes, book of its group) of stream s over src[lo:hi]."""
    if nbooks == 1:  # one book: summing code lengths is cheaper than a histogram
        return _segment_bytes(src, lo, hi, s, exp_shift, ref, lens[0]), 0
    lane_histograms(src, lo, hi, s, hist)
    _, sub, _, _, _ = stream_params(src, s, exp_shift, ref)
    return _segment_plan(hist, sub, lens, nbooks, total)


@parallel_entry
def plan_chunks(bits, chunk_elems, exp_shift, enc_len, nbooks, raw_stream, cflags, refs, books, sizes):
    """Choose each chunk's reference, zero handling, books and raw fallbacks; size its streams.

    Args:
        bits: element bits (typed as :mod:`comm_codec.kernels.layout` describes).
        chunk_elems: elements per chunk.
        exp_shift: the exponent's position in stream 0 (-1: no relative coding).
        enc_len: uint8[nstreams, nbooks_max, 256] code lengths (escape included) per
            stream and book of its group.
        nbooks: int64[nstreams], the size of each stream's group.
        raw_stream: bool[nstreams], streams whose book is raw.
        cflags, refs, books, sizes: outputs, uint8[nchunks], uint8[nchunks],
            uint16[nchunks] (book of stream s in bits 4s..4s+3), uint32[nchunks, ns].
    """
    n = bits.size
    ns = enc_len.shape[0]
    for c in prange(cflags.size):
        lo = c * chunk_elems
        hi = min(n, lo + chunk_elems)
        count = hi - lo
        ref = chunk_ref(bits, lo, hi, exp_shift)
        refs[c] = ref
        books[c] = 0
        hist = np.empty((LANES, 256), dtype=np.int64)
        total = np.empty(256, dtype=np.int64)
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
            seg0, k0 = _size_stream(bits, lo, hi, first, exp_shift, ref, enc_len[first], nbooks[first], hist, total)
        zeros = count_zeros(bits[lo:hi])
        if zeros == count:
            cflags[c] = CHUNK_ZERO
            for s in range(ns):
                sizes[c, s] = 0
            continue
        # The mask costs one bit per element: take it when the zeros cost more in the
        # streams (priced with each group's first book).
        zero_cost = 0
        for s in range(ns):
            sh, sub, top, ra, mask = stream_params(bits, s, exp_shift, ref)
            zero_cost += 8 if raw_stream[s] else enc_len[s, 0, symbol(0, sh, sub, top, ra, mask)]
        use_mask = zeros * zero_cost > count + 64
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
                seg, k = _size_stream(src, slo, shi, s, exp_shift, ref, enc_len[s], nbooks[s], hist, total)
            if seg >= present:
                flags |= CHUNK_RAW0 << s
                sizes[c, s] = present
            else:
                sizes[c, s] = seg
                chosen |= k << (4 * s)
        cflags[c] = flags
        books[c] = chosen


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
def _pack(view, sh, sub, top, ra, mask, codes, lens, out64, w):
    """Bit-pack one stream of view LSB-first into out64 from word w; return bits.

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
            out64[w] = acc
            w += 1
            nb -= 64
            acc = code >> np.uint64(ln - nb)
    for i in range(3 * (n // 3), n):
        s0 = symbol(view[i], sh, sub, top, ra, mask)
        ln = np.int64(lens[s0])
        total += ln
        acc, nb, w = _emit(acc, nb, w, np.uint64(codes[s0]), ln, out64)
    if nb > 0:
        out64[w] = acc
    return total


@jit
def _pack0(view, codes, lens, out64, w):
    """:func:`_pack` of stream 0 with the reference folded into codes and lens: the
    layout is all constants here (a separate function, so that the compiler cannot
    merge it with the general packer's code; merged, the shifts were run-time values
    again and the loop spilled registers)."""
    acc = _U64_0
    nb = 0
    w0 = w
    n = view.size
    for k in range(n // 3):
        # Lane k's elements of the next chunk lie 4 lane lengths on: ask for them now,
        # as the histogram does (the input comes from memory, once per pass).
        prefetch(view, 4 * n + 3 * k)
        s0 = symbol0(view[3 * k])
        s1 = symbol0(view[3 * k + 1])
        s2 = symbol0(view[3 * k + 2])
        l0 = np.int64(lens[s0])
        l01 = l0 + np.int64(lens[s1])
        ln = l01 + np.int64(lens[s2])
        code = (np.uint64(codes[s0]) | (np.uint64(codes[s1]) << np.uint64(l0))
                | (np.uint64(codes[s2]) << np.uint64(l01)))
        acc |= code << np.uint64(nb)
        nb += ln
        if nb >= 64:
            out64[w] = acc
            w += 1
            nb -= 64
            acc = code >> np.uint64(ln - nb)
    for i in range(3 * (n // 3), n):
        s0 = symbol0(view[i])
        acc, nb, w = _emit(acc, nb, w, np.uint64(codes[s0]), np.int64(lens[s0]), out64)
    if nb > 0:
        out64[w] = acc
    return 64 * (w - w0) + nb


@jit
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
def _write_raw(src, s, exp_shift, ref, out8, pos, size):
    """Write stream s of src uncoded at pos, zero-padded to 8 bytes."""
    sh, sub, top, ra, mask = stream_params(src, s, exp_shift, ref)
    count = src.size
    dst = out8[pos:pos + ((size + 7) & ~7)]
    for i in range(count):
        dst[i] = symbol(src[i], sh, sub, top, ra, mask)
    for k in range(count, dst.size):
        dst[k] = 0


@jit
def _write_segment(src, s, exp_shift, ref, codes, lens, out8, out64, pos):
    """Write stream s of src as a coded segment (lane lengths, then lanes) at pos."""
    count = src.size
    wpos = pos + LANE_HEADER
    # Each branch gets its own copy of the packer; for stream 0 the layout is all
    # constants and the reference is folded into rotated tables.
    if s == 0:
        sh, sub, top, ra, mask = stream_params(src, 0, exp_shift, ref)
        rcodes = rotated(codes, sub)
        rlens = rotated(lens, sub)
        for k in range(LANES):
            view = src[k * count // LANES: (k + 1) * count // LANES]
            nbytes = (_pack0(view, rcodes, rlens, out64, wpos // 8) + 7) // 8
            _put_u32(out8, pos + 4 * k, nbytes)
            wpos += (nbytes + 7) & ~7
    else:
        sh, sub, top, ra, mask = stream_params(src, s, exp_shift, ref)
        for k in range(LANES):
            view = src[k * count // LANES: (k + 1) * count // LANES]
            nbytes = (_pack(view, sh, sub, top, ra, mask, codes, lens, out64, wpos // 8) + 7) // 8
            _put_u32(out8, pos + 4 * k, nbytes)
            wpos += (nbytes + 7) & ~7


@jit
def _encode_chunk(src, c, flags, ref, chosen, sizes, pos, exp_shift, enc_code, enc_len, out8, out64):
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
            _write_segment(src, s, exp_shift, ref, enc_code[s, k], enc_len[s, k], out8, out64, pos)
        pos += (size + 7) & ~7
    return pos


@parallel_entry
def encode_chunks(bits, chunk_elems, exp_shift, enc_code, enc_len, cflags, refs, books, sizes, offsets,
                  out8, out64, checksums, do_checksum):
    """Write every chunk's payload at its offset (as planned by :func:`plan_chunks`).

    Args:
        bits, chunk_elems, exp_shift: as for :func:`plan_chunks`.
        enc_code, enc_len: uint32/uint8[nstreams, nbooks_max, 256] encoder tables.
        cflags, refs, books, sizes: the plan.
        offsets: int64[nchunks], byte offset of each payload (multiples of 8).
        out8, out64: the frame as uint8 and as uint64 (same memory).
        checksums: uint32[nchunks] output.
        do_checksum: whether to compute checksums (0 is stored otherwise).
    """
    n = bits.size
    for c in prange(cflags.size):
        lo = c * chunk_elems
        hi = min(n, lo + chunk_elems)
        end = _encode_chunk(bits[lo:hi], c, cflags[c], np.int64(refs[c]), np.int64(books[c]), sizes,
                            offsets[c], exp_shift, enc_code, enc_len, out8, out64)
        start = offsets[c] // 8
        checksums[c] = hash_words(out64, start, end // 8 - start, c) if do_checksum else 0
