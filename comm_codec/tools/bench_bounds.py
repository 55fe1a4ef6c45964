"""Bounds the table prints beside the codecs: the Shannon bound and an ideal per-chunk Huffman coder.

Both are computed on the encoder's own streams (definitions in
:data:`comm_codec.tools.bench.DEFINITIONS`), so a row's gap to them is what its fixed books
cost.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..books.profiler import stream_counts
from ..core.huffman import entropy_bits, optimal_lengths
from ..core.streams import as_bits, split
from .bench_data import Dataset

__all__ = ["bound_rows"]


def _shannon_bits(t: torch.Tensor, chunk_elems: int) -> float:
    counts, zeros = stream_counts(t, chunk_elems)
    n = t.numel()
    nonzero = n - zeros
    p = zeros / n if n else 0.0
    indicator = 0.0 if p in (0.0, 1.0) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    return n * indicator + nonzero * sum(entropy_bits(c) for c in counts)


def _huffman_bits(hist: np.ndarray) -> int:
    total = int(hist.sum())
    if total == 0:
        return 0
    return min(int((optimal_lengths(hist) * hist).sum()), 8 * total)


def _chunk_huffman_bits(t: torch.Tensor, chunk_elems: int) -> int:
    """Ideal per-chunk Huffman cost of a tensor, in bits (see DEFINITIONS)."""
    streams = split(t)
    bits, _ = as_bits(t)
    nonzero = bits != 0
    n = bits.size
    total = 0
    block = chunk_elems * 64  # chunks per vectorized pass, bounds the scratch memory
    for start in range(0, n, block):
        stop = min(n, start + block)
        k = -(-(stop - start) // chunk_elems)
        cid = np.arange(stop - start, dtype=np.int64) // chunk_elems
        keep = nonzero[start:stop]
        counts = np.bincount(cid, minlength=k)
        nz_counts = np.bincount(cid[keep], minlength=k)
        base = cid * 256
        plain = np.zeros(k, dtype=np.int64)
        masked = counts.astype(np.int64)  # the mask: 1 bit per element
        for s in streams:
            sym = s[start:stop].astype(np.int64) + base
            h_all = np.bincount(sym, minlength=k * 256).reshape(k, 256)
            h_nz = np.bincount(sym[keep], minlength=k * 256).reshape(k, 256)
            for c in range(k):
                plain[c] += _huffman_bits(h_all[c])
                if 0 < nz_counts[c] < counts[c]:
                    masked[c] += _huffman_bits(h_nz[c])
        for c in range(k):
            if nz_counts[c] == 0:
                continue  # an all-zero chunk: a flag, no payload
            total += int(min(plain[c], masked[c]) if nz_counts[c] < counts[c] else plain[c])
    return total


def bound_rows(ds: Dataset, chunk_elems: int) -> list:
    raw_bits = 8 * ds.nbytes
    shannon = sum(_shannon_bits(b, chunk_elems) for b in ds.buckets)
    chunk = sum(_chunk_huffman_bits(b, chunk_elems) for b in ds.buckets)
    rows = []
    for codec, bits in (("bound:shannon", shannon), ("bound:chunk-huffman", chunk)):
        rows.append(
            {
                "dataset": ds.name,
                "dtype": ds.spec_name,
                "kind": ds.kind,
                "codec": codec,
                "ratio": raw_bits / bits if bits else math.inf,
                "eval_bytes": ds.nbytes,
                "exact": None,
                "enc_gbps": {},
                "dec_gbps": {},
                "notes": [],
                "error": None,
            }
        )
    return rows
