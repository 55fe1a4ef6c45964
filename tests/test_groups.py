"""Groups of books: per-chunk choice in frames, the profiler that grows them, their files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comm_codec as cc
from comm_codec.books.profiler import WarmupProfiler, chunk_counts, grow_group
from comm_codec.core import frame as _frame

import naive
from helpers import bits_equal, fix_header_crc, int_view, random_bits

pytestmark = pytest.mark.unit


def _layered(dtype, n_layers=6, per_layer=3000, seed=0) -> torch.Tensor:
    """Layers whose values differ in the *shape* of their exponent spread, not only in scale."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for layer in range(n_layers):
        x = torch.randn(per_layer, generator=g) * 10.0 ** (-layer % 3)
        if layer % 2:
            x = x * torch.exp2(torch.randint(-6, 2, (per_layer,), generator=g).float())  # wide, skewed
        parts.append(x)
    x = torch.cat(parts)
    if dtype in (torch.int8, torch.uint8):
        x = (x / x.abs().max() * 120).round().to(torch.int8)
        return x.view(torch.uint8) if dtype == torch.uint8 else x
    if dtype == torch.float8_e4m3fn:
        return (x / x.abs().max() * 448).to(dtype)
    if dtype == torch.float8_e5m2:
        return (x / x.abs().max() * 50000).to(dtype)
    return x.to(dtype)


def _grown(x: torch.Tensor, chunk_elems=256, max_books=6, kind="gradient") -> cc.CodebookSet:
    prof = WarmupProfiler(chunk_elems=chunk_elems, max_books=max_books, min_gain=0.0)
    prof.observe(x, kind=kind)
    return prof.build()


@pytest.fixture(scope="module")
def bf16_case():
    x = _layered(torch.bfloat16)
    books = _grown(x)
    return x, books, cc.Codec(books, chunk_elems=256)


# -- frames ----------------------------------------------------------------------------------------
def test_chunks_pick_different_books_and_round_trip(bf16_case):
    x, books, codec = bf16_case
    group = books.group("gradient", "bf16", 0)
    assert len(group) > 2
    f = codec.encode(x)
    p = cc.get_frame_parameters(f)
    assert p.version == 2 and p.book_ids[0] == group.id
    assert len(set((p.table["books"] & 15).tolist())) > 2
    bits_equal(codec.decode(f), x)
    # The pure-Python decoder also checks that each chunk's book is the cheapest for it.
    bits_equal(naive.decode_frame(f.numpy().tobytes(), naive.frame_books(books)), x)


def test_a_group_codes_no_worse_than_its_first_book(bf16_case):
    x, books, codec = bf16_case
    first = cc.CodebookSet({k: g.primary for k, g in books.groups()})
    alone = cc.Codec(first, chunk_elems=256).encode(x)
    grouped = codec.encode(x)
    assert grouped.numel() < alone.numel()
    assert cc.get_frame_parameters(alone).version == 1


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(cc.SUPPORTED_DTYPES),
    n=st.integers(0, 4000),
    seed=st.integers(0, 2**31),
    chunk_elems=st.sampled_from([8, 64, 1024]),
    specials=st.booleans(),
    threads=st.sampled_from([1, 2]),
)
def test_grouped_round_trips_are_bit_exact(dtype, n, seed, chunk_elems, specials, threads):
    books = _GROUPED[dtype]
    x = _layered(dtype, seed=seed)[:n].clone()
    if specials and n:
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, n, (min(n, 40),), generator=g)
        int_view(x)[idx] = int_view(random_bits(idx.numel(), dtype, g))
    codec = cc.Codec(books, chunk_elems=chunk_elems, threads=threads)
    f = codec.encode(x)
    bits_equal(codec.decode(f), x)
    if n <= 600:
        bits_equal(naive.decode_frame(f.numpy().tobytes(), naive.frame_books(books)), x)


_GROUPED = {dtype: _grown(_layered(dtype, seed=99), chunk_elems=64) for dtype in cc.SUPPORTED_DTYPES}


def test_book_index_beyond_the_group_is_refused(bf16_case):
    x, books, codec = bf16_case
    f = codec.encode(x).numpy().copy()
    p = cc.get_frame_parameters(f)
    coded = np.nonzero((p.table["cflags"] & (_frame.CHUNK_RAW0 | _frame.CHUNK_ZERO)) == 0)[0]
    c = int(coded[0])
    pos = _frame.HEADER_BYTES + 8 * 2 + c * p.table.dtype.itemsize + 2
    bad = bytearray(f.tobytes())
    bad[pos] = 15
    n = len(books.group("gradient", "bf16", 0))
    with pytest.raises(
        cc.FrameError, match=f"chunk {c} says stream 0 was coded with book 15 of its group, which holds {n}"
    ):
        codec.decode(fix_header_crc(bytes(bad)))


