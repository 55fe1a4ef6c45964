"""Codebook sets: one book per (tensor kind, dtype, stream), saved as versioned JSON.

Every rank of a job must hold the same set; a frame names the book of each stream by id,
and a decoder refuses ids it does not hold. A set's :attr:`~CodebookSet.digest` covers
every key and book id, so ranks can compare one string.

Lookups fall back when a kind has no book of its own: ``reduced_gradient`` uses
``gradient``, ``optimizer_state`` uses ``weight``, and so on (:data:`FALLBACK`); each
fallback is logged once.

File format (``codebooks/README.md`` has the long form)::

    {"format": "comm_codec.codebooks", "version": 1,
     "meta": {"source": ..., "steps": ..., "world_size": ..., "created": ...},
     "books": [{"kind": "gradient", "dtype": "bf16", "stream": 0,
                "entropy_bits": 2.71, "expected_bits": 2.74, "book": {<Codebook.to_dict()>}},
               ...]}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from importlib import resources

from .huffman import Codebook, CodebookError
from .streams import spec_for

__all__ = ["CodebookSet", "KINDS", "FALLBACK", "CodebookError"]

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
_FILE_VERSION = 1
_DEFAULT_NAME = "default.json"
_default_cache: "CodebookSet | None" = None


def check_kind(kind: str) -> str:
    """Return kind if it is one of :data:`KINDS`, else raise ValueError naming them."""
    if kind not in KINDS:
        raise ValueError(f"unknown tensor kind {kind!r}; expected one of {', '.join(KINDS)}")
    return kind


class CodebookSet:
    """Books keyed by (kind, dtype name, stream), with metadata.

    Args:
        books: mapping of ``(kind, dtype, stream)`` to :class:`Codebook`; dtype is a
            torch dtype or a short name such as ``"bf16"``.
        meta: free-form JSON-ready metadata (source model, steps, world size, date...).
        stats: optional per-key dict of numbers (entropy_bits, expected_bits...) saved
            beside each book.

    Raises:
        ValueError: an unknown kind, dtype or stream number.
        TypeError: a value that is not a Codebook.
    """

    def __init__(self, books: dict | None = None, meta: dict | None = None, stats: dict | None = None):
        self._books: dict[tuple[str, str, int], Codebook] = {}
        self._stats: dict[tuple[str, str, int], dict] = {}
        self.meta = dict(meta or {})
        for key, book in (books or {}).items():
            kind, dtype, stream = key
            spec = spec_for(dtype)
            check_kind(kind)
            if not 0 <= int(stream) < spec.nstreams:
                raise ValueError(f"{spec.name} has streams 0..{spec.nstreams - 1}, got {stream}")
            if not isinstance(book, Codebook):
                raise TypeError(f"books[{key!r}] must be a Codebook, got {type(book).__name__}")
            norm = (kind, spec.name, int(stream))
            self._books[norm] = book
            if stats and key in stats:
                self._stats[norm] = dict(stats[key])
        self._by_id = {b.id: b for b in self._books.values() if not b.raw}
        self._warned: set = set()

    # -- lookup -------------------------------------------------------------------------
    def get(self, kind: str, dtype, stream: int) -> Codebook:
        """Return the book for a kind, dtype and stream, falling back across kinds.

        Args:
            kind: one of :data:`KINDS`.
            dtype: torch dtype or short name.
            stream: stream number.

        Returns:
            The :class:`Codebook`.

        Raises:
            ValueError: unknown kind, or no book for this dtype and stream in any kind.
            TypeError: unsupported dtype.
        """
        check_kind(kind)
        name = spec_for(dtype).name
        book = self._books.get((kind, name, stream))
        if book is not None:
            return book
        for other in FALLBACK[kind]:
            book = self._books.get((other, name, stream))
            if book is not None:
                if (kind, name) not in self._warned:
                    self._warned.add((kind, name))
                    log.info("no %s book for %s; using the %s book", kind, name, other)
                return book
        raise ValueError(
            f"codebook set has no book for {name} stream {stream} (kind {kind!r}); "
            f"profile one with WarmupProfiler or use CodebookSet.default()"
        )

    def by_id(self, book_id: str) -> Codebook | None:
        """Return the book with this id, or None."""
        return self._by_id.get(book_id)

    def keys(self):
        """Return the sorted (kind, dtype, stream) keys."""
        return sorted(self._books)

    def items(self):
        """Return sorted ((kind, dtype, stream), book) pairs."""
        return [(k, self._books[k]) for k in self.keys()]

    def stats(self, key) -> dict:
        """Return the numbers saved beside one book (empty if none)."""
        return dict(self._stats.get(key, {}))

    def __len__(self) -> int:
        return len(self._books)

    def __contains__(self, key) -> bool:
        return key in self._books

    def __getitem__(self, key) -> Codebook:
        return self._books[key]

    @property
    def digest(self) -> str:
        """A digest of every key and book id: equal sets have equal digests."""
        h = hashlib.blake2b(digest_size=16, person=b"comm_codec.set1")
        for key in self.keys():
            h.update(("%s/%s/%d=%s;" % (*key, self._books[key].id)).encode())
        return h.hexdigest()

    def __or__(self, other: "CodebookSet") -> "CodebookSet":
        """Return a set with other's books added, other winning where both have a key."""
        if not isinstance(other, CodebookSet):
            return NotImplemented
        books = dict(self._books)
        books.update(other._books)
        stats = dict(self._stats)
        stats.update(other._stats)
        return CodebookSet(books, {**self.meta, **other.meta}, stats)

    def __eq__(self, other) -> bool:
        return isinstance(other, CodebookSet) and self.digest == other.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __repr__(self) -> str:
        return f"CodebookSet({len(self)} books, digest={self.digest[:12]})"

    # -- files ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """Return the set as a JSON-ready dict (the file format)."""
        books = []
        for (kind, dtype, stream), book in self.items():
            entry = {"kind": kind, "dtype": dtype, "stream": stream}
            entry.update(self._stats.get((kind, dtype, stream), {}))
            entry["book"] = book.to_dict()
            books.append(entry)
        return {"format": _FILE_FORMAT, "version": _FILE_VERSION, "meta": self.meta, "books": books}

    def save(self, path) -> None:
        """Write the set as JSON, atomically (temp file + rename).

        Args:
            path: destination file.

        Raises:
            OSError: the file cannot be written.
        """
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        text = json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> "CodebookSet":
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
        if data.get("version") != _FILE_VERSION:
            raise CodebookError(
                f"{source}: codebook file version {data.get('version')!r}; this build reads version {_FILE_VERSION}"
            )
        entries = data.get("books")
        if not isinstance(entries, list):
            raise CodebookError(f"{source}: 'books' must be a list")
        books, stats = {}, {}
        for i, entry in enumerate(entries):
            try:
                key = (entry["kind"], entry["dtype"], int(entry["stream"]))
                books[key] = Codebook.from_dict(entry["book"])
                stats[key] = {k: v for k, v in entry.items() if k not in ("kind", "dtype", "stream", "book")}
            except (KeyError, TypeError) as exc:
                raise CodebookError(f"{source}: book entry {i} is malformed ({exc!r})") from None
            except CodebookError as exc:
                raise CodebookError(f"{source}: book entry {i} ({entry.get('kind')}/{entry.get('dtype')}/"
                                    f"{entry.get('stream')}): {exc}") from None
        meta = data.get("meta", {})
        try:
            return cls(books, meta if isinstance(meta, dict) else {}, stats)
        except (ValueError, TypeError) as exc:
            raise CodebookError(f"{source}: {exc}") from None

    @classmethod
    def load(cls, path) -> "CodebookSet":
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
        with open(path, "rb") as fh:
            raw = fh.read()
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CodebookError(f"{path}: not a valid codebook file (bad JSON: {exc})") from None
        return cls.from_dict(data, source=path)

    @classmethod
    def default(cls) -> "CodebookSet":
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
