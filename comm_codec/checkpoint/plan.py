"""How the checkpoint compressor codes each tensor: transforms and book choice.

Used by :mod:`.exact` (tensors of a file, :func:`plan_tensor`) and :mod:`.dcp` (tensors in
memory, :func:`plan_bytes`). A tensor's transform (none, or XOR with the
base's tensor), chunk size and per-stream books (its own, the shipped one, or raw) are
chosen from histograms of a sample of its chunks, by expected coded bits.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from ..core.codebooks import CodebookGroup, CodebookSet
from ..core.codec import Codec
from ..core.huffman import RAW_THRESHOLD_BITS, Codebook
from ..kernels import plan as _plan
from ..kernels.layout import MIN_SAVING_SHIFT
from .files import FileMap
from .formats import FileTensor

__all__ = [
    "CHUNK_SIZES",
    "GROUP_MIN_ROWS",
    "TRANSFORMS",
    "BookChooser",
    "Sample",
    "make_codec",
    "plan_bytes",
    "plan_tensor",
]

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
# Sampled chunks a group (or a book for a stream's compressible chunks) is fitted to, at
# least: fewer and the tensor gets single books only.
GROUP_MIN_ROWS = 6
_GROUP_MAX_BOOKS = 8
_GROUP_MIN_GAIN = 0.002
_GROUP_REACH = 0.025  # see BookChooser._own_options
# Big tensors are sampled up to this many elements (16 chunks of 64 Ki) to fit a group.
_GROUP_SAMPLE_ELEMS = 1 << 20
# A sample too small to fit a group to is counted on every _COUNT_EVERY-th element of each
# chunk, where that leaves at least _COUNT_MIN elements: the books and chunk sizes it
# chooses come out the same (TinyLM's bf16 and fp32 weights: the same files to the byte;
# its Adam state, its .pt and all-MiniLM-L6-v2's files within 0.004 % of their size), for
# a quarter of the counting, which was 15 % of compressing a 6.7 MB file. Samples for
# groups are counted whole, a group being fitted chunk by chunk, and so are tensors with a
# base (plan_tensor).
_COUNT_EVERY = 4
_COUNT_MIN = 1 << 14
# A stream whose every sampled chunk shows at least this entropy (bits per symbol, bias
# corrected) on every _RAW_LOOK_STEP-th element is stored raw without a full count: no
# book codes it below RAW_THRESHOLD_BITS (and a chunk of it below 7.6 bits, what a book
# for partly compressible streams needs). bf16's and fp32's mantissa bytes of trained
# weights show 7.99 here. Only chunks of at least _RAW_LOOK_MIN_ELEMS elements are looked at.
_RAW_LOOK_BITS = 7.8
_RAW_LOOK_STEP = 16
_RAW_LOOK_MIN_ELEMS = 1 << 15
# Books kept per (dtype, stream) for reuse by later tensors.
_MAX_REUSED_BOOKS = 64
_INT_NP = {1: np.uint8, 2: np.int16, 4: np.int32}
# One raw book for every option that stores a stream raw: building one per stream and
# tensor would cost 2 % of a small file's compress.
_RAW_BOOK = Codebook.raw_book()
_NO_BOOKS = np.zeros((0, 256), dtype=np.int64)
# Small chunks whose streams' entropies agree within this (bits per symbol) are alike
# enough for the large chunks alone to settle the chunk size (_large_chunks_cover).
_ALIKE_BITS = 0.05  # price_stream's group for a stream priced raw only


# -- transforms and book choice ---------------------------------------------------------------
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
        np.bitwise_xor(
            coded.view(ints),
            base.view(ints) if base.ctypes.data % spec.itemsize == 0 else base.copy().view(ints),
            out=coded.view(ints),
        )
        return coded


TRANSFORMS = {t.name: t for t in (_Transform(), _XorTransform())}


@dataclasses.dataclass
class Sample:
    """Whole chunks of a tensor: element bits, and where each chunk lies in them.

    Attributes:
        bits: element bits (``spec.bits_dtype``): the tensor's own bytes, or a copy of
            the sampled chunks.
        starts, lengths: int64 arrays: chunk k is ``bits[starts[k]:starts[k] + lengths[k]]``.
        scale: the tensor's elements per counted element.
        at: int64 array: the element of the tensor that chunk k starts at.
        every: each chunk's elements 0, every, 2 * every, ... are counted.
        whole: every chunk of the tensor is in the sample.
    """

    bits: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    scale: float
    at: np.ndarray
    every: int = 1
    whole: bool = True

    def xor(self, other: Sample, spec) -> Sample:
        """The same chunks XORed with another tensor's (its base), as one contiguous copy."""
        ints = np.dtype(f"u{spec.itemsize}")
        parts = [
            np.bitwise_xor(self.bits[a : a + n].view(ints), other.bits[b : b + n].view(ints))
            for a, b, n in zip(self.starts, other.starts, self.lengths)
        ]
        starts = np.concatenate(([0], np.cumsum(self.lengths)[:-1])).astype(np.int64)
        return Sample(
            np.concatenate(parts).view(spec.bits_dtype),
            starts,
            self.lengths,
            self.scale,
            self.at,
            self.every,
            self.whole,
        )


