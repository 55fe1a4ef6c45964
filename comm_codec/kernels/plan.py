"""numba kernels for the checkpoint planner: byte histograms of sampled chunks, chunk references.

Arrays in, a status out (:data:`~comm_codec.kernels.layout.STATUS_OK` or
:data:`~comm_codec.kernels.layout.STATUS_BAD_ARGS`, one per call).
:mod:`comm_codec.checkpoint.plan` samples whole chunks of a tensor and wants, per chunk
size it weighs (64 Ki and 256 Ki elements), the symbol counts the encoder would see.
Symbols of stream 0 depend on the chunk's reference exponent, the rest do not, so one
pass suffices: the histograms of the *bytes* (before any reference) of every sampled
64 Ki piece, the pieces' all-zero element counts, and the references of the chunks of
each size (:func:`chunk_refs`); the counts of a chunk made of several pieces are the
sums of its pieces' histograms, stream 0's rotated by the chunk's reference
(:func:`chunk_rows`). Streams that can only end up raw get a sparse look (every 16th
element) instead of a full histogram, and the look decides it in the same call
(:func:`count_pieces`). The planner makes one call, :func:`count_chunks`, which runs
these steps for both chunk sizes (apart, the calls and their scratch arrays cost as much
as counting a small tensor); the steps stay callable alone, and are tested so. The
histograms may count every k-th element of each piece only (a book
fitted to a quarter of a tensor's elements codes it as well as one fitted to all of
them), for a fraction of the counting.

Element bits are typed as :mod:`comm_codec.kernels.layout` describes.
"""

from __future__ import annotations

import numpy as np

from .jit import entry, inline, jit
from .layout import MIN_SAVING_SHIFT, STATUS_BAD_ARGS, STATUS_OK
from .symbols import count_zeros, element_layout, symbol, symbol0

__all__ = [
    "count_pieces",
    "chunk_refs",
    "chunk_rows",
    "count_chunks",
    "chunks_alike",
    "price_stream",
    "STATUS_OK",
    "STATUS_BAD_ARGS",
]


@inline
def _entropy(row):
    """Shannon entropy in bits per symbol of 256 counts: ``log2(n) - sum(c log2 c) / n``
    over their n symbols (0 for none; floored at 0 against rounding)."""
    n = np.int64(0)
    acc = 0.0
    for b in range(256):
        k = row[b]
        n += k
        if k > 1:
            acc += np.float64(k) * np.log2(np.float64(k))
    m = np.float64(max(n, np.int64(1)))
    return max(np.log2(m) - acc / m, 0.0)


@jit
def _check_pieces(bits, starts, lengths):
    if starts.size != lengths.size:
        return False
    for k in range(starts.size):
        if starts[k] < 0 or lengths[k] < 0 or starts[k] + lengths[k] > bits.size:
            return False
    return True


@jit
def _count_stream0(piece, out):
    """out[b] = elements of piece whose stream-0 byte is b; return the all-zero elements.

    Stream 0's layout folded into constants (:func:`symbol0`), four tables counting four
    quarters of the piece side by side (consecutive increments of one counter would each
    wait for the last: exponent bytes repeat), zeros in a vectorized pass of their own
    where byte 0 occurs at all.
    A function of its own, so that the compiler does not merge it with the general loop
    (merged, the shifts were run-time values again).
    """
    q = piece.size // 4
    v0 = piece[:q]
    v1 = piece[q : 2 * q]
    v2 = piece[2 * q : 3 * q]
    v3 = piece[3 * q :]
    h0 = np.zeros(256, dtype=np.int32)
    h1 = np.zeros(256, dtype=np.int32)
    h2 = np.zeros(256, dtype=np.int32)
    h3 = np.zeros(256, dtype=np.int32)
    for i in range(q):
        h0[symbol0(v0[i])] += 1
        h1[symbol0(v1[i])] += 1
        h2[symbol0(v2[i])] += 1
        h3[symbol0(v3[i])] += 1
    for i in range(q, v3.size):
        h3[symbol0(v3[i])] += 1
    for b in range(256):
        out[b] = np.int64(h0[b]) + h1[b] + h2[b] + h3[b]
    # An all-zero element has stream-0 byte 0 (every type's symbol0(0) is 0): with no
    # such byte there is none, and trained weights seldom have one.
    return count_zeros(piece) if out[0] else np.int64(0)


