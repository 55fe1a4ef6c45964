"""Private compute kernels: ``cpu`` (numba njit) and, where available, ``cuda`` (numba.cuda).

Kernels never raise on bad data; they bound-check and report a status per chunk, and the
Python layer (:mod:`comm_codec.codec`) turns statuses into :class:`comm_codec.FrameError`.
"""
