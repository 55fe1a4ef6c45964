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
* whichever call compiles first logs it once, with its duration (:func:`first_use`);
* and before that, a compile is said before it is waited for: when numba takes its
  compiler lock for one of this package's kernels whose signature is neither loaded nor
  in numba's cache index, one WARNING line (logger ``comm_codec.compile``, which a
  default Python setup prints to stderr) says what compiles, why, how long it usually
  takes and how to avoid it, once per wait. numba's own set-up before its compile event
  takes seconds on a first use, so the line comes at the lock, not at that event (which
  still says, :data:`NOTICE_AFTER` seconds in, a compile the index did not foresee).
  Every path (codec, command line, hooks, DeepSpeed, DCP, the demo) gets it, since it
  listens to numba's own events instead of wrapping call sites.

Where the cache goes: numba writes beside the package (``__pycache__``) when it can, and
otherwise (a read-only site-packages) under the user's cache directory; set
``NUMBA_CACHE_DIR`` to choose one, e.g. a directory shared by every rank of a node. With
none writable the kernels are compiled in memory, in every process; importing this module
says so once (a warning).
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import sys
import threading
import time
from typing import TYPE_CHECKING

import numpy as np

from ..kernels import jit as _jit  # first: it names a bad NUMBA_* setting in its error

# isort: split
from numba.core import event as _event  # after kernels.jit (see above)

from ..kernels.histogram import chunk_histograms, huffman_costs
from ..kernels.premul import premul_sum_bf16
from .huffman import Codebook
from .streams import SUPPORTED_NAMES, as_bits, is_accumulable, spec_for

if TYPE_CHECKING:  # annotations only: torch is imported where a tensor is first used
    import torch

__all__ = ["precompile", "is_precompiled", "first_use", "cache_location", "NOTICE_AFTER"]

log = logging.getLogger(__name__)
_notice_log = logging.getLogger("comm_codec.compile")

_lock = threading.Lock()
_done: set = set()  # (bits dtype, profiler) that precompile() has run in this process
_used: set = set()  # (operation, bits dtype) whose kernels this process has loaded

if not _jit.CACHING:
    log.warning(
        "numba has no writable cache directory (HOME, the package directory and NUMBA_CACHE_DIR are not "
        "writable): kernels are compiled in memory by every process; set NUMBA_CACHE_DIR to a writable "
        "directory to cache them"
    )


def _sample(dtype) -> torch.Tensor:
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
    x[2048 : 2048 + 1024 : 3] = 0
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
        log.info(
            "%s of %s compiled comm_codec's %s kernels (%s) in %.1f s, once: numba caches them in %s "
            "(Codec.precompile() or the command line's precompile command does this ahead of time)",
            operation,
            spec.name,
            width,
            ", ".join(compiled),
            seconds,
            cache_location(),
        )
    else:
        log.debug(
            "%s of %s loaded comm_codec's %s kernels from numba's cache in %.2f s", operation, spec.name, width, seconds
        )


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
                if spec.dtype == torch.bfloat16:  # the DDP hook's plain pair sum
                    one = np.zeros(1, dtype=np.uint16)
                    premul_sum_bf16(one, one.copy(), np.float32(0.5))
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


# A compile that was not foreseen (see _CacheLookup) and is still running after this many
# seconds gets its line (see the module's docstring).
NOTICE_AFTER = 1.0
# Compiles closer than this to the previous one's end belong to the same wait (one first
# use compiles several kernels one after the other): no second line for them.
_SAME_WAIT = 20.0
# What a first use of one element type compiles (encode and decode), measured with an
# empty cache on a loaded 2-core machine: the line's "usually".
USUAL_SECONDS = "10-30 s"
_PACKAGE = __name__.split(".")[0] + "."
_ELEMENTS = {"uint16": "bf16/fp16", "uint32": "fp32", "uint8": "fp8", "int8": "int8/uint8"}


# Kernels that build a book's tables: their arrays are code lengths and tables, not elements.
_TABLE_KERNELS = frozenset({"canonical_tables", "pair_tables", "package_merge", "multi_tables"})


def _element_type(name: str, args) -> str:
    """The element type a compile is for, as the notice names it: its first element array's."""
    if name in _TABLE_KERNELS:
        return "codebook tables"
    for a in args:
        dtype = getattr(a, "dtype", None)
        if dtype is not None and getattr(a, "ndim", 0) == 1 and str(dtype) in _ELEMENTS:
            return _ELEMENTS[str(dtype)]
    return "codebook tables"


