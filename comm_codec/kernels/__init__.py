"""Private compute kernels: ``cpu`` (numba njit) and, where available, ``cuda`` (numba.cuda).

Kernels never raise on bad data; they bound-check and report a status per chunk, and the
Python layer (:mod:`comm_codec.codec`) turns statuses into :class:`comm_codec.FrameError`.
"""

import contextlib

import torch


@contextlib.contextmanager
def torch_threads_kept():
    """Run parallel kernels without changing torch's thread count.

    numba's OpenMP layer sets the calling thread's OpenMP thread count when a parallel
    kernel runs, and torch reads the same setting: a rank pinned with
    torch.set_num_threads(1) would silently go back to all cores (seen: 4 ranks on 2
    cores, DDP steps 5x slower).
    """
    before = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # Linux
# Outputs from this size get huge pages: glibc's largest mmap threshold (64-bit), above
# which every allocation is a fresh mapping. Smaller ones come back from glibc's heap
# already populated, which beats any page size.
_HUGE_MIN_BYTES = 32 << 20


def _libc_madvise():
    try:
        import ctypes
        import ctypes.util
        import sys

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


def empty_output(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor for a kernel to fill, on huge pages when it is large.

    An output of 32 MiB or more is a fresh mapping on every call, populated page by page
    on first write: with 4 KiB pages that ran at 2.4 GB/s on this VM and held decoding
    into new memory to 1.2 GB/s (bf16, 1 thread) against 2.1 GB/s into a reused buffer.
    Asking for transparent huge pages (``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned
    interior, before the first touch) takes it to 2.0 GB/s. Smaller outputs are left to
    the allocator, whose heap reuse is faster still; advising heap memory also made
    some calls 5x slower here (huge pages split and collapsed as the heap moved). Only
    whole huge pages inside the tensor are advised, so no memory is added; where THP is
    off or madvise is missing this is plain ``torch.empty``.

    Args:
        numel: number of elements.
        dtype: element type.

    Returns:
        A 1-D contiguous CPU tensor.
    """
    out = torch.empty(numel, dtype=dtype)
    nbytes = out.numel() * out.element_size()
    if _madvise is not None and nbytes >= _HUGE_MIN_BYTES:
        ptr = out.data_ptr()
        lo = -(-ptr // _HUGE_PAGE) * _HUGE_PAGE
        hi = (ptr + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if hi > lo:
            _madvise(lo, hi - lo, _MADV_HUGEPAGE)  # advice only: a failure changes nothing
    return out
