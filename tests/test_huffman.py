"""Codebooks: length-limited canonical Huffman books, against the naive reference."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import comm_codec as cc
from comm_codec.core import huffman
from comm_codec.kernels.histogram import package_merge

import naive
from helpers import bits_equal

pytestmark = pytest.mark.unit


def _geometric(ratio: float, floor: float = 0.0) -> np.ndarray:
    c = ratio ** np.arange(256, dtype=np.float64)
    return c + floor


def _kraft(book: cc.Codebook) -> int:
    return naive.kraft_sum_times(book.lengths, book.escape_length)


# Distributions with a coded (non-raw) book: a pointy exponent-like one, a power law, one
# symbol dominating, two symbols only.
DISTRIBUTIONS = {
    "geometric": _geometric(0.6),
    "power_law": 1.0 / np.arange(1, 257, dtype=np.float64) ** 1.3,
    "dominant": np.r_[1e9, np.ones(255)],
    "two_symbols": np.r_[np.zeros(100), 3.0, np.zeros(50), 1.0, np.zeros(104)],
    "all_256_flat_tail": _geometric(0.9, floor=1e-3),
}


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_from_counts_is_a_complete_prefix_code_within_the_limit(name):
    counts = DISTRIBUTIONS[name]
    book = cc.Codebook.from_counts(counts, raw_threshold=None)
    assert not book.raw
    assert book.lengths.dtype == np.uint8 and book.lengths.shape == (256,)
    assert int(book.lengths.max()) <= huffman.MAX_CODE_LENGTH == 12
    assert book.escape_length <= 12
    # Kraft equality: the code is complete, no code space is wasted.
    assert _kraft(book) == 1 << 12
    # Every symbol is codable: a code of its own, or the escape exists.
    assert (book.lengths > 0).all() or book.escape_length > 0
    assert (book.symbol_bits() > 0).all() and (book.symbol_bits() <= 20).all()


@settings(max_examples=60)
@given(st.lists(st.integers(0, 10**6), min_size=256, max_size=256).filter(lambda c: sum(c) > 0))
@pytest.mark.slow
def test_from_counts_properties_hold_for_any_counts(counts):
    book = cc.Codebook.from_counts(counts, raw_threshold=None)
    assert int(book.lengths.max()) <= 12 and book.escape_length <= 12
    assert _kraft(book) == 1 << 12
    assert (book.lengths > 0).all() or book.escape_length > 0
    # A symbol comfortably above the escape threshold (2^-13) is never escaped.
    total = sum(counts)
    for s, c in enumerate(counts):
        if c / total >= 2.0**-12:
            assert book.lengths[s] > 0, s
    # The same counts, scaled, give the same book (they are the same distribution).
    assert cc.Codebook.from_counts(np.asarray(counts) * 4.0, raw_threshold=None).id == book.id


def test_symbols_never_seen_are_codable_through_the_escape():
    counts = np.zeros(256)
    counts[[3, 4, 5]] = [10, 5, 1]
    book = cc.Codebook.from_counts(counts)
    assert book.escape_length > 0
    assert (book.lengths[[3, 4, 5]] > 0).all()
    assert (book.lengths[6:] == 0).all() and book.lengths[0] == 0
    bits = book.symbol_bits()
    assert bits[200] == book.escape_length + 8


def test_escape_is_used_for_very_skewed_distributions():
    counts = np.ones(256)
    counts[7] = 1e9
    book = cc.Codebook.from_counts(counts)
    assert not book.raw
    assert book.lengths[7] == 1
    assert book.escape_length == 1  # everything else shares the other half of the code space
    assert int((book.lengths == 0).sum()) == 255
    assert book.expected_bits(counts) == pytest.approx(1.0, abs=1e-5)


def test_uniform_data_gets_the_raw_book():
    book = cc.Codebook.from_counts(np.ones(256))
    assert book.raw and book.id == "0" * 16
    assert book.expected_bits(np.ones(256)) == 8.0
    assert (book.symbol_bits() == 8).all()
    # Just under the threshold stays raw; a clearly compressible stream does not.
    assert cc.Codebook.from_counts(_geometric(0.99, floor=0.5)).raw
    assert not cc.Codebook.from_counts(_geometric(0.9)).raw


def test_raw_threshold_none_never_returns_raw():
    book = cc.Codebook.from_counts(np.ones(256), raw_threshold=None)
    assert not book.raw
    assert (book.lengths == 8).all() and book.escape_length == 0


def test_determinism_same_counts_same_id():
    counts = DISTRIBUTIONS["power_law"]
    a = cc.Codebook.from_counts(counts)
    b = cc.Codebook.from_counts(counts.copy())
    assert a.id == b.id and a == b and hash(a) == hash(b)
    assert np.array_equal(a.lengths, b.lengths)
    assert json.dumps(a.to_dict()) == json.dumps(b.to_dict())


@pytest.mark.slow
def test_determinism_across_processes():
    # Another interpreter (another hash seed) must build the byte-identical book.
    counts = [int(x) for x in (DISTRIBUTIONS["power_law"] * 1e6)]
    here = json.dumps(cc.Codebook.from_counts(counts).to_dict(), sort_keys=True).encode()
    code = (
        "import json, sys, comm_codec as cc\n"
        f"counts = {counts!r}\n"
        "sys.stdout.write(json.dumps(cc.Codebook.from_counts(counts).to_dict(), sort_keys=True))\n"
    )
    env = {"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, env=env).stdout
    assert there == here


def test_ties_are_broken_by_symbol():
    # Equal weights: a canonical code gives the smaller symbol the shorter (or equal) code.
    counts = np.zeros(256)
    counts[[9, 2, 200]] = 1.0
    book = cc.Codebook.from_counts(counts, raw_threshold=None)
    lengths = book.lengths
    assert lengths[2] <= lengths[9] <= lengths[200]


def _optimal_cost(weights) -> float:
    lengths = naive.huffman_lengths(weights)
    return naive.expected_bits(weights, lengths)


@settings(max_examples=60)
@given(
    st.lists(st.integers(1, 24), min_size=256, max_size=256),
    st.integers(0, 255),
    st.integers(0, 3000),
)
@pytest.mark.slow
def test_optimal_when_the_length_limit_does_not_bind(counts, peak, extra):
    # Every symbol >= 1/(256*24 + 3000) > 2^-13: nothing is escaped; when the unlimited
    # optimum fits in 12 bits, the book must cost exactly the optimum.
    counts = list(counts)
    counts[peak] += extra
    total = sum(counts)
    assert min(counts) / total > 2.0**-13
    lengths = naive.huffman_lengths(counts)
    assume(max(lengths) <= 12)
    book = cc.Codebook.from_counts(counts, raw_threshold=None)
    assert book.escape_length == 0 and (book.lengths > 0).all()
    assert book.expected_bits(counts) == pytest.approx(naive.expected_bits(counts, lengths), abs=1e-9)


@settings(max_examples=40)
@given(st.lists(st.integers(0, 5000), min_size=256, max_size=256).filter(lambda c: sum(c) > 0))
@pytest.mark.slow
def test_never_worse_than_optimal_plus_escape_floor(counts):
    # With escapes and the length limit in play the book may lose, but never more than the
    # cost of keeping the escape (weight 2^-20) and the 12-bit limit allows: bounded by the
    # optimum over (symbols >= 2^-13, escape with all the rest) plus one bit for the rare ones.
    book = cc.Codebook.from_counts(counts, raw_threshold=None)
    got = book.expected_bits(counts)
    assert got >= _optimal_cost(counts) - 1e-9  # nothing beats Huffman
    total = sum(counts)
    rare = sum(c for c in counts if c / total < 2.0**-13)
    assert got <= _optimal_cost(counts) + 1.0 + 20 * rare / total + 1e-9


def test_entropy_and_optimal_lengths_match_naive():
    rng = np.random.default_rng(0)
    for _ in range(20):
        counts = rng.integers(0, 1000, 256) * (rng.random(256) < 0.5)
        counts[rng.integers(256)] += 1
        assert huffman.entropy_bits(counts) == pytest.approx(naive.entropy(counts), abs=1e-12)
        got = huffman.optimal_lengths(counts)
        want = naive.huffman_lengths(counts)
        assert [bool(x) for x in got] == [bool(c) for c in counts]
        assert naive.expected_bits(counts, got) == pytest.approx(naive.expected_bits(counts, want), abs=1e-12)
        assert naive.kraft_sum_times(got, 0, 64) <= 1 << 64
    assert huffman.entropy_bits(np.zeros(256)) == 0.0
    one = np.zeros(256, dtype=np.int64)
    one[42] = 7
    assert huffman.optimal_lengths(one)[42] == 1 and huffman.optimal_lengths(one).sum() == 1
    # Books sit between entropy and entropy + 1 bit (when nothing is escaped).
    counts = DISTRIBUTIONS["power_law"]
    book = cc.Codebook.from_counts(counts)
    assert naive.entropy(counts) <= book.expected_bits(counts) < naive.entropy(counts) + 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 1 << 30) | st.integers(1, 4), min_size=1, max_size=257), st.integers(9, 12))
@pytest.mark.slow
def test_package_merge_kernel_matches_textbook_package_merge(weights, limit):
    # The kernel keeps only leaf/package flags per level; the reference carries every
    # item's leaves. Small weights force ties, where the tie-breaking must agree too.
    order = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    by_rank = package_merge(np.array([weights[i] for i in order], dtype=np.int64), limit)
    lengths = [0] * len(weights)
    for rank, i in enumerate(order):
        lengths[i] = int(by_rank[rank])
    assert lengths == naive.package_merge(weights, limit)


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_tables_agree_with_naive_canonical_codes(name):
    book = cc.Codebook.from_counts(DISTRIBUTIONS[name], raw_threshold=None)
    enc_code, enc_len, dec = book.tables()
    codes = naive.canonical_codes(book.lengths, book.escape_length)
    for sym in range(256):
        bits = naive.encode_bits([sym], book.lengths, book.escape_length)
        assert enc_len[sym] == len(bits), sym
        packed = int.from_bytes(naive.bits_to_bytes(bits), "little")
        assert enc_code[sym] == packed, sym
        # The decode table maps any 12 bits starting with the code to it.
        code, ln = codes.get(sym, codes.get(naive.ESCAPE))
        low = packed & ((1 << ln) - 1)
        entry = int(dec[low | (0xABC << ln) & 0xFFF])
        assert (entry >> 8) & 15 == ln
        if sym in codes:
            assert entry & 0xFF == sym and not entry & 0x8000
        else:
            assert entry & 0x8000


def _naive_tables(lengths, escape_length):
    """Every enc_code / enc_len / dec entry of a book, from the textbook canonical codes."""
    codes = naive.canonical_codes(lengths, escape_length)
    enc_code, enc_len = [0] * 256, [0] * 256
    for sym in range(256):
        if int(lengths[sym]) or escape_length:
            bits = naive.encode_bits([sym], lengths, escape_length)
            enc_len[sym] = len(bits)
            enc_code[sym] = int.from_bytes(naive.bits_to_bytes(bits), "little")
    dec = [0] * 4096
    for sym, (code, ln) in codes.items():
        rev = int(format(code, f"0{ln}b")[::-1], 2)
        entry = (0x8000 if sym == naive.ESCAPE else sym) | (ln << 8)
        for high in range(1 << (12 - ln)):
            dec[rev | (high << ln)] = entry
    return enc_code, enc_len, dec


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 1 << 20), min_size=256, max_size=256), st.booleans(), st.integers(0, 3))
@pytest.mark.slow
def test_every_table_entry_matches_the_textbook_codes(counts, escapes, drop):
    # Escapes (rare symbols), codes short and long, and books whose code is incomplete
    # (some codes dropped): every one of the 4096 decode slots and 256 encode entries.
    # Without escapes every symbol is likely enough (p > 2**-13) to get a code of its own.
    counts = np.array(counts) + (0 if escapes else 1 << 16)
    assume(counts.sum() > 0)
    book = cc.Codebook.from_counts(counts, raw_threshold=None)
    if drop and book.escape_length:
        lengths = book.lengths.copy()
        lengths[np.nonzero(lengths)[0][:drop]] = 0  # an incomplete code: slots no code starts at stay 0
        book = huffman.Codebook(lengths, book.escape_length)
    enc_code, enc_len, dec = book.tables()
    want_code, want_len, want_dec = _naive_tables(book.lengths, book.escape_length)
    assert enc_len.tolist() == want_len
    assert enc_code.tolist() == want_code
    assert dec.tolist() == want_dec


def test_naive_round_trip_through_a_book():
    book = cc.Codebook.from_counts(DISTRIBUTIONS["geometric"])
    symbols = list(range(256)) + [0, 0, 1, 255, 17]
    bits = naive.encode_bits(symbols, book.lengths, book.escape_length)
    assert len(bits) == sum(int(book.symbol_bits()[s]) for s in symbols)
    decoded, used = naive.decode_bits(
        naive.bytes_to_bits(naive.bits_to_bytes(bits)), len(symbols), book.lengths, book.escape_length
    )
    assert decoded == symbols and used == len(bits)


# -- serialization ----------------------------------------------------------------------
def test_to_dict_from_dict_round_trip():
    for counts in DISTRIBUTIONS.values():
        book = cc.Codebook.from_counts(counts)
        d = book.to_dict()
        again = cc.Codebook.from_dict(json.loads(json.dumps(d)))
        assert again == book and again.id == book.id and again.raw == book.raw
        assert np.array_equal(again.lengths, book.lengths) and again.escape_length == book.escape_length
    raw = cc.Codebook.raw_book()
    assert raw.to_dict() == {"format": 1, "raw": True, "id": "0" * 16}
    assert cc.Codebook.from_dict(raw.to_dict()).raw


def test_from_dict_reads_upper_case_hex():
    book = cc.Codebook.from_counts(DISTRIBUTIONS["geometric"])
    d = book.to_dict()
    assert any(ch in "abcdef" for ch in "".join(d["lengths"]))  # the case matters here
    d["lengths"] = [row.upper() for row in d["lengths"]]
    assert cc.Codebook.from_dict(d) == book


def test_to_dict_layout():
    book = cc.Codebook.from_counts(DISTRIBUTIONS["dominant"])
    d = book.to_dict()
    assert d["format"] == 1 and d["raw"] is False and d["max_length"] == 12
    assert d["escape_length"] == book.escape_length
    assert len(d["lengths"]) == 16 and all(len(row) == 16 for row in d["lengths"])
    assert [int(ch, 16) for ch in "".join(d["lengths"])] == book.lengths.tolist()
    assert len(d["id"]) == 16 and int(d["id"], 16) == book.id_int


def test_from_dict_rejects_a_tampered_id():
    d = cc.Codebook.from_counts(DISTRIBUTIONS["geometric"]).to_dict()
    d["id"] = "%016x" % (int(d["id"], 16) ^ 1)
    with pytest.raises(cc.CodebookError, match="does not match its lengths"):
        cc.Codebook.from_dict(d)
    raw = {"format": 1, "raw": True, "id": "0000000000000001"}
    with pytest.raises(cc.CodebookError, match="does not match"):
        cc.Codebook.from_dict(raw)


def test_from_dict_rejects_edited_lengths():
    d = cc.Codebook.from_counts(DISTRIBUTIONS["geometric"]).to_dict()
    row = d["lengths"][0]
    d["lengths"][0] = ("1" if row[0] != "1" else "2") + row[1:]
    with pytest.raises(cc.CodebookError):
        cc.Codebook.from_dict(d)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"format": 2, "raw": True}, "unsupported codebook format 2"),
        ({"raw": True}, "unsupported codebook format None"),
        ([1, 2], "must be a JSON object"),
        ({"format": 1, "raw": False, "max_length": 11, "lengths": ["8" * 16] * 16}, "max_length 11"),
        ({"format": 1, "raw": False, "lengths": "8" * 256}, "list of hex strings"),
        ({"format": 1, "raw": False, "lengths": ["8" * 16] * 15}, "256 hex digits, got 240"),
        ({"format": 1, "raw": False, "lengths": ["g" * 16] * 16}, "not hexadecimal"),
        # digits of other scripts (int() would take them), a lone surrogate, a NUL
        ({"format": 1, "raw": False, "lengths": ["\u0663" * 16] * 16}, "not hexadecimal"),
        ({"format": 1, "raw": False, "lengths": ["\ud800" + "8" * 15] + ["8" * 16] * 15}, "not hexadecimal"),
        ({"format": 1, "raw": False, "lengths": ["\x00" + "8" * 15] + ["8" * 16] * 15}, "not hexadecimal"),
        ({"format": 1, "raw": False, "lengths": ["8" * 16] * 16, "escape_length": "0"}, "must be an integer"),
    ],
)
def test_from_dict_errors(data, message):
    with pytest.raises(cc.CodebookError, match=message):
        cc.Codebook.from_dict(data)


# -- errors -------------------------------------------------------------------------------
def test_from_counts_errors():
    with pytest.raises(ValueError, match="zero observations"):
        cc.Codebook.from_counts(np.zeros(256))
    with pytest.raises(ValueError, match="non-negative"):
        cc.Codebook.from_counts(np.r_[-1.0, np.ones(255)])
    with pytest.raises(ValueError, match="finite"):
        cc.Codebook.from_counts(np.r_[np.nan, np.ones(255)])
    with pytest.raises(ValueError, match=r"256 entries, got shape \(255,\)"):
        cc.Codebook.from_counts(np.ones(255))
    with pytest.raises(ValueError, match=r"256 entries, got shape \(2, 256\)"):
        cc.Codebook.from_counts(np.ones((2, 256)))


def test_kraft_violating_lengths_are_rejected():
    lengths = np.full(256, 8)
    lengths[0] = 7  # 2^-7 + 255 * 2^-8 > 1
    with pytest.raises(cc.CodebookError, match="Kraft"):
        cc.Codebook(lengths)
    lengths = np.zeros(256, dtype=np.int64)
    lengths[:3] = 1
    with pytest.raises(cc.CodebookError, match="Kraft"):
        cc.Codebook(lengths, escape_length=2)
    # An incomplete code is legal (Kraft < 1).
    lengths = np.full(256, 9)
    assert naive.kraft_sum_times(cc.Codebook(lengths).lengths, 0) == 1 << 11


def test_bad_lengths_and_escape_lengths_are_rejected():
    with pytest.raises(cc.CodebookError, match=r"0\.\.12, got 0\.\.13"):
        cc.Codebook(np.r_[13, np.full(255, 0)], escape_length=1)
    with pytest.raises(cc.CodebookError, match="256 integer code lengths"):
        cc.Codebook(np.full(255, 8))
    with pytest.raises(cc.CodebookError, match="256 integer code lengths"):
        cc.Codebook(np.full(256, 8.0))
    with pytest.raises(cc.CodebookError, match="0..12"):
        cc.Codebook(np.r_[-1, np.full(255, 8)])
    escaped = np.r_[np.full(128, 8), np.zeros(128, dtype=np.int64)]
    with pytest.raises(cc.CodebookError, match="escape_length is 0; expected 1..12"):
        cc.Codebook(escaped, escape_length=0)
    with pytest.raises(cc.CodebookError, match="escape_length is 13"):
        cc.Codebook(escaped, escape_length=13)
    with pytest.raises(cc.CodebookError, match="must be 0 when no symbol is escaped"):
        cc.Codebook(np.full(256, 8), escape_length=3)
    # The same book made by hand is accepted: 128 codes of 8 bits + escape of 1 bit.
    assert cc.Codebook(escaped, escape_length=1).escape_length == 1


def test_codebook_error_is_a_value_error():
    assert issubclass(cc.CodebookError, ValueError)


def test_a_hand_made_book_codes_its_symbols():
    # A book whose escaped symbols appear in the data still round trips through the codec.
    lengths = np.zeros(256, dtype=np.int64)
    lengths[:4] = [1, 2, 3, 4]
    book = cc.Codebook(lengths, escape_length=4)
    books = cc.CodebookSet({("gradient", "int8", 0): book})
    codec = cc.Codec(books, chunk_elems=256)
    t = torch.tensor([0, 1, 2, 3, -5, 100, 0, 0] * 40, dtype=torch.int8)
    frame = codec.encode(t)
    p = cc.get_frame_parameters(frame)
    assert p.book_ids == (book.id,)
    assert not p.table["cflags"][0] & 0x10  # stream 0 coded
    bits_equal(codec.decode(frame), t)
