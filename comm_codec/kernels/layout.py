"""What every kernel agrees on: statuses, chunk flags, lanes, checksums and the element bit layout.

The CPU kernels (:mod:`.encode`, :mod:`.lanes`, :mod:`.decode`, :mod:`.histogram`,
:mod:`.plan`), the GPU kernels (:mod:`.cuda`) and the Python layer above
(:mod:`comm_codec.core.streams`, :mod:`comm_codec.core.frame`) all take these from here,
so a frame written by one is read by the others by construction. numpy only, so
constants (statuses, flags) are read without compiling anything.

**Element bits.** A tensor's elements reach the kernels as an integer array whose *type*
carries the layout: uint8/uint16/uint32 for IEEE types, whose bits are rotated left by
one (the sign to bit 0) before being cut into bytes, and int8 for the 1-byte integer
types, not rotated. Stream s is byte s of the (rotated) element, most significant first;
stream 0 of a float type holds the exponent ``exp_shift`` bits up, and is coded relative
to the chunk's reference exponent (:func:`chunk_ref`): its symbol is ``(byte - (ref <<
exp_shift)) mod 256``. :mod:`comm_codec.kernels.symbols` computes the symbols.

**Coded segments** hold :data:`LANES` independent bit streams ("lanes") over consecutive
quarters of the chunk's (present) elements, preceded by their u32 byte lengths
(:data:`LANE_HEADER` bytes); each lane is padded to 8 bytes. A split stream 0 (frame
version 3) ends its coded segment in a plane of each symbol's low bits
(:mod:`comm_codec.kernels.plane`).

**Statuses.** Kernels never raise: each chunk (or call) reports one of the ``STATUS_*``
codes, and the Python layer turns them into exceptions with :data:`STATUS_MESSAGES`.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "MAX_STREAMS",
    "CHUNK_MASK",
    "CHUNK_ZERO",
    "CHUNK_RAW0",
    "LANES",
    "LANE_HEADER",
    "MIN_SAVING_SHIFT",
    "DEC_BITS",
    "DEC_ENTRIES",
    "HASH_MUL",
    "HASH_SEED",
    "HASH_STATE",
    "STATUS_OK",
    "STATUS_CHECKSUM",
    "STATUS_BAD_CODE",
    "STATUS_OVERRUN",
    "STATUS_MASK_COUNT",
    "STATUS_SIZE",
    "STATUS_BOOK",
    "STATUS_BAD_ARGS",
    "STATUS_MESSAGES",
    "UNSIGNED_BITS",
    "bits_dtype",
]

MAX_STREAMS = 4  # one stream per byte of the widest element (fp32)

# Chunk flags (the chunk table's cflags byte).
CHUNK_MASK = 0x01  # all-zero elements are left out of the streams, marked in a bitmap
CHUNK_ZERO = 0x02  # every element is all-zero bits: no payload
CHUNK_RAW0 = 0x10  # CHUNK_RAW0 << s: stream s is stored uncoded

LANES = 4
LANE_HEADER = 4 * LANES  # u32 byte length of each lane

# A chunk's stream 0 is coded wherever its segment is smaller than its raw bytes; a later
# stream only where its segment is at least 1/2**MIN_SAVING_SHIFT smaller: that is,
# for a chunk of n present elements, stream s > 0 is raw unless its segment holds at most
# ``n - max(1, n >> MIN_SAVING_SHIFT)`` bytes (every encoder, CPU and GPU, and the
# checkpoint planner's pricing decide so). A later stream is a mantissa byte (or fp16's
# low byte) with 7-9-bit codes, one symbol a table lookup: decoding it costs about 1 ns a
# symbol more than copying it, twice the decode time of a frame whose streams are raw but
# the exponent's. EfficientNet-Lite0's fp32 weights coded their lowest byte in 205 of 287
# chunks for 0.6 % of the frame: from 1/32, 72 chunks keep 71 % of those bytes.
# numba freezes it into the cached CPU kernels of encode.py and plan.py, whose cache
# is keyed on their own files: a change here must come with a change to each of them.
MIN_SAVING_SHIFT = 5

DEC_BITS = 12  # a decode table is indexed by the next 12 bits of a lane
DEC_ENTRIES = 1 << DEC_BITS

# The payload checksum's multiply-xor chains (see symbols.hash_words).
HASH_MUL = np.uint64(0x9E3779B97F4A7C15)
HASH_SEED = np.uint64(0xCBF29CE484222325)
# A chunk checksum's state while it is taken piecewise (symbols.hash_start): the four
# chains, then the next word and the end of the whole quads to hash (word indices).
HASH_STATE = 6

STATUS_OK = 0
STATUS_CHECKSUM = 1
STATUS_BAD_CODE = 2
STATUS_OVERRUN = 3
STATUS_MASK_COUNT = 4
STATUS_SIZE = 5
STATUS_BOOK = 6
STATUS_BAD_ARGS = 7  # the planner's kernels (one status per call): arguments out of range
STATUS_MESSAGES = {
    STATUS_CHECKSUM: "payload checksum mismatch (corrupted data)",
    STATUS_BAD_CODE: "bit pattern that is no code of its codebook (corrupted data or wrong codebook)",
    STATUS_OVERRUN: "coded stream is shorter than its symbols need (truncated or corrupted)",
    STATUS_MASK_COUNT: "zero mask does not match the stream sizes (corrupted data)",
    STATUS_SIZE: "stream size does not match its element count (corrupted data)",
    STATUS_BOOK: "names a book that its stream's group does not hold (corrupted data)",
    STATUS_BAD_ARGS: "arguments out of range (a piece outside the bits, a stream out of range, a step < 1 "
    "or shapes that disagree)",
}

# Element bits of a rotated (IEEE) type, by element width in bytes.
UNSIGNED_BITS = {1: np.dtype(np.uint8), 2: np.dtype(np.uint16), 4: np.dtype(np.uint32)}


def bits_dtype(itemsize: int, rotate: bool) -> np.dtype:
    """Return the array type that the kernels read an element type's bits as.

    Unsigned for rotated (IEEE) types, int8 for the 1-byte integer types: the kernels
    read the layout from the array type, so each gets compiled code of its own.
    """
    return UNSIGNED_BITS[itemsize] if rotate else np.dtype(np.int8)
