"""Warmup profiler (averaging semantics) and codebook sets (files, lookups, defaults)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import comm_codec as cc
from comm_codec.books.profiler import WarmupProfiler, stream_counts
from comm_codec.core.streams import spec_for

import naive
from helpers import bits_equal

pytestmark = pytest.mark.unit


def _two_tensors():
    g = torch.Generator().manual_seed(1)
    big = (torch.randn(200_000, generator=g) * 1e-3).to(torch.bfloat16)
    # Small and shaped differently: exponents spread evenly over 40 octaves.
    e = torch.randint(-20, 20, (600,), generator=g).float()
    small = (torch.exp2(e) * torch.sign(torch.randn(600, generator=g))).to(torch.bfloat16)
    return big, small


def _normalized(counts: np.ndarray) -> np.ndarray:
    return counts / counts.sum(axis=1, keepdims=True)


def test_books_come_from_the_mean_of_normalized_distributions():
    big, small = _two_tensors()
    prof = WarmupProfiler(max_books=1)  # single books: the average alone decides
    prof.observe(big, kind="gradient")
    prof.observe(small, kind="gradient")
    books = prof.build()
    (c1, z1), (c2, _z2) = stream_counts(big), stream_counts(small)
    assert z1 == int((big.view(torch.int16) == 0).sum()) and c1.sum(axis=1).tolist() == [big.numel() - z1] * 2
    avg = (_normalized(c1) + _normalized(c2)) / 2
    for s in range(2):
        want = cc.Codebook.from_counts(avg[s])
        assert books[("gradient", "bf16", s)].id == want.id, s
        stats = books.stats(("gradient", "bf16", s))
        assert stats["observations"] == 2
        assert stats["expected_bits"] == pytest.approx(want.expected_bits(avg[s]), abs=1e-4)
    # The test can tell averaging from pooling: pooled counts give another exponent book.
    pooled = cc.Codebook.from_counts((c1 + c2)[0])
    assert pooled.id != books[("gradient", "bf16", 0)].id
    assert prof.kinds() == [("gradient", "bf16")] and prof.observations == 2


def test_an_average_book_that_loses_on_the_chunks_is_raw():
    # The small tensor's few values make the average mantissa distribution look
    # compressible; on the chunks (the big tensor's, one of them the small one) the
    # average book saves nothing over raw, so with chunk rows (groups) the stream is raw.
    big, small = _two_tensors()
    single, grouped = WarmupProfiler(max_books=1), WarmupProfiler()
    for prof in (single, grouped):
        prof.observe(big, kind="gradient")
        prof.observe(small, kind="gradient")
    one, many = single.build(), grouped.build()
    assert not one.group("gradient", "bf16", 1).raw and many.group("gradient", "bf16", 1).raw
    assert one[("gradient", "bf16", 0)].id == many[("gradient", "bf16", 0)].id  # the exponent book pays
    x = torch.cat([big, small])
    f1, f2 = cc.Codec(one).encode(x), cc.Codec(many).encode(x)
    assert f2.numel() <= f1.numel() + 64  # nothing lost beyond chunk-table noise
    bits_equal(cc.Codec(many).decode(f2), x)


def test_kinds_and_dtypes_are_kept_apart():
    big, small = _two_tensors()
    prof = WarmupProfiler()
    prof.observe(big, kind="gradient")
    prof.observe(small, kind="weight")
    prof.observe(big.float(), kind="gradient")
    books = prof.build()
    assert books.keys() == sorted(
        [("gradient", "bf16", 0), ("gradient", "bf16", 1), ("weight", "bf16", 0), ("weight", "bf16", 1)]
        + [("gradient", "fp32", s) for s in range(4)]
    )
    c2, _ = stream_counts(small)
    assert books[("weight", "bf16", 0)].id == cc.Codebook.from_counts(_normalized(c2)[0]).id


def test_profiler_books_code_what_they_profiled():
    big, small = _two_tensors()
    prof = WarmupProfiler(chunk_elems=4096)
    prof.observe(big)
    codec = cc.Codec(prof.build(), chunk_elems=4096)
    f = codec.encode(big)
    assert len(f) < big.numel() * 2 * 0.8
    bits_equal(codec.decode(f), big)


def test_build_with_zero_observations_raises():
    with pytest.raises(ValueError, match="cannot build codebooks from zero observations"):
        WarmupProfiler().build()
    prof = WarmupProfiler()
    prof.observe(torch.zeros(100, dtype=torch.bfloat16))
    prof.observe(torch.empty(0, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cannot build codebooks from zero observations"):
        prof.build()


def test_all_zero_tensors_do_not_dilute_the_average():
    big, _ = _two_tensors()
    a, b = WarmupProfiler(), WarmupProfiler()
    a.observe(big)
    b.observe(big)
    b.observe(torch.zeros(5000, dtype=torch.bfloat16))
    assert a.build()[("gradient", "bf16", 0)] == b.build()[("gradient", "bf16", 0)]


def test_observe_errors():
    prof = WarmupProfiler()
    with pytest.raises(ValueError, match="unknown tensor kind 'grad'"):
        prof.observe(torch.ones(4), kind="grad")
    with pytest.raises(TypeError, match="cannot code dtype torch.float64"):
        prof.observe(torch.ones(4, dtype=torch.float64))


def test_warmup_profiler_is_public():
    # design.md's contract: prof = cc.WarmupProfiler(); prof.observe(...); prof.build()
    assert cc.WarmupProfiler is WarmupProfiler


# -- codebook sets ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def some_books():
    big, small = _two_tensors()
    prof = WarmupProfiler()
    prof.observe(big, kind="gradient")
    prof.observe(small.to(torch.float16), kind="activation")
    prof.observe((big.float() * 100).round().clamp(-128, 127).to(torch.int8), kind="weight")
    return prof.build(meta={"source": "test"})


def test_save_load_round_trip(tmp_path, some_books):
    p1, p2, p3 = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    some_books.save(p1)
    some_books.save(p2)
    assert p1.read_bytes() == p2.read_bytes()
    loaded = cc.CodebookSet.load(p1)
    assert loaded.digest == some_books.digest and loaded == some_books
    assert loaded.keys() == some_books.keys()
    for key, book in some_books.items():
        assert loaded[key] == book and loaded.stats(key) == some_books.stats(key)
    assert loaded.meta == some_books.meta and loaded.meta["source"] == "test"
    loaded.save(p3)
    assert p3.read_bytes() == p1.read_bytes()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.json", "b.json", "c.json"]  # no temp files left
    # A codec with the loaded books decodes frames made with the originals.
    x = torch.randn(3000).to(torch.bfloat16) * 1e-3
    bits_equal(cc.Codec(loaded).decode(cc.Codec(some_books).encode(x)), x)


def test_digest_depends_on_every_book(some_books):
    items = dict(some_books.groups())
    key = ("gradient", "bf16", 0)
    items[key] = cc.Codebook.raw_book()
    assert cc.CodebookSet(items).digest != some_books.digest
    assert cc.CodebookSet(dict(some_books.groups())).digest == some_books.digest
    # A group's later books count too, not only its first.
    firsts = cc.CodebookSet(dict(some_books.items()))
    assert len(some_books.group(*key)) > 1 and firsts.digest != some_books.digest


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        cc.CodebookSet.load(tmp_path / "nope.json")


def _saved(tmp_path, books) -> tuple:
    path = tmp_path / "books.json"
    books.save(path)
    return path, json.loads(path.read_text())


def test_load_corrupt_json(tmp_path, some_books):
    path, _ = _saved(tmp_path, some_books)
    path.write_bytes(b"{not json")
    with pytest.raises(cc.CodebookError, match=f"{path}: not a valid codebook file \\(bad JSON"):
        cc.CodebookSet.load(path)
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(cc.CodebookError, match="not a valid codebook file"):
        cc.CodebookSet.load(path)


def test_load_truncated_file(tmp_path, some_books):
    path, _ = _saved(tmp_path, some_books)
    text = path.read_bytes()
    for cut in (0, 1, len(text) // 3, len(text) - 3):
        path.write_bytes(text[:cut])
        with pytest.raises(cc.CodebookError, match=str(path)):
            cc.CodebookSet.load(path)


def test_load_wrong_version_and_format(tmp_path, some_books):
    path, data = _saved(tmp_path, some_books)
    path.write_text(json.dumps({**data, "version": 3}))
    with pytest.raises(cc.CodebookError, match=f"{path}: codebook file version 3; this build reads versions 1, 2"):
        cc.CodebookSet.load(path)
    path.write_text(json.dumps({**data, "format": "zstd.dict"}))
    with pytest.raises(cc.CodebookError, match="not a comm_codec codebook file"):
        cc.CodebookSet.load(path)
    path.write_text(json.dumps([1, 2, 3]))
    with pytest.raises(cc.CodebookError, match="not a comm_codec codebook file"):
        cc.CodebookSet.load(path)


def test_load_tampered_book_id_names_the_file_and_entry(tmp_path, some_books):
    path, data = _saved(tmp_path, some_books)
    i = next(k for k, e in enumerate(data["books"]) if not e["book"]["raw"])
    entry = data["books"][i]
    entry["book"]["id"] = "%016x" % (int(entry["book"]["id"], 16) ^ 0x100)
    path.write_text(json.dumps(data))
    where = f"{entry['kind']}/{entry['dtype']}/{entry['stream']}"
    with pytest.raises(cc.CodebookError, match=f"{path}: book entry {i} \\({where}\\): codebook id"):
        cc.CodebookSet.load(path)


def test_load_malformed_entries(tmp_path, some_books):
    path, data = _saved(tmp_path, some_books)
    del data["books"][0]["kind"]
    path.write_text(json.dumps(data))
    with pytest.raises(cc.CodebookError, match=f"{path}: book entry 0 is malformed"):
        cc.CodebookSet.load(path)
    _, data = _saved(tmp_path, some_books)
    data["books"][0]["dtype"] = "fp64"
    path.write_text(json.dumps(data))
    with pytest.raises(cc.CodebookError, match=str(path)):
        cc.CodebookSet.load(path)


def test_fallback_reduced_gradient_uses_gradient():
    g0 = cc.Codebook.from_counts(0.6 ** np.arange(256))
    books = cc.CodebookSet({("gradient", "bf16", 0): g0, ("gradient", "bf16", 1): cc.Codebook.raw_book()})
    assert books.get("reduced_gradient", "bf16", 0) is g0
    assert books.get("reduced_gradient", torch.bfloat16, 1).raw
    codec = cc.Codec(books)
    x = torch.randn(4000).to(torch.bfloat16)
    f = codec.encode(x, kind="reduced_gradient")
    assert cc.get_frame_parameters(f).book_ids == (g0.id, "0" * 16)
    bits_equal(codec.decode(f), x)
    with pytest.raises(ValueError, match="codebook set has no book for fp32 stream 0"):
        books.get("gradient", "fp32", 0)
    with pytest.raises(ValueError, match="unknown tensor kind"):
        books.get("gradients", "bf16", 0)


def test_codebook_set_argument_errors():
    raw = cc.Codebook.raw_book()
    with pytest.raises(ValueError, match="unknown tensor kind"):
        cc.CodebookSet({("grads", "bf16", 0): raw})
    with pytest.raises(ValueError, match="bf16 has streams 0..1, got 2"):
        cc.CodebookSet({("gradient", "bf16", 2): raw})
    with pytest.raises(TypeError, match="must be a Codebook"):
        cc.CodebookSet({("gradient", "bf16", 0): "raw"})
    with pytest.raises(TypeError, match="cannot code dtype"):
        cc.CodebookSet({("gradient", torch.float64, 0): raw})


def test_union_prefers_the_right_operand():
    a = cc.Codebook.from_counts(0.6 ** np.arange(256))
    b = cc.Codebook.from_counts(0.7 ** np.arange(256))
    left = cc.CodebookSet({("gradient", "int8", 0): a}, meta={"x": 1})
    right = cc.CodebookSet({("gradient", "int8", 0): b, ("weight", "int8", 0): a}, meta={"y": 2})
    both = left | right
    assert both[("gradient", "int8", 0)] is b and both[("weight", "int8", 0)] is a
    assert both.meta == {"x": 1, "y": 2} and len(both) == 2


def test_default_covers_every_kind_and_dtype():
    books = cc.CodebookSet.default()
    assert books is cc.CodebookSet.default()  # loaded once
    for kind in cc.KINDS:
        for dtype in cc.SUPPORTED_DTYPES:
            name = spec_for(dtype).name
            for s in range(torch.empty(0, dtype=dtype).element_size()):
                assert (kind, name, s) in books, (kind, name, s)
    assert len(books) == len(cc.KINDS) * (2 + 2 + 4 + 1 + 1 + 1 + 1)
    # Exponent streams of float types are coded; the shipped file is self-consistent.
    assert not books[("gradient", "bf16", 0)].raw
    assert all(book == cc.Codebook.from_dict(book.to_dict()) for _, book in books.items())


def test_stream_counts_counts_rare_zeros_and_leaves_out_common_ones():
    from comm_codec.books.profiler import stream_counts

    x = torch.randn(16384, dtype=torch.bfloat16)
    x[:1000] = 0  # 6 % zeros in the one chunk: coded inline, so counted
    counts, zeros = stream_counts(x, chunk_elems=16384)
    assert zeros == 1000 and counts[0].sum() == 16384
    x[:4000] = 0  # 24 %: the encoder masks them, so they are not counted
    counts, zeros = stream_counts(x, chunk_elems=16384)
    assert zeros == 4000 and counts[0].sum() == 16384 - 4000


def test_distribution_is_the_average_of_normalized_observations():
    from comm_codec.books.profiler import stream_counts

    prof = cc.WarmupProfiler()
    a = torch.randn(5000, dtype=torch.bfloat16)
    b = torch.randn(50000, dtype=torch.bfloat16) * 1e-3
    prof.observe(a, "gradient")
    prof.observe(b, "gradient")
    ca, _ = stream_counts(a)
    cb, _ = stream_counts(b)
    expected = (ca / ca.sum(axis=1, keepdims=True) + cb / cb.sum(axis=1, keepdims=True)) / 2
    assert np.allclose(prof.distribution("gradient", torch.bfloat16), expected)
    assert prof.distribution("weight", torch.bfloat16) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("numel", [1, 3, 1027, 5 * 1024 + 2])
def test_stream_counts_are_the_symbols_the_encoder_codes(dtype, numel):
    # Held against the naive stream split with each chunk's reference exponent read out
    # of a real frame; sizes that are not multiples of 4 reach the kernel's tail loop.
    g = torch.Generator().manual_seed(numel)
    if dtype == torch.int8:
        x = torch.randint(-128, 128, (numel,), generator=g, dtype=torch.int8)
    else:
        x = (torch.randn(numel, generator=g) * torch.exp2(torch.randint(-9, 9, (numel,), generator=g))).to(dtype)
        x[5::37] = 0  # under 1/8 zeros in every chunk: coded inline, so counted
    chunk = 1024
    frame = naive.parse_frame(bytes(cc.Codec(chunk_elems=chunk).encode(x).numpy()))
    width, _, exp_shift, _ = naive.LAYOUT[dtype]
    want = np.zeros((width, 256), dtype=np.int64)
    for c, (_, ref, _, _, _) in enumerate(frame.table):
        for s, stream in enumerate(naive.split(x[c * chunk : (c + 1) * chunk])):
            sub = (ref << exp_shift) if (s == 0 and exp_shift is not None) else 0
            for sym in stream:
                want[s, (sym - sub) % 256] += 1
    counts, zeros = stream_counts(x, chunk_elems=chunk)
    assert zeros == int((x.view(naive._INT_OF_WIDTH[width]) == 0).sum())
    assert np.array_equal(counts, want)


def test_load_deeply_nested_json_is_a_codebook_error(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"format": "comm_codec.codebooks", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(cc.CodebookError, match=f"{path}: not a valid codebook file \\(nested too deeply"):
        cc.CodebookSet.load(path)


def test_profile_help_states_the_entry_contract(capsys):
    from comm_codec.tools.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["profile", "--help"])
    assert exc.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for needed in (
        "function(prof, steps)",
        "prof.step()",
        "steps = --steps + --holdout",
        "torchrun",
        "launch_scripts/profile_codebooks.py",
        "(default: 5)",
        "(default: 0)",
        "(default: codebooks.json)",
        "(default: 8)",
    ):
        assert needed in text, needed


# -- histograms of chosen streams only (checkpoint planning) -----------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_chunk_counts_of_chosen_streams_equal_those_of_all(dtype):
    from comm_codec.books.profiler import chunk_counts

    g = torch.Generator().manual_seed(4)
    x = torch.randn(10_000, generator=g) * 1e-2
    x[:3000] = 0  # chunks where zeros are taken out of the counts
    x = (x * 1e4).clamp(-128, 127).to(torch.int8) if dtype == torch.int8 else x.to(dtype)
    full, zeros = chunk_counts(x, 1024)
    ns = full.shape[1]
    for streams in ([0], [ns - 1], list(range(ns))[::-1]):
        part, z = chunk_counts(x, 1024, streams=streams)
        assert part.shape == (full.shape[0], len(streams), 256)
        assert np.array_equal(part, full[:, streams]) and np.array_equal(z, zeros)
    assert chunk_counts(x, 1024, streams=[])[0].shape == (full.shape[0], 0, 256)
    with pytest.raises(ValueError, match=rf"streams \[{ns}\] do not exist"):
        chunk_counts(x, 1024, streams=[0, ns])


def _second_byte_saves_a_little(n=200_000):
    """fp32 whose second stream (the top mantissa byte) takes 200 of its 256 values: a
    book saves ~3.5 % of that stream's bits, with 7- and 8-bit codes."""
    g = torch.Generator().manual_seed(5)
    bits = (
        (torch.randint(120, 124, (n,), generator=g) << 23)
        | (torch.randint(0, 200, (n,), generator=g) << 15)
        | torch.randint(0, 1 << 15, (n,), generator=g)
    )
    sign = 1 - 2 * torch.randint(0, 2, (n,), generator=g).float()
    return bits.to(torch.int32).view(torch.float32) * sign


@pytest.mark.parametrize("max_books", [1, 8])
def test_wire_kinds_leave_a_stream_that_saves_little_raw(max_books):
    t = _second_byte_saves_a_little()
    for kind, coded in (
        ("gradient", False),
        ("reduced_gradient", False),
        ("activation", False),
        ("optimizer_state", True),
        ("weight", True),
    ):
        prof = WarmupProfiler(max_books=max_books)
        prof.observe(t, kind=kind)
        books = prof.build()
        assert not books.group(kind, "fp32", 0).raw, kind
        assert books.group(kind, "fp32", 1).raw is not coded, kind
    prof = WarmupProfiler(max_books=max_books, wire_min_gain=0.02)  # the caller weighs it
    prof.observe(t, kind="gradient")
    assert not prof.build().group("gradient", "fp32", 1).raw


def test_wire_min_gain_is_checked():
    with pytest.raises(ValueError, match="wire_min_gain"):
        WarmupProfiler(wire_min_gain=1.0)
