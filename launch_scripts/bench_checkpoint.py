"""Checkpoint benchmark: comm_codec.checkpoint beside zstd -3, bz2 -9, lzma, zipnn and OpenZL.

One run prints (and with ``--json PATH`` writes) four tables:

1. **Files**: for each real checkpoint made by ``launch_scripts/make_checkpoints.py``
   (fp32 weights, bf16 weights, Adam state, the full torch ``.pt`` with model and
   optimizer, and deltas between successive checkpoints): ratio, compress and decompress
   GB/s at 1 and 2 threads, and whether the round trip was exact (sha256 / bytes).
2. **Delta per tensor kind**: ratio of weights, exp_avg, exp_avg_sq and other bytes,
   standalone vs against the previous checkpoint, from the compressed files' indexes.
3. **Peak memory**: peak RSS (VmHWM) of a subprocess compressing and decompressing a
   multi-GB checkpoint on disk, beside the file size and its RSS after the imports.
4. **Targets**: PASS/MISS per target (ratio and speed against zipnn, memory), from the numbers above.

How things are measured (also printed):

* GB/s is 1e9 bytes/s of the *uncompressed* checkpoint, best of ``--repeat`` timed calls.
* Every row says what its time includes (the notes column):

  - ``comm_codec``: file to file (``compress_file``/``decompress_file``: pread, BLAKE3 of
    the whole file, CRCs, temp file, fsync, rename) on tmpfs (``/dev/shm``), so disk
    speed does not count. The targets are judged on this row against ``zipnn f2f``; the
    two are timed alternately (ours 1T, ours 2T, zipnn 1T, zipnn 2T, then again), so a
    load change on a shared machine hits both alike; best of ``--repeat`` calls, or of
    as many as make a second per configuration (up to 60: a small file's call takes
    tens of ms, and a best of 5 then says more about which call met a quiet moment of a
    shared machine than about the codecs). The notes say how many.
  - the comparators (zstd, bz2, lzma, zipnn) run in memory on the file's bytes (their
    best case);
  - ``zipnn f2f``: zipnn under the same file I/O as comm_codec's file row: read the file,
    compress, write a temp file, fsync, rename (and the same back); no hash.
* zipnn (``input_format="byte"``, dtype of the file's tensors) gets a fresh copy of its
  input for every call because its ``compress`` rewrites its input buffer; exactness is
  checked against the pristine bytes.
* bz2 and lzma run once per file; on the first 4 MiB only in ``--quick`` mode and for
  files over 64 MB.
* Files: TinyLM checkpoints (make_checkpoints.py) and, when made with ``--pretrained``,
  the pretrained all-MiniLM-L6-v2 in fp32, bf16, fp16 and its Adam state.
* The big file (``--big-gb``) runs in fresh processes at 1 and 2 threads alternately,
  each loading the kernels on a small file first (not timed): peak RSS (against the RSS
  after the imports, and after the kernels loaded), and 2T vs 1T speed with the cores
  each run really got. ``--big-only`` runs just that. Beside it, what the machine gives
  two threads then: a pure compute loop's 2T / 1T (and the steal the kernel reports), and
  4 MiB pwrites into one file by 1 and 2 threads and into two files (a restore's workers
  write one file: where writers of one file take turns, that part cannot scale).
* "codec frames" is :class:`comm_codec.Codec` alone on the same bytes in memory (shipped
  books, one tensor): the kernels' speed, without the container's planning, sha256, CRCs
  and I/O.
* The machine may be shared: timings are noisy, ratios are not.

Usage::

    python launch_scripts/bench_checkpoint.py              # full (makes data if missing)
    python launch_scripts/bench_checkpoint.py --quick      # < 60 s, no multi-GB file
    python launch_scripts/bench_checkpoint.py --big-only --big-gb 2   # the multi-GB file alone
"""

from __future__ import annotations

import argparse
import bz2
import collections
import hashlib
import importlib.metadata
import json
import logging
import lzma
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import zstandard

try:
    from comm_codec import checkpoint as ck
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from comm_codec import checkpoint as ck

log = logging.getLogger("bench_checkpoint")

_HERE = Path(__file__).resolve().parent
_SAMPLE = 4 << 20


# -- comparators --------------------------------------------------------------------------
class _Zstd:
    name = "zstd-3"

    def encode(self, data, threads):
        return zstandard.ZstdCompressor(level=3, threads=0 if threads == 1 else threads).compress(data)

    def decode(self, blob, threads):
        return zstandard.ZstdDecompressor().decompress(blob)

    dec_threads = (1,)
    enc_threads = (1, 2)


class _Bz2:
    name = "bz2-9"
    enc_threads = dec_threads = (1,)

    def encode(self, data, threads):
        return bz2.compress(data, 9)

    def decode(self, blob, threads):
        return bz2.decompress(blob)


