"""Untrusted input and hostile environments: memory, disk and time bounded by what a file holds.

Crafted files are built with the project's own writer code and resealed (``tests/crafted.py``),
so every checksum holds and the readers are reached. Each test measures what a bound is
about (peak RSS of a child process, bytes written, files left) on a claim small enough to
stay cheap, and checks that a larger claim is refused before anything is written.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from comm_codec import checkpoint as ck
from comm_codec.core import atomic

import crafted
from helpers import REPO, run_cli, run_crafted

pytestmark = pytest.mark.unit

_MB = 1 << 20
_GEN = torch.Generator().manual_seed(11)


def _weights(n, dtype=torch.bfloat16):
    return (torch.randn(n, generator=_GEN) * 0.02).to(dtype)


def _one_line_error(r) -> str:
    """Assert a CLI run failed with status 2 and one short line; return the line."""
    lines = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith("INFO ")]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr and len(lines[0]) < 1024, r.stderr[-2000:]
    return lines[0]


# -- temp files: exclusive, never through a symlink, names that fit -------------------------
def test_temp_names_fit_any_valid_output_name(tmp_path):
    src = tmp_path / "a.bin"
    src.write_bytes(os.urandom(5000))
    for name in ("x" * 220, "y" * 255, "é" * 127 + "z"):  # 255 bytes: the longest valid name
        assert len(os.fsencode(name)) <= 255
        ck.compress_file(src, tmp_path / name)
        ck.decompress_file(tmp_path / name, tmp_path / (name[:-1] + "r"))
        assert (tmp_path / (name[:-1] + "r")).read_bytes() == src.read_bytes()
        assert len(os.fsencode(atomic.temp_prefix(name))) + 12 <= atomic.NAME_MAX
    assert not [n for n in os.listdir(tmp_path) if atomic.TEMP_MARK in n]


def test_temp_file_is_never_written_through_a_planted_symlink(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    out = tmp_path / "books.json"
    names = iter(["0badf00d", "c0ffee00", "0badf00d", "c0ffee01"])
    monkeypatch.setattr(atomic, "_random_chars", lambda: next(names))  # the temp names' random part
    planted = tmp_path / f"{atomic.temp_prefix(out.name)}0badf00d.tmp"
    planted.symlink_to(victim)
    atomic.atomic_write(out, b"{}")
    assert victim.read_bytes() == b"keep me"
    assert not out.is_symlink() and out.read_bytes() == b"{}"
    # The checkpoint writer's temp files are made the same way.
    src = tmp_path / "a.bin"
    src.write_bytes(os.urandom(3000))
    dst = tmp_path / "a.cckp"
    planted = tmp_path / f"{atomic.temp_prefix(dst.name)}0badf00d.tmp"
    planted.symlink_to(victim)
    ck.compress_file(src, dst)
    assert victim.read_bytes() == b"keep me" and not dst.is_symlink()
    assert next(names, None) is None, "every planted name was tried, and another one after it"


def test_atomic_write_leaves_nothing_on_error(tmp_path):
    with pytest.raises(OSError):
        atomic.atomic_write(tmp_path / "missing-dir" / "x", b"data")
    (tmp_path / "ro").mkdir()
    with pytest.raises(TypeError):
        atomic.atomic_write(tmp_path / "ro" / "x", 5)
    assert os.listdir(tmp_path / "ro") == []


# -- numba without a writable cache ----------------------------------------------------------
@pytest.mark.cli
@pytest.mark.slow
def test_every_command_works_without_a_writable_numba_cache(tmp_path):
    """A copy of the package where no cache can be written, even by root: ``__pycache__`` is a
    file beside every module, HOME and NUMBA_CACHE_DIR lie under /dev/null."""
    copy = tmp_path / "ro"
    shutil.copytree(os.path.join(REPO, "comm_codec"), copy / "comm_codec", ignore=shutil.ignore_patterns("__pycache__"))
    for folder, _, _ in os.walk(copy / "comm_codec"):
        open(os.path.join(folder, "__pycache__"), "w").close()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(
        HOME="/dev/null",
        NUMBA_CACHE_DIR="/dev/null/numba",
        PYTHONPATH=f"{copy}{os.pathsep}{REPO}/tests",
        PYTHONDONTWRITEBYTECODE="1",
    )
    src = tmp_path / "w.bin"  # opaque bytes: no kernel to compile (that takes minutes in memory)
    src.write_bytes(os.urandom(50_000))

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "comm_codec", *map(str, args)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )

    r = cli("--version")
    assert r.returncode == 0 and "comm_codec" in r.stdout, r.stderr[-2000:]
    r = cli("compress", src, tmp_path / "w.cckp", "--threads", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("numba has no writable cache directory") == 1 and "Traceback" not in r.stderr
    for args in (
        ("ls", tmp_path / "w.cckp"),
        ("verify", tmp_path / "w.cckp"),
        ("decompress", tmp_path / "w.cckp", tmp_path / "w.out"),
    ):
        r = cli(*args)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
    assert (tmp_path / "w.out").read_bytes() == src.read_bytes()
    # Every kernel module imports (each decorates its kernels), caching off.
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "import comm_codec.core.codec, comm_codec.kernels.plan, "
            "comm_codec.kernels.histogram; from comm_codec.kernels import jit; assert not jit.CACHING; "
            "print(jit.cache_location())",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0 and "NUMBA_CACHE_DIR" in r.stdout, r.stderr[-2000:]
    assert not any(os.path.isdir(os.path.join(f, "__pycache__")) for f, _, _ in os.walk(copy))


@pytest.mark.cli
def test_a_bad_numba_thread_setting_is_one_line():
    r = run_cli("precompile", env={"NUMBA_NUM_THREADS": "0"}, timeout=120)
    assert "NUMBA_NUM_THREADS" in _one_line_error(r)


# -- exact containers that claim far more than they hold --------------------------------------
def _coded_tensor_file(tmp_path):
    """A real exact checkpoint of one bf16 tensor coded as frames; return (path, chunk_elems)."""
    src = tmp_path / "m.safetensors"
    save_file({"w": _weights(1 << 20)}, src)
    ck.compress_file(src, tmp_path / "m.cckp", threads=1, force=True)
    c = crafted.Container.read(tmp_path / "m.cckp")
    (t,) = [t for t in c.index["tensors"] if t["coding"] == "frame"]
    return tmp_path / "m.cckp", t["chunk_elems"]


def _zero_segments_file(base, out, count: int, chunk_elems: int, seg_bytes: int = 64 * _MB):
    """Make the coded tensor ``count`` segments of ``seg_bytes`` each, every one a frame of
    all-zero chunks of ``chunk_elems`` elements (a few hundred bytes claiming 64 MiB). The
    source digest is left as it was, so a full restore fails at its end."""
    from comm_codec.checkpoint.plan import make_codec
    from comm_codec.core.huffman import Codebook
    from comm_codec.core.streams import spec_for

    c = crafted.Container.read(base)
    ti = next(i for i, t in enumerate(c.index["tensors"]) if t["coding"] == "frame")
    t = c.index["tensors"][ti]
    books = [
        Codebook.raw_book() if b == "0" * 16 else Codebook.from_dict(c.index["books"][b]["book"]) for b in t["books"]
    ]
    codec = make_codec(books, spec_for(torch.bfloat16), chunk_elems)
    frame = codec.encode(torch.zeros(seg_bytes // 2, dtype=torch.bfloat16), kind="weight").numpy().tobytes()
    segs = c.index["segments"]
    first = next(k for k, s in enumerate(segs) if s[6] == ti)
    kept_before = segs[:first]
    after = [s for s in segs[first:] if s[6] != ti]
    grow = count * seg_bytes - t["nbytes"]
    new = [[t["offset"] + k * seg_bytes, seg_bytes, 0, 0, "frame", None, ti] for k in range(count)]
    for s in after:
        s[0] += grow
    body = bytearray(c.body[: crafted.HEADER.size])
    old_body = bytes(c.body)
    for s in kept_before + new + after:
        payload = frame if s in new else old_body[s[2] : s[2] + s[3]]
        s[2], s[3] = len(body), len(payload)
        body += payload + bytes(-len(payload) % 8)
    c.body = body
    c.index["segments"] = kept_before + new + after
    t["nbytes"], t["shape"] = count * seg_bytes, [count * seg_bytes // 2]
    c.index["source"]["size"] += grow
    c.write(out)
    return len(frame)


_PEAK = """
import sys
from comm_codec import checkpoint as ck
from comm_codec.core.errors import CheckpointError

