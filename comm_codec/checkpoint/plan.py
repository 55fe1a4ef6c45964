"""How the checkpoint compressor codes each tensor: transforms and book choice.

Used by :mod:`.exact`. A tensor's transform (none, or XOR with the
base's tensor), chunk size and per-stream books (its own, the shipped one, or raw) are
chosen from histograms of a sample of its chunks, by expected coded bits.
"""

from __future__ import annotations

import contextlib
import math
import threading

import numba
import numpy as np
import torch

from ..codebooks import CodebookSet
from ..codec import Codec
from ..huffman import RAW_THRESHOLD_BITS, Codebook, entropy_bits
from ..codebooks import CodebookGroup
from ..profiler import chunk_counts, grow_group
from .files import FileMap
from .formats import FileTensor

__all__ = ["CHUNK_SIZES", "TRANSFORMS", "BookChooser", "as_tensor", "make_codec", "plan_tensor"]

# What storing one per-tensor book costs in the (zstd-compressed) index, in bits.
_BOOK_COST_BITS = 160 * 8
# A per-tensor book built earlier is reused when it costs at most this many bits per
# symbol more (relative to the entropy) than on the tensor it was built for.
_REUSE_SLACK_BITS = 0.01
# Chunk sizes a tensor may be coded with. Offline, chunks can be larger than on the wire
# (Codec's default): each chunk codes its exponents relative to its own reference, which
# tracks scale changes inside a tensor (Adam moments gain) but, on a homogeneous tensor,
# only adds noise to what one per-tensor book must fit (weights lose ~0.04 bit/element
# with 64 Ki chunks). Each tensor gets whichever its sample says is smaller.
CHUNK_SIZES = (1 << 16, 1 << 18)
# Per-chunk bytes beyond the streams: table entry, lane lengths, lane padding (about).
_CHUNK_OVERHEAD_BYTES = 48
# Book choice looks at about this many elements of a tensor (whole chunks, spread out).
_SAMPLE_ELEMS = 1 << 18
# A tensor of at least this many chunks may get a group of books per stream, chosen chunk
# by chunk (frame version 2), when its sampled chunks say the group pays for its books.
_GROUP_MIN_CHUNKS = 8
_GROUP_MIN_ROWS = 6  # sampled chunks a group is fitted to, at least
_GROUP_MAX_BOOKS = 8
_GROUP_MIN_GAIN = 0.002
# Big tensors are sampled up to this many elements (16 chunks of 64 Ki) to fit a group.
_GROUP_SAMPLE_ELEMS = 1 << 20
# Books kept per (dtype, stream) for reuse by later tensors.
_MAX_REUSED_BOOKS = 64
_INT_NP = {1: np.uint8, 2: np.int16, 4: np.int32}


# -- transforms and book choice ---------------------------------------------------------------
def as_tensor(u8: np.ndarray, spec) -> torch.Tensor:
    """View (or copy, when misaligned) bytes as a 1-D tensor of spec's dtype."""
    if u8.ctypes.data % spec.itemsize:
        u8 = u8.copy()
    return torch.from_numpy(u8.view(_INT_NP[spec.itemsize])).view(spec.dtype)


def _xor(a: np.ndarray, b: np.ndarray, spec) -> np.ndarray:
    ints = _INT_NP[spec.itemsize]
    a = a if a.ctypes.data % spec.itemsize == 0 else a.copy()
    b = b if b.ctypes.data % spec.itemsize == 0 else b.copy()
    return np.bitwise_xor(a.view(ints), b.view(ints)).view(np.uint8)


class _Transform:
    """How a tensor's bits become what is coded (forward) and back (inverse).

    The seam for the lossy ExCP-style mode: a transform that prunes residuals and
    quantizes them would be one more subclass (and a container of its own magic).
    """

    name = "none"

    def forward(self, src: np.ndarray, base: np.ndarray | None, spec) -> np.ndarray:
        return src

    def inverse(self, coded: np.ndarray, base: np.ndarray | None, spec) -> np.ndarray:
        return coded


class _XorTransform(_Transform):
    """XOR with the base tensor's bits: unchanged bits become zeros (Hershcovitch et al.,
    ZipNN delta compression, 2024); exact repeats become zero elements the codec masks."""

    name = "xor"

    def forward(self, src, base, spec):
        return _xor(src, base, spec)

    def inverse(self, coded, base, spec):
        ints = _INT_NP[spec.itemsize]
        np.bitwise_xor(coded.view(ints), base.view(ints) if base.ctypes.data % spec.itemsize == 0
                       else base.copy().view(ints), out=coded.view(ints))
        return coded


TRANSFORMS = {t.name: t for t in (_Transform(), _XorTransform())}


