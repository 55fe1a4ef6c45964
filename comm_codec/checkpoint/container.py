"""The container both checkpoint formats share: header, segments, JSON index, trailer.

An exact checkpoint (:data:`MAGIC`, :mod:`.exact`) and a lossy one (:data:`LOSSY_MAGIC`,
:mod:`.lossy`) are laid out alike (integers little-endian)::

    header    magic 8 bytes | version u16 | flags u16 (0) | 0 u32
    payload   the format's coded bytes, each piece padded with zeros to 8 bytes
    index     zstd-compressed UTF-8 JSON
    trailer   index offset u64 | index length u64 | index CRC-32 u32 | version u16 |
              flags u16 (bit 0: index is zstd-compressed) | magic 8 bytes     (32 bytes)

The two magics differ from each other and from a codec frame's (``CCFR``), so no reader
takes one kind of file for another. This module reads and writes the frame around the
index; what the index holds is each format's business (its ``check`` function).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import struct
import threading
import zlib

import zstandard

from ..core._json import loads as json_loads
from .errors import CheckpointError, fail
from .files import FileMap

__all__ = [
    "MAGIC",
    "LOSSY_MAGIC",
    "FRAME_MAGIC",
    "HEADER",
    "TRAILER",
    "FLAG_INDEX_ZSTD",
    "NOT_OURS",
    "created_by",
    "identify",
    "read_container_index",
    "index_file",
    "encode_index",
    "zstd_bounded",
    "parse_json",
]

MAGIC = b"\x89CCKP\r\n\x1a"
LOSSY_MAGIC = b"\x89CCKL\r\n\x1a"  # the lossy container; never read as exact
FRAME_MAGIC = b"CCFR"  # a single codec frame (comm_codec.core.frame)
HEADER = struct.Struct("<8sHHI")
TRAILER = struct.Struct("<QQIHH8s")
FLAG_INDEX_ZSTD = 0x1
# What every reader says of a file that is no comm_codec file at all.
NOT_OURS = (
    "not a comm_codec checkpoint or frame (bad magic): give a file written by "
    "`comm-codec compress` (or a codec frame, for inspect)"
)
# Largest index (JSON text) read: a checkpoint of 250 000 segments needs about 15 MB.
_MAX_INDEX_BYTES = 128 << 20
# What parsing an index may hold (comm_codec.core._json.estimate): a real index of 250 000
# segments takes about 200 MB.
_MAX_INDEX_MEMORY = 512 << 20


@functools.lru_cache(maxsize=1)
def created_by() -> str:
    """Return the writer's name and version, for the index's ``created_by``.

    Cached: importlib.metadata parses the package's metadata on every call, which costs
    milliseconds, a noticeable share of compressing a small checkpoint.
    """
    try:
        version = importlib.metadata.version("comm_codec")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout without installing
        version = "unknown"
    return f"comm_codec {version}"


def identify(head: bytes) -> str | None:
    """Return "exact", "lossy" or "frame" for a file's first 8 bytes, None for anything else."""
    if head[:8] == MAGIC:
        return "exact"
    if head[:8] == LOSSY_MAGIC:
        return "lossy"
    if head[:4] == FRAME_MAGIC:
        return "frame"
    return None


