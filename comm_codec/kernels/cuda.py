"""numba.cuda kernels: plan, encode and decode chunks on the GPU, in the CPU's frame format.

A leaf like the CPU kernels: arrays in, status out; only :mod:`comm_codec.kernels.layout`
is imported here (the host side, :mod:`comm_codec.core.gpu`, lays out
frames, reads headers and launches these kernels). They produce and read *the same
bytes* as the CPU kernels (same reference exponent, zero-mask and raw decisions, lanes,
bit order, padding and checksums), so a frame made on one device decodes on the other,
and the tests check the two byte for byte. Under ``NUMBA_ENABLE_CUDASIM=1`` the same
kernels run in numba's CUDA simulator on CPU arrays, which is how CI tests them.

Kernels:

1. ``plan_kernel`` (one block per chunk): the chunk's reference exponent (mode of the
   same strided sample as the CPU), its zero count and mask decision (priced with each
   stream's first book), every stream's lane bit counts under each book of its group,
   hence the book with the fewest bits (ties to the lower index) and the segment size
   with it, and the raw fallback. Output: one u32 row per chunk
   ``[cflags, ref, books, size_0 .. size_{ns-1}]`` (``books`` as in the chunk table:
   the book of stream s in bits 4s..4s+3, 0 for raw streams).
2. ``encode_kernel`` (one block per chunk): mask bitmap, raw bytes, coded lanes (bit
   offsets from an exclusive scan of per-thread bit counts, packed with 64-bit atomic
   ORs), each coded stream with the book the plan chose, then the chunk checksum,
   written straight into the frame's chunk table.
3. ``crc_segments`` and ``crc_combine``: the header's CRC-32 (zlib's): segment CRCs in
   parallel, joined with the linear "shift by L zero bytes" operator.
4. ``decode_kernel`` (one block per chunk, one thread per lane; the decode table of
   each coded stream's chosen book in shared memory).

This version favours exact equality and simplicity over speed. A faster one would: give
each thread strided (coalesced) elements and keep the chunk in shared memory instead of
reading it from global memory in every pass; reuse the plan's lane counts in the
encoder; replace the serial per-block scans by warp shuffles; pack lanes with
warp-cooperative word writes instead of atomics; decode eight chunks per warp (four
lanes each: a chunk has only four independent bit streams, so a block per chunk leaves
most threads idle after the table load); and expand masked chunks in parallel through a
scratch buffer. No performance figure is claimed for this code;
``launch_scripts/bench_gpu.py`` measures it.

Kernels never raise: bad frames give a status per chunk (the codes of
:data:`comm_codec.kernels.layout.STATUS_MESSAGES`), every read is bounded by the frame's
length and by its segment, and every table lookup is checked.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import cuda, int32, int64, uint16, uint64

# The CPU kernels' constants: the same statuses (the codec maps both through
# layout.STATUS_MESSAGES), chunk flags, lane layout and checksum chains, by construction.
from .layout import (
    CHUNK_MASK,
    CHUNK_RAW0,
    CHUNK_ZERO,
    DEC_ENTRIES,
    HASH_MUL,
    HASH_SEED,
    LANE_HEADER,
    LANES,
    MAX_STREAMS,
    MIN_SAVING_SHIFT,
    STATUS_BAD_CODE,
    STATUS_BOOK,
    STATUS_CHECKSUM,
    STATUS_MASK_COUNT,
    STATUS_OK,
    STATUS_OVERRUN,
    STATUS_SIZE,
)

__all__ = [
    "SIMULATOR",
    "PLAN_THREADS",
    "DECODE_THREADS",
    "CRC_SEGMENT",
    "MAX_STREAMS",
    "plan_kernel",
    "encode_kernel",
    "crc_segments",
    "crc_combine",
    "decode_kernel",
]

# True when NUMBA_ENABLE_CUDASIM=1 was set before numba was imported (tests, CI).
SIMULATOR = bool(numba.config.ENABLE_CUDASIM)

# Threads per block. The simulator runs each thread as a Python thread, so it gets fewer.
PLAN_THREADS = 8 if SIMULATOR else 128
DECODE_THREADS = 8 if SIMULATOR else 32
_MAX_THREADS = 256  # size of the per-thread shared scratch arrays
_STATUS_SLOTS = LANES + 1  # shared array shapes must be plain constants
_MAX_BOOKS = 16  # books per group: four bits per stream in the chunk table
CRC_SEGMENT = 512  # header bytes per thread of crc_segments

_U64_0 = np.uint64(0)
_U64_1 = np.uint64(1)
_U64_63 = np.uint64(63)
_U64_4095 = np.uint64(4095)
_U64_32 = np.uint64(32)
_U64_LO32 = np.uint64(0xFFFFFFFF)


# -- element bits -> stream symbols (the same arithmetic as symbols.symbol) ---------------
@cuda.jit(device=True)
def _sym(v, s, width, ra, sub):
    """Stream s's symbol of element bits v (rotated by ra, minus sub, mod 256)."""
    top = 8 * width
    x = int64(v) & ((int64(1) << top) - 1)
    return ((((x << ra) | (x >> (top - ra))) >> (8 * (width - 1 - s))) - sub) & 255


