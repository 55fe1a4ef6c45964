"""Untrusted input: crafted containers and pickles whose checksums still hold.

Every crafted file goes through the real command line in one subprocess
(``tests/crafted.py``), which records per case: the exit status, stderr, peak RSS (VmHWM,
reset per case) and every path opened outside the case's own paths. Each case must exit
0 or 2 with at most one line on stderr and no traceback, stay under 1 GB of RSS, leave no
file behind and open nothing it was not given. A hang shows as the subprocess's timeout.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import sysconfig
import time
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from comm_codec import checkpoint as ck
from comm_codec.checkpoint import lossy
from comm_codec.checkpoint.files import temp_name

import crafted
from helpers import run_crafted, start_cli

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GEN = torch.Generator().manual_seed(7)
_MB = 1 << 20


def _weights(n, dtype=torch.bfloat16):
    return (torch.randn(n, generator=_GEN) * 0.02).to(dtype)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Real files to start from: an exact and a lossy checkpoint of a small torch file."""
    d = tmp_path_factory.mktemp("corpus")
    w = _weights(40_000, torch.float32)
    sd = {
        "model": {"w": w, "b": _weights(5000, torch.float32)},
        "optimizer": {
            "state": {
                0: {"exp_avg": w * 0.1, "exp_avg_sq": w * w},
                1: {"exp_avg": _weights(5000, torch.float32), "exp_avg_sq": _weights(5000, torch.float32) ** 2},
            },
            "param_groups": [{"params": [0, 1]}],
        },
    }
    torch.save(sd, d / "a.pt")
    save_file({"w": _weights(50_000), "v": _weights(8000, torch.float32)}, d / "m.safetensors")
    ck.compress_file(d / "m.safetensors", d / "m.cckp")
    lossy.compress_file(d / "a.pt", d / "a.ccl")
    sd["model"]["w"] = w + 1e-3
    torch.save(sd, d / "b.pt")
    lossy.compress_file(d / "b.pt", d / "b.ccl", base=d / "a.ccl")
    return d


