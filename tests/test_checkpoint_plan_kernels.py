"""The planner's pricing kernel (comm_codec.kernels.plan.price_stream) against numpy.

The reference is the book choice's numpy formulas: a matrix product per group, the
cheapest book per chunk (ties to the lower index) or raw, and each chunk's entropy.
"""

from __future__ import annotations

import numpy as np
import pytest

import comm_codec as cc
from comm_codec.core.huffman import entropy_bits
from comm_codec.kernels import plan as kp

pytestmark = pytest.mark.unit


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
        out = np.full(5, np.nan)
        assert kp.price_stream(rows, s, book_bits, True, colsum, out) == kp.STATUS_OK
        symbols, priced, floor, used, counts = _reference(rows, s, book_bits)
        assert out[0] == symbols and out[1] == priced and int(out[3]) == used
        assert out[2] == pytest.approx(floor, rel=1e-12, abs=1e-9)
        assert out[4] == pytest.approx(entropy_bits(counts), rel=1e-12, abs=1e-9)
        assert np.array_equal(colsum, counts)
        assert kp.price_stream(rows, s, book_bits, False, colsum, out) == kp.STATUS_OK
        assert out[2] == 0.0 and out[4] == 0.0, "no entropy asked for"


def test_price_stream_refuses_bad_arguments():
    rows = np.zeros((2, 2, 256), dtype=np.int64)
    books = np.zeros((1, 256), dtype=np.int64)
    colsum, out = np.zeros(256, dtype=np.int64), np.zeros(5)
    ok = kp.STATUS_OK
    assert kp.price_stream(rows, 1, books, True, colsum, out) == ok
    for args in (
        (rows, 2, books, True, colsum, out),
        (rows, -1, books, True, colsum, out),
        (rows, 0, np.zeros((1, 255), dtype=np.int64), True, colsum, out),
        (rows, 0, np.zeros((63, 256), dtype=np.int64), True, colsum, out),
        (rows, 0, books, True, np.zeros(255, dtype=np.int64), out),
        (rows, 0, books, True, colsum, np.zeros(4)),
    ):
        assert kp.price_stream(*args) == kp.STATUS_BAD_ARGS


@pytest.mark.parametrize("every", [1, 4, 7])
@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint8, np.int8])
@pytest.mark.parametrize("zeros", ["none", "byte0-not-zero", "some"])
def test_count_pieces_counts_zeros_and_stream_0_as_numpy(dtype, zeros, every):
    """Stream 0 counted on each piece's every ``every``-th element and the all-zero elements
    among them exactly, whether or not byte 0 occurs (-0.0 and subnormals have stream-0
    byte 0 but are not zero); pieces of lengths that ``every`` does not divide included."""
    rng = np.random.default_rng(7)
    width = np.dtype(dtype).itemsize
    ints = rng.integers(1, 1 << (8 * width) - (1 if dtype is np.int8 else 0), 70000).astype(dtype)
    ref = _stream0(ints)
    if zeros == "none":
        ints = ints[ref != 0]
    elif zeros == "byte0-not-zero":
        ints = ints[ref != 0]
        sign = np.array(1 << (8 * width - 1), dtype=np.uint64).astype(dtype) if dtype is not np.int8 else dtype(1)
        # -0.0 of a 2- or 4-byte float: stream-0 byte 0, not zero. A 1-byte type has no such
        # element (fp8's sign rotates into bit 0, int8's byte is the element): byte 0 is zero.
        ints[::97] = sign
    else:
        ints[::13] = 0
    starts = np.array([0, 1000, 40000], dtype=np.int64)
    lengths = np.array([1000, 39000, ints.size - 40000], dtype=np.int64)
    hist = np.empty((3, width, 256), dtype=np.int64)
    got_zeros = np.empty(3, dtype=np.int64)
    coded = np.empty(width, dtype=np.bool_)
    assert kp.count_pieces(ints, starts, lengths, every, 1, 1 << 15, 7.8, hist, got_zeros, coded) == kp.STATUS_OK
    for k in range(3):
        piece = ints[starts[k] : starts[k] + lengths[k] : every]
        assert got_zeros[k] == int((piece == 0).sum())
        assert np.array_equal(hist[k, 0], np.bincount(_stream0(piece), minlength=256))
        for s in range(1, width):  # step 1: every stream counted on the same elements
            assert hist[k, s].sum() == piece.size
    if zeros == "none":
        assert hist[:, 0, 0].sum() == 0 and got_zeros.sum() == 0


