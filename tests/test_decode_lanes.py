"""The decoder's lane loop on bad codes: every lane stalled, and lanes stalled mid-chunk.

The fast loop lets a lane that meets a bit pattern that is no code stall in place (no
flag is carried through the loop); these frames make sure such a lane always ends in
the "no code" status, also when all four lanes stall at once (the loop must notice and
stop) and when the bad code sits deep inside a long chunk.
"""

import numpy as np
import pytest
import torch

import comm_codec as cc

from helpers import bits_equal

pytestmark = pytest.mark.unit


def _codec_and_frame(n: int, escapes: float = 0.01):
    # An incomplete code (Kraft sum 7/8): 1/8 of all bit patterns are no code.
    lengths = np.zeros(256, dtype=np.int64)
    lengths[[1, 2, 3]] = [1, 3, 3]
    book = cc.Codebook(lengths, escape_length=3)
    codec = cc.Codec(cc.CodebookSet({("gradient", "uint8", 0): book}), chunk_elems=n, checksum=False)
    gen = torch.Generator().manual_seed(n)
    x = torch.ones(n, dtype=torch.uint8)
    x[torch.rand(n, generator=gen) < 0.3] = 2
    x[torch.rand(n, generator=gen) < escapes] = 200  # escapes
    f = codec.encode(x)
    p = cc.get_frame_parameters(f)
    assert p.table["cflags"].tolist() == [0]  # one coded chunk, no mask
    bits_equal(codec.decode(f), x)
    return codec, f, p


def _lane_starts(f: np.ndarray, p) -> list:
    """Byte offsets in the frame of the chunk's four lanes (the lane header holds their byte lengths)."""
    pos = p.header_bytes
    lens = f[pos : pos + 16].view("<u4").astype(np.int64)
    starts, at = [], pos + 16
    for lb in lens:
        starts.append(at)
        at += 8 * ((lb + 7) // 8)
    return starts


@pytest.mark.parametrize("where", ["start", "middle"])
def test_every_lane_on_a_bad_code_is_reported(where):
    n = 1 << 14
    codec, f, p = _codec_and_frame(n)
    bad = f.numpy().copy()
    starts = _lane_starts(bad, p)
    rng = np.random.default_rng(1)
    for s in starts:
        at = s if where == "start" else s + (starts[1] - starts[0]) // 2
        bad[at : at + 48] = 0xFF  # all ones: the 7/8 code's missing pattern, again and again
    with pytest.raises(cc.FrameError, match="chunk 0 of 1 is bad: bit pattern that is no code"):
        codec.decode(bad)
    for seed in range(20):  # one lane at a time, random bytes at a random place
        bad = f.numpy().copy()
        k = seed % 4
        at = starts[k] + int(rng.integers(0, 300))
        bad[at : at + 8] = 0xFF
        with pytest.raises(cc.FrameError, match="chunk 0 of 1 is bad"):
            codec.decode(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int8])
def test_masked_chunks_round_trip_bit_exact(dtype):
    # Masked chunks (more than 1/8 exact zeros) are assembled a mask byte at a time:
    # zero runs, scattered zeros, a last byte with fewer than 8 elements, and the
    # special values must all come back bit for bit.
    gen = torch.Generator().manual_seed(7)
    n = 3 * 1021 + 5  # three full chunks and a short fourth
    x = torch.randn(n, generator=gen) * 0.02
    x[torch.rand(n, generator=gen) < 0.45] = 0  # scattered zeros
    x[1024 : 1024 + 200] = 0  # a run of zero bytes in the mask
    x[2048 : 2048 + 1024 : 2] = 0
    if dtype == torch.int8:
        x = torch.round(x * 3000).clamp(-128, 127).to(dtype)
    else:
        x = x.to(dtype)
        x[5] = float("nan")
        x[6] = float("inf")
        x[7] = float("-inf")
        x[9] = -0.0
    codec = cc.Codec(chunk_elems=1021)  # not a multiple of 8: every chunk's mask ends in a partial byte
    f = codec.encode(x, kind="gradient")
    p = cc.get_frame_parameters(f)
    assert (p.table["cflags"][:3] & 0x01).all()  # the full chunks are masked
    bits_equal(codec.decode(f), x)


