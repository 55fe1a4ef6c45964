"""Compile (or load from numba's cache) the codec's kernels before they are timed.

numba compiles a kernel on its first call for each element type (bf16 and fp16 share
one, fp32 has its own, the 1-byte floats another, int8/uint8 the last) and caches the
machine code on disk. Compiling one element type's encode and decode kernels takes tens
of seconds, and every process of a fresh install that codes pays it at once (two ranks
compile the same kernels side by side); loading them back from the cache takes a
fraction of a second. So:

* :func:`precompile` (run once after installing, from the command line) fills the
  cache for every element type;
* :meth:`comm_codec.Codec.precompile` does the same inside a process, for the dtypes
  it will code, so that a caller can keep compile or cache-load time out of its first
  measured encode and decode (the DDP hook's ``encode_seconds``);
* whichever call compiles first logs it once, with its duration (:func:`first_use`).

Where the cache goes: numba writes beside the package (``__pycache__``) when it can, and
otherwise (a read-only site-packages) under the user's cache directory; set
``NUMBA_CACHE_DIR`` to choose one, e.g. a directory shared by every rank of a node. With
none writable the kernels are compiled in memory, in every process; importing this module
says so once (a warning).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np

from ..kernels import jit as _jit
from ..kernels.histogram import chunk_histograms, huffman_costs
from .huffman import Codebook
from .streams import SUPPORTED_NAMES, as_bits, is_accumulable, spec_for

__all__ = ["precompile", "is_precompiled", "first_use", "cache_location"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_done: set = set()  # (bits dtype, profiler) that precompile() has run in this process
_used: set = set()  # (operation, bits dtype) whose kernels this process has loaded

if not _jit.CACHING:
    log.warning("numba has no writable cache directory (HOME, the package directory and NUMBA_CACHE_DIR are not "
                "writable): kernels are compiled in memory by every process; set NUMBA_CACHE_DIR to a writable "
                "directory to cache them")


def _sample(dtype) -> "torch.Tensor":
    """A small tensor that takes every planning path: dense, masked and all-zero chunks."""
    import torch

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


def _threads_for_ranges() -> int:
    """Two threads where numba allows them: the threaded paths' kernels (their argument
    types do not depend on the count)."""
    import numba

    return min(2, numba.config.NUMBA_NUM_THREADS)


def cache_location() -> str:
    """Return the directory where numba caches the codec's compiled kernels."""
    return _jit.cache_location()


@contextlib.contextmanager
def first_use(operation: str, spec):
    """Around a kernel call: on its first use of this element type in the process, log
    a compile (INFO, with its duration) or a cache load (DEBUG); later uses cost a set
    lookup.

    Args:
        operation: what the call does ("encode", "decode", ...), as the log line names it.
        spec: the :class:`comm_codec.core.streams.StreamSpec` of the element type.
    """
    key = (operation, spec.bits_dtype)
    if key in _used:
        yield
        return
    before = _jit.compile_counts()
    start = time.perf_counter()
    yield
    seconds = time.perf_counter() - start
    _used.add(key)
    compiled = [n for n, v in _jit.compile_counts().items() if v > before.get(n, 0)]
    width = f"{spec.itemsize}-byte" + (" float" if spec.rotate else " integer")
    if compiled:
        log.info("%s of %s compiled comm_codec's %s kernels (%s) in %.1f s, once: numba caches them in %s "
                 "(Codec.precompile() or the command line's precompile command does this ahead of time)",
                 operation, spec.name, width, ", ".join(compiled), seconds, cache_location())
    else:
        log.debug("%s of %s loaded comm_codec's %s kernels from numba's cache in %.2f s", operation, spec.name,
                  width, seconds)