@cuda.jit(device=True)
def _lane_of(j, b1, b2, b3):
    """Lane of present element j; lane k holds [k*present//4, (k+1)*present//4)."""
    return int64(j >= b1) + int64(j >= b2) + int64(j >= b3)


@cuda.jit(device=True)
def _thread_lane_bits(bits, a, b, j0, use_mask, enc_len, s, book, width, ra, sub, b1, b2, b3):
    """Coded bits of stream s (with book ``book`` of its group) that elements a..b add to each lane.

    j0 is the index of the thread's first present element in the chunk; with a mask,
    zeros are skipped (they are in no stream).
    """
    l0 = int64(0)
    l1 = int64(0)
    l2 = int64(0)
    l3 = int64(0)
    j = j0
    for i in range(a, b):
        v = bits[i]
        if use_mask and v == 0:
            continue
        ln = int64(enc_len[s, book, _sym(v, s, width, ra, sub)])
        k = _lane_of(j, b1, b2, b3)
        if k == 0:
            l0 += ln
        elif k == 1:
            l1 += ln
        elif k == 2:
            l2 += ln
        else:
            l3 += ln
        j += 1
    return l0, l1, l2, l3


@cuda.jit(device=True)
def _sub_for(s, exp_shift, ref):
    if s == 0 and exp_shift >= 0:
        return int64(ref) << exp_shift
    return int64(0)


@cuda.jit(device=True)
def _imin(a, b):
    # min/max of two integers, spelled out: the builtins' generic overloads took a
    # varargs path that the CUDA target (numba 0.68) could not compile.
    return a if a < b else b


@cuda.jit(device=True)
def _imax(a, b):
    return a if a > b else b


@cuda.jit(device=True)
def _pad8(n):
    return (n + 7) & ~7