def test_book_index_for_a_raw_stream_is_refused(bf16_case):
    x, _, codec = bf16_case
    f = codec.encode(x).numpy().tobytes()
    pos = _frame.HEADER_BYTES + 8 * 2 + 2
    bad = bytearray(f)
    bad[pos] |= 0x10  # stream 1 is raw (the mantissa)
    with pytest.raises(cc.FrameError, match="chunk 0 names a book for a stream it does not code"):
        codec.decode(fix_header_crc(bytes(bad)))


def test_a_codec_without_the_group_refuses_its_frames(bf16_case):
    x, books, codec = bf16_case
    f = codec.encode(x)
    first_only = cc.Codec(cc.CodebookSet({k: g.primary for k, g in books.groups()}), chunk_elems=256)
    gid = books.group("gradient", "bf16", 0).id
    with pytest.raises(cc.FrameError, match=f"frame stream 0 was coded with codebook {gid}, which this codec"):
        first_only.decode(f)


# -- the group class and files ---------------------------------------------------------------------
def test_group_ids_and_argument_errors(bf16_case):
    _, books, _ = bf16_case
    group = books.group("gradient", "bf16", 0)
    a, b = group[0], group[1]
    assert cc.CodebookGroup([a]).id == a.id  # a group of one is its book
    assert cc.CodebookGroup([a, b]).id != cc.CodebookGroup([b, a]).id  # order is the index
    assert books.by_id(b.id) is b and books.group_by_id(group.id) is group
    with pytest.raises(ValueError, match="holds 1..16 books, got 0"):
        cc.CodebookGroup([])
    with pytest.raises(ValueError, match="holds 1..16 books, got 17"):
        cc.CodebookGroup([a] * 17)
    with pytest.raises(ValueError, match="the same book twice"):
        cc.CodebookGroup([a, a])
    with pytest.raises(ValueError, match="raw book"):
        cc.CodebookGroup([a, cc.Codebook.raw_book()])
    with pytest.raises(TypeError, match="holds Codebooks"):
        cc.CodebookGroup([a, "b"])


def test_group_files_round_trip_and_are_checked(tmp_path, bf16_case):
    _, books, _ = bf16_case
    path = tmp_path / "g.json"
    books.save(path)
    data = json.loads(path.read_text())
    assert data["version"] == 2
    loaded = cc.CodebookSet.load(path)
    assert loaded == books and loaded.group("gradient", "bf16", 0) == books.group("gradient", "bf16", 0)
    entry = next(e for e in data["books"] if "books" in e)
    entry["group"] = "0" * 16
    path.write_text(json.dumps(data))
    with pytest.raises(cc.CodebookError, match="group id '0000000000000000' does not match its books"):
        cc.CodebookSet.load(path)
    data["version"] = 1
    entry.pop("group")
    path.write_text(json.dumps(data))
    with pytest.raises(cc.CodebookError, match="groups of books need codebook file version 2"):
        cc.CodebookSet.load(path)
    # Sets without groups stay version-1 files.
    single = cc.CodebookSet({k: g.primary for k, g in books.groups()})
    single.save(path)
    assert json.loads(path.read_text())["version"] == 1


# -- growing groups --------------------------------------------------------------------------------
def test_grow_group_is_deterministic_and_never_worse_than_the_first_book():
    x = _layered(torch.bfloat16, seed=3)
    rows = chunk_counts(x, 256)[0][:, 0]
    first = cc.Codebook.from_counts(rows.sum(axis=0))
    g1, s1 = grow_group(rows, first, 8, 0.0)
    g2, _ = grow_group(rows.copy(), first, 8, 0.0)
    assert g1 == g2 and g1[0] is first and len(g1) > 1
    bits = np.stack([np.rint(b.symbol_bits()) for b in g1]).astype(np.int64)
    per_row = rows @ bits.T
    assert (per_row.min(axis=1) <= per_row[:, 0]).all()
    assert s1["chunk_bits_optimal"] <= s1["chunk_bits_group"] < s1["chunk_bits_one_book"]
    # min_gain stops the growth; max_books caps it.
    assert len(grow_group(rows, first, 8, 0.5)[0]) == 1
    assert len(grow_group(rows, first, 2, 0.0)[0]) == 2


