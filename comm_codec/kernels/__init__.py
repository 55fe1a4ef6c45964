"""The compute kernels: numba on the CPU and, where available, numba.cuda on the GPU.

Leaves of the package: they import numpy, numba and each other, nothing else.

* :mod:`.jit` — numba's flags in one place, and which kernels compiled;
* :mod:`.layout` — what every kernel agrees on: statuses, chunk flags, lanes, checksum
  constants, the element bit layout (numpy only);
* :mod:`.symbols` — element bits to stream symbols, the chunk reference, the checksum;
* :mod:`.intrinsics` — prefetch hints, unaligned loads and stores;
* :mod:`.plane` — the raw bits of a split exponent stream (fp16, fp8);
* :mod:`.encode` — plan and write chunks; :mod:`.lanes`, :mod:`.assemble` and
  :mod:`.decode` — read them back (and decode-and-add into float32);
* :mod:`.histogram` — symbol histograms and Huffman cost arithmetic for book fitting;
* :mod:`.plan` — the checkpoint planner's sampled byte histograms;
* :mod:`.frame_params` — the frame parser's chunk-table checks and payload layout;
* :mod:`.cuda` — the same frames on a GPU (imported only by the GPU host driver).

Kernels never raise on bad data; they bound-check and report a status per chunk
(:data:`.layout.STATUS_MESSAGES`), and the Python layer (:mod:`comm_codec.core.codec`)
turns statuses into :class:`comm_codec.FrameError`.
"""
