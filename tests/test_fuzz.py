"""Decoder fuzzing: corrupted, truncated, edited and random frames.

Whatever the bytes, decode must raise cc.FrameError or return a tensor of the frame's
dtype and size; never crash, hang or raise anything else. With checksums on, a changed
payload must be detected.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comm_codec as cc
from comm_codec.core import frame as _frame
from comm_codec.core.streams import spec_for

import naive
from helpers import bits_equal, fix_header_crc, random_bits, reseal

pytestmark = pytest.mark.unit


def _inputs() -> list[tuple[torch.Tensor, dict]]:
    """Tensors whose frames have masks, ZERO chunks, coded and raw streams, several
    chunks; each with the settings of the codec that encodes it."""
    g = torch.Generator().manual_seed(17)
    out = []

    def tensor(dtype, chunk):
        n = 5 * chunk + 60
        x = (
            (torch.randn(n, generator=g) * 1e-2).to(dtype)
            if dtype != torch.int8
            else (torch.randn(n, generator=g) * 3).round().to(torch.int8)
        )
        iv = x.view(torch.uint8 if x.element_size() == 1 else {2: torch.int16, 4: torch.int32}[x.element_size()])
        iv[chunk : 2 * chunk] = 0  # a ZERO chunk
        masked = iv[2 * chunk + chunk // 3 : 3 * chunk + chunk // 4]
        masked[torch.rand(masked.numel(), generator=g) < 0.8] = 0  # masked chunks
        iv[n - 60 :] = random_bits(60, dtype, g).view(iv.dtype)  # raw-ish tail
        return x

    for dtype in (torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn, torch.int8):
        out.append((tensor(dtype, 128), dict(chunk_elems=128, split_exponent=False)))
    # Split exponents: chunks of 256, where a coded segment with its plane beats raw.
    for dtype in (torch.float16, torch.float8_e4m3fn):
        out.append((tensor(dtype, 256), dict(chunk_elems=256)))
    return out


CASES = _inputs()
INPUTS = [x for x, _ in CASES]
CODECS = {ck: cc.Codec(cc.CodebookSet.default(), chunk_elems=128, checksum=ck) for ck in (True, False)}
FRAMES = {
    (i, ck): cc.Codec(cc.CodebookSet.default(), checksum=ck, **kw).encode(x).numpy().tobytes()
    for i, (x, kw) in enumerate(CASES)
    for ck in (True, False)
}


def test_fuzz_inputs_cover_every_chunk_kind():
    seen = 0
    for (i, ck), data in FRAMES.items():
        flags = cc.get_frame_parameters(data).table["cflags"]
        for bit in (_frame.CHUNK_MASK, _frame.CHUNK_ZERO):
            assert (flags & bit).any(), (i, bit)
        seen |= int(np.bitwise_or.reduce(flags))
        coded = [
            (flags[~(flags & _frame.CHUNK_ZERO).astype(bool)] & (_frame.CHUNK_RAW0 << s)) == 0
            for s in range(INPUTS[i].element_size())
        ]
        assert any(c.any() for c in coded), i  # some stream of some chunk is coded
        bits_equal(CODECS[ck].decode(_writable(data)), INPUTS[i])
    assert seen & _frame.CHUNK_RAW0
    assert sorted({cc.get_frame_parameters(data).split for data in FRAMES.values()}) == [0, 3]


def _writable(data: bytes) -> np.ndarray:
    # Frames go in as writable numpy arrays: the kernels compiled for the round-trip tests
    # serve (bytes would compile read-only variants; test_codec covers bytes frames).
    return np.frombuffer(bytearray(data), dtype=np.uint8)


def _decode_checked(data: bytes, dtype: torch.dtype, numel: int):
    """Decode with a codec; return the tensor, or None on FrameError. Anything else fails."""
    codec = CODECS[True]  # the frame's own flag decides whether checksums are verified
    try:
        out = codec.decode(_writable(data))
    except cc.FrameError:
        return None
    assert out.dtype == dtype and out.shape == (numel,)
    return out


# One mutation: (kind, position fraction, value).
_mutation = st.tuples(
    st.sampled_from(["flip", "overwrite", "insert", "delete"]),
    st.floats(0, 1, exclude_max=True),
    st.integers(0, 255),
)


def _apply(data: bytes, mutations) -> bytes:
    buf = bytearray(data)
    for kind, where, value in mutations:
        if not buf and kind != "insert":
            continue
        pos = int(where * len(buf))
        if kind == "flip":
            buf[pos] ^= 1 << (value % 8)
        elif kind == "overwrite":
            buf[pos] = value
        elif kind == "insert":
            buf.insert(pos, value)
        else:
            del buf[pos]
    return bytes(buf)


@settings(max_examples=150)
@given(
    which=st.integers(0, len(INPUTS) - 1),
    checksum=st.booleans(),
    mutations=st.lists(_mutation, min_size=1, max_size=4),
    truncate=st.one_of(st.none(), st.floats(0, 1, exclude_max=True)),
    fix_crc=st.booleans(),
)
def test_mutated_frames(which, checksum, mutations, truncate, fix_crc):
    data = FRAMES[(which, checksum)]
    bad = _apply(data, mutations)
    if truncate is not None:
        bad = bad[: int(truncate * len(bad))]
    if fix_crc:
        bad = fix_header_crc(bad)
    x = INPUTS[which]
    out = _decode_checked(bad, x.dtype, x.numel())
    if bad == data:
        bits_equal(out, x)
        return
    if out is None:
        return
    # Accepted a changed frame. If it still says "checksums", its payload must be the
    # original one (every payload byte lies in some chunk's checksummed range).
    hsize = cc.get_frame_parameters(data).header_bytes
    if bad[7] & _frame.FLAG_CHECKSUM:
        assert len(bad) == len(data) and bad[hsize:] == data[hsize:], "changed payload accepted"
    # Without a CRC fix-up no byte of the header, table or CRC may differ.
    if not fix_crc:
        assert len(bad) == len(data) and bad[: hsize - 4] == data[: hsize - 4]


@settings(max_examples=100)
@given(
    which=st.integers(0, len(INPUTS) - 1),
    where=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 7),
    extra=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), max_size=3),
)
def test_payload_corruption_is_detected_with_checksums(which, where, bit, extra):
    data = FRAMES[(which, True)]
    p = cc.get_frame_parameters(data)
    span = len(data) - p.header_bytes
    buf = bytearray(data)
    buf[p.header_bytes + int(where * span)] ^= 1 << bit
    for w, xor in extra:
        buf[p.header_bytes + int(w * span)] ^= xor
    if bytes(buf) == data:
        return
    x = INPUTS[which]
    with pytest.raises(cc.FrameError, match=r"chunk \d+ of \d+ is bad: payload checksum mismatch"):
        CODECS[True].decode(_writable(bytes(buf)))
    # Without checksums the same corruption decodes to something, or is caught by a
    # structural check; never anything else.
    plain = bytearray(FRAMES[(which, False)])
    q = cc.get_frame_parameters(FRAMES[(which, False)])
    plain[q.header_bytes + int(where * (len(plain) - q.header_bytes))] ^= 1 << bit
    _decode_checked(bytes(plain), x.dtype, x.numel())


@settings(max_examples=150)
@given(
    which=st.integers(0, len(INPUTS) - 1),
    checksum=st.booleans(),
    chunk=st.integers(0, 5),
    stream=st.integers(0, 3),
    edit=st.sampled_from(["size_move", "size_within_pad", "size_any", "flags", "ref", "lane_len"]),
    value=st.integers(0, 2**32 - 1),
)
def test_chunk_table_edits_with_a_valid_crc(which, checksum, chunk, stream, edit, value):
    # Edit the chunk table, then recompute the header CRC so that the table checks and the
    # kernels' bound checks (not the CRC) meet the edit.
    data = FRAMES[(which, checksum)]
    p = cc.get_frame_parameters(data)
    x = INPUTS[which]
    ns = x.element_size()
    chunk %= p.nchunks
    stream %= ns
    entry = _frame.HEADER_BYTES + 8 * ns + chunk * _frame.table_dtype(ns).itemsize
    buf = bytearray(data)
    size_at = lambda s: entry + 8 + 4 * s  # noqa: E731
    get = lambda pos: int.from_bytes(buf[pos : pos + 4], "little")  # noqa: E731
    put = lambda pos, v: buf.__setitem__(slice(pos, pos + 4), (v % 2**32).to_bytes(4, "little"))  # noqa: E731
    if edit == "size_move" and ns > 1:  # move 8*k bytes between two streams: total unchanged
        other = (stream + 1) % ns
        k = 8 * (value % 4 + 1)
        put(size_at(stream), get(size_at(stream)) + k)
        put(size_at(other), get(size_at(other)) - k)
    elif edit == "size_within_pad":  # same padded size, different byte count
        s = get(size_at(stream))
        put(size_at(stream), (s & ~7) + value % 8 if s else value % 8)
    elif edit == "size_any":
        put(size_at(stream), value % 5000)
    elif edit == "flags":
        buf[entry] = value & 0xFF
    elif edit == "ref":
        buf[entry + 1] = value & 0xFF
    else:  # a lane length inside a coded segment (payload; not CRC-covered)
        off = int(p.offsets[chunk])
        flags = int(p.table["cflags"][chunk])
        if flags & _frame.CHUNK_MASK:
            count = min(p.chunk_elems, p.numel - chunk * p.chunk_elems)
            off += _frame.pad8((count + 7) // 8)
        for s in range(stream):
            off += _frame.pad8(int(p.table["sizes"][chunk][s]))
        if not flags & (_frame.CHUNK_RAW0 << stream) and not flags & _frame.CHUNK_ZERO:
            put(off + 4 * (value % 4), value >> 8 & 0xFFFF)
    bad = fix_header_crc(buf)
    out = _decode_checked(bad, x.dtype, x.numel())
    if out is not None and bad != data and checksum and edit == "lane_len":
        pytest.fail("a changed lane length in a checksummed payload was accepted")


@settings(max_examples=100)
@given(data=st.binary(min_size=0, max_size=600))
def test_random_bytes(data):
    for codec in CODECS.values():
        try:
            out = codec.decode(_writable(data))
        except cc.FrameError:
            continue
        assert isinstance(out, torch.Tensor)


@settings(max_examples=150)
@given(
    dtype=st.sampled_from(cc.SUPPORTED_DTYPES),
    numel=st.integers(0, 400),
    chunk_elems=st.sampled_from([8, 16, 64, 512]),
    checksum=st.booleans(),
    entries=st.lists(
        st.tuples(st.integers(0, 255), st.integers(0, 255), st.lists(st.integers(0, 120), min_size=4, max_size=4)),
        min_size=8,
        max_size=8,
    ),
    ids=st.lists(st.integers(0, 3), min_size=4, max_size=4),
    seed=st.integers(0, 2**32 - 1),
    consistent=st.booleans(),
)
@pytest.mark.slow
def test_structured_random_frames(dtype, numel, chunk_elems, checksum, entries, ids, seed, consistent):
    # A frame with a valid header and CRC, a chunk table whose sizes add up, book ids the
    # codec holds, and random payload bytes. With `consistent`, mask popcounts match raw
    # sizes, lane headers match segment sizes and checksums are right, so the random bits
    # reach the kernels' table lookups and lane bounds.
    codec = CODECS[checksum]
    spec = cc.get_frame_parameters(codec.encode(torch.zeros(1, dtype=dtype))).spec
    ns = spec.nstreams
    nchunks = -(-numel // chunk_elems) if numel else 0
    own = [codec.codebooks.get("gradient", spec.name, s).id_int for s in range(ns)]
    others = [b.id_int for _, b in codec.codebooks.items() if not b.raw][:2]
    book_ids = [([0] + others + [own[s]])[ids[s]] for s in range(ns)]
    rng = np.random.default_rng(seed)
    table = np.zeros(nchunks, dtype=_frame.table_dtype(ns))
    payload = bytearray()
    for c in range(nchunks):
        cflags, ref, sizes = entries[c % len(entries)]
        count = min(chunk_elems, numel - c * chunk_elems)
        cflags &= _frame.CHUNK_MASK | _frame.CHUNK_ZERO | sum(_frame.CHUNK_RAW0 << s for s in range(ns))
        if cflags & _frame.CHUNK_ZERO:
            cflags = _frame.CHUNK_ZERO
        for s in range(ns):
            if book_ids[s] == 0:
                cflags |= _frame.CHUNK_RAW0 << s
        chunk = bytearray()
        present = count
        if cflags & _frame.CHUNK_MASK:
            mask = bytearray(rng.integers(0, 256, (count + 7) // 8, dtype=np.uint8).tobytes())
            if consistent and count % 8:
                mask[-1] &= (1 << (count % 8)) - 1
            present = sum(bin(b).count("1") for b in mask) if consistent else min(count, sizes[0])
            chunk += mask + bytes(_frame.pad8(len(mask)) - len(mask))
        for s in range(ns if not cflags & _frame.CHUNK_ZERO else 0):
            if cflags & (_frame.CHUNK_RAW0 << s):
                size = present
                seg = bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
            else:
                size = min(16 + 8 * (sizes[s] // 8), (count * 20 + 7) // 8 // 8 * 8)
                seg = bytearray(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
                if consistent and size >= 16:
                    words = rng.multinomial((size - 16) // 8, [0.25] * 4)
                    lens = [max(0, 8 * int(w) - int(rng.integers(0, 8))) if w else 0 for w in words]
                    seg[:16] = np.array(lens, dtype="<u4").tobytes()
                    pos = 16
                    for w, ln in zip(words, lens):  # zero the padding after each lane
                        seg[pos + ln : pos + 8 * int(w)] = bytes(8 * int(w) - ln)
                        pos += 8 * int(w)
            table[c]["sizes"][s] = size
            chunk += seg + bytes(_frame.pad8(size) - size)
        table[c]["cflags"] = cflags
        table[c]["ref"] = ref
        if checksum:
            table[c]["checksum"] = naive.payload_hash(bytes(chunk), c) if consistent else rng.integers(0, 2**32)
        payload += chunk
    hsize = _frame.header_size(ns, nchunks)
    buf = np.zeros(hsize + len(payload), dtype=np.uint8)
    buf[hsize:] = np.frombuffer(bytes(payload), dtype=np.uint8)
    _frame.write_header(buf, spec, numel, chunk_elems, int(checksum), book_ids, table)
    _decode_checked(buf.tobytes(), spec.dtype, numel)


def test_bit_pattern_that_is_no_code_is_reported():
    # An incomplete code (Kraft sum 7/8): 1/8 of all bit patterns are no code. Random lane
    # bits then hit the kernels' "no such code" status, which must surface as FrameError.
    lengths = np.zeros(256, dtype=np.int64)
    lengths[[1, 2, 3]] = [1, 3, 3]
    book = cc.Codebook(lengths, escape_length=3)
    codec = cc.Codec(cc.CodebookSet({("gradient", "uint8", 0): book}), chunk_elems=1024, checksum=False)
    x = torch.ones(1000, dtype=torch.uint8)
    x[::7] = 2
    x[::31] = 200
    f = codec.encode(x)
    p = cc.get_frame_parameters(f)
    assert p.table["cflags"].tolist() == [0]  # coded, no mask
    bits_equal(codec.decode(f), x)
    rng = np.random.default_rng(0)
    bad = f.numpy().copy()
    start = p.header_bytes + 16
    bad[start : start + 40] = rng.integers(0, 256, 40, dtype=np.uint8)
    with pytest.raises(cc.FrameError, match="chunk 0 of 1 is bad: bit pattern that is no code of its codebook"):
        codec.decode(bad)


# -- big frames, coded with groups of books (every chunk picks one) --------------------------
def _own_books(x: torch.Tensor) -> cc.CodebookSet:
    """Per stream a group: a book fitted to x (rarest symbols escaped), then a flatter one."""
    from comm_codec.books.profiler import stream_counts

    counts, _ = stream_counts(x, 256)
    name = spec_for(x.dtype).name
    groups = {}
    for s, c in enumerate(counts):
        fitted = cc.Codebook.from_counts(c + 1e-9, raw_threshold=None)
        flat = cc.Codebook.from_counts(c + c.sum() / 64, raw_threshold=None)
        groups[("gradient", name, s)] = cc.CodebookGroup([fitted] if flat == fitted else [fitted, flat])
    return cc.CodebookSet(groups)


def _big_inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(23)
    out = []
    for dtype in (torch.bfloat16, torch.float32, torch.float16, torch.float8_e5m2, torch.int8):
        n = 40_000
        # The last quarter is spread wider: chunks there pick the flatter book.
        wide = torch.ones(n)
        wide[3 * n // 4 :] = 6.0
        if dtype == torch.int8:
            x = (torch.randn(n, generator=g) * 2 * wide).round().clamp(-128, 127).to(torch.int8)
        else:
            # Exponents from a narrow band plus rare far ones (escaped symbols), exact
            # zeros in places, and a stretch of random bit patterns (NaN, Inf, -0.0).
            band = torch.randint(-3, 3, (n,), generator=g) * wide.to(torch.int64)
            x = (torch.randn(n, generator=g) * torch.exp2(band)).to(dtype)
            iv = x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])
            iv[::997] = random_bits(len(iv[::997]), dtype, g).view(iv.dtype)
            iv[5000:5300][torch.rand(300, generator=g) < 0.7] = 0
        out.append(x)
    # Few distinct values: low-entropy mantissa streams get coded too.
    for dtype in (torch.bfloat16, torch.float32):
        out.append((torch.randint(-40, 40, (40_000,), generator=g) * 0.375).to(dtype))
    return out


BIG = _big_inputs()
BIG_CODECS = [cc.Codec(_own_books(x), chunk_elems=4096, checksum=False) for x in BIG]
BIG_FRAMES = [c.encode(x).numpy().tobytes() for c, x in zip(BIG_CODECS, BIG)]


def test_big_frames_code_every_stream_somewhere_with_both_books():
    coded = set()
    chosen = set()
    for x, data in zip(BIG, BIG_FRAMES):
        table = cc.get_frame_parameters(data).table
        flags = table["cflags"]
        live = flags[(flags & _frame.CHUNK_ZERO) == 0]
        coded |= {
            (x.element_size(), s) for s in range(x.element_size()) if ((live & (_frame.CHUNK_RAW0 << s)) == 0).any()
        }
        chosen |= {int(b) & 15 for b in table["books"]}
    # Coded later streams are OR-ed into place: the decoder's other path.
    assert {(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3), (1, 0)} <= coded
    assert chosen == {0, 1}


@pytest.mark.parametrize("i", range(len(BIG)))
def test_big_frames_round_trip_through_the_multi_symbol_decoder(i):
    bits_equal(BIG_CODECS[i].decode(_writable(BIG_FRAMES[i])), BIG[i])


@settings(max_examples=60, deadline=None)
@given(
    which=st.integers(0, len(BIG) - 1),
    mutations=st.lists(_mutation, min_size=1, max_size=4),
    fix_crc=st.booleans(),
)
def test_mutated_big_frames_never_crash(which, mutations, fix_crc):
    # No checksums: corrupted payloads reach the multi-symbol decoder itself.
    data = BIG_FRAMES[which]
    bad = _apply(data, mutations)
    if fix_crc:
        bad = fix_header_crc(bad)
    x = BIG[which]
    try:
        out = BIG_CODECS[which].decode(_writable(bad))
    except cc.FrameError:
        return
    assert out.dtype == x.dtype and out.shape == x.shape


# -- frames of the shipped weight books: groups on every stream, fp32's low bytes coded ---------
def _weight_inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    full = torch.randn(3 * 128, generator=g) * 0.02
    rounded = (torch.randn(2 * 128, generator=g) * 0.02).to(torch.bfloat16).float()  # low bytes 0
    ones = 1.0 + torch.randn(128, generator=g) * 1e-3  # LayerNorm-like
    x = torch.cat([full, rounded, ones])
    return [x, x.to(torch.bfloat16)]


WEIGHTS = _weight_inputs()
WEIGHT_FRAMES = [CODECS[True].encode(x, "weight").numpy().tobytes() for x in WEIGHTS]


def test_weight_frames_use_books_on_low_mantissa_bytes():
    table = cc.get_frame_parameters(WEIGHT_FRAMES[0]).table
    coded = (table["cflags"] & (_frame.CHUNK_RAW0 << 3)) == 0
    assert coded.any(), "no chunk codes fp32 stream 3: the fuzz below would not reach that decoder path"


@settings(max_examples=150)
@given(
    which=st.integers(0, len(WEIGHTS) - 1),
    mutations=st.lists(_mutation, min_size=1, max_size=4),
    payload_only=st.booleans(),
)
def test_resealed_mutations_of_grouped_weight_frames(which, mutations, payload_only):
    # Checksums and CRC recomputed after the edit: the edit reaches the group index
    # checks, the lane headers and the multi-symbol decoder of every coded stream.
    data = WEIGHT_FRAMES[which]
    x = WEIGHTS[which]
    if payload_only:  # edits confined to the payload, so the table still parses
        hsize = cc.get_frame_parameters(data).header_bytes
        bad = data[:hsize] + _apply(data[hsize:], [m for m in mutations if m[0] in ("flip", "overwrite")])
    else:
        bad = _apply(data, mutations)
    out = _decode_checked(reseal(bad), x.dtype, x.numel())
    if bad == data:
        bits_equal(out, x)
