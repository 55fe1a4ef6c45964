"""Checkpoint compression: byte-exact round trips, deltas, corrupt input, the CLI.

Every round trip is checked with sha256 of the whole file; every failure case checks
the error type and message, that no output (nor temp file) is left behind, and that the
source is untouched.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
import time
import zipfile

import blake3
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from comm_codec import checkpoint as ck
from comm_codec.checkpoint import exact
from comm_codec.checkpoint.files import FileMap
from comm_codec.core.codebooks import CodebookSet
from comm_codec.core.frame import FrameError

from helpers import run_cli

pytestmark = pytest.mark.unit

_GEN = torch.Generator().manual_seed(0)


def _sha(path) -> str:
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()


def _weights(*shape, dtype=torch.float32, scale=0.02) -> torch.Tensor:
    return (torch.randn(*shape, generator=_GEN) * scale).to(dtype)


def _round_trip(src, tmp_path, base=None, threads=1, name="x"):
    """Compress and decompress src; assert the same sha256; return (summary, compressed path)."""
    packed, restored = tmp_path / f"{name}.cckp", tmp_path / f"{name}.out"
    summary = ck.compress_file(src, packed, base=base, threads=threads, force=True)  # called again on the same names
    ck.decompress_file(packed, restored, base=base, threads=threads, force=True)
    assert _sha(restored) == _sha(src)
    return summary, packed


def _leftovers(folder) -> list:
    """Files a failed call could have left: outputs and temp files."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".out", ".tmp")))


def _state_dict(step: int = 0) -> dict:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 128, generator=g) * 0.02
    w = w + step * 1e-4 * torch.randn(64, 128, generator=torch.Generator().manual_seed(100 + step))
    return {
        "model": {
            "w": w,
            "w_bf16": w.to(torch.bfloat16),
            "w_fp16": w.to(torch.float16),
            "bias": torch.zeros(128),
            "ids": torch.arange(2000),
            "mask": torch.ones(3000, dtype=torch.bool),
            "q8": torch.randint(-128, 127, (5000,), dtype=torch.int8, generator=g),
            "f8": w.to(torch.float8_e4m3fn),
            "f64": w.double(),
            "col": w[:, 3],
            "view": w.view(-1)[100:200],
        },
        "optimizer": {
            "state": {0: {"step": torch.tensor(float(step)), "exp_avg": w * 0.1, "exp_avg_sq": w * w}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        },
        "step": step,
        "note": "checkpoint",
        "nested": [1, 2.5, None, ("a", b"bytes")],
    }


# -- round trips per format -------------------------------------------------------------
@pytest.mark.slow
def test_safetensors_round_trip_all_dtypes(tmp_path):
    w = _weights(64, 128)
    tensors = {
        "w_fp32": w,
        "w_bf16": w.bfloat16(),
        "w_fp16": w.half(),
        "w_f8": w.to(torch.float8_e5m2),
        "f64": w.double(),
        "i64": torch.arange(4096),
        "i32": torch.arange(4096, dtype=torch.int32),
        "b": torch.ones(5000, dtype=torch.bool),
        "u8": torch.randint(0, 255, (8192,), dtype=torch.uint8),
        "tiny": torch.ones(3),
        "empty": torch.zeros(0),
        "scalar": torch.tensor(2.0),
    }
    save_file(tensors, tmp_path / "m.safetensors", metadata={"format": "pt"})
    for threads in (1, 2):
        summary, packed = _round_trip(tmp_path / "m.safetensors", tmp_path, threads=threads)
        assert summary.format == "safetensors" and summary.ratio > 1.0
    index = ck.read_index(packed)
    by_name = {t["name"]: t for t in index["tensors"]}
    for name in ("w_fp32", "w_bf16", "w_fp16", "w_f8", "u8"):
        assert by_name[name]["coding"] == "frame", name
    for name in ("f64", "i64", "i32", "b", "tiny"):  # unsupported dtypes and tiny tensors: zstd
        assert by_name[name]["coding"] == "opaque", name
    assert by_name["f64"]["dtype"] == "float64" and by_name["w_bf16"]["shape"] == [64, 128]
    listing = ck.describe(packed)
    assert "w_bf16" in listing and "bfloat16" in listing and "64x128" in listing


def test_torch_zip_round_trip_finds_storages_by_name(tmp_path):
    torch.save(_state_dict(), tmp_path / "c.pt")
    summary, packed = _round_trip(tmp_path / "c.pt", tmp_path, threads=2)
    assert summary.format == "torch_zip"
    tensors = {t["name"]: t for t in ck.read_index(packed)["tensors"]}
    assert tensors["model.w"]["dtype"] == "float32" and tensors["model.w"]["coding"] == "frame"
    assert tensors["model.w"]["shape"] == [64, 128]
    assert tensors["model.w_bf16"]["coding"] == "frame"
    assert tensors["model.f8"]["dtype"] == "float8_e4m3fn"  # _rebuild_tensor_v3 + dtype global
    assert tensors["model.f64"]["dtype"] == "float64" and tensors["model.f64"]["coding"] == "opaque"
    assert tensors["optimizer.state.0.exp_avg"]["kind"] == "optimizer_state"
    assert tensors["model.w"]["kind"] == "weight"
    # model.col and model.view share model.w's storage: one storage, one name.
    assert "model.col" not in tensors and "model.view" not in tensors
    restored = ck.load(packed)
    assert torch.equal(restored["model"]["w"], _state_dict()["model"]["w"])


def test_storage_claimed_with_two_dtypes_is_opaque(tmp_path):
    """torch refuses to save this; a crafted file can claim it. The storage stays opaque."""
    torch.save({"a": _weights(4096), "b": torch.arange(4096, dtype=torch.int32)}, tmp_path / "two.pt")
    with (
        zipfile.ZipFile(tmp_path / "two.pt") as src,
        zipfile.ZipFile(tmp_path / "v.pt", "w", zipfile.ZIP_STORED) as dst,
    ):
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                assert data.count(b"X\x01\x00\x00\x001") == 1
                data = data.replace(b"X\x01\x00\x00\x001", b"X\x01\x00\x00\x000")  # b's storage -> a's
            dst.writestr(info.filename, data)
    _, packed = _round_trip(tmp_path / "v.pt", tmp_path)
    assert [t["coding"] for t in ck.read_index(packed)["tensors"]] == ["opaque", "opaque"]


@settings(max_examples=25)
@given(
    data=st.one_of(
        st.binary(max_size=3000),
        st.binary(min_size=5000, max_size=20000),
        st.sampled_from(
            [b"", b"\x00" * 70000, b"PK\x03\x04" + b"\x00" * 100, b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}\x00\x00"]
        ),
    )
)
def test_generic_round_trip(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("gen")
    (folder / "f.bin").write_bytes(data)
    summary, _ = _round_trip(folder / "f.bin", folder)
    assert summary.format == "generic" and summary.original_bytes == len(data)


def test_empty_file(tmp_path):
    (tmp_path / "e").write_bytes(b"")
    summary, packed = _round_trip(tmp_path / "e", tmp_path)
    assert summary.original_bytes == 0 and ck.verify_file(packed).digest == "blake3:" + blake3.blake3(b"").hexdigest()


def test_text_file_compresses(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"the quick brown fox jumps over the lazy dog\n" * 50000)
    summary, _ = _round_trip(tmp_path / "t.txt", tmp_path, threads=2)
    assert summary.ratio > 50


def _many_tensors(step: int, dtype=torch.bfloat16) -> dict:
    """A model-like state dict: a dozen weights past 64 Ki elements (chunk sizes are
    weighed) with tiny biases between them (small opaque segments)."""
    g = torch.Generator().manual_seed(7)
    out = {}
    for i in range(12):
        w = torch.randn(160 + 40 * i, 512, generator=g) * (0.01 * (1 + i % 3))
        w = w + step * 1e-3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(50 + i + step))
        out[f"layer{i}.w"] = w.to(dtype)
        out[f"layer{i}.b"] = torch.zeros(16)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_same_output_for_any_number_of_threads(tmp_path, fmt):
    """Tensors are coded in parallel but planned in file order: one file, any threads."""
    for step in (0, 1):
        sd = _many_tensors(step)
        path = tmp_path / f"s{step}.{fmt}"
        save_file(sd, path) if fmt == "safetensors" else torch.save(sd, path)
    for base in (None, tmp_path / f"s0.{fmt}"):
        outputs = []
        for threads in (1, 2, 3):
            _, packed = _round_trip(tmp_path / f"s1.{fmt}", tmp_path, base=base, threads=threads, name=f"t{threads}")
            outputs.append(packed.read_bytes())
        assert outputs[0] == outputs[1] == outputs[2]
    index = ck.read_index(packed)
    assert any(t["transform"] == "xor" for t in index["tensors"])


def test_default_threads_follow_the_file_size(tmp_path, monkeypatch):
    """By default a small file gets one thread (a second costs more than it brings there),
    a larger one the CPU count; a number asked for is used as given."""
    import numba

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 2)
    small = tmp_path / "small.safetensors"
    save_file(_many_tensors(0), small)
    assert small.stat().st_size < exact.SMALL_FILE_BYTES
    monkeypatch.setattr(exact, "SMALL_FILE_BYTES", small.stat().st_size)  # the same file, now "large"
    large = ck.compress_file(small, tmp_path / "large.cckp")
    monkeypatch.setattr(exact, "SMALL_FILE_BYTES", small.stat().st_size + 1)
    packed = tmp_path / "small.cckp"
    summaries = [
        ck.compress_file(small, packed),
        ck.compress_file(small, packed, threads=2, force=True),
        ck.decompress_file(packed, tmp_path / "small.out"),
        ck.decompress_file(packed, tmp_path / "small.out", threads=2, force=True),
        ck.verify_file(packed),
    ]
    assert large.threads == 2
    assert [s.threads for s in summaries] == [1, 2, 1, 2, 1]
    assert (tmp_path / "small.out").read_bytes() == small.read_bytes()


