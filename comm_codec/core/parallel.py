"""Threads for the kernels: ranges of chunks on a pool of Python threads.

The kernels release the GIL (``nogil``) and each takes a range of chunks, so a frame
is shared among threads by calling one kernel on several ranges at once: the calling
thread takes the first range, pool threads the others. numba's ``parallel=True`` (its
parfor and OpenMP pool) would do the same, but it compiles every such kernel again, and
that compile cost more than the kernel itself: with ranges, one compiled copy of each
kernel per element type serves one thread and many. No OpenMP runtime is loaded
either, so torch's thread count and a later ``fork`` are left alone.

Ranges are contiguous and of equal size (numba's static schedule): chunks are of equal
size, and the decoder's order keeps a book's chunks together in one range.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba

__all__ = ["thread_count", "run_ranges"]

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: start a new pool on first use."""
    global _pool, _pool_size
    _pool, _pool_size = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def thread_count(threads: int | None) -> int:
    """Return the threads a call should use: ``threads``, or numba's setting when None.

    numba's setting is ``numba.get_num_threads()`` once a caller has set it (which starts
    numba's threading layer), else ``NUMBA_NUM_THREADS``; reading it does not start a
    threading layer that nothing here uses.
    """
    if threads is not None:
        return int(threads)
    from numba.np.ufunc import parallel

    if parallel._is_initialized:  # numba keeps no public name for it
        return numba.get_num_threads()
    return numba.config.NUMBA_NUM_THREADS


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < workers:
            # A larger pool replaces a smaller one; the old one's threads finish their work.
            old = _pool
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="comm_codec_kernels")
            _pool_size = workers
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def run_ranges(kernel, n: int, threads: int, make_args) -> None:
    """Call ``kernel(*make_args(lo, hi))`` on ``threads`` equal ranges of 0..n, at once.

    Args:
        kernel: a numba kernel that releases the GIL.
        n: items (chunks) in all.
        threads: ranges to make (at most n); 1 calls the kernel once, on this thread.
        make_args: (lo, hi) -> the kernel's arguments for items lo..hi-1.

    Raises:
        Whatever a call raised (after every call has returned).
    """
    threads = max(1, min(int(threads), n))
    if threads == 1:
        kernel(*make_args(0, n))
        return
    bounds = [n * k // threads for k in range(threads + 1)]
    pool = _get_pool(threads - 1)
    futures = [pool.submit(kernel, *make_args(bounds[k], bounds[k + 1])) for k in range(1, threads)]
    try:
        kernel(*make_args(bounds[0], bounds[1]))
    finally:
        for f in futures:
            f.result()
