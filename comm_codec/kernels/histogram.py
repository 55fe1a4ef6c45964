"""Histograms of stream symbols, and the code-length arithmetic that book fitting needs.

* :func:`lane_histograms`: one chunk's bytes of one stream, per lane (the planner prices
  a group of books on them);
* :func:`chunk_histograms`: every chunk's symbol counts, formed exactly as the encoder
  forms its symbols (the profiler fits books on them);
* :func:`huffman_costs` and :func:`package_merge`: the cost of an optimal code, and
  optimal length-limited code lengths.
"""

from __future__ import annotations

import numpy as np

from .intrinsics import prefetch
from .jit import entry, inline, jit
from .layout import LANES
from .symbols import chunk_ref, count_zeros, element_layout, stream_params, symbol, symbol0

__all__ = ["lane_histograms", "chunk_histograms_range", "chunk_histograms", "huffman_costs", "package_merge"]


@inline
def _hist_rest(view, start, h, sh, top, ra, mask):
    """Count view[start:] into h (what a longer lane has past the shortest)."""
    for i in range(start, view.size):
        h[symbol(view[i], sh, 0, top, ra, mask)] += 1


@inline
def _hist4(src, lo, a1, a2, a3, a4, sh, top, ra, mask, hist):
    """hist[k, byte] = count over lane k = src[lo+a_k : lo+a_{k+1}] (a0 = 0), lanes interleaved.

    Four separate tables advanced in lockstep: consecutive increments of one counter
    would each wait for the last (exponent bytes repeat).
    """
    v0 = src[lo : lo + a1]
    v1 = src[lo + a1 : lo + a2]
    v2 = src[lo + a2 : lo + a3]
    v3 = src[lo + a3 : lo + a4]
    h0 = np.zeros(256, dtype=np.int32)
    h1 = np.zeros(256, dtype=np.int32)
    h2 = np.zeros(256, dtype=np.int32)
    h3 = np.zeros(256, dtype=np.int32)
    m = min(min(v0.size, v1.size), min(v2.size, v3.size))
    for i in range(m):
        h0[symbol(v0[i], sh, 0, top, ra, mask)] += 1
        h1[symbol(v1[i], sh, 0, top, ra, mask)] += 1
        h2[symbol(v2[i], sh, 0, top, ra, mask)] += 1
        h3[symbol(v3[i], sh, 0, top, ra, mask)] += 1
    _hist_rest(v0, m, h0, sh, top, ra, mask)
    _hist_rest(v1, m, h1, sh, top, ra, mask)
    _hist_rest(v2, m, h2, sh, top, ra, mask)
    _hist_rest(v3, m, h3, sh, top, ra, mask)
    for b in range(256):
        hist[0, b] = h0[b]
        hist[1, b] = h1[b]
        hist[2, b] = h2[b]
        hist[3, b] = h3[b]


@jit
def _hist4_0(src, lo, a1, a2, a3, a4, hist):
    """:func:`_hist4` for stream 0, its layout all constants (a function of its own, so
    that the compiler cannot merge it with the general one: merged, the shifts were
    run-time values again)."""
    v0 = src[lo : lo + a1]
    v1 = src[lo + a1 : lo + a2]
    v2 = src[lo + a2 : lo + a3]
    v3 = src[lo + a3 : lo + a4]
    h0 = np.zeros(256, dtype=np.int32)
    h1 = np.zeros(256, dtype=np.int32)
    h2 = np.zeros(256, dtype=np.int32)
    h3 = np.zeros(256, dtype=np.int32)
    m = min(min(v0.size, v1.size), min(v2.size, v3.size))
    ahead = lo + a4  # the next chunk: its lines arrive while this one is counted
    for i in range(m):
        prefetch(src, ahead + 4 * i)
        h0[symbol0(v0[i])] += 1
        h1[symbol0(v1[i])] += 1
        h2[symbol0(v2[i])] += 1
        h3[symbol0(v3[i])] += 1
    for i in range(m, v0.size):
        h0[symbol0(v0[i])] += 1
    for i in range(m, v1.size):
        h1[symbol0(v1[i])] += 1
    for i in range(m, v2.size):
        h2[symbol0(v2[i])] += 1
    for i in range(m, v3.size):
        h3[symbol0(v3[i])] += 1
    for b in range(256):
        hist[0, b] = h0[b]
        hist[1, b] = h1[b]
        hist[2, b] = h2[b]
        hist[3, b] = h3[b]


