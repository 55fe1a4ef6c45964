"""The encoder's kernels: stream 0's pair packer, and the frame written in one call.

The packer reads stream 0's symbols two at a time from a buffer that
:func:`comm_codec.kernels.symbols.symbols0` fills, as indices into
:func:`comm_codec.kernels.encode.pair_tables`; steps with an escape go symbol by symbol
and a lane's last symbols go through scratch. The frames are checked by the naive
decoder, which insists on exact lane lengths and zero padding.
:func:`comm_codec.kernels.encode.encode_frame` must write the very bytes of the
planned path (plan, allocate, pack, header).
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

import comm_codec as cc
from comm_codec.books.profiler import WarmupProfiler
from comm_codec.core import frame as _frame
from comm_codec.core.streams import as_bits, spec_for
from comm_codec.kernels.encode import PAIR_ENTRIES, PAIR_SLOW, encode_frame_into, frame_room, pair_tables
from comm_codec.kernels.symbols import symbols0

import naive
from helpers import bits_equal, low_byte_books, low_byte_segments, low_byte_tensor

pytestmark = pytest.mark.unit


@njit(cache=False)
def _symbols0(view, sub, out):
    symbols0(view, sub, out)


def _stream0_bytes(bits: np.ndarray) -> np.ndarray:
    """Stream 0's byte of each element, as layout.py describes it."""
    v = bits.astype(np.int64) & ((1 << (8 * bits.itemsize)) - 1)
    if bits.dtype == np.int8:
        return v & 255
    if bits.itemsize == 1:
        return ((v << 1) | (v >> 7)) & 255
    return (v >> (8 * bits.itemsize - 9)) & 255


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.uint8, np.int8])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_symbols0_is_the_byte_minus_the_reference_at_any_length_and_alignment(dtype, offset):
    rng = np.random.default_rng(offset)
    info = np.iinfo(dtype)
    raw = rng.integers(info.min, info.max, 200, endpoint=True).astype(dtype)
    raw[:8] = [info.min, info.max, 0, 1, info.max - 1, info.min + 1, 0, info.max]
    for n in (0, 1, 3, 4, 5, 7, 8, 9, 31, 64, 150):
        view = raw[offset : offset + n]
        for sub in (0, 1, 7, 128, 200, 255):
            out = np.full(n + 8, 0xAB, dtype=np.uint8)
            _symbols0(view, sub, out)
            assert np.array_equal(out[:n], (_stream0_bytes(view) - sub) & 255), (n, sub)
            assert np.all(out[n:] == 0xAB), "wrote past the symbols"


def test_pair_tables_join_two_codes_or_mark_the_pair_slow():
    group = cc.CodebookSet.default().group("weight", "bf16", 0)
    codes = np.stack([b.tables()[0] for b in group])
    lens = np.stack([b.tables()[1] for b in group])
    pc = np.empty((len(group), PAIR_ENTRIES), dtype=np.uint32)
    pl = np.empty((len(group), PAIR_ENTRIES), dtype=np.uint8)
    pair_tables(codes, lens, pc, pl)
    a = np.tile(np.arange(256), 256)
    b = np.repeat(np.arange(256), 256)
    for k in range(len(group)):
        la, lb = lens[k][a].astype(np.int64), lens[k][b].astype(np.int64)
        fits = la + lb <= 32
        joined = codes[k][a].astype(np.int64) | (codes[k][b].astype(np.int64) << la)
        assert np.array_equal(pl[k], np.where(fits, la + lb, PAIR_SLOW))
        assert np.array_equal(pc[k], np.where(fits, joined, 0))
    assert (pl == PAIR_SLOW).any(), "these books escape rare symbols: some pairs must be slow"


def _wide_exponents(n: int, dtype, spread: int, seed: int) -> torch.Tensor:
    """Values whose exponents spread by up to ``spread`` octaves (wide spreads escape)."""
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(-spread, 1, (n,), generator=g).float()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    return (sign * torch.exp2(e) * (1 + torch.rand(n, generator=g))).to(dtype)


