"""Memory around the kernels: recycled output blocks, huge pages, and torch's thread count kept.

The kernels (:mod:`comm_codec.kernels`) take numpy arrays; the codec hands them the
memory of torch tensors. :func:`empty_output` allocates those outputs (:func:`empty_bytes`
the same for numpy callers), and :func:`torch_threads_kept` wraps every parallel kernel
call. torch is imported only by the functions that make tensors.
"""

import contextlib
import logging
import os
import sys
import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only: torch is imported where a tensor is first used
    import torch

__all__ = ["torch_threads_kept", "OutputPool", "output_pool", "empty_output", "empty_bytes", "front", "POOL_MIN_BYTES"]


@contextlib.contextmanager
def torch_threads_kept():
    """Run parallel kernels without changing torch's thread count.

    numba's OpenMP layer sets the calling thread's OpenMP thread count when a parallel
    kernel runs, and torch reads the same setting: a rank pinned with
    torch.set_num_threads(1) would silently go back to all cores (several ranks on a
    few cores then oversubscribe them). In a process without torch there is nothing to keep.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux
# Fresh blocks from this size get huge pages: glibc's largest mmap threshold (64-bit),
# above which every allocation is a fresh mapping. Smaller ones may come from glibc's
# heap, where advised pages are split and collapsed again as the heap moves.
_HUGE_MIN_BYTES = 32 << 20
# Outputs from this size live in recycled blocks (see OutputPool); smaller ones come
# from glibc's heap, already populated.
POOL_MIN_BYTES = 1 << 20


def _libc_madvise():
    try:
        import ctypes
        import ctypes.util

        if not sys.platform.startswith("linux"):
            return None
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):  # pragma: no cover - no libc: plain pages
        return None


_madvise = _libc_madvise()


_ALIGN = 64  # a cache line: the decoder streams whole lines into aligned outputs


def _fresh_block(nbytes: int) -> np.ndarray:
    """A new uint8 block, 64-byte aligned, its whole huge pages advised when it is a fresh mapping."""
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    block = raw[skip : skip + nbytes]
    if _madvise is not None and nbytes >= _HUGE_MIN_BYTES:
        ptr = block.ctypes.data
        lo = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE
        hi = (ptr + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if hi > lo:
            _madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: a failure changes nothing
    return block


class OutputPool:
    """Memory blocks that earlier outputs lived in, kept for the next output of about their size.

    A frame or a decoded tensor of a few MiB or more would be fresh memory on every
    call, populated page by page on its first write, which costs the kernel several
    times what writing memory that was written before costs. An output is a view of a
    block; when the last tensor using it is gone, a finalizer gives the block back
    here, and the next output that fits (up to 1.5x its size) takes it. Free blocks are
    kept up to ``limit`` bytes, oldest dropped first (``COMM_CODEC_OUTPUT_POOL_MB``,
    default 512; 0 turns the pool off).
    """

    def __init__(self, limit: int):
        self.limit = int(limit)
        self._free: list = []  # oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A block of at least nbytes: the smallest free one that fits, else a fresh one."""
        with self._lock:
            best = -1
            for i, block in enumerate(self._free):
                if nbytes <= block.size <= nbytes + nbytes // 2 and (best < 0 or block.size < self._free[best].size):
                    best = i
            if best >= 0:
                block = self._free.pop(best)
                self._bytes -= block.size
                return block
        return _fresh_block(nbytes)

    def give(self, block: np.ndarray) -> None:
        """Keep a block that no output uses any more (finalizer callback: any thread)."""
        if block.size > self.limit:
            return
        with self._lock:
            while self._free and self._bytes + block.size > self.limit:
                self._bytes -= self._free.pop(0).size
            self._free.append(block)
            self._bytes += block.size

    def clear(self) -> None:
        """Drop every free block (their memory goes back to the allocator)."""
        with self._lock:
            self._free.clear()
            self._bytes = 0

    @property
    def free_bytes(self) -> int:
        """Bytes held in free blocks, waiting for an output."""
        return self._bytes

    def reset_after_fork(self) -> None:
        """Give a forked child a fresh lock: another thread may have held it at the fork."""
        self._lock = threading.Lock()