def _profile_kernels(x) -> None:
    """Run the kernels that book fitting runs, with the argument types it passes them.

    :class:`comm_codec.WarmupProfiler` histograms chunks (chunk_histograms over int64
    stream lists and counts), prices groups of books (huffman_costs on int64 rows) and
    builds books (package-merge, through :meth:`Codebook.from_counts`).
    """
    bits, spec = as_bits(x)
    chunk_elems = 1024
    streams = np.arange(spec.nstreams, dtype=np.int64)
    nchunks = -(-bits.size // chunk_elems)
    counts = np.empty((nchunks, streams.size, 256), dtype=np.int64)
    zeros = np.empty(nchunks, dtype=np.int64)
    chunk_histograms(bits, chunk_elems, spec.exp_shift, streams, counts, zeros)
    rows = np.ascontiguousarray(counts[:, 0])
    huffman_costs(rows, np.zeros(len(rows), dtype=np.int64))
    Codebook.from_counts(rows.sum(axis=0) + 1, raw_threshold=None)


def precompile(codec, dtypes=None, profiler: bool = False) -> dict:
    """Load (compiling if the cache lacks them) the kernels that coding these dtypes needs.

    Runs one small encode and decode per dtype with ``codec`` (its books and threads),
    and a decode-and-add for the float types. Element types already done in this process
    cost next to nothing. A compile is logged at INFO once, with its duration; a cache
    load at DEBUG.

    Args:
        codec: the :class:`comm_codec.Codec` whose books and threads to use.
        dtypes: torch dtypes (or names such as ``"bf16"``); None: every supported dtype.
        profiler: also load the kernels that book fitting runs (chunk histograms,
            Huffman costs, package-merge).

    Returns:
        dtype name -> seconds this call spent on it.

    Raises:
        TypeError: an unsupported dtype.
    """
    import torch

    specs = [spec_for(d) for d in (SUPPORTED_NAMES if dtypes is None else dtypes)]
    spent = {}
    for spec in specs:
        with _lock:  # two threads' first calls: one compiles, the other waits for it
            start = time.perf_counter()
            if (spec.bits_dtype, profiler) not in _done and (spec.bits_dtype, True) not in _done:
                x = _sample(spec.dtype)
                try:
                    frame = codec.encode(x, "gradient")
                    out = codec.decode(frame)
                    # A tensor of one chunk (or any small one, with one thread) is coded by
                    # one kernel, larger ones on threads by the planner and the packer (and
                    # decoded on threads in the book order): load both, whatever the
                    # codec's own thread count (chunks of 1024 make four here).
                    chunked = type(codec)(codec.codebooks, chunk_elems=1024, threads=_threads_for_ranges())
                    single = type(codec)(codec.codebooks, chunk_elems=1024, threads=1)
                    out_chunked = chunked.decode(chunked.encode(x, "gradient"))
                    out_single = single.decode(single.encode(x, "gradient"))
                except ValueError as exc:  # a codebook set without books for this dtype
                    log.debug("precompile: %s skipped (%s)", spec.name, exc)
                    spent[spec.name] = 0.0
                    continue
                want = x.reshape(-1).view(torch.uint8)
                if not all(torch.equal(o.view(torch.uint8), want) for o in (out, out_chunked, out_single)):
                    raise RuntimeError(f"precompile round trip of {spec.name} is not bit-exact")  # pragma: no cover
                if is_accumulable(spec):  # the all-reduce's decode-and-add
                    codec.decode_accumulate(frame, torch.zeros(x.numel(), dtype=torch.float32))
                if profiler:
                    with first_use("profiling", spec):
                        _profile_kernels(x)
                _done.add((spec.bits_dtype, profiler))
            spent[spec.name] = time.perf_counter() - start
    return spent


def is_precompiled(dtype, profiler: bool = False) -> bool:
    """Return whether :func:`precompile` has run for ``dtype``'s element type in this process.

    Args:
        dtype: a torch dtype or a name such as ``"bf16"`` (bf16 and fp16 share kernels).
        profiler: ask about a call that also loaded the book-fitting kernels.

    Raises:
        TypeError: an unsupported dtype.
    """
    bits = spec_for(dtype).bits_dtype
    return (bits, True) in _done or (not profiler and (bits, False) in _done)
