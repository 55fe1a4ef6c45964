"""Decode kernels: a chunk's streams into elements, and decode-and-add into float32.

A chunk decodes in two phases. Its coded streams are decoded lane by lane
(:func:`comm_codec.kernels.lanes.decode_lanes`) into byte rows of a scratch array, while
raw streams are read where they lie in the frame; then one pass joins each element's
stream bytes (:mod:`comm_codec.kernels.assemble`), with streaming stores where the
whole output reaches :data:`~comm_codec.kernels.assemble.STREAM_MIN_BYTES`.
A chunk of a 1-byte integer type has one stream whose bytes are the elements: its lanes
are decoded straight into the output.

One kernel, :func:`decode_range`, does every decode: a range of chunks into the output,
or each chunk into cache-resident scratch and added, widened to float32, into an
accumulator: bit for bit what torch's CPU ``add_`` gives, NaNs included
(:func:`_add_f32`). Threads share a frame by calling it on ranges of chunks; numba's
``parallel=True`` is not used, because its compile cost more than the kernel's own
(one copy of the decode code per element type, not three).
"""

from __future__ import annotations

import numpy as np

# As for lanes.py below: assemble.py's code is compiled into the kernels here.
from .assemble import LINE_BYTES, STREAM_MIN_BYTES, assemble, assemble_masked
from .intrinsics import address, as_f32, f32_bits
from .jit import entry, inline, jit

# numba's on-disk cache keys the kernels below on this file alone, and they hold their
# own compiled copy of decode_lanes: any change to lanes.py (its code, not only its
# table layout) must come with a change to this file, or a cached decode_chunks goes on
# running the old lanes (with new tables, reading them the old way). So a cached
# decode kernel is only as new as this file.
from .lanes import decode_lanes
from .layout import (
    CHUNK_MASK,
    CHUNK_RAW0,
    CHUNK_ZERO,
    HASH_STATE,
    LANE_HEADER,
    STATUS_BOOK,
    STATUS_CHECKSUM,
    STATUS_MASK_COUNT,
    STATUS_OK,
    STATUS_SIZE,
)

# As for lanes.py: plane.py's code is compiled into the kernels below, keyed on this file.
from .plane import or_plane, plane_bytes
from .symbols import element_layout, hash_finish, hash_start

__all__ = ["decode_range", "decode_chunks", "decode_chunks_serial", "decode_accumulate_chunks"]


