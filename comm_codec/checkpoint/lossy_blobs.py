"""The blobs of a lossy file: Huffman frames coded with the file's own books, and the skeleton.

A lossy file (``lossy_format.md``) holds two kinds of blob between its header and its
index. *Frames* code the excp streams and the tensors kept exactly or cut in precision,
with books fitted to this file's own data (:class:`FileBooks`, which encodes and
decodes them). The *skeleton* is every source byte outside the rewritten tensors,
zstd-coded (:func:`cut_skeleton`, :func:`read_skeleton`); :func:`rebuild` lays the
skeleton and the reconstructed tensors back out as the source was.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import torch

from ..books.profiler import stream_counts
from ..core.codebooks import CodebookSet
from ..core.codec import Codec
from ..core.frame import FrameError, get_frame_parameters
from ..core.huffman import Codebook
from ..core.streams import spec_for
from .container import zstd_bounded
from .errors import CheckpointError, fail
from .files import FileMap

__all__ = ["CHUNK", "FileBooks", "cut_skeleton", "skeleton_offsets", "read_skeleton", "rebuild"]

# Elements per chunk of every frame of a lossy file.
CHUNK = 1 << 16
# What a book costs in the (compressed) index, in bytes: a stream gets its own book only
# when coding with it saves more than this.
_BOOK_COST_BYTES = 160


class FileBooks:
    """The Huffman books of one lossy file, and codecs that code with them.

    Args:
        threads: numba threads for coding (None: numba's setting).
        books: the file's books by id, for decoding (from its index); empty to encode.
    """

    def __init__(self, threads: int | None, books: dict[str, Codebook] | None = None):
        self.threads = threads
        self.books: dict[str, Codebook] = {} if books is None else books
        self._codecs: dict = {}

    def codec(self, books: list[Codebook], dtype: torch.dtype) -> Codec:
        """Return the codec that codes dtype with these books (one per stream), made once."""
        spec = spec_for(dtype)
        key = (spec.name, tuple(b.id for b in books))
        codec = self._codecs.get(key)
        if codec is None:
            keyed = {("weight", spec.name, s): b for s, b in enumerate(books)}
            codec = self._codecs[key] = Codec(CodebookSet(keyed), threads=self.threads, chunk_elems=CHUNK)
        return codec

    def fit(self, tensor: torch.Tensor) -> list[Codebook]:
        """Return one book per stream fitted to the tensor, raw where a book does not pay."""
        counts, _ = stream_counts(tensor, CHUNK)
        books = []
        for c in counts:
            n = float(c.sum())
            book = Codebook.raw_book()
            if n:
                own = Codebook.from_counts(c)
                if not own.raw and (8 - own.expected_bits(c)) * n / 8 > _BOOK_COST_BYTES:
                    book = own
            books.append(book)
            if not book.raw:
                self.books[book.id] = book
        return books

    def encode(self, tensor: torch.Tensor) -> tuple[np.ndarray, list[str]]:
        """Code a tensor with books fitted to it; return its frame and the books' ids."""
        books = self.fit(tensor)
        return self.codec(books, tensor.dtype).encode(tensor, kind="weight").numpy(), [b.id for b in books]

    def decode(self, frame: np.ndarray, ids: list[str], dtype: torch.dtype, numel: int, where: str) -> torch.Tensor:
        """Decode a frame the index says holds ``numel`` elements of dtype, coded with books ``ids``.

        Raises:
            CheckpointError: "<where>: ..." when the frame disagrees with the index or is
                corrupted.
        """
        books = [Codebook.raw_book() if i == "0" * 16 else self.books[i] for i in ids]
        try:
            # The frame's own header must agree with the index before anything is allocated.
            p = get_frame_parameters(frame)
            if p.numel != numel or p.chunk_elems != CHUNK or p.spec.dtype != dtype:
                raise FrameError(f"frame holds {p.numel} {p.spec.name} elements in chunks of {p.chunk_elems}, "
                                 f"the index says {numel} {spec_for(dtype).name} in chunks of {CHUNK}")
            out = torch.empty(numel, dtype=dtype)
            self.codec(books, dtype).decode(frame, out=out, max_output_bytes=numel * out.element_size())
        except (FrameError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        return out


def _rewritten(records: list[dict]) -> list[tuple[int, int, int]]:
    """(offset, nbytes, record number) of every rewritten tensor, in source order."""
    return sorted((r["offset"], r["nbytes"], i) for i, r in enumerate(records) if r["coding"] != "skeleton")


def cut_skeleton(read, size: int, records: list[dict]) -> bytes:
    """Return the source bytes outside rewritten tensors (``read(offset, length)`` reads the source)."""
    parts, pos = [], 0
    for off, nb, _ in _rewritten(records):
        parts.append(bytes(read(pos, off - pos)))
        pos = off + nb
    parts.append(bytes(read(pos, size - pos)))
    return b"".join(parts)


def skeleton_offsets(records: list[dict]) -> None:
    """Set each skeleton-coded record's offset inside the skeleton."""
    cut = _rewritten(records)
    for r in records:
        if r["coding"] == "skeleton":
            r["skeleton_offset"] = r["offset"] - sum(nb for off, nb, _ in cut if off < r["offset"])


def read_skeleton(path: str, m: FileMap, index: dict) -> bytes:
    """Return a lossy file's skeleton, checked (CRC-32, size) and decompressed within its size.

    Raises:
        CheckpointError: the skeleton is corrupted.
    """
    s = index["skeleton"]
    blob = m.u8(s["offset"], s["length"])
    if zlib.crc32(blob) != s["crc32"]:
        fail(path, "the bytes around the tensors are corrupted (CRC-32 mismatch)")
    out = zstd_bounded(blob, s["size"], path, "the bytes around the tensors")
    if len(out) != s["size"]:
        fail(path, "the bytes around the tensors have the wrong size")
    return out


def rebuild(size: int, skeleton: bytes, records: list[dict], values: dict) -> bytearray:
    """Lay the skeleton and the reconstructed tensors out as the source was; patch zip CRCs.

    Args:
        size: the reconstruction's size.
        skeleton: the source bytes outside rewritten tensors.
        records: the index's tensor records.
        values: record number -> the reconstructed bytes of each rewritten tensor.
    """
    out = bytearray(size)
    cut = _rewritten(records)
    pos = spos = 0
    for off, nb, i in cut:
        out[pos:off] = skeleton[spos:spos + off - pos]
        spos += off - pos
        out[off:off + nb] = memoryview(values[i]).cast("B")
        pos = off + nb
    out[pos:] = skeleton[spos:]
    for off, nb, i in cut:
        crc = zlib.crc32(memoryview(out)[off:off + nb])
        for at in records[i]["crc_at"]:
            struct.pack_into("<I", out, at, crc)
    return out