@jit
def _count_stream0_every(piece, every, out):
    """:func:`_count_stream0` of piece's elements 0, every, 2 * every, ...; return the
    all-zero elements among them.

    Four tables again, taking the counted elements in turn (with a stride there is
    nothing for the loads to vectorize, so they need not be quarters).
    """
    m = (piece.size + every - 1) // every  # elements counted
    q = m // 4
    h0 = np.zeros(256, dtype=np.int32)
    h1 = np.zeros(256, dtype=np.int32)
    h2 = np.zeros(256, dtype=np.int32)
    h3 = np.zeros(256, dtype=np.int32)
    for k in range(q):
        i = 4 * k * every
        h0[symbol0(piece[i])] += 1
        h1[symbol0(piece[i + every])] += 1
        h2[symbol0(piece[i + 2 * every])] += 1
        h3[symbol0(piece[i + 3 * every])] += 1
    for j in range(4 * q, m):
        h0[symbol0(piece[j * every])] += 1
    for b in range(256):
        out[b] = np.int64(h0[b]) + h1[b] + h2[b] + h3[b]
    z = np.int64(0)
    if out[0]:  # as in _count_stream0: without a stream-0 byte 0 there is no zero element
        for i in range(0, piece.size, every):
            z += np.int64(piece[i] == 0)
    return z


@jit
def _count(piece, stream, step, out):
    """out[b] = elements of piece (every step-th) whose byte of ``stream`` is b; return
    the all-zero elements among them."""
    width, ra, _ = element_layout(piece)
    if stream == 0 and piece.size < (1 << 33):  # int32 tables: quarters < 2**31
        return _count_stream0(piece, out) if step == 1 else _count_stream0_every(piece, step, out)
    top = np.int64(8 * width)
    mask = np.int64((1 << (8 * width)) - 1)
    sh = np.int64(8 * (width - 1 - stream))
    # Four partial histograms: consecutive increments of one counter would each wait for
    # the last (exponent bytes repeat).
    h0 = np.zeros(256, dtype=np.int64)
    h1 = np.zeros(256, dtype=np.int64)
    h2 = np.zeros(256, dtype=np.int64)
    h3 = np.zeros(256, dtype=np.int64)
    z = np.int64(0)
    if step == 1:  # contiguous: the loads vectorize; zeros in a loop of their own
        quads = piece.size // 4
        for q in range(quads):
            i = 4 * q
            h0[symbol(piece[i], sh, 0, top, ra, mask)] += 1
            h1[symbol(piece[i + 1], sh, 0, top, ra, mask)] += 1
            h2[symbol(piece[i + 2], sh, 0, top, ra, mask)] += 1
            h3[symbol(piece[i + 3], sh, 0, top, ra, mask)] += 1
        for i in range(4 * quads, piece.size):
            h0[symbol(piece[i], sh, 0, top, ra, mask)] += 1
        z = count_zeros(piece)
    else:
        for i in range(0, piece.size, step):
            v = piece[i]
            h0[symbol(v, sh, 0, top, ra, mask)] += 1
            z += np.int64(v == 0)
    for b in range(256):
        out[b] = h0[b] + h1[b] + h2[b] + h3[b]
    return z


@jit
def _look(piece, step, out):
    """out[s, b] = elements of piece, every step-th, whose byte of stream s is b, for every
    stream s but 0 (one load per element for all of them); return the all-zero elements
    among them."""
    width, ra, _ = element_layout(piece)
    top = np.int64(8 * width)
    mask = np.int64((1 << (8 * width)) - 1)
    for s in range(1, width):
        out[s, :] = 0
    z = np.int64(0)
    for i in range(0, piece.size, step):
        v = piece[i]
        for s in range(1, width):
            out[s, symbol(v, np.int64(8 * (width - 1 - s)), 0, top, ra, mask)] += 1
        z += np.int64(v == 0)
    return z


