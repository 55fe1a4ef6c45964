"""numba CPU kernels: plan, encode, decode and histogram chunks of a tensor's bits.

Private. The wrappers in :mod:`comm_codec.core.codec` validate what they pass in; still,
these kernels never trust frame contents: every read of a payload is bounded by its
segment, every table entry is checked, and each chunk reports a status code instead of
raising. Parallelism is over chunks (``prange``); a chunk is a few hundred KiB at most,
so its working set stays in L2 while its streams are processed one by one.

Element bits arrive as integer arrays whose *type* carries the layout (see
:func:`comm_codec.core.streams.kernel_bits`): uint8/uint16/uint32 for IEEE types (sign rotated
to bit 0), int8 for 1-byte integers (not rotated). numba compiles one specialization per
type, so element width and rotation are compile-time constants and the bit shuffling in
the hot loops folds into a few instructions (measured: 0.63 vs 0.95 ns per symbol for
the packer with run-time layout parameters). Two more habits the measurements taught:
loops run over 0-based views (``for i in range(view.size)``; loops over ``range(lo, hi)``
compiled to code 1.7x slower), and stream 0's per-chunk reference is folded into a
rotated copy of its tables once per chunk instead of being subtracted per element.

Coded stream segments hold ``_LANES`` independent bit streams ("lanes") over consecutive
quarters of the chunk's elements, preceded by their byte lengths. The decoder advances
the four lanes in lockstep so that four table lookups are in flight at once (as huff0's
4-stream mode); one lane alone is bound by the lookup -> shift dependency chain. Each
lookup goes to a table, built once per book from its decode table (:func:`multi_tables`,
cached by the codec), that holds up to six whole codes per 12-bit window (exponent
codes are 2-3 bits): measured 2.24 -> 0.90 ns per bf16 element with three, four took
bf16 weights' kernel 34.9 -> 30.0 ms, six cut the lane loop by another 3-7 % (13- and
14-bit windows were slower: their tables leave L1); escapes and invalid windows take
the one-symbol path, which keeps the checks. A lookup's symbols go out as one 8-byte
store into a byte row per stream (the next step overwrites the unused slots);
raw streams are read where they lie in the frame; and one pass then joins each
element's stream bytes, adds the chunk's reference and rotates the sign back (issue 14:
decode 1.76 -> 2.34 GB/s on all-MiniLM-L6-v2's bf16 weights, 2.31 -> 2.91 fp32, kernel
alone, 1 thread, against writing shifted symbols into the elements stream by stream).
The lane loop is bound by its lookups and the assembly by memory (it reads the raw
streams and writes the output, read for ownership first), so the lane loop asks for
the lines that the assembly will touch a few per round: the two phases overlap
(decode_chunks, 1 thread: 16 M bf16 N(0, 0.02) 9.2 -> 7.6 ms, MiniLM bf16 weights
14.4 -> 12.0 ms, fp32 weights 26.3 -> 24.1 ms).

A stream may have a group of books (``nbooks[s] > 1``): the planner then takes the
chunk's lane histograms once and prices every book on them (a 4 x 256 dot product per
book), instead of summing code lengths element by element as it does for one book.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic, overload

__all__ = [
    "plan_chunks",
    "encode_chunks",
    "decode_chunks",
    "decode_accumulate_chunks",
    "multi_tables",
    "chunk_histograms",
    "STATUS_OK",
    "STATUS_MESSAGES",
]

# One place for kernel flags: cache compiled code across processes; no fastmath (integer
# code, and bit-exactness is the point); errors are statuses, never exceptions.
_JIT = dict(nogil=True, cache=True)
_PJIT = dict(_JIT, parallel=True)

STATUS_OK = 0
_ST_CHECKSUM = 1
_ST_BAD_CODE = 2
_ST_OVERRUN = 3
_ST_MASK_COUNT = 4
_ST_SIZE = 5
_ST_BOOK = 6
STATUS_MESSAGES = {
    _ST_CHECKSUM: "payload checksum mismatch (corrupted data)",
    _ST_BAD_CODE: "bit pattern that is no code of its codebook (corrupted data or wrong codebook)",
    _ST_OVERRUN: "coded stream is shorter than its symbols need (truncated or corrupted)",
    _ST_MASK_COUNT: "zero mask does not match the stream sizes (corrupted data)",
    _ST_SIZE: "stream size does not match its element count (corrupted data)",
    _ST_BOOK: "names a book that its stream's group does not hold (corrupted data)",
}

_CHUNK_MASK = 0x01
_CHUNK_ZERO = 0x02
_CHUNK_RAW0 = 0x10
_DEC_MASK = np.uint64(4095)
MULTI_BITS = 12  # window of a multi-symbol lookup (13 and 14 bits: tables out of L1, slower)
_MULTI_SIZE = 1 << MULTI_BITS
_MULTI_MASK = np.uint64(_MULTI_SIZE - 1)
_HASH_MUL = np.uint64(0x9E3779B97F4A7C15)
_HASH_SEED = np.uint64(0xCBF29CE484222325)
_U64_0 = np.uint64(0)
_LANES = 4
_LANE_HEADER = 4 * _LANES  # u32 byte length of each lane
_MULTI_MAX = 6  # symbols per multi-symbol table entry; its store writes 8 bytes


def _layout(bits):
    """(width in bytes, rotate, all-ones mask) of an element-bits array; compile-time."""
    raise NotImplementedError  # only called from kernels, through the overload below


@overload(_layout, jit_options=dict(cache=True))
def _ol_layout(bits):
    width = bits.dtype.bitwidth // 8
    rotate = 1 if not bits.dtype.signed else 0
    mask = (1 << (8 * width)) - 1

    def impl(bits):
        return width, rotate, mask

    return impl


@numba.njit(inline="always", **_JIT)
def _params(bits, s, exp_shift, ref):
    """(sh, sub, top, ra, mask) for :func:`_sym` of stream s of this array type."""
    width, ra, mask = _layout(bits)
    sub = (np.int64(ref) << exp_shift) if (s == 0 and exp_shift >= 0) else np.int64(0)
    return np.int64(8 * (width - 1 - s)), sub, np.int64(8 * width), np.int64(ra), np.int64(mask)


@numba.njit(inline="always", **_JIT)
def _sym(v, sh, sub, top, ra, mask):
    """One stream's symbol of element bits v.

    The element is rotated left by ra (1: sign to bit 0) within top bits, shifted right
    by sh (8 * (width - 1 - stream)) and, for an exponent stream, reduced by sub
    (ref << exp_shift) modulo 256.
    """
    x = np.int64(v) & mask
    return ((((x << ra) | (x >> (top - ra))) >> sh) - sub) & 255


def _sym0(v):
    """Stream 0's byte of element bits v (before any reference), with the layout of v's
    type folded into constants; compile-time, like :func:`_layout`."""
    raise NotImplementedError  # only called from kernels, through the overload below


@overload(_sym0, jit_options=dict(cache=True))
def _ol_sym0(v):
    width = v.bitwidth // 8
    if v.signed:  # int8: the byte itself
        return lambda v: np.int64(v) & 255
    if width == 1:  # fp8: the byte rotated left by one
        return lambda v: ((np.int64(v) << 1) | (np.int64(v) >> 7)) & 255
    # wider floats: the sign rotated in lands in the last stream, so stream 0 is a
    # plain shift of the element (bf16: v >> 7)
    shift = 8 * width - 9
    return lambda v: (np.int64(v) >> shift) & 255


@numba.njit(inline="always", **_JIT)
def _unrot(x, top, ra):
    return (x >> ra) | ((x & ra) << (top - 1))


@numba.njit(**_JIT)
def _chunk_ref(bits, lo, hi, exp_shift):
    """Reference exponent of a chunk: the mode of a strided sample of its exponents.

    Exact zeros are left out (they are masked or rare); ties go to the smaller exponent.
    A poor reference only costs bits, never correctness.
    """
    if exp_shift < 0:
        return 0
    hist = np.zeros(256, dtype=np.int64)
    step = max(1, (hi - lo) // 256)
    sh, _, top, ra, mask = _params(bits, 0, -1, 0)
    for i in range(lo, hi, step):
        if bits[i] != 0:
            hist[_sym(bits[i], sh, 0, top, ra, mask) >> exp_shift] += 1
    best = 0
    for e in range(256):
        if hist[e] > hist[best]:
            best = e
    return best


@numba.njit(inline="always", **_JIT)
def _rotated(table, sub):
    """table re-indexed by the absolute byte: out[b] = table[(b - sub) mod 256]."""
    out = np.empty(256, dtype=table.dtype)
    for b in range(256):
        out[b] = table[(b - sub) & 255]
    return out


@numba.njit(inline="always", **_JIT)
def _view_bits(view, sh, sub, top, ra, mask, lens):
    """Coded bits of view."""
    total = 0
    for i in range(view.size):
        total += lens[_sym(view[i], sh, sub, top, ra, mask)]
    return total


@numba.njit(**_JIT)
def _view_bits0(view, lens):
    """:func:`_view_bits` of stream 0, the reference folded into lens (a function of its
    own with the layout as constants, like :func:`_pack0`)."""
    total = 0
    n = view.size
    for j in range(0, n, 16):
        _prefetch(view, 4 * n + j)  # the next chunk's lane, as in _hist4_0
        for i in range(j, min(n, j + 16)):
            total += lens[_sym0(view[i])]
    return total


@numba.njit(inline="always", **_JIT)
def _segment_size(lane_bits):
    """Bytes of a coded segment whose lanes hold lane_bits[k] bits: header, padded lanes."""
    total = _LANE_HEADER
    for k in range(_LANES):
        total += (((lane_bits[k] + 7) // 8) + 7) & ~7
    return total


@numba.njit(**_JIT)
def _segment_bytes(src, lo, hi, s, exp_shift, ref, lens):
    """Bytes of the coded segment of stream s over src[lo:hi] with one book, lane header included."""
    lane = np.zeros(_LANES, dtype=np.int64)
    present = hi - lo
    if s == 0:
        _, sub, _, _, _ = _params(src, 0, exp_shift, ref)
        rlens = _rotated(lens, sub)
        for k in range(_LANES):
            lane[k] = _view_bits0(src[lo + k * present // _LANES: lo + (k + 1) * present // _LANES], rlens)
    else:
        sh, sub, top, ra, mask = _params(src, s, exp_shift, ref)
        for k in range(_LANES):
            view = src[lo + k * present // _LANES: lo + (k + 1) * present // _LANES]
            lane[k] = _view_bits(view, sh, sub, top, ra, mask, lens)
    return _segment_size(lane)


@numba.njit(inline="always", **_JIT)
def _hist_rest(view, start, h, sh, top, ra, mask):
    """Count view[start:] into h (what a longer lane has past the shortest)."""
    for i in range(start, view.size):
        h[_sym(view[i], sh, 0, top, ra, mask)] += 1


@numba.njit(inline="always", **_JIT)
def _hist4(src, lo, a1, a2, a3, a4, sh, top, ra, mask, hist):
    """hist[k, byte] = count over lane k = src[lo+a_k : lo+a_{k+1}] (a0 = 0), lanes interleaved.

    Four separate tables advanced in lockstep: consecutive increments of one counter
    would each wait for the last (exponent bytes repeat).
    """
    v0 = src[lo:lo + a1]
    v1 = src[lo + a1:lo + a2]
    v2 = src[lo + a2:lo + a3]
    v3 = src[lo + a3:lo + a4]
    h0 = np.zeros(256, dtype=np.int32)
    h1 = np.zeros(256, dtype=np.int32)
    h2 = np.zeros(256, dtype=np.int32)
    h3 = np.zeros(256, dtype=np.int32)
    m = min(min(v0.size, v1.size), min(v2.size, v3.size))
    for i in range(m):
        h0[_sym(v0[i], sh, 0, top, ra, mask)] += 1
        h1[_sym(v1[i], sh, 0, top, ra, mask)] += 1
        h2[_sym(v2[i], sh, 0, top, ra, mask)] += 1
        h3[_sym(v3[i], sh, 0, top, ra, mask)] += 1
    _hist_rest(v0, m, h0, sh, top, ra, mask)
    _hist_rest(v1, m, h1, sh, top, ra, mask)
    _hist_rest(v2, m, h2, sh, top, ra, mask)
    _hist_rest(v3, m, h3, sh, top, ra, mask)
    for b in range(256):
        hist[0, b] = h0[b]
        hist[1, b] = h1[b]
        hist[2, b] = h2[b]
        hist[3, b] = h3[b]


@intrinsic
def _prefetch(typingctx, arr, i):
    """Ask for the cache line holding arr[i] to be brought into L2 (a hint: never faults,
    so i may lie past the array's end)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        ary, index = args
        data = context.make_array(signature.args[0])(context, builder, ary).data
        ptr = builder.bitcast(builder.gep(data, [index]), ir.IntType(8).as_pointer())
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(
            ir.VoidType(), [ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(32), ir.IntType(32)]))
        builder.call(fn, [ptr, ir.Constant(ir.IntType(32), 0), ir.Constant(ir.IntType(32), 2),
                          ir.Constant(ir.IntType(32), 1)])
        return context.get_dummy_value()

    return types.void(arr, types.int64), codegen