def test_count_pieces_counts_a_coded_later_stream_on_the_counted_elements():
    """A later stream found coded on the sparse look is then counted on the same elements
    as stream 0 (every 4th here), so that all of a chunk's rows are in the same units."""
    rng = np.random.default_rng(8)
    ints = rng.integers(0, 1 << 16, 1 << 17).astype(np.uint16) & np.uint16(0xFF0F)  # stream 1: 16 symbols
    starts, lengths = np.array([0, 1 << 16], dtype=np.int64), np.array([1 << 16, (1 << 16) - 3], dtype=np.int64)
    hist = np.empty((2, 2, 256), dtype=np.int64)
    got_zeros, coded = np.empty(2, dtype=np.int64), np.empty(2, dtype=np.bool_)
    assert kp.count_pieces(ints, starts, lengths, 4, 16, 1 << 15, 7.8, hist, got_zeros, coded) == kp.STATUS_OK
    assert coded.tolist() == [True, True]
    for k in range(2):
        piece = ints[starts[k] : starts[k] + lengths[k] : 4].astype(np.int64)
        assert np.array_equal(hist[k, 1], np.bincount(((piece << 1) | (piece >> 15)) & 255, minlength=256))
        assert hist[k, 0].sum() == hist[k, 1].sum() == piece.size


def test_count_pieces_refuses_a_stride_under_one():
    bits = np.zeros(100, dtype=np.uint16)
    hist, zeros = np.zeros((1, 2, 256), dtype=np.int64), np.full(1, -1, dtype=np.int64)
    status = kp.count_pieces(
        bits, np.array([0]), np.array([100]), 0, 1, 1 << 15, 7.8, hist, zeros, np.zeros(2, np.bool_)
    )
    assert status == kp.STATUS_BAD_ARGS and zeros[0] == -1


def _stream0(ints):
    """Stream 0's byte of each element (layout: comm_codec.kernels.symbols.symbol0)."""
    v = ints.astype(np.int64)
    width = ints.dtype.itemsize
    if ints.dtype == np.int8:
        return v & 255
    if width == 1:
        return ((v << 1) | (v >> 7)) & 255
    return (v >> (8 * width - 9)) & 255