def test_profiler_max_books_one_builds_single_books():
    x = _layered(torch.bfloat16, seed=4)
    prof = WarmupProfiler(chunk_elems=256, max_books=1)
    prof.observe(x)
    books = prof.build()
    assert all(len(g) == 1 for _, g in books.groups())
    many = _grown(x)
    assert many.get("gradient", "bf16", 0).id == books.get("gradient", "bf16", 0).id  # same first book


def test_profiler_rows_are_bounded_by_merging_neighbours():
    x = _layered(torch.bfloat16, n_layers=12, seed=5)
    prof = WarmupProfiler(chunk_elems=64, max_rows=100)
    prof.observe(x)
    prof.observe(x)
    rows = prof.chunk_rows("gradient", torch.bfloat16)
    assert len(rows) <= 100
    assert rows.sum() == 2 * chunk_counts(x, 64)[0].sum()  # merged, nothing dropped


def test_profiler_argument_errors():
    with pytest.raises(ValueError, match="max_books must be in 1..16, got 0"):
        WarmupProfiler(max_books=0)
    with pytest.raises(ValueError, match="max_books must be in 1..16, got 17"):
        WarmupProfiler(max_books=17)
    with pytest.raises(ValueError, match="min_gain"):
        WarmupProfiler(min_gain=1.0)
    with pytest.raises(ValueError, match="max_rows"):
        WarmupProfiler(max_rows=1)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 10**6), min_size=256, max_size=256), min_size=1, max_size=4), st.integers(0, 255)
)
@pytest.mark.slow
def test_huffman_costs_match_the_textbook_code(rows, sparse):
    from comm_codec.kernels.histogram import huffman_costs

    counts = np.array(rows, dtype=np.int64)
    counts[:, :sparse] = 0  # few symbols, down to one or none
    out = np.zeros(len(counts), dtype=np.int64)
    huffman_costs(counts, out)
    for r, c in enumerate(counts):
        present = [int(x) for x in c if x]
        want = (
            0
            if not present
            else present[0]
            if len(present) == 1
            else sum(w * n for w, n in zip(present, naive.huffman_lengths(present)))
        )
        assert out[r] == want


@pytest.mark.slow
def test_cpu_kernel_checks_book_indices_without_the_host(bf16_case):
    # decode_chunks called with a book index the Python layer never checked (past every
    # table): that chunk reports a status, the others decode (numba does not bound-check).
    from comm_codec.core.tables import decode_tables
    from comm_codec.kernels.decode import decode_chunks
    from comm_codec.kernels.layout import STATUS_MESSAGES

    x, books, codec = bf16_case
    f = codec.encode(x).numpy()
    p = cc.get_frame_parameters(f)
    tables = decode_tables(codec.codebooks, p.book_ids)
    t = p.table
    c = int(np.nonzero((t["cflags"] & (_frame.CHUNK_RAW0 | _frame.CHUNK_ZERO)) == 0)[0][0])
    chosen = t["books"].copy()
    chosen[c] = 15
    out = np.zeros(p.numel, dtype=np.uint16)
    status = np.zeros(p.nchunks, dtype=np.int32)
    decode_chunks(
        f,
        f.view(np.uint64),
        p.numel,
        p.chunk_elems,
        0,
        0,
        tables.dec,
        tables.multi,
        np.ascontiguousarray(t["cflags"]),
        np.ascontiguousarray(t["ref"]),
        chosen,
        np.ascontiguousarray(t["sizes"]),
        p.offsets,
        np.ascontiguousarray(t["checksum"]),
        False,
        out,
        status,
    )
    assert STATUS_MESSAGES[int(status[c])].startswith("names a book that its stream's group does not hold")
    assert (np.delete(status, c) == 0).all()


