"""The blobs of a lossy file: Huffman frames coded with the file's own books, and the skeleton.

A lossy file (``lossy_format.md``) holds two kinds of blob between its header and its
index. *Frames* code the excp streams and the tensors kept exactly or cut in precision,
with books fitted to this file's own data (:class:`FileBooks`, which encodes them and
decodes them whole or a run of chunks at a time). The *skeleton* is every source byte
outside the rewritten tensors, zstd-coded (:func:`cut_skeleton`; read back in order by
:class:`SkeletonReader`); :func:`lay_out` streams the skeleton and the reconstructed
tensors, piece by piece, in the order the source held them, so that a reconstruction
never has to exist in memory whole.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np
import torch
import zstandard

from ..books.profiler import stream_counts
from ..core.codec import Codec
from ..core.frame import FrameError, get_frame_parameters, header_size, write_header
from ..core.huffman import Codebook
from ..core.streams import spec_for
from ..kernels.symbols import hash_words
from .errors import CheckpointError, fail
from .files import FileMap
from .plan import make_codec

__all__ = ["CHUNK", "PIECE", "FileBooks", "SkeletonReader", "cut_skeleton", "skeleton_offsets", "lay_out"]

# Elements per chunk of every frame of a lossy file.
CHUNK = 1 << 16
# Elements decoded at a time (a whole number of chunks, and of bytes of a bit mask): what
# a reader holds of one tensor whatever its size, a few arrays of this many elements.
PIECE = 16 * CHUNK
# Skeleton bytes read at a time.
_SKELETON_STEP = 1 << 20
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
            codec = self._codecs[key] = make_codec(books, spec, CHUNK, self.threads)
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
        p = self.check(frame, dtype, numel, where)
        return torch.cat(
            [torch.from_numpy(u8) for u8 in self.pieces(frame, ids, p, 0, p.nchunks, where)]
            or [torch.zeros(0, dtype=torch.uint8)]
        ).view(dtype)

    @staticmethod
    def check(frame: np.ndarray, dtype: torch.dtype, numel: int, where: str):
        """Check that a frame's header agrees with the index (before anything is decoded or allocated).

        Returns:
            Its :class:`~comm_codec.core.frame.FrameParameters`.

        Raises:
            CheckpointError: "<where>: ..." when it does not, or the header is corrupted.
        """
        try:
            p = get_frame_parameters(frame)
        except FrameError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        if p.numel != numel or p.chunk_elems != CHUNK or p.spec.dtype != dtype:
            raise CheckpointError(
                f"{where}: frame holds {p.numel} {p.spec.name} elements in chunks of "
                f"{p.chunk_elems}, the index says {numel} {spec_for(dtype).name} in chunks of {CHUNK}"
            )
        return p

    def pieces(self, frame: np.ndarray, ids: list[str], p, first: int, stop: int, where: str, step: int = PIECE):
        """Yield the bytes of chunks first..stop-1 of a checked frame, ``step`` elements at a time.

        Each run of chunks is decoded as a frame of its own (chunks are independent), so
        what is held is one run, whatever the frame's size and the number of threads.
        Chunk checksums are checked here, against the original chunk numbers they are
        seeded with.

        Raises:
            CheckpointError: "<where>: ..." for a corrupted chunk.
        """
        books = [Codebook.raw_book() if i == "0" * 16 else self.books[i] for i in ids]
        codec = self.codec(books, p.spec.dtype)
        book_ids = np.array([int(b, 16) for b in p.book_ids], dtype=np.uint64)
        words = frame.view(np.uint64) if frame.ctypes.data % 8 == 0 and frame.size % 8 == 0 else None
        if words is None:
            frame = (
                frame.copy() if frame.size % 8 == 0 else np.concatenate([frame, np.zeros(-frame.size % 8, np.uint8)])
            )
            words = frame.view(np.uint64)
        ends = np.append(p.offsets[1:], p.frame_bytes)
        per = max(1, step // CHUNK)
        for c0 in range(first, stop, per):
            c1 = min(stop, c0 + per)
            if p.checksums:
                for c in range(c0, c1):
                    if (
                        hash_words(words, int(p.offsets[c]) // 8, (int(ends[c]) - int(p.offsets[c])) // 8, c)
                        != p.table["checksum"][c]
                    ):
                        fail(where, f"chunk {c} of {p.nchunks} is bad: payload checksum mismatch (corrupted data)")
            count = min(p.numel, c1 * CHUNK) - c0 * CHUNK
            hsize = header_size(p.spec.nstreams, c1 - c0)
            start, end = int(p.offsets[c0]), int(ends[c1 - 1])
            sub = np.empty(hsize + end - start, np.uint8)
            write_header(sub, p.spec, count, CHUNK, 0, book_ids, p.table[c0:c1].copy())
            sub[hsize:] = frame[start:end]
            out = torch.empty(count, dtype=p.spec.dtype)
            try:
                codec.decode(sub, out=out, max_output_bytes=count * p.spec.itemsize)
            except (FrameError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{where}: {exc}") from None
            yield out.view(torch.uint8).numpy()


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


class SkeletonReader:
    """A lossy file's skeleton, decompressed in order as it is read (never whole).

    Its CRC-32 is checked when it is opened, its size when :meth:`finish` is called.

    Raises:
        CheckpointError: the skeleton is corrupted, or shorter or longer than recorded.
    """

    def __init__(self, path: str, m: FileMap, index: dict):
        s = index["skeleton"]
        self.path, self.size, self.pos = path, s["size"], 0
        blob = m.u8(s["offset"], s["length"])
        if zlib.crc32(blob) != s["crc32"]:
            fail(path, "the bytes around the tensors are corrupted (CRC-32 mismatch)")
        self._reader = zstandard.ZstdDecompressor().stream_reader(memoryview(blob), read_across_frames=True)

    def read(self, n: int) -> bytes:
        """Return the next n bytes."""
        parts, left = [], n
        try:
            while left:
                part = self._reader.read(min(left, _SKELETON_STEP))
                if not part:
                    fail(self.path, "the bytes around the tensors have the wrong size")
                parts.append(part)
                left -= len(part)
        except zstandard.ZstdError as exc:
            fail(self.path, f"the bytes around the tensors: {exc}")
        self.pos += n
        return b"".join(parts)

    def skip(self, n: int) -> None:
        """Pass over the next n bytes."""
        while n:
            step = min(n, _SKELETON_STEP)
            self.read(step)
            n -= step

    def finish(self) -> None:
        """Check that the skeleton held exactly its recorded size."""
        try:
            more = self._reader.read(1)
        except zstandard.ZstdError as exc:
            fail(self.path, f"the bytes around the tensors: {exc}")
        if more or self.pos != self.size:
            fail(self.path, "the bytes around the tensors have the wrong size")


def lay_out(size: int, skeleton, records: list[dict], pieces, crcs: dict, sink, where: str) -> None:
    """Stream a reconstruction: the skeleton and the rewritten tensors in source order; patch zip CRCs.

    Args:
        size: the reconstruction's size.
        skeleton: the source bytes outside rewritten tensors, as an object whose
            ``read(n)`` returns the next n of them (:class:`SkeletonReader`, a BytesIO).
        records: the index's tensor records.
        pieces: record number -> an iterable of the tensor's reconstructed bytes, in order.
        crcs: record number -> the CRC-32 of those bytes, for each record with ``crc_at``
            (written into the skeleton where ``crc_at`` says; a local header comes before
            its data, so the CRC must be known before the tensor is decoded).
        sink: called with each piece of the reconstruction, in order.
        where: the file's name, for messages.

    Raises:
        CheckpointError: a tensor's pieces are not its size, or do not have the CRC-32
            written for it.
    """
    patches = sorted((at, struct.pack("<I", crcs[i])) for _, _, i in _rewritten(records) for at in records[i]["crc_at"])

    def skeleton_span(start: int, end: int) -> None:
        for lo in range(start, end, _SKELETON_STEP):
            hi = min(end, lo + _SKELETON_STEP)
            data = skeleton.read(hi - lo)
            hits = [(at, crc) for at, crc in patches if at < hi and at + 4 > lo]
            if hits:
                data = bytearray(data)
                for at, crc in hits:
                    for k in range(4):
                        if lo <= at + k < hi:
                            data[at + k - lo] = crc[k]
            sink(data)

    pos = 0
    for off, nb, i in _rewritten(records):
        skeleton_span(pos, off)
        done, crc = 0, 0
        for piece in pieces(i):
            sink(piece)
            crc = zlib.crc32(piece, crc)
            done += memoryview(piece).nbytes
        if done != nb:
            fail(where, f"tensor {i} decodes to {done} bytes, its record says {nb}: corrupted")
        if records[i]["crc_at"] and crc != crcs[i]:
            fail(where, f"tensor {i} does not have the CRC-32 its zip headers record: corrupted")
        pos = off + nb
    skeleton_span(pos, size)