@jit
def _decode_chunk(
    frame8, frame64, pos, count, flags, ref, chosen, sizes_c, exp_shift, split, dec_tables, multi, out, hs, streaming
):
    """Decode one chunk's payload at pos into out (count elements); return a status.

    Coded streams are decoded into byte rows of a scratch array; raw streams are read
    where they lie in the frame; a split stream 0's lanes give its exponents (shifted
    up) and its plane the bits under them (:func:`comm_codec.kernels.plane.or_plane`);
    then one pass builds the elements (:func:`comm_codec.kernels.assemble.assemble`,
    with streaming stores if ``streaming``).
    A coded chunk of a 1-byte integer type (one stream, its bytes the elements: no
    reference, no rotation) is decoded straight into out instead. The lane loops go on
    with the checksum in hs (see :func:`comm_codec.kernels.lanes.decode_lanes`).
    """
    if flags & CHUNK_ZERO:
        out[:] = 0
        return STATUS_OK
    width, ra, _ = element_layout(out)
    if width == 1 and not ra and not flags & (CHUNK_MASK | CHUNK_RAW0) and sizes_c.size == 1:
        k = chosen & 15
        if k >= dec_tables.shape[1]:  # the Python layer checks it against the group; trust nothing
            return STATUS_BOOK
        pf = address(out)  # nothing to prefetch: the output is what the lanes write
        return decode_lanes(
            frame8,
            frame64,
            pos,
            np.int64(sizes_c[0]),
            count,
            dec_tables[0, k],
            multi[0, k],
            out.view(np.uint8),
            pf,
            pf,
            pf,
            pf,
            hs,
        )
    mpos = pos
    present = count
    if flags & CHUNK_MASK:
        mbytes = (count + 7) // 8
        present = 0
        for k in range(mbytes):
            byte = np.int64(frame8[pos + k])
            if k == mbytes - 1 and count % 8:
                byte &= (1 << (count % 8)) - 1
            # branch-free popcount: a loop over the set bits mispredicts once a byte
            byte -= (byte >> 1) & 0x55
            byte = (byte & 0x33) + ((byte >> 2) & 0x33)
            present += (byte + (byte >> 4)) & 0x0F
        pos += (mbytes + 7) & ~7
    ns = sizes_c.size
    # + 8: a masked chunk's assembly may index one past its last present element (and
    # then skips the read), and a plane is ORed in 8 symbols at a time; raw rows get
    # the one byte of slack from the frame's padding.
    rows = np.empty((ns, present + 8), dtype=np.uint8)
    v0 = rows[0]
    v1 = rows[min(1, ns - 1)]
    v2 = rows[min(2, ns - 1)]
    v3 = rows[min(3, ns - 1)]
    # What the coded streams' decoding prefetches: the rest of the chunk's payload (raw
    # streams) and the output.
    pf_end = address(frame8) + pos
    for s in range(ns):
        pf_end += (np.int64(sizes_c[s]) + 7) & ~7
    pf_out = address(out)
    # A streamed output is not brought into cache: its stores bypass it (whole lines,
    # where its start is a line's; a masked chunk is spread with plain stores).
    streaming = streaming and pf_out % LINE_BYTES == 0 and not flags & CHUNK_MASK
    pf_out_end = pf_out if streaming else pf_out + out.size * out.itemsize
    for s in range(ns):
        size = np.int64(sizes_c[s])
        pf_in = address(frame8) + pos + size
        if flags & (CHUNK_RAW0 << s):
            if size != present:
                return STATUS_MASK_COUNT if flags & CHUNK_MASK else STATUS_SIZE
            view = frame8[pos : pos + present + 1]  # decode_chunks checked the chunk's end
            if s == 0:
                v0 = view
            elif s == 1:
                v1 = view
            elif s == 2:
                v2 = view
            else:
                v3 = view
        else:
            k = (chosen >> (4 * s)) & 15
            if k >= dec_tables.shape[1]:  # the Python layer checks it against the group; trust nothing
                return STATUS_BOOK
            lanes = size
            if s == 0 and split:
                lanes = size - plane_bytes(present, split)
                if lanes < LANE_HEADER:
                    return STATUS_SIZE
                pf_in -= size - lanes  # the plane too: it is read right after the lanes
            st = decode_lanes(
                frame8,
                frame64,
                pos,
                lanes,
                present,
                dec_tables[s, k],
                multi[s, k],
                rows[s],
                pf_in,
                pf_end,
                pf_out,
                pf_out_end,
                hs,
            )
            if st != STATUS_OK:
                return st
            if lanes != size:
                fa = address(frame8)
                or_plane(address(rows[0]), fa + pos + lanes, present, split, fa + pos + ((size + 7) & ~7))
        pos += (size + 7) & ~7
    add = (np.int64(ref) << exp_shift) if exp_shift >= 0 else np.int64(0)
    if flags & CHUNK_MASK:
        assemble_masked(v0, v1, v2, v3, present, add, frame8, mpos, out)
    else:
        assemble(v0, v1, v2, v3, present, add, out, streaming)
    return STATUS_OK


