"""Profile numba's compile of the codec's kernels: per phase, per kernel, per signature.

Runs in a fresh numba cache (a new temporary directory unless ``--cache`` names one), so
every kernel is compiled, not loaded; a second run with the same ``--cache`` shows what
loading costs instead. numba's ``numba:compile`` events give each dispatcher's compile
time, inclusive of the helpers it compiles on the way and exclusive of them (self time:
typing, lowering and LLVM of that function alone).

    python launch_scripts/profile_compile.py [--cache DIR] [--phases encode,decode,...] [--json OUT]

Prints a table of phases (wall and CPU seconds) and one of kernels sorted by self CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

PHASES = ("import", "codec1", "codec2", "profiler", "checkpoint", "lossy", "collective")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", help="numba cache directory (default: a new empty temporary one)")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases to run, in order")
    p.add_argument("--dtypes", default="bf16,fp16,fp32,fp8_e4m3,int8", help="dtypes of the codec phases")
    p.add_argument("--json", help="write the tables as JSON here")
    p.add_argument("--top", type=int, default=40, help="kernel rows to print")
    args = p.parse_args(argv)
    os.environ["NUMBA_CACHE_DIR"] = args.cache or tempfile.mkdtemp(prefix="cc-numba-")
    phases = [x for x in args.phases.split(",") if x]

    from numba.core import event

    stack: list = []
    rows: dict = {}  # (name, signature) -> [inclusive, self]

    class Listener(event.Listener):
        def on_start(self, ev):
            stack.append([time.process_time(), 0.0])

        def on_end(self, ev):
            start, children = stack.pop()
            total = time.process_time() - start
            if stack:
                stack[-1][1] += total
            disp = ev.data["dispatcher"]
            name = getattr(disp, "py_func", disp).__module__.rsplit(".", 1)[-1] + "." + disp.py_func.__name__
            sig = ",".join(str(a) for a in ev.data["args"])
            row = rows.setdefault((name, sig), [0.0, 0.0])
            row[0] += total
            row[1] += total - children

    event.register("numba:compile", Listener())

    times: dict = {}
    cpu: dict = {}
    t0, c0 = time.perf_counter(), time.process_time()
    import torch

    import comm_codec as cc

    times["import"] = time.perf_counter() - t0
    cpu["import"] = time.process_time() - c0
    dtypes = [x for x in args.dtypes.split(",") if x]
    from comm_codec.core.streams import spec_for

    def sample(dtype, n=1 << 16):
        from comm_codec.core.precompile import _sample

        x = _sample(spec_for(dtype).dtype)
        return x.repeat(n // x.numel())

    def run_codec(threads):
        codec = cc.Codec(threads=threads)
        for d in dtypes:
            x = sample(d)
            f = codec.encode(x, "gradient")
            assert torch.equal(codec.decode(f).view(torch.uint8), x.view(torch.uint8))
            small = x[:1000]
            assert torch.equal(codec.decode(codec.encode(small)).view(torch.uint8), small.view(torch.uint8))
            if spec_for(d).name in ("bf16", "fp16", "fp32"):
                codec.decode_accumulate(f, torch.zeros(x.numel(), dtype=torch.float32))

    work = {
        "codec1": lambda: run_codec(1),
        "codec2": lambda: run_codec(2),
        "profiler": lambda: [_prof(d) for d in dtypes],
        "checkpoint": lambda: _checkpoint(),
        "lossy": lambda: _lossy(),
        "collective": lambda: None,
    }

    def _prof(d):
        prof = cc.WarmupProfiler()
        prof.observe(sample(d))
        prof.build()

    def _checkpoint():
        from comm_codec import checkpoint

        d = tempfile.mkdtemp()
        g = torch.Generator().manual_seed(0)
        sd = {
            "w": torch.randn(512, 512, generator=g).to(torch.bfloat16),
            "h": torch.randn(300, 300, generator=g).half(),
            "f": torch.randn(700, 300, generator=g),
            "i": torch.arange(1000),
        }
        torch.save(sd, f"{d}/a.pt")
        checkpoint.compress_file(f"{d}/a.pt", f"{d}/a.cc")
        checkpoint.decompress_file(f"{d}/a.cc", f"{d}/b.pt")

    def _lossy():
        from comm_codec.checkpoint import lossy

        d = tempfile.mkdtemp()
        g = torch.Generator().manual_seed(0)
        torch.save({"w": torch.randn(512, 512, generator=g).to(torch.bfloat16)}, f"{d}/a.pt")
        lossy.compress_file(f"{d}/a.pt", f"{d}/a.ccl")
        lossy.decompress_file(f"{d}/a.ccl", f"{d}/b.pt")

    for ph in phases:
        if ph == "import":
            continue
        t, c = time.perf_counter(), time.process_time()
        work[ph]()
        times[ph] = time.perf_counter() - t
        cpu[ph] = time.process_time() - c
    times["total"] = time.perf_counter() - t0
    cpu["total"] = time.process_time() - c0

    print(f"cache {os.environ['NUMBA_CACHE_DIR']}  threads {os.cpu_count()}  load {os.getloadavg()[0]:.2f}")
    print(f"{'phase':<12} {'wall s':>8} {'cpu s':>8}")
    for k, v in times.items():
        print(f"{k:<12} {v:8.2f} {cpu[k]:8.2f}")
    by_kernel: dict = {}
    for (name, _sig), (inc, own) in rows.items():
        r = by_kernel.setdefault(name, [0.0, 0.0, 0])
        r[0] += inc
        r[1] += own
        r[2] += 1
    total_self = sum(r[1] for r in by_kernel.values())
    print(f"\ncompiled: {len(rows)} signatures of {len(by_kernel)} functions, {total_self:.1f} CPU s")
    print(f"{'function':<40} {'sigs':>4} {'self s':>7} {'incl s':>7}  (CPU seconds)")
    for name, (inc, own, n) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[: args.top]:
        print(f"{name:<40} {n:4d} {own:7.2f} {inc:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "phases": times,
                    "cpu": cpu,
                    "kernels": {k: v for k, v in by_kernel.items()},
                    "signatures": [[n, s, i, o] for (n, s), (i, o) in rows.items()],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