@numba.njit(**_JIT)
def _zeros(view):
    """How many elements of view are all-zero bits (a vectorized pass: counting them in
    the histogram's loop cost a quarter of its time)."""
    z = np.int64(0)
    for i in range(view.size):
        z += np.int64(view[i] == 0)
    return z


@numba.njit(**_JIT)
def _hist4_0(src, lo, a1, a2, a3, a4, hist):
    """:func:`_hist4` for stream 0, its layout all constants (a function of its own, so
    that the compiler cannot merge it with the general one: merged, the shifts were
    run-time values again)."""
    v0 = src[lo:lo + a1]
    v1 = src[lo + a1:lo + a2]
    v2 = src[lo + a2:lo + a3]
    v3 = src[lo + a3:lo + a4]
    h0 = np.zeros(256, dtype=np.int32)
    h1 = np.zeros(256, dtype=np.int32)
    h2 = np.zeros(256, dtype=np.int32)
    h3 = np.zeros(256, dtype=np.int32)
    m = min(min(v0.size, v1.size), min(v2.size, v3.size))
    ahead = lo + a4  # the next chunk: its lines arrive while this one is counted
    for i in range(m):
        _prefetch(src, ahead + 4 * i)
        h0[_sym0(v0[i])] += 1
        h1[_sym0(v1[i])] += 1
        h2[_sym0(v2[i])] += 1
        h3[_sym0(v3[i])] += 1
    for i in range(m, v0.size):
        h0[_sym0(v0[i])] += 1
    for i in range(m, v1.size):
        h1[_sym0(v1[i])] += 1
    for i in range(m, v2.size):
        h2[_sym0(v2[i])] += 1
    for i in range(m, v3.size):
        h3[_sym0(v3[i])] += 1
    for b in range(256):
        hist[0, b] = h0[b]
        hist[1, b] = h1[b]
        hist[2, b] = h2[b]
        hist[3, b] = h3[b]