class _Lzma:
    name = "lzma-6"
    enc_threads = dec_threads = (1,)

    def encode(self, data, threads):
        return lzma.compress(data, preset=6)

    def decode(self, blob, threads):
        return lzma.decompress(blob)


class _ZipNN:
    name = "zipnn"
    enc_threads = dec_threads = (1, 2)

    def __init__(self, dtype):
        import zipnn

        self.zipnn, self.dtype = zipnn, dtype
        self.name = f"zipnn-{importlib.metadata.version('zipnn')}"
        self.mutated = False

    def prepare(self, data):
        return bytearray(data)

    def encode(self, data, threads):
        z = self.zipnn.ZipNN(input_format="byte", bytearray_dtype=self.dtype, threads=threads)
        return bytes(z.compress(data))

    def decode(self, blob, threads):
        z = self.zipnn.ZipNN(input_format="byte", bytearray_dtype=self.dtype, threads=threads)
        return bytes(z.decompress(blob))


class _OpenZL:
    """OpenZL's float graph for the file's dtype (comm_codec.tools.openzl_graph), in memory, 1 thread."""

    enc_threads = dec_threads = (1,)

    def __init__(self, dtype):
        from comm_codec.tools.openzl_graph import OpenZL

        self.graph = OpenZL({"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype))
        self.name = f"openzl-{self.graph.version}"

    def encode(self, data, threads):
        return self.graph.compress(data)

    def decode(self, blob, threads):
        return self.graph.decompress(blob)


def _atomic_write(path: Path, data) -> None:
    """Write data as comm_codec writes its outputs: temp file, fsync, rename, fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _best(fn, repeat, cpu=None):
    """Best wall time of fn over repeat calls, its result, and (into cpu) that call's CPU time."""
    best, out = float("inf"), None
    for _ in range(max(1, repeat)):
        c0, start = _cpu(), time.perf_counter()
        out = fn()
        wall = time.perf_counter() - start
        if wall < best:
            best = wall
            if cpu is not None:
                cpu[0] = _cpu() - c0
    return best, out


def _run_comparator(comp, data: bytes, repeat: int, note: str) -> dict:
    row = {
        "codec": comp.name,
        "ratio": None,
        "enc": {},
        "dec": {},
        "exact": None,
        "notes": [note] if note else [],
        "cpu": {},
    }
    blob = None
    for th in comp.enc_threads:
        prepared = [getattr(comp, "prepare", lambda d: d)(data) for _ in range(max(1, repeat))]
        holder = iter(prepared)
        cpu = [0.0]
        seconds, blob = _best(lambda: comp.encode(next(holder), th), repeat, cpu)
        row["enc"][th] = len(data) / seconds / 1e9
        row["cpu"][("enc", th)] = (len(data) / max(cpu[0], 1e-9) / 1e9, cpu[0] / seconds)
        if isinstance(prepared[0], bytearray) and bytes(prepared[0]) != data:
            if "rewrites its input" not in row["notes"]:
                row["notes"].append("rewrites its input")
        del prepared
    row["ratio"] = len(data) / len(blob)
    exact = True
    for th in comp.dec_threads:
        cpu = [0.0]
        seconds, out = _best(lambda: comp.decode(blob, th), repeat, cpu)
        row["dec"][th] = len(data) / seconds / 1e9
        row["cpu"][("dec", th)] = (len(data) / max(cpu[0], 1e-9) / 1e9, cpu[0] / seconds)
        exact = exact and bytes(out) == data
    row["exact"] = exact
    if isinstance(comp, _ZipNN):  # the same call with immutable bytes in
        blob = comp.encode(data, 1)
        if comp.decode(blob, 1) != data:
            row["notes"].append("NOT exact when given bytes instead of a bytearray")
    return row


def _sha(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _alternate(fns: dict, repeat: int) -> dict:
    """Time each fn ``repeat`` times, round robin (A, B, A, B ...), so load drifts hit all alike.

    Returns {key: (best seconds, median seconds, CPU seconds of the best call)}.
    """
    times = {k: [] for k in fns}
    for _ in range(max(1, repeat)):
        for key, fn in fns.items():
            c0, start = _cpu(), time.perf_counter()
            fn()
            times[key].append((time.perf_counter() - start, _cpu() - c0))
    out = {}
    for key, runs in times.items():
        walls = sorted(w for w, _ in runs)
        best = min(runs)
        out[key] = (best[0], walls[len(walls) // 2], best[1])
    return out


# Small files take tens of ms a call, and this machine's speed wanders over seconds (a
# neighbour's load): a best of 3 or 5 then says more about which call hit a quiet moment
# than about the codecs. Each configuration gets at least this many seconds of calls.
_F2F_SECONDS = 1.0
_F2F_MAX_REPEAT = 60


def _enough(repeat: int, fn) -> int:
    """Timed calls per configuration: ``repeat``, or more, so that they add up to _F2F_SECONDS."""
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    return max(repeat, min(_F2F_MAX_REPEAT, math.ceil(_F2F_SECONDS / max(once, 1e-3))))


def _run_file_to_file(src: Path, base: Path | None, work: Path, dtype: str, repeat: int) -> list:
    """comm_codec and zipnn file to file, timed alternately at 1 and 2 threads: two rows."""
    packed, restored = work / "packed.cckp", work / "restored"
    zpacked, zrestored = work / "zipnn.packed", work / "zipnn.restored"
    ck.compress_file(src, packed, base=base, threads=1, force=True)  # warm the kernels and page cache
    ck.decompress_file(packed, restored, base=base, threads=1, force=True)
    repeat = _enough(repeat, lambda: ck.compress_file(src, packed, base=base, threads=1, progress=False, force=True))
    fns = {}
    for th in (1, 2):
        fns[("cc", "enc", th)] = lambda th=th: ck.compress_file(
            src, packed, base=base, threads=th, progress=False, force=True
        )
    try:
        zn = _ZipNN(dtype)
    except ImportError:
        zn = None
    if zn is not None:
        for th in zn.enc_threads:
            fns[("zn", "enc", th)] = lambda th=th: _atomic_write(zpacked, zn.encode(bytearray(src.read_bytes()), th))
    enc = _alternate(fns, repeat)
    fns = {}
    for th in (1, 2):
        fns[("cc", "dec", th)] = lambda th=th: ck.decompress_file(
            packed, restored, base=base, threads=th, progress=False, force=True
        )
    if zn is not None:
        for th in zn.dec_threads:
            fns[("zn", "dec", th)] = lambda th=th: _atomic_write(zrestored, zn.decode(zpacked.read_bytes(), th))
    dec = _alternate(fns, repeat)
    size = src.stat().st_size
    cc = {
        "codec": "comm_codec",
        "ratio": size / packed.stat().st_size,
        "enc": {},
        "dec": {},
        "cpu": {},
        "median": {},
        "exact": _sha(restored) == _sha(src),
        "index": ck.read_index(packed),
        "notes": [f"file to file: pread, BLAKE3, CRCs, temp file+fsync+rename (tmpfs); best of {repeat}"]
        + ([f"delta against {base.name}"] if base is not None else []),
    }
    rows = [cc]
    if zn is not None:
        rows.append(
            {
                "codec": f"{zn.name} f2f",
                "ratio": size / zpacked.stat().st_size,
                "enc": {},
                "dec": {},
                "cpu": {},
                "median": {},
                "exact": _sha(zrestored) == _sha(src),
                "notes": ["file to file: read, compress, temp file+fsync+rename (tmpfs); no hash"]
                + (["no delta mode: standalone"] if base is not None else []),
            }
        )
    for timing in (enc, dec):
        for (who, key, th), (best, median, cpu) in timing.items():
            row = rows[0] if who == "cc" else rows[1]
            row[key][th] = size / best / 1e9
            row["median"][(key, th)] = size / median / 1e9
            row["cpu"][(key, th)] = (size / max(cpu, 1e-9) / 1e9, cpu / best)
    for p in (packed, restored, zpacked, zrestored):
        p.unlink(missing_ok=True)
    return rows


def _run_comm_codec(src: Path, base: Path | None, work: Path, repeat: int) -> dict:
    """comm_codec alone (one compress call): its ratio and index."""
    packed = work / "packed.cckp"
    summary = ck.compress_file(src, packed, base=base, threads=1, progress=False, force=True)
    row = {"codec": "comm_codec", "ratio": summary.ratio, "index": ck.read_index(packed)}
    packed.unlink()
    return row


def _run_frames(data: bytes, dtype: str, repeat: int) -> dict:
    """The Codec alone, in memory: the file's tensor bytes as one tensor, shipped books."""
    import numpy as np
    import torch

    from comm_codec import Codec

    (hlen,) = np.frombuffer(data[:8], "<u8")
    body = np.frombuffer(data, np.uint8)[8 + int(hlen) :]
    width = {"bfloat16": 2, "float32": 4}[dtype]
    body = body[: body.size - body.size % width].copy()
    t = torch.from_numpy(body.view({2: np.int16, 4: np.int32}[width])).view(getattr(torch, dtype))
    row = {
        "codec": "codec frames",
        "ratio": None,
        "enc": {},
        "dec": {},
        "exact": True,
        "cpu": {},
        "notes": ["Codec(threads=N).encode/decode in memory, shipped books, no container/sha256/IO"],
    }
    for th in (1, 2):
        codec = Codec(threads=th)
        codec.decode(codec.encode(t, kind="weight"))
        for key, fn in (("enc", lambda: codec.encode(t, kind="weight")), ("dec", lambda: codec.decode(frame))):
            cpu = [0.0]
            seconds, result = _best(fn, repeat, cpu)
            row[key][th] = body.size / seconds / 1e9
            row["cpu"][(key, th)] = (body.size / max(cpu[0], 1e-9) / 1e9, cpu[0] / seconds)
            if key == "enc":
                frame = result
            else:
                out = result
        row["ratio"] = body.size / frame.numel()
        row["exact"] = row["exact"] and torch.equal(out.view(torch.uint8), t.view(torch.uint8))
    return row


def _xor_zstd(src: Path, base: Path, repeat: int) -> dict | None:
    a, b = src.read_bytes(), base.read_bytes()
    if len(a) != len(b):
        return None
    import numpy as np

    def enc():
        x = np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))
        return zstandard.ZstdCompressor(level=3).compress(x.tobytes())

    seconds, blob = _best(enc, repeat)

    def dec():
        x = np.frombuffer(zstandard.ZstdDecompressor().decompress(blob), np.uint8)
        return np.bitwise_xor(x, np.frombuffer(b, np.uint8)).tobytes()

    dseconds, out = _best(dec, repeat)
    return {
        "codec": "xor+zstd-3",
        "ratio": len(a) / len(blob),
        "enc": {1: len(a) / seconds / 1e9},
        "dec": {1: len(a) / dseconds / 1e9},
        "exact": out == a,
        "notes": ["whole-file XOR with the base"],
    }


# -- datasets -----------------------------------------------------------------------------
def _datasets(data_dir: Path, meta: dict) -> list:
    tags = meta["checkpoints"]
    last, prev = tags[-1], tags[-2]
    rows = [
        ("fp32 weights", f"weights_fp32_{last}.safetensors", None, "float32"),
        ("bf16 weights", f"weights_bf16_{last}.safetensors", None, "bfloat16"),
        ("Adam state", f"adam_{last}.safetensors", None, "float32"),
        ("torch .pt model+Adam", f"{last}.pt", None, "float32"),
        ("delta fp32 weights", f"weights_fp32_{last}.safetensors", f"weights_fp32_{prev}.safetensors", "float32"),
        ("delta bf16 weights", f"weights_bf16_{last}.safetensors", f"weights_bf16_{prev}.safetensors", "bfloat16"),
        ("delta torch .pt", f"{last}.pt", f"{prev}.pt", "float32"),
    ]
    for tag, dt in (("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"), ("adam", "float32")):
        if (data_dir / f"pretrained_{tag}.safetensors").exists():
            rows.append((f"pretrained {tag}", f"pretrained_{tag}.safetensors", None, dt))
    return [(name, data_dir / f, None if b is None else data_dir / b, dt) for name, f, b, dt in rows]


def _kind(name: str) -> str:
    if "exp_avg_sq" in name:
        return "exp_avg_sq"
    if "exp_avg" in name:
        return "exp_avg"
    return "weight" if name else "other bytes"


def _ratio_by_kind(index: dict) -> dict:
    acc = collections.defaultdict(lambda: [0, 0])
    for _src_off, src_len, _off, length, _method, _crc, ti in index["segments"]:
        kind = _kind(index["tensors"][ti]["name"]) if ti >= 0 else "other bytes"
        acc[kind][0] += src_len
        acc[kind][1] += length
    return {k: (a, a / max(1, b)) for k, (a, b) in acc.items()}


# -- peak memory --------------------------------------------------------------------------
# Peak RSS is VmHWM of the child's own address space: getrusage's ru_maxrss would also
# count the parent's RSS, which a child carries until exec.
_RSS_CHILD = r"""
import json, sys, time
from comm_codec import checkpoint as ck

def hwm_kb():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))

def rss_kb():
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))

op, src, dst, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
idle = hwm_kb()
# Load the kernels first (numba's cache: ~70 MiB of code and LLVM state, whatever the file),
# so that the timed call is the file's work alone and its memory can be told apart.
import os, tempfile, numpy as np
from safetensors.numpy import save_file
with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(dst))) as tmp:
    save_file({"w": np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)}, tmp + "/w.st")
    ck.compress_file(tmp + "/w.st", tmp + "/w.cckp", threads=threads, progress=False, force=True)
    ck.decompress_file(tmp + "/w.cckp", tmp + "/w.out", threads=threads, progress=False, force=True)
warm = rss_kb()
# The previous run's output goes first: freeing it is no part of this run's work (and a run
# of several threads frees a replaced file after it returns, one thread inside the call).
if os.path.exists(dst):
    os.unlink(dst)
import resource
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
c0, start = cpu(), time.perf_counter()
s = (ck.compress_file if op == "compress" else ck.decompress_file)(src, dst, threads=threads, progress=False, force=True)
wall = time.perf_counter() - start
print(json.dumps({"idle_kb": idle, "warm_kb": warm, "peak_kb": hwm_kb(), "seconds": wall, "cores": (cpu() - c0) / wall,
                  "ratio": s.ratio, "bytes": s.original_bytes}))
"""


def _big_dir(big: Path, choice: str) -> Path:
    """Where the big file is coded: tmpfs when it has room for it, its copy and the outputs."""
    if choice != "auto":
        return Path(choice)
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 3.5 * big.stat().st_size:
        return shm
    return big.parent


def _peak_rss(big: Path, repeat: int) -> dict:
    """Compress and decompress the big file in fresh processes at 1 and 2 threads, alternately.

    Returns per op: the largest peak RSS seen, and per thread count the best run (its
    seconds and the cores it really got: process CPU time / wall time).
    """
    packed, restored = big.with_name(big.name + ".cckp"), big.with_name(big.name + ".restored")
    out = {"file_bytes": big.stat().st_size}
    for op, src, dst in (("compress", big, packed), ("decompress", packed, restored)):
        runs = {1: [], 2: []}
        for _ in range(max(1, repeat)):
            for threads in (1, 2):
                r = subprocess.run(
                    [sys.executable, "-c", _RSS_CHILD, op, str(src), str(dst), str(threads)],
                    capture_output=True,
                    text=True,
                )
                if r.returncode:
                    raise RuntimeError(f"{op} of {src} failed: {r.stderr.strip()}")
                runs[threads].append(json.loads(r.stdout.strip().splitlines()[-1]))
        every = runs[1] + runs[2]
        peak = max(every, key=lambda x: x["peak_kb"])
        out[op] = dict(peak, by_threads={t: min(rs, key=lambda x: x["seconds"]) for t, rs in runs.items()})
    out["exact"] = _sha(restored) == _sha(big)
    for p in (packed, restored):
        p.unlink()
    return out


def _steal_ticks() -> tuple[int, int]:
    """(steal, total) CPU ticks of the whole machine so far, from /proc/stat (0, 0 elsewhere)."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return 0, 0
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def _core_scaling(seconds: float = 1.0) -> dict:
    """How much two threads of pure compute get done against one, on this machine now.

    The loop is CRC-32 over a buffer that stays in L2 (zlib releases the GIL for it): no
    memory traffic, no I/O, no locks, so 2 / 1 below 2.0 means the second core is not
    wholly ours (another tenant, a sibling hyperthread, a hypervisor taking it: steal).
    """
    import threading
    import zlib

    buf = bytes(256 << 10)

    def spin(deadline, out, k):
        n = 0
        while time.perf_counter() < deadline:
            zlib.crc32(buf)
            n += 1
        out[k] = n

    rates = {}
    s0 = _steal_ticks()
    for threads in (1, 2, 1, 2):
        out = [0] * threads
        deadline = time.perf_counter() + seconds / 4
        workers = [threading.Thread(target=spin, args=(deadline, out, k)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        rates[threads] = max(rates.get(threads, 0), sum(out))
    s1 = _steal_ticks()
    steal = (s1[0] - s0[0]) / max(1, s1[1] - s0[1])
    return {"x2": rates[2] / max(1, rates[1]), "steal": steal}


def _write_scaling(folder: Path, total: int = 512 << 20) -> dict:
    """GB/s of writing ``total`` bytes in 4 MiB pwrites: one file by 1 and by 2 threads, two files by 2.

    What a restore does (workers write their segments into one output): where the file
    system holds the file's lock for a whole write (tmpfs, ext4), writers of one file take
    turns, and two threads write no faster than one, while two files scale.
    """
    import threading

    import numpy as np

    seg = 4 << 20
    data = np.random.default_rng(0).integers(0, 256, seg, dtype=np.uint8)

    def once(threads: int, files: int) -> float:
        paths = [folder / f"bench_checkpoint.{os.getpid()}.write{k}" for k in range(files)]
        fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600) for p in paths]
        try:

            def work(k):
                for i in range(k, total // seg, threads):
                    os.pwrite(fds[k % files], data, (i // files) * seg)

            start = time.perf_counter()
            workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            return total / (time.perf_counter() - start) / 1e9
        finally:
            for fd, path in zip(fds, paths):
                os.close(fd)
                path.unlink()

    out = {}
    for _ in range(3):  # best of 3, alternated
        for key, threads, files in (("1T one file", 1, 1), ("2T one file", 2, 1), ("2T two files", 2, 2)):
            out[key] = max(out.get(key, 0.0), once(threads, files))
    return out


# -- report -------------------------------------------------------------------------------
def _fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def _print_files(results: list) -> None:
    print("\n## Files (GB/s of uncompressed bytes; 1T / 2T)\n")
    print(
        f"{'dataset':<22} {'MB':>6}  {'codec':<17} {'ratio':>6}  {'comp 1T':>8} {'comp 2T':>8}  "
        f"{'dec 1T':>8} {'dec 2T':>8}  exact  notes"
    )
    for res in results:
        for i, row in enumerate(res["rows"]):
            head = f"{res['name']:<22} {res['bytes'] / 1e6:>6.1f}" if i == 0 else f"{'':<22} {'':>6}"
            print(
                f"{head}  {row['codec']:<17} {_fmt(row['ratio']):>6}  {_fmt(row['enc'].get(1)):>8} "
                f"{_fmt(row['enc'].get(2)):>8}  {_fmt(row['dec'].get(1)):>8} {_fmt(row['dec'].get(2)):>8}  "
                f"{'yes' if row['exact'] else 'NO':<5}  {'; '.join(row['notes'])}"
            )


def _print_cpu(results: list) -> None:
    print(
        "\n## CPU use (load-independent view; GB per CPU-second of the process at 1 thread, and how many "
        "cores the 2-thread runs actually got)\n"
    )
    print(
        f"{'dataset':<22} {'codec':<17} {'comp GB/cpu-s':>13} {'dec GB/cpu-s':>13}  {'2T comp cpu/wall':>16} "
        f"{'2T dec cpu/wall':>15}"
    )
    for res in results:
        for row in res["rows"]:
            cpu = row.get("cpu") or {}
            if ("enc", 1) not in cpu:
                continue
            c2e, c2d = cpu.get(("enc", 2)), cpu.get(("dec", 2))
            print(
                f"{res['name']:<22} {row['codec']:<17} {cpu[('enc', 1)][0]:>13.3f} {cpu[('dec', 1)][0]:>13.3f}  "
                f"{_fmt(c2e and c2e[1], 2):>16} {_fmt(c2d and c2d[1], 2):>15}"
            )


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _row(results, dataset, codec_prefix, suffix=""):
    """The row of ``dataset`` whose codec starts with ``codec_prefix`` and ends with
    ``suffix`` ("": the plain row, not " f2f")."""
    for res in results:
        if res["name"] == dataset:
            for row in res["rows"]:
                name = row["codec"]
                if (
                    name.startswith(codec_prefix)
                    and name != "codec frames"
                    and (name.endswith(suffix) if suffix else not name.endswith(" f2f"))
                ):
                    return row
    return None


def _targets(results: list, kinds: dict, rss: dict | None, xor: dict) -> list:
    """The targets, judged on the rows above (comparators from the same run)."""
    lines = []

    def add(what, value, need, ok):
        lines.append((what, value, need, "PASS" if ok else "MISS"))

    for res in results:
        ds = res["name"]
        cc = _row(results, ds, "comm_codec")
        zn = _row(results, ds, "zipnn", " f2f")
        zm = _row(results, ds, "zipnn")
        oz = _row(results, ds, "openzl")
        if ds.startswith("delta"):
            continue
        if oz:
            # OpenZL runs in memory: our file-to-file row against it counts our file I/O too.
            v = cc["ratio"] / oz["ratio"]
            add(
                f"{ds}: ratio vs OpenZL (same bytes)",
                f"{v:.4f}x ({cc['ratio']:.4f} vs {oz['ratio']:.4f})",
                ">= 1.000x",
                v >= 1.0,
            )
            for key, label in (("enc", "compress"), ("dec", "decompress")):
                v = cc[key][1] / oz[key][1]
                add(
                    f"{ds}: {label} 1T (file to file) vs OpenZL 1T (in memory)",
                    f"{v:.2f}x ({cc[key][1]:.3f} vs {oz[key][1]:.3f} GB/s)",
                    ">= 1.5x",
                    v >= 1.5,
                )
        if zm:
            v = cc["ratio"] / zm["ratio"]
            add(
                f"{ds}: ratio vs zipnn (same bytes)",
                f"{v:.4f}x ({cc['ratio']:.4f} vs {zm['ratio']:.4f})",
                ">= 1.005x",
                v >= 1.005,
            )
        if zn:
            # Every file at least zipnn's speed; files over 40 MB (where fixed costs no
            # longer decide) 1.3x.
            need = 1.3 if res["bytes"] > 40e6 else 1.0
            for key, label in (("enc", "compress"), ("dec", "decompress")):
                v = cc[key][1] / zn[key][1]
                add(
                    f"{ds}: {label} 1T vs zipnn 1T, both file to file",
                    f"{v:.2f}x ({cc[key][1]:.3f} vs "
                    f"{zn[key][1]:.3f} GB/s; 1T cores got {cc['cpu'][(key, 1)][1]:.2f} / "
                    f"{zn['cpu'][(key, 1)][1]:.2f})",
                    f">= {need}x",
                    v >= need,
                )
    if rss:
        for op in ("compress", "decompress"):
            bt = rss[op]["by_threads"]
            v = bt[1]["seconds"] / bt[2]["seconds"]
            add(
                f"big file {rss['file_bytes'] / 1e9:.2f} GB: {op} 2T vs 1T",
                f"{v:.2f}x (the 2T run got {bt[2]['cores']:.2f} cores)",
                ">= 1.7x",
                v >= 1.7,
            )
    for pair in kinds:
        cc = _row(results, f"delta {pair}", "comm_codec")
        xz = xor.get(pair)
        if cc and xz:
            add(f"delta {pair}: ratio vs XOR+zstd-3", f"{cc['ratio']:.3f} vs {xz:.3f}", ">=", cc["ratio"] >= xz)
    for res in results:
        for row in res["rows"]:
            if not row["exact"]:
                lines.append((f"{res['name']}: {row['codec']} round trip", "NOT exact", "exact", "MISS"))
    if rss:
        # The process after `import comm_codec.checkpoint` (torch, numba) is the floor; what
        # compressing adds on top must stay at a few pieces in flight, whatever the file size.
        for op in ("compress", "decompress"):
            r = rss[op]
            extra = (r["peak_kb"] - r["idle_kb"]) * 1024
            add(
                f"peak RSS {op}, multi-GB checkpoint",
                f"{r['peak_kb'] / 1024:.0f} MiB ({extra / 2**20:.0f} MiB above the {r['idle_kb'] / 1024:.0f} MiB "
                f"after imports) for a {rss['file_bytes'] / 1e9:.2f} GB file",
                "<= 256 MiB above imports and <= 10% of the file",
                extra <= min(256 << 20, 0.1 * rss["file_bytes"]) and rss["exact"],
            )
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--data",
        type=Path,
        default=Path("/tmp/comm_codec_ckpts"),
        help="checkpoints from make_checkpoints.py (made here if missing)",
    )
    p.add_argument("--quick", action="store_true", help="< 60 s: 2 timed calls, samples for bz2/lzma, no big file")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per measurement, best kept (default 3)")
    p.add_argument("--big-gb", type=float, default=4.0, help="size of the peak-memory checkpoint (0: skip)")
    p.add_argument("--json", type=Path, help="write every number here")
    p.add_argument("--big-only", action="store_true", help="only the big file (peak memory, 2T vs 1T)")
    p.add_argument(
        "--big-dir",
        default="auto",
        help="where the big file is coded (a copy, removed after): 'auto' = /dev/shm when it has room "
        "(disk speed does not count, as for the files above), else --data",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.quick:
        args.repeat, args.big_gb = 2, 0.0
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:  # the 2-thread rows would fail half way through
        print(
            f"bench_checkpoint.py: it times 1 and 2 threads, and NUMBA_NUM_THREADS is "
            f"{numba.config.NUMBA_NUM_THREADS}; unset it (or set it to 2 or more)",
            file=sys.stderr,
        )
        return 2
    meta_path = args.data / "meta.json"
    if not meta_path.exists():
        log.info("making checkpoints in %s", args.data)
        subprocess.run(
            [sys.executable, str(_HERE / "make_checkpoints.py"), "--out", str(args.data)]
            + (["--quick"] if args.quick else []),
            check=True,
        )
    meta = json.loads(meta_path.read_text())
    big = args.data / "big_bf16.safetensors"
    if args.big_gb > 0 and (not big.exists() or big.stat().st_size < args.big_gb * 1e9 * 0.95):
        log.info("making a %.1f GB checkpoint in %s", args.big_gb, big)
        subprocess.run(
            [
                sys.executable,
                str(_HERE / "make_checkpoints.py"),
                "--out",
                str(args.data),
                "--big-only",
                "--big-gb",
                str(args.big_gb),
            ],
            check=True,
        )
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
    work = shm / f"bench_checkpoint.{os.getpid()}"
    work.mkdir()
    results, kinds = [], {}
    try:
        for name, src, base, dtype in [] if args.big_only else _datasets(args.data, meta):
            log.info("%s: %s", name, src.name)
            local = work / src.name
            shutil.copyfile(src, local)
            local_base = None
            if base is not None:
                local_base = work / ("base-" + base.name)
                shutil.copyfile(base, local_base)
            data = local.read_bytes()
            rows = _run_file_to_file(local, local_base, work, dtype, args.repeat)
            if base is None and name.endswith("weights"):
                rows.append(_run_frames(data, dtype, args.repeat))
            if base is not None:
                alone = _run_comm_codec(local, None, work, 1)
                rows[0]["notes"].append(f"standalone ratio {alone['ratio']:.3f}")
                kinds[name.replace("delta ", "")] = {
                    "standalone": _ratio_by_kind(alone["index"]),
                    "delta": _ratio_by_kind(rows[0]["index"]),
                }
                xz = _xor_zstd(local, local_base, args.repeat)
                if xz:
                    rows.append(xz)
            comps = [_Zstd(), _Bz2(), _Lzma()]
            try:
                comps.append(_ZipNN(dtype))
            except ImportError as exc:
                log.warning("zipnn missing (%s): pip install comm_codec[bench]", exc)
            try:
                comps.append(_OpenZL(dtype))
            except ImportError as exc:
                log.warning("openzl missing (%s): pip install comm_codec[bench]", exc)
            for comp in comps:
                sample = isinstance(comp, (_Bz2, _Lzma))
                chunk = data[:_SAMPLE] if sample and (args.quick or len(data) > 64 << 20) else data
                note = "first 4 MiB" if chunk is not data else ""
                note += ("; " if note else "") + ("no delta mode: standalone" if base is not None else "")
                if isinstance(comp, (_ZipNN, _OpenZL)):
                    note += ("; " if note else "") + "in memory"
                rows.append(_run_comparator(comp, chunk, 1 if sample else args.repeat, note.strip("; ")))
            for row in rows:
                row.pop("index", None)
            results.append({"name": name, "file": src.name, "bytes": len(data), "rows": rows})
            local.unlink()
            if local_base:
                local_base.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rss = None
    if args.big_gb > 0:
        log.info("peak RSS on %s", big)
        where = _big_dir(big, args.big_dir)
        local = where / f"bench_checkpoint.{os.getpid()}.{big.name}" if where != big.parent else big
        try:
            if local != big:
                shutil.copyfile(big, local)
            before = _core_scaling()
            rss = _peak_rss(local, 2 if args.repeat > 1 else 1)
            rss["where"] = str(where)
            rss["cores"] = {"before": before, "after": _core_scaling()}
            rss["writes"] = _write_scaling(where)
        finally:
            if local != big:
                local.unlink(missing_ok=True)

    print("# comm_codec checkpoint benchmark")
    print(
        f"python {platform.python_version()}, {os.cpu_count()} CPUs, "
        + ", ".join(f"{m} {_version(m)}" for m in ("torch", "numba", "zstandard", "zipnn", "openzl"))
    )
    print(
        f"data: {args.data} ({meta.get('params', 0) / 1e6:.2f} M parameters, checkpoints {meta['checkpoints']}); "
        f"repeat {args.repeat}{', QUICK' if args.quick else ''}"
    )
    print("load average at the end: " + ", ".join(f"{x:.1f}" for x in os.getloadavg()))
    _print_files(results)
    _print_cpu(results)
    print("\n## Delta against the previous checkpoint, per tensor kind (ratio; MB of source)\n")
    print(f"{'pair':<20} {'kind':<12} {'MB':>7} {'standalone':>11} {'delta':>8}")
    for pair, by_kind in kinds.items():
        for kind in ("weight", "exp_avg", "exp_avg_sq", "other bytes"):
            if kind in by_kind["delta"]:
                mb = by_kind["delta"][kind][0] / 1e6
                print(
                    f"{pair:<20} {kind:<12} {mb:>7.2f} {by_kind['standalone'][kind][1]:>11.3f} "
                    f"{by_kind['delta'][kind][1]:>8.3f}"
                )
    if rss:
        print(
            f"\n## Big file: peak memory and threads (fresh processes, files in {rss['where']}, 1T and 2T alternated)\n"
        )
        for op in ("compress", "decompress"):
            r = rss[op]
            speeds = ", ".join(
                f"{t}T {b['bytes'] / b['seconds'] / 1e9:.3f} GB/s ({b['cores']:.2f} cores)"
                for t, b in r["by_threads"].items()
            )
            print(
                f"{op:<11} {rss['file_bytes'] / 1e9:.2f} GB: peak RSS {r['peak_kb'] / 1024:.0f} MiB "
                f"(idle after imports {r['idle_kb'] / 1024:.0f} MiB, {r['warm_kb'] / 1024:.0f} MiB once the kernels "
                f"are loaded); {speeds}; ratio {r['ratio']:.3f}"
            )
        print(f"round trip exact: {'yes' if rss['exact'] else 'NO'}")
        print(
            "pure compute, 2 threads / 1 thread (CRC-32 in L2; 2.00 = two whole cores), before / after: "
            + " / ".join(f"{c['x2']:.2f} (steal {100 * c['steal']:.1f} %)" for c in rss["cores"].values())
        )
        print(
            f"writes into {rss['where']} (4 MiB pwrites, GB/s): "
            + ", ".join(f"{k} {v:.2f}" for k, v in rss["writes"].items())
        )
    xor = {
        res["name"].replace("delta ", ""): _row(results, res["name"], "xor+zstd")["ratio"]
        for res in results
        if res["name"].startswith("delta") and _row(results, res["name"], "xor+zstd")
    }
    lines = _targets(results, kinds, rss, xor)
    print("\n## Targets\n")
    for what, value, need, verdict in lines:
        print(f"{verdict:<6} {what}: {value} (target {need})")
    if args.json:
        for res in results:
            for row in res["rows"]:
                for field in ("cpu", "median"):
                    row[field] = {f"{k[0]}{k[1]}T": v for k, v in (row.get(field) or {}).items()}
        args.json.write_text(
            json.dumps(
                {"results": results, "delta_by_kind": kinds, "peak_rss": rss, "targets": lines}, indent=1, default=str
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
