"""The kernels' view of a codebook set: per-stream tables for one tuple of book groups.

:class:`comm_codec.Codec` keeps one :class:`KernelTables` per (kind, dtype) it encodes
(:func:`encode_tables`) and a bounded cache of them by the book ids that frames name
(:func:`decode_tables`, :class:`TablesCache`). The GPU host driver copies them to a
device once (:class:`comm_codec.core.gpu.DeviceTables`, kept in
:attr:`KernelTables.on_device`).
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from ..kernels.encode import PAIR_ENTRIES, pair_tables
from ..kernels.lanes import MULTI_BITS, multi_tables
from ..kernels.layout import DEC_ENTRIES
from .codebooks import CodebookGroup, CodebookSet
from .errors import FrameError
from .huffman import Codebook, split_tables

__all__ = ["KernelTables", "TablesCache", "encode_tables", "decode_tables", "RAW_ID"]

RAW_ID = "0" * 16  # the id a frame names for a stream stored raw
# Up to this many chunks, check_books checks a frame's books field by field in Python.
_FEW_CHUNKS = 8


class KernelTables:
    """Kernel-ready tables for one tuple of per-stream book groups.

    Attributes:
        ids: uint64[ns], each stream's group id (the frame header's book ids).
        nbooks: int64[ns], how many books each stream's group holds.
        enc_code, enc_len: uint32/uint8[ns, nbooks_max, 256] encoder tables.
        dec: uint16[ns, nbooks_max, 4096] decode tables.
        raw: bool[ns], streams whose book is raw.
        split: the bits under the exponent that stream 0's coded segments store raw (a
            frame with split exponents; its tables are
            :func:`comm_codec.core.huffman.split_tables`'), or 0.
        pairs: stream 0's pair tables for the CPU encoder, built on first use.
        on_device: torch.device -> :class:`comm_codec.core.gpu.DeviceTables`, filled by
            whoever copies the tables to a device.
    """

    __slots__ = (
        "ids",
        "nbooks",
        "enc_code",
        "enc_len",
        "dec",
        "raw",
        "split",
        "on_device",
        "_multi",
        "_pairs",
        "_limits",
    )

    def __init__(self, groups: list[CodebookGroup], split: int = 0):
        ns = len(groups)
        kmax = max(len(g) for g in groups)
        self.ids = np.array([g.id_int for g in groups], dtype=np.uint64)
        self.nbooks = np.array([len(g) for g in groups], dtype=np.int64)
        self._limits = tuple(len(g) for g in groups)
        self.enc_code = np.zeros((ns, kmax, 256), dtype=np.uint32)
        self.enc_len = np.zeros((ns, kmax, 256), dtype=np.uint8)
        self.dec = np.zeros((ns, kmax, DEC_ENTRIES), dtype=np.uint16)
        self.raw = np.array([g.raw for g in groups], dtype=np.bool_)
        self.split = int(split) if not groups[0].raw else 0
        self.on_device: dict = {}
        self._multi = None
        self._pairs = None
        for s, group in enumerate(groups):
            for k, book in enumerate(group):
                tables = split_tables(book, self.split) if s == 0 and self.split else book.tables()
                self.enc_code[s, k], self.enc_len[s, k], self.dec[s, k] = tables

    @property
    def multi(self) -> np.ndarray:
        """The multi-symbol decode tables, built on first use (4096 lookups per book)."""
        if self._multi is None:
            multi = np.zeros(self.dec.shape[:2] + (1 << MULTI_BITS,), dtype=np.uint64)
            multi_tables(self.dec, multi)
            self._multi = multi
        return self._multi

    @property
    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """Stream 0's pair tables (code uint32, length uint8; [nbooks, 65536] each), built on first use.

        The CPU encoder packs stream 0 two symbols per lookup in them
        (:func:`comm_codec.kernels.encode.pair_tables`): 320 KiB per book, so only the
        encoder builds them, once per tables object (shared by every codec with the same
        books: :func:`encode_tables`). Threads that race here build the same tables; the
        last one is kept.
        """
        pairs = self._pairs
        if pairs is None:
            nb = int(self.nbooks[0])
            code = np.empty((nb, PAIR_ENTRIES), dtype=np.uint32)
            length = np.empty((nb, PAIR_ENTRIES), dtype=np.uint8)
            pair_tables(self.enc_code[0, :nb], self.enc_len[0, :nb], code, length)
            pairs = self._pairs = (code, length)
        return pairs

    def check_books(self, books: np.ndarray) -> None:
        """Raise FrameError if a chunk names a book beyond its stream's group.

        Args:
            books: the chunk table's ``books`` column (book of stream s in bits 4s..4s+3).
        """
        if books.size <= _FEW_CHUNKS:  # a frame's few chunks: Python ints cost less than numpy calls
            limits = self._limits
            if all((b >> (4 * s)) & 15 < n for b in books.tolist() for s, n in enumerate(limits)):
                return
        for s, n in enumerate(self.nbooks):
            k = (books.astype(np.int64) >> (4 * s)) & 15
            if np.any(k >= n):
                bad = int(np.nonzero(k >= n)[0][0])
                raise FrameError(
                    f"chunk {bad} says stream {s} was coded with book {int(k[bad])} of its group, which holds {int(n)}"
                )


def encode_tables(codebooks: CodebookSet, kind: str, spec, split: bool = False) -> KernelTables:
    """Return the tables that encode ``kind`` tensors of ``spec``'s dtype with ``codebooks``.

    Args:
        codebooks, kind: the books to code with.
        spec: the dtype's :class:`~comm_codec.core.streams.StreamSpec`.
        split: split exponents where the dtype has bits under its exponent (fp16, fp8)
            and its stream 0 is coded.

    Raises:
        ValueError: an unknown kind, or a set without books for it (as
            :meth:`CodebookSet.group`).
    """
    shift = spec.split_bits if split else 0
    # Shared by content with every codec: the checkpoint writer makes a codec per file
    # and book tuple, and stream 0's pair tables take as long to build as coding a
    # 128 kB tensor.
    return _SHARED.get([codebooks.group(kind, spec.name, s) for s in range(spec.nstreams)], shift)


def decode_tables(codebooks: CodebookSet, ids: tuple, split: int = 0) -> KernelTables:
    """Return the tables that decode a frame whose streams name the book (group) ids ``ids``.

    Args:
        codebooks: the set to find the books in.
        ids: one 16-hex-digit id per stream (:attr:`FrameParameters.book_ids`); an id may
            name a group or one book of a group; :data:`RAW_ID` is a raw stream.
        split: the frame's :attr:`FrameParameters.split`.

    Raises:
        FrameError: an id that the set does not hold.
    """
    groups = []
    for s, book_id in enumerate(ids):
        if book_id == RAW_ID:
            groups.append(CodebookGroup(Codebook.raw_book()))
            continue
        group = codebooks.group_by_id(book_id)
        if group is None:
            book = codebooks.by_id(book_id)  # a member of a group, named alone
            group = CodebookGroup(book) if book is not None else None
        if group is None:
            raise FrameError(
                f"frame stream {s} was coded with codebook {book_id}, which this codec's "
                "codebook set does not hold; decode with the books it was encoded with"
            )
        groups.append(group)
    return _SHARED.get(groups, split)


class _SharedTables:
    """Encode and decode tables by the books' content, for every codec of the process (LRU, bounded).

    The checkpoint reader makes a codec per tensor book tuple on every file it opens,
    from books parsed out of that file: equal books, new objects. Keyed by what the
    tables are built from (each book's code lengths and escape length, exact bytes, not
    a digest), equal books share one build whatever codec or file they come from.
    """

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, groups: list, split: int) -> KernelTables:
        key = (split,) + tuple(tuple((b.raw, b.escape_length, b.lengths.tobytes()) for b in g) for g in groups)
        with self._lock:
            tables = self._entries.get(key)
            if tables is not None:
                self._entries.move_to_end(key)
                return tables
        tables = KernelTables(groups, split)
        with self._lock:
            self._entries[key] = tables
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return tables


# 16 tuples, shared by every codec: each at most 2.5 MiB of decode tables (see
# TablesCache) and, once encoded with, 320 KiB of pair tables per book of stream 0's group.
_SHARED = _SharedTables(16)


class TablesCache:
    """Decode tables by book-id tuple and split bits, least recently used out first; safe between threads.

    A job's frames name a handful of tuples (one per kind and dtype), but frames from an
    untrusted peer can name any mix of a set's ids, and each tuple's tables take up to
    2.5 MiB (per stream 16 books x 4096 entries of 2 + 8 bytes, plain and multi-symbol):
    the cache is bounded so that crafted frames cannot grow it.

    Args:
        maxsize: entries kept.
    """

    def __init__(self, maxsize: int):
        self.maxsize = int(maxsize)
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, codebooks: CodebookSet, ids: tuple, split: int = 0) -> KernelTables:
        """Return the cached tables for ``ids`` (and a frame's ``split``), building them
        (:func:`decode_tables`) if absent."""
        key = (ids, split)
        with self._lock:
            tables = self._entries.get(key)
            if tables is not None:
                self._entries.move_to_end(key)
                return tables
        tables = decode_tables(codebooks, ids, split)  # outside the lock: other threads keep decoding
        with self._lock:
            self._entries[key] = tables
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return tables

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, ids) -> bool:
        with self._lock:  # another thread's get() may insert or evict meanwhile
            return any(key[0] == ids for key in self._entries)
