"""Untrusted lossy files: reconstruction streamed in bounded memory, bounds that hold for every value.

A lossy file is decoded tensor by tensor, and a large tensor piece by piece, into the
output (or only into the digest, for ``verify``), so memory does not grow with what a
file declares. Crafted files are built from real lossy files with the project's own
writer code and resealed (``tests/crafted.py``). The precision mode's error bounds are
checked over every subnormal bit pattern of each float dtype, against what ``inspect``
prints.
"""

from __future__ import annotations

import hashlib
import os
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from comm_codec.checkpoint import lossy
from comm_codec.checkpoint.lossy_transforms import MANTISSA, round_mantissa
from comm_codec.core import atomic

import crafted
from helpers import run_cli, run_crafted

pytestmark = pytest.mark.cli

_GEN = torch.Generator().manual_seed(27)
_GIB = 1 << 30


def _zero_frame(numel: int) -> bytes:
    """A float32 frame of ``numel`` zeros in the lossy format's chunks, built without the zeros
    (no chunk checksums: a zero chunk's depends on its number)."""
    from comm_codec.checkpoint.lossy_blobs import CHUNK
    from comm_codec.core import frame as fr
    from comm_codec.core.codec import Codec
    from comm_codec.core.streams import spec_for

    one = Codec(threads=1, chunk_elems=CHUNK).encode(torch.zeros(CHUNK), kind="weight").numpy()
    p = fr.get_frame_parameters(one)
    nchunks = -(-numel // CHUNK)
    buf = np.zeros(fr.header_size(p.spec.nstreams, nchunks), np.uint8)
    fr.write_header(
        buf,
        spec_for(torch.float32),
        numel,
        CHUNK,
        0,
        np.zeros(p.spec.nstreams, np.uint64),
        np.repeat(p.table[:1], nchunks),
    )
    return buf.tobytes()


@pytest.fixture(scope="module")
def precision_file(tmp_path_factory):
    """A real precision file: a small float32 tensor ``w`` and ``pad``, random bytes that keep the
    file large enough for a 1 GiB claim to pass the expansion check."""
    d = tmp_path_factory.mktemp("lossy")
    src = d / "p.safetensors"
    save_file({"w": torch.zeros(4096), "pad": torch.randn(100_000, generator=_GEN)}, src)
    lossy.compress_file(src, d / "p.ccl", method="precision", keep_bits=23)
    save_file({"w": torch.zeros(4096)}, d / "small.safetensors")
    lossy.compress_file(d / "small.safetensors", d / "small.ccl", method="precision", keep_bits=23)
    return src, d / "p.ccl"


def _claim_zeros(src, ccl, dst, numel: int, reseal: bool) -> int:
    """Make ``w`` a frame of ``numel`` zeros, every size after it moved; with ``reseal`` the recorded
    sha256 is the one of what the reader must then produce. Return the reconstruction's size."""
    c = crafted.Container.read(ccl)
    (r,) = [r for r in c.index["tensors"] if r["name"] == "w"]
    frame = _zero_frame(numel)
    at = len(c.body)
    c.body += frame + bytes(-len(frame) % 8)
    r["frame"].update(offset=at, length=len(frame), books=["0" * 16])
    grow = numel * 4 - r["nbytes"]
    for u in c.index["tensors"]:
        if u["offset"] > r["offset"]:
            u["offset"] += grow
    old_off, old_nb = r["offset"], r["nbytes"]
    r["nbytes"], r["shape"] = numel * 4, [numel]
    for key in ("source", "reconstruction"):
        c.index[key]["size"] += grow
    if reseal:
        data = src.read_bytes()
        h = hashlib.sha256(data[:old_off])
        zeros = bytes(16 << 20)
        for k in range(0, numel * 4, len(zeros)):
            h.update(zeros[: min(len(zeros), numel * 4 - k)])
        h.update(data[old_off + old_nb :])
        c.index["reconstruction"]["sha256"] = h.hexdigest()
    c.write(dst)
    return c.index["reconstruction"]["size"]


@pytest.mark.slow
def test_a_gigabyte_claim_is_streamed_in_bounded_memory(precision_file, tmp_path):
    src, ccl = precision_file
    size = _claim_zeros(src, ccl, tmp_path / "g.ccl", _GIB // 4, reseal=True)
    bad = _claim_zeros(src, ccl, tmp_path / "bad.ccl", _GIB // 4, reseal=False)
    assert size == bad > _GIB and 300_000 < os.path.getsize(tmp_path / "g.ccl") < 600_000
    before = sorted(os.listdir(tmp_path))
    cases = [
        ["verify", str(tmp_path / "g.ccl"), "--threads", "8"],
        ["decompress", str(tmp_path / "g.ccl"), str(tmp_path / "g.out"), "--threads", "2"],
        ["decompress", str(tmp_path / "bad.ccl"), str(tmp_path / "bad.out"), "--threads", "8"],
    ]
    results = run_crafted(cases, tmp_path, ["/"])
    for res in results:
        lines = [
            x
            for x in res["stderr"].splitlines()
            if x.strip() and not x.startswith("INFO ") and "cores this process may use" not in x
        ]  # --threads 8 on a smaller machine says so
        assert len(lines) <= 1 and all(len(x) < 1024 for x in lines) and "Traceback" not in res["stderr"], res
        assert res["rss_mb"] < 1024 and res["seconds"] < 30, res
    assert [res["rc"] for res in results] == [0, 0, 2], results
    assert "sha256 does not match" in results[2]["stderr"]
    assert os.path.getsize(tmp_path / "g.out") == size
    with open(tmp_path / "g.out", "rb") as fh:
        data = src.read_bytes()
        r = next(r for r in lossy.read_index(ccl)["tensors"] if r["name"] == "w")
        assert fh.read(r["offset"]) == data[: r["offset"]]
        fh.seek(size - (len(data) - r["offset"] - r["nbytes"]))
        assert fh.read() == data[r["offset"] + r["nbytes"] :]
    os.unlink(tmp_path / "g.out")
    after = sorted(os.listdir(tmp_path))
    assert after == sorted(before + ["cases.json", "r.json"]), after  # no bad.out, no temp file


@pytest.mark.slow
def test_claims_beyond_what_the_file_holds_fail_before_a_byte_is_written(precision_file, tmp_path):
    _, ccl = precision_file
    # 1 GiB in ~100 kB, and 40 GiB in ~4 MB: all-zero chunks, far past the expansion limit.
    small = ccl.parent / "small.ccl"
    for name, numel in (("1g.ccl", _GIB // 4), ("40g.ccl", 40 * _GIB // 4)):
        _claim_zeros(small.with_suffix(".safetensors"), small, tmp_path / name, numel, reseal=False)
    assert os.path.getsize(tmp_path / "1g.ccl") < 120_000 and os.path.getsize(tmp_path / "40g.ccl") < 4_500_000
    for name in ("1g.ccl", "40g.ccl"):
        for args in (
            ("verify", tmp_path / name, "--threads", "8"),
            ("decompress", tmp_path / name, tmp_path / "o.out", "--threads", "2"),
        ):
            # A written output byte would show as "File too large" (RLIMIT_FSIZE).
            r = run_cli(*args, limit_bytes=64 << 10, timeout=60)
            lines = [x for x in r.stderr.splitlines() if x.strip() and "cores this process may use" not in x]
            assert r.returncode == 2 and len(lines) == 1 and len(lines[0]) < 1024, r.stderr[-2000:]
            assert "decompression bomb" in lines[0] and "too large" not in r.stderr
    assert not (tmp_path / "o.out").exists()
    assert not [n for n in os.listdir(tmp_path) if atomic.TEMP_MARK in n]


# -- precision bounds over every subnormal --------------------------------------------------
_INTS = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}
_TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _subnormals(dtype: str) -> np.ndarray:
    """Every subnormal bit pattern of dtype, both signs (zero left out)."""
    mant = MANTISSA[dtype]
    pos = np.arange(1, 1 << mant, dtype=np.uint64)
    sign = np.uint64(1) << np.uint64(8 * np.dtype(_INTS[dtype]).itemsize - 1)
    return np.concatenate([pos, pos | sign]).astype(_INTS[dtype])


def _values(bits: np.ndarray, dtype: str) -> np.ndarray:
    return (
        torch.from_numpy(bits.view(np.int32 if bits.itemsize == 4 else np.int16)).view(_TORCH[dtype]).double().numpy()
    )


@pytest.mark.unit
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_rounding_meets_the_subnormal_bound_for_every_pattern(dtype):
    bits = _subnormals(dtype)
    orig = _values(bits, dtype)
    tiny = float(torch.finfo(_TORCH[dtype]).tiny)
    for keep in range(MANTISSA[dtype] + 1) if dtype != "float32" else (0, 1, 5, 7, 12, 22, 23):
        drop = MANTISSA[dtype] - keep
        err = np.abs(_values(round_mantissa(bits, drop, dtype), dtype) - orig)
        bound = 2.0 ** -(keep + 1) * tiny if drop else 0.0
        assert err.max() <= bound, (dtype, keep, err.max(), bound)
        if drop:  # the bound is tight: some subnormal reaches it
            assert err.max() == bound


def _printed_bounds(text: str) -> dict:
    """name -> (relative bound, absolute bound for subnormals) from ``inspect``'s table."""
    rows = {}
    header = next(line for line in text.splitlines() if line.startswith("tensor"))
    cols = header.split()
    for line in text.splitlines()[text.splitlines().index(header) + 1 :]:
        cells = dict(zip(cols, line.split()))
        rows[cells["tensor"]] = (float(cells["bound"]), float(cells["subn.abs"]))
    return rows


@pytest.mark.parametrize("keep", [2, 9])
@pytest.mark.slow
def test_inspect_prints_bounds_that_hold_for_subnormals(tmp_path, keep):
    # Every fp16 and bf16 subnormal (repeated to the 4 kB a tensor needs to be cut), and every
    # 61st fp32 one with its largest (test_rounding_meets_the_subnormal_bound_for_every_pattern
    # takes all of them through the same rounding).
    tensors = {}
    for dtype in ("float16", "bfloat16", "float32"):
        bits = _subnormals(dtype)
        bits = np.tile(bits, 16) if dtype != "float32" else np.concatenate([bits[::61], bits[-64:]])
        tensors[dtype] = torch.from_numpy(bits.view(np.int32 if bits.itemsize == 4 else np.int16)).view(_TORCH[dtype])
    tensors["normal"] = torch.randn(8192, generator=_GEN).to(torch.float16)
    save_file(tensors, tmp_path / "s.safetensors")
    lossy.compress_file(tmp_path / "s.safetensors", tmp_path / "s.ccl", method="precision", keep_bits=keep)
    lossy.decompress_file(tmp_path / "s.ccl", tmp_path / "s.out")
    out = load_file(tmp_path / "s.out")
    r = run_cli("inspect", tmp_path / "s.ccl")
    assert r.returncode == 0, r.stderr
    printed = _printed_bounds(r.stdout)
    assert re.search(r"subnormal", r.stdout) and "smallest normal" in r.stdout, r.stdout
    for name, t in tensors.items():
        rel_bound, abs_bound = printed[name]
        a, b = t.double(), out[name].double()
        tiny = torch.finfo(t.dtype).tiny
        sub = (a.abs() < tiny) & (a != 0)
        normal = a.abs() >= tiny
        if sub.any():
            assert (b - a).abs()[sub].max().item() <= abs_bound, name
        if normal.any():
            assert ((b - a).abs() / a.abs())[normal].max().item() <= rel_bound, name
        keep_eff = min(keep, MANTISSA[str(t.dtype).replace("torch.", "")])
        assert rel_bound == pytest.approx(2.0 ** -(keep_eff + 1), rel=1e-2)
        assert abs_bound == pytest.approx(2.0 ** -(keep_eff + 1) * tiny, rel=1e-2)