@pytest.mark.parametrize("every", [1, 4])
@pytest.mark.parametrize("npieces", [1, 3, 4, 6])
def test_count_chunks_is_the_three_planning_kernels_in_one_call(every, npieces):
    """count_chunks gives what count_pieces, chunk_refs and chunk_rows give, for chunks of
    one piece and of four; zeros (masked pieces), a short last piece and a random stream
    (left out) included."""
    rng = np.random.default_rng(npieces * 10 + every)
    n = (npieces - 1) * 65536 + 40000
    x = (rng.standard_normal(n) * np.logspace(-3, 0, n)).astype(np.float32)
    x[: n // 7] = 0
    bits = x.view(np.uint32)
    starts = np.arange(0, n, 65536, dtype=np.int64)
    lengths = np.minimum(starts + 65536, n) - starts
    ns = 4
    hist, zeros, coded = np.empty((npieces, ns, 256), np.int64), np.empty(npieces, np.int64), np.empty(ns, np.bool_)
    assert kp.count_pieces(bits, starts, lengths, every, 16, 1 << 15, 7.8, hist, zeros, coded) == kp.STATUS_OK
    counted = (lengths + every - 1) // every
    want = []
    for per in (1, 4):
        refs = np.empty(-(-npieces // per), np.int64)
        assert kp.chunk_refs(bits, starts, lengths, per, 7, refs) == kp.STATUS_OK
        rows = np.empty((len(refs), ns, 256), np.int64)
        assert kp.chunk_rows(hist, zeros, counted, refs, per, 7, coded, rows) == kp.STATUS_OK
        want.append(rows)
    got_zeros, got_coded = np.empty(npieces, np.int64), np.empty(ns, np.bool_)
    rows, rows_large = np.empty_like(want[0]), np.empty_like(want[1])
    assert (
        kp.count_chunks(bits, starts, lengths, every, 16, 1 << 15, 7.8, 7, 4, got_zeros, got_coded, rows, rows_large)
        == kp.STATUS_OK
    )
    assert np.array_equal(got_zeros, zeros) and np.array_equal(got_coded, coded) and not coded[3]
    assert np.array_equal(rows, want[0]) and np.array_equal(rows_large, want[1])
    assert kp.count_chunks(
        bits, starts, lengths, every, 16, 1 << 15, 7.8, 7, 2, got_zeros, got_coded, rows, rows_large
    ) == (kp.STATUS_OK if npieces == 1 else kp.STATUS_BAD_ARGS)  # wrong shape


def _alike_reference(rows, rows_large, per, spread):
    if not np.array_equal(np.add.reduceat(rows, np.arange(0, len(rows), per), axis=0), rows_large):
        return 0
    r = rows.reshape(-1, 256)
    n = np.maximum(r.sum(axis=1), 1)
    h = np.maximum(np.log2(n) - (r * np.log2(np.maximum(r, 1))).sum(axis=1) / n, 0.0).reshape(rows.shape[:2])
    return int(bool((h.max(axis=0) - h.min(axis=0) <= spread).all()))


@pytest.mark.parametrize("case", ["alike", "spread", "other-ref", "empty-row", "one"])
def test_chunks_alike_is_the_numpy_check(case):
    rng = np.random.default_rng(3)
    npieces = 1 if case == "one" else 4
    rows = np.zeros((npieces, 2, 256), np.int64)
    for p in range(npieces):
        rows[p, 0, :40] = rng.integers(100, 200, 40)
        rows[p, 1, 0] = 65536
    if case == "spread":
        rows[2, 0, :200] = rng.integers(100, 200, 200)  # a wider piece: higher entropy
    if case == "empty-row":
        rows[3] = 0
    large = rows.sum(axis=0, keepdims=True)
    if case == "other-ref":
        large = np.roll(large, 1, axis=2)  # a chunk whose reference differs from its pieces'
    want = _alike_reference(rows, large, 4, 0.05)
    assert kp.chunks_alike(rows, large, 4, 0.05) == want
    assert want == (1 if case in ("alike", "one") else 0)
    assert kp.chunks_alike(rows, large, 2, 0.05) == (1 if case == "one" else -1)


def test_chunks_alike_refuses_arguments_of_mismatched_shapes_with_minus_one():
    # -1, not a status code: 0 and 1 are its answers, and the planner tells a refusal by
    # its sign (STATUS_BAD_ARGS is 7, which read as "alike" would hide the bug).
    rows = np.zeros((4, 1, 256), dtype=np.int64)
    assert kp.chunks_alike(rows, np.zeros((3, 1, 256), dtype=np.int64), 2, 0.05) == -1
    assert kp.chunks_alike(rows, np.zeros((2, 2, 256), dtype=np.int64), 2, 0.05) == -1
    assert kp.chunks_alike(rows, np.zeros((2, 1, 256), dtype=np.int64), 0, 0.05) == -1
    assert kp.chunks_alike(rows, np.zeros((2, 1, 256), dtype=np.int64), 2, 0.05) == 1