def _escape_codec(n: int) -> "cc.Codec":
    # Codes of 1..12 bits for symbols 1..11 and 0 and an 11-bit escape: short codes fill
    # a 12-bit window with up to six symbols, long ones leave it with one. Zero's code
    # is long, so a chunk with many zeros is masked.
    lengths = np.zeros(256, dtype=np.int64)
    lengths[[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 0]] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 12]
    book = cc.Codebook(lengths, escape_length=11)
    return cc.Codec(cc.CodebookSet({("gradient", "uint8", 0): book}), chunk_elems=n, checksum=False)


@pytest.mark.parametrize("n", [400, 1021, 1 << 14])
@pytest.mark.parametrize("layout", ["scattered", "runs", "lane edges", "dense"])
@pytest.mark.parametrize("masked", [False, True], ids=["dense chunk", "masked chunk"])
def test_escapes_anywhere_round_trip(n, layout, masked):
    # The fast loop leaves a round when a lane meets an escape, decodes that symbol
    # alone and goes on: escapes in every lane, in runs, on the first and last symbols
    # of each lane and one symbol in ten must all come back, in chunks too short for
    # more than a round or two too (shorter ones are stored raw: lane headers). A
    # 1-byte chunk is decoded straight into the output, a masked one through the rows
    # and the assembly.
    codec = _escape_codec(n)
    gen = torch.Generator().manual_seed(n)
    x = torch.randint(1, 12, (n,), generator=gen, dtype=torch.uint8)
    x[torch.rand(n, generator=gen) < 0.5] = 1  # mostly 1-bit codes: six symbols a lookup
    escaped = torch.randint(12, 256, (n,), generator=gen, dtype=torch.uint8)
    if layout == "scattered":
        where = torch.rand(n, generator=gen) < 0.02
    elif layout == "runs":
        where = torch.arange(n) % 40 < 5
    elif layout == "lane edges":
        where = torch.zeros(n, dtype=torch.bool)
        for k in range(4):
            lo, hi = k * n // 4, (k + 1) * n // 4
            where[lo : min(hi, lo + 2)] = True
            where[max(lo, hi - 2) : hi] = True
    else:
        where = torch.rand(n, generator=gen) < 0.1
    x[where] = escaped[where]
    if masked:
        x[torch.rand(n, generator=gen) < 0.4] = 0
    f = codec.encode(x)
    assert cc.get_frame_parameters(f).table["cflags"].tolist() == [1 if masked else 0]  # coded, not raw
    bits_equal(codec.decode(f), x)


@pytest.mark.parametrize("escapes", [0.0, 0.01], ids=["no escapes", "escape-heavy"])
def test_a_bad_code_deep_in_a_lane_is_reported(escapes):
    # Deep in a long chunk, after lanes that met no escape (the branch-free rounds)
    # and after escapes common enough that the lanes go on with a branch per step,
    # a lane that meets no code still ends in the "no code" status, whichever it is.
    n = 1 << 14
    codec, f, p = _codec_and_frame(n, escapes)
    starts = _lane_starts(f.numpy(), p)
    for k in range(4):
        bad = f.numpy().copy()
        at = starts[k] + (starts[1] - starts[0]) // 3
        bad[at : at + 16] = 0xFF
        with pytest.raises(cc.FrameError, match="chunk 0 of 1 is bad: bit pattern that is no code"):
            codec.decode(bad)