@jit
def lane_histograms(src, lo, hi, s, hist):
    """Fill hist (int64[4, 256]) with the bytes of stream s per lane, before any reference.

    Lane k holds elements [lo + k*n//4, lo + (k+1)*n//4) of src, n = hi - lo (a masked
    chunk is compacted first: see :func:`comm_codec.kernels.encode.plan_chunks`).
    """
    hist[:] = 0
    n = hi - lo
    a1 = n // LANES
    a2 = 2 * n // LANES
    a3 = 3 * n // LANES
    if s == 0:  # stream 0 with constant layout: the hot case
        _hist4_0(src, lo, a1, a2, a3, n, hist)
    else:
        sh, _, top, ra, mask = stream_params(src, s, -1, 0)
        _hist4(src, lo, a1, a2, a3, n, sh, top, ra, mask, hist)


@entry
def chunk_histograms_range(bits, chunk_elems, exp_shift, streams, local, zeros, c0, c1):
    """Fill local[c, j] with the symbol counts of stream streams[j] in chunk c, zeros[c] with its zeros.

    Chunks c0..c1-1 only: threads each take a range (:mod:`comm_codec.core.parallel`).

    Symbols are formed exactly as the encoder forms them: per-chunk reference exponent
    for stream 0. Exact zeros are counted where the encoder will code them, in chunks
    with at most 1/8 zeros, and left out where it will mostly mask them (a zero costs
    9+ bits in a float's streams, so the one-bit-per-element mask pays above ~1/9).
    Streams not listed cost nothing (a checkpoint's planner skips the mantissa bytes it
    will store raw).

    Args:
        bits, chunk_elems, exp_shift: as for :func:`comm_codec.kernels.encode.plan_chunks`.
        streams: int64[k], the streams to count (each in 0..nstreams-1; others are skipped).
        local: int64[nchunks, k, 256] output (overwritten).
        zeros: int64[nchunks] output.
        c0, c1: the chunks to count.
    """
    n = bits.size
    width, _, _ = element_layout(bits)
    for c in range(max(0, c0), min(c1, local.shape[0])):
        lo = c * chunk_elems
        hi = min(n, lo + chunk_elems)
        ref = chunk_ref(bits, lo, hi, exp_shift)
        chunk = bits[lo:hi]
        quads = chunk.size // 4
        for j in range(streams.size):
            s = streams[j]
            h = local[c, j]
            h[:] = 0
            if s < 0 or s >= width:  # the Python layer checks; trust nothing
                continue
            sh, sub, top, ra, mask = stream_params(bits, s, exp_shift, ref)
            # Four partial histograms: exponent symbols repeat, and with one histogram
            # each increment waits for the previous one to the same counter.
            h0 = np.zeros(256, dtype=np.int64)
            h1 = np.zeros(256, dtype=np.int64)
            h2 = np.zeros(256, dtype=np.int64)
            h3 = np.zeros(256, dtype=np.int64)
            for q in range(quads):
                i = 4 * q
                h0[symbol(chunk[i], sh, sub, top, ra, mask)] += 1
                h1[symbol(chunk[i + 1], sh, sub, top, ra, mask)] += 1
                h2[symbol(chunk[i + 2], sh, sub, top, ra, mask)] += 1
                h3[symbol(chunk[i + 3], sh, sub, top, ra, mask)] += 1
            for i in range(4 * quads, chunk.size):
                h0[symbol(chunk[i], sh, sub, top, ra, mask)] += 1
            for k in range(256):
                h[k] = h0[k] + h1[k] + h2[k] + h3[k]
        # Exact zeros were counted under their symbols above; take them out again.
        z = count_zeros(chunk)
        zeros[c] = z
        if z * 8 > chunk.size:
            for j in range(streams.size):
                s = streams[j]
                if 0 <= s < width:
                    sh, sub, top, ra, mask = stream_params(bits, s, exp_shift, ref)
                    local[c, j, symbol(0, sh, sub, top, ra, mask)] -= z


def chunk_histograms(bits, chunk_elems, exp_shift, streams, local, zeros):
    """:func:`chunk_histograms_range` over every chunk, on the calling thread."""
    chunk_histograms_range(bits, chunk_elems, exp_shift, streams, local, zeros, 0, local.shape[0])


@entry
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


@entry
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
