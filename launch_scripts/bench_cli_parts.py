"""The command line's fixed cost, part by part, beside zstd -3 on the same file.

Each part is a fresh interpreter (wall and CPU seconds, best of ROUNDS, alternated):

* ``python``: the interpreter alone (``-c pass``);
* ``numpy``, ``numba``: importing them;
* ``imports``: everything ``comm-codec compress`` imports (the command line, numba's numpy
  support, the checkpoint package), nothing run;
* ``loads``: the same, then one ``compress_file`` of the file in process, timed inside:
  its first call loads the kernels from numba's cache, a second call on the same file
  does not (the difference is what the cache loads and first uses cost);
* ``compress``: the whole ``comm-codec compress`` of the file (1 thread);
* ``zstd -3``: the comparator, where the ``zstd`` command exists.

    python launch_scripts/bench_cli_parts.py [FILE] [--rounds N] [--mb 1]

Without FILE it writes a torch.save file of about --mb MB (bf16 and fp32 tensors of a
seeded model-like state) in a temporary directory. Run ``comm-codec precompile`` first:
compiles are not what this measures.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

_IMPORTS = (
    "import comm_codec.tools.cli as c, comm_codec.core.precompile; c._numba_without_blas(); "
    "c._numba_without_extensions(); c._numba_cache_loads_without_setup(); import comm_codec.checkpoint.exact"
)
_LOADS = (
    _IMPORTS
    + """
import sys, time
from comm_codec.checkpoint import exact
t = time.perf_counter(); exact.compress_file(sys.argv[1], sys.argv[2], threads=1, progress=False, force=True)
first = time.perf_counter() - t
t = time.perf_counter(); exact.compress_file(sys.argv[1], sys.argv[2], threads=1, progress=False, force=True)
print(first, time.perf_counter() - t)
"""
)


def _run(cmd: list) -> tuple[float, float, str]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), out


def _make(path: str, mb: float) -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    n = int(mb * 1e6 / 2 * 0.7)
    sd = {
        "embed.weight": (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16),
        "norm.weight": torch.ones(int(mb * 1e6 * 0.3 / 4)),
        "step": torch.tensor(10),
    }
    torch.save(sd, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", nargs="?")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mb", type=float, default=1.0)
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench_cli_parts.")
    try:
        src = args.file or os.path.join(work, "one.pt")
        if not args.file:
            _make(src, args.mb)
        dst = os.path.join(work, "out.cckp")
        py = sys.executable
        cli = [py, "-m", "comm_codec"]
        parts = {
            "python": [py, "-c", "pass"],
            "numpy": [py, "-c", "import numpy"],
            "numba": [py, "-c", "import numba"],
            "imports": [py, "-c", _IMPORTS],
            "loads": [py, "-c", _LOADS, src, dst],
            "compress": [*cli, "compress", "-q", "--force", "--threads", "1", src, dst],
        }
        if shutil.which("zstd"):
            parts["zstd -3"] = ["zstd", "-3", "-q", "-f", "-T1", src, "-o", os.path.join(work, "x.zst")]
        best = {k: [float("inf"), float("inf")] for k in parts}
        inside = [float("inf"), float("inf")]
        for _ in range(args.rounds):
            for name, cmd in parts.items():
                wall, cpu, out = _run(cmd)
                best[name][0] = min(best[name][0], wall)
                best[name][1] = min(best[name][1], cpu)
                if name == "loads":
                    first, second = map(float, out.split())
                    inside = [min(inside[0], first), min(inside[1], second)]
        print(
            f"file {src}: {os.path.getsize(src)} bytes; {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f} "
            f"(after); best of {args.rounds}"
        )
        print(f"{'part':<10} {'wall s':>7} {'cpu s':>7}")
        for name, (wall, cpu) in best.items():
            print(f"{name:<10} {wall:7.3f} {cpu:7.3f}")
        print(
            f"in process: first compress_file {inside[0]:.3f} s (kernel cache loads and first uses), "
            f"second {inside[1]:.3f} s"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
