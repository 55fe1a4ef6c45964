"""comm_codec against zipnn, file to file at one thread, on checkpoint files of every format.

For DCP data files (torch's FileSystemWriter), legacy torch.save files, or any file:
ratio, compress and decompress GB/s (original bytes over wall time, best of N), timed
alternately A, B, A, B in one run. zipnn gets the whole file padded to whole elements
(zipnn 0.5.4 aborts otherwise) and a fresh copy per call (it rewrites its input).

    python launch_scripts/bench_formats.py FILE... [--dtype float32] [--repeat 5] [--json out.json]

Directory deltas (``--delta PREV NEXT``): the total ratio of ``compress NEXT OUT --base
PREV`` against each file compressed alone with ``compress_file(base=)``, and against
XOR with the partner file then zstd -3. Loading (``--hf-load PLAIN PACKED``):
``from_pretrained`` of a compressed HF directory against ``AutoModel.from_pretrained`` of
the plain one, alternately.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from comm_codec import checkpoint as ck


def _best(fns: dict, repeat: int) -> dict:
    best = {k: float("inf") for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():  # A, B, A, B
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def _write(path: str, data) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def bench(path: str, dtype: str, repeat: int, work: str) -> dict:
    import zipnn

    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    packed, restored = os.path.join(work, "p.cckp"), os.path.join(work, "r.out")
    zpacked, zrestored = os.path.join(work, "z.zipnn"), os.path.join(work, "z.out")
    zn = zipnn.ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)
    size = os.path.getsize(path)

    def zn_enc():
        with open(path, "rb") as fh:
            data = bytearray(fh.read())
        data += b"\0" * (-len(data) % itemsize)
        _write(zpacked, zn.compress(data))

    def zn_dec():
        with open(zpacked, "rb") as fh:
            _write(zrestored, zn.decompress(fh.read())[:size])

    s = ck.compress_file(path, packed, threads=1, progress=False, force=True)  # warm: kernels, page cache
    ck.decompress_file(packed, restored, threads=1, progress=False, force=True)
    zn_enc()
    zn_dec()
    enc = _best(
        {"cc": lambda: ck.compress_file(path, packed, threads=1, progress=False, force=True), "zn": zn_enc}, repeat
    )
    dec = _best(
        {"cc": lambda: ck.decompress_file(packed, restored, threads=1, progress=False, force=True), "zn": zn_dec},
        repeat,
    )
    with open(path, "rb") as a, open(restored, "rb") as b, open(zrestored, "rb") as c:
        orig = a.read()
        exact, zexact = orig == b.read(), orig == c.read()
    row = {
        "file": path,
        "bytes": size,
        "format": s.format,
        "tensors": s.tensors,
        "coded": s.coded,
        "cc_ratio": size / os.path.getsize(packed),
        "zn_ratio": size / os.path.getsize(zpacked),
        "cc_enc": size / enc["cc"] / 1e9,
        "zn_enc": size / enc["zn"] / 1e9,
        "cc_dec": size / dec["cc"] / 1e9,
        "zn_dec": size / dec["zn"] / 1e9,
        "exact": exact,
        "zn_exact": zexact,
    }
    for p in (packed, restored, zpacked, zrestored):
        os.unlink(p)
    return row


def delta(prev: str, nxt: str, work: str) -> None:
    import zstandard

    from comm_codec.checkpoint import directory

    out = os.path.join(work, "delta")
    t0 = time.perf_counter()
    summary = directory.compress_dir(nxt, out, base=prev, threads=1)
    seconds = time.perf_counter() - t0
    orig = stored = xz = per_file = 0
    zc = zstandard.ZstdCompressor(level=3)
    for f in summary.files:
        a, b = os.path.join(prev, f.path), os.path.join(nxt, f.path)
        with open(b, "rb") as fh:
            data = fh.read()
        orig += len(data)
        stored += f.stored_bytes
        if f.action == "compressed":
            one = os.path.join(work, "one.cckp")
            per_file += ck.compress_file(b, one, base=a, threads=1, progress=False, force=True).compressed_bytes
            os.unlink(one)
            with open(a, "rb") as fh:
                base = fh.read()
            if len(base) == len(data):
                import numpy as np

                x = np.frombuffer(data, np.uint8) ^ np.frombuffer(base, np.uint8)
                xz += len(zc.compress(x.tobytes()))
            else:
                xz += len(zc.compress(data))
        else:
            per_file += len(data)
            xz += len(data)
    print(f"directory delta {nxt} against {prev}: {orig / 1e6:.1f} MB")
    print(f"  compress DIR --base PREV   ratio {orig / stored:.4f} ({seconds:.2f} s, 1 thread)")
    print(f"  compress_file per file     ratio {orig / per_file:.4f}")
    print(f"  XOR + zstd -3 per file     ratio {orig / xz:.4f}")
    import shutil

    shutil.rmtree(out)


def hf_load(plain: str, packed: str, repeat: int) -> None:
    import torch
    from transformers import AutoModel

    from comm_codec.integrations.hf import from_pretrained

    def a():
        return AutoModel.from_pretrained(plain)

    def b():
        return from_pretrained(AutoModel, packed)

    sa, sb = a().state_dict(), b().state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    times: dict = {"plain": [], "cc": []}
    for _ in range(repeat):  # A, B, A, B
        for key, fn in (("plain", a), ("cc", b)):
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"from_pretrained: plain directory {best['plain']:.3f} s, compressed {best['cc']:.3f} s "
        f"({best['cc'] / best['plain']:.2f}x) best of {repeat}; medians {median['plain']:.3f} / "
        f"{median['cc']:.3f} s ({median['cc'] / median['plain']:.2f}x); alternated, parameters equal; "
        f"{len(os.sched_getaffinity(0))} cores"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--delta", nargs=2, metavar=("PREV", "NEXT"))
    ap.add_argument("--hf-load", nargs=2, metavar=("PLAIN", "PACKED"))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    work = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    print(f"load before: {os.getloadavg()[0]:.2f}")
    if args.delta:
        delta(*args.delta, work)
    if args.hf_load:
        hf_load(*args.hf_load, args.repeat)
    if not args.files:
        print(f"load after: {os.getloadavg()[0]:.2f}")
        os.rmdir(work)
        return
    print(
        f"{'file':<28} {'format':<13} {'MB':>7} {'tensors':>9} {'ratio cc':>8} {'zipnn':>7} {'r/zn':>6} "
        f"{'enc cc':>7} {'zn':>6} {'x':>5} {'dec cc':>7} {'zn':>6} {'x':>5} exact"
    )
    rows = []
    for f in args.files:
        r = bench(f, args.dtype, args.repeat, work)
        rows.append(r)
        name = os.path.join(os.path.basename(os.path.dirname(f)), os.path.basename(f))[-28:]
        print(
            f"{name:<28} {r['format']:<13} {r['bytes'] / 1e6:>7.1f} {r['coded']:>4}/{r['tensors']:<4} "
            f"{r['cc_ratio']:>8.4f} {r['zn_ratio']:>7.4f} {r['cc_ratio'] / r['zn_ratio']:>6.4f} "
            f"{r['cc_enc']:>7.3f} {r['zn_enc']:>6.3f} {r['cc_enc'] / r['zn_enc']:>5.2f} "
            f"{r['cc_dec']:>7.3f} {r['zn_dec']:>6.3f} {r['cc_dec'] / r['zn_dec']:>5.2f} {r['exact']}/{r['zn_exact']}",
            flush=True,
        )
    print(
        f"load after: {os.getloadavg()[0]:.2f} (GB/s = original bytes over wall time, best of {args.repeat}, "
        "1 thread, file to file on /dev/shm)"
    )
    os.rmdir(work)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