@entry
def count_pieces(bits, starts, lengths, every, step, min_elems, limit, hist, zeros, coded):
    """Count every stream of pieces of a tensor, looking at the random-looking ones only sparsely.

    A piece's *counted* elements are its elements 0, every, 2 * every, ...
    (``ceil(length / every)`` of them). Stream 0 is counted on all of them. With ``step``
    > 1, every other stream is first counted on every step-th element of the piece; it
    is *coded* when some piece of at least ``min_elems`` elements shows under ``limit``
    bits per symbol there (Shannon entropy plus the Miller-Madow bias 255 / (2 n ln 2)
    of n samples; where over 1/8 of the piece's elements are all zero, the encoder masks
    them, and those seen are left out of byte 0 first), and then counted on the counted
    elements; a stream not coded keeps its sparse counts. With ``step`` 1 every stream
    is counted on the counted elements, and coded.

    Args:
        bits: element bits (layout in the module docstring).
        starts, lengths: int64[npieces], piece k is bits[starts[k]:starts[k]+lengths[k]].
        every: >= 1 (1: every element is counted).
        step: >= 1.
        min_elems: pieces shorter than this say nothing on a sparse look.
        limit: bits per symbol.
        hist: int64[npieces, nstreams, 256] output: hist[k, s, b] = counted elements of
            piece k (every step-th element where stream s is not coded) whose byte of
            stream s is b.
        zeros: int64[npieces] output: all-zero counted elements of each piece.
        coded: bool[nstreams] output.

    Returns:
        STATUS_OK, or STATUS_BAD_ARGS (nothing written).
    """
    if not _pieces_ok(bits, starts, lengths, every, step, hist, zeros, coded):
        return STATUS_BAD_ARGS
    _count_pieces(bits, starts, lengths, every, step, min_elems, limit, hist, zeros, coded)
    return STATUS_OK


@jit
def _pieces_ok(bits, starts, lengths, every, step, hist, zeros, coded):
    width, _, _ = element_layout(bits)
    npieces = starts.size
    return not (
        every < 1
        or step < 1
        or hist.shape[0] != npieces
        or hist.shape[1] != width
        or hist.shape[2] != 256
        or zeros.size != npieces
        or coded.size != width
        or not _check_pieces(bits, starts, lengths)
    )


@jit
def _count_pieces(bits, starts, lengths, every, step, min_elems, limit, hist, zeros, coded):
    """:func:`count_pieces` of checked arguments."""
    width, _, _ = element_layout(bits)
    npieces = starts.size
    # Piece by piece, every stream of a piece while it is in cache: a sparse look at a
    # stream of 4-byte elements touches every cache line, as a full pass does.
    seen = np.zeros(npieces, dtype=np.int64)  # all-zero elements among those looked at
    for k in range(npieces):
        piece = bits[starts[k] : starts[k] + lengths[k]]
        zeros[k] = _count(piece, 0, every, hist[k, 0])
        if step == 1:
            for s in range(1, width):
                _count(piece, s, every, hist[k, s])
        elif width > 1:
            seen[k] = _look(piece, step, hist[k])
    coded[0] = True
    ln2 = np.log(2.0)
    for s in range(1, width):
        coded[s] = step == 1
        for k in range(npieces):
            if coded[s] or lengths[k] < min_elems:
                continue
            n = np.int64(0)
            for b in range(256):
                n += hist[k, s, b]
            counted = (lengths[k] + every - 1) // every
            drop = seen[k] if zeros[k] * 8 > counted else 0  # masked zeros are not coded
            n = max(n - drop, np.int64(1))
            acc = 0.0
            for b in range(256):
                c = hist[k, s, b] - (drop if b == 0 else 0)
                if c > 1:
                    acc += c * np.log2(np.float64(c))
            h = max(np.log2(np.float64(n)) - acc / n, 0.0)
            if h + 255.0 / (2.0 * ln2 * n) < limit:
                coded[s] = True
        if coded[s] and step > 1:
            for k in range(npieces):
                piece = bits[starts[k] : starts[k] + lengths[k]]
                _count(piece, s, every, hist[k, s])


