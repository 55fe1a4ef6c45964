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

A compile is a wait the caller did not ask for: :mod:`comm_codec.core.precompile` says so
before it waits (numba's compile events).
"""

from __future__ import annotations

try:
    import numba
except ValueError as _exc:  # numba's own check of its environment, e.g. NUMBA_NUM_THREADS=0
    raise ValueError(
        f"numba cannot start: {_exc} (check the NUMBA_* environment variables: "
        "NUMBA_NUM_THREADS must be a positive integer, or unset)"
    ) from None

__all__ = ["FLAGS", "OVERLOAD_OPTIONS", "CACHING", "jit", "inline", "entry", "compile_counts", "cache_location"]


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
