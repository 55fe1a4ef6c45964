"""Codebook sets: one book, or a group of alternative books, per (tensor kind, dtype,
stream), saved as versioned JSON.

Every rank of a job must hold the same set; a frame names the book (or group) of each
stream by id, and a decoder refuses ids it does not hold. A set's
:attr:`~CodebookSet.digest` covers every key and id, so ranks can compare one string.

A :class:`CodebookGroup` holds up to 16 books for one stream; the encoder codes each
chunk with whichever of them makes it smallest and records the choice in the chunk
table. One book fits a kind's *average* distribution; the layers of a model differ in
its shape (not only in scale, which the per-chunk reference exponent absorbs): on
TinyLM's bf16 gradients, frames were 1.71 % above an ideal per-chunk Huffman coder with
one book and 0.88 % with a group of five (:mod:`comm_codec.books.profiler` grows the group
from the warmup's chunk histograms).

Lookups fall back when a kind has no book of its own: ``reduced_gradient`` uses
``gradient``, ``optimizer_state`` uses ``weight``, and so on (:data:`FALLBACK`); each
fallback is logged once.

File format (``codebooks/README.md`` has the long form)::

    {"format": "comm_codec.codebooks", "version": 1,
     "meta": {"source": ..., "steps": ..., "world_size": ..., "created": ...},
     "books": [{"kind": "gradient", "dtype": "bf16", "stream": 0,
                "entropy_bits": 2.71, "expected_bits": 2.74, "book": {<Codebook.to_dict()>}},
               {"kind": "weight", "dtype": "bf16", "stream": 0,
                "group": "<group id>", "books": [{<Codebook.to_dict()>}, ...]},   # version 2
               ...]}

Files are written as version 1 unless a key holds a group of more than one book.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from importlib import resources

import numpy as np

from ._json import loads as json_loads
from .atomic import atomic_write
from .huffman import Codebook, CodebookError
from .quoting import printable, shown
from .streams import spec_for

__all__ = ["CodebookSet", "CodebookGroup", "KINDS", "FALLBACK", "CodebookError", "as_codebook_set"]

log = logging.getLogger(__name__)

KINDS = ("gradient", "reduced_gradient", "activation", "weight", "optimizer_state")
# Where to look when a kind has no book of its own, nearest statistics first.
FALLBACK = {
    "gradient": ("reduced_gradient", "activation", "optimizer_state", "weight"),
    "reduced_gradient": ("gradient", "activation", "optimizer_state", "weight"),
    "activation": ("gradient", "reduced_gradient", "weight", "optimizer_state"),
    "weight": ("optimizer_state", "gradient", "reduced_gradient", "activation"),
    "optimizer_state": ("gradient", "weight", "reduced_gradient", "activation"),
}
_FILE_FORMAT = "comm_codec.codebooks"
_FILE_VERSION = 2  # 2 adds groups; version 1 files (single books) are read and, without groups, written
_FILE_VERSIONS = (1, 2)
_DEFAULT_NAME = "default.json"
# Largest codebook file read: a book takes ~400 bytes of JSON, the shipped set 180 kB.
MAX_FILE_BYTES = 64 << 20
# Integers a codebook file holds are small (streams, lengths, counts): more digits than
# this is no codebook file, and int() of thousands of digits is slow or refused.
_MAX_DIGITS = 30
# What parsing a codebook file may hold (core._json.estimate): the shipped 1 MB set needs ~40 MB.
_MAX_PARSE_BYTES = 256 << 20
_default_cache: CodebookSet | None = None


def as_codebook_set(books) -> CodebookSet:
    """Return books as a :class:`CodebookSet`: a set itself, a path to a saved one, or None.

    Every API that takes books (the codec, the hooks, the cost functions) accepts the
    same three forms through this function.

    Args:
        books: a :class:`CodebookSet`; a ``str`` or ``os.PathLike`` path to a file
            written by :meth:`CodebookSet.save`; or None for :meth:`CodebookSet.default`.

    Returns:
        The :class:`CodebookSet`.

    Raises:
        TypeError: anything else.
        CodebookError: the path does not exist, or the file is not a valid codebook file.
    """
    if books is None:
        return CodebookSet.default()
    if isinstance(books, (str, os.PathLike)):
        if not os.path.exists(books):  # a FIFO or device goes on to the loader, which refuses it by name
            raise CodebookError(
                f"codebooks={os.fspath(books)!r}: no such file; allowed: a CodebookSet, the path "
                "of a file saved by CodebookSet.save, or None"
            )
        return CodebookSet.load(books)
    if not isinstance(books, CodebookSet):
        raise TypeError(f"codebooks must be a CodebookSet, a path to a saved one, or None, got {type(books).__name__}")
    return books


def check_kind(kind: str) -> str:
    """Return kind if it is one of :data:`KINDS`, else raise ValueError naming them."""
    if kind not in KINDS:
        raise ValueError(f"unknown tensor kind {kind!r}; expected one of {', '.join(KINDS)}")
    return kind


class CodebookGroup:
    """Alternative books for one stream, tried per chunk.

    The encoder codes each chunk's stream with the book that gives it the fewest bits
    (ties to the lower index) and stores the index in the chunk table, so a group never
    codes worse than its first book. A group of one book is that book: same id, same
    frames.

    Args:
        books: 1 to :attr:`MAX_BOOKS` :class:`Codebook` objects, distinct; a raw book only
            alone.

    Raises:
        TypeError: a member that is not a Codebook.
        ValueError: no books, too many, a duplicate, or a raw book in a group.
    """

    MAX_BOOKS = 16  # four bits per stream in the chunk table

    __slots__ = ("books", "id")

    def __init__(self, books):
        if isinstance(books, Codebook):
            books = (books,)
        books = tuple(books)
        if not 1 <= len(books) <= self.MAX_BOOKS:
            raise ValueError(f"a codebook group holds 1..{self.MAX_BOOKS} books, got {len(books)}")
        for b in books:
            if not isinstance(b, Codebook):
                raise TypeError(f"a codebook group holds Codebooks, got {type(b).__name__}")
        if len(books) > 1:
            if any(b.raw for b in books):
                raise ValueError("a raw book cannot be part of a group of several books")
            if len({b.id for b in books}) != len(books):
                raise ValueError("a codebook group holds the same book twice")
        self.books = books
        if len(books) == 1:
            self.id = books[0].id
        else:
            h = hashlib.blake2b(digest_size=8, person=b"comm_codec.grp1")
            for b in books:
                h.update(bytes.fromhex(b.id))
            self.id = h.hexdigest()

    @property
    def id_int(self) -> int:
        """The id as the u64 a frame header stores (0 for a raw book)."""
        return 0 if self.raw else int(self.id, 16)

    @property
    def raw(self) -> bool:
        """True if the stream is stored raw (a group of one raw book)."""
        return self.books[0].raw

    @property
    def primary(self) -> Codebook:
        """The first book: the one fitted to the kind's average distribution."""
        return self.books[0]

    def symbol_bits(self) -> np.ndarray:
        """float64[nbooks, 256]: each book's cost of each symbol (escape included)."""
        return np.stack([b.symbol_bits() for b in self.books])

    def __len__(self) -> int:
        return len(self.books)

    def __iter__(self):
        return iter(self.books)

    def __getitem__(self, i) -> Codebook:
        return self.books[i]

    def __eq__(self, other) -> bool:
        return isinstance(other, CodebookGroup) and self.id == other.id

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"CodebookGroup({len(self)} books, id={self.id})"

    def to_dict(self) -> dict:
        """Return the group as JSON-ready data (a single book's dict for a group of one)."""
        if len(self) == 1:
            return {"book": self.primary.to_dict()}
        return {"group": self.id, "books": [b.to_dict() for b in self.books]}

    @classmethod
    def from_dict(cls, entry: dict) -> CodebookGroup:
        """Rebuild a group from :meth:`to_dict` output (checks the group id).

        Raises:
            CodebookError: a malformed member or a wrong group id.
        """
        if "books" in entry:
            if not isinstance(entry["books"], list):
                raise CodebookError("'books' must be a list of books")
            try:
                group = cls([Codebook.from_dict(b) for b in entry["books"]])
            except (ValueError, TypeError) as exc:
                if isinstance(exc, CodebookError):
                    raise
                raise CodebookError(str(exc)) from None
            if entry.get("group") != group.id:
                raise CodebookError(f"group id {shown(entry.get('group'))} does not match its books ({group.id})")
            return group
        return cls(Codebook.from_dict(entry["book"]))


