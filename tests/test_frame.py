"""The frame format: golden bytes, the naive decoder, header parsing and its errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comm_codec as cc
from comm_codec.core import frame

import naive
from helpers import bits_equal, fix_header_crc

pytestmark = pytest.mark.unit


# -- a tiny explicit codebook set and inputs, for frames whose bytes are pinned ---------------
def golden_books() -> cc.CodebookSet:
    exp = np.zeros(256)
    # Relative exponents: 0 = the chunk's reference, 255 = one below it, 1 = one above...
    exp[[0, 255, 254, 1, 253, 2, 252]] = [40, 25, 15, 10, 6, 3, 1]
    i8 = np.zeros(256)
    i8[[0, 1, 255, 2, 254, 3, 253]] = [30, 20, 20, 10, 10, 5, 5]
    return cc.CodebookSet(
        {
            ("gradient", "bf16", 0): cc.Codebook.from_counts(exp),
            ("gradient", "bf16", 1): cc.Codebook.from_counts(np.ones(256)),  # raw
            ("gradient", "int8", 0): cc.Codebook.from_counts(i8),
        }
    )


def golden_bf16() -> torch.Tensor:
    """160 bf16 values: a dense chunk, an all-zero chunk, a mostly-zero chunk with -0.0 and inf."""
    rel = [0, -1, 0, -2, 1, 0, -1, 0, 2, -1, 0, -3, 0]
    vals = []
    for i in range(64):
        mant = 1 + ((i * 37) % 128) / 128
        vals.append((-1) ** i * mant * 2.0 ** (rel[(i * 5) % 13] - 6))
    vals += [0.0] * 64
    for i in range(32):
        vals.append(0.0 if i % 3 else (i - 16) * 0.125)
    vals[130] = -0.0
    vals[131] = float("inf")
    return torch.tensor(vals, dtype=torch.float32).to(torch.bfloat16)


def golden_int8() -> torch.Tensor:
    """84 int8 values: a chunk of small values (coded) and a 20-element chunk of spread ones (raw)."""
    vals = [((i * 5) % 7) - 3 for i in range(64)] + [(i * 29) % 256 - 128 for i in range(20)]
    return torch.tensor(vals, dtype=torch.int8)


# Pinned frames, one line per section. Generated once by Codec.encode, then checked by hand
# against the documented layout (and by naive.decode_frame below).
GOLDEN_BF16 = "".join(
    [
        # magic "CCFR", version 1, dtype 1 (bf16), 2 streams, flags 1 (checksums), numel 160,
        # chunk_elems 64, nchunks 3
        "4343465201010201a0000000000000004000000003000000",
        # book ids: stream 0 ef91d20e5c0f5c91, stream 1 raw (0)
        "915c0f5c0ed291ef0000000000000000",
        # chunk table: cflags, ref, 0, checksum, size[0], size[1]
        "207900007609c9333000000040000000",  # RAW1, ref 121 (2^-6), 48 + 64 bytes
        "020000008b9710a60000000000000000",  # ZERO
        "317f000057b923150c0000000c000000",  # MASK|RAW0|RAW1, ref 127, 12 + 12
        # header CRC-32, zero
        "f40f325200000000",
        # chunk 0 stream 0: four lane byte lengths, four lanes padded to 8 bytes
        "05000000050000000500000005000000",
        "c0556f1f00000000b8eaed030000000057bd7dc015000000bd7dc0556f000000",
        # chunk 0 stream 1, raw: 64 bytes
        "004b94df2873bc07509be42f78c30c57a0eb347fc8135ca7f03b84cf1863acf7",
        "408bd41f68b3fc4790db246fb8034c97e02b74bf08539ce7307bc40f58a3ec37",
        # chunk 2: 32-bit zero mask, stream 0 (12 bytes + pad), stream 1 (12 bytes + pad)
        "4d92244900000000",
        "01818000fffffdfeff00000000000000",
        "01010041c1010100400060c000000000",
    ]
)

GOLDEN_INT8 = "".join(
    [
        # magic, version 1, dtype 6 (int8), 1 stream, flags 0 (no checksums), numel 84, 64, 2 chunks
        "434346520106010054000000000000004000000002000000",
        "ac70c2ed041cfd65",  # book id 65fd1c04edc270ac
        "00000000000000003000000000000000",  # coded, 48 bytes (entry padded to 16)
        "10000000000000001400000000000000",  # RAW0, 20 bytes
        "bd02515f00000000",
        "07000000070000000700000007000000",
        "57f6e295bd780500ecc52b7bf1ca00002f5ed98b57f602005ed98b57f6e20100",
        "809dbad7f4112e4b6885a2bfdcf91633506d8aa700000000",
    ]
)


def golden_group_books() -> cc.CodebookSet:
    """golden_books, with bf16 stream 0 a group: the narrow book, then a wide one."""
    narrow = golden_books().get("gradient", "bf16", 0)
    wide = np.zeros(256)
    wide[[0, 255, 1, 254, 2, 253, 3, 252, 4, 251, 5]] = [12, 12, 11, 11, 10, 9, 9, 8, 8, 7, 7]
    return golden_books() | cc.CodebookSet(
        {
            ("gradient", "bf16", 0): cc.CodebookGroup([narrow, cc.Codebook.from_counts(wide)]),
        }
    )


def golden_bf16_spread() -> torch.Tensor:
    """128 bf16 values: a chunk of exponents near one value, a chunk spread over +-5 binades."""
    near = [2.0 ** (-6 + [0, -1, 0, -2, 1, 0, -1, 0][i % 8]) * (1 + (i % 5) / 8) for i in range(64)]
    offsets = [0, 1, -1, 0, 2, -2, 0, 3, -3, 4, -4, 5, -5]
    spread = [(-1) ** i * 2.0 ** (-6 + offsets[i % 13]) * (1 + (i % 3) / 4) for i in range(64)]
    return torch.tensor(near + spread, dtype=torch.float32).to(torch.bfloat16)


GOLDEN_BF16_GROUP = "".join(
    [
        # magic, version 2 (a chunk names a book), bf16, 2 streams, checksums, numel 128, 64, 2 chunks
        "434346520201020180000000000000004000000002000000",
        # stream 0: the group's id e526973b2c04a70d (not a book's), stream 1 raw
        "0da7042c3b9726e50000000000000000",
        # chunk table: cflags, ref, books (stream 0 in bits 0-3), checksum, sizes
        "207900003b51b25c3000000040000000",  # RAW1, ref 121, book 0
        "20790100888aa0183000000040000000",  # RAW1, ref 121, book 1 (wide)
        "591521cd00000000",
        # chunk 0: stream 0 coded with the narrow book (lane lengths, lanes), stream 1 raw
        "04000000040000000400000004000000",
        "b213d90900000000b213d90900000000b213d90900000000b213d90900000000",
        "0020406080002040608000204060800020406080002040608000204060800020",
        "4060800020406080002040608000204060800020406080002040608000204060",
        # chunk 1: stream 0 with the wide book, stream 1 raw
        "07000000070000000800000008000000",
        "6020a3aef70d18009051d7fb060c6400a8eb7d030632ea00bd6fc040465def03",
        "0041800140810041800140810041800140810041800140810041800140810041",
        "8001408100418001408100418001408100418001408100418001408100418001",
    ]
)

GOLDEN = {
    "bf16": (golden_bf16, True, GOLDEN_BF16),
    "int8": (golden_int8, False, GOLDEN_INT8),
    "bf16-group": (golden_bf16_spread, True, GOLDEN_BF16_GROUP),
}


@pytest.fixture(scope="module")
def books():
    return golden_books()


def _books_for(name):
    return golden_group_books() if name.endswith("-group") else golden_books()


def _encode(books, name):
    make, checksum, _ = GOLDEN[name]
    return cc.Codec(_books_for(name) if name.endswith("-group") else books, chunk_elems=64, checksum=checksum).encode(
        make()
    )


def test_golden_books_are_the_expected_ones(books):
    assert books.get("gradient", "bf16", 0).id == "ef91d20e5c0f5c91"
    assert books.get("gradient", "bf16", 1).raw
    assert books.get("gradient", "int8", 0).id == "65fd1c04edc270ac"


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_bytes(books, name):
    got = _encode(books, name).numpy().tobytes()
    assert got.hex() == GOLDEN[name][2]


@pytest.mark.parametrize("name", GOLDEN)
def test_golden_frames_decode(books, name):
    make, checksum, hexes = GOLDEN[name]
    data = bytes.fromhex(hexes)
    books = _books_for(name)
    want = make()
    bits_equal(cc.Codec(books, chunk_elems=64).decode(data), want)
    # Any chunk size and checksum setting decodes it: the frame describes itself.
    bits_equal(cc.Codec(books, chunk_elems=8, checksum=not checksum).decode(data), want)
    bits_equal(naive.decode_frame(data, naive.frame_books(books)), want)


def test_get_frame_parameters_fields(books):
    f = _encode(books, "bf16")
    p = cc.get_frame_parameters(f)
    # Single books: the oldest version that can express the frame.
    assert p.version == 1 and frame.VERSION == 2
    assert p.spec.dtype == p.dtype == torch.bfloat16
    assert (p.numel, p.chunk_elems, p.nchunks) == (160, 64, 3)
    assert p.book_ids == ("ef91d20e5c0f5c91", "0" * 16)
    assert p.checksums is True
    assert p.header_bytes == frame.header_size(2, 3) == 24 + 16 + 3 * 16 + 8 == 96
    assert p.frame_bytes == len(f) == 248
    assert p.table["cflags"].tolist() == [
        frame.CHUNK_RAW0 << 1,
        frame.CHUNK_ZERO,
        frame.CHUNK_MASK | frame.CHUNK_RAW0 | frame.CHUNK_RAW0 << 1,
    ]
    assert p.table["ref"].tolist() == [121, 0, 127]
    assert p.table["sizes"].tolist() == [[48, 64], [0, 0], [12, 12]]
    assert p.offsets.tolist() == [96, 208, 208]
    # The same from numpy and from bytes.
    for form in (f.numpy(), f.numpy().tobytes(), bytearray(f.numpy().tobytes())):
        q = cc.get_frame_parameters(form)
        assert (q.numel, q.book_ids, q.frame_bytes) == (p.numel, p.book_ids, p.frame_bytes)
    q = cc.get_frame_parameters(_encode(books, "int8"))
    assert q.dtype == torch.int8 and q.checksums is False and q.book_ids == ("65fd1c04edc270ac",)
    assert q.table["sizes"].tolist() == [[48], [20]]
    assert q.table.dtype.itemsize == frame.table_dtype(1).itemsize == 16


def test_layout_constants():
    assert frame.MAGIC == b"CCFR" and frame.HEADER_BYTES == 24
    assert [frame.table_dtype(ns).itemsize for ns in (1, 2, 4)] == [16, 16, 24]
    assert frame.header_size(4, 0) == 24 + 32 + 8
    assert frame.pad8(0) == 0 and frame.pad8(1) == 8 and frame.pad8(16) == 16


def test_empty_tensor_frame(books):
    f = cc.Codec(books).encode(torch.empty(0, dtype=torch.bfloat16))
    p = cc.get_frame_parameters(f)
    assert (p.numel, p.nchunks, p.frame_bytes) == (0, 0, frame.header_size(2, 0)) == (0, 0, 48)
    assert cc.Codec(books).decode(f).shape == (0,)


# -- the naive decoder on kernel output -------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_single_chunk_single_stream_lanes_match_naive_coder(dtype):
    # One chunk, one stream, coded: the kernel's lane bytes are exactly what the naive
    # encoder makes of the symbols, and the naive decoder reads them back.
    g = torch.Generator().manual_seed(7)
    n = 203
    if dtype == torch.int8:
        vals = torch.randint(-3, 4, (n,), generator=g, dtype=torch.int8)
        vals[vals == 0] = 1
        vals[[5, 77]] = torch.tensor([100, -128], dtype=torch.int8)  # escaped symbols
    else:
        v32 = torch.randn(n, generator=g) * 0.3
        v32[v32.abs() < 2**-9] = 0.5  # no zeros (they would be masked)
        v32[9] = 448.0  # a far exponent: escaped
        vals = v32.to(dtype)
    counts = np.zeros(256)
    syms = naive.split(vals)[0]
    # A book from this data's symbols (relative to the reference the kernel will pick).
    p0 = cc.get_frame_parameters(
        cc.Codec(cc.CodebookSet({("gradient", dtype, 0): cc.Codebook.raw_book()}), chunk_elems=256).encode(vals)
    )
    ref = int(p0.table["ref"][0])
    shift = naive.LAYOUT[dtype][2]
    rel = [(b - (ref << shift)) & 0xFF if shift is not None else b for b in syms]
    for s in rel:
        counts[s] += 1
    counts[rel[5 if dtype == torch.int8 else 9]] = 0  # leave one symbol to the escape
    book = cc.Codebook.from_counts(counts)
    assert not book.raw and book.escape_length
    codec = cc.Codec(
        cc.CodebookSet({("gradient", dtype, 0): book}), chunk_elems=256, checksum=False, split_exponent=False
    )
    f = codec.encode(vals)
    p = cc.get_frame_parameters(f)
    assert p.nchunks == 1 and p.table["cflags"][0] == 0 and int(p.table["ref"][0]) == ref and p.split == 0
    seg = f.numpy().tobytes()[p.header_bytes :]
    assert len(seg) == int(p.table["sizes"][0][0])
    _check_lanes(seg, rel, book.lengths, book.escape_length)
    bits_equal(naive.decode_frame(f.numpy().tobytes(), naive.frame_books(codec.codebooks)), vals)
    if dtype == torch.float8_e4m3fn:
        # Split exponents: the lanes code rel >> 3 (e4m3's exponent and top mantissa bit)
        # with the code derived from the book (no escape), and a plane of the 3 bits
        # under them follows.
        f = cc.Codec(cc.CodebookSet({("gradient", dtype, 0): book}), chunk_elems=256, checksum=False).encode(vals)
        p = cc.get_frame_parameters(f)
        assert (p.version, p.split, int(p.table["cflags"][0]), int(p.table["ref"][0])) == (3, 3, 0, ref)
        seg = f.numpy().tobytes()[p.header_bytes :]
        size = int(p.table["sizes"][0][0])
        plane = 3 * ((n + 7) // 8)
        lengths = naive.exponent_lengths([int(x) for x in book.lengths], book.escape_length, 3)
        _check_lanes(seg[: size - plane], [r >> 3 for r in rel], lengths + [0] * (256 - len(lengths)), 0)
        low = naive.bytes_to_bits(seg[size - plane : size])
        assert [sum(low[3 * j + b] << b for b in range(3)) for j in range(n)] == [r & 7 for r in rel]
        assert not any(low[3 * n :])
        bits_equal(naive.decode_frame(f.numpy().tobytes(), naive.frame_books(codec.codebooks)), vals)


def _check_lanes(seg, symbols, lengths, escape_length):
    """The segment's four lanes are exactly the naive coder's bytes of the symbols."""
    n = len(symbols)
    lane_bytes = [int.from_bytes(seg[4 * k : 4 * k + 4], "little") for k in range(4)]
    pos = 16
    for k in range(4):
        lane_syms = symbols[k * n // 4 : (k + 1) * n // 4]
        want = naive.bits_to_bytes(naive.encode_bits(lane_syms, lengths, escape_length))
        assert lane_bytes[k] == len(want)
        assert seg[pos : pos + len(want)] == want, f"lane {k}"
        pos += naive.pad8(len(want))
    assert naive.decode_lanes(seg, n, [int(x) for x in lengths], escape_length) == symbols


def _tensor(dtype, n, seed, zero_frac, scale):
    g = torch.Generator().manual_seed(seed)
    if dtype in (torch.int8, torch.uint8):
        x = (torch.randn(n, generator=g) * scale * 10).round().clamp(-128, 127)
        x = x.to(torch.int8).view(dtype) if dtype == torch.uint8 else x.to(dtype)
        x = x.clone()
    else:
        x = (torch.randn(n, generator=g) * scale).to(dtype)
    zero = torch.rand(n, generator=g) < zero_frac
    x.view(torch.uint8 if x.element_size() == 1 else {2: torch.int16, 4: torch.int32}[x.element_size()])[zero] = 0
    return x


@settings(max_examples=60)
@given(
    dtype=st.sampled_from(cc.SUPPORTED_DTYPES),
    n=st.integers(0, 300),
    seed=st.integers(0, 2**31),
    zero_frac=st.sampled_from([0.0, 0.1, 0.6, 0.97, 1.0]),
    scale=st.sampled_from([1e-6, 1.0, 300.0]),
    chunk_elems=st.sampled_from([8, 64, 1024]),
    checksum=st.booleans(),
)
@pytest.mark.slow
def test_naive_decoder_reads_codec_frames(default_books, dtype, n, seed, zero_frac, scale, chunk_elems, checksum):
    x = _tensor(dtype, n, seed, zero_frac, scale)
    kind = "gradient"
    f = cc.Codec(default_books, chunk_elems=chunk_elems, checksum=checksum).encode(x, kind=kind)
    bits_equal(naive.decode_frame(f.numpy().tobytes(), naive.frame_books(default_books)), x)


# -- parse errors -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_frame(books):
    return _encode(books, "bf16").numpy().tobytes()


def _edit(data: bytes, pos: int, value: int, fix_crc: bool = True) -> bytes:
    buf = bytearray(data)
    buf[pos] = value
    return fix_header_crc(buf) if fix_crc else bytes(buf)


def test_bad_magic(books, small_frame):
    with pytest.raises(cc.FrameError, match=r"not a comm_codec frame: magic b'XCFR', expected b'CCFR'"):
        cc.get_frame_parameters(b"X" + small_frame[1:])
    with pytest.raises(cc.FrameError, match="not a comm_codec frame"):
        cc.Codec(books).decode(b"X" + small_frame[1:])


def test_wrong_version(books, small_frame):
    with pytest.raises(cc.FrameError, match="unsupported frame version 4; this build reads versions 1, 2, 3"):
        cc.Codec(books).decode(_edit(small_frame, 4, 4))
    with pytest.raises(
        cc.FrameError,
        match="frame version 3 without the split-exponent flag: version 3 frames, and only they, split exponents",
    ):
        cc.Codec(books).decode(_edit(small_frame, 4, 3))
    with pytest.raises(cc.FrameError, match="unsupported frame version 0"):
        cc.Codec(books).decode(_edit(small_frame, 4, 0))
    # Version 2 with every books field 0 is the same frame.
    out = cc.Codec(books).decode(_edit(small_frame, 4, 2))
    assert bits_equal(out, cc.Codec(books).decode(small_frame))


def test_split_exponent_flag_is_checked_against_version_and_dtype(books, small_frame):
    # bf16's stream 0 is its exponent alone: nothing to split.
    with pytest.raises(
        cc.FrameError, match="frame says its bf16 exponents are split, but bf16 has no bits under its exponent"
    ):
        cc.get_frame_parameters(_edit(_edit(small_frame, 7, 0x03), 4, 3))
    split = cc.Codec().encode(torch.linspace(-3, 3, 5000, dtype=torch.float16), kind="gradient")
    data = split.numpy().tobytes()
    p = cc.get_frame_parameters(data)
    assert (p.version, p.split) == (3, 3)
    with pytest.raises(cc.FrameError, match="frame version 2 with the split-exponent flag"):
        cc.get_frame_parameters(_edit(data, 4, 2))
    with pytest.raises(cc.FrameError, match="frame version 3 without the split-exponent flag"):
        cc.get_frame_parameters(_edit(data, 7, data[7] & ~0x02))
    with pytest.raises(cc.FrameError, match="unknown frame flags 0x05"):
        cc.get_frame_parameters(_edit(data, 7, 0x05))
    raw_books = cc.CodebookSet({("gradient", "fp16", s): cc.Codebook.raw_book() for s in (0, 1)})
    plain = cc.Codec(raw_books).encode(torch.linspace(-3, 3, 5000, dtype=torch.float16), kind="gradient")
    assert cc.get_frame_parameters(plain).version == 1  # nothing coded: not split
    with pytest.raises(cc.FrameError, match=r"exponents are split, but its stream 0 is stored raw \(book id 0\)"):
        cc.get_frame_parameters(_edit(_edit(plain.numpy().tobytes(), 7, 0x03), 4, 3))


def test_unknown_dtype_code(books, small_frame):
    for code in (0, 8, 255):
        with pytest.raises(cc.FrameError, match=f"unknown dtype code {code} in frame header"):
            cc.Codec(books).decode(_edit(small_frame, 5, code))
    # A known code with the wrong stream count.
    with pytest.raises(cc.FrameError, match="frame says 2 streams, but fp32 has 4"):
        cc.Codec(books).decode(_edit(small_frame, 5, 3))


def test_unknown_flags_and_chunk_count(books, small_frame):
    with pytest.raises(cc.FrameError, match="unknown frame flags 0x81"):
        cc.Codec(books).decode(_edit(small_frame, 7, 0x81))
    with pytest.raises(cc.FrameError, match="frame has 4 chunks, expected 3 for 160 elements"):
        cc.Codec(books).decode(_edit(small_frame, 20, 4))
    with pytest.raises(cc.FrameError, match=r"chunk_elems 0 is outside 1\.\.67108864"):
        cc.Codec(books).decode(_edit(_edit(small_frame, 16, 0), 20, 3))


def test_truncated_at_every_length(books, small_frame):
    codec = cc.Codec(books)
    for n in range(len(small_frame)):
        with pytest.raises(cc.FrameError):
            codec.decode(small_frame[:n])
    with pytest.raises(cc.FrameError, match="frame too short: 10 bytes"):
        codec.decode(small_frame[:10])
    with pytest.raises(cc.FrameError, match="frame truncated: 240 bytes, the chunk table describes 248"):
        codec.decode(small_frame[:240])


def test_extra_trailing_bytes(books, small_frame):
    for extra in (1, 8, 100):
        with pytest.raises(cc.FrameError, match="longer than its chunk table says"):
            cc.Codec(books).decode(small_frame + bytes(extra))


def test_header_crc_mismatch(books, small_frame):
    # A byte of the chunk table (chunk 0's checksum) changed, CRC left as it was.
    with pytest.raises(cc.FrameError, match=r"frame header is corrupted \(CRC-32 mismatch\)"):
        cc.Codec(books).decode(_edit(small_frame, 60, small_frame[60] ^ 0x10, fix_crc=False))
    # Any single-bit change in the CRC-covered header is caught.
    for pos in range(8, 88):
        bad = _edit(small_frame, pos, small_frame[pos] ^ 0x04, fix_crc=False)
        with pytest.raises(cc.FrameError):
            cc.get_frame_parameters(bad)


def test_chunk_table_consistency_checks(books, small_frame):
    codec = cc.Codec(books)
    entry = lambda c: 40 + 16 * c  # noqa: E731
    with pytest.raises(cc.FrameError, match="chunk 0 has unknown flags 0x60"):
        codec.decode(_edit(small_frame, entry(0), 0x60))
    with pytest.raises(cc.FrameError, match="chunk 1 is flagged all-zero but has a mask"):
        codec.decode(_edit(small_frame, entry(1), 0x03))
    with pytest.raises(cc.FrameError, match="stream 1 has no codebook, but chunk 0 says it is coded"):
        codec.decode(_edit(small_frame, entry(0), 0x00))
    with pytest.raises(cc.FrameError, match="chunk 0 stream 1 is raw but holds 60 bytes for 64 elements"):
        codec.decode(_edit(small_frame, entry(0) + 12, 60))
    with pytest.raises(cc.FrameError, match="chunk 0 stream 0 size 200 is impossible for 64 elements"):
        codec.decode(_edit(small_frame, entry(0) + 8, 200))


def test_frame_type_errors(books, small_frame):
    codec = cc.Codec(books)
    with pytest.raises(TypeError, match="1-D torch.uint8 tensor, got torch.int8"):
        codec.decode(torch.zeros(8, dtype=torch.int8))
    with pytest.raises(TypeError, match=r"shape \(2, 4\)"):
        codec.decode(torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(TypeError, match="1-D uint8 array"):
        codec.decode(np.zeros(8, dtype=np.int16))
    with pytest.raises(TypeError, match="got list"):
        codec.decode(list(small_frame))


def test_frame_error_is_a_value_error():
    assert issubclass(cc.FrameError, ValueError)


def test_books_field_in_version_1_and_crc_padding_are_refused(books, small_frame):
    table_start = frame.HEADER_BYTES + 8 * 2
    with pytest.raises(cc.FrameError, match="chunk 0 names a book, which version 1 frames cannot"):
        cc.Codec(books).decode(_edit(small_frame, table_start + 2, 1))
    hsize = frame.header_size(2, 3)
    with pytest.raises(cc.FrameError, match="CRC-32 mismatch"):
        cc.Codec(books).decode(_edit(small_frame, hsize - 1, 1, fix_crc=False))


def test_chunk_elems_above_the_limit_is_refused(books, small_frame):
    data = bytearray(small_frame)
    data[16:20] = (frame.MAX_CHUNK_ELEMS + 1).to_bytes(4, "little")
    with pytest.raises(cc.FrameError, match="chunk_elems 67108865 is outside"):
        cc.Codec(books).decode(bytes(data))