@numba.njit(**_JIT)
def _lane_histograms(src, lo, hi, s, hist):
    """Fill hist (int64[4, 256]) with the bytes of stream s per lane, before any reference.

    Lane k holds elements [lo + k*n//4, lo + (k+1)*n//4) of src, n = hi - lo (a masked
    chunk is compacted first: see :func:`_compact`).
    """
    hist[:] = 0
    n = hi - lo
    a1 = n // _LANES
    a2 = 2 * n // _LANES
    a3 = 3 * n // _LANES
    if s == 0:  # stream 0 with constant layout: the hot case
        _hist4_0(src, lo, a1, a2, a3, n, hist)
    else:
        sh, _, top, ra, mask = _params(src, s, -1, 0)
        _hist4(src, lo, a1, a2, a3, n, sh, top, ra, mask, hist)


@numba.njit(**_JIT)
def _compact(src, kept):
    """Copy src's elements whose bits are not all zero to the front of kept; return how
    many (branch-free: half of a masked chunk's elements are zeros, unpredictably)."""
    j = 0
    for i in range(src.size):
        v = src[i]
        kept[j] = v
        j += np.int64(v != 0)
    return j


@numba.njit(**_JIT)
def _sample_zeros(bits, lo, hi):
    """All-zero elements among the strided sample that :func:`_chunk_ref` reads."""
    step = max(1, (hi - lo) // 256)
    z = 0
    for i in range(lo, hi, step):
        z += np.int64(bits[i] == 0)
    return z, (hi - lo + step - 1) // step


@numba.njit(**_JIT)
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
    seg = np.int64(_LANE_HEADER)
    for k in range(_LANES):
        bits = np.int64(0)
        for b in range(256):
            bits += hist[k, b] * np.int64(row[(b - sub) & 255])
        seg += (((bits + 7) // 8) + 7) & ~7
    return seg, best


@numba.njit(**_JIT)
def _size_stream(src, lo, hi, s, exp_shift, ref, lens, nbooks, hist, total):
    """(coded segment bytes, book of its group) of stream s over src[lo:hi]."""
    if nbooks == 1:  # summing code lengths beats a histogram (9 vs 11 ms / 64 MiB)
        return _segment_bytes(src, lo, hi, s, exp_shift, ref, lens[0]), 0
    _lane_histograms(src, lo, hi, s, hist)
    _, sub, _, _, _ = _params(src, s, exp_shift, ref)
    return _segment_plan(hist, sub, lens, nbooks, total)


@numba.njit(**_PJIT)
def plan_chunks(bits, chunk_elems, exp_shift, enc_len, nbooks, raw_stream, cflags, refs, books, sizes):
    """Choose each chunk's reference, zero handling, books and raw fallbacks; size its streams.

    Args:
        bits: element bits (typed as described in the module docstring).
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
        ref = _chunk_ref(bits, lo, hi, exp_shift)
        refs[c] = ref
        books[c] = 0
        hist = np.empty((_LANES, 256), dtype=np.int64)
        total = np.empty(256, dtype=np.int64)
        first = -1
        for s in range(ns):
            if not raw_stream[s]:
                first = s
                break
        # Unless the reference's sample saw zeros, the first coded stream is sized as if
        # there were no mask (while its elements come in: see _prefetch); a chunk that
        # then takes the mask is sized again.
        sz, sn = _sample_zeros(bits, lo, hi)
        early = first >= 0 and sz * 16 <= sn
        seg0 = np.int64(0)
        k0 = 0
        if early:
            seg0, k0 = _size_stream(bits, lo, hi, first, exp_shift, ref, enc_len[first], nbooks[first], hist, total)
        zeros = _zeros(bits[lo:hi])
        if zeros == count:
            cflags[c] = _CHUNK_ZERO
            for s in range(ns):
                sizes[c, s] = 0
            continue
        # The mask costs one bit per element: take it when the zeros cost more in the
        # streams (priced with each group's first book).
        zero_cost = 0
        for s in range(ns):
            sh, sub, top, ra, mask = _params(bits, s, exp_shift, ref)
            zero_cost += 8 if raw_stream[s] else enc_len[s, 0, _sym(0, sh, sub, top, ra, mask)]
        use_mask = zeros * zero_cost > count + 64
        present = count - zeros if use_mask else count
        flags = _CHUNK_MASK if use_mask else 0
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
                flags |= _CHUNK_RAW0 << s
                sizes[c, s] = present
            else:
                sizes[c, s] = seg
                chosen |= k << (4 * s)
        cflags[c] = flags
        books[c] = chosen


@numba.njit(**_JIT)
def _hash_words(words, start, nwords, seed):
    """Checksum of words[start:start+nwords]: four multiply-xor chains, then combined.

    Four chains (over words k = j mod 4) keep four multiplications in flight; one chain
    was bound by the multiply's latency (0.16 ns per bf16 element of encode time).
    """
    base = _HASH_SEED ^ np.uint64(seed)
    h0 = base
    h1 = base ^ np.uint64(1)
    h2 = base ^ np.uint64(2)
    h3 = base ^ np.uint64(3)
    view = words[start:start + nwords]
    q = view.size // 4
    for k in range(q):
        h0 = (h0 ^ view[4 * k]) * _HASH_MUL
        h1 = (h1 ^ view[4 * k + 1]) * _HASH_MUL
        h2 = (h2 ^ view[4 * k + 2]) * _HASH_MUL
        h3 = (h3 ^ view[4 * k + 3]) * _HASH_MUL
    r = view.size - 4 * q
    if r > 0:
        h0 = (h0 ^ view[4 * q]) * _HASH_MUL
    if r > 1:
        h1 = (h1 ^ view[4 * q + 1]) * _HASH_MUL
    if r > 2:
        h2 = (h2 ^ view[4 * q + 2]) * _HASH_MUL
    h = (((h0 ^ h1) * _HASH_MUL ^ h2) * _HASH_MUL ^ h3) * _HASH_MUL
    return np.uint32((h >> np.uint64(32)) ^ (h & np.uint64(0xFFFFFFFF)))


@numba.njit(inline="always", **_JIT)
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


@numba.njit(inline="always", **_JIT)
def _pack(view, sh, sub, top, ra, mask, codes, lens, out64, w):
    """Bit-pack one stream of view LSB-first into out64 from word w; return bits.

    Three symbols are joined before they are appended (at most 3 x 20 bits, so one
    accumulator step still suffices): joining two took 0.50 -> 0.43 ns per symbol, three
    the encode pass over 32 MiB of bf16 gradients 14.8 -> 13.0 ms.
    """
    acc = _U64_0
    nb = 0
    total = 0
    n = view.size
    for k in range(n // 3):
        s0 = _sym(view[3 * k], sh, sub, top, ra, mask)
        s1 = _sym(view[3 * k + 1], sh, sub, top, ra, mask)
        s2 = _sym(view[3 * k + 2], sh, sub, top, ra, mask)
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
        s0 = _sym(view[i], sh, sub, top, ra, mask)
        ln = np.int64(lens[s0])
        total += ln
        acc, nb, w = _emit(acc, nb, w, np.uint64(codes[s0]), ln, out64)
    if nb > 0:
        out64[w] = acc
    return total


@numba.njit(**_JIT)
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
        _prefetch(view, 4 * n + 3 * k)
        s0 = _sym0(view[3 * k])
        s1 = _sym0(view[3 * k + 1])
        s2 = _sym0(view[3 * k + 2])
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
        s0 = _sym0(view[i])
        acc, nb, w = _emit(acc, nb, w, np.uint64(codes[s0]), np.int64(lens[s0]), out64)
    if nb > 0:
        out64[w] = acc
    return 64 * (w - w0) + nb


@numba.njit(**_JIT)
def _put_u32(out8, pos, value):
    for k in range(4):
        out8[pos + k] = (value >> (8 * k)) & 255


@numba.njit(**_JIT)
def _get_u32(buf8, pos):
    return (np.int64(buf8[pos]) | (np.int64(buf8[pos + 1]) << 8)
            | (np.int64(buf8[pos + 2]) << 16) | (np.int64(buf8[pos + 3]) << 24))


@numba.njit(**_JIT)
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


@numba.njit(**_JIT)
def _write_raw(src, s, exp_shift, ref, out8, pos, size):
    """Write stream s of src uncoded at pos, zero-padded to 8 bytes."""
    sh, sub, top, ra, mask = _params(src, s, exp_shift, ref)
    count = src.size
    dst = out8[pos:pos + ((size + 7) & ~7)]
    for i in range(count):
        dst[i] = _sym(src[i], sh, sub, top, ra, mask)
    for k in range(count, dst.size):
        dst[k] = 0


@numba.njit(**_JIT)
def _write_segment(src, s, exp_shift, ref, codes, lens, out8, out64, pos):
    """Write stream s of src as a coded segment (lane lengths, then lanes) at pos."""
    count = src.size
    wpos = pos + _LANE_HEADER
    # Each branch gets its own copy of the packer; for stream 0 the layout is all
    # constants and the reference is folded into rotated tables.
    if s == 0:
        sh, sub, top, ra, mask = _params(src, 0, exp_shift, ref)
        rcodes = _rotated(codes, sub)
        rlens = _rotated(lens, sub)
        for k in range(_LANES):
            view = src[k * count // _LANES: (k + 1) * count // _LANES]
            nbytes = (_pack0(view, rcodes, rlens, out64, wpos // 8) + 7) // 8
            _put_u32(out8, pos + 4 * k, nbytes)
            wpos += (nbytes + 7) & ~7
    else:
        sh, sub, top, ra, mask = _params(src, s, exp_shift, ref)
        for k in range(_LANES):
            view = src[k * count // _LANES: (k + 1) * count // _LANES]
            nbytes = (_pack(view, sh, sub, top, ra, mask, codes, lens, out64, wpos // 8) + 7) // 8
            _put_u32(out8, pos + 4 * k, nbytes)
            wpos += (nbytes + 7) & ~7


@numba.njit(**_JIT)
def _encode_chunk(src, c, flags, ref, chosen, sizes, pos, exp_shift, enc_code, enc_len, out8, out64):
    """Write one chunk's payload from byte pos; return the end position."""
    if flags & _CHUNK_ZERO:
        return pos
    if flags & _CHUNK_MASK:
        pos = _write_mask(src, out8, pos)
        kept = np.empty(src.size, dtype=src.dtype)
        src = kept[:_compact(src, kept)]
    for s in range(enc_len.shape[0]):
        size = np.int64(sizes[c, s])
        if flags & (_CHUNK_RAW0 << s):
            _write_raw(src, s, exp_shift, ref, out8, pos, size)
        else:
            k = (chosen >> (4 * s)) & 15
            _write_segment(src, s, exp_shift, ref, enc_code[s, k], enc_len[s, k], out8, out64, pos)
        pos += (size + 7) & ~7
    return pos


@numba.njit(**_PJIT)
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
        checksums[c] = _hash_words(out64, start, end // 8 - start, c) if do_checksum else 0


@numba.njit(inline="always", **_JIT)
def _peek(words, base, nwords, pos):
    """64 bits of a lane from bit pos; bits past the lane's last word read as zero."""
    w = pos >> 6
    off = np.uint64(pos & 63)
    lo = words[base + w] if w < nwords else _U64_0
    hi = words[base + w + 1] if w + 1 < nwords else _U64_0
    return (lo >> off) | ((hi << np.uint64(1)) << (np.uint64(63) - off))


@numba.njit(inline="always", **_JIT)
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


@numba.njit(**_JIT)
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
            e = np.int64(dec[bits & 4095])
            ln = (e >> 8) & 15
            if e >= 0x8000 or ln == 0 or ln > avail:
                break
            entry |= (e & 255) << (8 + 8 * n)
            total += ln
            bits >>= ln
            avail -= ln
            n += 1
        multi[x] = (entry | total | (n << 56)) if n else 0


@intrinsic
def _store8(typingctx, arr, i, value):
    """Store the 8 bytes of value at arr[i:i+8] (uint8 array, any alignment); the
    caller guarantees i + 8 <= arr.size. One store instead of eight byte stores."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.uint8):
        return None

    def codegen(context, builder, signature, args):
        ary, index, val = args
        base = context.make_array(signature.args[0])(context, builder, ary).data
        ptr = builder.gep(base, [index])
        word = builder.bitcast(ptr, ir.IntType(64).as_pointer())
        builder.store(val, word, align=1)
        return context.get_dummy_value()

    return types.void(arr, types.int64, types.int64), codegen


@numba.njit(inline="always", **_JIT)
def _multi_step(buf, multi, dec, dst, i):
    """Decode up to six symbols from buf into dst[i:i+8]: (symbols done, bits used).

    Always writes eight bytes (the caller leaves room): slots past the symbols decoded
    are rewritten by the next step. Symbols are the codes' own bytes; stream 0's
    reference is added when the element is assembled.
    """
    e = np.int64(multi[np.int64(buf & _MULTI_MASK)])
    if e != 0:
        _store8(dst, i, e >> 8)
        return (e >> 56) & 7, e & 63
    sym, ln = _step(buf, dec)
    if ln == 0:
        return 0, 0
    dst[i] = sym
    return 1, ln


@numba.njit(**_JIT)
def _lane_rest(words, base, nwords, pos, multi, dec, dst, i, end):
    """Decode dst[i:end] of one lane, three steps per refill while 20 slots remain."""
    while i + 20 <= end:  # 3 steps of up to 6 symbols, each writing 8 bytes
        b = _peek(words, base, nwords, pos)
        for r in range(3):
            n, ln = _multi_step(b, multi, dec, dst, i)
            if ln == 0:
                return _ST_BAD_CODE, pos
            b >>= np.uint64(ln)
            pos += ln
            i += n
    while i < end:  # one symbol per refill
        sym, ln = _step(_peek(words, base, nwords, pos), dec)
        if ln == 0:
            return _ST_BAD_CODE, pos
        pos += ln
        dst[i] = sym
        i += 1
    return STATUS_OK, pos


@intrinsic
def _address(typingctx, arr):
    """The address of arr's first element, as an integer (for the raw loads below)."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))

    return types.int64(arr), codegen


def _raw_load(bits):
    def typer(typingctx, addr):
        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
            return builder.load(ptr, align=1)

        return getattr(types, f"uint{bits}")(types.int64), codegen

    return intrinsic(typer)


# Loads at raw addresses in the decoder's fast loop. Passing arrays into its inlined
# steps made numba count references on every step (an NRT call per symbol: 17x slower);
# integers are free. The loop's bounds are established before it runs (see
# _decode_lanes); only aligned-or-not loads and stores of in-bounds bytes happen here.
_ld64 = _raw_load(64)
_ld16 = _raw_load(16)


@intrinsic
def _st64(typingctx, addr, value):
    """Store the 8 bytes of value at address addr (any alignment)."""
    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        builder.store(args[1], ptr, align=1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def _st8(typingctx, addr, value):
    """Store the low byte of value at address addr."""
    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        builder.store(builder.trunc(args[1], ir.IntType(8)), ptr, align=1)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def _prefetch_at(typingctx, addr, write):
    """Ask for the cache line at address addr (write: for writing) to be brought into
    L2; a hint that never faults, so addr may lie outside any buffer."""
    if not isinstance(write, types.IntegerLiteral):
        return None
    rw = write.literal_value

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(
            ir.VoidType(), [ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(32), ir.IntType(32)]))
        builder.call(fn, [ptr, ir.Constant(ir.IntType(32), rw), ir.Constant(ir.IntType(32), 2),
                          ir.Constant(ir.IntType(32), 1)])
        return context.get_dummy_value()

    return types.void(types.int64, write), codegen


@numba.njit(inline="always", **_JIT)
def _window(f, p):
    """At least 57 bits of the frame at address f from bit p on (the caller bounds p)."""
    return _ld64(f + (p >> 3)) >> np.uint64(p & 7)


@numba.njit(**_JIT)
def _slow_step(f, p, d, dec):
    """One symbol at bit p with the plain table at address dec, stored at address d:
    (bits used, 0 = no such code). Off the fast path (escapes), so not inlined."""
    w = _window(f, p)
    x = np.int64(_ld16(dec + 2 * np.int64(w & _DEC_MASK)))
    ln = (x >> 8) & 15
    sym = x & 255
    if x >= 0x8000 and ln != 0:  # escape: the symbol's 8 bits follow its code
        sym = np.int64(w >> np.uint64(ln)) & 255
        ln += 8
    _st8(d, sym)
    return ln


@numba.njit(inline="always", **_JIT)
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
    e = _ld64(multi + 8 * np.int64(b & _MULTI_MASK))
    if e != _U64_0:
        _st64(d, np.int64(e >> np.uint64(8)))
        ln = np.int64(e) & 63  # the mask folds into the shift instruction
        return b >> np.uint64(ln), p + ln, d + (np.int64(e >> np.uint64(56)) & 7)
    ln = _slow_step(f, p, d, dec)
    p += ln
    return _window(f, p), p, d + np.int64(ln != 0)


@numba.njit(**_JIT)
def _decode_lanes(frame8, frame64, pos, size, count, dec, multi, dst, pf_in, pf_in_end, pf_out, pf_out_end):
    """Decode one coded segment (4 lanes) of count symbols into dst (uint8); return status.

    While it decodes (bound by its lookups, not by memory) it asks for the addresses
    [pf_in, pf_in_end) and [pf_out, pf_out_end) to be brought into cache, 2 and 4 lines
    a round (a round makes ~64 symbols; 6 and 12 lines for fp32 were slower): the bytes that the assembly of the chunk reads next (its raw streams) and the
    output it writes (read for ownership first). Hints only: any addresses are safe.
    """
    if size < _LANE_HEADER:
        return _ST_SIZE
    lb0 = _get_u32(frame8, pos)
    lb1 = _get_u32(frame8, pos + 4)
    lb2 = _get_u32(frame8, pos + 8)
    lb3 = _get_u32(frame8, pos + 12)
    n0 = (lb0 + 7) // 8
    n1 = (lb1 + 7) // 8
    n2 = (lb2 + 7) // 8
    n3 = (lb3 + 7) // 8
    if _LANE_HEADER + 8 * (n0 + n1 + n2 + n3) != size:
        return _ST_SIZE
    w0 = (pos + _LANE_HEADER) // 8
    w1 = w0 + n0
    w2 = w1 + n1
    w3 = w2 + n2
    e0 = count // _LANES
    e1 = 2 * count // _LANES
    e2 = 3 * count // _LANES
    e3 = count
    i0 = np.int64(0)
    i1 = e0
    i2 = e1
    i3 = e2
    # Fast loop on absolute bit positions of the frame. A round reads each lane's next
    # 57+ bits with one unaligned load and takes 4 steps from each (up to 6 symbols and
    # 12 bits a step; an escape reloads). Instead of checking every round, run as many
    # rounds as no lane can go wrong in: 24 symbols a round, and the 8-byte store of the
    # last step (from up to 18 symbols in), must fit before the lane's end, and 4 x 20 bits (4 escapes) a round must leave an 8-byte read inside the
    # frame. Valid lanes never read past their own end there; a corrupt one may read its
    # neighbour's bits and then fails the overrun check below.
    if multi.size != _MULTI_SIZE or dec.size != 4096 or dst.size < count:  # the codec's tables; trust nothing
        return _ST_BOOK
    f = _address(frame8)
    mt = _address(multi)
    dt = _address(dec)
    d0 = _address(dst)
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
            _prefetch_at(pf_in, 0)
            _prefetch_at(pf_in + 64, 0)
            _prefetch_at(pf_out, 1)
            _prefetch_at(pf_out + 64, 1)
            _prefetch_at(pf_out + 128, 1)
            _prefetch_at(pf_out + 192, 1)
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
        return _ST_OVERRUN
    st, p0 = _lane_rest(frame64, w0, n0, p0, multi, dec, dst, i0, e0)
    if st == STATUS_OK:
        st, p1 = _lane_rest(frame64, w1, n1, p1, multi, dec, dst, i1, e1)
    if st == STATUS_OK:
        st, p2 = _lane_rest(frame64, w2, n2, p2, multi, dec, dst, i2, e2)
    if st == STATUS_OK:
        st, p3 = _lane_rest(frame64, w3, n3, p3, multi, dec, dst, i3, e3)
    if st == STATUS_OK and (p0 > 8 * lb0 or p1 > 8 * lb1 or p2 > 8 * lb2 or p3 > 8 * lb3):
        return _ST_OVERRUN
    return st


@numba.njit(inline="always", **_JIT)
def _element(v0, v1, v2, v3, j, add, width, ra):
    """The element whose stream bytes are v0[j], v1[j], ...: stream 0 plus add (mod 256),
    the streams joined most significant first, rotated back (sign from bit 0)."""
    x = (np.int64(v0[j]) + add) & 255
    if width >= 2:
        x = (x << 8) | np.int64(v1[j])
    if width == 4:
        x = (((x << 8) | np.int64(v2[j])) << 8) | np.int64(v3[j])
    if ra:
        x = (x >> 1) | ((x & 1) << (8 * width - 1))
    return x


@numba.njit(**_JIT)
def _assemble(v0, v1, v2, v3, present, add, dst):
    """dst[i] = the element of the streams' bytes i, for i < present: one vectorizable pass."""
    width, ra, _ = _layout(dst)
    for i in range(present):
        dst[i] = _element(v0, v1, v2, v3, i, add, width, ra)


@numba.njit(**_JIT)
def _assemble_masked(v0, v1, v2, v3, present, add, frame8, mpos, out):
    """out[i] = the next of the present elements (streams' bytes 0..present-1) where bit
    i of the mask at frame8[mpos] is set, else 0.

    Two passes: the present elements are built densely into a scratch row (the
    vectorized :func:`_assemble`), then spread out by the mask a byte at a time,
    branch-free: each element takes the next dense one multiplied by its bit (the
    scratch row holds a zero one past the last, so nothing past the streams' bytes is
    read even where a raw stream ends the frame). An all-zero mask byte (zeros come in runs in many
    gradients) stores 8 zeros. Element by element with a select (``if bit``, and even
    ``& -bit``), LLVM emitted a branch that mispredicted on half-zero gradients.
    """
    dense = np.empty(present + 1, dtype=out.dtype)
    _assemble(v0, v1, v2, v3, present, add, dense)
    dense[present] = 0
    j = np.int64(0)
    n = out.size
    for q in range(n >> 3):
        m = np.int64(frame8[mpos + q])
        base = 8 * q
        if m == 0:
            for t in range(8):
                out[base + t] = 0
            continue
        for t in range(8):
            bit = (m >> t) & 1
            out[base + t] = dense[j] * bit
            j += bit
    for i in range(n & ~7, n):
        bit = (np.int64(frame8[mpos + (i >> 3)]) >> (i & 7)) & 1
        out[i] = dense[j] * bit
        j += bit


@numba.njit(**_JIT)
def _decode_chunk(frame8, frame64, pos, count, flags, ref, chosen, sizes_c, exp_shift, dec_tables, multi, out):
    """Decode one chunk's payload at pos into out (count elements); return a status.

    Coded streams are decoded into byte rows of a scratch array; raw streams are read
    where they lie in the frame; then one pass (:func:`_assemble`) builds the elements.
    """
    if flags & _CHUNK_ZERO:
        out[:] = 0
        return STATUS_OK
    mpos = pos
    present = count
    if flags & _CHUNK_MASK:
        mbytes = (count + 7) // 8
        present = 0
        for k in range(mbytes):
            byte = np.int64(frame8[pos + k])
            if k == mbytes - 1 and count % 8:
                byte &= (1 << (count % 8)) - 1
            # branch-free popcount: a loop over the set bits mispredicted once a byte
            # (0.7 ns per element of a half-zero chunk)
            byte -= (byte >> 1) & 0x55
            byte = (byte & 0x33) + ((byte >> 2) & 0x33)
            present += (byte + (byte >> 4)) & 0x0F
        pos += (mbytes + 7) & ~7
    ns = sizes_c.size
    # + 1: a masked chunk's assembly may index one past its last present element (and
    # then skips the read); raw rows get the same slack from the frame's padding.
    rows = np.empty((ns, present + 1), dtype=np.uint8)
    v0 = rows[0]
    v1 = rows[min(1, ns - 1)]
    v2 = rows[min(2, ns - 1)]
    v3 = rows[min(3, ns - 1)]
    # What the coded streams' decoding prefetches: the rest of the chunk's payload (raw
    # streams) and the output.
    pf_end = _address(frame8) + pos
    for s in range(ns):
        pf_end += (np.int64(sizes_c[s]) + 7) & ~7
    pf_out = _address(out)
    pf_out_end = pf_out + out.size * out.itemsize
    for s in range(ns):
        size = np.int64(sizes_c[s])
        pf_in = _address(frame8) + pos + size
        if flags & (_CHUNK_RAW0 << s):
            if size != present:
                return _ST_MASK_COUNT if flags & _CHUNK_MASK else _ST_SIZE
            view = frame8[pos:pos + present + 1]  # decode_chunks checked the chunk's end
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
                return _ST_BOOK
            st = _decode_lanes(frame8, frame64, pos, size, present, dec_tables[s, k], multi[s, k], rows[s],
                               pf_in, pf_end, pf_out, pf_out_end)
            if st != STATUS_OK:
                return st
        pos += (size + 7) & ~7
    add = (np.int64(ref) << exp_shift) if exp_shift >= 0 else np.int64(0)
    if flags & _CHUNK_MASK:
        _assemble_masked(v0, v1, v2, v3, present, add, frame8, mpos, out)
    else:
        _assemble(v0, v1, v2, v3, present, add, out)
    return STATUS_OK


@numba.njit(**_JIT)
def _decode_one(c, frame8, frame64, numel, chunk_elems, exp_shift, dec_tables, multi, cflags, refs, books, sizes,
                offsets, checksums, do_checksum, out):
    """Decode chunk c into out (its count elements); return its status."""
    lo = c * chunk_elems
    count = min(numel, lo + chunk_elems) - lo
    flags = cflags[c]
    pos = offsets[c]
    length = (((count + 7) // 8) + 7) & ~7 if flags & _CHUNK_MASK else 0
    for s in range(sizes.shape[1]):
        length += (np.int64(sizes[c, s]) + 7) & ~7
    if pos < 0 or pos % 8 or pos + length > frame8.size or out.size != count:  # checked above us; trust nothing
        return _ST_SIZE
    st = _decode_chunk(frame8, frame64, pos, count, flags, np.int64(refs[c]), np.int64(books[c]),
                       sizes[c], exp_shift, dec_tables, multi, out)
    # Checked after decoding (the kernels are safe on any bytes): the decode streams
    # the payload in from memory while it computes, and the hash then reads it from
    # cache. Hashing first made the hash wait for memory (bf16 weights, 1 thread:
    # the checksum cost 3.4 ms of a 20.5 ms kernel, 1.5 ms on a cached payload).
    if do_checksum and _hash_words(frame64, pos // 8, length // 8, c) != checksums[c]:
        st = _ST_CHECKSUM
    return st


@numba.njit(**_PJIT)
def decode_chunks(frame8, frame64, numel, chunk_elems, exp_shift, dec_tables, multi, cflags, refs, books, sizes,
                  offsets, checksums, do_checksum, out, status):
    """Decode every chunk into out; status[c] gets a code per chunk (0 = ok).

    Args:
        frame8, frame64: the frame as uint8 and uint64 (same memory, 8-byte aligned).
        numel, chunk_elems, exp_shift: frame parameters.
        dec_tables: uint16[nstreams, nbooks_max, 4096] decode tables (unused rows for raw
            streams).
        multi: uint64[nstreams, nbooks_max, 4096] from :func:`multi_tables`.
        cflags, refs, books, sizes, offsets, checksums: the parsed chunk table (checked
            for consistency with the frame length, and books against the group sizes,
            by the Python layer).
        do_checksum: verify checksums.
        out: element bits output, typed as ``bits`` in :func:`plan_chunks`.
        status: int32[nchunks] output.
    """
    for c in prange(cflags.size):
        lo = c * chunk_elems
        hi = min(numel, lo + chunk_elems)
        status[c] = _decode_one(c, frame8, frame64, numel, chunk_elems, exp_shift, dec_tables, multi, cflags, refs,
                                books, sizes, offsets, checksums, do_checksum, out[lo:hi])


# -- decode and accumulate into float32 ------------------------------------------------------
_QUIET = np.uint32(0x00400000)
_ABS = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)


@intrinsic
def _as_f32(typingctx, bits):
    """The float32 whose bits are the low 32 bits of the integer bits (numba widens
    uint32 arithmetic to 64 bits)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = args[0] if bits.bitwidth == 32 else builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_bits(typingctx, x):
    """The bits of the float32 x, as a uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@numba.njit(inline="always", **_JIT)
def _add_f32(a, b):
    """Bits of float32(a) + float32(b) (both given as bits), NaNs as torch's CPU add gives them.

    IEEE leaves which NaN a sum of NaNs carries to the hardware and the instruction's
    operand order; torch's ``acc.add_(x)`` gives x's NaN (quieted) when x is one, else
    acc's (seen on x86, vectorized and scalar tails alike). Choosing it here explicitly
    keeps the result independent of how LLVM orders the add.
    """
    r = _f32_bits(_as_f32(a) + _as_f32(b))
    if (a & _ABS) > _INF_BITS:
        r = a | _QUIET
    if (b & _ABS) > _INF_BITS:
        r = b | _QUIET
    return r


@numba.njit(inline="always", **_JIT)
def _half_bits_f32(h):
    """float32 bits of the fp16 bits h: exact; a NaN keeps its sign and payload and is
    quieted (what the hardware conversion gives, and torch's vectorized one; torch's
    scalar loop tail makes every NaN 0x7FFFFFFF instead)."""
    sign = np.uint32(h >> 15) << np.uint32(31)
    e = (np.uint32(h) >> np.uint32(10)) & np.uint32(31)
    m = np.uint32(h) & np.uint32(1023)
    r = sign | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))
    if e == 0:  # zero or subnormal: m * 2**-24, exact in float32
        r = sign | _f32_bits(np.float32(m) * np.float32(5.9604644775390625e-08))
    if e == 31:
        r = (sign | _INF_BITS) if m == 0 else (sign | _INF_BITS | _QUIET | (m << np.uint32(13)))
    return r


@numba.njit(**_JIT)
def _accumulate(bits, acc, half, add):
    """acc[i] (float32 bits) += the float32 value of element bits[i] (or = it, add False).

    bits are as :func:`decode_chunks` writes them: uint16 for bf16 (half False) and fp16
    (half True), uint32 for fp32. Widening is exact, so the sum is the one of widening
    first and adding then, bit for bit (see :func:`_add_f32` for NaNs).
    """
    width, _, _ = _layout(bits)
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


@numba.njit(**_PJIT)
def decode_accumulate_chunks(frame8, frame64, numel, chunk_elems, exp_shift, dec_tables, multi, cflags, refs, books,
                             sizes, offsets, checksums, do_checksum, proto, half, acc, add, status):
    """Decode every chunk and add its elements, widened to float32, into acc (or assign them).

    Each chunk is decoded into a scratch chunk (it stays in L1/L2) and then added, so the
    decoded tensor never exists in memory: one pass over acc instead of a decode, a
    widening copy and an add. A chunk whose status is not 0 leaves its part of acc
    untouched.

    Args:
        frame8 ... do_checksum: as for :func:`decode_chunks`.
        proto: an empty array of the element bits' type (uint16 or uint32).
        half: the frame holds fp16 (its uint16 bits widen differently from bf16's).
        acc: uint32[numel], the float32 accumulator's bits (updated in place).
        add: True: acc += value; False: acc = value.
        status: int32[nchunks] output.
    """
    for c in prange(cflags.size):
        lo = c * chunk_elems
        hi = min(numel, lo + chunk_elems)
        scratch = np.empty(hi - lo, dtype=proto.dtype)
        st = _decode_one(c, frame8, frame64, numel, chunk_elems, exp_shift, dec_tables, multi, cflags, refs, books,
                         sizes, offsets, checksums, do_checksum, scratch)
        status[c] = st
        if st == STATUS_OK and hi <= acc.size:
            _accumulate(scratch, acc[lo:hi], half, add)


@numba.njit(**_JIT)
def multi_tables(dec_tables, multi):
    """Fill multi (uint64[ns, nbooks, 4096]) from dec_tables (uint16[ns, nbooks, 4096]).

    Built once per set of books (the codec caches them): ~4096 lookups per book.
    """
    for s in range(dec_tables.shape[0]):
        for k in range(dec_tables.shape[1]):
            _multi_table(dec_tables[s, k], multi[s, k])


@numba.njit(**_PJIT)
def chunk_histograms(bits, chunk_elems, exp_shift, streams, local, zeros):
    """Fill local[c, j] with the symbol counts of stream streams[j] in chunk c, zeros[c] with its zeros.

    Symbols are formed exactly as the encoder forms them: per-chunk reference exponent
    for stream 0. Exact zeros are counted where the encoder will code them, in chunks
    with at most 1/8 zeros, and left out where it will mostly mask them (a zero costs
    9+ bits in a float's streams, so the one-bit-per-element mask pays above ~1/9).
    Streams not listed cost nothing (a checkpoint's planner skips the mantissa bytes it
    will store raw).

    Args:
        bits, chunk_elems, exp_shift: as for :func:`plan_chunks`.
        streams: int64[k], the streams to count (each in 0..nstreams-1; others are skipped).
        local: int64[nchunks, k, 256] output (overwritten).
        zeros: int64[nchunks] output.
    """
    n = bits.size
    width, _, _ = _layout(bits)
    for c in prange(local.shape[0]):
        lo = c * chunk_elems
        hi = min(n, lo + chunk_elems)
        ref = _chunk_ref(bits, lo, hi, exp_shift)
        chunk = bits[lo:hi]
        quads = chunk.size // 4
        for j in range(streams.size):
            s = streams[j]
            h = local[c, j]
            h[:] = 0
            if s < 0 or s >= width:  # the Python layer checks; trust nothing
                continue
            sh, sub, top, ra, mask = _params(bits, s, exp_shift, ref)
            # Four partial histograms: exponent symbols repeat, and with one histogram
            # each increment waits for the previous one to the same counter (measured
            # 1.01 -> 0.83 ns per bf16 element).
            h0 = np.zeros(256, dtype=np.int64)
            h1 = np.zeros(256, dtype=np.int64)
            h2 = np.zeros(256, dtype=np.int64)
            h3 = np.zeros(256, dtype=np.int64)
            for q in range(quads):
                i = 4 * q
                h0[_sym(chunk[i], sh, sub, top, ra, mask)] += 1
                h1[_sym(chunk[i + 1], sh, sub, top, ra, mask)] += 1
                h2[_sym(chunk[i + 2], sh, sub, top, ra, mask)] += 1
                h3[_sym(chunk[i + 3], sh, sub, top, ra, mask)] += 1
            for i in range(4 * quads, chunk.size):
                h0[_sym(chunk[i], sh, sub, top, ra, mask)] += 1
            for k in range(256):
                h[k] = h0[k] + h1[k] + h2[k] + h3[k]
        # Exact zeros were counted under their symbols above; take them out again.
        z = _zeros(chunk)
        zeros[c] = z
        if z * 8 > chunk.size:
            for j in range(streams.size):
                s = streams[j]
                if 0 <= s < width:
                    sh, sub, top, ra, mask = _params(bits, s, exp_shift, ref)
                    local[c, j, _sym(0, sh, sub, top, ra, mask)] -= z


@numba.njit(**_JIT)
def huffman_costs(rows, out):
    """out[r] = bits of an optimal (unlimited-length) Huffman code of counts rows[r].

    The cost of an optimal code is the sum of its internal nodes' weights, the same for
    every optimal code whatever its ties, so this is exact and deterministic: two
    queues (sorted leaves, merged nodes in creation order, which are sorted too). One
    symbol alone costs one bit each.
    """
    for r in range(rows.shape[0]):
        leaves = np.sort(rows[r][rows[r] > 0])
        n = leaves.size
        if n == 0:
            out[r] = 0
            continue
        if n == 1:
            out[r] = leaves[0]
            continue
        nodes = np.empty(n, dtype=np.int64)
        i = 0
        head = 0
        tail = 0
        cost = np.int64(0)
        for _ in range(n - 1):
            pair = np.int64(0)
            for _k in range(2):
                if i < n and (head >= tail or leaves[i] <= nodes[head]):
                    pair += leaves[i]
                    i += 1
                else:
                    pair += nodes[head]
                    head += 1
            nodes[tail] = pair
            tail += 1
            cost += pair
        out[r] = cost


@numba.njit(**_JIT)
def package_merge(weights, limit):
    """Optimal code lengths (<= limit) for weights sorted ascending; int32[n] by rank.

    Package-merge (Larmore & Hirschberg) without carrying a leaf-count vector per item:
    each level's list keeps only "leaf or package" flags, because the items a solution
    selects are a prefix of every level's list (the first 2n-2 of the last; the children
    of the p packages selected at one level are the first 2p items of the level below),
    and leaves appear in each list in rank order. Ties merge leaves before packages and
    keep each list's own order, which makes the lengths a function of the weights alone.
    """
    n = weights.size
    lengths = np.zeros(n, dtype=np.int32)
    if n == 1:
        lengths[0] = 1
        return lengths
    is_pkg = np.zeros((limit, 2 * n), dtype=np.bool_)
    sizes = np.zeros(limit, dtype=np.int64)
    cur = weights.copy()
    sizes[0] = n
    for level in range(1, limit):
        npk = sizes[level - 1] // 2
        merged = np.empty(n + npk, dtype=np.int64)
        i = 0
        k = 0
        out = 0
        while i < n or k < npk:
            if k >= npk or (i < n and weights[i] <= cur[2 * k] + cur[2 * k + 1]):
                merged[out] = weights[i]
                i += 1
            else:
                merged[out] = cur[2 * k] + cur[2 * k + 1]
                is_pkg[level, out] = True
                k += 1
            out += 1
        cur = merged
        sizes[level] = n + npk
    take = 2 * n - 2
    for level in range(limit - 1, -1, -1):
        leaves = 0
        pkgs = 0
        for j in range(take):
            if is_pkg[level, j]:
                pkgs += 1
            else:
                leaves += 1
        for r in range(leaves):
            lengths[r] += 1
        take = 2 * pkgs
    return lengths