class BookChooser:
    """Pick each stream's book: the tensor's own, the shipped one, or raw, by expected bits."""

    def __init__(self, shipped: CodebookSet):
        self.shipped = shipped
        self.chunk_elems = CHUNK_SIZES[0]  # the sampling unit
        self.books: dict[str, dict] = {}  # id -> {"origin", "book"} for the index
        self.groups: dict[str, list] = {}  # group id -> member book ids, for the index
        self._codecs: dict = {}
        self._built: dict = {}  # (dtype, stream) -> books built for earlier tensors
        self._shipped: dict = {}  # (kind, dtype, stream) -> (group, its symbol bits, cut-down groups)
        self._lock = threading.Lock()

    def sample(self, data, spec, offset: int = 0, nbytes: int | None = None, sparse: bool = True) -> Sample:
        """Return whole chunks spread evenly over a tensor's bytes (all of them for a small one).

        Whole chunks, aligned as the encoder cuts them, so each sampled chunk gets the
        reference exponent the encoder will give it; and only they are read. A tensor
        sampled whole is read with ``keep`` (:meth:`FileMap.u8`): its coder gets the same
        array instead of reading it again. Planning leaves the sample's bytes unchanged.

        Args:
            data: the tensor's bytes (a uint8 array), or a :class:`FileMap` holding them.
            spec: its stream layout.
            offset, nbytes: where the tensor lies in a FileMap (ignored for an array).
            sparse: count a sample too small for a group on every _COUNT_EVERY-th element
                (False: on every element).
        """
        if isinstance(data, np.ndarray):
            offset, nbytes = 0, data.size
            read = lambda a, n: data[a : a + n]  # noqa: E731
        else:
            read = lambda a, n: data.u8(offset + a, n)  # noqa: E731
        per = self.chunk_elems
        chunk = per * spec.itemsize
        nchunks = -(-nbytes // chunk)
        elems = _GROUP_SAMPLE_ELEMS if nchunks >= _GROUP_MIN_CHUNKS else _SAMPLE_ELEMS
        take = min(nchunks, max(1, elems // per))
        numel = nbytes // spec.itemsize
        # Python integers: planning a small tensor is a few dozen such steps, and each
        # numpy call on a handful of values costs a microsecond or more.
        first = [(i * nchunks) // take * per for i in range(take)]
        last = min(per, numel - first[-1]) if take else 0  # every chunk but the last is whole
        sampled = max(0, take - 1) * per + last
        every = _COUNT_EVERY if sparse and take < GROUP_MIN_ROWS and sampled >= _COUNT_EVERY * _COUNT_MIN else 1
        counted = sampled if every == 1 else (take - 1) * -(-per // every) + -(-last // every)
        starts = at = np.array(first, dtype=np.int64)
        lengths = np.full(take, per, dtype=np.int64)
        if take:
            lengths[-1] = last
        if take == nchunks:  # every chunk: the whole tensor, one read
            # kept for the coder, which reads the same bytes next (a small tensor is one
            # segment): planning reads nothing the coding does not
            u8 = (
                data.u8(offset, numel * spec.itemsize, keep=True)
                if isinstance(data, FileMap)
                else read(0, numel * spec.itemsize)
            )
            if u8.__array_interface__["data"][0] % spec.itemsize:
                u8 = u8.copy()
            bits = u8.view(spec.bits_dtype)
        else:  # the sampled chunks only, one after the other
            bits = np.concatenate(
                [read(int(a) * spec.itemsize, int(n) * spec.itemsize) for a, n in zip(starts, lengths)]
            ).view(spec.bits_dtype)
            starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
        return Sample(bits, starts, lengths, numel / max(1, counted), at, every, take == nchunks)

    def counts(self, sample: Sample, spec) -> dict:
        """Return, per chunk size in CHUNK_SIZES, the sampled chunks' symbol counts.

        One pass over the sampled 64 Ki pieces (:mod:`comm_codec.kernels.plan`) gives the
        byte histograms of every stream that can end up coded; a chunk of 256 Ki is four
        consecutive pieces (spread over the tensor when it is sampled, as the encoder
        would see them were they one chunk). A stream of which every piece looks random
        on every 16th element (over _RAW_LOOK_BITS bits of entropy, bias-corrected) is
        left out: it is stored raw. Only a chunk's counted elements (every
        ``sample.every``-th) are counted, and its references are the encoder's, taken from
        all of its elements.

        Returns:
            chunk_elems -> ``(rows, zeros, coded)``: int64[nchunks, nstreams, 256] counts as
            :func:`comm_codec.books.profiler.chunk_counts` gives them for the counted elements
            (rows of streams left out hold the symbol count, all at symbol 0), the zeros
            among them, and which streams were counted.
        """
        ns, npieces = spec.nstreams, sample.starts.size
        # Only chunks of enough elements say anything on a sparse look; a short last one
        # is left to them (it is stored raw too if they say so).
        step = _RAW_LOOK_STEP if bool((sample.lengths >= _RAW_LOOK_MIN_ELEMS).any()) else 1
        small, large = CHUNK_SIZES
        per = large // small
        zeros = np.empty(npieces, dtype=np.int64)
        flags = np.empty(ns, dtype=np.bool_)
        rows = np.empty((npieces, ns, 256), dtype=np.int64)
        rows_large = np.empty((-(-npieces // per), ns, 256), dtype=np.int64)
        _check(
            _plan.count_chunks(
                sample.bits,
                sample.starts,
                sample.lengths,
                sample.every,
                step,
                _RAW_LOOK_MIN_ELEMS,
                _RAW_LOOK_BITS,
                spec.exp_shift,
                per,
                zeros,
                flags,
                rows,
                rows_large,
            )
        )
        z, coded = float(zeros.sum()), flags.tolist()
        if len(rows_large) == npieces:  # one piece a chunk either way (a one-chunk tensor): the same rows
            rows_large = rows
        return {small: (rows, z, coded), large: (rows_large, z, coded)}

    def partial(self, rows: np.ndarray, s: int, scale: float) -> tuple[Codebook, float] | None:
        """A book for stream s, raw on the whole but compressible in some chunks.

        The encoder stores a chunk's stream raw wherever its book would not save enough
        (:data:`~comm_codec.kernels.layout.MIN_SAVING_SHIFT`), so a book fitted to the
        chunks that compress (some rows of an embedding, say) costs nothing on the
        others. Returns the book and the bits it saves (net of its place in the index),
        or None.
        """
        n = rows.sum(axis=1)
        pick = (_entropies(rows, n) < RAW_THRESHOLD_BITS - 0.25) & (n > 0)
        if not pick.any():
            return None
        book = Codebook.from_counts(rows[pick].sum(axis=0), raw_threshold=None)
        bits = (rows @ book.symbol_bits()).astype(np.float64)
        limit = 8.0 * (n if s == 0 else n - np.maximum(1, n >> MIN_SAVING_SHIFT))
        coded = np.where(bits < limit, bits, 8.0 * n)
        saved = float(8.0 * n.sum() - coded.sum()) * scale - _BOOK_COST_BITS
        return (book, saved) if saved > 0 else None

    def group(self, rows: np.ndarray, book: Codebook, scale: float) -> tuple[CodebookGroup, float] | None:
        """A group grown from ``book`` over sampled chunks, and the bits it saves (net of the
        new books' place in the index), or None when it does not pay."""
        from ..books.profiler import grow_group  # only for tensors big enough to group

        group, stats = grow_group(rows, book, _GROUP_MAX_BOOKS, _GROUP_MIN_GAIN)
        if len(group.books) < 2:
            return None
        symbols = float(rows.sum()) * scale
        saved = (stats["chunk_bits_one_book"] - stats["chunk_bits_group"]) * symbols
        saved -= (len(group.books) - 1) * _BOOK_COST_BITS
        return (group, saved) if saved > 0 else None

    def choose(
        self, rows: np.ndarray, scale: float, kind: str, spec, coded=None, *, whole: bool
    ) -> tuple[list, list[str], float]:
        """Return the books (or groups), their origins and the expected coded bits of the tensor.

        Every option is priced chunk by chunk as the encoder codes it: each sampled
        chunk's stream costs its cheapest book of the option, or 8 bits a symbol where
        raw storage is cheaper (the encoder's per-chunk fallback). A shipped group whose
        first book fits only the chunks that compress (fp32 weight streams 2 and 3 of
        the default books) is raw on the average and pays on those chunks alone; priced
        on the summed counts it lost to raw. Books the file does not hold yet are
        charged their place in the index.

        With at least GROUP_MIN_ROWS sampled chunks, an own book may grow into a group
        (chosen chunk by chunk), and a stream raw on the whole may get a book for the
        chunks that compress (:meth:`partial`).

        Args:
            rows: int64[nchunks, nstreams, 256] symbol counts of the sampled chunks.
            scale: tensor elements per counted element.
            kind: the tensor's kind (which shipped books).
            spec: its stream layout.
            coded: per stream, whether it was counted (False: raw, see :meth:`counts`).
            whole: whether the rows are of every chunk of the tensor (:attr:`Sample.whole`;
                not ``scale == 1``: a sample counted on every 4th element has scale 4).
        """
        grouped = len(rows) >= GROUP_MIN_ROWS  # enough sampled chunks to fit a group to
        books, origins, total = [], [], 0.0
        colsum = np.empty(256, dtype=np.int64)
        sums = np.empty(5)
        for s in range(spec.nstreams):
            counted = coded is None or coded[s]
            entry = self._shipped_entry(kind, spec.name, s) if counted else None
            _check(_plan.price_stream(rows, s, _NO_BOOKS if entry is None else entry[1], counted, colsum, sums))
            raw_bits = 8.0 * float(sums[0])  # integers: exact in any order
            if not raw_bits or not counted:  # raw is the only option
                books.append(_RAW_BOOK)
                origins.append("raw")
                total += raw_bits * scale
                continue
            options = [(raw_bits * scale, _RAW_BOOK, "raw")]
            shipped = None if entry is None else self._shipped_option(entry, float(sums[1]), int(sums[3]), whole)
            if shipped is not None:
                options.append(
                    (shipped[0] * scale + self._index_bits(shipped[1]), shipped[1], f"shipped:{kind}/{spec.name}/{s}")
                )
            # A book of its own costs at least each chunk's entropy (or raw), plus its
            # place in the index when new: skip it when even that cannot beat the best.
            best = min(o[0] for o in options)
            floor = float(sums[2]) * scale
            if floor < best:
                options += self._own_options(
                    rows, s, colsum, float(sums[4]), raw_bits, scale, spec.name, grouped, best, floor, whole
                )
            bits, book, origin = min(options, key=lambda o: o[0])
            books.append(book)
            origins.append(origin)
            total += bits
        return books, origins, total

    def _own_options(
        self,
        rows: np.ndarray,
        s: int,
        colsum: np.ndarray,
        h: float,
        raw_bits: float,
        scale: float,
        dtype: str,
        grouped: bool,
        best: float,
        floor: float,
        whole: bool,
    ) -> list:
        """Options of books fitted to the tensor: its own book, a group grown from it, or
        (a stream raw on the whole) a book for the chunks that compress.

        A group's saving is measured on the chunks it was fitted to: exact when they are
        the whole tensor, optimistic for a sample. So a group is grown for a sampled
        tensor only when its own book alone already beats ``best`` (the other options):
        on all-MiniLM-L6-v2's bf16 word embeddings a group grown on 16 of 179 chunks
        promised more than the shipped group and came out 1.6 kB larger. For a tensor
        sampled whole, a group (cheap to grow) is tried when the own book is within
        _GROUP_REACH of ``best``: on all-MiniLM-L6-v2 and its Adam state the groups that
        won saved 0.4-2.1 % over their first book, and none won from farther than 2.2 %.

        ``floor`` is what any book of the tensor's own costs at least (each chunk's
        entropy, or raw). Without enough chunks for a group, a new book is built only
        when ``floor`` plus its place in the index beats ``best``: one that cannot win
        is not built (building is most of planning a small tensor; on TinyLM's Adam
        state half the books built were never stored).

        ``colsum`` holds stream s's counts summed over the chunks, ``h`` their entropy in
        bits per symbol, ``raw_bits`` their raw cost; ``whole``: the chunks are all of the
        tensor's.
        """
        c = colsum * scale
        if h >= RAW_THRESHOLD_BITS:
            found = self.partial(rows[:, s, :], s, scale) if grouped else None
            return [] if found is None else [(raw_bits * scale - found[1], found[0], "tensor")]
        found = self._own(c, float(c.sum()), h, dtype, s, build=grouped or floor + _BOOK_COST_BITS < best)
        if found is None:
            return []
        book, new = found
        priced = np.empty(5)
        _check(_plan.price_stream(rows, s, book.symbol_bits()[None], False, np.empty(256, dtype=np.int64), priced))
        bits = float(priced[1]) * scale + (_BOOK_COST_BITS if new else 0.0)
        options = [(bits, book, "tensor")]
        reach = best * (1.0 + _GROUP_REACH) if whole else best
        found = self.group(rows[:, s, :], book, scale) if grouped and bits < reach else None
        if found is not None:
            options.append((bits - found[1], found[0], "tensor"))
        return options

    def _shipped_entry(self, kind: str, dtype: str, stream: int):
        """(group, int64[nbooks, 256] symbol bits, cut-down groups) of the shipped books for a
        stream, or None (no shipped book, or a raw one)."""
        key = (kind, dtype, stream)
        if key not in self._shipped:
            try:
                group = self.shipped.group(kind, dtype, stream)
            except ValueError:
                group = None
            self._shipped[key] = (
                None
                if group is None or group.raw
                else (group, np.ascontiguousarray(group.symbol_bits(), dtype=np.int64), {})
            )
        return self._shipped[key]

    def _shipped_option(self, entry, priced: float, used_mask: int, whole: bool):
        """(bits over the sampled chunks, book or group) of the shipped books for a stream, or None.

        The option is the shipped group cut down to the books that the sampled chunks
        choose (in the group's order): each book the file stores costs its place in the
        index, and the books nothing chose would be paid for in vain. A tensor known only
        from a sample (``whole`` False) keeps the whole group, for the chunks that were
        not sampled (measured on all-MiniLM-L6-v2's bf16 word embeddings, 16 of 179
        chunks sampled: the whole group of 16 books came out 2.5 kB smaller than the
        four the sample chose, its books' place in the index included).

        ``priced`` and ``used_mask`` are :func:`comm_codec.kernels.plan.price_stream`'s
        sum over the sampled chunks (each its cheapest book of the group, or raw) and the
        books the chunks chose where they beat raw.
        """
        group, _, cut = entry
        used = tuple(j for j in range(len(group)) if used_mask >> j & 1)
        if not used:
            return None
        if not whole:
            used = tuple(range(len(group)))
        if used not in cut:
            cut[used] = group[used[0]] if len(used) == 1 else CodebookGroup([group[k] for k in used])
        # The cut-down group's cheapest book of a chunk is its cheapest of all wherever
        # that beats raw (the book is in the cut), and raw is cheaper anyway elsewhere.
        return priced, cut[used]

    def _index_bits(self, option) -> float:
        """What the books of an option the file does not hold yet cost in its index."""
        members = option.books if isinstance(option, CodebookGroup) else (option,)
        return _BOOK_COST_BITS * sum(b.id not in self.books for b in members)

    def _own(
        self, c: np.ndarray, n: float, h: float, dtype: str, stream: int, build: bool = True
    ) -> tuple[Codebook, bool] | None:
        """A book fitted to these counts, and whether it is new to the file (None: no
        earlier book fits and ``build`` is False).

        A book built for an earlier tensor is reused when it spends at most
        _REUSE_SLACK_BITS per symbol more, above the entropy, than it did on the tensor
        it was built for (so about what a new book would achieve; it is free, the file
        holds it already). Otherwise a new one is built. Tensors are planned in file
        order, so the choice is deterministic.
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
                return books[j], False
        if not build:
            return None
        book = Codebook.from_counts(c, raw_threshold=None)
        if len(books) < _MAX_REUSED_BOOKS:
            costs[len(books)] = book.symbol_bits()
            books.append(book)
            redundancies.append(book.expected_bits(c) - h)
        return book, True

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


def make_codec(books, spec, chunk_elems, threads: int = 1) -> Codec:
    """Return the codec of one tensor's books (or groups), one per stream, keyed as "weight".

    Stored frames keep fp16's and fp8's ratio: no split exponents (a file is read far
    less often than it is kept).
    """
    keyed = {("weight", spec.name, s): b for s, b in enumerate(books)}
    return Codec(CodebookSet(keyed), threads=threads, chunk_elems=chunk_elems, split_exponent=False)


def plan_tensor(
    t: FileTensor, src: FileMap, base: FileMap | None, base_tensor: FileTensor | None, chooser: BookChooser
) -> None:
    """Choose transform, chunk size and books of one tensor of a file from a sample of its chunks.

    Args:
        t: the tensor (where it lies in ``src``, its dtype and kind); gets ``transform``,
            ``chunk_elems``, ``codec``, ``books`` and ``coding``.
        src: the file holding it.
        base, base_tensor: the base file and its tensor of the same name, or None.
        chooser: the file's :class:`BookChooser` (books already chosen are reused).
    """
    # A tensor that may become its XOR with the base is counted whole: that XOR is mostly
    # zeros and a few bits, and counted on every 4th element it cost delta files 0.04 %.
    sparse = base_tensor is None
    sample = chooser.sample(src, t.spec, t.offset, t.nbytes, sparse)
    base_sample = None if base_tensor is None else chooser.sample(base, t.spec, base_tensor.offset, t.nbytes, sparse)
    _plan_from(t, sample, base_sample, base_tensor, chooser)


def plan_bytes(t: FileTensor, data: np.ndarray, chooser: BookChooser) -> None:
    """Choose chunk size and books of a tensor held in memory, from a sample of its chunks.

    :func:`plan_tensor` for bytes that are in memory already (a state dict's tensor): no
    file, no base.

    Args:
        t: the tensor's record (``nbytes``, dtype and kind; ``offset`` is not used); gets
            ``transform`` ("none"), ``chunk_elems``, ``codec``, ``books`` and ``coding``.
        data: a uint8 array of the tensor's ``t.nbytes`` bytes.
        chooser: as for :func:`plan_tensor`.

    Raises:
        ValueError: data does not hold t.nbytes bytes.
    """
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.size != t.nbytes:
        raise ValueError(f"plan_bytes needs the tensor's {t.nbytes} bytes as a uint8 array")
    _plan_from(t, chooser.sample(data, t.spec), None, None, chooser)


def _plan_from(
    t: FileTensor, sample: Sample, base_sample: Sample | None, base_tensor: FileTensor | None, chooser: BookChooser
) -> None:
    spec = t.spec
    numel = t.nbytes // spec.itemsize
    candidates = [("none", sample)]
    if base_sample is not None:
        candidates.append(("xor", sample.xor(base_sample, spec)))

    def cost(transform, counts, chunk_elems):
        rows, zeros, coded = counts[chunk_elems]
        books, origins, bits = chooser.choose(rows, sample.scale, t.kind, spec, coded, whole=sample.whole)
        bits += min(zeros * sample.scale * spec.nstreams * 8, numel)  # zeros: coded, or one mask bit each
        bits += -(-numel // chunk_elems) * _CHUNK_OVERHEAD_BYTES * 8
        return bits, transform, chunk_elems, books, origins, counts

    small, large = CHUNK_SIZES
    counts = chooser.counts(sample, spec)  # the untransformed sample's, needed either way
    if len(candidates) == 1 and numel > small and _large_chunks_cover(counts):
        best = cost("none", counts, large)
    else:
        # The transform at the small chunk size, then the large chunks for the winner only.
        best = min(
            (cost(tr, counts if tr == "none" else chooser.counts(data, spec), small) for tr, data in candidates),
            key=lambda c: c[0],
        )
        if numel > small:  # else one chunk either way
            best = min(best, cost(best[1], best[5], large), key=lambda c: c[0])
    _, t.transform, t.chunk_elems, books, origins, _ = best
    if t.transform != "none":
        t.base_offset = base_tensor.offset
    t.codec, t.books = chooser.codec_for(books, origins, spec, t.chunk_elems)
    t.coding = "frame"


def _large_chunks_cover(counts: dict) -> bool:
    """Whether pricing the large chunks alone settles a tensor's chunk size.

    True when each sampled large chunk's symbol counts are the sums of its small
    chunks' (the same references, the same zero handling), there are too few small
    chunks to fit a group to, and the small chunks are alike: each stream's entropy
    within _ALIKE_BITS of every other small chunk's. Then every book option codes the
    same symbols either way and the large chunks spend less on their entries; what
    could still favour the small chunks, a per-chunk choice within a shipped group or
    a small chunk stored raw, needs chunks that differ (one fp16-like chunk among
    random fp32 ones: ``test_shipped_groups_are_priced_chunk_by_chunk``).

    Measured against pricing both sizes: TinyLM's files came out the same to the byte,
    all-MiniLM-L6-v2's bf16, fp16 and fp32 files 14, 8 and 5 millionths larger, and
    planning TinyLM's bf16 and fp32 weights took 4-6 % less time (7 and 5 of their 12
    tensors of 2-4 chunks qualify).
    """
    small, large = CHUNK_SIZES
    rows = counts[small][0]
    if len(rows) >= GROUP_MIN_ROWS:
        return False
    alike = _plan.chunks_alike(rows, counts[large][0], large // small, _ALIKE_BITS)
    if alike < 0:
        _check(_plan.STATUS_BAD_ARGS)
    return alike == 1


def _check(status: int) -> None:
    if status != _plan.STATUS_OK:  # our own arguments: a bug, not bad input
        raise RuntimeError(f"planning kernel refused its arguments (status {status})")


def _entropies(rows: np.ndarray, n: np.ndarray | None = None) -> np.ndarray:
    """Shannon entropy in bits per symbol of each row of counts (0 for an empty row);
    ``n``: the rows' sums, when the caller has them."""
    # log2(n) - sum(c log2 c) / n: one log over the counts, no division of each count.
    n = np.maximum(rows.sum(axis=1) if n is None else n, 1)
    h = np.log2(n) - (rows * np.log2(np.maximum(rows, 1))).sum(axis=1) / n
    return np.maximum(h, 0.0)  # rounding: a single symbol gives +-1e-16