def test_coding_cost_prices_a_group_chunk_by_chunk(bf16_case):
    from comm_codec.books.profiler import coding_cost

    x, books, codec = bf16_case
    first = cc.CodebookSet({k: g.primary for k, g in books.groups()})
    fixed_group, optimal, entropy = coding_cost(x, books, chunk_elems=256)
    fixed_first, optimal_1, _ = coding_cost(x, first, chunk_elems=256)
    assert optimal == optimal_1 and fixed_group < fixed_first
    # The group's price is what the encoder spends on the streams; the frame adds at most
    # 64 bytes per 256-element chunk (table entry, lane lengths, padding) and its header.
    frame_bits = 8 * codec.encode(x).numel()
    nchunks = -(-x.numel() // 256)
    assert fixed_group < frame_bits < fixed_group + 8 * (64 * nchunks + 64)


def test_merge_rows_halves_neighbours_and_keeps_every_count():
    from comm_codec.books.profiler import merge_rows

    rows = np.arange(7 * 2 * 256, dtype=np.int64).reshape(7, 2, 256)
    merged = merge_rows(rows, 3)
    assert len(merged) == 2 and merged.sum() == rows.sum()
    assert np.array_equal(merged[0], rows[0] + rows[1] + rows[2] + rows[3])
    assert merge_rows(rows, 7) is rows and len(merge_rows(rows, 1)) == 1


def _w_build_groups(rank, world):
    """Each rank observes its own layers; books built over the world. Returns the set's file dict."""
    from comm_codec.comm.agreement import build_books

    prof = WarmupProfiler(chunk_elems=256, min_gain=0.0)
    prof.observe(_layered(torch.bfloat16, seed=20 + rank))
    return build_books(prof).to_dict()


@pytest.mark.dist
def test_distributed_build_equals_one_process_over_all_ranks_data():
    # Ranks gather each other's chunk histograms in rank order, so every rank builds the
    # groups that one process observing all ranks' tensors in that order builds.
    import dist_utils

    results = dist_utils.run(_w_build_groups, 2)
    distributed = cc.CodebookSet.from_dict(results[0])
    assert cc.CodebookSet.from_dict(results[1]).digest == distributed.digest
    assert results[0]["meta"]["world_size"] == 2
    prof = WarmupProfiler(chunk_elems=256, min_gain=0.0)
    for rank in range(2):
        prof.observe(_layered(torch.bfloat16, seed=20 + rank))
    single = prof.build()
    assert len(distributed.group("gradient", "bf16", 0)) > 2
    assert distributed.digest == single.digest


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda e: 5, "'books' must be a list of books"),
        (lambda e: [1, 2], "a codebook must be a JSON object, got int"),
        (lambda e: [e[0], e[0]], "a codebook group holds the same book twice"),
        (lambda e: [], "a codebook group holds 1..16 books, got 0"),
        (lambda e: [e[0]] * 17, "a codebook group holds 1..16 books, got 17"),
    ],
)
def test_malformed_groups_in_files_are_named(tmp_path, bf16_case, edit, message):
    _, books, _ = bf16_case
    data = books.to_dict()
    entry = next(e for e in data["books"] if "books" in e)
    entry["books"] = edit(entry["books"])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(cc.CodebookError, match=f"{path}: book entry .*: {message}"):
        cc.CodebookSet.load(path)


def test_a_raw_stream_gets_books_for_the_chunks_they_pay_in():
    # An fp32 layer whose values went through bf16 (low mantissa bytes 0) beside full
    # ones: the average of streams 2 and 3 is nearly uniform (a raw book), but that one
    # chunk in 32 codes them in ~1 bit. The profiler gives those streams a group; each
    # chunk then takes it or stays raw.
    g = torch.Generator().manual_seed(11)
    full = torch.randn(31 * 512, generator=g) * 0.02
    rounded = (torch.randn(512, generator=g) * 0.02).to(torch.bfloat16).float()
    x = torch.cat([full, rounded])
    single = WarmupProfiler(chunk_elems=512, max_books=1)
    grouped = WarmupProfiler(chunk_elems=512, max_books=4)
    for prof in (single, grouped):
        prof.observe(x, "weight")
    one, many = single.build(), grouped.build()
    assert one.group("weight", "fp32", 3).raw
    group = many.group("weight", "fp32", 3)
    assert not group.raw and len(group) >= 1
    c1, c2 = cc.Codec(one, chunk_elems=512), cc.Codec(many, chunk_elems=512)
    f1, f2 = c1.encode(x, "weight"), c2.encode(x, "weight")
    assert f2.numel() < f1.numel() - 700  # ~14 bits of 32 saved on 512 elements
    table = cc.get_frame_parameters(f2).table
    raw3 = (table["cflags"] & (_frame.CHUNK_RAW0 << 3)) != 0
    assert raw3[:31].mean() > 0.5 and not raw3[31]  # full chunks mostly stay raw, the rounded one is coded
    bits_equal(c2.decode(f2), x)