class CodebookSet:
    """Books keyed by (kind, dtype name, stream), with metadata.

    Args:
        books: mapping of ``(kind, dtype, stream)`` to a :class:`Codebook` or a
            :class:`CodebookGroup` (or a list of Codebooks); dtype is a torch dtype or a
            short name such as ``"bf16"``.
        meta: free-form JSON-ready metadata (source model, steps, world size, date...).
        stats: optional per-key dict of numbers (entropy_bits, expected_bits...) saved
            beside each book.

    Raises:
        ValueError: an unknown kind, dtype or stream number, or an invalid group.
        TypeError: a value that is not a Codebook or a group of them.
    """

    def __init__(self, books: dict | None = None, meta: dict | None = None, stats: dict | None = None):
        self._groups: dict[tuple[str, str, int], CodebookGroup] = {}
        self._stats: dict[tuple[str, str, int], dict] = {}
        self.meta = dict(meta or {})
        for key, book in (books or {}).items():
            kind, dtype, stream = key
            spec = spec_for(dtype)
            check_kind(kind)
            if not 0 <= int(stream) < spec.nstreams:
                raise ValueError(f"{spec.name} has streams 0..{spec.nstreams - 1}, got {stream}")
            if isinstance(book, (list, tuple)):
                book = CodebookGroup(book)
            if not isinstance(book, (Codebook, CodebookGroup)):
                raise TypeError(f"books[{key!r}] must be a Codebook or CodebookGroup, got {type(book).__name__}")
            norm = (kind, spec.name, int(stream))
            self._groups[norm] = book if isinstance(book, CodebookGroup) else CodebookGroup(book)
            if stats and key in stats:
                self._stats[norm] = dict(stats[key])
        self._by_id = {b.id: b for g in self._groups.values() for b in g if not b.raw}
        self._group_by_id = {g.id: g for g in self._groups.values() if not g.raw}
        self._warned: set = set()

    # -- lookup -------------------------------------------------------------------------
    def group(self, kind: str, dtype, stream: int) -> CodebookGroup:
        """Return the books for a kind, dtype and stream, falling back across kinds.

        Args:
            kind: one of :data:`KINDS`.
            dtype: torch dtype or short name.
            stream: stream number.

        Returns:
            The :class:`CodebookGroup` (a group of one for a single book).

        Raises:
            ValueError: unknown kind, or no book for this dtype and stream in any kind.
            TypeError: unsupported dtype.
        """
        check_kind(kind)
        name = spec_for(dtype).name
        group = self._groups.get((kind, name, stream))
        if group is not None:
            return group
        for other in FALLBACK[kind]:
            group = self._groups.get((other, name, stream))
            if group is not None:
                if (kind, name) not in self._warned:
                    self._warned.add((kind, name))
                    log.info("no %s book for %s; using the %s book", kind, name, other)
                return group
        raise ValueError(
            f"codebook set has no book for {name} stream {stream} (kind {kind!r}); "
            f"profile one with WarmupProfiler or use CodebookSet.default()"
        )

    def get(self, kind: str, dtype, stream: int) -> Codebook:
        """Return the (first) book for a kind, dtype and stream, falling back across kinds.

        Args, Raises: as :meth:`group`.

        Returns:
            The :class:`Codebook`: the only one, or the first of a group.
        """
        return self.group(kind, dtype, stream).primary

    def by_id(self, book_id: str) -> Codebook | None:
        """Return the book with this id (alone or inside a group), or None."""
        return self._by_id.get(book_id)

    def group_by_id(self, group_id: str) -> CodebookGroup | None:
        """Return the group (or single book, as a group of one) with this id, or None."""
        return self._group_by_id.get(group_id)

    def keys(self):
        """Return the sorted (kind, dtype, stream) keys."""
        return sorted(self._groups)

    def items(self):
        """Return sorted ((kind, dtype, stream), book) pairs, a group's first book for a group."""
        return [(k, self._groups[k].primary) for k in self.keys()]

    def groups(self):
        """Return sorted ((kind, dtype, stream), CodebookGroup) pairs."""
        return [(k, self._groups[k]) for k in self.keys()]

    def stats(self, key) -> dict:
        """Return the numbers saved beside one book (empty if none)."""
        return dict(self._stats.get(key, {}))

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, key) -> bool:
        return key in self._groups

    def __getitem__(self, key) -> Codebook:
        return self._groups[key].primary

    @property
    def digest(self) -> str:
        """A digest of every key and book (or group) id: equal sets have equal digests."""
        h = hashlib.blake2b(digest_size=16, person=b"comm_codec.set1")
        for key in self.keys():
            h.update(("%s/%s/%d=%s;" % (*key, self._groups[key].id)).encode())
        return h.hexdigest()

    def __or__(self, other: CodebookSet) -> CodebookSet:
        """Return a set with other's books added, other winning where both have a key."""
        if not isinstance(other, CodebookSet):
            return NotImplemented
        books = dict(self._groups)
        books.update(other._groups)
        stats = dict(self._stats)
        stats.update(other._stats)
        return CodebookSet(books, {**self.meta, **other.meta}, stats)

    def __eq__(self, other) -> bool:
        return isinstance(other, CodebookSet) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        nbooks = sum(len(g) for g in self._groups.values())
        extra = f", {nbooks} books in all" if nbooks != len(self) else ""
        return f"CodebookSet({len(self)} keys{extra}, digest={self.digest[:12]})"

    # -- files ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Return the set as a JSON-ready dict (the file format)."""
        books = []
        for (kind, dtype, stream), group in self.groups():
            entry = {"kind": kind, "dtype": dtype, "stream": stream}
            entry.update(self._stats.get((kind, dtype, stream), {}))
            entry.update(group.to_dict())
            books.append(entry)
        version = _FILE_VERSION if any(len(g) > 1 for _, g in self.groups()) else 1
        return {"format": _FILE_FORMAT, "version": version, "meta": self.meta, "books": books}

    def save(self, path) -> None:
        """Write the set as JSON, atomically (temp file + rename).

        Args:
            path: destination file.

        Raises:
            OSError: the file cannot be written.
        """
        # a temp file of its own (O_EXCL, O_NOFOLLOW) beside path, renamed over it when complete
        atomic_write(os.fspath(path), json.dumps(self.to_dict(), indent=1, sort_keys=False, allow_nan=False) + "\n")

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> CodebookSet:
        """Rebuild a set from :meth:`to_dict` output.

        Args:
            data: the dict.
            source: a name for error messages (the file path).

        Returns:
            The :class:`CodebookSet`.

        Raises:
            CodebookError: wrong format or version, or a malformed book; the message
                names the source and the entry.
        """
        if not isinstance(data, dict) or data.get("format") != _FILE_FORMAT:
            raise CodebookError(f"{source}: not a comm_codec codebook file (no format {_FILE_FORMAT!r})")
        if data.get("version") not in _FILE_VERSIONS:
            raise CodebookError(
                f"{source}: codebook file version {shown(data.get('version'))}; this build reads versions "
                + ", ".join(map(str, _FILE_VERSIONS))
            )
        entries = data.get("books")
        if not isinstance(entries, list):
            raise CodebookError(f"{source}: 'books' must be a list")
        books, stats = {}, {}
        for i, entry in enumerate(entries):
            try:
                stream = entry["stream"]
                if not (isinstance(stream, int) and not isinstance(stream, bool) and 0 <= stream < 256):
                    raise CodebookError(f"stream {shown(stream)} is not a stream number")
                if not (isinstance(entry["kind"], str) and isinstance(entry["dtype"], str)):
                    raise CodebookError("kind and dtype must be strings")
                key = (entry["kind"], entry["dtype"], stream)
                if "books" in entry and data["version"] < 2:
                    raise CodebookError("groups of books need codebook file version 2")
                books[key] = CodebookGroup.from_dict(entry)
                stats[key] = {
                    k: v for k, v in entry.items() if k not in ("kind", "dtype", "stream", "book", "books", "group")
                }
            except (KeyError, TypeError, AttributeError) as exc:
                raise CodebookError(
                    f"{source}: book entry {i} is malformed ({type(exc).__name__}: {printable(str(exc), 80)})"
                ) from None
            except CodebookError as exc:
                where = "/".join(printable(entry.get(k), 20) for k in ("kind", "dtype", "stream"))
                raise CodebookError(f"{source}: book entry {i} ({where}): {exc}") from None
        meta = data.get("meta", {})
        try:
            return cls(books, meta if isinstance(meta, dict) else {}, stats)
        except (ValueError, TypeError) as exc:
            raise CodebookError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path) -> CodebookSet:
        """Read a set written by :meth:`save`.

        Args:
            path: the JSON file.

        Returns:
            The :class:`CodebookSet`.

        Raises:
            FileNotFoundError: no such file.
            CodebookError: not valid JSON, or not a valid codebook file; the message
                names the file and the problem.
        """
        path = os.fspath(path)
        raw = _read_book_file(path)
        try:
            data = json_loads(
                raw, limit=_MAX_PARSE_BYTES, parse_constant=_no_constant, parse_int=_small_int, error=CodebookError
            )
        except CodebookError as exc:
            raise CodebookError(f"{path}: not a valid codebook file ({exc})") from None
        return cls.from_dict(data, source=path)

    @classmethod
    def default(cls) -> CodebookSet:
        """Return the books shipped with the package (``codebooks/default.json``).

        Returns:
            The shared default :class:`CodebookSet` (loaded once per process).

        Raises:
            FileNotFoundError: the package was installed without its codebooks.
        """
        global _default_cache
        if _default_cache is None:
            ref = resources.files("comm_codec._books").joinpath(_DEFAULT_NAME)
            with resources.as_file(ref) as path:
                if not os.path.exists(path):
                    raise FileNotFoundError(
                        f"default codebooks not found at {path}; reinstall comm_codec or run "
                        "launch_scripts/build_default_codebooks.py"
                    )
                _default_cache = cls.load(path)
        return _default_cache


def _no_constant(name: str):
    raise CodebookError(f"JSON {name} is no number a codebook file holds")


def _small_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_DIGITS:
        raise CodebookError(f"an integer of {len(text)} digits is no number a codebook file holds")
    return int(text)


def _read_book_file(path: str) -> bytes:
    """Read a codebook file: a regular file of at most MAX_FILE_BYTES, or CodebookError.

    The type is checked before ``open`` (a FIFO would block in it, a device never end)
    and again on the open descriptor, which is opened non-blocking.

    Raises:
        FileNotFoundError, PermissionError, IsADirectoryError: as ``open``.
        CodebookError: not a regular file, or larger than MAX_FILE_BYTES.
    """
    st = os.stat(path)
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(21, "Is a directory", path)
    if not stat.S_ISREG(st.st_mode):
        raise CodebookError(f"{path} is not a regular file (a FIFO, device or socket); give a codebook file")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CodebookError(f"{path} is not a regular file; give a codebook file")
        raw = fh.read(MAX_FILE_BYTES + 1)
    if len(raw) > MAX_FILE_BYTES:
        raise CodebookError(f"{path} is larger than {MAX_FILE_BYTES} bytes: not a codebook file")
    return raw
