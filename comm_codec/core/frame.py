"""The frame: the self-describing byte layout of one coded tensor.

One format serves the wire, files, the CPU and the GPU. Everything is little-endian.
Every section starts on an 8-byte boundary so that kernels can move whole 64-bit words.
The full specification is in ``frame_format.md`` beside this module; the
summary::

    header   magic "CCFR" | version u8 | dtype u8 | nstreams u8 | flags u8
             numel u64 | chunk_elems u32 | nchunks u32              (24 bytes)
             (flags: bit 0 checksums, bit 1 split exponents)
    books    nstreams x u64 book (or book group) id (0 = stream stored raw)
    table    nchunks x entry: cflags u8 | ref u8 | books u16 | checksum u32 | nstreams x size u32
             (entry padded to a multiple of 8 bytes)
    crc      u32 CRC-32 of everything above | u32 zero
    payload  per chunk: [mask bitmap][stream 0][stream 1]..., each padded to 8 bytes

Chunk flags: ``MASK`` (elements whose bits are all zero are left out of the streams and
marked by a 0 in an LSB-first bitmap of the chunk), ``ZERO`` (every element is +0.0: no
payload at all), ``RAW0 << s`` (stream s of this chunk is stored uncoded). ``ref`` is the
chunk's reference exponent: stream-0 symbols are coded as ``(byte - (ref << exp_shift))
mod 256``. ``books`` (version 2) holds, in bits 4s..4s+3, which book of stream s's group
coded the chunk; version 1 frames have 0 there (one book per stream), and a frame is
written as version 1 whenever that holds. Version 3 is every frame with split exponents
(fp16, fp8: stream 0's coded segments code the byte's top bits with a code derived from
the book, and store its low ``spec.split_bits`` bits raw in a plane after the lanes).

The checksum is a 64-bit multiply-xor hash (four interleaved chains) of the chunk's
payload words folded to 32 bits: the 64-bit hash changes under any change confined to one word, the folded value misses such a change with probability 2**-32.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import sys
import zlib

import numpy as np

from ..kernels import frame_params as _fp
from ..kernels.layout import CHUNK_MASK, CHUNK_RAW0, CHUNK_ZERO, MAX_STREAMS
from . import streams as _streams
from .errors import FrameError

__all__ = [
    "FrameError",
    "FrameParameters",
    "MAGIC",
    "VERSION",
    "HEADER_BYTES",
    "MAX_CHUNK_ELEMS",
    "FLAG_CHECKSUM",
    "FLAG_SPLIT",
    "VERSION_SPLIT",
    "CHUNK_MASK",
    "CHUNK_ZERO",
    "CHUNK_RAW0",
    "get_frame_parameters",
    "as_frame_bytes",
    "header_size",
    "table_dtype",
    "pad8",
]

MAGIC = b"CCFR"
# The version of a frame whose chunks name books of groups; version 1 = version 2 with
# every chunk's books field 0 (written so whenever that holds).
VERSION = 2
# The version of every frame with split exponents (FLAG_SPLIT), books or not: a decoder
# that reads versions 1 and 2 only refuses it by its version.
VERSION_SPLIT = 3
READ_VERSIONS = (1, 2, 3)
MAX_CHUNK_ELEMS = 1 << 26
HEADER_BYTES = 24
FLAG_CHECKSUM = 0x01
# Stream 0's coded segments code the exponent alone, the spec's split_bits under it in a
# raw plane after the lanes (fp16 and fp8 only; see frame_format.md).
FLAG_SPLIT = 0x02
_KNOWN_FLAGS = FLAG_CHECKSUM | FLAG_SPLIT
# The chunk flags (CHUNK_MASK, CHUNK_ZERO, CHUNK_RAW0 << s) are the kernels' own
# (comm_codec.kernels.layout), re-exported here with the rest of the format.

# magic, version, dtype code, nstreams, flags, numel, chunk_elems, nchunks (little-endian)
_HEAD_STRUCT = struct.Struct("<4sBBBBQII")
assert _HEAD_STRUCT.size == HEADER_BYTES
_CRC_STRUCT = struct.Struct("<II")  # the header's CRC-32, then 4 zero bytes


def pad8(n):
    """Round a byte count (or an integer array of them) up to a multiple of 8."""
    return (n + 7) & ~7


@functools.cache
def table_dtype(nstreams: int) -> np.dtype:
    """Return the numpy structured dtype of one chunk-table entry."""
    return np.dtype(
        {
            "names": ["cflags", "ref", "books", "checksum", "sizes"],
            "formats": ["u1", "u1", "<u2", "<u4", ("<u4", (nstreams,))],
            "offsets": [0, 1, 2, 4, 8],
            "itemsize": pad8(8 + 4 * nstreams),
        }
    )


def header_size(nstreams: int, nchunks: int) -> int:
    """Return the bytes before the first chunk payload: header, book ids, table, crc."""
    return HEADER_BYTES + 8 * nstreams + nchunks * table_dtype(nstreams).itemsize + 8


@dataclasses.dataclass(frozen=True)
class FrameParameters:
    """What a frame's header says (see :func:`get_frame_parameters`).

    Attributes:
        version: format version.
        spec: the element dtype's stream layout.
        numel: number of elements.
        chunk_elems: elements per chunk (the last may hold fewer).
        nchunks: number of chunks.
        book_ids: the codebook id of each stream ("0"*16 for raw).
        checksums: whether chunk payloads carry checksums.
        split: the low bits of stream 0's byte that its coded segments store in a
            plane (``spec.split_bits`` in a frame with split exponents), or 0.
        header_bytes: bytes before the payload.
        frame_bytes: the frame's total length.
        table: the chunk table (numpy structured array).
        offsets: byte offset of each chunk's payload.
    """

    version: int
    spec: _streams.StreamSpec
    numel: int
    chunk_elems: int
    nchunks: int
    book_ids: tuple
    checksums: bool
    split: int
    header_bytes: int
    frame_bytes: int
    table: np.ndarray
    offsets: np.ndarray

    @property
    def dtype(self):
        return self.spec.dtype


def header_flags(checksums: bool, split: int) -> int:
    """Return the header's flags byte: FLAG_CHECKSUM with checksums, FLAG_SPLIT with split bits."""
    return (FLAG_CHECKSUM if checksums else 0) | (FLAG_SPLIT if split else 0)


