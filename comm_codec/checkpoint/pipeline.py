"""Segments coded on worker threads, in order, within a budget of bytes in flight.

Used by the exact format (:mod:`.exact`): :func:`ordered_map` runs a function over
segments on a thread pool and yields the results in order; a :class:`Budget` bounds the
bytes the segments in flight hold (being coded, waiting to be written or hashed), whatever
the number of threads; :func:`batched` hands small segments over several at a time;
:class:`Buffers` recycles the buffers restored segments land in.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

__all__ = ["Budget", "Buffers", "batched", "ordered_map", "unbatched"]


class Budget:
    """Bytes in flight, bounded: taken before a segment is handed out, given back once its
    bytes are written and hashed (thread-safe)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._cv = threading.Condition()

    def take(self, n: int, block: bool) -> bool:
        """Take n bytes; False (when not ``block``) if that would pass the limit. With nothing
        taken, any size is granted, so one segment larger than the limit still runs alone."""
        with self._cv:
            while self.used and self.used + n > self.limit:
                if not block:
                    return False
                self._cv.wait()
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._cv:
            self.used -= n
            self._cv.notify_all()


def ordered_map(fn, jobs, threads: int, budget: Budget, cost, inline: bool | None = None, idle=None):
    """Yield (job, fn(job)) in job order, running up to ``threads`` jobs at once.

    A job is started only once ``budget.take(cost(job))`` grants it; the consumer gives
    ``cost(job)`` back when done with the result (for a digest computed on another thread,
    once hashed), so memory stays within the budget at any number of threads. At most
    ``2 * threads + 2`` jobs are in flight. ``inline`` (default: one thread) runs every
    job on the caller's thread; otherwise ``threads`` workers run them, so even one
    worker runs beside a consumer that has work of its own. The numba kernels and zstd
    release the GIL. ``idle()``, when given, is called while the next result is not
    ready, for as long as it returns True (work of the consumer's own that can wait:
    the restore's digest), before waiting for the result.
    """
    if inline is None:
        inline = threads == 1
    if inline:
        for job in jobs:
            budget.take(cost(job), block=True)
            yield job, fn(job)
        return
    pending = collections.deque()
    it = iter(jobs)
    held = []  # a job the budget did not grant yet
    ex = ThreadPoolExecutor(threads, thread_name_prefix="comm_codec-ckpt")

    def admit():
        while len(pending) < 2 * threads + 2:
            job = held.pop() if held else next(it, None)
            if job is None:
                return
            # Wait for the budget only with nothing running (the digest thread gives back).
            if not budget.take(cost(job), block=not pending):
                held.append(job)
                return
            pending.append((job, ex.submit(fn, job)))

    try:
        admit()
        while pending:
            job, fut = pending.popleft()
            while idle is not None and not fut.done() and idle():
                pass
            result = fut.result()
            yield job, result
            admit()
    finally:
        ex.shutdown(wait=True, cancel_futures=True)


def batched(jobs, least: int, most: int, length=lambda job: job.length):
    """Yield consecutive jobs in lists, for :func:`ordered_map` to hand to a worker together.

    A list is closed once it holds ``least`` source bytes or ``most`` jobs; the last one may
    hold less. Every hand-over wakes a worker and then the consumer, which costs more than
    coding a small tensor.

    Args:
        jobs: the jobs, in order.
        least: source bytes a list holds at least (0: one job a list).
        most: jobs a list holds at most (bounding its budget where each job holds a buffer).
        length: a job's source bytes.

    Yields:
        Lists of consecutive jobs, every job once, in order.
    """
    batch, size = [], 0
    for job in jobs:
        batch.append(job)
        size += length(job)
        if size >= least or len(batch) >= most:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def unbatched(work):
    """Undo :func:`batched` on the results of :func:`ordered_map`.

    Args:
        work: (list of jobs, list of their results) pairs, as :func:`ordered_map` yields
            them for a function over :func:`batched` lists.

    Yields:
        (job, result) for each job, in order.
    """
    for batch, results in work:
        yield from zip(batch, results)


class Buffers:
    """Reused buffers for decoded segments (thread-safe).

    A fresh ``np.empty`` per segment is a fresh mapping: its pages fault in on first
    write and are unmapped again once hashed, and unmapping in a process with several
    threads costs a TLB shootdown on every core (a VM exit each under virtualization), so
    with threads the kernel time of page faults and unmaps can exceed the decoding.
    A buffer goes back once its bytes are written and hashed; at most the segments in
    flight plus those waiting for the digest are out (a :class:`Budget` bounds them), and
    the buffers kept for reuse are bounded by ``keep`` bytes.
    """

    def __init__(self, keep: int, least: int):
        self._free: list = []
        self._free_bytes = 0
        self._keep, self._least = keep, least
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """Return a uint8 array of at least nbytes (at least ``least``): a free one that fits (the
        last one given back when any would do, else the smallest that fits), or a new one."""
        with self._lock:
            # Most requests fit any buffer (segments and their coded bytes are at most
            # ``least``): the last one given back, still warm in cache.
            best = len(self._free) - 1 if nbytes <= self._least else -1
            if best < 0:
                for i, buf in enumerate(self._free):
                    if buf.size >= nbytes and (best < 0 or buf.size < self._free[best].size):
                        best = i
            if best >= 0:
                buf = self._free.pop(best)
                self._free_bytes -= buf.size
                return buf
        return np.empty(max(nbytes, self._least), dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self._lock:
            if self._free_bytes + buf.size <= self._keep:
                self._free.append(buf)
                self._free_bytes += buf.size