_tls = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor, reused: making one takes longer than decoding a small segment."""
    if not hasattr(_tls, "zd"):
        _tls.zd = zstandard.ZstdDecompressor()
    return _tls.zd


def zstd_bounded(blob, limit: int, path, what: str) -> bytes:
    """Decompress zstd bytes, producing at most ``limit`` bytes whatever the frame claims.

    A frame's header may declare any content size; ``ZstdDecompressor.decompress`` would
    allocate it. Here output grows only with bytes actually produced, and more than
    ``limit`` of them is an error.

    A frame that declares a size within ``limit`` is decoded in one call into a buffer of
    that size (the writers' frames all do; streaming cost ~15 us a segment, a tenth of
    restoring a small checkpoint's zstd segments); anything else, several frames included,
    streams.

    Raises:
        CheckpointError: not zstd, truncated, or more than ``limit`` bytes.
    """
    try:
        declared = zstandard.frame_content_size(blob)
    except zstandard.ZstdError:
        declared = -1  # not a frame header: the stream reader says what is wrong
    if 0 <= declared <= limit:
        try:
            # allow_extra_data=False: bytes after the frame fail here and stream below
            return _decompressor().decompress(blob, allow_extra_data=False)
        except zstandard.ZstdError:
            pass  # several frames, or a bad one: streamed, which names the error
    parts, total = [], 0
    try:
        with _decompressor().stream_reader(memoryview(blob), read_across_frames=True) as reader:
            while True:
                part = reader.read(min(1 << 20, limit + 1 - total))
                if not part:
                    break
                parts.append(part)
                total += len(part)
                if total > limit:
                    fail(path, f"{what} decompresses to more than the {limit} bytes expected: corrupted")
    except zstandard.ZstdError as exc:
        fail(path, f"{what}: {exc}")
    return b"".join(parts)


def parse_json(text: bytes, path, what: str = "index"):
    """Parse JSON text read from a container (its index, a safetensors header) with
    :func:`comm_codec.core._json.loads`: refused before parsing when it could not fit in
    memory, and within the budget every parse in flight shares.

    Raises:
        CheckpointError: too large, not UTF-8, not JSON, or nested too deeply.
    """
    return json_loads(
        text, limit=_MAX_INDEX_MEMORY, error=lambda reason: CheckpointError(f"{path}: {what} is malformed ({reason})")
    )


def encode_index(index: dict, index_offset: int, version: int, magic: bytes) -> tuple[bytes, bytes]:
    """Return the compressed index and the trailer that points at it (at ``index_offset``)."""
    blob = zstandard.ZstdCompressor(level=9).compress(json.dumps(index, separators=(",", ":")).encode())
    return blob, TRAILER.pack(index_offset, len(blob), zlib.crc32(blob), version, FLAG_INDEX_ZSTD, magic)


def read_container_index(m, magic: bytes, version_expected: int, check, kind: str) -> dict:
    """Read the index of a container whose magic was checked.

    Args:
        m: the file (:class:`.files.FileMap`).
        magic: the magic its trailer must end with.
        version_expected: the only version this build reads.
        check: ``check(index, index_offset, path)`` validates the index's contents.
        kind: what to call the file in messages ("checkpoint", "lossy checkpoint").

    Returns:
        The index dict, as ``check`` left it.

    Raises:
        CheckpointError: truncated, corrupted, or not of this kind.
    """
    path = m.path
    if m.size < HEADER.size + TRAILER.size:
        fail(path, f"truncated: {m.size} bytes, a {kind} has at least {HEADER.size + TRAILER.size}")
    _, version, hflags, reserved = HEADER.unpack(bytes(m.u8(0, HEADER.size)))
    if version != version_expected:
        fail(path, f"{kind} format version {version}; this build reads version {version_expected}")
    if hflags or reserved:
        fail(path, "header is corrupted (unknown flags)")
    off, length, crc, tversion, flags, tail_magic = TRAILER.unpack(bytes(m.u8(m.size - TRAILER.size, TRAILER.size)))
    if tail_magic != magic:
        fail(path, "truncated, or bytes appended after its end (no trailer at the end of the file)")
    if tversion != version_expected or flags & ~FLAG_INDEX_ZSTD or length > _MAX_INDEX_BYTES:
        fail(path, "trailer is corrupted")
    if off < HEADER.size or off + length + TRAILER.size != m.size:
        fail(
            path,
            f"trailer says the index is at {off}..{off + length}, which does not end where the "
            f"trailer starts ({m.size - TRAILER.size}): truncated, extended or corrupted",
        )
    blob = bytes(m.u8(off, length))
    if zlib.crc32(blob) != crc:
        fail(path, "index is corrupted (CRC-32 mismatch)")
    if flags & FLAG_INDEX_ZSTD:
        blob = zstd_bounded(blob, _MAX_INDEX_BYTES, path, "index")
    try:
        index = parse_json(blob, path)
        if not isinstance(index, dict):
            fail(path, f"index is malformed (a JSON {type(index).__name__}, not an object)")
        check(index, off, path)
    except CheckpointError:
        raise
    except (
        zstandard.ZstdError,
        UnicodeDecodeError,
        json.JSONDecodeError,
        KeyError,
        TypeError,
        ValueError,
        IndexError,
        AttributeError,
    ) as exc:  # CodebookError is a ValueError
        fail(path, f"index is malformed ({type(exc).__name__}: {exc})")
    return index


def index_file(path, load) -> dict:
    """Return the index of the container at ``path``, read by ``load(FileMap)``.

    The parsed codebooks a format's ``load`` adds under ``"_books"`` (objects, not JSON)
    are left out: the result is the index as the file holds it.
    """
    m = FileMap(os.fspath(path))
    try:
        index = load(m)
    finally:
        m.close()
    index.pop("_books", None)
    return index