@settings(max_examples=30)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    lane=st.sampled_from([0, 1, 5, 60, 63, 64, 65, 69, 70, 71, 200]),
    extra=st.integers(0, 3),
    spread=st.sampled_from([0, 3, 40, 100]),
    seed=st.integers(0, 2**31),
    masked=st.booleans(),
)
def test_lanes_around_the_tail_and_with_escapes_decode_naively(dtype, lane, extra, spread, seed, masked):
    # Lanes of about 64 symbols end at the packer's tail limit; wide exponents with
    # books fitted on narrow ones send many symbols through the escape (slow steps).
    n = 4 * lane + extra
    x = _wide_exponents(n, dtype, spread, seed)
    if masked and n:
        x[torch.rand(n, generator=torch.Generator().manual_seed(seed)) < 0.3] = 0
    prof = WarmupProfiler(chunk_elems=1 << 14, max_books=2)
    prof.observe(_wide_exponents(5000, dtype, 2, seed + 1), "weight")
    books = prof.build()
    codec = cc.Codec(books)
    frame = codec.encode(x, "weight")
    bits_equal(naive.decode_frame(frame.numpy().tobytes(), naive.frame_books(books)), x)
    bits_equal(codec.decode(frame), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_frames_equal_across_threads_with_many_chunks(dtype):
    x = _wide_exponents(50_000, dtype, 12, 3)
    threads = (1, min(2, numba.config.NUMBA_NUM_THREADS))
    frames = [cc.Codec(threads=t, chunk_elems=1000).encode(x, "weight") for t in threads]
    assert torch.equal(frames[0], frames[1])
    bits_equal(cc.Codec().decode(frames[0]), x)


def test_stream0_of_each_spec_matches_the_naive_split():
    # symbols0 of a float type's element bits is the naive split's stream 0 (sub 0).
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = _wide_exponents(301, dtype, 30, 1)
        bits, spec = as_bits(x)
        assert spec is spec_for(dtype) or spec.name == spec_for(dtype).name
        out = np.empty(bits.size, dtype=np.uint8)
        _symbols0(bits, 0, out)
        assert out.tolist() == naive.split(x)[0]


def _sample(n: int, dtype, seed: int, zeros: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 3, (n,), generator=g).float())
    if zeros:
        x[torch.rand(n, generator=g) < zeros] = 0
    if dtype == torch.int8:
        return (x * 50).clamp(-128, 127).to(torch.int8)
    return x.to(dtype)


