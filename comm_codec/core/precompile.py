"""Compile (or load from numba's cache) the codec's kernels before they are timed.

numba compiles a kernel on its first call for each element type (bf16 and fp16 share
one, fp32 has its own, the 1-byte floats another, int8/uint8 the last) and caches the
machine code on disk. Compiling one element type's encode and decode kernels took
~20 s on the 2-core development VM (issue 14: a fresh install's first training step
paused 87 s, two ranks compiling the same kernels at once); loading them back from the
cache takes ~0.3 s. So:

* ``comm-codec warmup`` (run once after installing, as the README's install step does)
  fills the cache for every element type and prints what it took;
* :meth:`comm_codec.Codec.warmup` does the same inside a process, for the dtypes it
  will code, so that a caller can keep compile or cache-load time out of its first
  measured encode and decode (the DDP hook's ``encode_seconds``);
* whichever call compiles first logs it once, with its duration.

Where the cache goes: numba writes beside the package (``__pycache__``) when it can, and
otherwise (a read-only site-packages) under the user's cache directory; set
``NUMBA_CACHE_DIR`` to choose one, e.g. a directory shared by every rank of a node.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch

from .streams import SUPPORTED_DTYPES, spec_for

__all__ = ["warm", "first_use", "cache_location", "register"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_warm: set = set()  # (bits dtype, profiler) that warm() has run in this process
_used: set = set()  # (operation, bits dtype) whose kernels this process has loaded


def _sample(dtype: torch.dtype) -> torch.Tensor:
    """A small tensor that takes every planning path: dense, masked and all-zero chunks."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * 1e-2
    if dtype in (torch.int8, torch.uint8):
        x = (x * 1e4).round().clamp(-128, 127).to(torch.int8)
        x = x.view(torch.uint8) if dtype == torch.uint8 else x
    else:
        x = x.to(dtype)
    x[1024:2048] = 0
    x[2048:2048 + 1024:3] = 0
    return x


def _kernel_stats():
    from ..kernels import cpu as _cpu

    names = ("plan_chunks", "encode_chunks", "decode_chunks", "decode_accumulate_chunks", "multi_tables",
             "chunk_histograms", "huffman_costs", "package_merge")
    return {n: sum(getattr(_cpu, n).stats.cache_misses.values()) for n in names}


def cache_location() -> str:
    """Return the directory where numba caches the codec's compiled kernels."""
    from ..kernels import cpu as _cpu

    try:
        return _cpu.plan_chunks._cache._cache_path
    except AttributeError:  # pragma: no cover - a numba without this attribute
        return "(numba's cache directory)"


@contextlib.contextmanager
def first_use(operation: str, spec):
    """Around a kernel call: on its first use of this element type in the process, log
    a compile (INFO, with its duration) or a cache load (DEBUG); later uses cost a set
    lookup."""
    key = (operation, spec.bits_dtype)
    if key in _used:
        yield
        return
    before = _kernel_stats()
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    _used.add(key)
    compiled = [n for n, v in _kernel_stats().items() if v > before[n]]
    width = f"{spec.itemsize}-byte" + (" float" if spec.rotate else " integer")
    if compiled:
        log.info("%s of %s compiled comm_codec's %s kernels (%s) in %.1f s, once: numba caches them in %s "
                 "(`comm-codec warmup` or Codec.warmup() does this ahead of time)", operation, spec.name, width,
                 ", ".join(compiled), seconds, cache_location())
    else:
        log.debug("%s of %s loaded comm_codec's %s kernels from numba's cache in %.2f s", operation, spec.name,
                  width, seconds)


def warm(codec, dtypes=None, profiler: bool = False) -> dict:
    """Load (compiling if the cache lacks them) the kernels that coding these dtypes needs.

    Runs one small encode and decode per dtype with ``codec`` (its books and threads).
    Element types already warm in this process cost next to nothing. A compile is
    logged at INFO once, with its duration; a cache load at DEBUG.

    Args:
        codec: the :class:`comm_codec.Codec` whose books and threads to use.
        dtypes: torch dtypes (or names such as ``"bf16"``); None: every supported dtype.
        profiler: also warm the profiler's kernels (chunk histograms, book building).

    Returns:
        dtype name -> seconds this call spent on it.

    Raises:
        TypeError: an unsupported dtype.
    """
    specs = [spec_for(d) for d in (SUPPORTED_DTYPES if dtypes is None else dtypes)]
    spent = {}
    for spec in specs:
        with _lock:  # two threads' first calls: one compiles, the other waits for it
            start = time.perf_counter()
            if (spec.bits_dtype, profiler) not in _warm and (spec.bits_dtype, True) not in _warm:
                x = _sample(spec.dtype)
                try:
                    frame = codec.encode(x, "gradient")
                    out = codec.decode(frame)
                except ValueError as exc:  # a codebook set without books for this dtype
                    log.debug("warmup: %s skipped (%s)", spec.name, exc)
                    spent[spec.name] = 0.0
                    continue
                if not torch.equal(out.view(torch.uint8), x.reshape(-1).view(torch.uint8)):
                    raise RuntimeError(f"warmup round trip of {spec.name} is not bit-exact")  # pragma: no cover
                if spec.dtype in (torch.bfloat16, torch.float16, torch.float32):  # the all-reduce's decode-and-add
                    codec.decode_accumulate(frame, torch.zeros(x.numel(), dtype=torch.float32))
                if profiler:
                    from ..books.profiler import WarmupProfiler

                    with first_use("profiling", spec):
                        prof = WarmupProfiler(chunk_elems=1024, max_books=2)
                        prof.observe(x, "gradient")
                        prof.build()
                _warm.add((spec.bits_dtype, profiler))
            spent[spec.name] = time.perf_counter() - start
    return spent


def _cmd_warmup(args) -> int:
    from .codec import Codec

    dtypes = None
    if args.dtypes:
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    codec = Codec(threads=1)
    start = time.perf_counter()
    spent = warm(codec, dtypes, profiler=not args.codec_only)
    print(f"{'dtype':<10} {'seconds':>8}")
    for name, seconds in spent.items():
        print(f"{name:<10} {seconds:8.2f}")
    print(f"comm_codec kernels ready in {time.perf_counter() - start:.1f} s; cache: {cache_location()}")
    return 0


def register(sub) -> None:
    """Add the ``warmup`` subcommand to the CLI's subparsers."""
    p = sub.add_parser(
        "warmup", help="compile the codec's kernels into numba's cache (run once after installing)",
        description="Compile the codec's numba kernels for every dtype (or --dtypes) into numba's on-disk "
                    "cache, so that no training process pauses to compile them. Run once per machine "
                    "after installing (and after upgrading numba or comm_codec); set NUMBA_CACHE_DIR to "
                    "put the cache somewhere else (a read-only site-packages falls back to the user's "
                    "cache directory).")
    p.add_argument("--dtypes", metavar="LIST",
                   help="comma-separated dtypes, e.g. bf16,fp32 (default: every supported dtype)")
    p.add_argument("--codec-only", action="store_true",
                   help="skip the profiler's kernels (histograms and book building)")
    p.set_defaults(func=_cmd_warmup)