def _layers(step: int) -> dict:
    """A file whose planning depends on order: alike layers (a later one may reuse a book
    built for an earlier one), layers of other scales (books of their own), tiny tensors
    (coded with the bytes around them), a bf16 table of 8+ chunks (groups), three dtypes."""
    g = torch.Generator().manual_seed(7)
    out = {}
    for i in range(10):
        scale = (0.02, 0.02, 0.5, 1e-3, 0.02)[i % 5]
        w = torch.randn(256, 96 + 16 * i, generator=g) * scale
        w = w + step * 1e-4 * torch.randn(w.shape, generator=torch.Generator().manual_seed(50 + i))
        out[f"layer{i:02d}.w"] = w.to((torch.float32, torch.bfloat16, torch.float16)[i % 3])
        out[f"layer{i:02d}.b"] = torch.randn(96, generator=g).to(torch.bfloat16)
    table = torch.randn(9 * 65536, generator=g) * torch.linspace(0.001, 2.0, 9 * 65536)
    out["table"] = table.to(torch.bfloat16)
    return out


def test_container_is_the_same_bytes_at_any_thread_count(tmp_path):
    """With threads, tensors are sampled and counted ahead on workers, while books are
    chosen in file order: 1, 2 and 3 threads write the same bytes, standalone and as a delta."""
    src, prev = tmp_path / "step1.safetensors", tmp_path / "step0.safetensors"
    save_file(_layers(1), src)
    save_file(_layers(0), prev)
    for base in (None, prev):
        packed = []
        for threads in (1, 2, 3, 1, 2):
            out = tmp_path / f"{threads}.{len(packed)}.cckp"
            summary = ck.compress_file(src, out, base=base, threads=threads, progress=False, force=True)
            assert summary.threads == threads and summary.coded == 11  # the biases go with the bytes around them
            packed.append(out.read_bytes())
        assert all(p == packed[0] for p in packed[1:])
        index = ck.read_index(out)
        assert len(index["books"]) >= 3  # books built (and some reused) in file order
        if base is not None:
            assert any(t["transform"] == "xor" for t in index["tensors"])
        ck.decompress_file(out, tmp_path / "out", base=base, threads=2, progress=False, force=True)
        assert _sha(tmp_path / "out") == _sha(src)


def test_segments_reach_the_workers_in_batches_in_order():
    """Small segments go to a worker together (a wake-up each cost more than coding a small
    tensor), at least ``least`` bytes or ``most`` of them; on one thread, one at a time."""
    from comm_codec.checkpoint.pipeline import batched, unbatched

    sizes = [100, 2000] + [5] * 9 + [3000, 7]
    jobs = [exact._Job(i, n, -1) for i, n in enumerate(sizes)]
    batches = list(batched(iter(jobs), 1000, 8))
    assert [j for b in batches for j in b] == jobs
    assert [len(b) for b in batches] == [2, 8, 2, 1]
    assert [len(b) for b in batched(iter(jobs), exact._batch_bytes(1), 8)] == [1] * len(jobs)
    segments = [[0, n] for n in sizes]
    assert next(batched(iter(segments), 2100, 8, lambda seg: seg[1])) == segments[:2]
    results = [[j.length for j in b] for b in batches]
    assert list(unbatched(zip(batches, results))) == [(j, j.length) for j in jobs]