def hwm():
    with open("/proc/self/status") as fh:
        return next(int(x.split()[1]) for x in fh if x.startswith("VmHWM:")) / 1024

op, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
try:  # the first call loads the kernels (not what is measured)
    ck.verify_file(path, threads=1)
except CheckpointError:
    pass
for threads in map(int, sys.argv[4:]):
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    before = hwm()
    try:
        if op == "verify":
            ck.verify_file(path, threads=threads)
        else:
            ck.decompress_file(path, out, threads=threads)
        print("ok", threads, hwm() - before)
    except CheckpointError as exc:
        print("error", threads, hwm() - before, str(exc).replace(chr(10), " "))
"""


def _peak_mb(op, path, out, threads):
    """Peak RSS (MB) that each call of ``op`` adds, in a child that has loaded the kernels."""
    r = subprocess.run(
        [sys.executable, "-c", _PEAK, op, str(path), str(out), *map(str, threads)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line.split(" ", 3) for line in r.stdout.splitlines()]
    return {int(row[1]): (row[0], float(row[2]), row[3] if len(row) > 3 else "") for row in rows}


@pytest.mark.slow
def test_memory_in_flight_is_bounded_whatever_the_threads(tmp_path):
    base, chunk = _coded_tensor_file(tmp_path)
    _zero_segments_file(base, tmp_path / "z.cckp", 12, chunk)  # 768 MiB claimed in ~30 kB
    assert os.path.getsize(tmp_path / "z.cckp") < 64_000
    for op in ("verify", "decompress"):
        peaks = _peak_mb(op, tmp_path / "z.cckp", tmp_path / "z.out", (2, 8))
        for threads, (status, mb, message) in peaks.items():
            assert status == "error" and "corrupted" in message, (op, threads, message)
            # The decoded segments in flight stay within one budget, not segments x threads.
            assert mb < 400, (op, threads, mb)
    assert not os.path.exists(tmp_path / "z.out")
    assert not [n for n in os.listdir(tmp_path) if atomic.TEMP_MARK in n]


@pytest.mark.slow
def test_a_bomb_fails_before_a_byte_is_written(tmp_path):
    base, chunk = _coded_tensor_file(tmp_path)
    _zero_segments_file(base, tmp_path / "z.cckp", 6, chunk)  # 384 MiB, digest wrong
    # An output segment written shows as "File too large" (RLIMIT_FSIZE: numba needs a few bytes in /dev/shm).
    r = run_cli("decompress", tmp_path / "z.cckp", tmp_path / "z.out", limit_bytes=64 << 10, timeout=120)
    assert "corrupted" in _one_line_error(r) and "too large" not in r.stderr
    assert not os.path.exists(tmp_path / "z.out")
    # Frames whose chunks are larger than the tensor's recorded chunk size (one chunk of
    # 32 Mi zeros: an 80-byte frame per 64 MiB): refused before any decoding, at once.
    _zero_segments_file(base, tmp_path / "big.cckp", 1024, 1 << 25)
    assert os.path.getsize(tmp_path / "big.cckp") < 200_000
    for args in (
        ("verify", tmp_path / "big.cckp", "--threads", "2"),
        ("decompress", tmp_path / "big.cckp", tmp_path / "big.out"),
    ):
        r = run_cli(*args, limit_bytes=64 << 10, timeout=60)
        assert "chunk" in _one_line_error(r)
    assert not os.path.exists(tmp_path / "big.out")


_WRITES = """
import os, sys
written = []

