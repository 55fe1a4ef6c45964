"""The exact container's index: what it holds, and the checks a reader runs on it.

The container around it (header, trailer, the zstd-compressed JSON) is
:mod:`.container`'s. The index (``"format": "comm_codec.checkpoint"``, version 1)::

    source    {name, size, blake3 | sha256, format: "safetensors" | "torch_zip" | "distcp" |
              "torch_legacy" | "generic", note (optional): why its tensors stay opaque}
    base      null, or {name, size, blake3 | sha256} of the file deltas were taken against
    books     {id: {origin, book}}: every codebook a frame uses, per-tensor and shipped
              alike (a file never depends on the installed default books)
    groups    {id: [book id, ...]}: groups of books chosen chunk by chunk (optional)
    tensors   [{name, dtype, shape, offset, nbytes, kind, coding: "frame" | "opaque",
                transform: "none" | "xor", base_offset, books: [id per stream], chunk_elems,
                entries (optional): [[name, shape], ...] of the state-dict entries sharing
                the tensor's storage, where several do}]
    segments  [[src_offset, src_length, offset, length, method, crc32, tensor], ...]

Segments cover the source exactly, in order, and follow each other in the file, each
padded with zeros to 8 bytes. ``method`` is ``"frame"`` (one :meth:`Codec.encode` frame
of the tensor's elements src_offset..src_offset+src_length, after the tensor's
transform, in chunks of the tensor's ``chunk_elems``; frames carry a CRC-32 header and a
checksum per chunk), ``"zstd"`` or ``"stored"``; ``crc32`` (CRC-32 of the coded bytes) is
set for the last two. ``tensor`` is the segment's tensor in ``tensors``, -1 for the
bytes between tensors. A transform maps a tensor's bit pattern to what is coded and
back: ``"none"``, and ``"xor"`` with the base's tensor at ``base_offset``.

A reader checks the whole index before it uses any of it (schema, then layout) and
raises :class:`CheckpointError` naming the first bad field.
"""

from __future__ import annotations

import os
import struct

from ..core.codebooks import CodebookGroup
from ..core.frame import header_size
from ..core.huffman import Codebook, CodebookError
from ..core.quoting import printable, shown
from ..core.streams import spec_for
from . import schema
from .container import HEADER, MAGIC, NOT_OURS, identify, index_file, read_container_index
from .errors import fail
from .files import FileMap, open_regular
from .formats import CODABLE_NAMES, FORMATS
from .pickle_scan import MAX_ENTRIES
from .plan import CHUNK_SIZES, TRANSFORMS
from .schema import Anything, Int, ListOf, MapOf, Nullable, OneOf, Record, Row, Str

__all__ = ["VERSION", "INDEX_FORMAT", "METHODS", "MAX_SEGMENT_BYTES", "is_checkpoint", "load_index", "read_index"]

VERSION = 1
INDEX_FORMAT = "comm_codec.checkpoint"
METHODS = ("frame", "zstd", "stored")
# Largest piece of source one segment may restore: what the writer makes (exact.PIECE_BYTES,
# or one chunk of a tensor when larger) with room to spare. A reader holds a few segments in
# memory at a time, so this bounds its memory whatever sizes a file claims.
MAX_SEGMENT_BYTES = 64 << 20
# Most source bytes one zstd byte can restore: a block (at most 128 KiB) costs at least a
# 3-byte header and one byte.
_ZSTD_MAX_RATIO = (128 << 10) // 4
# A frame's fixed header (comm_codec.core.frame): magic, version, dtype, nstreams, flags,
# numel, chunk_elems, nchunks.
_FRAME_HEAD = struct.Struct("<4sBBBBQII")


def is_checkpoint(path) -> bool:
    """Return True when the file starts with the checkpoint container's magic."""
    with open_regular(os.fspath(path)) as fh:
        return fh.read(len(MAGIC)) == MAGIC