def test_big_tensor_is_cut_into_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(exact, "PIECE_BYTES", 64 << 10)
    save_file({"w": _weights(300_000, dtype=torch.bfloat16)}, tmp_path / "b.safetensors")
    _, packed = _round_trip(tmp_path / "b.safetensors", tmp_path, threads=2)
    index = ck.read_index(packed)
    chunk = index["tensors"][0]["chunk_elems"]
    frames = [s for s in index["segments"] if s[4] == "frame"]
    assert len(frames) == -(-300_000 // chunk) > 1  # pieces of one chunk each (64 kB < a chunk)


def test_nonzero_padding_after_a_segment_is_corruption(tmp_path):
    """The zeros that pad a segment to 8 bytes are covered by no CRC: a restore checks
    them, and names the segment."""
    save_file(
        {"w": _weights(5003, dtype=torch.bfloat16), "b": torch.arange(7, dtype=torch.int8)}, tmp_path / "p.safetensors"
    )
    packed = tmp_path / "p.cckp"
    ck.compress_file(tmp_path / "p.safetensors", packed)
    seg = next(s for s in ck.read_index(packed)["segments"] if s[3] % 8)
    data = bytearray(packed.read_bytes())
    data[seg[2] + seg[3]] = 1  # the first padding byte after its payload
    packed.write_bytes(bytes(data))
    for op in (lambda: ck.decompress_file(packed, tmp_path / "p.out"), lambda: ck.verify_file(packed)):
        with pytest.raises(
            ck.CheckpointError, match=f"padding after the segment at source bytes {seg[0]}\\.\\..* is corrupted"
        ):
            op()
    assert not (tmp_path / "p.out").exists()


def test_chunk_size_follows_the_data(tmp_path):
    """Homogeneous tensors get large chunks; tensors whose scale changes get small ones."""
    gen = torch.Generator().manual_seed(5)
    flat = torch.randn(1 << 20, generator=gen) * 0.02
    scaled = torch.randn(1 << 20, generator=gen) * torch.logspace(-8, 2, 16).repeat_interleave(1 << 16)
    save_file({"flat": flat.bfloat16(), "scaled": scaled.bfloat16()}, tmp_path / "m.safetensors")
    _, packed = _round_trip(tmp_path / "m.safetensors", tmp_path)
    chunks = {t["name"]: t["chunk_elems"] for t in ck.read_index(packed)["tensors"]}
    assert chunks == {"flat": 1 << 18, "scaled": 1 << 16}


# -- deltas ------------------------------------------------------------------------------
@pytest.mark.slow
def test_delta_chain_of_three(tmp_path):
    paths = []
    for step in range(3):
        paths.append(tmp_path / f"s{step}.pt")
        torch.save(_state_dict(step), paths[-1])
    standalone, _ = _round_trip(paths[1], tmp_path, name="alone")
    d1, p1 = _round_trip(paths[1], tmp_path, base=paths[0], name="d1")
    d2, p2 = _round_trip(paths[2], tmp_path, base=paths[1], name="d2")
    assert d1.delta > 0 and d2.delta > 0
    assert d1.ratio > standalone.ratio
    index = ck.read_index(p2)
    assert index["base"]["blake3"] == blake3.blake3(paths[1].read_bytes()).hexdigest()
    w_bf16 = next(t for t in index["tensors"] if t["name"] == "model.w_bf16")
    assert w_bf16["transform"] == "xor"
    # Each link restores with its own base only.
    with pytest.raises(ck.CheckpointError, match="wrong base"):
        ck.decompress_file(p2, tmp_path / "x.out", base=paths[0])


def test_delta_safetensors_and_new_tensors(tmp_path):
    w = _weights(256, 256, dtype=torch.bfloat16)
    save_file({"w": w, "gone": w.clone()}, tmp_path / "a.safetensors")
    save_file({"w": w.clone(), "new": _weights(64, 64), "gone": w[:10].clone()}, tmp_path / "b.safetensors")
    summary, packed = _round_trip(tmp_path / "b.safetensors", tmp_path, base=tmp_path / "a.safetensors")
    tensors = {t["name"]: t for t in ck.read_index(packed)["tensors"]}
    assert tensors["w"]["transform"] == "xor"  # unchanged: all zeros after XOR
    assert tensors["new"]["transform"] == "none"
    index = ck.read_index(packed)
    w_index = [t["name"] for t in index["tensors"]].index("w")
    assert sum(seg[3] for seg in index["segments"] if seg[6] == w_index) < 1000  # 128 kB unchanged


def test_base_may_be_a_standalone_compressed_file(tmp_path):
    torch.save(_state_dict(0), tmp_path / "a.pt")
    torch.save(_state_dict(1), tmp_path / "b.pt")
    ck.compress_file(tmp_path / "a.pt", tmp_path / "a.cckp")
    _round_trip(tmp_path / "b.pt", tmp_path, base=tmp_path / "a.cckp")
    ck.compress_file(tmp_path / "b.pt", tmp_path / "b.cckp", base=tmp_path / "a.pt")
    with pytest.raises(ck.CheckpointError, match="itself a delta"):
        ck.compress_file(tmp_path / "a.pt", tmp_path / "c.cckp", base=tmp_path / "b.cckp")


def test_missing_and_wrong_base_refused(tmp_path):
    torch.save(_state_dict(0), tmp_path / "a.pt")
    torch.save(_state_dict(1), tmp_path / "b.pt")
    ck.compress_file(tmp_path / "b.pt", tmp_path / "b.cckp", base=tmp_path / "a.pt")
    with pytest.raises(ck.CheckpointError, match=r"compressed against base a\.pt .*pass that original file"):
        ck.decompress_file(tmp_path / "b.cckp", tmp_path / "b.out")
    with pytest.raises(ck.CheckpointError, match="wrong base: .*b.pt has blake3"):
        ck.decompress_file(tmp_path / "b.cckp", tmp_path / "b.out", base=tmp_path / "b.pt")
    assert _leftovers(tmp_path) == []
    # verify without the base checks every checksum, but cannot check the digest of the original
    assert ck.verify_file(tmp_path / "b.cckp").digest is None
    assert (
        ck.verify_file(tmp_path / "b.cckp", base=tmp_path / "a.pt").digest
        == "blake3:" + blake3.blake3((tmp_path / "b.pt").read_bytes()).hexdigest()
    )


# -- bad input ---------------------------------------------------------------------------
@pytest.fixture()
def packed(tmp_path):
    save_file(
        {"w": _weights(128, 128, dtype=torch.bfloat16), "f": _weights(64, 64), "i": torch.arange(3000)},
        tmp_path / "m.safetensors",
    )
    ck.compress_file(tmp_path / "m.safetensors", tmp_path / "m.cckp")
    return tmp_path / "m.cckp"


def _expect_refused(bad: bytes, folder, match=None):
    (folder / "bad.cckp").write_bytes(bad)
    with pytest.raises((ck.CheckpointError, FrameError), match=match):
        ck.decompress_file(folder / "bad.cckp", folder / "bad.out")
    with pytest.raises((ck.CheckpointError, FrameError)):
        ck.verify_file(folder / "bad.cckp")
    assert _leftovers(folder) == []


def test_bit_flips_are_detected(packed):
    data = packed.read_bytes()
    gen = torch.Generator().manual_seed(3)
    spots = torch.randint(0, len(data) * 8, (40,), generator=gen).tolist()
    spots += [0, 8 * 9, 8 * 12, 8 * (len(data) - 1), 8 * (len(data) - 20), 8 * 40]
    for bit in spots:
        bad = bytearray(data)
        bad[bit // 8] ^= 1 << (bit % 8)
        _expect_refused(bytes(bad), packed.parent)


@pytest.mark.parametrize("keep", [0, 5, 16, 100, -33, -32, -1])
def test_truncation_is_detected(packed, keep):
    data = packed.read_bytes()
    _expect_refused(
        data[:keep] if keep >= 0 else data[: len(data) + keep],
        packed.parent,
        match="truncated|not a comm_codec checkpoint",
    )


def test_trailing_garbage_is_detected(packed):
    _expect_refused(packed.read_bytes() + b"garbage!", packed.parent, match="appended")


def test_foreign_files_are_refused(tmp_path, packed):
    import comm_codec as cc

    frame = cc.Codec().encode(torch.ones(10))
    _expect_refused(frame.numpy().tobytes(), tmp_path, match="is a comm_codec frame")
    _expect_refused(ck.LOSSY_MAGIC + b"\0" * 64, tmp_path, match="lossy")
    _expect_refused(b"hello world", tmp_path, match="bad magic")


def test_unreadable_source_and_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        ck.compress_file(tmp_path / "missing.pt", tmp_path / "x.cckp")
    with pytest.raises(IsADirectoryError):
        ck.compress_file(tmp_path, tmp_path / "x.cckp")
    (tmp_path / "f").write_bytes(b"abc")
    with pytest.raises(IsADirectoryError):
        ck.compress_file(tmp_path / "f", tmp_path)
    with pytest.raises(FileNotFoundError, match="No such directory"):
        ck.compress_file(tmp_path / "f", tmp_path / "no" / "x.cckp")
    with pytest.raises(ValueError, match="threads must be"):
        ck.compress_file(tmp_path / "f", tmp_path / "x.cckp", threads=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_source_untouched_and_dst_never_the_source(tmp_path):
    torch.save(_state_dict(), tmp_path / "c.pt")
    before = (os.stat(tmp_path / "c.pt").st_mtime_ns, _sha(tmp_path / "c.pt"))
    ck.compress_file(tmp_path / "c.pt", tmp_path / "c.cckp")
    with pytest.raises(ck.CheckpointError, match="is the source file"):
        ck.compress_file(tmp_path / "c.pt", tmp_path / "c.pt")
    assert (os.stat(tmp_path / "c.pt").st_mtime_ns, _sha(tmp_path / "c.pt")) == before


def test_full_disk_leaves_nothing(tmp_path, monkeypatch):
    torch.save(_state_dict(), tmp_path / "c.pt")

    def no_space(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(ck.CheckpointError, match="cannot write .*No space left on device"):
        ck.compress_file(tmp_path / "c.pt", tmp_path / "c.out")
    assert _leftovers(tmp_path) == []


def test_output_writes_large_and_small_land_in_order(tmp_path, monkeypatch):
    """Payloads past the write buffer go to the file directly, after what the buffer
    holds; a write error there is the same clear CheckpointError."""
    from comm_codec.checkpoint import files

    g = np.random.default_rng(3)
    big = g.integers(0, 256, 3 * files.DIRECT_WRITE_BYTES + 5, dtype=np.uint8)
    parts = [
        b"head",
        big,
        b"\0" * 3,
        memoryview(bytes(range(200))),
        big[: files.DIRECT_WRITE_BYTES],
        b"z",
        bytearray(b"tail"),
    ]
    out = tmp_path / "o.bin"
    with files.atomic_output(str(out)) as f:
        for part in parts:
            f.write(part)
            f.pad8()
        want = b"".join(bytes(p) + b"\0" * (-len(bytes(p)) % 8) for p in parts)
        assert f.pos == len(want)
        f.commit()
    assert out.read_bytes() == want

    def no_space(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", no_space)
    with pytest.raises(ck.CheckpointError, match="cannot write .*No space left on device"):
        with files.atomic_output(str(tmp_path / "p.bin")) as f:
            f.write(big)
    assert not (tmp_path / "p.bin").exists()


@pytest.mark.parametrize("name", ["blake3", "sha256"])
def test_file_digest_over_several_blocks(tmp_path, monkeypatch, name):
    """A whole file hashed a block at a time (a base's digest) equals the digest of its
    bytes, with a short last block and an empty file."""
    from comm_codec.checkpoint import files

    monkeypatch.setattr(files, "_HASH_BLOCK", 4096)
    data = np.random.default_rng(5).integers(0, 256, 3 * 4096 + 123, dtype=np.uint8).tobytes()
    for content in (data, data[:4096], b""):
        (tmp_path / "f").write_bytes(content)
        m = files.FileMap(str(tmp_path / "f"))
        try:
            want = (blake3.blake3 if name == "blake3" else hashlib.sha256)(content).hexdigest()
            assert files.file_digest(m, name) == want
        finally:
            m.close()


def test_full_disk_on_decompress_fails_up_front(tmp_path, monkeypatch):
    torch.save(_state_dict(), tmp_path / "c.pt")
    ck.compress_file(tmp_path / "c.pt", tmp_path / "c.cckp")

    real = os.fstatvfs

    def full(fd):  # the output's file system has 4 kB left
        st = real(fd)
        return os.statvfs_result((st.f_bsize, 4096, st.f_blocks, 1, 1) + tuple(st)[5:])

    monkeypatch.setattr(os, "fstatvfs", full)
    with pytest.raises(ck.CheckpointError, match="cannot write .*c.out: No space left on device"):
        ck.decompress_file(tmp_path / "c.cckp", tmp_path / "c.out", threads=2)
    assert _leftovers(tmp_path) == []


def test_restored_output_is_checked_for_room_not_allocated(tmp_path, monkeypatch):
    """Allocating the output ahead (posix_fallocate) zeroes its pages on tmpfs, which the
    writes then overwrite, and holds its inode lock against the writers: restoring only
    checks that the file system has room."""
    torch.save(_state_dict(), tmp_path / "c.pt")
    ck.compress_file(tmp_path / "c.pt", tmp_path / "c.cckp")

    def refuse(fd, offset, length):
        raise AssertionError("the output was allocated ahead")

    monkeypatch.setattr(os, "posix_fallocate", refuse)
    for threads in (1, 2):
        ck.decompress_file(tmp_path / "c.cckp", tmp_path / "c.out", threads=threads, force=True)
        assert (tmp_path / "c.out").read_bytes() == (tmp_path / "c.pt").read_bytes()


def test_source_changing_during_compression_is_refused(tmp_path, monkeypatch):
    torch.save(_state_dict(), tmp_path / "c.pt")
    monkeypatch.setattr(FileMap, "unchanged", lambda self: False)
    with pytest.raises(ck.CheckpointError, match="changed while it was being compressed"):
        ck.compress_file(tmp_path / "c.pt", tmp_path / "c.out")
    assert _leftovers(tmp_path) == []


def test_never_unpickles(tmp_path):
    """A torch-like zip whose pickle would create a file if it were ever loaded."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    payload = pickle.dumps({"w": Evil()}, protocol=2)
    pickle.loads(payload)  # proof that the pickle is live ...
    assert marker.exists()
    marker.unlink()  # ... so that the checks below can fail
    with zipfile.ZipFile(tmp_path / "evil.pt", "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", payload)
        zf.writestr("archive/data/0", _weights(4096).numpy().tobytes())
        zf.writestr("archive/version", "3\n")
    summary, packed = _round_trip(tmp_path / "evil.pt", tmp_path)
    assert summary.format == "torch_zip"
    assert ck.read_index(packed)["tensors"][0]["coding"] == "opaque"  # no dtype known: opaque
    with pytest.raises(Exception):  # noqa: B017 - torch's refusal type differs between versions
        ck.load(packed)  # weights_only=True refuses the pickle
    assert not marker.exists()


def test_misleading_pickle_and_zip_layout(tmp_path):
    """Storages whose pickle lies about dtype or size, overlapping entries: still exact."""
    pid = ("storage", "torch FloatStorage", "0", "cpu", 10**9)  # claims far more than stored

    class Fake:
        def __reduce__(self):
            return (tuple, (pid,))

    with zipfile.ZipFile(tmp_path / "lie.pt", "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle.dumps([Fake()], protocol=2))
        zf.writestr("archive/data/0", _weights(4096).numpy().tobytes())
        zf.writestr("archive/byteorder", "big")
    _round_trip(tmp_path / "lie.pt", tmp_path)


def test_save_load_api(tmp_path):
    sd = _state_dict(0)
    ck.save(sd, tmp_path / "a.cckp")
    out = ck.load(tmp_path / "a.cckp")
    assert torch.equal(out["model"]["w_bf16"].view(torch.int16), sd["model"]["w_bf16"].view(torch.int16))
    assert out["nested"] == sd["nested"] and out["step"] == 0
    torch.save(sd, tmp_path / "a.pt")
    ck.save(_state_dict(1), tmp_path / "b.cckp", base=tmp_path / "a.pt")
    assert torch.equal(ck.load(tmp_path / "b.cckp", base=tmp_path / "a.pt")["model"]["w"], _state_dict(1)["model"]["w"])
    w = _weights(64, 64)
    save_file({"w": w}, tmp_path / "s.safetensors")
    ck.compress_file(tmp_path / "s.safetensors", tmp_path / "s.cckp")
    assert torch.equal(ck.load(tmp_path / "s.cckp")["w"], w)
    (tmp_path / "g.bin").write_bytes(b"not a checkpoint")
    ck.compress_file(tmp_path / "g.bin", tmp_path / "g.cckp")
    with pytest.raises(ck.CheckpointError, match="holds a generic file"):
        ck.load(tmp_path / "g.cckp")


def test_container_magic_and_trailer_are_pinned(packed):
    data = packed.read_bytes()
    assert data[:8] == b"\x89CCKP\r\n\x1a" and data[8:16] == struct.pack("<HHI", 1, 0, 0)
    assert data[-8:] == ck.MAGIC and struct.unpack("<HH", data[-12:-8]) == (1, 1)
    assert ck.is_checkpoint(packed) and ck.MAGIC != ck.LOSSY_MAGIC and not ck.MAGIC.startswith(b"CCFR")


# -- command line ------------------------------------------------------------------------
@pytest.mark.cli
@pytest.mark.slow
def test_cli_round_trip_and_errors(tmp_path):
    torch.save(_state_dict(0), tmp_path / "a.pt")
    torch.save(_state_dict(1), tmp_path / "b.pt")
    r = run_cli("compress", "b.pt", "b.cckp", "--base", "a.pt", "--threads", "2", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("compressed ") and "ratio" in r.stdout and "GB/s" in r.stdout
    r = run_cli("decompress", "b.cckp", "b.out", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("comm-codec: error: b.cckp was compressed against base a.pt")
    assert "Traceback" not in r.stderr and not (tmp_path / "b.out").exists()
    r = run_cli("decompress", "b.cckp", "b.out", "--base", "a.pt", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert _sha(tmp_path / "b.out") == _sha(tmp_path / "b.pt")
    r = run_cli("ls", "b.cckp", cwd=tmp_path)
    assert r.returncode == 0 and "model.w_bf16" in r.stdout and "xor-frame" in r.stdout
    r = run_cli("verify", "missing.cckp", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == "comm-codec: error: No such file or directory: missing.cckp\n"
    assert _leftovers(tmp_path) == ["b.out"]


@pytest.mark.cli
def test_cli_file_size_limit_is_a_clean_error(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk: a clear message, exit 2, nothing left."""
    (tmp_path / "r.bin").write_bytes(os.urandom(300_000))
    r = run_cli("compress", "r.bin", "r.cckp", cwd=tmp_path, limit_bytes=100_000)
    assert r.returncode == 2 and r.stderr.startswith("comm-codec: error: cannot write r.cckp: File too large")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.bin"]


# -- what a new user hit (#16) -----------------------------------------------------------
def test_an_unrelated_base_is_refused_and_an_unused_one_not_recorded(tmp_path):
    save_file({"w": _weights(128, 128)}, tmp_path / "m.safetensors")
    save_file({"other": _weights(128, 128)}, tmp_path / "unrelated.safetensors")
    with pytest.raises(ck.CheckpointError, match="shares no tensor with .*compress without --base"):
        ck.compress_file(tmp_path / "m.safetensors", tmp_path / "m.cckp", base=tmp_path / "unrelated.safetensors")
    assert _leftovers(tmp_path) == [] and not (tmp_path / "m.cckp").exists()
    # Same names and sizes but unrelated values: XOR never pays, so the file stands alone.
    save_file({"w": _weights(128, 128, scale=3.0)}, tmp_path / "noise.safetensors")
    ck.compress_file(tmp_path / "m.safetensors", tmp_path / "m.cckp", base=tmp_path / "noise.safetensors")
    assert ck.read_index(tmp_path / "m.cckp")["base"] is None
    ck.decompress_file(tmp_path / "m.cckp", tmp_path / "m.out")  # no base needed
    assert _sha(tmp_path / "m.out") == _sha(tmp_path / "m.safetensors")


def test_outputs_keep_the_inputs_permission_bits(tmp_path):
    torch.save(_state_dict(), tmp_path / "c.pt")
    os.chmod(tmp_path / "c.pt", 0o600)
    ck.compress_file(tmp_path / "c.pt", tmp_path / "c.cckp")
    ck.decompress_file(tmp_path / "c.cckp", tmp_path / "c.out")
    assert (os.stat(tmp_path / "c.cckp").st_mode & 0o777, os.stat(tmp_path / "c.out").st_mode & 0o777) == (0o600, 0o600)


def test_an_unwritable_output_directory_is_named_by_its_output(tmp_path, monkeypatch):
    from comm_codec.core import atomic

    torch.save(_state_dict(), tmp_path / "c.pt")
    real_open = os.open

    def denied(path, flags, *args, **kwargs):  # the temp file's create, as in a read-only directory
        if flags & os.O_CREAT and flags & os.O_EXCL:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(atomic.os, "open", denied)
    with pytest.raises(PermissionError) as info:
        ck.compress_file(tmp_path / "c.pt", tmp_path / "c.cckp")
    assert info.value.filename == str(tmp_path / "c.cckp")


# -- format: files of earlier writers, groups of books, partly compressible streams -------
_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def test_a_file_written_before_the_package_split_is_still_read(tmp_path):
    """v1_small.cckp was written by the flat-module code (commit b48c811), before groups."""
    src, packed = os.path.join(_DATA, "v1_small.safetensors"), os.path.join(_DATA, "v1_small.cckp")
    ck.decompress_file(packed, tmp_path / "out")
    assert _sha(tmp_path / "out") == _sha(src) == ck.read_index(packed)["source"]["sha256"]
    assert "groups" not in ck.read_index(packed)
    summary = ck.verify_file(packed)  # it records sha256, which is what is checked
    assert summary.sha256 == _sha(src) and summary.digest == "sha256:" + _sha(src)


def test_mixed_chunks_get_a_group_and_partly_compressible_streams_a_book(tmp_path, monkeypatch):
    from comm_codec.checkpoint import plan

    gen = torch.Generator().manual_seed(9)
    n = 1 << 20  # 16 chunks of 64 Ki
    gauss = torch.randn(n // 2, generator=gen) * 0.02
    laplace = torch.distributions.Laplace(0.0, 0.02).sample((n // 2,))
    mixed = torch.cat([gauss, laplace]).bfloat16()
    fp32 = torch.randn(n, generator=gen) * 0.02
    fp32[: n // 2] = fp32[: n // 2].half().float()  # half the chunks: low mantissa bytes zero
    save_file({"mixed": mixed, "fp32": fp32}, tmp_path / "m.safetensors")
    # No shipped books to weigh against: the tensors' own books alone.
    packed, plain = tmp_path / "with.cckp", tmp_path / "without.cckp"
    ck.compress_file(tmp_path / "m.safetensors", packed, codebooks=CodebookSet({}))
    index = ck.read_index(packed)
    t = {x["name"]: x for x in index["tensors"]}
    assert t["mixed"]["books"][0] in index["groups"] and len(index["groups"][t["mixed"]["books"][0]]) >= 2
    assert t["fp32"]["books"][3] != "0" * 16  # the lowest byte: coded where it compresses
    monkeypatch.setattr(plan, "GROUP_MIN_ROWS", 1 << 30)  # neither groups nor partial books
    ck.compress_file(tmp_path / "m.safetensors", plain, codebooks=CodebookSet({}))
    assert "groups" not in ck.read_index(plain)
    assert packed.stat().st_size < plain.stat().st_size * 0.99
    for p in (packed, plain):
        ck.decompress_file(p, tmp_path / f"{p.name}.out")
        assert _sha(tmp_path / f"{p.name}.out") == _sha(tmp_path / "m.safetensors")
    assert "own x" in ck.describe(packed)


def test_shipped_groups_are_priced_chunk_by_chunk(tmp_path):
    """The shipped fp32 weight groups of streams 2 and 3 start with books fitted to the chunks
    that compress (raw on average): priced chunk by chunk, with the encoder's raw fallback,
    they code a tensor that has one such chunk among random ones, too few chunks for a book
    of its own; priced on the tensor's summed counts they looked worse than raw."""
    gen = torch.Generator().manual_seed(11)
    n = 4 << 16  # four chunks of 64 Ki elements: fewer than a partly compressible stream's own book needs
    w = torch.randn(n, generator=gen) * 0.02
    w[: 1 << 16] = w[: 1 << 16].half().float()  # one chunk: the low 13 mantissa bits are zero
    save_file({"w": w}, tmp_path / "w.safetensors")
    summary, packed = _round_trip(tmp_path / "w.safetensors", tmp_path)
    index = ck.read_index(packed)
    t = index["tensors"][0]
    for s in (2, 3):
        assert t["books"][s] != "0" * 16, f"stream {s} stored raw"
        members = index.get("groups", {}).get(t["books"][s], [t["books"][s]])
        assert all(index["books"][b]["origin"] == f"shipped:weight/fp32/{s}" for b in members)
    # Streams 2 and 3 of the fp16-like chunk cost ~2 and ~1 bits instead of 8 (raw): ~3 %.
    assert summary.ratio > 1.33  # 1.29 with an own book fitted to the summed counts (256 Ki chunks)


def test_alike_chunks_are_priced_at_the_large_chunk_size_alone(tmp_path, monkeypatch):
    """A tensor of four alike 64 Ki chunks (the same reference, similar entropies) is priced
    once, in 256 Ki chunks; one whose chunks differ is priced at both sizes and keeps the
    cheaper (the fp16-like chunk of test_shipped_groups_are_priced_chunk_by_chunk)."""
    from comm_codec.checkpoint.plan import CHUNK_SIZES, BookChooser

    priced, counted = [], []
    real, real_counts = BookChooser.choose, BookChooser.counts
    monkeypatch.setattr(
        BookChooser, "choose", lambda self, rows, *a, **k: priced.append(len(rows)) or real(self, rows, *a, **k)
    )
    monkeypatch.setattr(BookChooser, "counts", lambda self, *a: counted.append(1) or real_counts(self, *a))
    gen = torch.Generator().manual_seed(12)
    alike = torch.randn(4 << 16, generator=gen) * 0.02
    differ = alike.clone()
    differ[: 1 << 16] = differ[: 1 << 16].half().float()
    for name, w, want in (("alike", alike, [1]), ("differ", differ, [4, 1])):
        priced.clear()
        counted.clear()
        save_file({"w": w}, tmp_path / f"{name}.safetensors")
        summary, packed = _round_trip(tmp_path / f"{name}.safetensors", tmp_path)
        assert priced == want, name
        assert len(counted) == 1, name  # the sample is counted once, whichever sizes are priced
        assert ck.read_index(packed)["tensors"][0]["chunk_elems"] in CHUNK_SIZES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.int8, torch.float8_e5m2])
def test_planning_counts_are_the_encoders_counts(dtype):
    """The planner's one-pass counts (comm_codec.kernels.plan) equal chunk_histograms' on the
    sampled chunks' counted elements laid end to end, at both chunk sizes, for every stream
    it counts; a stream it leaves out (random bytes) keeps each chunk's symbol count; zeros,
    masked chunks, a short last chunk, a sampled (strided) big tensor and a tensor counted
    on every 4th element included."""
    from comm_codec.books.profiler import chunk_counts
    from comm_codec.checkpoint.plan import CHUNK_SIZES, BookChooser
    from comm_codec.core.streams import spec_for

    chooser = BookChooser(CodebookSet({}))
    spec = spec_for(dtype)
    for n in (5000, 300_000, 2_500_001):
        x = torch.randn(n, generator=_GEN) * torch.logspace(-6, 1, n)
        x[::7] = 0
        x[: n // 9] = 0  # a masked chunk or two
        if dtype == torch.int8:
            t = (x * 50).clamp(-128, 127).to(dtype)
        else:
            t = x.to(dtype)
            if dtype == torch.float32:
                t[n // 3 : n // 2] = t[n // 3 : n // 2].half().float()  # low mantissa bytes zero: counted
        sample = chooser.sample(t.view(torch.uint8).numpy(), spec)
        assert sample.whole == (n <= 4 << 16)  # up to four chunks, or 16 of eight or more
        assert sample.every == (1 if n in (5000, 2_500_001) else 4)  # too few elements; fitting a group
        every = sample.every
        laid = torch.cat([t[a : a + k : every] for a, k in zip(sample.at.tolist(), sample.lengths.tolist())])
        assert sample.scale == n / len(laid)
        counts = chooser.counts(sample, spec)
        for chunk_elems in CHUNK_SIZES:
            rows, zeros, coded = counts[chunk_elems]
            # Chunks of whole 64 Ki pieces: each counts chunk_elems / every elements, and its
            # reference (every n // 256-th element) is taken from the same elements either way.
            want, want_zeros = chunk_counts(laid, chunk_elems // every)
            assert zeros == want_zeros.sum()
            for s in range(spec.nstreams):
                if coded[s]:
                    assert np.array_equal(rows[:, s], want[:, s]), (n, chunk_elems, s)
                else:
                    assert np.array_equal(rows[:, s].sum(axis=1), want[:, s].sum(axis=1))
        if dtype == torch.bfloat16 and n > 100_000:
            assert counts[CHUNK_SIZES[0]][2] == [True, False]  # sign and mantissa: random, left raw


def test_planning_kernels_refuse_bad_arguments_with_a_status():
    from comm_codec.kernels import plan as kp

    bits = np.zeros(1000, dtype=np.uint16)
    hist, zeros = np.zeros((1, 2, 256), dtype=np.int64), np.zeros(1, dtype=np.int64)
    coded = np.zeros(2, dtype=np.bool_)
    one = np.ones(1, dtype=np.int64)
    for start, length, step, streams in ((990, 20, 1, 2), (-1, 5, 1, 2), (0, 10, 1, 3), (0, 10, 0, 2)):
        status = kp.count_pieces(
            bits,
            np.array([start]),
            np.array([length]),
            1,
            step,
            1 << 15,
            7.8,
            np.zeros((1, streams, 256), dtype=np.int64),
            zeros,
            np.zeros(streams, np.bool_),
        )
        assert status == kp.STATUS_BAD_ARGS and not zeros.any()
    assert kp.count_pieces(bits, np.array([0]), np.array([10]), 1, 1, 1 << 15, 7.8, hist, zeros, coded) == kp.STATUS_OK
    hist = np.zeros((1, 1, 256), dtype=np.int64)
    refs = np.zeros(1, dtype=np.int64)
    assert kp.chunk_refs(bits, np.array([0]), np.array([1001]), 1, 0, refs) == kp.STATUS_BAD_ARGS
    assert kp.chunk_refs(bits, np.array([0]), np.array([10]), 0, 0, refs) == kp.STATUS_BAD_ARGS
    rows = np.zeros((1, 1, 256), dtype=np.int64)
    assert kp.chunk_rows(hist, one, one, np.array([256]), 1, 0, np.ones(1, dtype=np.bool_), rows) == kp.STATUS_BAD_ARGS
    assert kp.chunk_rows(hist, one, one, refs, 1, 0, np.ones(1, dtype=np.bool_), rows) == kp.STATUS_OK


def test_many_pieces_through_reused_buffers(tmp_path, monkeypatch):
    """Source pieces read for coding, coded pieces read back and decoded pieces all land in
    reused buffers, handed back once written and hashed: byte-exact at any threads, written
    to a file (positional) or read back by load(); stored (incompressible) pieces, whose
    buffer is what is written, included."""
    from comm_codec.checkpoint import files

    monkeypatch.setattr(exact, "PIECE_BYTES", 64 << 10)
    slow_hash = files.new_hasher

    class _Slow:  # a digest that lags behind: a buffer handed back before it is hashed would be reused
        def __init__(self, name):
            self.h = slow_hash(name)

        def update(self, data):
            time.sleep(0.002)
            self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(files, "new_hasher", _Slow)
    sd = {
        f"w{i}": _weights(300_000 + 999 * i, dtype=dtype)
        for i, dtype in enumerate((torch.bfloat16, torch.float32, torch.float16))
    }
    sd["noise"] = torch.randint(-(2**62), 2**62, (40_000,), generator=_GEN)  # opaque and incompressible: stored
    save_file(sd, tmp_path / "m.safetensors")
    for threads in (1, 3):
        _, packed = _round_trip(tmp_path / "m.safetensors", tmp_path, threads=threads, name=f"t{threads}")
        assert "stored" in {s[4] for s in ck.read_index(packed)["segments"]}
        loaded = ck.load(packed, threads=threads)
        assert all(torch.equal(loaded[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in sd)


@pytest.mark.parametrize(
    "value, message",
    [
        ({"a": [[1, "x"], [2, 3]], "m": {}}, "f.cckp: index.a[1][1]: expected a string, got 3"),
        ({"a": [[1]], "m": {}}, "f.cckp: index.a[0]: expected a list of 2 items, got [1]"),
        ({"a": [], "m": {"ab": {}}}, "f.cckp: index.m['ab']: field 'x' is missing"),
        ({"a": [], "m": {"abc": {"x": 1}}}, "f.cckp: index.m key: expected a string of 2 characters, got 'abc'"),
        ({"a": [], "m": {"ab": {"x": True}}}, "f.cckp: index.m['ab'].x: expected an integer from 0 to 9, got True"),
    ],
)
def test_index_schema_names_the_bad_field(value, message):
    """A malformed index names the first bad field by its full path (built only on failure)."""
    from comm_codec.checkpoint import schema as S

    spec = S.Record(
        {"a": S.ListOf(S.Row(S.Int(), S.Str())), "m": S.MapOf(S.Str(length=2), S.Record({"x": S.Int(0, 9)}))}
    )
    with pytest.raises(ck.CheckpointError) as info:
        S.check(value, spec, "f.cckp")
    assert str(info.value) == message
    S.check({"a": [[1, "x"]], "m": {"ab": {"x": 9}}}, spec, "f.cckp")  # a fitting value passes


def test_plan_bytes_chooses_what_plan_tensor_chooses_for_the_same_bytes(tmp_path):
    # A tensor in memory (the DCP writer's case) and the same tensor in a file get the
    # same chunk size and books; bytes of another size are refused.
    from comm_codec.checkpoint.formats import find_tensors
    from comm_codec.checkpoint.plan import BookChooser, plan_bytes, plan_tensor

    w = torch.cat([_weights(1 << 17, dtype=torch.bfloat16), _weights(1 << 17, dtype=torch.bfloat16, scale=3.0)])
    src = tmp_path / "w.safetensors"
    save_file({"w": w}, str(src))
    m = FileMap(str(src))
    try:
        (in_file,) = find_tensors(m)[1]
        in_memory = find_tensors(m)[1][0]
        plan_tensor(in_file, m, None, None, BookChooser(CodebookSet.default()))
        data = w.view(torch.int16).numpy().view(np.uint8)
        plan_bytes(in_memory, data, BookChooser(CodebookSet.default()))
        assert (in_memory.chunk_elems, in_memory.books, in_memory.transform) == (
            in_file.chunk_elems,
            in_file.books,
            in_file.transform,
        )
        frame = in_memory.codec.encode_array(data, in_memory.spec, kind="weight")
        assert bytes(frame) == bytes(
            in_file.codec.encode_array(m.u8(in_file.offset, in_file.nbytes), in_file.spec, kind="weight")
        )
        with pytest.raises(ValueError, match="needs the tensor's 524288 bytes"):
            plan_bytes(in_memory, data[:-2], BookChooser(CodebookSet.default()))
    finally:
        m.close()


def test_filemap_keeps_a_read_for_the_next_reader_of_the_same_range(tmp_path, monkeypatch):
    from comm_codec.checkpoint import files

    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 64)
    m = FileMap(str(p))
    try:
        a = m.u8(256, 512, keep=True)
        assert m.u8(256, 512) is a  # handed on, not read again
        assert m.u8(256, 512) is not a and bytes(m.u8(256, 512)) == bytes(a)  # once only
        assert m.u8(0, 512, keep=True) is not m.u8(0, 256)  # another range: read
        monkeypatch.setattr(files, "KEEP_BYTES", 1024)
        first, second = m.u8(0, 1024, keep=True), m.u8(1024, 1024, keep=True)
        assert m.u8(0, 1024) is not first and m.u8(1024, 1024) is second  # the oldest went first
    finally:
        m.close()


def test_a_replaced_output_is_released_after_the_call_and_links_are_left_alone(tmp_path):
    """With threads, the file an output replaces is freed on a thread of its own: the new
    file is in place when the call returns; a replaced file with another name (a hard
    link) or a symlink at dst is never held or followed."""
    from comm_codec.checkpoint.files import atomic_output

    src = tmp_path / "w.safetensors"
    save_file({"w": torch.randn(1 << 16).to(torch.bfloat16)}, src)
    packed, out = tmp_path / "w.cckp", tmp_path / "w.out"
    for _ in range(2):  # the second round replaces both outputs
        ck.compress_file(src, packed, threads=2, force=True)
        ck.decompress_file(packed, out, threads=2, force=True)
        assert out.read_bytes() == src.read_bytes()
    other = tmp_path / "other"
    os.link(out, other)  # the replaced file keeps a name: it is not ours to hold
    with atomic_output(str(out), release_in_background=True) as f:
        f.write(b"new")
        f.commit()
    assert out.read_bytes() == b"new" and other.read_bytes() == src.read_bytes()
    target = tmp_path / "target"
    target.write_bytes(b"kept")
    link = tmp_path / "link"
    os.symlink(target, link)
    with atomic_output(str(link), release_in_background=True) as f:
        f.write(b"x")
        f.commit()
    assert not os.path.islink(link) and link.read_bytes() == b"x" and target.read_bytes() == b"kept"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_a_tensor_with_a_base_is_counted_on_every_element(tmp_path, monkeypatch):
    """A tensor that may be coded as its XOR with the base is planned from every element of its
    sampled chunks (the XOR of two checkpoints is mostly zeros and sparse bits: a sample of
    every 4th element cost delta files 0.04 %); one without a base, every 4th."""
    from comm_codec.checkpoint import plan

    seen = []
    real = plan.BookChooser.counts
    monkeypatch.setattr(
        plan.BookChooser, "counts", lambda self, sample, spec: seen.append(sample.every) or real(self, sample, spec)
    )
    w = _weights(4 << 16, dtype=torch.bfloat16)
    w2 = w.clone()
    w2[::3] = _weights(len(w2[::3]), dtype=torch.bfloat16)
    save_file({"w": w}, tmp_path / "a.safetensors")
    save_file({"w": w2}, tmp_path / "b.safetensors")
    _round_trip(tmp_path / "b.safetensors", tmp_path, name="alone")
    assert seen == [4]
    seen.clear()
    _round_trip(tmp_path / "b.safetensors", tmp_path, base=tmp_path / "a.safetensors", name="delta")
    assert seen and set(seen) == {1}