class _CompileNotice(_event.Listener):
    """numba's compile events -> one WARNING line for a wait on compiles (see the module's docstring)."""

    def __init__(self):
        self._local = threading.local()
        self._lock = threading.Lock()
        self._said_at = None  # monotonic time of the last line
        self._last_end = float("-inf")  # monotonic time the last compile of ours ended

    def on_start(self, ev):
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth:
            return  # a helper compiled on the way: the outermost compile's timer covers it
        self._local.timer = None
        disp = ev.data.get("dispatcher")
        module = getattr(getattr(disp, "py_func", None), "__module__", "") or ""
        self._local.ours = module.startswith(_PACKAGE)
        if not self._local.ours:
            return
        with self._lock:
            if self._said_at is not None and time.monotonic() - self._last_end < _SAME_WAIT:
                return  # the wait already said
        name = disp.py_func.__name__
        timer = threading.Timer(NOTICE_AFTER, self._say, (name, _element_type(name, ev.data["args"])))
        timer.daemon = True
        self._local.timer = timer
        timer.start()

    def on_end(self, ev):
        self._local.depth = getattr(self._local, "depth", 1) - 1
        if self._local.depth:
            return
        timer = getattr(self._local, "timer", None)
        if timer is not None:
            timer.cancel()
            self._local.timer = None
        if getattr(self._local, "ours", False):
            with self._lock:
                self._last_end = time.monotonic()

    def _say(self, name: str, what: str) -> None:
        with self._lock:
            now = time.monotonic()
            if self._said_at is not None and now - self._last_end < _SAME_WAIT + NOTICE_AFTER:
                return
            self._said_at = now
            # The wait starts now: a compile event that follows (the one foreseen) is part of it.
            self._last_end = max(self._last_end, now)
        if _jit.CACHING:
            why, after = "first use on this machine (not in numba's cache)", f"then cached in {_jit.cache_location()}"
        else:
            why, after = "no writable cache (set NUMBA_CACHE_DIR)", "compiled again by every process"
        _notice_log.warning(
            "comm_codec is compiling its numba kernels (%s for %s), %s: usually %s per element type on "
            "2 cores, %s; run `comm-codec precompile` once after installing (or Codec.precompile()) to do "
            "this ahead of time",
            name,
            what,
            why,
            USUAL_SECONDS,
            after,
        )


def _dispatcher_and_signature(frame):
    """The numba dispatcher and signature whose ``compile`` took the compiler lock, or None.

    numba's compiler-lock event carries no data; the dispatcher's ``compile(sig)`` is a few
    frames up (the lock's ``acquire``, the ``ExitStack`` that enters it). Other holders of
    the lock (cfunc, the CUDA target's helpers) have no such frame and give None.
    """
    from numba.core.dispatcher import Dispatcher

    for _ in range(12):
        if frame is None:
            return None
        if frame.f_code.co_name == "compile":
            disp, sig = frame.f_locals.get("self"), frame.f_locals.get("sig")
            if isinstance(disp, Dispatcher) and sig is not None:
                return disp, sig
        frame = frame.f_back
    return None


def _foreseen_compile(disp, sig) -> bool:
    """Whether calling ``disp`` with ``sig`` will compile: neither in memory nor in numba's
    on-disk cache index (an index numba finds stale, its source changed, counts as empty).

    Reads only the cache's index (a small pickle), as numba does next; the slow part that
    follows it, numba's target set-up, is the wait this lets the line come before.
    """
    from numba.core import sigutils

    try:
        args, _ = sigutils.normalize_signature(sig)
        if disp.overloads.get(tuple(args)) is not None:
            return False
        cache_file = getattr(getattr(disp, "_cache", None), "_cache_file", None)
        if cache_file is None:  # numba's NullCache: no caching, every process compiles
            return True
        return not any(key[0] == sig for key in cache_file._load_index())  # numba keeps no public name for it
    # A numba whose internals differ, or an index it could not read either: leave it to the
    # compile event's timer.
    except (AttributeError, TypeError, ValueError, OSError, EOFError, ImportError, pickle.UnpicklingError):
        return False


class _CacheLookup(_event.Listener):
    """numba's compiler-lock events -> the notice before the wait, when the cache lacks the kernel.

    The lock is taken before numba looks in its cache and sets up its target (seconds on a
    first use in a process), long before its compile event: the kernel's cache index says
    here whether this is a compile or a cache load.
    """

    def __init__(self, notice: _CompileNotice):
        self._notice = notice
        self._local = threading.local()

    def on_start(self, ev):
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth:
            return  # a helper typed inside an outer compile: the outer one decided
        found = _dispatcher_and_signature(sys._getframe(1))
        if found is None:
            return
        disp, sig = found
        module = getattr(getattr(disp, "py_func", None), "__module__", "") or ""
        if module.startswith(_PACKAGE) and _foreseen_compile(disp, sig):
            name = disp.py_func.__name__
            self._notice._say(name, _element_type(name, sig))

    def on_end(self, ev):
        self._local.depth = max(0, getattr(self._local, "depth", 1) - 1)


_NOTICE = _CompileNotice()
_event.register("numba:compile", _NOTICE)
_event.register("numba:compiler_lock", _CacheLookup(_NOTICE))
