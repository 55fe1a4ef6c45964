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
element) instead of a full histogram.

Element bits are typed as :mod:`comm_codec.kernels.layout` describes.
"""

from __future__ import annotations

import numpy as np

from .jit import entry, jit
from .layout import STATUS_BAD_ARGS, STATUS_OK
from .symbols import count_zeros, element_layout, symbol, symbol0

__all__ = ["byte_histograms", "chunk_refs", "chunk_rows", "STATUS_OK", "STATUS_BAD_ARGS"]


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
    wait for the last: exponent bytes repeat), zeros in a vectorized pass of their own.
    A function of its own, so that the compiler does not merge it with the general loop
    (merged, the shifts were run-time values again).
    """
    q = piece.size // 4
    v0 = piece[:q]
    v1 = piece[q:2 * q]
    v2 = piece[2 * q:3 * q]
    v3 = piece[3 * q:]
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
    return count_zeros(piece)


@entry
def byte_histograms(bits, starts, lengths, streams, steps, hist, zeros):
    """Count the bytes of some streams over pieces of a tensor's element bits.

    Args:
        bits: element bits (layout in the module docstring).
        starts, lengths: int64[npieces], piece k is bits[starts[k]:starts[k]+lengths[k]].
        streams: int64[m], which streams (0 = the most significant byte).
        steps: int64[m], stream j counts every steps[j]-th element of a piece (1: all).
        hist: int64[npieces, m, 256] output: hist[k, j, b] = elements of piece k (of those
            visited for stream j) whose byte of stream streams[j] is b.
        zeros: int64[npieces, m] output: zeros[k, j] = all-zero elements among those
            visited for stream j.

    Returns:
        STATUS_OK, or STATUS_BAD_ARGS (nothing written) for out-of-range arguments.
    """
    width, ra, _ = element_layout(bits)
    m = streams.size
    if (steps.size != m or hist.shape[0] != starts.size or hist.shape[1] != m or hist.shape[2] != 256
            or zeros.shape[0] != starts.size or zeros.shape[1] != m or not _check_pieces(bits, starts, lengths)):
        return STATUS_BAD_ARGS
    for j in range(m):
        if streams[j] < 0 or streams[j] >= width or steps[j] < 1:
            return STATUS_BAD_ARGS
    top = np.int64(8 * width)
    mask = np.int64((1 << (8 * width)) - 1)
    for k in range(starts.size):
        piece = bits[starts[k]:starts[k] + lengths[k]]
        for j in range(m):
            sh = np.int64(8 * (width - 1 - streams[j]))
            step = steps[j]
            if streams[j] == 0 and step == 1 and piece.size < (1 << 33):  # int32 tables: quarters < 2**31
                zeros[k, j] = _count_stream0(piece, hist[k, j])
                continue
            # Four partial histograms: consecutive increments of one counter would each
            # wait for the last (exponent bytes repeat).
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
                for i in range(piece.size):
                    z += np.int64(piece[i] == 0)
            else:
                for i in range(0, piece.size, step):
                    v = piece[i]
                    h0[symbol(v, sh, 0, top, ra, mask)] += 1
                    z += np.int64(v == 0)
            for b in range(256):
                hist[k, j, b] = h0[b] + h1[b] + h2[b] + h3[b]
            zeros[k, j] = z
    return STATUS_OK


@entry
def chunk_refs(bits, starts, lengths, per, exp_shift, refs):
    """Reference exponents of chunks made of consecutive pieces, as the encoder picks them.

    Chunk c is pieces c*per .. c*per+per-1 (the last chunk may have fewer) laid end to
    end; its reference is the mode of the exponents (``byte0 >> exp_shift``) of every
    ``max(1, n // 256)``-th of its n elements from its first, all-zero elements left out,
    ties to the smaller exponent: what :func:`comm_codec.kernels.symbols.chunk_ref` computes
    for a chunk of those elements. With ``exp_shift < 0`` (integers) every reference is 0.

    Args:
        bits, starts, lengths: as for :func:`byte_histograms`.
        per: pieces per chunk (>= 1).
        exp_shift: the exponent's position in stream 0's byte, or -1.
        refs: int64[ceil(npieces / per)] output.

    Returns:
        STATUS_OK, or STATUS_BAD_ARGS (nothing written).
    """
    width, ra, _ = element_layout(bits)
    npieces = starts.size
    if per < 1 or refs.size != (npieces + per - 1) // per or not _check_pieces(bits, starts, lengths):
        return STATUS_BAD_ARGS
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
    return STATUS_OK


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
        hist: int64[npieces, nstreams, 256] byte histograms (:func:`byte_histograms`).
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
    if (per < 1 or hist.shape[2] != 256 or zeros.size != npieces or lengths.size != npieces
            or refs.size != nchunks or nchunks != (npieces + per - 1) // per or counted.size != ns
            or rows.shape[1] != ns or rows.shape[2] != 256):
        return STATUS_BAD_ARGS
    for c in range(nchunks):
        if refs[c] < 0 or refs[c] > 255:
            return STATUS_BAD_ARGS
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
    return STATUS_OK