def hook(event, args):
    if event == "open" and args and isinstance(args[0], (str, bytes)):
        mode, flags = args[1], args[2]
        if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & (os.O_WRONLY | os.O_RDWR):
            written.append(os.fsdecode(args[0]))

sys.addaudithook(hook)
from comm_codec import checkpoint as ck
s = ck.verify_file(sys.argv[1], base=sys.argv[2], threads=int(sys.argv[3]))
print(s.digest)
print([p for p in written if not p.startswith(("/dev/", "/proc/")) and "__pycache__" not in p])  # numba's own cache
"""


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.slow
def test_verify_with_a_compressed_base_writes_nothing(tmp_path, threads):
    w = _weights(300_000)
    save_file({"w": w, "v": _weights(7000, torch.float32)}, tmp_path / "a.safetensors")
    w2 = w.clone()
    w2[::97] = 0
    save_file({"w": w2, "v": _weights(7000, torch.float32)}, tmp_path / "b.safetensors")
    ck.compress_file(tmp_path / "a.safetensors", tmp_path / "a.cckp")
    s = ck.compress_file(tmp_path / "b.safetensors", tmp_path / "b.cckp", base=tmp_path / "a.cckp")
    assert s.delta
    before = sorted(os.listdir(tmp_path))
    r = subprocess.run(
        [sys.executable, "-c", _WRITES, str(tmp_path / "b.cckp"), str(tmp_path / "a.cckp"), str(threads)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    digest, written = r.stdout.splitlines()[-2:]
    assert digest == s.digest and written == "[]", r.stdout
    assert sorted(os.listdir(tmp_path)) == before
    # A base that is not the one recorded is refused, still writing nothing.
    c = crafted.Container.read(tmp_path / "a.cckp")
    c.index["source"]["blake3"] = "0" * 64
    c.write(tmp_path / "wrong.cckp")
    with pytest.raises(ck.CheckpointError):
        ck.verify_file(tmp_path / "b.cckp", base=tmp_path / "wrong.cckp", threads=threads)
    assert sorted(os.listdir(tmp_path)) == sorted(before + ["wrong.cckp"])


# -- zip members, safetensors headers and frame files that claim more than they are ------------
def _bzip2_member_zip(name: str, inflated: bytes, claimed: int) -> bytes:
    """A torch-like zip whose member ``name`` is bzip2-coded (method 12), its size given as ``claimed``."""
    import struct
    import zipfile

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for member, data in (
            ("archive/data.pkl", b"\x80\x02N."),
            ("archive/byteorder", b"little"),
            ("archive/data/0", bytes(8192)),
        ):
            if member == name:
                zf.writestr(zipfile.ZipInfo(member), inflated, compress_type=zipfile.ZIP_BZIP2)
            else:
                zf.writestr(zipfile.ZipInfo(member), data)
    raw = bytearray(buf.getvalue())
    pos = raw.index(b"PK\x01\x02")
    while raw[pos : pos + 4] == b"PK\x01\x02":
        nlen, xlen, clen = struct.unpack_from("<HHH", raw, pos + 28)
        if raw[pos + 46 : pos + 46 + nlen].decode() == name:
            struct.pack_into("<I", raw, pos + 24, claimed)
        pos += 46 + nlen + xlen + clen
    return bytes(raw)


@pytest.mark.slow
def test_members_and_headers_that_inflate_are_not_inflated(tmp_path):
    import bz2

    zeros = bz2.compress(bytes(512 * _MB), 1)
    assert len(zeros) < 100_000
    (tmp_path / "pkl.pt").write_bytes(_bzip2_member_zip("archive/data.pkl", b"\x80\x02N." + bytes(512 * _MB), 1000))
    (tmp_path / "order.pt").write_bytes(_bzip2_member_zip("archive/byteorder", bytes(512 * _MB), 6))
    # A safetensors header of 12 M empty lists: json.loads would build GBs of lists.
    text = b'{"a":[' + b"[]," * 12_000_000 + b"[]]}"
    (tmp_path / "lists.safetensors").write_bytes(len(text).to_bytes(8, "little") + text)
    # A sparse 3 GiB file that starts with a valid frame.
    from comm_codec import Codec

    with open(tmp_path / "sparse.frame", "wb") as fh:
        fh.write(Codec(threads=1).encode(_weights(5000), kind="weight").numpy().tobytes())
        fh.truncate(3 << 30)
    cases = [
        ["compress", str(tmp_path / n), str(tmp_path / (n + ".cckp"))]
        for n in ("pkl.pt", "order.pt", "lists.safetensors")
    ] + [["inspect", str(tmp_path / "sparse.frame")]]
    results = run_crafted(cases, tmp_path, ["/"])
    for res in results:
        lines = [x for x in res["stderr"].splitlines() if x.strip() and not x.startswith("INFO ")]
        assert res["rss_mb"] < 700 and res["seconds"] < 30, res
        assert len(lines) <= 1 and "Traceback" not in res["stderr"], res
    assert [res["rc"] for res in results] == [0, 0, 0, 2]
    assert "longer than its chunk table says" in results[3]["stderr"], results[3]
    for n in ("pkl.pt", "order.pt", "lists.safetensors"):
        ck.decompress_file(tmp_path / (n + ".cckp"), tmp_path / (n + ".out"))
        assert (tmp_path / (n + ".out")).read_bytes() == (tmp_path / n).read_bytes()


def test_codebook_save_never_writes_through_a_planted_symlink(tmp_path):
    """CodebookSet.save (and so `comm-codec profile --out`) writes a temp file of its own, never
    through a symlink at the name it once used, and replaces a symlink at the output itself."""
    import comm_codec as cc

    victim = tmp_path / "victim"
    victim.write_text("keep")
    out = tmp_path / "books.json"
    os.symlink(victim, f"{out}.tmp{os.getpid()}")
    os.symlink(victim, out)
    books = cc.CodebookSet.default()
    books.save(out)
    assert victim.read_text() == "keep"
    assert not out.is_symlink() and cc.CodebookSet.load(out).digest == books.digest