@jit
def _decode_one(
    c,
    frame8,
    frame64,
    numel,
    chunk_elems,
    exp_shift,
    split,
    dec_tables,
    multi,
    cflags,
    refs,
    books,
    sizes,
    offsets,
    checksums,
    do_checksum,
    out,
    streaming,
):
    """Decode chunk c into out (its count elements); return its status."""
    lo = c * chunk_elems
    count = min(numel, lo + chunk_elems) - lo
    flags = cflags[c]
    pos = offsets[c]
    length = (((count + 7) // 8) + 7) & ~7 if flags & CHUNK_MASK else 0
    for s in range(sizes.shape[1]):
        length += (np.int64(sizes[c, s]) + 7) & ~7
    if pos < 0 or pos % 8 or pos + length > frame8.size or out.size != count:  # checked above us; trust nothing
        return STATUS_SIZE
    # The checksum is taken while the chunk decodes, in the lane loops' rounds (a pass
    # of its own is bound by the multiplications' latency); unchecked, nothing is hashed.
    hs = np.empty(HASH_STATE, dtype=np.uint64)
    hash_start(hs, pos // 8, length // 8 if do_checksum else 0, c)
    st = _decode_chunk(
        frame8,
        frame64,
        pos,
        count,
        flags,
        np.int64(refs[c]),
        np.int64(books[c]),
        sizes[c],
        exp_shift,
        split,
        dec_tables,
        multi,
        out,
        hs,
        streaming,
    )
    if do_checksum and hash_finish(frame64, hs, pos // 8, length // 8) != checksums[c]:
        st = STATUS_CHECKSUM
    return st


@jit
def _chunk_order(books, n):
    """Chunks 0..n-1 ordered by stream 0's book, in chunk order within a book (a counting sort).

    A chunk's lane loop reads its book's 32 KiB multi-symbol table at random: chunks
    taken in frame order switch books often (a group holds up to 16), and each switch
    brings a table from L2 line by line on the loop's dependency chain.
    """
    counts = np.zeros(17, dtype=np.int64)
    for c in range(n):
        counts[(np.int64(books[c]) & 15) + 1] += 1
    for k in range(16):
        counts[k + 1] += counts[k]
    order = np.empty(n, dtype=np.int64)
    for c in range(n):
        k = np.int64(books[c]) & 15
        order[counts[k]] = c
        counts[k] += 1
    return order


@entry
def decode_range(
    frame8,
    frame64,
    numel,
    chunk_elems,
    exp_shift,
    split,
    dec_tables,
    multi,
    cflags,
    refs,
    books,
    sizes,
    offsets,
    checksums,
    do_checksum,
    out,
    status,
    order,
    i0,
    i1,
    acc,
    half,
    add,
):
    """Decode chunks order[i0:i1] into out, or add them into acc; status[c] gets a code per chunk (0 = ok).

    The one decode kernel: every decode (one thread or many, plain or added into
    float32) runs it, so that its code is compiled and cached once per element type.
    Threads each take a range of ``order`` (the Python layer's pool calls this kernel,
    which releases the GIL, on each). Chunks are taken by stream 0's book
    (:func:`_chunk_order`), so that a book's tables stay in cache from one chunk to the next.

    Args:
        frame8, frame64: the frame as uint8 and uint64 (same memory, 8-byte aligned).
        numel, chunk_elems, exp_shift: frame parameters.
        split: the frame's split exponent bits (0: not split); with them, stream 0's
            tables decode exponents (:func:`comm_codec.core.huffman.split_tables`).
        dec_tables: uint16[nstreams, nbooks_max, 4096] decode tables (unused rows for raw
            streams).
        multi: uint64[nstreams, nbooks_max, 4096] from
            :func:`comm_codec.kernels.lanes.multi_tables`.
        cflags, refs, books, sizes, offsets, checksums: the parsed chunk table (checked
            for consistency with the frame length, and books against the group sizes,
            by the Python layer).
        do_checksum: verify checksums.
        out: element bits output, typed as ``bits`` in
            :func:`comm_codec.kernels.encode.plan_chunks`; with acc, only its type counts.
        status: int32[nchunks] output.
        order: int64[], chunk indices (:func:`_chunk_order`'s order); empty: that order, computed
            here, and the whole of it (i0 and i1 are then ignored).
        i0, i1: the range of ``order`` to decode.
        acc: uint32[numel], a float32 accumulator's bits, or empty (decode into out). Each
            chunk is then decoded into a scratch chunk (it stays in L1/L2) and added from
            there, so that the decoded tensor never exists in memory; a chunk whose status
            is not 0 leaves its part of acc untouched.
        half: the frame holds fp16 (its uint16 bits widen differently from bf16's).
        add: True: acc += value; False: acc = value.
    """
    if order.size == 0:
        order = _chunk_order(books, cflags.size)
        i0 = 0
        i1 = cflags.size
    streaming = out.size * out.itemsize >= STREAM_MIN_BYTES
    plain = acc.size == 0
    for i in range(i0, i1):
        c = order[i]
        lo = c * chunk_elems
        hi = min(numel, lo + chunk_elems)
        # One call of the chunk decoder, for both uses: each call site with other argument
        # types (a literal False) would compile all of it again.
        dst = out[lo:hi] if plain else np.empty(hi - lo, dtype=out.dtype)
        st = _decode_one(
            c,
            frame8,
            frame64,
            numel,
            chunk_elems,
            exp_shift,
            split,
            dec_tables,
            multi,
            cflags,
            refs,
            books,
            sizes,
            offsets,
            checksums,
            do_checksum,
            dst,
            streaming and plain,
        )
        status[c] = st
        if not plain and st == STATUS_OK and hi <= acc.size:
            _accumulate(dst, acc[lo:hi], half, add)


_NO_ORDER = np.zeros(0, dtype=np.int64)
_NO_ACC = np.zeros(0, dtype=np.uint32)


def decode_chunks(
    frame8,
    frame64,
    numel,
    chunk_elems,
    exp_shift,
    split,
    dec_tables,
    multi,
    cflags,
    refs,
    books,
    sizes,
    offsets,
    checksums,
    do_checksum,
    out,
    status,
):
    """Decode every chunk into out on the calling thread; status[c] gets a code per chunk (0 = ok).

    :func:`decode_range` over all chunks (arguments as there); the Python layer shares
    the chunks among threads by calling that kernel on ranges.
    """
    decode_range(
        frame8,
        frame64,
        numel,
        chunk_elems,
        exp_shift,
        split,
        dec_tables,
        multi,
        cflags,
        refs,
        books,
        sizes,
        offsets,
        checksums,
        do_checksum,
        out,
        status,
        _NO_ORDER,
        0,
        0,
        _NO_ACC,
        False,
        False,
    )


decode_chunks_serial = decode_chunks


# -- decode and accumulate into float32 ------------------------------------------------------
_QUIET = np.uint32(0x00400000)
_ABS = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)


@inline
def _add_f32(a, b):
    """Bits of float32(a) + float32(b) (both given as bits), NaNs as torch's CPU add gives them.

    IEEE leaves which NaN a sum of NaNs carries to the hardware and the instruction's
    operand order; torch's ``acc.add_(x)`` gives x's NaN (quieted) when x is one, else
    acc's (seen on x86, vectorized and scalar tails alike). Choosing it here explicitly
    keeps the result independent of how LLVM orders the add.
    """
    r = f32_bits(as_f32(a) + as_f32(b))
    if (a & _ABS) > _INF_BITS:
        r = a | _QUIET
    if (b & _ABS) > _INF_BITS:
        r = b | _QUIET
    return r


@inline
def _half_bits_f32(h):
    """float32 bits of the fp16 bits h: exact; a NaN keeps its sign and payload and is
    quieted (what the hardware conversion gives, and torch's vectorized one; torch's
    scalar loop tail makes every NaN 0x7FFFFFFF instead)."""
    sign = np.uint32(h >> 15) << np.uint32(31)
    e = (np.uint32(h) >> np.uint32(10)) & np.uint32(31)
    m = np.uint32(h) & np.uint32(1023)
    r = sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
    if e == 0:  # zero or subnormal: m * 2**-24, exact in float32
        r = sign | f32_bits(np.float32(m) * np.float32(5.9604644775390625e-08))
    if e == 31:
        r = (sign | _INF_BITS) if m == 0 else (sign | _INF_BITS | _QUIET | (m << np.uint32(13)))
    return r


@jit
def _accumulate(bits, acc, half, add):
    """acc[i] (float32 bits) += the float32 value of element bits[i] (or = it, add False).

    bits are as :func:`decode_chunks` writes them: uint16 for bf16 (half False) and fp16
    (half True), uint32 for fp32. Widening is exact, so the sum is the one of widening
    first and adding then, bit for bit (see :func:`_add_f32` for NaNs).
    """
    width, _, _ = element_layout(bits)
    if width == 4:
        if add:
            for i in range(bits.size):
                acc[i] = _add_f32(acc[i], np.uint32(bits[i]))
        else:
            for i in range(bits.size):
                acc[i] = np.uint32(bits[i])
    elif half:
        if add:
            for i in range(bits.size):
                acc[i] = _add_f32(acc[i], _half_bits_f32(bits[i]))
        else:
            for i in range(bits.size):
                acc[i] = _half_bits_f32(bits[i])
    else:
        if add:
            for i in range(bits.size):
                acc[i] = _add_f32(acc[i], np.uint32(bits[i]) << np.uint32(16))
        else:
            for i in range(bits.size):
                acc[i] = np.uint32(bits[i]) << np.uint32(16)


def decode_accumulate_chunks(
    frame8,
    frame64,
    numel,
    chunk_elems,
    exp_shift,
    split,
    dec_tables,
    multi,
    cflags,
    refs,
    books,
    sizes,
    offsets,
    checksums,
    do_checksum,
    proto,
    half,
    acc,
    add,
    status,
):
    """Decode every chunk and add its elements, widened to float32, into acc (or assign them).

    :func:`decode_range` over all chunks, with ``proto`` (an empty array of the element
    bits' type, uint16 or uint32) for its ``out``.
    """
    decode_range(
        frame8,
        frame64,
        numel,
        chunk_elems,
        exp_shift,
        split,
        dec_tables,
        multi,
        cflags,
        refs,
        books,
        sizes,
        offsets,
        checksums,
        do_checksum,
        proto,
        status,
        _NO_ORDER,
        0,
        0,
        acc,
        half,
        add,
    )