@entry
def chunk_refs(bits, starts, lengths, per, exp_shift, refs):
    """Reference exponents of chunks made of consecutive pieces, as the encoder picks them.

    Chunk c is pieces c*per .. c*per+per-1 (the last chunk may have fewer) laid end to
    end; its reference is the mode of the exponents (``byte0 >> exp_shift``) of every
    ``max(1, n // 256)``-th of its n elements from its first, all-zero elements left out,
    ties to the smaller exponent: what :func:`comm_codec.kernels.symbols.chunk_ref` computes
    for a chunk of those elements. With ``exp_shift < 0`` (integers) every reference is 0.

    Args:
        bits, starts, lengths: as for :func:`count_pieces`.
        per: pieces per chunk (>= 1).
        exp_shift: the exponent's position in stream 0's byte, or -1.
        refs: int64[ceil(npieces / per)] output.

    Returns:
        STATUS_OK, or STATUS_BAD_ARGS (nothing written).
    """
    npieces = starts.size
    if per < 1 or refs.size != (npieces + per - 1) // per or not _check_pieces(bits, starts, lengths):
        return STATUS_BAD_ARGS
    _chunk_refs(bits, starts, lengths, per, exp_shift, refs)
    return STATUS_OK


@jit
def _chunk_refs(bits, starts, lengths, per, exp_shift, refs):
    """:func:`chunk_refs` of checked arguments."""
    width, ra, _ = element_layout(bits)
    npieces = starts.size
    top = np.int64(8 * width)
    mask = np.int64((1 << (8 * width)) - 1)
    sh = np.int64(8 * (width - 1))
    hist = np.zeros(256, dtype=np.int64)
    for c in range(refs.size):
        if exp_shift < 0:
            refs[c] = 0
            continue
        first = c * per
        last = min(npieces, first + per)
        n = np.int64(0)
        for p in range(first, last):
            n += lengths[p]
        step = max(np.int64(1), n // 256)
        hist[:] = 0
        p = first
        base = np.int64(0)  # where piece p starts in the chunk
        for i in range(0, n, step):
            while i >= base + lengths[p]:
                base += lengths[p]
                p += 1
            v = bits[starts[p] + i - base]
            if v != 0:
                hist[symbol(v, sh, 0, top, ra, mask) >> exp_shift] += 1
        best = 0
        for e in range(256):
            if hist[e] > hist[best]:
                best = e
        refs[c] = best


@entry
def chunk_rows(hist, zeros, lengths, refs, per, exp_shift, counted, rows):
    """Symbol counts of chunks made of consecutive pieces, from the pieces' byte histograms.

    rows[c, s] sums hist[p, s] over the pieces p of chunk c (c*per .. c*per+per-1);
    where more than 1/8 of the chunk's elements are all zero (the encoder masks them)
    they are taken out of every stream's byte 0 (a zero element's bytes are all 0);
    stream 0's bytes become symbols relative to the chunk's reference,
    ``(byte - (refs[c] << exp_shift)) mod 256`` (not for ``exp_shift < 0``). A stream not
    counted (``counted[s]`` False) gets the chunk's symbol count at symbol 0.

    Args:
        hist: int64[npieces, nstreams, 256] byte histograms (:func:`count_pieces`).
        zeros, lengths: int64[npieces], all-zero elements and elements per piece.
        refs: int64[nchunks] chunk references (:func:`chunk_refs`), each in 0..255.
        per: pieces per chunk (>= 1).
        exp_shift: as for :func:`chunk_refs`.
        counted: bool[nstreams].
        rows: int64[nchunks, nstreams, 256] output.

    Returns:
        STATUS_OK, or STATUS_BAD_ARGS (nothing written).
    """
    npieces, ns = hist.shape[0], hist.shape[1]
    nchunks = rows.shape[0]
    if (
        per < 1
        or hist.shape[2] != 256
        or zeros.size != npieces
        or lengths.size != npieces
        or refs.size != nchunks
        or nchunks != (npieces + per - 1) // per
        or counted.size != ns
        or rows.shape[1] != ns
        or rows.shape[2] != 256
    ):
        return STATUS_BAD_ARGS
    for c in range(nchunks):
        if refs[c] < 0 or refs[c] > 255:
            return STATUS_BAD_ARGS
    _chunk_rows(hist, zeros, lengths, refs, per, exp_shift, counted, rows)
    return STATUS_OK


@jit
def _chunk_rows(hist, zeros, lengths, refs, per, exp_shift, counted, rows):
    """:func:`chunk_rows` of checked arguments."""
    npieces, ns = hist.shape[0], hist.shape[1]
    nchunks = rows.shape[0]
    for c in range(nchunks):
        first = c * per
        last = min(npieces, first + per)
        z = np.int64(0)
        n = np.int64(0)
        for p in range(first, last):
            z += zeros[p]
            n += lengths[p]
        drop = z if z * 8 > n else 0
        for s in range(ns):
            out = rows[c, s]
            if not counted[s]:
                out[:] = 0
                out[0] = n - drop
                continue
            acc = np.zeros(256, dtype=np.int64)
            for p in range(first, last):
                for b in range(256):
                    acc[b] += hist[p, s, b]
            acc[0] -= drop
            sub = (refs[c] << exp_shift) if (s == 0 and exp_shift >= 0) else 0
            for x in range(256):
                out[x] = acc[(x + sub) & 255]


@entry
def count_chunks(bits, starts, lengths, every, step, min_elems, limit, exp_shift, per, zeros, coded, rows, rows_large):
    """:func:`count_pieces`, then :func:`chunk_refs` and :func:`chunk_rows` for chunks of one
    piece and of ``per`` pieces, in one call.

    What the planner asks of a tensor's sample; as separate calls, the calls and their
    scratch arrays cost as much as the counting of a small tensor.

    Args:
        bits, starts, lengths, every, step, min_elems, limit: as for :func:`count_pieces`.
        exp_shift: as for :func:`chunk_refs`.
        per: pieces per large chunk (>= 1).
        zeros, coded: outputs, as for :func:`count_pieces`.
        rows: int64[npieces, nstreams, 256] output: :func:`chunk_rows` of chunks of one piece.
        rows_large: int64[ceil(npieces / per), nstreams, 256] output: the same of chunks of
            ``per`` pieces.

    Returns:
        STATUS_OK, or STATUS_BAD_ARGS (nothing written).
    """
    npieces, ns = starts.size, coded.size
    if (
        per < 1
        or rows.shape[0] != npieces
        or rows.shape[1] != ns
        or rows.shape[2] != 256
        or rows_large.shape[0] != (npieces + per - 1) // per
        or rows_large.shape[1] != ns
        or rows_large.shape[2] != 256
    ):
        return STATUS_BAD_ARGS
    hist = np.empty((npieces, ns, 256), dtype=np.int64)
    if not _pieces_ok(bits, starts, lengths, every, step, hist, zeros, coded):
        return STATUS_BAD_ARGS
    _count_pieces(bits, starts, lengths, every, step, min_elems, limit, hist, zeros, coded)
    ncounted = (lengths + every - 1) // every
    for chunk_pieces, out in ((np.int64(1), rows), (np.int64(per), rows_large)):
        if chunk_pieces > 1 and out.shape[0] == npieces:  # at most one piece: one chunk at either size
            out[:] = rows
            continue
        refs = np.empty(out.shape[0], dtype=np.int64)
        _chunk_refs(bits, starts, lengths, chunk_pieces, exp_shift, refs)
        _chunk_rows(hist, zeros, ncounted, refs, chunk_pieces, exp_shift, coded, out)
    return STATUS_OK


@entry
def chunks_alike(rows, rows_large, per, spread):
    """Whether chunks of ``per`` pieces have exactly their pieces' counts, and the pieces are alike.

    True when rows_large[c] is the sum of rows[c*per .. c*per+per-1] (the same
    references and zero handling: :func:`chunk_rows` of the same histograms) and, per
    stream, the pieces' entropies (bits per symbol, ``log2(n) - sum(c log2 c) / n``, 0
    for an empty row) lie within ``spread`` of each other.

    Args:
        rows, rows_large: int64 counts as :func:`count_chunks` gives them.
        per: pieces per large chunk (>= 1).
        spread: bits per symbol.

    Returns:
        1 (alike), 0 (not), or -1 for arguments out of range (mismatched shapes, per < 1).
    """
    npieces, ns = rows.shape[0], rows.shape[1]
    nlarge = rows_large.shape[0]
    if (
        per < 1
        or nlarge != (npieces + per - 1) // per
        or rows_large.shape[1] != ns
        or rows.shape[2] != 256
        or rows_large.shape[2] != 256
    ):
        return -1
    for c in range(nlarge):
        for s in range(ns):
            for b in range(256):
                acc = np.int64(0)
                for p in range(c * per, min(npieces, c * per + per)):
                    acc += rows[p, s, b]
                if acc != rows_large[c, s, b]:
                    return 0
    for s in range(ns):
        lo, hi = np.inf, -np.inf
        for p in range(npieces):
            h = _entropy(rows[p, s])
            lo = min(lo, h)
            hi = max(hi, h)
        if hi - lo > spread:
            return 0
    return 1


@entry
def price_stream(rows, s, book_bits, floor, colsum, out):
    """Price one stream of sampled chunks under a group of books, as the encoder codes them.

    Each chunk costs its cheapest book (ties to the lower index) or, where that does not
    save what :data:`~comm_codec.kernels.layout.MIN_SAVING_SHIFT` asks of the stream, its
    raw bits (8 a symbol): the sums a book choice weighs, in one call
    instead of a dozen numpy operations on a few rows (the planner prices every stream
    of every tensor this way). Counts and bits are integers, so the sums are exact in
    any order.

    Args:
        rows: int64[nchunks, nstreams, 256] symbol counts (:func:`chunk_rows`).
        s: the stream.
        book_bits: int64[nbooks, 256], each book's bits per symbol (nbooks may be 0).
        floor: whether to price each chunk's entropy too (out[2]).
        colsum: int64[256] output: the stream's counts summed over the chunks.
        out: float64[5] output: [0] the stream's symbols; [1] the sum over chunks of
            the cheapest book's bits where the chunk is coded, else its raw bits (raw
            bits without books); [2] with ``floor``, the same with each chunk's entropy
            for the book's bits, the entropy in bits per symbol being
            ``log2(n) - sum(c log2 c) / n`` over the chunk's n symbols; [3] a bitmask of
            the books some chunk picks where it is coded; [4] with ``floor``, the
            entropy of ``colsum`` in bits per symbol (else 0).

    Returns:
        STATUS_OK, or STATUS_BAD_ARGS (nothing written).
    """
    nchunks = rows.shape[0]
    nbooks = book_bits.shape[0]
    if (
        s < 0
        or s >= rows.shape[1]
        or rows.shape[2] != 256
        or book_bits.shape[1] != 256
        or nbooks > 62
        or colsum.size != 256
        or out.size != 5
    ):
        return STATUS_BAD_ARGS
    colsum[:] = 0
    symbols = 0.0
    priced = 0.0
    least = 0.0
    used = np.int64(0)
    for k in range(nchunks):
        r = rows[k, s]
        n = np.int64(0)
        for b in range(256):
            n += r[b]
            colsum[b] += r[b]
        raw = 8.0 * np.float64(n)
        # Coded only below this many bits (layout.MIN_SAVING_SHIFT: a later stream must
        # save a share of its bytes, as every encoder decides).
        limit = raw if s == 0 else 8.0 * np.float64(n - max(np.int64(1), n >> MIN_SAVING_SHIFT))
        symbols += np.float64(n)
        cheapest = raw
        if nbooks:
            best = np.int64(-1)
            pick = 0
            for j in range(nbooks):
                bits = np.int64(0)
                row = book_bits[j]
                for b in range(256):
                    bits += r[b] * row[b]
                if best < 0 or bits < best:
                    best = bits
                    pick = j
            if np.float64(best) < limit:
                used |= np.int64(1) << pick
                cheapest = np.float64(best)
        priced += cheapest
        if floor:
            h = _entropy(r)
            least += h * np.float64(n) if h * np.float64(n) < limit else raw
    out[0] = symbols
    out[1] = priced
    out[2] = least
    out[3] = np.float64(used)
    out[4] = _entropy(colsum) if floor else 0.0
    return STATUS_OK
