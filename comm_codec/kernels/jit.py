"""How the CPU kernels are compiled: numba's flags in one place, and what was compiled.

Every CPU kernel is decorated with one of the three decorators below, so that the flags
are the same everywhere: machine code is cached on disk across processes
(``cache=True``), kernels release the GIL (``nogil``), and ``fastmath`` stays off (the
kernels do integer work, and bit-exactness is the point). None is compiled with
``parallel=True``: the kernels that threads share take a range of chunks, and the
Python layer runs ranges on its own threads (:mod:`comm_codec.core.parallel`), so that
one compiled copy serves one thread and many. numba compiles each entry point with
every helper it calls linked in and optimized again, so the entry points are few: one
decode kernel, the one-call frame encoder, and the threaded encoder's two passes.

Without a writable cache (a read-only install, HOME not writable, a bad
``NUMBA_CACHE_DIR``) numba refuses ``cache=True`` outright; then :data:`CACHING` is False,
the kernels are compiled in memory by every process (:mod:`comm_codec.core.precompile`
says so once).

The entry points (the kernels that the layer above calls) are registered here, so that
:func:`compile_counts` can tell a compile from a cache load, and :func:`cache_location`
where numba keeps them.

A compile is a wait the caller did not ask for: when one of this package's kernels is
still compiling :data:`NOTICE_AFTER` seconds after it started, one WARNING line (logger
``comm_codec.compile``, which a default Python setup prints to stderr) says what compiles,
why, how long it usually takes and how to avoid it, once per element type and process;
every path (codec, command line, hooks, DeepSpeed, DCP) gets it, because it listens to
numba's own compile events rather than wrapping call sites.
"""

from __future__ import annotations

import logging
import threading
import time

try:
    import numba
except ValueError as _exc:  # numba's own check of its environment, e.g. NUMBA_NUM_THREADS=0
    raise ValueError(f"numba cannot start: {_exc} (check the NUMBA_* environment variables: "
                     "NUMBA_NUM_THREADS must be a positive integer, or unset)") from None

from numba.core import event as _event

__all__ = ["FLAGS", "OVERLOAD_OPTIONS", "CACHING", "NOTICE_AFTER", "jit", "inline", "entry", "compile_counts",
           "cache_location"]

_log = logging.getLogger("comm_codec.compile")

def _caching_works() -> bool:
    """Whether numba can cache functions of this package (a writable cache location exists).

    numba looks for one (NUMBA_CACHE_DIR, ``__pycache__`` beside the module, the user's
    cache directory) when a ``cache=True`` function is decorated, and raises if none is
    writable. The kernels live beside this module, so one probe here answers for all.
    """
    def probe():  # pragma: no cover - never called, only decorated
        return 0

    try:
        numba.njit(cache=True)(probe)
    except RuntimeError:
        return False
    return True


# Whether compiled kernels are cached on disk (False: compiled in memory, per process).
CACHING = _caching_works()

FLAGS = dict(nogil=True, cache=CACHING)
OVERLOAD_OPTIONS = dict(cache=CACHING)  # jit_options of numba.extending.overload

_ENTRY_POINTS: dict = {}  # name -> dispatcher


def jit(fn):
    """Compile a helper that kernels call."""
    return numba.njit(**FLAGS)(fn)


def inline(fn):
    """Compile a helper that is inlined into every kernel that calls it (numba IR inlining)."""
    return numba.njit(inline="always", **FLAGS)(fn)


def entry(fn):
    """Compile a kernel that the Python layer calls, and register it."""
    dispatcher = numba.njit(**FLAGS)(fn)
    _ENTRY_POINTS[fn.__name__] = dispatcher
    return dispatcher


def compile_counts() -> dict:
    """Return, for every registered entry point, how many signatures this process compiled.

    A kernel loaded from numba's on-disk cache counts nothing; compare two calls to see
    whether the code between them compiled. Only the kernel modules imported so far are
    registered (each registers its entry points when it is imported).
    """
    return {name: sum(k.stats.cache_misses.values()) for name, k in _ENTRY_POINTS.items()}


def cache_location() -> str:
    """Return the directory where numba caches the compiled kernels."""
    if not CACHING:
        return "nowhere (no writable cache directory: set NUMBA_CACHE_DIR)"
    for dispatcher in _ENTRY_POINTS.values():
        try:
            return dispatcher._cache._cache_path  # numba keeps no public name for it
        except AttributeError:  # pragma: no cover - a numba without this attribute
            break
    return "(numba's cache directory)"


# A compile still running after this many seconds gets its line (see the module's docstring).
NOTICE_AFTER = 1.0
# Compiles closer than this to the previous one's end belong to the same wait (one first
# use compiles several kernels one after the other): no second line for them.
_SAME_WAIT = 20.0
# What a first use of one element type compiles (encode and decode), measured with an
# empty cache on a loaded 2-core machine: the line's "usually".
USUAL_SECONDS = "10-30 s"
_PACKAGE = __name__.split(".")[0] + "."
_ELEMENTS = {"uint16": "bf16/fp16", "uint32": "fp32", "uint8": "fp8", "int8": "int8/uint8"}


def _element_type(args) -> str:
    """The element type a compile is for, as the notice names it: its first element array's."""
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
        timer = threading.Timer(NOTICE_AFTER, self._say, (disp.py_func.__name__, _element_type(ev.data["args"])))
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
        if CACHING:
            why, after = "first use on this machine (not in numba's cache)", f"then cached in {cache_location()}"
        else:
            why, after = "no writable cache (set NUMBA_CACHE_DIR)", "compiled again by every process"
        _log.warning("comm_codec is compiling its numba kernels (%s for %s), %s: usually %s per element type on "
                     "2 cores, %s; run `comm-codec precompile` once after installing (or Codec.precompile()) to do "
                     "this ahead of time", name, what, why, USUAL_SECONDS, after)


_event.register("numba:compile", _CompileNotice())