def _pool_limit() -> int:
    raw = os.environ.get("COMM_CODEC_OUTPUT_POOL_MB", "512")
    try:
        return max(0, int(raw)) << 20
    except ValueError:
        logging.getLogger(__name__).warning("COMM_CODEC_OUTPUT_POOL_MB=%r is not an integer; using 512", raw)
        return 512 << 20


output_pool = OutputPool(_pool_limit())
if hasattr(os, "register_at_fork"):  # a fork while another thread held the lock must not deadlock the child
    os.register_at_fork(after_in_child=output_pool.reset_after_fork)


def empty_bytes(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 array for a kernel to fill: recycled memory when it is large.

    The numpy counterpart of :func:`empty_output` (same pool, same rule): arrays of
    :data:`POOL_MIN_BYTES` or more are views of pooled blocks, which go back to the pool
    once the last array on them is gone.

    Args:
        nbytes: size in bytes.

    Returns:
        A 1-D contiguous uint8 array of ``nbytes`` bytes.
    """
    nbytes = int(nbytes)
    if nbytes < POOL_MIN_BYTES or output_pool.limit == 0:
        return np.empty(nbytes, dtype=np.uint8)
    block = output_pool.take(nbytes)
    view = block[:nbytes]
    weakref.finalize(view, output_pool.give, block).atexit = False
    return view


def front(array: np.ndarray, nbytes: int) -> np.ndarray:
    """The first nbytes of an array from :func:`empty_bytes`, holding its memory as it did.

    A slice's ``base`` is the block itself, not the array whose finalizer returns the
    block to the pool, so a plain slice would let the block go back (and be written by
    the next output) while the slice is still in use. This one keeps the array alive
    for as long as the slice is.

    Args:
        array: a 1-D uint8 array from :func:`empty_bytes`.
        nbytes: how many of its bytes, at most its size.

    Returns:
        A view of ``array[:nbytes]``.
    """
    out = array[:nbytes]
    if array.base is not None:  # a pooled view (an array of its own needs nothing)
        weakref.finalize(out, _keep, array).atexit = False
    return out


def _keep(_array) -> None:
    """Nothing: the finalizer's reference to its argument is what keeps an array alive."""


def empty_output(numel: int, dtype) -> "torch.Tensor":
    """An uninitialized 1-D CPU tensor for a kernel to fill: recycled memory when it is large.

    Outputs of 1 MiB or more are views of blocks from :data:`output_pool`: memory that an
    earlier output was written into, so the kernel does not pay for populating fresh
    pages (see :class:`OutputPool`). Fresh blocks of 32 MiB or more ask for transparent
    huge pages (``madvise(MADV_HUGEPAGE)`` on their 2 MiB-aligned interior, before the
    first touch): first writes to 4 KiB pages take a page fault every 4 KiB. Smaller
    outputs are plain ``torch.empty``. Like any numpy-backed tensor, a pooled output's
    storage cannot grow (``resize_`` to a larger size raises); everything else is as
    for ``torch.empty``.

    Args:
        numel: number of elements.
        dtype: element type.

    Returns:
        A 1-D contiguous CPU tensor of ``numel`` elements.
    """
    import torch

    itemsize = torch.empty(0, dtype=dtype).element_size()
    nbytes = int(numel) * itemsize
    if nbytes < POOL_MIN_BYTES or output_pool.limit == 0:
        return torch.empty(numel, dtype=dtype)
    block = output_pool.take(nbytes)
    view = block[:nbytes]
    # The tensor holds the view (torch.from_numpy keeps it alive); when the last tensor
    # on that memory is gone, the view goes, and the block returns to the pool.
    weakref.finalize(view, output_pool.give, block).atexit = False
    return torch.from_numpy(view).view(dtype)
