"""Canonical, length-limited Huffman codebooks over the 256 byte symbols.

A :class:`Codebook` is the *model* half of the codec: code lengths, nothing else. The
coder half (the numba kernels) only ever sees the tables derived from it.

Choices, and why:

* **Maximum code length 12.** The decoder reads 12 bits and looks the symbol up in one
  4096-entry table (8 KiB of uint16, resident in L1 next to the input). 11 bits (huff0's
  choice) halves the table but, for a book that must keep every symbol codable, squeezes
  the common symbols harder; 12 keeps that loss under 0.1 % on real exponent streams.
* **Every symbol is codable, through an escape.** A fixed book will meet symbols its
  warmup never saw. Giving all 256 symbols a direct code would reserve 1/16 of the code
  space at 12 bits for symbols that almost never occur — about 3 % on a 2.7-bit exponent
  stream. Instead, symbols rarer than 2**-13 share one *escape* code followed by the
  symbol's 8 raw bits. The escape always exists when any symbol is escaped, so nothing
  is uncodable and the common symbols keep their ideal lengths.
* **Optimal length limiting**: package-merge (Larmore & Hirschberg 1990) over integer
  weights, so the book is the best possible prefix code under the limit.
* **Deterministic**: probabilities are quantised to integers (2**30 scale) before any
  comparison; every sort is by (weight, symbol), leaves before packages on ties; canonical
  codes are assigned by (length, symbol) with the escape as symbol 256. The same counts
  give the same book, byte for byte, on every machine and rank.
* **Raw books**: a stream that coding would shrink by less than ``RAW_THRESHOLD_BITS``
  is stored raw — a book that says so, with id 0.

Serialized form (inside a codebook-set JSON file; see ``codebooks/README.md``)::

    {"format": 1, "raw": false, "max_length": 12, "escape_length": 11,
     "lengths": ["0000000000000000", ...16 rows of 16 hex digits, one per symbol...],
     "id": "3f2a9c0d1e5b7a64"}

A length of 0 means "coded through the escape". The id is the first 8 bytes of a
BLAKE2b digest of the lengths; loading checks it and the Kraft inequality.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..kernels.codes import canonical_tables
from ..kernels.histogram import package_merge
from .errors import CodebookError
from .quoting import shown

__all__ = [
    "Codebook",
    "CodebookError",
    "MAX_CODE_LENGTH",
    "DECODE_BITS",
    "RAW_THRESHOLD_BITS",
    "entropy_bits",
    "optimal_lengths",
    "exponent_lengths",
    "split_tables",
]

MAX_CODE_LENGTH = 12
DECODE_BITS = 12
# A coded stream must beat raw by at least this much per symbol to be worth its time.
RAW_THRESHOLD_BITS = 7.85
# Symbols rarer than this go through the escape code.
_ESCAPE_BELOW = 2.0**-13
_WEIGHT_SCALE = 1 << 30
# Smallest weight the escape gets, so that unseen symbols stay codable at <= 12 bits.
_ESCAPE_FLOOR = _WEIGHT_SCALE >> 20
_FORMAT = 1
# Hex digits of code lengths, as the books' JSON writes them, and back (255: not a hex
# digit): a file's index holds dozens of books, read and written as arrays, not digit by digit.
_HEX_OUT = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_HEX_IN = np.full(256, 255, dtype=np.uint8)
_HEX_IN[_HEX_OUT] = np.arange(16)
_HEX_IN[np.frombuffer(b"ABCDEF", dtype=np.uint8)] = np.arange(10, 16)
_ESCAPE = 256
# Decode-table entry layout (uint16): symbol in bits 0-7, length in bits 8-11, escape flag.
DEC_LEN_SHIFT = 8
DEC_ESCAPE_FLAG = 0x8000


def _quantize(counts) -> np.ndarray:
    """Turn counts or probabilities into deterministic integer weights (sum ~ 2**30)."""
    c = np.asarray(counts, dtype=np.float64)
    if c.shape != (256,):
        raise ValueError(f"counts must have 256 entries, got shape {c.shape}")
    if not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError("counts must be finite and non-negative")
    total = float(c.sum())
    if total <= 0:
        raise ValueError("cannot build a codebook from zero observations (all counts are 0)")
    return np.floor(c / total * _WEIGHT_SCALE).astype(np.int64)


class Codebook:
    """A canonical Huffman code over byte symbols, or the "store raw" book.

    Build one with :meth:`from_counts`; the encoder and decoder tables are derived and
    cached. Two books with equal lengths are equal and share an :attr:`id`.

    Attributes:
        lengths: uint8[256], the code length of each symbol; 0 = coded through the escape.
        escape_length: length of the escape code, 0 when no symbol is escaped.
        raw: True for the book that stores its stream uncoded.
        id: 16 hex digits, a digest of the lengths ("0000000000000000" for raw).
    """

    __slots__ = ("lengths", "escape_length", "raw", "id", "_tables", "_symbol_bits")

    def __init__(self, lengths, escape_length: int = 0, raw: bool = False):
        """Make a book from code lengths, checking that they form a prefix code.

        Args:
            lengths: 256 code lengths in 0..12 (0 = escaped).
            escape_length: the escape code's length, required (1..12) iff any length is 0.
            raw: make the raw book (lengths and escape_length are then ignored).

        Raises:
            CodebookError: lengths out of range, a missing escape, or lengths that
                violate the Kraft inequality (no prefix code has them).
        """
        self.raw = bool(raw)
        self._tables = None
        self._symbol_bits = None
        if self.raw:
            self.lengths = np.full(256, 8, dtype=np.uint8)
            self.escape_length = 0
            self.id = "0" * 16
            return
        arr = np.asarray(lengths)
        if arr.shape != (256,) or not np.issubdtype(arr.dtype, np.integer):
            raise CodebookError(f"a codebook needs 256 integer code lengths, got {arr.shape}")
        if arr.min() < 0 or arr.max() > MAX_CODE_LENGTH:
            raise CodebookError(
                f"code lengths must lie in 0..{MAX_CODE_LENGTH}, got {int(arr.min())}..{int(arr.max())}"
            )
        escaped = bool((arr == 0).any())
        if escaped and not 1 <= escape_length <= MAX_CODE_LENGTH:
            raise CodebookError(
                f"some symbols are escaped (length 0) but escape_length is {escape_length}; "
                f"expected 1..{MAX_CODE_LENGTH}"
            )
        if not escaped and escape_length != 0:
            raise CodebookError("escape_length must be 0 when no symbol is escaped")
        used = arr[arr > 0].astype(np.int64)
        kraft = int((np.int64(1) << (MAX_CODE_LENGTH - used)).sum()) + (
            (1 << (MAX_CODE_LENGTH - escape_length)) if escaped else 0
        )
        if kraft > 1 << MAX_CODE_LENGTH:
            raise CodebookError(
                f"code lengths violate the Kraft inequality (sum 2^-l = {kraft / (1 << MAX_CODE_LENGTH):.6f} > 1)"
            )
        self.lengths = arr.astype(np.uint8)
        self.escape_length = int(escape_length)
        self.id = self._digest()

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_counts(cls, counts, raw_threshold: float | None = RAW_THRESHOLD_BITS) -> Codebook:
        """Build the optimal length-limited book for a symbol distribution.

        Args:
            counts: 256 non-negative counts or probabilities (not all zero).
            raw_threshold: return the raw book when the coded stream would cost at
                least this many bits per symbol; None never returns raw.

        Returns:
            A :class:`Codebook`.

        Raises:
            ValueError: wrong shape, negative or non-finite counts, or all zeros.
        """
        w = _quantize(counts)
        escaped = w < _ESCAPE_BELOW * _WEIGHT_SCALE
        symbols = np.nonzero(~escaped)[0]
        weights = w[symbols]
        if escaped.any():
            symbols = np.append(symbols, _ESCAPE)
            weights = np.append(weights, max(int(w[escaped].sum()), _ESCAPE_FLOOR))
        if (1 << MAX_CODE_LENGTH) < symbols.size:  # pragma: no cover - 257 symbols always fit
            raise ValueError(f"{symbols.size} symbols cannot be coded in {MAX_CODE_LENGTH} bits")
        lens = _limited_lengths(weights)
        lengths = np.zeros(256, dtype=np.uint8)
        esc_len = 0
        if symbols[-1] == _ESCAPE:
            esc_len = int(lens[-1])
            symbols, lens = symbols[:-1], lens[:-1]
        lengths[symbols] = lens
        book = cls(lengths, esc_len)
        if raw_threshold is not None and book.expected_bits(counts) >= raw_threshold:
            return cls.raw_book()
        return book

    @classmethod
    def raw_book(cls) -> Codebook:
        """Return the book that stores its stream uncoded (8 bits per symbol)."""
        return cls(None, raw=True)

    # -- properties -----------------------------------------------------------------
    def symbol_bits(self) -> np.ndarray:
        """Return the cost in bits of each of the 256 symbols under this book."""
        bits = self._symbol_bits
        if bits is None:  # a book does not change: computed once (the planner asks per tensor)
            if self.raw:
                bits = np.full(256, 8, dtype=np.int64)
            else:
                bits = self.lengths.astype(np.int64)
                bits[bits == 0] = self.escape_length + 8
            self._symbol_bits = bits
        return bits.copy()

    def expected_bits(self, counts) -> float:
        """Return the mean bits per symbol this book spends on a distribution.

        Args:
            counts: 256 non-negative counts or probabilities.

        Returns:
            Bits per symbol (8.0 for the raw book).
        """
        c = np.asarray(counts, dtype=np.float64)
        total = c.sum()
        if total <= 0:
            return 0.0
        return float((c * self.symbol_bits()).sum() / total)

    def _digest(self) -> str:
        h = hashlib.blake2b(digest_size=8, person=b"comm_codec.hf1")
        h.update(self.lengths.tobytes())
        h.update(bytes([self.escape_length]))
        digest = h.hexdigest()
        # Id 0 is reserved for the raw book in frames.
        return "0000000000000001" if digest == "0" * 16 else digest

    @property
    def id_int(self) -> int:
        """The id as the unsigned 64-bit integer stored in frame headers."""
        return int(self.id, 16)

    # -- tables for the kernels -------------------------------------------------------
    def tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return ``(enc_code, enc_len, dec)`` tables for the kernels (cached).

        enc_code (uint32[256]) holds each symbol's code bit-reversed for LSB-first
        packing, an escaped symbol's being the escape code followed by its 8 bits;
        enc_len (uint8[256]) the total bits; dec (uint16[4096]) maps the next 12 input
        bits to symbol | length << 8 | escape flag, 0 where no code starts (an
        incomplete code).
        """
        if self._tables is None:
            self._tables = self._build_tables()
        return self._tables

    def _build_tables(self):
        enc_code = np.zeros(256, dtype=np.uint32)
        enc_len = np.zeros(256, dtype=np.uint8)
        dec = np.zeros(1 << DECODE_BITS, dtype=np.uint16)
        if self.raw:
            enc_code[:] = np.arange(256, dtype=np.uint32)
            enc_len[:] = 8
            return enc_code, enc_len, dec
        canonical_tables(self.lengths, self.escape_length, DEC_ESCAPE_FLAG, enc_code, enc_len, dec)
        return enc_code, enc_len, dec

    # -- serialization --------------------------------------------------------------
    def to_dict(self) -> dict:
        """Return the book as a JSON-ready dict (see the module docstring)."""
        if self.raw:
            return {"format": _FORMAT, "raw": True, "id": self.id}
        hexes = _HEX_OUT[self.lengths].tobytes().decode("ascii")
        return {
            "format": _FORMAT,
            "raw": False,
            "max_length": MAX_CODE_LENGTH,
            "escape_length": self.escape_length,
            "lengths": [hexes[i : i + 16] for i in range(0, 256, 16)],
            "id": self.id,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Codebook:
        """Rebuild a book from :meth:`to_dict` output, checking format, Kraft and id.

        Args:
            data: the dict.

        Returns:
            The :class:`Codebook`.

        Raises:
            CodebookError: unknown format version, malformed fields, Kraft violated, or
                an id that does not match the lengths (a corrupted or edited file).
        """
        if not isinstance(data, dict):
            raise CodebookError(f"a codebook must be a JSON object, got {type(data).__name__}")
        if data.get("format") != _FORMAT:
            raise CodebookError(
                f"unsupported codebook format {shown(data.get('format'))}; this version reads format {_FORMAT}"
            )
        if data.get("raw"):
            book = cls.raw_book()
        else:
            if data.get("max_length", MAX_CODE_LENGTH) != MAX_CODE_LENGTH:
                raise CodebookError(f"codebook max_length {shown(data.get('max_length'))} is not {MAX_CODE_LENGTH}")
            rows = data.get("lengths")
            if not isinstance(rows, list) or not all(isinstance(r, str) for r in rows):
                raise CodebookError("codebook 'lengths' must be a list of hex strings")
            text = "".join(rows)
            if len(text) != 256:
                raise CodebookError(f"codebook 'lengths' must hold 256 hex digits, got {len(text)}")
            chars = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)  # code points
            digits = _HEX_IN[np.minimum(chars, 255)]  # 255 (and beyond) is no digit
            bad = np.flatnonzero(digits == 255)
            if bad.size:
                raise CodebookError(
                    f"codebook 'lengths' is not hexadecimal: {text[int(bad[0])]!r} at digit {int(bad[0])}"
                )
            lengths = digits.astype(np.int64)
            esc = data.get("escape_length", 0)
            if not isinstance(esc, int) or isinstance(esc, bool):
                raise CodebookError("codebook 'escape_length' must be an integer")
            book = cls(lengths, esc)
        if "id" in data and data["id"] != book.id:
            raise CodebookError(
                f"codebook id {shown(data['id'])} does not match its lengths (digest {book.id}); "
                "the file is corrupted or was edited"
            )
        return book

    # -- comparisons ----------------------------------------------------------------
    def __eq__(self, other) -> bool:
        return isinstance(other, Codebook) and self.id == other.id and self.raw == other.raw

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        if self.raw:
            return "Codebook(raw)"
        used = int((self.lengths > 0).sum())
        return (
            f"Codebook(id={self.id}, direct={used}, escape_length={self.escape_length}, "
            f"max_length={int(self.lengths.max())})"
        )