def write_header(buf: np.ndarray, spec, numel, chunk_elems, flags, book_ids, table) -> None:
    """Write header, book ids, chunk table and CRC into the start of ``buf`` (uint8).

    The version is :data:`VERSION_SPLIT` with ``FLAG_SPLIT`` in flags, else
    :data:`VERSION` where some chunk names a book, else 1.
    """
    ns = spec.nstreams
    if flags & FLAG_SPLIT:
        version = VERSION_SPLIT
    else:
        version = VERSION if len(table) and np.any(table["books"] != 0) else 1
    _HEAD_STRUCT.pack_into(buf, 0, MAGIC, version, spec.code, ns, flags, numel, chunk_elems, len(table))
    pos = HEADER_BYTES
    buf[pos : pos + 8 * ns] = np.asarray(book_ids, dtype="<u8").view(np.uint8)
    pos += 8 * ns
    tbytes = table.view(np.uint8).reshape(-1)
    buf[pos : pos + tbytes.size] = tbytes
    pos += tbytes.size
    crc = zlib.crc32(buf[:pos])
    _CRC_STRUCT.pack_into(buf, pos, crc, 0)


def _fail(msg: str):
    raise FrameError(msg)


def get_frame_parameters(frame) -> FrameParameters:
    """Parse and check a frame's header and chunk table (not its payload).

    Args:
        frame: the frame, as a 1-D uint8 torch tensor, numpy array, or bytes.

    Returns:
        A :class:`FrameParameters`.

    Raises:
        FrameError: the bytes are not a comm_codec frame (bad magic), are of another
            version, are truncated, or their header fails its CRC or its consistency
            checks; the message says which.
    """
    buf = as_frame_bytes(frame)
    n = buf.size
    if n < HEADER_BYTES:
        _fail(f"frame too short: {n} bytes, a header alone is {HEADER_BYTES}")
    magic, version, code, ns, flags, numel, chunk_elems, nchunks = _HEAD_STRUCT.unpack_from(buf)
    if magic != MAGIC:
        _fail(f"not a comm_codec frame: magic {bytes(buf[:4])!r}, expected {MAGIC!r}")
    if version not in READ_VERSIONS:
        _fail(f"unsupported frame version {version}; this build reads versions " + ", ".join(map(str, READ_VERSIONS)))
    spec = _streams.spec_for_code(code)
    if spec is None:
        _fail(f"unknown dtype code {code} in frame header")
    if ns != spec.nstreams:
        _fail(f"frame says {ns} streams, but {spec.name} has {spec.nstreams}")
    if flags & ~_KNOWN_FLAGS:
        _fail(f"unknown frame flags 0x{flags:02x}")
    split = 0
    if flags & FLAG_SPLIT:
        if not spec.split_bits:
            _fail(f"frame says its {spec.name} exponents are split, but {spec.name} has no bits under its exponent")
        split = spec.split_bits
    if (version == VERSION_SPLIT) != bool(split):
        _fail(
            f"frame version {version} {'with' if split else 'without'} the split-exponent flag: version "
            f"{VERSION_SPLIT} frames, and only they, split exponents"
        )
    if numel and not 0 < chunk_elems <= MAX_CHUNK_ELEMS:
        _fail(f"frame chunk_elems {chunk_elems} is outside 1..{MAX_CHUNK_ELEMS}")
    expected_chunks = -(-numel // chunk_elems) if numel else 0
    if nchunks != expected_chunks:
        _fail(f"frame has {nchunks} chunks, expected {expected_chunks} for {numel} elements")
    hsize = header_size(ns, nchunks)
    if n < hsize:
        _fail(f"frame truncated: {n} bytes, its header and chunk table alone need {hsize}")
    crc_pos = hsize - 8
    crc, pad = _CRC_STRUCT.unpack_from(buf, crc_pos)
    if crc != zlib.crc32(buf[:crc_pos]) or pad != 0:
        _fail("frame header is corrupted (CRC-32 mismatch)")
    ids = struct.unpack_from(f"<{ns}Q", buf, HEADER_BYTES)
    if split and not ids[0]:
        _fail(
            "frame says its exponents are split, but its stream 0 is stored raw (book id 0): an encoder "
            "splits only a coded stream 0"
        )
    tdt = table_dtype(ns)
    table = buf[HEADER_BYTES + 8 * ns : crc_pos].view(tdt)
    offsets, total = _payload_layout(buf, table, spec, numel, chunk_elems, ids, hsize, version)
    if total != n:
        what = "truncated" if total > n else "longer than its chunk table says"
        _fail(f"frame {what}: {n} bytes, the chunk table describes {total}")
    return FrameParameters(
        version=version,
        spec=spec,
        numel=numel,
        chunk_elems=chunk_elems,
        nchunks=nchunks,
        book_ids=_book_ids(ids),
        checksums=bool(flags & FLAG_CHECKSUM),
        split=split,
        header_bytes=hsize,
        frame_bytes=total,
        table=table,
        offsets=offsets,
    )


def chunk_counts(numel: int, chunk_elems: int, nchunks: int) -> np.ndarray:
    """Return the number of elements in each chunk."""
    counts = np.full(nchunks, chunk_elems, dtype=np.int64)
    if nchunks:
        counts[-1] = numel - (nchunks - 1) * chunk_elems
    return counts


def payload_bytes(cflags: np.ndarray, sizes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Return each chunk's payload length: padded mask plus padded streams."""
    mask = np.where(cflags & CHUNK_MASK, pad8((counts + 7) // 8), 0)
    return mask + pad8(sizes.astype(np.int64)).sum(axis=1)


@functools.lru_cache(maxsize=256)
def _book_ids(ids: tuple) -> tuple:
    """The header's book ids (ints) as 16-hex-digit strings; a job's frames name a few tuples."""
    return tuple("%016x" % x for x in ids)


def _stream_books(ids: tuple) -> np.ndarray:
    """uint8[nstreams], 1 where the frame names a book for the stream (the layout kernel's argument)."""
    return np.array([x != 0 for x in ids], dtype=np.uint8)


def _payload_layout(buf, table, spec, numel, chunk_elems, ids, hsize, version):
    """Check the chunk table (one kernel pass) and return the payload offsets and the frame length."""
    ns = spec.nstreams
    nchunks = len(table)
    if nchunks == 0:
        return np.zeros(0, dtype=np.int64), hsize
    offsets = np.empty(nchunks, dtype=np.int64)
    first = np.empty((_fp.CHECKS, MAX_STREAMS), dtype=np.int64)
    total = int(
        _fp.payload_layout(
            buf,
            HEADER_BYTES + 8 * ns,
            table.itemsize,
            nchunks,
            ns,
            numel,
            chunk_elems,
            _stream_books(ids),
            version,
            hsize,
            offsets,
            first,
        )
    )
    if total < 0:  # our own arguments: a bug, not a bad frame
        raise RuntimeError("the frame layout kernel refused its arguments")
    if (first < nchunks).any():
        _layout_failure(table, ns, numel, chunk_elems, first)
    return offsets, total


def _layout_failure(table, ns, numel, chunk_elems, first) -> None:
    """Raise FrameError for the first check of the table that failed (see kernels.frame_params)."""
    nchunks = len(table)

    def count(c):
        return chunk_elems if c < nchunks - 1 else numel - (nchunks - 1) * chunk_elems

    def at(check, s=0):
        return int(first[check, s]) if first[check, s] < nchunks else None

    if (c := at(_fp.CHECK_V1_BOOK)) is not None:
        _fail(f"chunk {c} names a book, which version 1 frames cannot")
    if (c := at(_fp.CHECK_BOOK_UNCODED)) is not None:
        _fail(f"chunk {c} names a book for a stream it does not code (books field 0x{int(table['books'][c]):04x})")
    if (c := at(_fp.CHECK_FLAGS)) is not None:
        _fail(f"chunk {c} has unknown flags 0x{int(table['cflags'][c]):02x}")
    if (c := at(_fp.CHECK_ZERO_PAYLOAD)) is not None:
        _fail(f"chunk {c} is flagged all-zero but has a mask or payload")
    for s in range(ns):
        if (c := at(_fp.CHECK_NO_BOOK, s)) is not None:
            _fail(f"stream {s} has no codebook, but chunk {c} says it is coded")
        if (c := at(_fp.CHECK_SIZE, s)) is not None:
            _fail(f"chunk {c} stream {s} size {int(table['sizes'][c][s])} is impossible for {count(c)} elements")
        if (c := at(_fp.CHECK_RAW_SIZE, s)) is not None:
            _fail(f"chunk {c} stream {s} is raw but holds {int(table['sizes'][c][s])} bytes for {count(c)} elements")
    raise AssertionError("unreachable: a failed check without a message")


def as_frame_bytes(frame) -> np.ndarray:
    """Return a frame's bytes as a contiguous 1-D numpy uint8 array (no copy where it can).

    Args:
        frame: a 1-D torch.uint8 tensor (copied to the host if on a GPU), a 1-D numpy
            uint8 array, or a bytes-like object (bytes, bytearray, contiguous memoryview).

    Raises:
        TypeError: any other type, dtype or shape, or a non-contiguous memoryview.
    """
    if isinstance(frame, np.ndarray):
        if frame.dtype != np.uint8 or frame.ndim != 1:
            raise TypeError(f"a frame is a 1-D uint8 array, got {frame.dtype} with shape {frame.shape}")
        return np.ascontiguousarray(frame)
    if isinstance(frame, memoryview) and not frame.contiguous:
        raise TypeError(
            f"a frame given as a memoryview must be contiguous; this one (strides {frame.strides}) is not: "
            "pass bytes(view) or a contiguous copy"
        )
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return np.frombuffer(frame, dtype=np.uint8)
    torch = sys.modules.get("torch")  # a tensor exists only once torch is loaded
    if torch is not None and isinstance(frame, torch.Tensor):
        if frame.dtype != torch.uint8 or frame.dim() != 1:
            raise TypeError(f"a frame is a 1-D torch.uint8 tensor, got {frame.dtype} with shape {tuple(frame.shape)}")
        if frame.device.type != "cpu":
            frame = frame.cpu()
        return frame.contiguous().numpy()
    raise TypeError(f"a frame is a 1-D torch.uint8 tensor, got {type(frame).__name__}")
