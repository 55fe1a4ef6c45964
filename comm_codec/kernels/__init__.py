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
