"""Directory mode on a tree of many small files, against ``cp -r`` of the same tree, same run.

A checkpoint directory with thousands of small files (tokenizer shards, per-rank DCP
files, logs) is mostly copying. This times ``comm-codec compress DIR OUT`` and
``comm-codec decompress OUT BACK`` (each a fresh process, as a user runs them) beside
``cp -r DIR COPY``, alternating (cp, compress+decompress, cp, ...), and prints the
medians and the ratio (compress + decompress) / cp. Every restored tree is checked against
the input (names and bytes).

Usage::

    python launch_scripts/bench_many_files.py [--files 20000] [--size 0] [--reps 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _timed(argv) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _same(a: str, b: str) -> bool:
    names_a, names_b = sorted(os.listdir(a)), sorted(os.listdir(b))
    if names_a != names_b:
        return False
    return all(open(os.path.join(a, n), "rb").read() == open(os.path.join(b, n), "rb").read() for n in names_a)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=20_000, help="files in the one directory (default 20000)")
    parser.add_argument("--size", type=int, default=0, help="bytes per file (default 0: empty files)")
    parser.add_argument("--reps", type=int, default=3, help="alternating repetitions (default 3)")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the trees are made")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="cc-many-", dir=args.dir)
    src = os.path.join(work, "src")
    os.mkdir(src)
    payload = os.urandom(args.size)
    for i in range(args.files):
        with open(os.path.join(src, f"f{i:06d}.bin"), "wb") as fh:
            fh.write(payload)
    cli = [sys.executable, "-m", "comm_codec"]
    cp, cc, comp, dec = [], [], [], []
    try:
        for _ in range(args.reps):
            for d in ("copy", "out", "back"):
                shutil.rmtree(os.path.join(work, d), ignore_errors=True)
            cp.append(_timed(["cp", "-r", src, os.path.join(work, "copy")]))
            c = _timed(cli + ["compress", "-q", src, os.path.join(work, "out")])
            d = _timed(cli + ["decompress", "-q", os.path.join(work, "out"), os.path.join(work, "back")])
            comp.append(c)
            dec.append(d)
            cc.append(c + d)
            if not _same(src, os.path.join(work, "back")):
                raise SystemExit("bench_many_files.py: the restored tree differs from the input")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    print(f"{args.files} files of {args.size} bytes in one directory, {args.reps} alternating reps, "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, load {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}, {args.dir}")
    print(f"{'what':<28} {'median s':>9} {'min s':>8}")
    for name, xs in (("cp -r", cp), ("comm-codec compress", comp), ("comm-codec decompress", dec),
                     ("compress + decompress", cc)):
        print(f"{name:<28} {statistics.median(xs):9.2f} {min(xs):8.2f}")
    print(f"ratio (compress + decompress) / cp -r: {statistics.median(cc) / statistics.median(cp):.1f}x (median), "
          f"{min(cc) / min(cp):.1f}x (min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