def _cases(corpus, work):
    """Yield (label, argv, expected exit statuses) for every crafted input."""

    def path(name):
        return str(work / name)

    # -- the pickle scanner: nesting, item counts, entry sizes ---------------------------
    (work / "nested.pt").write_bytes(crafted.torch_zip(crafted.nested_lists_pickle(40_000), compress_pickle=True))
    yield "40000 nested lists", ["compress", path("nested.pt"), path("nested.out")], (0,)
    (work / "ints.pt").write_bytes(crafted.torch_zip(crafted.many_ints_pickle(32_000_000), compress_pickle=True))
    yield "32 M small ints", ["compress", path("ints.pt"), path("ints.out")], (0,)
    zeros = zlib.compressobj(9, zlib.DEFLATED, -15)
    block, parts = bytes(_MB), []
    for _ in range(1536):
        parts.append(zeros.compress(block))
    parts.append(zeros.flush())
    (work / "byteorder.pt").write_bytes(
        _zip_with_raw_deflate(crafted.torch_zip(b"\x80\x02N."), "archive/byteorder", b"".join(parts), 1536 * _MB)
    )
    yield "1.5 GiB byteorder", ["compress", path("byteorder.pt"), path("byteorder.out")], (0,)

    # -- containers whose claimed sizes lie ----------------------------------------------
    exact = crafted.Container.read(corpus / "m.cckp")
    text = json.dumps(exact.index, separators=(",", ":")).encode()
    claimed = crafted.Container.read(corpus / "m.cckp")
    blob = crafted.zstd_with_claimed_size(text, 1 << 40)
    (work / "index_size.cckp").write_bytes(
        bytes(claimed.body)
        + blob
        + crafted.TRAILER.pack(len(claimed.body), len(blob), zlib.crc32(blob), 1, 1, claimed.magic)
    )
    for op in ("verify", "ls"):
        yield f"index claims 1 TiB ({op})", [op, path("index_size.cckp")], (2,)
    yield "index claims 1 TiB (decompress)", ["decompress", path("index_size.cckp"), path("index_size.out")], (2,)

    c = crafted.Container.read(corpus / "m.cckp")
    k = next(i for i, s in enumerate(c.index["segments"]) if s[4] == "zstd")
    seg = c.index["segments"][k]
    payload = bytes(c.body[seg[2] : seg[2] + seg[3]])
    body = crafted.zstd_with_claimed_size(zstd_plain(payload), 1 << 41)
    _replace_segment(c, k, body)
    c.write(work / "seg_size.cckp")
    yield "zstd segment claims 2 TiB", ["decompress", path("seg_size.cckp"), path("seg_size.out")], (2,)

    c = crafted.Container.read(corpus / "m.cckp")
    seg = c.index["segments"][-1]
    seg[1] += 2 << 40
    c.index["source"]["size"] += 2 << 40
    c.write(work / "seg_claim.cckp")
    yield "segment claims 2 TiB of source", ["decompress", path("seg_claim.cckp"), path("seg_claim.out")], (2,)

    # A 4 GiB all-zero tensor in one frame of huge chunks: tiny file, claimed 4 GiB.
    from comm_codec import Codec

    big = Codec(threads=1, chunk_elems=1 << 24).encode(torch.zeros(1 << 24, dtype=torch.bfloat16), kind="weight")
    c = crafted.Container.read(corpus / "m.cckp")
    ti = next(i for i, t in enumerate(c.index["tensors"]) if t["coding"] == "frame")
    _one_frame_tensor(c, ti, big.numpy().tobytes(), (1 << 24) * 2 * 128)
    c.write(work / "zero_frame.cckp")
    yield "frame of 4 GiB of zeros", ["decompress", path("zero_frame.cckp"), path("zero_frame.out")], (0, 2)

    c = crafted.Container.read(corpus / "m.cckp")
    c.index["source"]["size"] = 10 * 10**9
    c.index["segments"][-1][1] += 10 * 10**9 - sum(s[1] for s in c.index["segments"])
    c.write(work / "ten_gb.cckp")
    yield "142 kB claiming 10 GB", ["decompress", path("ten_gb.cckp"), path("ten_gb.out")], (2,)

    # -- structure not validated ----------------------------------------------------------
    c = crafted.Container.read(corpus / "m.cckp")
    c.write(work / "deep.cckp", index_bytes=crafted.deep_json(100_000))
    yield "deeply nested JSON index", ["ls", path("deep.cckp")], (2,)
    for label, edit in (
        ("books origin", lambda ix: [e.pop("origin") for e in ix["books"].values()]),
        ("tensor kind", lambda ix: ix["tensors"][0].update(kind=5)),
        ("tensor shape", lambda ix: ix["tensors"][0].update(shape="x")),
        ("source format", lambda ix: ix["source"].update(format=[1])),
    ):
        c = crafted.Container.read(corpus / "m.cckp")
        edit(c.index)
        name = label.replace(" ", "_") + ".cckp"
        c.write(work / name)
        for op in ("ls", "inspect"):
            yield f"bad {label} ({op})", [op, path(name)], (2,)
    for label, edit in (
        ("stats", lambda ix: ix["tensors"][0].update(stats=5)),
        ("params", lambda ix: ix.update(params=[1])),
        ("errors", lambda ix: ix.update(errors="x")),
    ):
        c = crafted.Container.read(corpus / "a.ccl")
        edit(c.index)
        name = f"lossy_{label}.ccl"
        c.write(work / name)
        yield f"lossy {label} of the wrong type", ["decompress", path(name), path(name + ".out")], (2,)
        yield f"lossy {label} of the wrong type (ls)", ["ls", path(name)], (2,)

    # -- recorded paths: never followed ---------------------------------------------------
    for label, target in (("/dev/zero", "/dev/zero"), ("../etc/passwd", "../../../../../../../../etc/passwd")):
        c = crafted.Container.read(corpus / "b.ccl")
        c.index["base"]["name"] = target
        name = "base_" + label.replace("/", "_").replace(".", "") + ".ccl"
        c.write(work / name)
        yield f"base named {label} (verify)", ["verify", path(name)], (2,)
        yield f"base named {label} (decompress)", ["decompress", path(name), path(name + ".out")], (2,)

    # -- non-regular inputs ---------------------------------------------------------------
    os.mkfifo(work / "fifo")
    for argv in (
        ["compress", path("fifo"), path("fifo.out")],
        ["decompress", path("fifo"), path("fifo.out")],
        ["verify", path("fifo")],
        ["ls", path("fifo")],
        ["inspect", path("fifo")],
    ):
        yield f"FIFO ({argv[0]})", argv, (2,)
    yield "/dev/zero", ["compress", "/dev/zero", path("zero.out")], (2,)
    yield "/proc/self/status", ["compress", "/proc/self/status", path("proc.out")], (2,)

    # -- a shape whose element count wraps int64 ------------------------------------------
    (work / "wrap.safetensors").write_bytes(
        _safetensors_raw(
            {
                "w": ("BF16", [2**62 + 1, 65536], bytes(2 * 65536)),
                "exp_avg/w": ("BF16", [65536], bytes(2 * 65536)),
                "exp_avg_sq/w": ("BF16", [65536], bytes(2 * 65536)),
            }
        )
    )
    yield "shape wraps int64 (exact)", ["compress", path("wrap.safetensors"), path("wrap.out")], (0,)
    yield (
        "shape wraps int64 (excp)",
        ["compress", path("wrap.safetensors"), path("wrap2.out"), "--lossy", "excp"],
        (0, 2),
    )


