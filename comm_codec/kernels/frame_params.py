"""The frame parser's kernel: check a chunk table and lay out the chunks' payloads, in one pass.

:func:`comm_codec.core.frame.get_frame_parameters` checks every chunk-table entry against
the frame's dtype, books and element counts and computes where each chunk's payload
starts. Done with numpy, that is some forty array operations whatever the table's size,
which on a frame of a few chunks costs about as much as decoding it; here it is one loop
over the entries, read straight from the frame's bytes.

Arrays in, results out, never a raise: each check records the first chunk that fails it
(:data:`CHECKS` names them, in the order the Python layer reports them), and the caller
turns the first failure into :class:`~comm_codec.FrameError`. The layout is the frame's
(``comm_codec/core/frame_format.md``); flags are :mod:`.layout`'s.
"""

from __future__ import annotations

import numpy as np

from .jit import entry
from .layout import CHUNK_MASK, CHUNK_RAW0, CHUNK_ZERO, MAX_STREAMS

__all__ = [
    "CHECKS",
    "CHECK_V1_BOOK",
    "CHECK_BOOK_UNCODED",
    "CHECK_FLAGS",
    "CHECK_ZERO_PAYLOAD",
    "CHECK_NO_BOOK",
    "CHECK_SIZE",
    "CHECK_RAW_SIZE",
    "payload_layout",
]

# What each row of ``first`` records: the first chunk that ...
CHECK_V1_BOOK = 0  # names a book in a version-1 frame
CHECK_BOOK_UNCODED = 1  # names a book for a stream it does not code
CHECK_FLAGS = 2  # has unknown chunk flags
CHECK_ZERO_PAYLOAD = 3  # is flagged all-zero but has a mask or payload
CHECK_NO_BOOK = 4  # (per stream) codes a stream the frame names no book for
CHECK_SIZE = 5  # (per stream) has a stream size impossible for its element count
CHECK_RAW_SIZE = 6  # (per stream) has a raw, unmasked stream of another size than its element count
CHECKS = 7


@entry
def payload_layout(
    buf,
    table_pos,
    entry_bytes,
    nchunks,
    nstreams,
    numel,
    chunk_elems,
    stream_books,
    version,
    header_bytes,
    offsets,
    first,
):
    """Check a frame's chunk table and compute each chunk's payload offset.

    Args:
        buf: the frame's bytes (uint8), at least up to the end of the chunk table.
        table_pos: where the chunk table starts in buf.
        entry_bytes: bytes per table entry (``frame.table_dtype(nstreams).itemsize``).
        nchunks, nstreams, numel, chunk_elems: the header's fields (nchunks consistent
            with numel and chunk_elems).
        stream_books: uint8[nstreams], 1 where the frame names a book for the stream.
        version: the frame's version (1: no chunk may name a book of a group).
        header_bytes: where the payload starts.
        offsets: int64[nchunks] output: where chunk c's payload starts.
        first: int64[CHECKS, MAX_STREAMS] output: ``first[k, s]`` is the first chunk that
            fails check k for stream s (column 0 for the checks that are not per
            stream), or nchunks if none does.

    Returns:
        The frame length the table describes (header plus payloads), or -1 when the
        arguments themselves are out of range (nothing checked).
    """
    if (
        nstreams < 1
        or nstreams > MAX_STREAMS
        or stream_books.size != nstreams
        or offsets.size != nchunks
        or first.shape[0] != CHECKS
        or first.shape[1] != MAX_STREAMS
        or entry_bytes < 8 + 4 * nstreams
        or table_pos < 0
        or table_pos + nchunks * entry_bytes > buf.size
        or chunk_elems < 1
        or nchunks < 0
    ):
        return np.int64(-1)
    first[:, :] = nchunks
    known = CHUNK_MASK | CHUNK_ZERO
    coded_nibbles = np.int64(0)
    for s in range(nstreams):
        known |= CHUNK_RAW0 << s
        coded_nibbles |= np.int64(0xF) << (4 * s)
    pos = np.int64(header_bytes)
    for c in range(nchunks):
        p = table_pos + c * entry_bytes
        flags = np.int64(buf[p])
        books = np.int64(buf[p + 2]) | (np.int64(buf[p + 3]) << 8)
        count = np.int64(chunk_elems) if c < nchunks - 1 else np.int64(numel) - (nchunks - 1) * np.int64(chunk_elems)
        zero = (flags & CHUNK_ZERO) != 0
        masked = (flags & CHUNK_MASK) != 0
        # A chunk names a book only for the streams it codes (not raw, not all-zero).
        allowed = np.int64(0)
        if not zero:
            for s in range(nstreams):
                if (flags & (CHUNK_RAW0 << s)) == 0:
                    allowed |= np.int64(0xF) << (4 * s)
        if version == 1 and books != 0 and first[CHECK_V1_BOOK, 0] == nchunks:
            first[CHECK_V1_BOOK, 0] = c
        if (books & ~(allowed & coded_nibbles)) != 0 and first[CHECK_BOOK_UNCODED, 0] == nchunks:
            first[CHECK_BOOK_UNCODED, 0] = c
        if (flags & ~known) != 0 and first[CHECK_FLAGS, 0] == nchunks:
            first[CHECK_FLAGS, 0] = c
        length = ((count + 7) // 8 + 7) & ~7 if masked else np.int64(0)
        total_size = np.int64(0)
        for s in range(nstreams):
            q = p + 8 + 4 * s
            size = (
                np.int64(buf[q])
                | (np.int64(buf[q + 1]) << 8)
                | (np.int64(buf[q + 2]) << 16)
                | (np.int64(buf[q + 3]) << 24)
            )
            total_size += size
            length += (size + 7) & ~7
            raw = (flags & (CHUNK_RAW0 << s)) != 0
            if stream_books[s] == 0 and not raw and not zero and first[CHECK_NO_BOOK, s] == nchunks:
                first[CHECK_NO_BOOK, s] = c
            # A raw stream holds one byte per element present; a coded one at most 20 bits.
            limit = count if raw else (count * 20 + 7) // 8
            if size > limit and first[CHECK_SIZE, s] == nchunks:
                first[CHECK_SIZE, s] = c
            if raw and not masked and not zero and size != count and first[CHECK_RAW_SIZE, s] == nchunks:
                first[CHECK_RAW_SIZE, s] = c
        if zero and (masked or total_size != 0) and first[CHECK_ZERO_PAYLOAD, 0] == nchunks:
            first[CHECK_ZERO_PAYLOAD, 0] = c
        offsets[c] = pos
        pos += length
    return pos
