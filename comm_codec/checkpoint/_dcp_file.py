"""The data file of a ``comm_codec.dcp`` directory: items, then a book table, then a fixed trailer.

A data file (``__<rank>_<n>.distcp``) holds its items at the offsets ``.metadata``
records (frames, pack frames, and items stored as DCP stores them), then a book table,
then :data:`TRAILER`: magic, the table's offset and length, its CRC-32 (of the bytes
stored), zero. The magic says the table's version: ``CCDCPBK1``, JSON; ``CCDCPBK2``,
zlib-compressed JSON (a shipped group of 16 books is ~7 kB of JSON, ~0.4 kB deflated).

Book table versions (a reader reads both):

* 1: the books of the file's own that its frames use, the groups they form, and the
  digest of the shipped set the writer had (``"shipped"``); shipped books are named by
  id only, so the file reads only where that set is at hand.
* 2 (written now): every book and group any frame of the file uses, shipped ones
  included, so the file reads with any later release whatever its default books; and
  ``"checksums"``: for each item stored as DCP stores it, its length and CRC-32 (frames
  carry their own checksums), checked when the item is read.
"""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np

from ..core.codebooks import CodebookGroup, CodebookSet
from ..core.errors import CheckpointError, CodebookError
from ..core.frame import header_size
from ..core.huffman import Codebook
from ..core.quoting import printable
from ._dcp_metadata import open_regular

__all__ = [
    "BOOKS_FORMAT",
    "BOOKS_VERSION",
    "DATA_SUFFIX",
    "RAW_ID",
    "TRAILER",
    "TRAILER_MAGIC",
    "DataFile",
    "book_table",
    "max_frame_bytes",
    "missing_book",
]

DATA_SUFFIX = ".distcp"  # FileSystemWriter's suffix for data files
BOOKS_FORMAT = "comm_codec.dcp.books"
BOOKS_VERSION = 2
_READ_VERSIONS = (1, 2)
MAX_BOOKS_BYTES = 64 << 20  # a book takes ~400 bytes of JSON
# At the very end of a data file: magic, book table offset and length, its CRC-32, zero.
TRAILER = struct.Struct("<8sQQII")
TRAILER_MAGIC = b"CCDCPBK2"  # written now: the table is zlib-compressed JSON, version 2
_MAGIC_V1 = b"CCDCPBK1"  # the table is JSON, version 1
RAW_ID = "0" * 16


def book_table(used_ids, own_books: dict, own_groups: dict, shipped: CodebookSet, checksums: dict) -> bytes:
    """The book table (version 2) of a data file whose frames name used_ids.

    Args:
        used_ids: every book or group id a frame of the file names.
        own_books: id -> book dict (``Codebook.to_dict``) of books the writer built or chose.
        own_groups: group id -> member book ids, of groups the writer chose.
        shipped: the shipped set the writer had (ids found nowhere else come from it).
        checksums: offset -> (length, CRC-32) of each item stored as DCP stores it.

    Returns:
        The table's JSON bytes.
    """
    books: dict = {}
    groups: dict = {}

    def book(book_id: str) -> None:
        if book_id in books:
            return
        entry = own_books.get(book_id)
        if entry is None:
            entry = shipped.by_id(book_id).to_dict()
        books[book_id] = entry

    for book_id in sorted(used_ids):
        if book_id == RAW_ID:
            continue
        if book_id in own_groups or book_id in own_books:
            members = own_groups.get(book_id, [book_id])
        else:
            group = shipped.group_by_id(book_id)
            members = [b.id for b in group.books] if group is not None else [book_id]
        if len(members) > 1:
            groups[book_id] = list(members)
        for member in members:
            book(member)
    table = {
        "format": BOOKS_FORMAT,
        "version": BOOKS_VERSION,
        "shipped": shipped.digest,
        "books": books,
        "groups": groups,
        "checksums": {str(k): list(v) for k, v in sorted(checksums.items())},
    }
    return zlib.compress(json.dumps(table, separators=(",", ":"), allow_nan=False).encode(), 9)