def _uneven_lanes(n: int, gen) -> torch.Tensor:
    # Lane 0's quarter all 1-bit codes (six symbols a lookup), the others long codes and
    # escapes: the lockstep rounds stop when lane 0 nears its end, with most of the
    # other lanes' symbols still to decode, each lane alone.
    x = torch.randint(5, 12, (n,), generator=gen, dtype=torch.uint8)
    x[: n // 4] = 1
    where = torch.rand(n, generator=gen) < 0.05
    x[where] = torch.randint(12, 256, (n,), generator=gen, dtype=torch.uint8)[where]
    x[n // 4 : n // 4 + 3] = 200  # escapes where the other lanes start
    x[n - 3 :] = 201  # and where the last one ends
    return x


@pytest.mark.parametrize("n", [1021, 1 << 14])
@pytest.mark.parametrize("masked", [False, True], ids=["dense chunk", "masked chunk"])
def test_lanes_of_uneven_length_round_trip(n, masked):
    codec = _escape_codec(n)
    gen = torch.Generator().manual_seed(n + 1)
    x = _uneven_lanes(n, gen)
    if masked:
        x[torch.rand(n, generator=gen) < 0.4] = 0
    f = codec.encode(x)
    assert cc.get_frame_parameters(f).table["cflags"].tolist() == [1 if masked else 0]
    bits_equal(codec.decode(f), x)


@pytest.mark.parametrize("lane", [1, 2, 3])
def test_a_bad_code_where_a_lane_goes_on_alone_is_reported(lane):
    # Past where lane 0 ended the lockstep rounds, a lane that meets no code still ends
    # in the "no code" status.
    n = 1 << 14
    lengths = np.zeros(256, dtype=np.int64)
    lengths[[1, 2, 3, 4, 5]] = [1, 3, 4, 5, 5]  # Kraft sum 7/8 + 1/16 < 1: some patterns are no code
    book = cc.Codebook(lengths, escape_length=4)
    codec = cc.Codec(cc.CodebookSet({("gradient", "uint8", 0): book}), chunk_elems=n, checksum=False)
    gen = torch.Generator().manual_seed(lane)
    x = torch.randint(2, 6, (n,), generator=gen, dtype=torch.uint8)
    x[: n // 4] = 1
    f = codec.encode(x)
    p = cc.get_frame_parameters(f)
    bits_equal(codec.decode(f), x)
    starts = _lane_starts(f.numpy(), p)
    nbytes = int(f.numpy()[p.header_bytes + 4 * lane : p.header_bytes + 4 * lane + 4].view("<u4")[0])
    bad = f.numpy().copy()
    at = starts[lane] + 9 * nbytes // 10
    bad[at : at + 16] = 0xFF
    with pytest.raises(cc.FrameError, match="chunk 0 of 1 is bad: bit pattern that is no code"):
        codec.decode(bad)


def _two_book_codec(chunk: int, threads: int = 1) -> "cc.Codec":
    # Book 0 codes symbol 1 short, book 1 symbol 2: a chunk of mostly 1s takes book 0,
    # one of mostly 2s book 1.
    books = []
    for short in (1, 2):
        lengths = np.full(256, 12, dtype=np.int64)
        lengths[short] = 1
        lengths[3 - short] = 3
        books.append(cc.Codebook.from_counts((2.0 ** (12 - lengths)).astype(np.int64)))
    group = cc.CodebookGroup(books)
    return cc.Codec(cc.CodebookSet({("gradient", "uint8", 0): group}), threads=threads, chunk_elems=chunk)


def _interleaved_books(chunk: int, nchunks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.ones(chunk * nchunks, dtype=torch.uint8)
    pattern = [1, 0, 0, 1, 1, 1, 0, 1, 0]  # chunks of book 1 among book 0's, out of order
    for c in range(nchunks):
        if pattern[c % len(pattern)]:
            x[c * chunk : (c + 1) * chunk] = 2
    x[torch.rand(x.numel(), generator=gen) < 0.2] = 3
    return x


@pytest.mark.parametrize("threads", [1, 2])
def test_chunks_of_interleaved_books_round_trip(threads):
    # The decoder takes chunks grouped by book rather than in frame order: every chunk
    # must still land at its own place, through decode and decode_accumulate alike.
    chunk, nchunks = 4096, 11
    x = _interleaved_books(chunk, nchunks)
    codec = _two_book_codec(chunk, threads)
    f = codec.encode(x)
    books = cc.get_frame_parameters(f).table["books"].tolist()
    assert sorted(set(books)) == [0, 1] and books != sorted(books)
    bits_equal(codec.decode(f), x)
    y = torch.randn(x.numel(), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    fy = cc.Codec(threads=threads, chunk_elems=chunk).encode(y, kind="gradient")
    assert len(set(cc.get_frame_parameters(fy).table["books"].tolist())) > 1
    acc = torch.zeros(y.numel())
    cc.Codec(threads=threads, chunk_elems=chunk).decode_accumulate(fy, acc, add=False)
    bits_equal(acc, y.float())


def test_a_bad_chunk_among_interleaved_books_is_named():
    # Chunks decode out of frame order; the error still names the first bad chunk by
    # its place in the frame.
    chunk, nchunks = 4096, 11
    codec = _two_book_codec(chunk)
    f = codec.encode(_interleaved_books(chunk, nchunks)).numpy().copy()
    p = cc.get_frame_parameters(f)
    for c in (7, 2):
        f[int(p.offsets[c]) + 40] ^= 0x5A
    with pytest.raises(cc.FrameError, match="chunk 2 of 11 is bad: payload checksum mismatch .* \\(2 chunks bad\\)"):
        codec.decode(f)