@cuda.jit(device=True)
def _plane_bytes(n, split):
    """Bytes of a split stream 0's plane of n symbols (kernels.plane.plane_bytes)."""
    return split * ((n + 7) // 8)


@cuda.jit(device=True)
def _hash_chain(words, start, nwords, seed, j):
    """Chain j of the chunk checksum: the words i = j (mod 4) of words[start:start+nwords]."""
    h = (HASH_SEED ^ uint64(seed)) ^ uint64(j)
    for i in range(j, nwords, 4):
        h = (h ^ words[start + i]) * HASH_MUL
    return h


@cuda.jit(device=True)
def _hash_fold(h0, h1, h2, h3):
    h = (((h0 ^ h1) * HASH_MUL ^ h2) * HASH_MUL ^ h3) * HASH_MUL
    return (h >> _U64_32) ^ (h & _U64_LO32)


@cuda.jit(device=True)
def _block_scan(vals, nthreads):
    """Exclusive prefix sum of vals[0:nthreads] in place (thread 0 only); return the total."""
    total = int64(0)
    for t in range(nthreads):
        v = vals[t]
        vals[t] = total
        total += v
    return total


# -- plan ---------------------------------------------------------------------------------
@cuda.jit
def plan_kernel(bits, n, chunk_elems, width, ra, exp_shift, split, enc_len, nbooks, raw_stream, plan):
    """Plan chunk blockIdx.x: plan[c] = [cflags, ref, books, sizes...] exactly as encode.plan_chunks.

    enc_len is uint8[ns, nbooks_max, 256]; nbooks[s] is the size of stream s's group;
    split is the bits under the exponent of a split stream 0 (then enc_len[0] holds the
    exponents' code lengths and its segments end in a plane of split bits a symbol), or 0.
    """
    c = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    ns = enc_len.shape[0]
    lo = int64(c) * chunk_elems
    hi = _imin(int64(n), lo + chunk_elems)
    count = hi - lo
    hist = cuda.shared.array(256, int64)
    nz = cuda.shared.array(_MAX_THREADS, int64)
    lanes = cuda.shared.array((_MAX_BOOKS, LANES), int64)  # per book of the group
    info = cuda.shared.array(4, int64)  # ref, use_mask, present, all_zero
    for e in range(t, 256, nt):
        hist[e] = 0
    cuda.syncthreads()
    # Reference exponent: mode of a strided sample, exact zeros left out (symbols.chunk_ref).
    if exp_shift >= 0:
        step = _imax(int64(1), count // 256)
        nsamp = (count + step - 1) // step
        for q in range(t, nsamp, nt):
            v = bits[lo + q * step]
            if v != 0:
                cuda.atomic.add(hist, _sym(v, 0, width, ra, 0) >> exp_shift, 1)
    per = (count + nt - 1) // nt
    a = _imin(hi, lo + t * per)
    b = _imin(hi, a + per)
    z = int64(0)
    for i in range(a, b):
        z += int64(bits[i] == 0)
    nz[t] = (b - a) - z
    cuda.syncthreads()
    if t == 0:
        best = 0
        if exp_shift >= 0:
            for e in range(256):
                if hist[e] > hist[best]:
                    best = e
        nonzero = _block_scan(nz, nt)
        zeros = count - nonzero
        # The mask costs one bit per element: take it when the zeros cost more in the streams.
        zero_cost = int64(0)
        for s in range(ns):
            if raw_stream[s]:
                zero_cost += 8
            else:
                zero_cost += int64(enc_len[s, 0, _sym(0, s, width, ra, _sub_for(s, exp_shift, best))])
                if s == 0:
                    zero_cost += split
        use_mask = zeros * zero_cost > count + 64
        info[0] = best
        info[1] = int64(use_mask)
        info[2] = nonzero if use_mask else count
        info[3] = int64(zeros == count)
        plan[c, 1] = best
        plan[c, 2] = 0
        plan[c, 0] = CHUNK_ZERO if zeros == count else (CHUNK_MASK if use_mask else 0)
    cuda.syncthreads()
    if info[3]:
        if t < ns:
            plan[c, 3 + t] = 0
        return
    ref = info[0]
    use_mask = info[1] != 0
    present = info[2]
    b1 = present // LANES
    b2 = 2 * present // LANES
    b3 = 3 * present // LANES
    j0 = nz[t] if use_mask else a - lo
    for s in range(ns):
        if raw_stream[s]:  # the same for every thread: no divergence around the barriers
            if t == 0:
                plan[c, 0] = plan[c, 0] | (CHUNK_RAW0 << s)
                plan[c, 3 + s] = present
            continue
        # One pass over the chunk per book of the group (the tables bound the count).
        nb = _imax(int64(1), _imin(int64(nbooks[s]), int64(_imin(enc_len.shape[1], _MAX_BOOKS))))
        for e in range(t, nb * LANES, nt):
            lanes[e // LANES, e % LANES] = 0
        cuda.syncthreads()
        sub = _sub_for(s, exp_shift, ref)
        for k in range(nb):
            l0, l1, l2, l3 = _thread_lane_bits(bits, a, b, j0, use_mask, enc_len, s, k, width, ra, sub, b1, b2, b3)
            cuda.atomic.add(lanes, (k, 0), l0)
            cuda.atomic.add(lanes, (k, 1), l1)
            cuda.atomic.add(lanes, (k, 2), l2)
            cuda.atomic.add(lanes, (k, 3), l3)
        cuda.syncthreads()
        if t == 0:
            # The book with the fewest bits over the chunk, ties to the lower index
            # (as encode.plan_chunks); its segment is sized with the lanes padded.
            chosen = 0
            fewest = int64(-1)
            for k in range(nb):
                total = lanes[k, 0] + lanes[k, 1] + lanes[k, 2] + lanes[k, 3]
                if fewest < 0 or total < fewest:
                    fewest = total
                    chosen = k
            seg = int64(LANE_HEADER)
            for q in range(LANES):
                seg += _pad8((lanes[chosen, q] + 7) // 8)
            if s == 0:
                seg += _plane_bytes(present, split)
            if seg > (present - 1 if s == 0 else present - _imax(int64(1), present >> MIN_SAVING_SHIFT)):
                plan[c, 0] = plan[c, 0] | (CHUNK_RAW0 << s)
                plan[c, 3 + s] = present
            else:
                plan[c, 2] = plan[c, 2] | (chosen << (4 * s))
                plan[c, 3 + s] = seg
        cuda.syncthreads()


# -- encode -------------------------------------------------------------------------------
@cuda.jit
def encode_kernel(
    bits,
    n,
    chunk_elems,
    width,
    ra,
    exp_shift,
    split,
    enc_code,
    enc_len,
    plan,
    offsets,
    out8,
    out64,
    table_pos,
    entry_bytes,
    do_checksum,
):
    """Write chunk blockIdx.x's payload at offsets[c] and its checksum into the chunk table.

    enc_code and enc_len are [ns, nbooks_max, 256]; each coded stream s uses book
    (plan[c, 2] >> 4s) & 15 of its group, as the plan chose. A split stream 0 (split > 0)
    codes its exponents with them and ends its segment in the plane of the split bits
    under them (kernels.plane's layout).
    """
    c = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    ns = enc_len.shape[0]
    lo = int64(c) * chunk_elems
    hi = _imin(int64(n), lo + chunk_elems)
    count = hi - lo
    flags = int64(plan[c, 0])
    ref = int64(plan[c, 1])
    chosen = int64(plan[c, 2])
    pos = int64(offsets[c])
    nz = cuda.shared.array(_MAX_THREADS, int64)
    lane_bits = cuda.shared.array((_MAX_THREADS, LANES), int64)
    lane_word = cuda.shared.array(LANES, int64)
    chains = cuda.shared.array(LANES, uint64)
    info = cuda.shared.array(1, int64)
    per = (count + nt - 1) // nt
    a = _imin(hi, lo + t * per)
    b = _imin(hi, a + per)
    use_mask = (flags & CHUNK_MASK) != 0
    end = pos
    if not (flags & CHUNK_ZERO):
        present = count
        j0 = a - lo
        if use_mask:
            mbytes = (count + 7) // 8
            for k in range(t, _pad8(mbytes), nt):
                byte = 0
                if k < mbytes:
                    for q in range(_imin(8, count - 8 * k)):
                        if bits[lo + 8 * k + q] != 0:
                            byte |= 1 << q
                out8[pos + k] = byte
            z = int64(0)
            for i in range(a, b):
                z += int64(bits[i] != 0)
            nz[t] = z
            cuda.syncthreads()
            if t == 0:
                info[0] = _block_scan(nz, nt)
            cuda.syncthreads()
            present = info[0]
            j0 = nz[t]
            pos += _pad8(mbytes)
        b1 = present // LANES
        b2 = 2 * present // LANES
        b3 = 3 * present // LANES
        for s in range(ns):
            size = int64(plan[c, 3 + s])
            book = (chosen >> (4 * s)) & 15
            sub = _sub_for(s, exp_shift, ref)
            if flags & (CHUNK_RAW0 << s):
                j = j0
                for i in range(a, b):
                    v = bits[i]
                    if use_mask and v == 0:
                        continue
                    out8[pos + j] = _sym(v, s, width, ra, sub)
                    j += 1
                for k in range(size + t, _pad8(size), nt):
                    out8[pos + k] = 0
            else:
                # Pass 1: this thread's bits per lane; zero the lane words for the ORs.
                l0, l1, l2, l3 = _thread_lane_bits(
                    bits, a, b, j0, use_mask, enc_len, s, book, width, ra, sub, b1, b2, b3
                )
                lane_bits[t, 0] = l0
                lane_bits[t, 1] = l1
                lane_bits[t, 2] = l2
                lane_bits[t, 3] = l3
                first_word = (pos + LANE_HEADER) // 8
                for w in range(t, (_pad8(size) - LANE_HEADER) // 8, nt):  # a plane and its padding too
                    out64[first_word + w] = _U64_0
                cuda.syncthreads()
                # Exclusive scan over threads, per lane (thread k scans lane k).
                if t < LANES:
                    total = int64(0)
                    for q in range(nt):
                        v2 = lane_bits[q, t]
                        lane_bits[q, t] = total
                        total += v2
                    nbytes = (total + 7) // 8
                    for q in range(4):
                        out8[pos + 4 * t + q] = (nbytes >> (8 * q)) & 255
                    lane_word[t] = _pad8(nbytes) // 8
                cuda.syncthreads()
                if t == 0:
                    w = first_word
                    for k in range(LANES):
                        words = lane_word[k]
                        lane_word[k] = w
                        w += words
                cuda.syncthreads()
                # Pass 2: each symbol's bits at its scanned offset; ORs because the words
                # at the ends of a thread's range are shared with its neighbours.
                p0 = lane_bits[t, 0]
                p1 = lane_bits[t, 1]
                p2 = lane_bits[t, 2]
                p3 = lane_bits[t, 3]
                j = j0
                for i in range(a, b):
                    v = bits[i]
                    if use_mask and v == 0:
                        continue
                    y = _sym(v, s, width, ra, sub)
                    ln = int64(enc_len[s, book, y])
                    code = uint64(enc_code[s, book, y])
                    k = _lane_of(j, b1, b2, b3)
                    if k == 0:
                        p = p0
                        p0 += ln
                    elif k == 1:
                        p = p1
                        p1 += ln
                    elif k == 2:
                        p = p2
                        p2 += ln
                    else:
                        p = p3
                        p3 += ln
                    w = lane_word[k] + (p >> 6)
                    off = p & 63
                    cuda.atomic.or_(out64, w, code << uint64(off))
                    if off + ln > 64:
                        cuda.atomic.or_(out64, w + 1, code >> uint64(64 - off))
                    j += 1
                if s == 0 and split:
                    # The plane after the lanes: each symbol's low split bits at bit split * j.
                    pbits = 8 * (pos + size - _plane_bytes(present, split))
                    low = (int64(1) << split) - 1
                    j = j0
                    for i in range(a, b):
                        v = bits[i]
                        if use_mask and v == 0:
                            continue
                        m = uint64(_sym(v, 0, width, ra, sub) & low)
                        p = pbits + split * j
                        off = p & 63
                        cuda.atomic.or_(out64, p >> 6, m << uint64(off))
                        if off + split > 64:
                            cuda.atomic.or_(out64, (p >> 6) + 1, m >> uint64(64 - off))
                        j += 1
                cuda.syncthreads()
            pos += _pad8(size)
        end = pos
    # Checksum of the payload words, four chains as in symbols.hash_words.
    cuda.syncthreads()
    if do_checksum:
        start = int64(offsets[c]) // 8
        nwords = (end - int64(offsets[c])) // 8
        if t < LANES:
            chains[t] = _hash_chain(out64, start, nwords, c, t)
        cuda.syncthreads()
        if t == 0:
            value = int64(_hash_fold(chains[0], chains[1], chains[2], chains[3]))
            at = table_pos + int64(c) * entry_bytes + 4
            for q in range(4):
                out8[at + q] = (value >> (8 * q)) & 255


# -- header CRC ---------------------------------------------------------------------------
@cuda.jit
def crc_segments(frame8, seg, nseg, crc_table, seg_crcs):
    """seg_crcs[i] = the unconditioned CRC-32 register of frame8[i*seg:(i+1)*seg] from 0."""
    i = cuda.grid(1)
    if i >= nseg:
        return
    r = int64(0)
    for k in range(i * seg, (i + 1) * seg):
        r = int64(crc_table[(r ^ int64(frame8[k])) & 255]) ^ (r >> 8)
    seg_crcs[i] = r


@cuda.jit
def crc_combine(frame8, seg, nseg, crc_end, seg_crcs, shift_cols, crc_table):
    """Join the segment CRCs into zlib's CRC-32 of frame8[:crc_end]; store it at crc_end.

    The register update is linear over GF(2): crc(A + B) = Z_|B|(crc(A)) ^ crc0(B), where
    Z_L (shift_cols, one column per bit) runs the register over L zero bytes.
    """
    if cuda.grid(1) != 0:
        return
    r = int64(0xFFFFFFFF)
    for i in range(nseg):
        z = int64(0)
        for bit in range(32):
            if (r >> bit) & 1:
                z ^= int64(shift_cols[bit])
        r = z ^ int64(seg_crcs[i])
    for k in range(nseg * seg, crc_end):
        r = int64(crc_table[(r ^ int64(frame8[k])) & 255]) ^ (r >> 8)
    r ^= 0xFFFFFFFF
    for q in range(4):
        frame8[crc_end + q] = (r >> (8 * q)) & 255


# -- decode -------------------------------------------------------------------------------
@cuda.jit(device=True)
def _peek(words, base, nwords, pos):
    """64 bits of a lane from bit pos; bits past the lane's last word read as zero."""
    w = pos >> 6
    off = uint64(pos & 63)
    lo = words[base + w] if w < nwords else _U64_0
    hi = words[base + w + 1] if w + 1 < nwords else _U64_0
    return (lo >> off) | ((hi << _U64_1) << (_U64_63 - off))


@cuda.jit(device=True)
def _lane_u32(frame8, at):
    return (
        int64(frame8[at]) | (int64(frame8[at + 1]) << 8) | (int64(frame8[at + 2]) << 16) | (int64(frame8[at + 3]) << 24)
    )


@cuda.jit
def decode_kernel(
    frame8,
    frame64,
    nbytes,
    numel,
    chunk_elems,
    width,
    ra,
    exp_shift,
    split,
    dec_tables,
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
    """Decode chunk blockIdx.x into out (element bits); status[c] = 0 or a layout.STATUS_* code.

    dec_tables is uint16[ns, nbooks_max, 4096]; coded stream s of chunk c was coded with
    book (books[c] >> 4s) & 15 of its group, whose table is loaded into shared memory.
    With split > 0, stream 0's tables decode exponents (shifted up by split) and its
    coded segments end in the plane of the split bits under them.
    """
    c = cuda.blockIdx.x
    t = cuda.threadIdx.x
    nt = cuda.blockDim.x
    ns = sizes.shape[1]
    dec = cuda.shared.array((MAX_STREAMS, DEC_ENTRIES), uint16)
    chains = cuda.shared.array(LANES, uint64)
    st = cuda.shared.array(_STATUS_SLOTS, int32)  # per lane, and [LANES] for the chunk
    cnt = cuda.shared.array(1, int64)
    lo = int64(c) * chunk_elems
    hi = _imin(int64(numel), lo + chunk_elems)
    count = hi - lo
    flags = int64(cflags[c])
    chosen = int64(books[c])
    nbooks = int64(dec_tables.shape[1])
    pos = int64(offsets[c])
    masked = (flags & CHUNK_MASK) != 0
    mbytes = (count + 7) // 8
    length = _pad8(mbytes) if masked else int64(0)
    for s in range(ns):
        length += _pad8(int64(sizes[c, s]))
    if t <= LANES:
        st[t] = STATUS_OK
    if t == 0:
        cnt[0] = 0
    cuda.syncthreads()
    # The host checked the layout; the kernel trusts nothing and checks again.
    if pos < 0 or pos % 8 != 0 or pos + length > nbytes:
        if t == 0:
            status[c] = STATUS_SIZE
        return
    if do_checksum:
        if t < LANES:
            chains[t] = _hash_chain(frame64, pos // 8, length // 8, c, t)
        cuda.syncthreads()
        if _hash_fold(chains[0], chains[1], chains[2], chains[3]) != uint64(checksums[c]):
            if t == 0:
                status[c] = STATUS_CHECKSUM
            return
    if flags & CHUNK_ZERO:
        for i in range(lo + t, hi, nt):
            out[i] = 0
        if t == 0:
            status[c] = STATUS_OK
        return
    present = count
    if masked:
        for k in range(t, mbytes, nt):
            byte = int64(frame8[pos + k])
            if k == mbytes - 1 and count % 8:
                byte &= (1 << (count % 8)) - 1
            ones = int64(0)
            while byte:
                byte &= byte - 1
                ones += 1
            cuda.atomic.add(cnt, 0, ones)
        cuda.syncthreads()
        present = cnt[0]
    # Stream checks (thread 0) and decode tables into shared memory (all threads).
    if t == 0:
        spos = pos + (_pad8(mbytes) if masked else 0)
        for s in range(ns):
            size = int64(sizes[c, s])
            if st[LANES] == STATUS_OK:
                if flags & (CHUNK_RAW0 << s):
                    if size != present:
                        st[LANES] = STATUS_MASK_COUNT if masked else STATUS_SIZE
                elif ((chosen >> (4 * s)) & 15) >= nbooks:  # the host checks it against the group
                    st[LANES] = STATUS_BOOK
                else:
                    lanes = size - (_plane_bytes(present, split) if s == 0 else 0)
                    if lanes < LANE_HEADER:
                        st[LANES] = STATUS_SIZE
                    else:
                        words = int64(0)
                        for k in range(LANES):
                            words += (_lane_u32(frame8, spos + 4 * k) + 7) // 8
                        if LANE_HEADER + 8 * words != lanes:
                            st[LANES] = STATUS_SIZE
            spos += _pad8(size)
    for s in range(ns):
        k = (chosen >> (4 * s)) & 15
        if not (flags & (CHUNK_RAW0 << s)) and k < nbooks:
            for e in range(t, DEC_ENTRIES, nt):
                dec[s, e] = dec_tables[s, k, e]
    cuda.syncthreads()
    if st[LANES] != STATUS_OK:
        if t == 0:
            status[c] = st[LANES]
        return
    # One thread per lane: lane k's symbols of every stream, then its elements unrotated.
    # Masked chunks decode compactly into out[lo:lo+present] and are expanded below.
    if t < LANES:
        k = t
        jlo = k * present // LANES
        jhi = (k + 1) * present // LANES
        top = 8 * width
        spos = pos + (_pad8(mbytes) if masked else 0)
        for s in range(ns):
            if st[k] != STATUS_OK:
                break
            size = int64(sizes[c, s])
            shift = 8 * (width - 1 - s)
            add = _sub_for(s, exp_shift, refs[c])
            if flags & (CHUNK_RAW0 << s):
                for j in range(jlo, jhi):
                    v = ((int64(frame8[spos + j]) + add) & 255) << shift
                    if s == 0:
                        out[lo + j] = v
                    else:
                        out[lo + j] = int64(out[lo + j]) | v
            else:
                base = (spos + LANE_HEADER) // 8
                lane_bytes = int64(0)
                for q in range(k + 1):
                    lane_bytes = _lane_u32(frame8, spos + 4 * q)
                    if q < k:
                        base += (lane_bytes + 7) // 8
                nwords = (lane_bytes + 7) // 8
                p = int64(0)
                plane = spos + size - _plane_bytes(present, split)  # a split stream 0's plane
                low = (int64(1) << split) - 1
                for j in range(jlo, jhi):
                    buf = _peek(frame64, base, nwords, p)
                    e = int64(dec[s, int64(buf & _U64_4095)])
                    ln = (e >> 8) & 15
                    y = e & 255
                    if ln == 0:
                        st[k] = STATUS_BAD_CODE
                        break
                    if e >= 0x8000:  # escape: the symbol's 8 bits follow the code
                        y = int64(buf >> uint64(ln)) & 255
                        ln += 8
                    p += ln
                    if s == 0 and split:  # the bits under the exponent, from the plane
                        q = split * j
                        at = plane + (q >> 3)
                        m = int64(frame8[at]) >> (q & 7)
                        if (q & 7) + split > 8:
                            m |= int64(frame8[at + 1]) << (8 - (q & 7))
                        y |= m & low
                    v = ((y + add) & 255) << shift
                    if s == 0:
                        out[lo + j] = v
                    else:
                        out[lo + j] = int64(out[lo + j]) | v
                if st[k] == STATUS_OK and p > 8 * lane_bytes:
                    st[k] = STATUS_OVERRUN
            spos += _pad8(size)
        if ra and st[k] == STATUS_OK:
            full = (int64(1) << top) - 1
            for j in range(jlo, jhi):
                x = int64(out[lo + j]) & full
                out[lo + j] = (x >> 1) | ((x & 1) << (top - 1))
    cuda.syncthreads()
    if t == 0:
        code = STATUS_OK
        for k in range(LANES):
            if code == STATUS_OK:
                code = st[k]
        status[c] = code
        # Expand a masked chunk in place, from the back: the j-th present element moves
        # to its position i >= j, so no element is overwritten before it is moved.
        if code == STATUS_OK and masked:
            j = present - 1
            for i in range(count - 1, -1, -1):
                if (int64(frame8[pos + (i >> 3)]) >> (i & 7)) & 1:
                    out[lo + i] = out[lo + j]
                    j -= 1
                else:
                    out[lo + i] = 0