@settings(max_examples=40)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int8]),
    n=st.integers(1, 5000),
    seed=st.integers(0, 2**31),
    zeros=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    kind=st.sampled_from(["weight", "gradient", "optimizer_state", "activation"]),
    checksum=st.booleans(),
    chunk_elems=st.sampled_from([8, 333, 1024, 4096]),
)
def test_serial_frame_equals_the_planned_path(dtype, n, seed, zeros, kind, checksum, chunk_elems):
    codec = cc.Codec(threads=1, chunk_elems=chunk_elems, checksum=checksum)
    x = _sample(n, dtype, seed, zeros)
    if zeros == 0.5 and n > 100:
        x[n // 3 : n // 3 + chunk_elems] = 0  # an all-zero chunk among the others
    bits, spec = as_bits(x)
    serial = codec._encode_serial(bits, spec, kind)
    planned = codec._encode_planned(bits, spec, kind)
    assert serial.dtype == np.uint8 and serial.flags.c_contiguous and serial.ctypes.data % 8 == 0
    assert np.array_equal(serial, planned)
    assert np.array_equal(codec.encode_array(bits, spec, kind), planned)  # the path encode_array takes
    bits_equal(codec.decode(serial), x)


def test_serial_path_is_taken_for_one_chunk_or_one_thread(monkeypatch):
    # One thread: always the single pass (a 1.2 MB frame too, written into a pooled
    # block); threads: only a tensor of one chunk.
    for threads, n, serial in (
        (None, 1000, True),
        (None, 1001, False),
        (1, 5000, True),
        (1, 300_000, True),
        (None, 300_000, False),
    ):
        codec = cc.Codec(threads=threads, chunk_elems=1000)
        taken = []
        real = codec._encode_serial
        monkeypatch.setattr(codec, "_encode_serial", lambda *a: taken.append(1) or real(*a))
        x = _sample(n, torch.bfloat16, n, 0.0)
        x = x.repeat(2) if n == 300_000 else x  # 1.2 MB: over the pool's 1 MiB
        bits, spec = as_bits(x)
        frame = codec.encode_array(bits, spec, "weight")
        assert bool(taken) == serial, (threads, n)
        assert np.array_equal(frame, codec._encode_planned(bits, spec, "weight"))
        assert codec.frame_parameters(frame).nchunks == -(-x.numel() // 1000)
        bits_equal(codec.decode(torch.from_numpy(frame)), x)
        if serial and n == 300_000:  # the front of a recycled block, not a fresh array
            assert frame.base is not None and frame.base.size >= frame.size


def test_encode_frame_into_refuses_a_block_short_of_its_room():
    codec = cc.Codec(threads=1, chunk_elems=1000)
    x = _sample(5000, torch.bfloat16, 3, 0.0)
    bits, spec = as_bits(x)
    want = codec.encode_array(bits, spec, "weight")
    tables = codec._encode_tables("weight", spec)
    head = codec._heads[("weight", spec.name)]  # what the codec hands the kernel (version 1, no counts)
    args = (
        bits,
        1000,
        spec.exp_shift,
        tables.split,
        tables.enc_code,
        tables.enc_len,
        tables.nbooks,
        tables.raw,
        *tables.pairs,
        head,
        _frame.VERSION,
        codec.checksum,
    )
    room = frame_room(bits.size, 1000, spec.nstreams, head.size)
    for size in (0, 64, room - 1):
        out8 = np.full(size, 7, dtype=np.uint8)
        assert encode_frame_into(*args, out8) == -1
        assert (out8 == 7).all()  # nothing written
    out8 = np.empty(room + 100, dtype=np.uint8)
    pos = encode_frame_into(*args, out8)
    assert 0 < pos <= room and np.array_equal(out8[:pos], want)
    # No elements: the header alone, as the planned path writes it.
    empty = bits[:0]
    room = frame_room(0, 1000, spec.nstreams, head.size)
    out8 = np.empty(room, dtype=np.uint8)
    pos = encode_frame_into(empty, *args[1:], out8)
    assert np.array_equal(out8[:pos], codec._encode_planned(empty, spec, "weight"))


@pytest.mark.parametrize("zeros", [0.0, 0.03, 0.5, 1.0])
@pytest.mark.parametrize("chunk_elems", [333, 4096])
def test_int8_lanes_packed_from_the_elements_decode_naively(zeros, chunk_elems):
    # 1-byte integer lanes are packed straight from the elements (no symbol copy), at
    # odd offsets for odd chunk sizes, and their zeros are read off byte 0's count.
    x = _sample(20_011, torch.int8, 7, zeros)
    for codec in (cc.Codec(threads=1, chunk_elems=chunk_elems), cc.Codec(chunk_elems=chunk_elems)):
        frame = codec.encode(x, "weight")
        bits_equal(naive.decode_frame(frame.numpy().tobytes(), naive.frame_books(codec.codebooks)), x)
        bits_equal(codec.decode(frame), x)


def _narrow_books(dtype, max_books: int):
    """Books fitted on two octaves of exponents: wide data escapes, and its streams stop paying."""
    prof = WarmupProfiler(chunk_elems=1 << 12, max_books=max_books)
    for seed in range(4):
        prof.observe(_wide_exponents(8000, dtype, 1 + seed, seed), "weight")
    return prof.build()


@settings(max_examples=30)
@given(
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    n=st.integers(1, 9000),
    spread=st.sampled_from([0, 6, 40, 120]),
    seed=st.integers(0, 2**31),
    max_books=st.sampled_from([1, 4]),
    chunk_elems=st.sampled_from([8, 256, 1000, 4096]),
)
def test_serial_frame_equals_the_planned_path_where_streams_stop_paying(dtype, n, spread, seed, max_books, chunk_elems):
    # encode_frame writes coded streams without sizing them and falls back to raw once a
    # stream reaches its raw size, part way through any lane; groups of books are planned
    # first. Either way the bytes are the planned path's.
    codec = cc.Codec(_narrow_books(dtype, max_books), threads=1, chunk_elems=chunk_elems)
    x = _wide_exponents(n, dtype, spread, seed)
    bits, spec = as_bits(x)
    serial = codec._encode_serial(bits, spec, "weight")
    assert np.array_equal(serial, codec._encode_planned(bits, spec, "weight"))
    bits_equal(codec.decode(serial), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("share", [0.02, 0.2, 0.45])
def test_serial_frame_equals_the_planned_path_with_zeros_the_reference_sample_misses(dtype, share):
    # The reference reads every 16th element of a 4096-element chunk: zeros on odd
    # elements only are unseen there, so the chunk is written unmasked first and, where
    # the count says the mask pays, planned and written again.
    bits, spec = as_bits(_sample(50_000, dtype, 11, 0.0))
    ints = bits.view(np.dtype(f"i{bits.itemsize}"))
    ints[ints == 0] = 1
    odd = np.random.default_rng(5).random(ints.size) < 2 * share
    odd[::2] = False
    ints[odd] = 0
    _check_serial_is_planned(torch.from_numpy(ints).view(dtype), masked=share == 0.45)


def _check_serial_is_planned(x: torch.Tensor, masked: bool) -> None:
    """encode_frame's bytes are the planned path's for x, coded in 4096-element chunks with
    a single book per stream fitted to it (groups are planned first); with ``masked``
    every chunk takes the zero mask. The frame decodes to x, also naively."""
    prof = WarmupProfiler(chunk_elems=4096, max_books=1)
    prof.observe(x, "weight")
    codec = cc.Codec(prof.build(), threads=1, chunk_elems=4096)
    bits, spec = as_bits(x)
    serial = codec._encode_serial(bits, spec, "weight")
    assert np.array_equal(serial, codec._encode_planned(bits, spec, "weight"))
    if masked:
        assert (codec.frame_parameters(serial).table["cflags"] & 1).all(), "these chunks pay for the mask"
    bits_equal(codec.decode(serial), x)
    bits_equal(naive.decode_frame(serial.tobytes(), naive.frame_books(codec.codebooks)), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("share", [0.06, 0.12, 0.25, 0.6])
def test_serial_frame_equals_the_planned_path_with_zeros_the_reference_sample_sees(dtype, share):
    # The XOR of two checkpoints' weights: some 12 % zeros, which the reference's sample
    # sees, at a few bits each in books fitted to it. Whether the sample says to write
    # the chunk at once (the mask will not pay) or to plan it first, and whatever the
    # exact count then decides, the bytes are the planned path's.
    g = torch.Generator().manual_seed(int(share * 100))
    a = (torch.randn(60_000, generator=g) * 0.02).to(dtype)
    b = (a.float() + torch.randn(60_000, generator=g) * 2e-4).to(dtype)
    ints = (as_bits(a)[0] ^ as_bits(b)[0]).view(np.dtype(f"i{a.element_size()}"))
    ints[np.random.default_rng(3).random(ints.size) < share] = 0
    _check_serial_is_planned(torch.from_numpy(ints.copy()).view(dtype), masked=share == 0.6)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_later_stream_is_coded_only_where_it_saves_a_32nd(threads):
    # Stream 3 of fp32 (the lowest mantissa byte) decodes one 8-9-bit code a lookup, about
    # twice the time of copying it: coded 1-2 % under raw it costs more than it saves, so
    # every encoder stores it raw unless its segment is n >> 5 bytes under the chunk's n.
    chunk = 4096
    books = low_byte_books(chunk)
    book = books.group("weight", "fp32", 3)
    assert not book.raw and len(book.books) == 1
    x = low_byte_tensor(chunk, [0, 1, 0, 0, 1, 0, 0], seed=9)
    codec = cc.Codec(books, threads=min(threads, numba.config.NUMBA_NUM_THREADS), chunk_elems=chunk)
    bits, spec = as_bits(x)
    serial = codec._encode_serial(bits, spec, "weight")
    assert np.array_equal(serial, codec._encode_planned(bits, spec, "weight"))
    table = _frame.get_frame_parameters(serial).table
    coded = low_byte_segments(x, book.books[0], chunk)
    limit = chunk - (chunk >> 5)
    in_band = (coded > limit) & (coded < chunk)  # what the book saves there is under 1/32
    assert in_band.sum() >= 3 and (coded <= limit).sum() >= 2
    raw = (table["cflags"] & (_frame.CHUNK_RAW0 << 3)) != 0
    assert np.array_equal(raw, coded > limit)
    assert np.array_equal(table["sizes"][:, 3], np.where(raw, chunk, coded))
    bits_equal(codec.decode(serial), x)
    bits_equal(naive.decode_frame(serial.tobytes(), naive.frame_books(books)), x)