def exponent_lengths(book: Codebook, shift: int) -> np.ndarray:
    """Return the code lengths of a book's exponents alone, for frames with split exponents.

    A frame with split exponents (``comm_codec/core/frame_format.md``) codes stream 0's
    symbol ``b`` as the exponent ``b >> shift`` in a code of its own, the ``shift`` bits
    under it stored raw. That code is derived from the stream's book, so the same books
    serve both kinds of frame and every rank derives the same code: each exponent's
    weight is the probability the book implies for its ``2**shift`` symbols, in integer
    units of 2**-20 (``2**(20 - length)`` a symbol, the escape's length plus 8 for an
    escaped one), and the lengths are package-merge's, limited to
    :data:`MAX_CODE_LENGTH`, over the weights sorted by (weight, exponent). Every
    exponent gets a code (the smallest weight is 1): no escape.

    Args:
        book: a coded book (not the raw one).
        shift: the low bits of a stream-0 byte stored raw (the dtype's ``split_bits``, 1..7).

    Returns:
        int64[256 >> shift], each exponent's code length.

    Raises:
        ValueError: the raw book, or a shift outside 1..7.
    """
    if book.raw:
        raise ValueError("the raw book has no exponent code: a raw stream is stored as it is")
    if not 1 <= shift <= 7:
        raise ValueError(f"shift must lie in 1..7, got {shift}")
    bits = book.symbol_bits()  # an escaped symbol costs its escape and its 8 bits
    weights = (np.int64(1) << (20 - bits)).reshape(256 >> shift, 1 << shift).sum(axis=1)
    return _limited_lengths(weights)