def zstd_plain(payload: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj().decompress(payload)


def _replace_segment(c, k, payload: bytes) -> None:
    """Replace segment k's coded bytes with payload of any length; later segments move."""
    seg = c.index["segments"][k]
    old_end = seg[2] + seg[3] + (-seg[3] % 8)
    new = payload + bytes(-len(payload) % 8)
    c.body[seg[2] : old_end] = new
    shift = len(new) - (old_end - seg[2])
    seg[3], seg[5] = len(payload), zlib.crc32(payload)
    for s in c.index["segments"][k + 1 :]:
        s[2] += shift


def _one_frame_tensor(c, ti, frame: bytes, nbytes: int) -> None:
    """Make tensor ti one segment holding ``frame`` that claims ``nbytes`` of source."""
    t = c.index["tensors"][ti]
    segs = [s for s in c.index["segments"] if s[6] == ti]
    first = c.index["segments"].index(segs[0])
    grow = nbytes - t["nbytes"]
    for s in segs[1:]:
        c.index["segments"].remove(s)
    seg = c.index["segments"][first]
    seg[1] = nbytes
    t["nbytes"] = nbytes
    t["chunk_elems"] = 1 << 24
    t["shape"] = [nbytes // 2]
    t["dtype"] = "bfloat16"
    _rebuild_body(c, {first: frame})
    for s in c.index["segments"][first + 1 :]:
        s[0] += grow
    for u in c.index["tensors"][ti + 1 :]:
        u["offset"] += grow
    c.index["source"]["size"] += grow


def _rebuild_body(c, replace: dict) -> None:
    """Lay every segment out again from the current body, with some payloads replaced."""
    body = bytearray(c.body[: crafted.HEADER.size])
    for k, s in enumerate(c.index["segments"]):
        payload = replace.get(k, bytes(c.body[s[2] : s[2] + s[3]]))
        s[2], s[3] = len(body), len(payload)
        body += payload + bytes(-len(payload) % 8)
    c.body = body


def _zip_with_raw_deflate(zipped: bytes, name: str, raw_deflate: bytes, size: int) -> bytes:
    """Append an entry whose deflated bytes are given (so a huge entry costs no time to make)."""
    import zipfile

    info = zipfile.ZipInfo(name)
    info.compress_type = zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(__import__("io").BytesIO(zipped)) as zf:
        entries = [(i, zf.read(i)) for i in zf.infolist()]
    out = bytearray()
    central = bytearray()

    def add(fname: bytes, method: int, data: bytes, crc: int, usize: int):
        off = len(out)
        out.extend(struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, method, 0, 0, crc, len(data), usize, len(fname), 0))
        out.extend(fname + data)
        central.extend(
            struct.pack(
                "<IHHHHHHIIIHHHHHII",
                0x02014B50,
                20,
                20,
                0,
                method,
                0,
                0,
                crc,
                len(data),
                usize,
                len(fname),
                0,
                0,
                0,
                0,
                0,
                off,
            )
            + fname
        )

    for i, data in entries:
        add(i.filename.encode(), 0, data, zlib.crc32(data), len(data))
    crc = 0
    block = bytes(_MB)
    for _ in range(size // _MB):
        crc = zlib.crc32(block, crc)
    add(name.encode(), 8, raw_deflate, crc, size)
    n = len(entries) + 1
    return bytes(out + central + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(central), len(out), 0))


def _safetensors_raw(tensors: dict) -> bytes:
    """A safetensors file from (dtype, shape, bytes) entries, shapes written as given."""
    header, body = {}, b""
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(data)]}
        body += data
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


