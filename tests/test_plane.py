"""Split exponents: the plane kernels and the exponent code, against plain-Python references."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

import comm_codec as cc
from comm_codec.core.huffman import exponent_lengths, split_tables
from comm_codec.kernels.intrinsics import address
from comm_codec.kernels.plane import or_plane, plane_bytes, write_plane

import naive

pytestmark = pytest.mark.unit

SENTINEL = 0xA5


@numba.njit
def _write(sym, n, k, out, end_offset):
    write_plane(address(sym), n, k, address(out), address(out) + end_offset)


@numba.njit
def _spread(row, plane, n, k, end_offset):
    or_plane(address(row), address(plane), n, k, address(plane) + end_offset)


def _naive_plane(symbols, k) -> bytes:
    """k low bits a symbol, LSB first, in ceil(n / 8) groups of k bytes (frame_format.md)."""
    bits = [(s >> b) & 1 for s in symbols for b in range(k)]
    data = naive.bits_to_bytes(bits)
    return data + bytes(plane_bytes_py(len(symbols), k) - len(data))


def plane_bytes_py(n, k):
    return k * ((n + 7) // 8)


SIZES = [0, 1, 7, 8, 9, 31, 32, 33, 63, 64, 65, 127, 200, 257, 1000, 4099]


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("n", SIZES)
def test_write_plane_is_the_naive_packing_and_stays_inside_its_end(k, n):
    rng = np.random.default_rng(n * 7 + k)
    sym = rng.integers(0, 256, n + 8, dtype=np.uint8)  # high bits and slack of any value
    size = plane_bytes_py(n, k)
    for end in (size, (size + 7) & ~7, size + 40):  # tight, padded, room to spare
        out = np.full(size + 64, SENTINEL, dtype=np.uint8)
        _write(sym, n, k, out, end)
        assert out[:size].tobytes() == _naive_plane(sym[:n].tolist(), k)
        assert (out[max(end, size) :] == SENTINEL).all(), "written past the end"


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("n", SIZES)
def test_or_plane_puts_each_symbols_bits_under_its_exponent(k, n):
    rng = np.random.default_rng(n * 13 + k)
    low = rng.integers(0, 1 << k, n, dtype=np.uint8)
    high = (rng.integers(0, 256, n, dtype=np.uint8) >> k) << k
    size = plane_bytes_py(n, k)
    for end in (size, (size + 7) & ~7):
        # The plane at the very end of its array: reads must stay below end.
        plane = np.frombuffer(_naive_plane(low.tolist(), k) + bytes(end - size), dtype=np.uint8).copy()
        assert plane.size == end
        row = np.concatenate([high, np.zeros(8, dtype=np.uint8)])  # the 8 bytes of slack the caller gives
        _spread(row, plane, n, k, end)
        assert (row[:n] == (high | low)).all()


def test_plane_bytes():
    @numba.njit
    def sizes(ns, k):
        return [plane_bytes(n, k) for n in ns]

    assert sizes(np.array([0, 1, 8, 9, 16], dtype=np.int64), 3) == [0, 3, 3, 6, 6]


def _books():
    default = cc.CodebookSet.default()
    out = [
        (b, dt)
        for dt in ("fp16", "fp8_e4m3", "fp8_e5m2")
        for kind in ("gradient", "weight")
        for b in default.group(kind, dt, 0)
        if not b.raw
    ]
    rng = np.random.default_rng(3)
    for _ in range(6):
        counts = rng.integers(0, 1000, 256) * (rng.random(256) < 0.4)
        counts[rng.integers(0, 256)] += 100000
        out.append((cc.Codebook.from_counts(counts, raw_threshold=None), "fp16"))
    return out


@pytest.mark.parametrize("shift", [3, 4])
def test_exponent_lengths_are_the_naive_derivation_and_a_complete_code(shift):
    for book, _ in _books():
        got = exponent_lengths(book, shift).tolist()
        assert got == naive.exponent_lengths([int(x) for x in book.lengths], book.escape_length, shift)
        assert naive.kraft_sum_times(got, 0) == 1 << 12  # every 12-bit window decodes: no escape needed
        assert max(got) <= 12 and min(got) >= 1


def test_split_tables_index_by_the_symbol_byte_and_decode_to_the_shifted_exponent():
    book = cc.CodebookSet.default().group("weight", "fp16", 0)[0]
    code, length, dec = split_tables(book, 3)
    codes = naive.canonical_codes(exponent_lengths(book, 3).tolist(), 0)  # MSB first

    def reversed_bits(value, n):
        return sum(((value >> i) & 1) << (n - 1 - i) for i in range(n))

    for b in range(256):
        c, n = codes[b >> 3]
        assert (int(code[b]), int(length[b])) == (reversed_bits(c, n), n)  # sent LSB first
    by_window = {}
    for e, (c, n) in codes.items():
        for rest in range(1 << (12 - n)):
            by_window[reversed_bits(c, n) | (rest << n)] = (e << 3) | (n << 8)
    assert len(by_window) == 4096  # a complete code: every window starts one
    assert dec.tolist() == [by_window[x] for x in range(4096)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_split_and_unsplit_frames_decode_alike_with_either_codec(dtype):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(70001, generator=g) * (1e-2 if dtype == torch.float16 else 4)).to(dtype)
    x.view(torch.uint8 if x.element_size() == 1 else torch.int16)[1000:9000] = 0
    frames = {split: cc.Codec(split_exponent=split).encode(x) for split in (True, False)}
    assert cc.get_frame_parameters(frames[True]).split == cc.core.streams.spec_for(dtype).split_bits
    assert cc.get_frame_parameters(frames[False]).split == 0
    for f in frames.values():
        for split in (True, False):
            assert torch.equal(cc.Codec(split_exponent=split).decode(f).view(torch.uint8), x.view(torch.uint8))