def _limited_lengths(weights: np.ndarray) -> np.ndarray:
    """Optimal code lengths of at most MAX_CODE_LENGTH bits for these weights (int64[]).

    Ties are broken by position (a stable sort), so the lengths depend on the weights alone.
    """
    order = np.argsort(weights, kind="stable")
    lengths = np.empty(weights.size, dtype=np.int64)
    lengths[order] = package_merge(weights[order].astype(np.int64), MAX_CODE_LENGTH)
    return lengths


def split_tables(book: Codebook, shift: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return the kernels' ``(enc_code, enc_len, dec)`` for stream 0 with split exponents.

    The code is :func:`exponent_lengths`'; the tables are :meth:`Codebook.tables`'
    layout, indexed and filled so that the kernels use them as they use a book's:
    ``enc_code`` and ``enc_len`` are indexed by the whole symbol byte and hold its
    exponent's code (the bits under it go to the plane), and ``dec`` yields the exponent
    shifted back up by ``shift``, its low bits 0 for the plane's bits.

    Args:
        book: a coded book.
        shift: bits under the coded part (the dtype's ``split_bits``, 1..7).

    Returns:
        uint32[256], uint8[256], uint16[4096] (the decode table has no escape entry).

    Raises:
        ValueError: as :func:`exponent_lengths`.
    """
    lengths = np.zeros(256, dtype=np.uint8)
    lengths[: 256 >> shift] = exponent_lengths(book, shift)
    code = np.zeros(256, dtype=np.uint32)
    length = np.zeros(256, dtype=np.uint8)
    dec = np.zeros(1 << DECODE_BITS, dtype=np.uint16)
    canonical_tables(lengths, 0, DEC_ESCAPE_FLAG, code, length, dec)
    exponent = np.arange(256) >> shift
    slots = dec != 0
    dec[slots] = ((dec[slots] & 255) << shift) | (dec[slots] & 0xFF00)
    return code[exponent], length[exponent], dec


def entropy_bits(counts) -> float:
    """Return the Shannon entropy, in bits per symbol, of a 256-symbol distribution.

    Args:
        counts: non-negative counts or probabilities.

    Returns:
        Entropy in bits (0.0 for an empty distribution).
    """
    c = np.asarray(counts, dtype=np.float64)
    total = c.sum()
    if total <= 0:
        return 0.0
    p = c[c > 0] / total
    return float(-(p * np.log2(p)).sum())


def optimal_lengths(counts) -> np.ndarray:
    """Return unlimited-length optimal Huffman code lengths (0 for absent symbols).

    Used as the "ideal per-chunk Huffman" yardstick in benchmarks and reports, not by
    the codec.

    Args:
        counts: 256 non-negative integer counts.

    Returns:
        int64[256] code lengths.
    """
    import heapq

    c = np.asarray(counts, dtype=np.int64)
    present = [int(s) for s in np.nonzero(c)[0]]
    lengths = np.zeros(256, dtype=np.int64)
    if len(present) == 1:
        lengths[present[0]] = 1
        return lengths
    heap = [(int(c[s]), s, (s,)) for s in present]
    heapq.heapify(heap)
    tie = 256
    while len(heap) > 1:
        wa, _, a = heapq.heappop(heap)
        wb, _, b = heapq.heappop(heap)
        for s in a + b:
            lengths[s] += 1
        heapq.heappush(heap, (wa + wb, tie, a + b))
        tie += 1
    return lengths
