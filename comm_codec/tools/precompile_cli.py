"""``comm-codec precompile`` (alias ``warmup``): compile the codec's kernels into numba's cache.

numba compiles a kernel on the first call for each element type and caches the machine
code on disk; compiling takes tens of seconds per element type, loading it back a fraction
of a second. Run once per machine after installing (and after upgrading numba or
comm_codec), so that no training process pauses to compile. :func:`precompile` is the
same step inside a process (the demo runs it before step 1).

Besides the codec's kernels for every dtype (one thread and several, the decode-and-add
of the collectives, the profiler's), the command runs the checkpoint paths once on a
small file it writes with ``torch.save`` in a temporary directory: the planner's kernels
(exact files, with and without a base; DCP codes tensors through the same planner) and
the lossy format's. After it, no public path compiles anything (tests/test_precompile.py).

This module imports neither torch nor numba until the command runs.
"""

from __future__ import annotations

import os
import tempfile
import time

__all__ = ["precompile", "precompile_checkpoint", "register"]


def precompile(codec, dtypes=None, profiler: bool = True) -> tuple[dict, str]:
    """Load (compiling where the cache lacks them) the kernels that coding ``dtypes`` needs.

    Args:
        codec: the :class:`comm_codec.Codec` whose books and threads to use.
        dtypes: torch dtypes or names such as ``"bf16"``; None: every supported dtype.
        profiler: also the profiler's kernels (chunk histograms, book building).

    Returns:
        (dtype name -> seconds spent on it, the directory of numba's cache).

    Raises:
        TypeError: an unsupported dtype.
    """
    from ..core import precompile as kernels

    return kernels.precompile(codec, dtypes, profiler=profiler), kernels.cache_location()


def _state(scale: float, torch) -> dict:
    """Tensors of every dtype the checkpoint path codes, each large enough for its sampled
    paths: many chunks of one dtype (groups of books) and small tensors (counted whole)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g) * scale

    sd = {
        "big": randn(640, 1024).to(torch.bfloat16),
        "bf16": randn(3000).to(torch.bfloat16),
        "fp16": randn(70000).half(),
        "fp32": randn(70000),
        "fp32_small": randn(300),
        "fp8_e4m3": randn(70000).to(torch.float8_e4m3fn),
        "fp8_e5m2": randn(70000).to(torch.float8_e5m2),
        "int8": (randn(70000) * 20).round().clamp(-128, 127).to(torch.int8),
        "uint8": torch.arange(70000) % 7,
        "step": torch.tensor(3),
    }
    sd["uint8"] = sd["uint8"].to(torch.uint8)
    sd["big"][::3] = 0
    return sd


def precompile_checkpoint() -> float:
    """Run the checkpoint paths once on a small file (see the module's docstring); return seconds."""
    import torch

    from ..checkpoint import exact, lossy

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="comm_codec_precompile.") as d:
        base, new = os.path.join(d, "base.pt"), os.path.join(d, "new.pt")
        torch.save(_state(1e-2, torch), base)
        sd = _state(1e-2, torch)
        for t in sd.values():
            if t.dtype in (torch.bfloat16, torch.float16, torch.float32) and t.numel() > 1:
                t.view(-1)[::5] = t.view(-1)[::5] * 1.5
        sd["opt"] = {"exp_avg": torch.randn(70000) * 1e-3, "exp_avg_sq": torch.rand(70000) * 1e-6}
        torch.save(sd, new)
        for threads in (1, 2):
            exact.compress_file(base, base + ".cc", threads=threads, progress=False, force=True)
            exact.compress_file(new, new + ".cc", base=base, threads=threads, progress=False, force=True)
            exact.decompress_file(base + ".cc", base + ".out", threads=threads, progress=False, force=True)
            exact.decompress_file(new + ".cc", new + ".out", base=base, threads=threads, progress=False, force=True)
        lossy.compress_file(new, new + ".ccl")
        lossy.decompress_file(new + ".ccl", new + ".lossy.pt")
    return time.perf_counter() - start


def _cmd_precompile(args) -> int:
    from ..core.codec import Codec

    dtypes = None
    if args.dtypes:
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    start = time.perf_counter()
    spent, cache = precompile(Codec(threads=1), dtypes, profiler=not args.codec_only)
    if not args.codec_only and dtypes is None:
        spent["checkpoint"] = precompile_checkpoint()
    print(f"{'dtype':<10} {'seconds':>8}")
    for name, seconds in spent.items():
        print(f"{name:<10} {seconds:8.2f}")
    print(f"comm_codec kernels ready in {time.perf_counter() - start:.1f} s; cache: {cache}")
    return 0


def register(sub) -> None:
    """Add the ``precompile`` subcommand (and its alias ``warmup``) to the CLI's subparsers."""
    p = sub.add_parser(
        "precompile",
        aliases=["warmup"],
        help="compile the codec's kernels into numba's cache (run once after installing)",
        description="Compile the codec's numba kernels for every dtype (or --dtypes) into numba's on-disk "
        "cache, so that no training process pauses to compile them. Run once per machine "
        "after installing (and after upgrading numba or comm_codec); set NUMBA_CACHE_DIR to "
        "put the cache somewhere else (a read-only site-packages falls back to the user's "
        "cache directory).",
    )
    p.add_argument(
        "--dtypes", metavar="LIST", help="comma-separated dtypes, e.g. bf16,fp32 (default: every supported dtype)"
    )
    p.add_argument("--codec-only", action="store_true", help="skip the profiler's and the checkpoint planner's kernels")
    p.set_defaults(func=_cmd_precompile)