def _allowed_roots(work) -> list:
    roots = {
        str(work),
        REPO,
        sys.prefix,
        sys.base_prefix,
        sysconfig.get_paths()["purelib"],
        "/proc/",
        "/sys/",
        "/dev/null",
        "/dev/urandom",
        "/dev/shm",
        "/etc/localtime",
        "/usr/",
        "/lib",
    }
    return sorted(r for r in roots if r)


@pytest.mark.cli
@pytest.mark.slow
def test_crafted_inputs_exit_cleanly_in_bounded_memory(corpus, tmp_path):
    cases = list(_cases(corpus, tmp_path))
    before = set(os.listdir(tmp_path))
    results = run_crafted([argv for _, argv, _ in cases], tmp_path, _allowed_roots(tmp_path), timeout=400)
    bad = []
    for (label, _argv, statuses), res in zip(cases, results):
        lines = [x for x in res["stderr"].splitlines() if x.strip() and not x.startswith("INFO ")]
        problems = []
        if res["rc"] not in statuses:
            problems.append(f"exit {res['rc']}, expected {statuses}")
        if len(lines) > 1 or "Traceback" in res["stderr"]:
            problems.append(f"stderr {res['stderr'][-600:]!r}")
        if res["rss_mb"] > 1024:
            problems.append(f"peak RSS {res['rss_mb']:.0f} MB")
        if res["foreign"]:
            problems.append(f"opened {res['foreign']}")
        if problems:
            bad.append(f"{label}: {'; '.join(problems)}")
    left = sorted(set(os.listdir(tmp_path)) - before - {"r.json", "cases.json"})
    # Outputs that succeeded are allowed (exit 0); temp files and failed outputs are not.
    ok_outputs = {
        os.path.basename(argv[2])
        for (_, argv, _), res in zip(cases, results)
        if res["rc"] == 0 and argv[0] in ("compress", "decompress")
    }
    stray = [n for n in left if n not in ok_outputs]
    assert not bad and not stray, "\n".join(bad + [f"left behind: {stray}"])


# -- signals and stale temp files --------------------------------------------------------
def _big_source(tmp_path):
    save_file({f"w{i}": _weights(4 << 20) for i in range(12)}, tmp_path / "big.safetensors")  # ~100 MB
    return tmp_path / "big.safetensors"


@pytest.mark.cli
@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGHUP, marks=pytest.mark.slow)])
def test_termination_signals_remove_the_temp_file(tmp_path, sig):
    src = _big_source(tmp_path)
    proc = start_cli("compress", src, tmp_path / "o.cckp", "--threads", "1")
    deadline = time.time() + 120
    while time.time() < deadline and not any(n.endswith(".tmp") for n in os.listdir(tmp_path)):
        time.sleep(0.005)
    # Stopped while it writes, the run cannot finish between this check and the signal (a
    # fixed sleep here let a fast compress commit first and meet the signal at exit).
    proc.send_signal(signal.SIGSTOP)
    assert any(n.endswith(".tmp") for n in os.listdir(tmp_path)), "the run ended before it could be signalled"
    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == ["big.safetensors"]