def max_frame_bytes(numel: int, spec) -> int:
    """The most bytes a frame of numel elements can take: raw data, the chunk table of the
    smallest chunks the codec makes (8 elements) and 8 bytes of padding per chunk and stream."""
    nchunks = -(-numel // 8)
    return numel * spec.itemsize + header_size(spec.nstreams, nchunks) + 8 * (spec.nstreams + 1) * nchunks


def missing_book(path: str, book_id, version, written_with, shipped: CodebookSet) -> str:
    """The error for a frame whose book neither the file nor the reader's shipped set holds."""
    msg = f"{path}: a frame needs codebook {printable(book_id, 20)}, which neither the file nor the shipped books hold"
    if version == 1 and written_with != shipped.digest:
        msg += (
            f"; the file names shipped books by id only (written before data files stored every book) and "
            f"was written with the book set of digest {printable(written_with, 40)}, this reader has "
            f"{shipped.digest}: pass that set as codebooks= (Reader(path, codebooks=...) or "
            "comm_codec.dcp.load(..., codebooks=...))"
        )
    elif written_with != shipped.digest:
        msg += f"; it was written with shipped books {printable(written_with, 40)}, this reader has {shipped.digest}"
    return msg


class DataFile:
    """One open data file of a checkpoint: bounded reads, its book table once asked for."""

    def __init__(self, path: str):
        self.path = path
        self.fh = open_regular(path)
        self.size = os.fstat(self.fh.fileno()).st_size
        self._table = None
        self._books = None

    def read(self, offset: int, length: int, what: str) -> np.ndarray:
        if offset + length > self.size:
            raise CheckpointError(
                f"{self.path}: truncated: {what} lies at bytes {offset}..{offset + length}, the file has {self.size}"
            )
        buf = np.empty(length, dtype=np.uint8)
        self.fh.seek(offset)
        view, got = memoryview(buf), 0
        while got < length:
            n = self.fh.readinto(view[got:])
            if not n:
                raise CheckpointError(f"{self.path}: truncated while reading {what}")
            got += n
        return buf

    def has_trailer(self) -> bool:
        """Whether the file ends with a book table's trailer (a plain DCP data file does not)."""
        if self.size < TRAILER.size:
            return False
        return bytes(self.read(self.size - TRAILER.size, 8, "the trailer")) in (TRAILER_MAGIC, _MAGIC_V1)

    def table(self) -> dict:
        """The file's book table, checked (CRC-32, format, version); CheckpointError if there is none."""
        if self._table is None:
            self._table = self._read_table()
        return self._table

    def _read_table(self) -> dict:
        path = self.path
        if self.size < TRAILER.size:
            raise CheckpointError(f"{path}: truncated or not a comm_codec DCP data file (no book table)")
        magic, offset, length, crc, zero = TRAILER.unpack(
            bytes(self.read(self.size - TRAILER.size, TRAILER.size, "the trailer"))
        )
        if magic not in (TRAILER_MAGIC, _MAGIC_V1) or zero != 0:
            raise CheckpointError(f"{path}: truncated or not a comm_codec DCP data file (no book table at its end)")
        if length > MAX_BOOKS_BYTES or offset + length + TRAILER.size != self.size:
            raise CheckpointError(
                f"{path}: the book table's place ({offset}, {length} bytes) is not before the "
                "trailer: truncated or corrupted"
            )
        raw = bytes(self.read(offset, length, "the book table"))
        if zlib.crc32(raw) != crc:
            raise CheckpointError(f"{path}: the book table is corrupted (CRC-32 mismatch)")
        if magic == TRAILER_MAGIC:
            inflate = zlib.decompressobj()
            try:
                raw = inflate.decompress(raw, MAX_BOOKS_BYTES + 1)
            except zlib.error:
                raise CheckpointError(f"{path}: the book table is not zlib data") from None
            if len(raw) > MAX_BOOKS_BYTES or not inflate.eof:
                raise CheckpointError(f"{path}: the book table inflates past {MAX_BOOKS_BYTES} bytes or is cut short")
        try:
            table = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise CheckpointError(f"{path}: the book table is not JSON") from None
        if (
            not isinstance(table, dict)
            or table.get("format") != BOOKS_FORMAT
            or table.get("version") != (2 if magic == TRAILER_MAGIC else 1)
            or not isinstance(table.get("books"), dict)
            or not isinstance(table.get("groups"), dict)
            or not isinstance(table.get("checksums", {}), dict)
        ):
            raise CheckpointError(
                f"{path}: the book table is not a {BOOKS_FORMAT} table of a version this "
                f"release reads ({', '.join(map(str, _READ_VERSIONS))})"
            )
        table["data_end"] = offset
        return table

    @property
    def version(self) -> int:
        return self.table()["version"]

    def checksum(self, offset: int, length: int, what: str):
        """The CRC-32 the table records for the item at offset (None: the file records none)."""
        if not self.has_trailer():
            return None  # a plain DCP data file
        table = self.table()
        if table["version"] < 2:
            return None
        entry = table["checksums"].get(str(offset))
        if (
            not (isinstance(entry, list) and len(entry) == 2 and all(type(x) is int for x in entry))
            or entry[0] != length
        ):
            raise CheckpointError(f"{self.path}: {what}: the book table records no checksum for it: tampered")
        return entry[1]

    def books(self, shipped: CodebookSet) -> dict:
        """id -> Codebook or CodebookGroup, of every book and group the file's table names."""
        if self._books is None:
            self._books = self._read_books(shipped)
        return self._books

    def _read_books(self, shipped: CodebookSet) -> dict:
        path = self.path
        table = self.table()
        books: dict = {}
        for book_id, entry in table["books"].items():
            try:
                book = Codebook.from_dict(entry)
            except (CodebookError, KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CheckpointError(f"{path}: codebook {printable(book_id, 20)}: {exc}") from None
            if book.id != book_id:
                raise CheckpointError(f"{path}: codebook listed as {printable(book_id, 20)} is {book.id}")
            books[book_id] = book

        def member(book_id):
            found = books.get(book_id) if isinstance(book_id, str) else None
            if found is None and isinstance(book_id, str) and table["version"] == 1:
                found = shipped.by_id(book_id)
            if found is None:
                raise CheckpointError(missing_book(path, book_id, table["version"], table.get("shipped"), shipped))
            return found

        for group_id, members in table["groups"].items():
            if not isinstance(members, list) or not 1 <= len(members) <= CodebookGroup.MAX_BOOKS:
                raise CheckpointError(f"{path}: codebook group {printable(group_id, 20)} is malformed")
            try:
                group = CodebookGroup([member(b) for b in members])
            except (ValueError, TypeError) as exc:
                if isinstance(exc, CheckpointError):
                    raise
                raise CheckpointError(f"{path}: codebook group {printable(group_id, 20)}: {exc}") from None
            if group.id != group_id:
                raise CheckpointError(f"{path}: codebook group listed as {printable(group_id, 20)} is {group.id}")
            books[group_id] = group
        return books

    def lookup(self, book_id: str, shipped: CodebookSet):
        """The book or group a frame names: from the file (version 2: only there), else the shipped set."""
        found = self.books(shipped).get(book_id)
        if found is None and self.version == 1:
            found = shipped.group_by_id(book_id) or shipped.by_id(book_id)
        if found is None:
            table = self.table()
            raise CheckpointError(missing_book(self.path, book_id, table["version"], table.get("shipped"), shipped))
        return found

    def close(self) -> None:
        self.fh.close()
