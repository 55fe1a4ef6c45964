"""The planner's pricing kernel (comm_codec.kernels.plan.price_stream) against numpy.

The reference is the book choice's numpy formulas: a matrix product per group, the
cheapest book per chunk (ties to the lower index) or raw, and each chunk's entropy.
"""

from __future__ import annotations

import numpy as np
import pytest

import comm_codec as cc
from comm_codec.kernels import plan as kp


def _reference(rows, s, book_bits):
    r = rows[:, s, :]
    symbols = r.sum(axis=1)
    raw = 8.0 * symbols
    if len(book_bits):
        costs = r @ book_bits.T
        pick = np.argmin(costs, axis=1)
        best = costs[np.arange(len(costs)), pick]
        priced = float(np.minimum(best, raw).sum())
        used = sum(1 << int(j) for j in set(pick[best < raw].tolist()))
    else:
        priced, used = float(raw.sum()), 0
    n = np.maximum(symbols, 1)
    h = np.maximum(np.log2(n) - (r * np.log2(np.maximum(r, 1))).sum(axis=1) / n, 0.0)
    floor = float(np.minimum(h * symbols, raw).sum())
    return float(symbols.sum()), priced, floor, used, r.sum(axis=0)


def _rows(rng, nchunks, ns, kind):
    rows = np.zeros((nchunks, ns, 256), dtype=np.int64)
    for k in range(nchunks):
        for s in range(ns):
            if kind == "empty":
                continue
            if kind == "one":
                rows[k, s, rng.integers(256)] = rng.integers(1, 1 << 16)
                continue
            width = int(rng.integers(1, 256))
            rows[k, s, :width] = rng.integers(0, 1 << int(rng.integers(1, 17)), width)
            rows[k, s] = rng.permutation(rows[k, s])
    return rows


@pytest.mark.parametrize("kind", ["random", "one", "empty"])
@pytest.mark.parametrize("nbooks", [0, 1, 3, 16])
@pytest.mark.parametrize("nchunks", [1, 4, 9])
def test_price_stream_equals_the_numpy_formulas(kind, nbooks, nchunks):
    rng = np.random.default_rng(nbooks * 100 + nchunks)
    rows = _rows(rng, nchunks, 2, kind)
    group = cc.CodebookSet.default().group("weight", "bf16", 0)
    book_bits = np.stack([b.symbol_bits() for b in group])[:nbooks].astype(np.int64)
    if nbooks == 3:
        book_bits[2] = book_bits[1]  # a tie: the lower index wins
    for s in (0, 1):
        colsum = np.full(256, -1, dtype=np.int64)
        out = np.full(4, np.nan)
        assert kp.price_stream(rows, s, book_bits, True, colsum, out) == kp.STATUS_OK
        symbols, priced, floor, used, counts = _reference(rows, s, book_bits)
        assert out[0] == symbols and out[1] == priced and int(out[3]) == used
        assert out[2] == pytest.approx(floor, rel=1e-12, abs=1e-9)
        assert np.array_equal(colsum, counts)
        assert kp.price_stream(rows, s, book_bits, False, colsum, out) == kp.STATUS_OK
        assert out[2] == 0.0, "no entropy asked for"


def test_price_stream_refuses_bad_arguments():
    rows = np.zeros((2, 2, 256), dtype=np.int64)
    books = np.zeros((1, 256), dtype=np.int64)
    colsum, out = np.zeros(256, dtype=np.int64), np.zeros(4)
    ok = kp.STATUS_OK
    assert kp.price_stream(rows, 1, books, True, colsum, out) == ok
    for args in ((rows, 2, books, True, colsum, out), (rows, -1, books, True, colsum, out),
                 (rows, 0, np.zeros((1, 255), dtype=np.int64), True, colsum, out),
                 (rows, 0, np.zeros((63, 256), dtype=np.int64), True, colsum, out),
                 (rows, 0, books, True, np.zeros(255, dtype=np.int64), out),
                 (rows, 0, books, True, colsum, np.zeros(3))):
        assert kp.price_stream(*args) == kp.STATUS_BAD_ARGS
