"""``comm-codec precompile`` (alias ``warmup``): compile the codec's kernels into numba's cache.

numba compiles a kernel on the first call for each element type and caches the machine
code on disk; compiling takes tens of seconds per element type, loading it back a fraction
of a second. Run once per machine after installing (and after upgrading numba or
comm_codec), so that no training process pauses to compile. :func:`precompile` is the
same step inside a process (the demo runs it before step 1).

This module imports neither torch nor numba until the command runs.
"""

from __future__ import annotations

import time

__all__ = ["precompile", "register"]


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


def _cmd_precompile(args) -> int:
    from ..core.codec import Codec

    dtypes = None
    if args.dtypes:
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    start = time.perf_counter()
    spent, cache = precompile(Codec(threads=1), dtypes, profiler=not args.codec_only)
    print(f"{'dtype':<10} {'seconds':>8}")
    for name, seconds in spent.items():
        print(f"{name:<10} {seconds:8.2f}")
    print(f"comm_codec kernels ready in {time.perf_counter() - start:.1f} s; cache: {cache}")
    return 0


def register(sub) -> None:
    """Add the ``precompile`` subcommand (and its alias ``warmup``) to the CLI's subparsers."""
    p = sub.add_parser(
        "precompile", aliases=["warmup"],
        help="compile the codec's kernels into numba's cache (run once after installing)",
        description="Compile the codec's numba kernels for every dtype (or --dtypes) into numba's on-disk "
                    "cache, so that no training process pauses to compile them. Run once per machine "
                    "after installing (and after upgrading numba or comm_codec); set NUMBA_CACHE_DIR to "
                    "put the cache somewhere else (a read-only site-packages falls back to the user's "
                    "cache directory).")
    p.add_argument("--dtypes", metavar="LIST",
                   help="comma-separated dtypes, e.g. bf16,fp32 (default: every supported dtype)")
    p.add_argument("--codec-only", action="store_true",
                   help="skip the profiler's kernels (histograms and book building)")
    p.set_defaults(func=_cmd_precompile)
