"""Directory mode on a tree of many small files, against ``cp -r`` of the same tree, same run.

A checkpoint directory with thousands of small files (tokenizer shards, per-rank DCP
files, logs) is mostly copying. This times ``comm-codec compress DIR OUT`` and
``comm-codec decompress OUT BACK`` (each a fresh process, as a user runs them) beside
``cp -r DIR COPY``, alternating (cp, compress+decompress, cp, ...), and prints the
medians and the ratio (compress + decompress) / cp. Every restored tree is checked against
the input (names and bytes). The tree also holds one small safetensors file (a checkpoint
among the small files, as in a model directory): ``decompress`` refuses a tree with no
compressed file in it, so a tree of empty files alone has nothing to restore.

Usage::

    python launch_scripts/bench_many_files.py [--files 20000] [--size 0] [--reps 3] [--dir /tmp] [--cpu-time]
        [--baseline DIR]    # another source tree's comm_codec (git archive REV comm_codec | tar -x -C DIR), same run
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


def _timed(argv, env=None) -> float:
    """Wall seconds of one command; with --cpu-time, its CPU seconds (user + system) instead."""
    start, before = time.perf_counter(), os.times()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)
    after = os.times()
    if _CPU[0]:
        return (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return time.perf_counter() - start


_CPU = [False]  # set by --cpu-time


def _small_checkpoint(path: str) -> None:
    """A 64 KiB safetensors file (one fp32 tensor): the tree's one checkpoint."""
    import torch
    from safetensors.torch import save_file

    save_file({"w": torch.randn(128, 128, generator=torch.Generator().manual_seed(0))}, path)


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
    parser.add_argument("--baseline", help="a source tree holding another comm_codec, timed alternately too")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the CPU seconds (user + system) of each command, not wall seconds (for a shared, loaded box)",
    )
    args = parser.parse_args(argv)
    _CPU[0] = args.cpu_time
    work = tempfile.mkdtemp(prefix="cc-many-", dir=args.dir)
    src = os.path.join(work, "src")
    os.mkdir(src)
    payload = os.urandom(args.size)
    for i in range(args.files):
        with open(os.path.join(src, f"f{i:06d}.bin"), "wb") as fh:
            fh.write(payload)
    _small_checkpoint(os.path.join(src, "model.safetensors"))
    cli = [sys.executable, "-m", "comm_codec"]
    trees = {"this tree": None}
    if args.baseline:
        trees["baseline"] = dict(os.environ, PYTHONPATH=os.path.abspath(args.baseline))
    cp, comp, dec = [], {t: [] for t in trees}, {t: [] for t in trees}
    try:
        for _ in range(args.reps):
            shutil.rmtree(os.path.join(work, "copy"), ignore_errors=True)
            cp.append(_timed(["cp", "-r", src, os.path.join(work, "copy")]))
            for tree, env in trees.items():
                for d in ("out", "back"):
                    shutil.rmtree(os.path.join(work, d), ignore_errors=True)
                comp[tree].append(_timed(cli + ["compress", "-q", src, os.path.join(work, "out")], env))
                dec[tree].append(
                    _timed(cli + ["decompress", "-q", os.path.join(work, "out"), os.path.join(work, "back")], env)
                )
                if not _same(src, os.path.join(work, "back")):
                    raise SystemExit(f"bench_many_files.py: {tree}: the restored tree differs from the input")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()
    print(
        f"{args.files} files of {args.size} bytes in one directory, {args.reps} alternating reps, "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, load {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f}, {args.dir}"
    )
    print(f"{'what':<36} {'median s':>9} {'min s':>8}" + ("   (CPU seconds: user + system)" if _CPU[0] else ""))
    print(f"{'cp -r':<36} {statistics.median(cp):9.2f} {min(cp):8.2f}")
    for tree in trees:
        both = [c + d for c, d in zip(comp[tree], dec[tree])]
        for name, xs in (("compress", comp[tree]), ("decompress", dec[tree]), ("compress + decompress", both)):
            print(f"{tree + ': ' + name:<36} {statistics.median(xs):9.2f} {min(xs):8.2f}")
        print(
            f"{tree}: (compress + decompress) / cp -r: {statistics.median(both) / statistics.median(cp):.1f}x "
            f"(median), {min(both) / min(cp):.1f}x (min)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