class BookChooser:
    """Pick each stream's book: the tensor's own, the shipped one, or raw, by expected bits."""

    def __init__(self, shipped: CodebookSet):
        self.shipped = shipped
        self.chunk_elems = CHUNK_SIZES[0]  # the sampling unit
        self.books: dict[str, dict] = {}  # id -> {"origin", "book"} for the index
        self.groups: dict[str, list] = {}  # group id -> member book ids, for the index
        self._codecs: dict = {}
        self._built: dict = {}  # (dtype, stream) -> books built for earlier tensors
        self._lock = threading.Lock()

    def sample(self, u8: np.ndarray, spec) -> tuple[np.ndarray, float]:
        """Return whole chunks spread evenly over a tensor's bytes, and the scale to all.

        Whole chunks, aligned as the encoder cuts them, so each sampled chunk gets the
        reference exponent the encoder will give it; and only their pages are read.
        """
        chunk = self.chunk_elems * spec.itemsize
        nchunks = -(-u8.size // chunk)
        elems = _GROUP_SAMPLE_ELEMS if nchunks >= _GROUP_MIN_CHUNKS else _SAMPLE_ELEMS
        take = min(nchunks, max(1, elems // self.chunk_elems))
        if take == nchunks:
            return u8, 1.0
        picks = [(i * nchunks) // take for i in range(take)]
        parts = [u8[c * chunk:(c + 1) * chunk] for c in picks]
        sample = np.concatenate(parts)
        return sample, u8.size / sample.size

    def counts(self, sample: np.ndarray, scale: float, spec, chunk_elems: int):
        """Return the sample's per-stream counts scaled to the tensor, its zeros, and its
        per-chunk counts int64[nchunks, nstreams, 256] (unscaled)."""
        with _numba_threads(1):
            rows, zeros = chunk_counts(as_tensor(sample, spec), chunk_elems)
        return rows.sum(axis=0) * scale, float(zeros.sum()) * scale, rows

    def partial(self, rows: np.ndarray, scale: float) -> tuple[Codebook, float] | None:
        """A book for a stream that is raw on the whole but compressible in some chunks.

        The encoder stores a chunk's stream raw wherever its book would spend more, so a
        book fitted to the chunks that compress (some rows of an embedding, say) costs
        nothing on the others. Returns the book and the bits it saves (net of its place
        in the index), or None.
        """
        n = rows.sum(axis=1)
        p = rows / np.maximum(n, 1)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            ent = -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=1)
        pick = (ent < RAW_THRESHOLD_BITS - 0.25) & (n > 0)
        if not pick.any():
            return None
        book = Codebook.from_counts(rows[pick].sum(axis=0), raw_threshold=None)
        coded = np.minimum(rows @ book.symbol_bits(), 8.0 * n)
        saved = float(8.0 * n.sum() - coded.sum()) * scale - _BOOK_COST_BITS
        return (book, saved) if saved > 0 else None

    def group(self, rows: np.ndarray, book: Codebook, scale: float) -> tuple[CodebookGroup, float] | None:
        """A group grown from ``book`` over sampled chunks, and the bits it saves (net of the
        new books' place in the index), or None when it does not pay."""
        group, stats = grow_group(rows, book, _GROUP_MAX_BOOKS, _GROUP_MIN_GAIN)
        if len(group.books) < 2:
            return None
        symbols = float(rows.sum()) * scale
        saved = (stats["chunk_bits_one_book"] - stats["chunk_bits_group"]) * symbols
        saved -= (len(group.books) - 1) * _BOOK_COST_BITS
        return (group, saved) if saved > 0 else None

    def choose(self, counts: np.ndarray, kind: str, spec) -> tuple[list[Codebook], list[str], float]:
        """Return the books, their origins and the expected coded bits of the tensor."""
        books, origins, total = [], [], 0.0
        for s in range(spec.nstreams):
            c = counts[s]
            n = float(c.sum())
            options = [(8.0 * n, Codebook.raw_book(), "raw")]
            if n:
                try:
                    shipped = self.shipped.get(kind, spec.name, s)
                    options.append((shipped.expected_bits(c) * n, shipped, f"shipped:{kind}/{spec.name}/{s}"))
                except ValueError:
                    pass
                h = entropy_bits(c)
                # A book of its own costs at least the entropy, plus its place in the index
                # when new: skip it when even that cannot beat the best option so far.
                if h * n < min(o[0] for o in options) and h < RAW_THRESHOLD_BITS:
                    options.append(self._own(c, n, h, spec.name, s, min(o[0] for o in options)))
            bits, book, origin = min(options, key=lambda o: o[0])
            books.append(book)
            origins.append(origin)
            total += bits
        return books, origins, total

    def _own(self, c: np.ndarray, n: float, h: float, dtype: str, stream: int, best_so_far: float) -> tuple:
        """A book fitted to these counts.

        A book built for an earlier tensor is reused when it spends at most
        _REUSE_SLACK_BITS per symbol more, above the entropy, than it did on the tensor
        it was built for (so about what a new book would achieve; it is free, the file
        holds it already). Otherwise a new one is built and its cost in the index
        counted. Tensors are planned in file order, so the choice is deterministic.
        """
        built = self._built.get((dtype, stream))
        if built is None:
            # Symbol costs of the books built so far, one row each, so that weighing them
            # all against a tensor is one matrix-vector product.
            built = self._built[(dtype, stream)] = (np.empty((_MAX_REUSED_BOOKS, 256)), [], [])
        costs, books, redundancies = built
        if books:
            per_symbol = costs[: len(books)] @ c / n
            excess = per_symbol - h - np.asarray(redundancies)
            j = int(np.argmin(excess))
            if excess[j] <= _REUSE_SLACK_BITS:
                return float(per_symbol[j]) * n, books[j], "tensor"
        if h * n + _BOOK_COST_BITS >= best_so_far:  # a new book cannot pay for its place
            return math.inf, None, "tensor"
        book = Codebook.from_counts(c, raw_threshold=None)
        bits = book.expected_bits(c)
        if len(books) < _MAX_REUSED_BOOKS:
            costs[len(books)] = book.symbol_bits()
            books.append(book)
            redundancies.append(bits - h)
        return bits * n + _BOOK_COST_BITS, book, "tensor"

    def codec_for(self, books: list, origins: list[str], spec, chunk_elems: int):
        """Return a Codec that codes with these books (or groups) and chunks, and their ids."""
        ids = [b.id for b in books]
        with self._lock:
            for book, origin in zip(books, origins):
                members = book.books if isinstance(book, CodebookGroup) else (book,)
                if isinstance(book, CodebookGroup):
                    self.groups[book.id] = [b.id for b in members]
                for b in members:
                    if not b.raw and b.id not in self.books:
                        self.books[b.id] = {"origin": origin, "book": b.to_dict()}
            key = (spec.name, tuple(ids), chunk_elems)
            codec = self._codecs.get(key)
            if codec is None:
                codec = self._codecs[key] = make_codec(books, spec, chunk_elems)
        return codec, ids


def make_codec(books, spec, chunk_elems) -> Codec:
    keyed = {("weight", spec.name, s): b for s, b in enumerate(books)}
    return Codec(CodebookSet(keyed), threads=1, chunk_elems=chunk_elems)


def plan_tensor(t: FileTensor, src: FileMap, base: FileMap | None, base_tensor: FileTensor | None,
                 chooser: BookChooser) -> None:
    """Choose transform, chunk size and books of one tensor from a sample of its chunks."""
    spec = t.spec
    numel = t.nbytes // spec.itemsize
    sample, scale = chooser.sample(src.u8(t.offset, t.nbytes), spec)
    candidates = [("none", sample)]
    if base_tensor is not None:
        base_sample, _ = chooser.sample(base.u8(base_tensor.offset, t.nbytes), spec)
        candidates.append(("xor", _xor(sample, base_sample, spec)))

    def cost(transform, data, chunk_elems):
        counts, zeros, rows = chooser.counts(data, scale, spec, chunk_elems)
        books, origins, bits = chooser.choose(counts, t.kind, spec)
        if len(rows) >= _GROUP_MIN_ROWS:
            for st in range(spec.nstreams):
                if origins[st] == "raw":
                    found = chooser.partial(rows[:, st, :], scale)
                    if found is not None:
                        books[st], origins[st] = found[0], "tensor"
                        bits -= found[1]
                elif origins[st] == "tensor":
                    found = chooser.group(rows[:, st, :], books[st], scale)
                    if found is not None:
                        books[st] = found[0]
                        bits -= found[1]
        bits += min(zeros * spec.nstreams * 8, numel)  # zeros: coded, or one mask bit each
        bits += -(-numel // chunk_elems) * _CHUNK_OVERHEAD_BYTES * 8
        return bits, transform, chunk_elems, books, origins, data

    # The transform at the small chunk size, then the large chunks for the winner only.
    best = min((cost(tr, data, CHUNK_SIZES[0]) for tr, data in candidates), key=lambda c: c[0])
    if numel > CHUNK_SIZES[0]:  # else one chunk either way
        best = min(best, cost(best[1], best[5], CHUNK_SIZES[1]), key=lambda c: c[0])
    _, t.transform, t.chunk_elems, books, origins, _ = best
    if t.transform != "none":
        t.base_offset = base_tensor.offset
    t.codec, t.books = chooser.codec_for(books, origins, spec, t.chunk_elems)
    t.coding = "frame"


@contextlib.contextmanager
def _numba_threads(n: int):
    """Run numba kernels on n threads in this thread (numba's setting is per thread)."""
    previous = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(previous)