def load_index(m: FileMap) -> dict:
    """Read and check the index of a mapped exact checkpoint.

    Returns:
        The index dict, with the parsed codebooks and groups added under ``"_books"``
        (``{id: Codebook | CodebookGroup}``; :func:`read_index` leaves them out).

    Raises:
        CheckpointError: not an exact checkpoint (a lossy file or a frame is named as
            such), truncated, or corrupted.
    """
    path = m.path
    if m.size < len(MAGIC) or bytes(m.u8(0, len(MAGIC))) != MAGIC:
        kind = identify(bytes(m.u8(0, min(8, m.size))))
        if kind == "lossy":
            fail(
                path,
                "is a lossy comm_codec checkpoint: it restores an approximation, not the original; "
                "use comm_codec.checkpoint.lossy.decompress_file (`comm-codec decompress` detects it)",
            )
        if kind == "frame":
            fail(path, "is a comm_codec frame, not a checkpoint (use `comm-codec inspect`)")
        fail(path, NOT_OURS)
    index = read_container_index(m, MAGIC, VERSION, _check_index, "checkpoint")
    _check_claims(m, index)
    return index


def _check_claims(m: FileMap, index: dict) -> None:
    """Check that every segment can hold the source bytes it claims, before any is decoded.

    A frame's header must say the elements and chunk size the index records (the writer
    codes each tensor in its recorded chunks: an all-zero chunk then costs a table entry per
    chunk_elems, never one entry for any size), and a zstd segment cannot restore more than
    zstd's largest ratio. So the total a file declares is bounded by its own size.
    """
    path, tensors = m.path, index["tensors"]
    for k, (_src_off, src_len, off, length, method, _crc, ti) in enumerate(index["segments"]):
        if method == "zstd" and src_len > length * _ZSTD_MAX_RATIO:
            fail(
                path,
                f"index: segment {k} claims {src_len} bytes from {length} zstd bytes, more than zstd "
                "can restore: corrupted",
            )
        if method != "frame":
            continue
        t = tensors[ti]
        itemsize = spec_for(t["dtype"]).itemsize
        if length < _FRAME_HEAD.size:
            fail(path, f"index: segment {k} is {length} bytes, too short for a frame: corrupted")
        _, _, _, ns, _, numel, chunk, nchunks = _FRAME_HEAD.unpack(bytes(m.u8(off, _FRAME_HEAD.size)))
        if (
            chunk != t["chunk_elems"]
            or numel * itemsize != src_len
            or nchunks != -(-numel // chunk)
            or header_size(ns, nchunks) > length
        ):
            fail(
                path,
                f"index: segment {k} of tensor {ti} holds a frame of {numel} elements in chunks of {chunk}, "
                f"but the index says {src_len // itemsize} elements in chunks of {t['chunk_elems']}: corrupted",
            )


_SHA = Str(length=64)
_BOOK_ID = Str(length=16)
# The exact index (the module docstring), as read: every field the readers use.
_INDEX = Record(
    {
        "format": OneOf(INDEX_FORMAT),
        "version": OneOf(VERSION),
        "created_by": Str(),
        "source": Record(
            {
                "name": Str(),
                "size": Int(),
                "blake3": _SHA,
                "sha256": _SHA,
                "format": OneOf(*FORMATS),
                "note": Str(1024),
            },
            optional=("blake3", "sha256", "note"),
        ),
        "base": Nullable(
            Record({"name": Str(), "size": Int(), "blake3": _SHA, "sha256": _SHA}, optional=("blake3", "sha256"))
        ),
        "books": MapOf(_BOOK_ID, Record({"origin": Str(), "book": Anything(dict)})),
        "groups": MapOf(_BOOK_ID, ListOf(_BOOK_ID, CodebookGroup.MAX_BOOKS)),
        "tensors": ListOf(
            Record(
                {
                    "name": Str(1 << 16),
                    "dtype": Str(64),
                    "shape": Nullable(ListOf(Int(), 64)),
                    "offset": Int(),
                    "nbytes": Int(),
                    "kind": Str(64),
                    "coding": OneOf("frame", "opaque"),
                    "transform": OneOf(*TRANSFORMS),
                    "base_offset": Nullable(Int()),
                    "books": Nullable(ListOf(_BOOK_ID, 8)),
                    "chunk_elems": Nullable(OneOf(*CHUNK_SIZES)),
                    "entries": ListOf(Row(Str(1 << 16), Nullable(ListOf(Int(), 64))), MAX_ENTRIES),
                },
                optional=("entries",),
            )
        ),
        "segments": ListOf(
            Row(
                Int(),
                Int(1, MAX_SEGMENT_BYTES),
                Int(),
                Int(),
                OneOf(*METHODS),
                Nullable(Int(0, 0xFFFFFFFF)),
                Int(-1, 1 << 31),
            )
        ),
    },
    optional=("created_by", "groups"),
)


def _check_index(index: dict, index_offset: int, path) -> None:
    """Check the whole index (schema, then layout); raise CheckpointError naming the first bad field."""
    if index.get("format") != INDEX_FORMAT or index.get("version") != VERSION:
        fail(
            path,
            f"index format {shown(index.get('format'), 40)} version {shown(index.get('version'), 10)}, "
            f"expected {INDEX_FORMAT!r} version {VERSION}",
        )
    schema.check(index, _INDEX, path)
    src, base = index["source"], index["base"]
    for what, rec in (("source", src), ("base", base)):
        if rec is not None and not any(d in rec for d in ("blake3", "sha256")):
            fail(path, f"index.{what}: no digest (blake3 or sha256)")
    books = {}
    for book_id, entry in index["books"].items():
        try:
            book = Codebook.from_dict(entry["book"])
        except CodebookError as exc:
            fail(path, f"index: codebook {book_id}: {exc}")
        if book.id != book_id:
            fail(path, f"index: codebook listed as {book_id} is {book.id}")
        books[book_id] = book
    for group_id, members in index.get("groups", {}).items():
        if any(b not in books for b in members):
            fail(path, f"index: codebook group {group_id} names books the file does not hold")
        try:
            group = CodebookGroup([books[b] for b in members])
        except ValueError as exc:
            fail(path, f"index: codebook group {group_id}: {exc}")
        if group.id != group_id:
            fail(path, f"index: codebook group listed as {group_id} is {group.id}")
        books[group_id] = group
    index["_books"] = books
    for i, t in enumerate(index["tensors"]):
        if t["offset"] + t["nbytes"] > src["size"]:
            fail(path, f"index: tensor {i} lies outside the source")
        if t["coding"] == "frame":
            if t["dtype"] not in CODABLE_NAMES or t["transform"] not in TRANSFORMS:
                fail(path, f"index: tensor {i} has dtype {t['dtype']!r} / transform {t['transform']!r}")
            spec = spec_for(t["dtype"])
            if (
                t["books"] is None
                or t["chunk_elems"] is None
                or len(t["books"]) != spec.nstreams
                or any(b != "0" * 16 and b not in books for b in t["books"])
            ):
                fail(path, f"index: tensor {i} ({printable(t['name'])}) names codebooks the file does not hold")
            if t["transform"] != "none" and (
                base is None or t["base_offset"] is None or t["base_offset"] + t["nbytes"] > base["size"]
            ):
                fail(path, f"index: tensor {i} ({printable(t['name'])}) has a bad base range")
    pos, at = 0, HEADER.size
    for k, seg in enumerate(index["segments"]):
        src_off, src_len, off, length, method, crc, ti = seg
        # Segments follow each other, each padded to 8 bytes: every byte has a known place.
        if not (src_off == pos and off == at and off + length <= index_offset and ti < len(index["tensors"])):
            fail(path, f"index: segment {k} is malformed")
        at = off + length + (-length % 8)
        if method == "frame":
            t = index["tensors"][ti] if ti >= 0 else None
            if (
                t is None
                or t["coding"] != "frame"
                or not (t["offset"] <= src_off and src_off + src_len <= t["offset"] + t["nbytes"])
                or (src_off - t["offset"]) % spec_for(t["dtype"]).itemsize
                or src_len % spec_for(t["dtype"]).itemsize
            ):
                fail(path, f"index: segment {k} is a frame outside any coded tensor")
        elif crc is None or (method == "stored" and length != src_len):
            fail(path, f"index: segment {k} is malformed")
        pos += src_len
    if pos != src["size"]:
        fail(path, f"index: segments cover {pos} bytes, the source had {src['size']}")
    if at != index_offset:
        fail(path, f"index: segments end at {at}, the index starts at {index_offset}")


def read_index(path) -> dict:
    """Return the checked JSON index of an exact checkpoint (see the module docstring).

    Raises:
        CheckpointError: not a checkpoint, truncated, or corrupted.
    """
    return index_file(path, load_index)