@pytest.mark.cli
def test_a_later_run_removes_stale_temp_files_of_dead_runs(tmp_path):
    src = tmp_path / "m.safetensors"
    save_file({"w": _weights(10_000)}, src)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale = [temp_name("o.cckp", pid) + "abc123.tmp", temp_name("o.cckp.base", pid) + "xyz_1.tmp"]
    alive = temp_name("o.cckp") + "abc123.tmp"  # this process: still running
    other = f".o.cckp.comm_codec-tmp.otherhost.{pid}.abc123.tmp"  # another machine's: not ours to judge
    for name in stale + [alive, other, ".unrelated.tmp"]:
        (tmp_path / name).write_bytes(b"x")
    ck.compress_file(src, tmp_path / "o.cckp")
    assert sorted(os.listdir(tmp_path)) == sorted([".unrelated.tmp", alive, other, "m.safetensors", "o.cckp"])


# -- hypothesis: edits to a real index, resealed ------------------------------------------
def _mutate(value, draw):
    kind = draw(st.sampled_from(["int", "neg", "huge", "str", "none", "list", "dict", "float", "bool"]))
    return {
        "int": 7,
        "neg": -1,
        "huge": 1 << 70,
        "str": "x",
        "none": None,
        "list": [1, "a"],
        "dict": {"a": 1},
        "float": 1.5,
        "bool": True,
    }[kind]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            yield from _paths(v, prefix + (i,))


@settings(
    max_examples=int(os.environ.get("CC_HYP_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
@pytest.mark.slow
def test_any_resealed_index_edit_is_refused_cleanly_or_restores_exactly(corpus, tmp_path_factory, data):
    work = tmp_path_factory.mktemp("hyp")
    name = data.draw(st.sampled_from(["m.cckp", "a.ccl"]))
    c = crafted.Container.read(corpus / name)
    paths = [p for p in _paths(c.index) if p]
    where = data.draw(st.sampled_from(paths))
    node = c.index
    for key in where[:-1]:
        node = node[key]
    if data.draw(st.booleans()) and isinstance(node, dict):
        node.pop(where[-1])
    else:
        node[where[-1]] = _mutate(node[where[-1]], data.draw)
    c.write(work / name)
    reader = lossy if name.endswith(".ccl") else ck
    for call in (
        lambda: reader.describe(work / name),
        lambda: reader.read_index(work / name),
        lambda: (
            reader.verify_file(work / name) if reader is ck else reader.verify_file(work / name, base=corpus / "a.ccl")
        ),
    ):
        try:
            call()
        except (ck.CheckpointError, OSError):
            pass  # refused: fine; anything else is a bug
    try:
        reader.decompress_file(work / name, work / "out")
    except (ck.CheckpointError, OSError):
        assert not (work / "out").exists()
    assert not [n for n in os.listdir(work) if n.endswith(".tmp")]


def test_describe_of_a_lossy_file_whose_error_stats_are_null(corpus, tmp_path):
    # found by the hypothesis test above: the schema admits null stats (a bound may be
    # none), and describe formatted max_abs_error/rel_rms_error as numbers (TypeError).
    c = crafted.Container.read(corpus / "a.ccl")
    c.index["tensors"][0]["stats"]["max_abs_error"] = None
    c.index["tensors"][0]["stats"]["rel_rms_error"] = None
    c.write(tmp_path / "a.ccl")
    text = lossy.describe(tmp_path / "a.ccl")
    row = [line for line in text.splitlines() if line.startswith(c.index["tensors"][0]["name"] + " ")]
    assert len(row) == 1 and row[0].split()[-3:-1] == ["-", "-"]
