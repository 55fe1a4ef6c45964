"""Warmup profiler: symbol statistics of the first steps, averaged into fixed codebooks.

The single-stage method (Huffman coding with fixed books built from averaged warmup
statistics): every observation's per-stream symbol histogram is *normalized* to a
distribution, the distributions are averaged per (kind, dtype, stream), and one book is
built from the average. Averaging normalized distributions keeps one huge tensor from
drowning the statistics of many small ones, which is what a book must fit.

Histograms are taken by the same numba kernel that defines the encoder's symbols
(per-chunk relative exponents, exact zeros left out), so a book fits what it will code.

One book fits the average; the layers of a model differ in the *shape* of their exponent
distribution, and the encoder can pick, per chunk, the best of a group of books
(:class:`~comm_codec.core.codebooks.CodebookGroup`). So the profiler also keeps the chunks'
own histograms (at most ``max_rows`` per kind and dtype: past that, neighbouring rows are
merged) and :meth:`WarmupProfiler.build` grows each stream's group from the average
book: it adds a book seeded by the chunk that the current books fit worst, refits the
added books to the chunks that choose them (Lloyd iterations), and stops when another
book saves less than ``min_gain`` of the stream's bits or at ``max_books``. Everything
is integer arithmetic over counts, so every rank builds the same books.

**What is worth coding depends on where the frame goes.** A stream's decode cost
follows its code lengths: the exponent stream's codes are 2-3 bits, and one 12-bit
table lookup of the decoder yields four to six of them, while a mantissa byte's book
has 7-9-bit codes, one symbol per lookup: decoding it costs about what the exponent
stream costs, and storing it raw costs a copy. On the wire a coded stream pays only if
the time its bytes save on the link exceeds what coding and decoding it add: at
1 Gbit/s a byte on the link costs 8 ns and a long-code symbol ~2 ns to encode and
decode, so a stream must save about a quarter of its bits to pay there, and more on a
faster link. So for the wire kinds (gradients, reduced gradients, activations) a
stream other than the exponent stream is coded only where its books save at least
``wire_min_gain`` (10 %) of its bits: MiniLM's dense fp32 gradients' second byte saves
2.4 % of its bits (0.6 % of the ratio) and coded halves the decode speed. Weights and
optimizer state (:data:`STORED_KINDS`) mostly go to checkpoints, where a byte stored
outweighs decode speed: their streams are coded from a ``_RAW_MIN_GAIN`` (1.5 %) gain.
Whatever the kind, the encoder then codes a later stream chunk by chunk only where it
saves 1/32 of that chunk's bytes (:data:`comm_codec.kernels.layout.MIN_SAVING_SHIFT`):
EfficientNet-Lite0's fp32 weights, under the shipped books, coded their lowest byte in
205 of 287 chunks for 0.6 % of the frame; now 72 chunks keep 71 % of those bytes, and
the weights decode 1.4x as fast (ratio 1.2031 -> 1.2010; zipnn's 1.2002).
The checkpoint planner fits its own groups (:func:`grow_group`) and weighs it there.

The same weighing applies inside the exponent stream of fp16 and fp8, whose byte holds
the exponent and the bits under it (fp16: ``[e5 m3]``, 4-10-bit codes, one or two a
lookup). On the wire (``Codec(split_exponent=True)``, the default) the frame codes the
exponent alone and stores the 3 bits under it raw (frame version 3): MiniLM's word
embeddings as fp16 decode 1.5x as fast for 0.6 % of ratio, e4m3 1.6x for 0.4 % (its top
mantissa bit stays with the exponent: all four of its low bits raw cost 1.6 %), e5m2
1.6x for 2 % (at 1 Gbit/s a byte more costs 8 ns, the decode saves 0.27 ns an element
for 0.014 bytes: 0.11 ns). The checkpoint writers keep
the whole byte coded (``split_exponent=False``). Either way the books are the ones built
here, over the whole byte: the exponent's code is derived from them
(:func:`comm_codec.core.huffman.exponent_lengths`), so one set of books serves both.

Distributed runs: :meth:`WarmupProfiler.statistics` gives the counts as plain arrays,
:func:`comm_codec.comm.agreement.sum_statistics` sums them over a process group, and
:meth:`WarmupProfiler.build` builds from the sum, so every rank builds byte-identical
books (:func:`comm_codec.comm.agreement.build_books` does the three in one call). This
module itself knows nothing of processes.
"""

from __future__ import annotations

import datetime
import logging
import typing

import numpy as np

from ..core.codebooks import CodebookGroup, CodebookSet, as_codebook_set, check_kind
from ..core.codec import DEFAULT_CHUNK_ELEMS
from ..core.huffman import Codebook, entropy_bits, optimal_lengths
from ..core.parallel import run_ranges, thread_count
from ..core.streams import as_bits, spec_for
from ..kernels.histogram import chunk_histograms_range, huffman_costs

if typing.TYPE_CHECKING:
    import torch

__all__ = [
    "WarmupProfiler",
    "ProfileStatistics",
    "STORED_KINDS",
    "WIRE_MIN_GAIN",
    "chunk_counts",
    "stream_counts",
    "coding_cost",
    "book_cost",
    "grow_group",
    "merge_rows",
]

log = logging.getLogger(__name__)

_LLOYD_ROUNDS = 12
# A stream whose average book is raw gets a group only if its first book saves this
# share of the stream's bits: every chunk then pays for a histogram pass in the
# planner. On the default books' weight rows the fp32 low mantissa bytes save 1.8 % and
# 2.3 % (all-MiniLM-L6-v2 and EfficientNet-Lite0 chunks with few significant bits), a
# bf16 second byte 0.1 %; torch.randn's own fp32 low byte 1.2 % (its generator's few
# random low bits), which is not worth a pass.
_RAW_MIN_GAIN = 0.015
# Kinds whose frames are mostly stored (checkpoints): ratio first. Every other kind is a
# wire kind, whose non-exponent streams must save WIRE_MIN_GAIN of their bits to be coded
# (see the module docs: a long-code stream decodes at about the exponent stream's cost).
STORED_KINDS = ("weight", "optimizer_state")
WIRE_MIN_GAIN = 0.10


def chunk_counts(
    tensor: torch.Tensor, chunk_elems: int = DEFAULT_CHUNK_ELEMS, streams=None
) -> tuple[np.ndarray, np.ndarray]:
    """Return the symbol counts of every chunk and stream, and each chunk's zero count.

    Args:
        tensor: a CPU tensor of a supported dtype (copied to the CPU if on a GPU).
        chunk_elems: the codec's chunk size.
        streams: which streams to count, e.g. ``(0,)`` for the exponents alone; None:
            all. The others cost nothing: a planner that will store a float's mantissa
            bytes raw need not histogram them (for fp32, three of four passes).

    Returns:
        ``(counts, zeros)``: int64[nchunks, len(streams), 256] (as :func:`stream_counts`
        counts them, chunk by chunk; ``counts[:, j]`` is stream ``streams[j]``; with
        ``streams=None``, ``counts[:, s]`` is stream s) and int64[nchunks].

    Raises:
        TypeError: unsupported dtype.
        ValueError: a stream number outside 0..nstreams-1 of the tensor's dtype.
    """
    # torch is imported only by callers that hold tensors (the checkpoint path passes arrays)
    device = getattr(tensor, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        tensor = tensor.detach().cpu()
    bits, spec = as_bits(tensor)
    if streams is None:
        chosen = np.arange(spec.nstreams, dtype=np.int64)
    else:
        chosen = np.array([int(s) for s in streams], dtype=np.int64)
        bad = [int(s) for s in chosen if not 0 <= s < spec.nstreams]
        if bad:
            raise ValueError(f"streams {bad} do not exist: {spec.name} has streams 0..{spec.nstreams - 1}")
    nchunks = -(-bits.size // chunk_elems)
    counts = np.empty((nchunks, chosen.size, 256), dtype=np.int64)
    zeros = np.empty(nchunks, dtype=np.int64)
    if nchunks:
        run_ranges(
            chunk_histograms_range,
            nchunks,
            thread_count(None),
            lambda lo, hi: (bits, chunk_elems, spec.exp_shift, chosen, counts, zeros, lo, hi),
        )
    return counts, zeros


def stream_counts(tensor: torch.Tensor, chunk_elems: int = DEFAULT_CHUNK_ELEMS) -> tuple[np.ndarray, int]:
    """Return the per-stream symbol counts the encoder would see, and the zero count.

    Args:
        tensor: a CPU tensor of a supported dtype (copied to the CPU if on a GPU).
        chunk_elems: the codec's chunk size (the reference exponent is per chunk).

    Returns:
        ``(counts, zeros)``: int64[nstreams, 256] symbol counts — exact (+0.0) zeros
        included only in chunks where they are rare (at most 1/8), since the encoder
        masks them out of chunks where they are common — and the number of zeros.

    Raises:
        TypeError: unsupported dtype.
    """
    per_chunk, zeros = chunk_counts(tensor, chunk_elems)
    return per_chunk.sum(axis=0), int(zeros.sum())


class ProfileStatistics:
    """What a profiler has seen, as plain arrays: the unit ranks sum before books are built.

    Attributes:
        sums: (kind, dtype name) -> (sum of normalized distributions float64[ns, 256],
            observations, raw counts [ns, 256]).
        rows: (kind, dtype name) -> kept chunk histograms int64[rows, ns, 256].
        max_rows: the row budget of the profiler that made them.
        rows_wanted: whether books are grown into groups (rows are used at all).
        world_size: how many ranks' statistics these are.
    """

    __slots__ = ("sums", "rows", "max_rows", "rows_wanted", "world_size")

    def __init__(self, sums: dict, rows: dict, max_rows: int, rows_wanted: bool, world_size: int):
        self.sums, self.rows, self.max_rows = sums, rows, max_rows
        self.rows_wanted, self.world_size = rows_wanted, world_size

    def merged_rows(self, key, limit: int) -> np.ndarray:
        """Return the rows of ``key`` merged down to at most ``limit`` (see :func:`merge_rows`)."""
        return merge_rows(self.rows[key], limit)


class WarmupProfiler:
    """Accumulate symbol distributions per (kind, dtype, stream) and build books.

    Args:
        chunk_elems: the chunk size of the codec the books are for.
        max_books: the largest group of books per stream (1: one average book).
        min_gain: the share of a stream's bits another book of its group must save.
        max_rows: chunk histograms kept per kind and dtype for the groups.
        wire_min_gain: the share of its bits a stream other than the exponent stream
            must save to be coded, for kinds outside :data:`STORED_KINDS` (decode cost:
            see the module docs).

    Raises:
        ValueError: an argument out of range.

    Example::

        prof = WarmupProfiler()
        for step in range(warmup_steps):
            ...
            prof.observe(param.grad, kind="gradient")
        books = prof.build()
    """

    def __init__(
        self,
        chunk_elems: int = DEFAULT_CHUNK_ELEMS,
        max_books: int = 8,
        min_gain: float = 0.001,
        max_rows: int = 2048,
        wire_min_gain: float = WIRE_MIN_GAIN,
    ):
        if not 1 <= int(max_books) <= CodebookGroup.MAX_BOOKS:
            raise ValueError(f"max_books must be in 1..{CodebookGroup.MAX_BOOKS}, got {max_books}")
        if not 0.0 <= float(min_gain) < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
        if int(max_rows) < 2:
            raise ValueError(f"max_rows must be at least 2, got {max_rows}")
        if not 0.0 <= float(wire_min_gain) < 1.0:
            raise ValueError(f"wire_min_gain must be in [0, 1), got {wire_min_gain}")
        self.wire_min_gain = float(wire_min_gain)
        self.chunk_elems = int(chunk_elems)
        self.max_books = int(max_books)
        self.min_gain = float(min_gain)
        self.max_rows = int(max_rows)
        # (kind, dtype name) -> [sum of normalized distributions (ns x 256), observations,
        #                        raw counts (ns x 256), zeros, elements]
        self._acc: dict[tuple[str, str], list] = {}
        # (kind, dtype name) -> (list of int64[rows, ns, 256] chunk histograms, total rows),
        # for the groups; merged down to max_rows as it grows (see chunk_rows)
        self._rows: dict[tuple[str, str], tuple[list, int]] = {}
        self.observations = 0

    def observe(self, tensor: torch.Tensor, kind: str = "gradient") -> None:
        """Add one tensor's symbol distributions to the statistics of its kind.

        Args:
            tensor: a tensor of a supported dtype (CPU, or GPU: copied to host).
            kind: one of :data:`comm_codec.KINDS`.

        Raises:
            ValueError: unknown kind.
            TypeError: unsupported dtype.
        """
        check_kind(kind)
        spec = spec_for(tensor.dtype)
        if tensor.numel() == 0:
            return
        per_chunk, chunk_zeros = chunk_counts(tensor, self.chunk_elems)
        counts, zeros = per_chunk.sum(axis=0), int(chunk_zeros.sum())
        key = (kind, spec.name)
        if self.max_books > 1:
            self._keep_rows(key, per_chunk)
        acc = self._acc.get(key)
        if acc is None:
            ns = spec.nstreams
            acc = self._acc[key] = [np.zeros((ns, 256)), 0, np.zeros((ns, 256), np.int64), 0, 0]
        totals = counts.sum(axis=1, keepdims=True)
        if totals[0, 0] > 0:  # an all-zero tensor has no symbol distribution
            acc[0] += counts / totals
            acc[1] += 1
        acc[2] += counts
        acc[3] += zeros
        acc[4] += tensor.numel()
        self.observations += 1

    def _keep_rows(self, key, per_chunk: np.ndarray) -> None:
        live = per_chunk[per_chunk[:, 0].sum(axis=1) > 0]  # all-zero chunks have no distribution
        parts, count = self._rows.get(key, ([], 0))
        parts.append(live)
        count += len(live)
        if count > 2 * self.max_rows:  # bound memory; copying on every call was quadratic
            parts = [self._merged_rows(parts)]
            count = len(parts[0])
        self._rows[key] = (parts, count)

    def _merged_rows(self, parts) -> np.ndarray:
        return merge_rows(np.concatenate(parts), self.max_rows)

    def chunk_rows(self, kind: str, dtype) -> np.ndarray | None:
        """Return the kept chunk histograms (int64[rows, nstreams, 256]) of a kind and
        dtype, at most ``max_rows`` (neighbours merged), or None if there are none."""
        entry = self._rows.get((kind, spec_for(dtype).name))
        if entry is None or not entry[1]:
            return None
        rows = self._merged_rows(entry[0])
        self._rows[(kind, spec_for(dtype).name)] = ([rows], len(rows))
        return rows

    # -- helpers that find the tensors of a training step ------------------------------
    def observe_gradients(self, model: torch.nn.Module, kind: str = "gradient") -> None:
        """Observe every parameter gradient of a model (call after backward)."""
        for p in model.parameters():
            if p.grad is not None:
                self.observe(p.grad, kind)

    def observe_parameters(self, model: torch.nn.Module, kind: str = "weight") -> None:
        """Observe every parameter of a model."""
        for p in model.parameters():
            self.observe(p.detach(), kind)

    def observe_optimizer(self, optimizer: torch.optim.Optimizer, kind: str = "optimizer_state") -> None:
        """Observe every floating-point tensor in an optimizer's state (Adam moments...)."""
        import torch

        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 1:
                    self.observe(value.detach(), kind)

    def attach_activations(self, modules, kind: str = "activation") -> list:
        """Observe the output of each module on every forward (forward hooks).

        Args:
            modules: an iterable of modules (e.g. the blocks of a transformer).
            kind: the kind to file the outputs under.

        Returns:
            The hook handles; call ``.remove()`` on each to stop observing.
        """
        import torch

        def hook(module, inputs, output):
            if isinstance(output, (tuple, list)):
                output = output[0]
            if isinstance(output, torch.Tensor):
                self.observe(output.detach(), kind)

        return [m.register_forward_hook(hook) for m in modules]

    def distribution(self, kind: str, dtype) -> np.ndarray | None:
        """Return the averaged normalized distributions (float64[nstreams, 256]) of this
        process's observations of a kind and dtype, or None if there were none."""
        acc = self._acc.get((kind, spec_for(dtype).name))
        if acc is None or acc[1] == 0:
            return None
        return acc[0] / acc[1]

    def kinds(self) -> list[tuple[str, str]]:
        """Return the (kind, dtype) pairs observed so far."""
        return sorted(self._acc)

    def statistics(self) -> ProfileStatistics:
        """Return this process's statistics as plain arrays, ready to be summed over ranks.

        :func:`comm_codec.comm.agreement.sum_statistics` sums them over a process group;
        :meth:`build` turns them (summed or not) into books.
        """
        keys = self.kinds()
        rows = {}
        for k in keys:
            kept = self.chunk_rows(*k)
            rows[k] = kept if kept is not None else np.zeros((0, self._acc[k][2].shape[0], 256), np.int64)
        sums = {k: (self._acc[k][0].copy(), float(self._acc[k][1]), self._acc[k][2].copy()) for k in keys}
        return ProfileStatistics(sums, rows, self.max_rows, self.max_books > 1, 1)

    def build(self, meta: dict | None = None, statistics: ProfileStatistics | None = None) -> CodebookSet:
        """Build a :class:`CodebookSet` from the averaged distributions.

        Args:
            meta: extra metadata to store in the set.
            statistics: statistics to build from, e.g. this profiler's summed over every
                rank (:func:`comm_codec.comm.agreement.build_books` does both steps);
                None: this process's own (:meth:`statistics`).

        Returns:
            The books, with entropy and expected bits per book in their stats.

        Raises:
            ValueError: nothing (or only all-zero tensors) was observed.
        """
        summed = statistics if statistics is not None else self.statistics()
        keys, sums, rows, world = sorted(summed.sums), summed.sums, summed.rows, summed.world_size
        books, stats = {}, {}
        for kind, dtype in keys:
            dist_sum, n_obs, raw = sums[(kind, dtype)]
            if n_obs == 0:
                continue
            avg = dist_sum / n_obs
            for s in range(avg.shape[0]):
                # What this stream must save to be coded at all (the module docs say why).
                need = _RAW_MIN_GAIN if s == 0 or kind in STORED_KINDS else max(_RAW_MIN_GAIN, self.wire_min_gain)
                book = Codebook.from_counts(avg[s])
                if (
                    s > 0
                    and kind not in STORED_KINDS
                    and not book.raw
                    and book.expected_bits(avg[s]) > (1.0 - self.wire_min_gain) * 8.0
                ):
                    book = Codebook.raw_book()
                group = CodebookGroup(book)
                entry = {
                    "entropy_bits": round(entropy_bits(avg[s]), 4),
                    "expected_bits": round(book.expected_bits(avg[s]), 4),
                    "observations": int(n_obs),
                }
                if self.max_books > 1 and len(rows[(kind, dtype)]):
                    # A stream is coded only where its books pay for sizing it in every
                    # chunk (the planner's histogram pass, ~0.5 ns per element): an average
                    # book that beats raw storage on the chunks by less than _RAW_MIN_GAIN
                    # (the average of many small tensors can look compressible while the
                    # chunks, each one tensor, are not) is dropped for a raw start.
                    chunk_rows = rows[(kind, dtype)][:, s]
                    first = None if book.raw or not _beats_raw(chunk_rows, book, need) else book
                    group, chunk_bits = grow_group(chunk_rows, first, self.max_books, self.min_gain, need)
                    entry.update(chunk_bits)
                books[(kind, dtype, s)] = group
                stats[(kind, dtype, s)] = entry
        if not books:
            raise ValueError("cannot build codebooks from zero observations: call observe() on nonzero tensors first")
        info = {
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "observations": int(sum(v[1] for v in sums.values())),
            "world_size": world,
            "chunk_elems": self.chunk_elems,
            "method": "average of normalized per-observation distributions"
            + (f"; groups of up to {self.max_books} books fitted to chunk histograms" if self.max_books > 1 else ""),
        }
        info.update(meta or {})
        result = CodebookSet(books, info, stats)
        log.info(
            "built %d codebooks from %d observations (world size %d), digest %s",
            len(books),
            info["observations"],
            world,
            result.digest[:12],
        )
        return result


def merge_rows(rows: np.ndarray, limit: int) -> np.ndarray:
    """Halve rows by summing neighbours (consecutive chunks, mostly of one layer) until at
    most ``limit`` remain; nothing is dropped (an odd last row is kept as it is)."""
    while len(rows) > limit:
        even = len(rows) - len(rows) % 2
        merged = rows[0:even:2] + rows[1:even:2]
        rows = np.concatenate([merged, rows[even:]]) if even < len(rows) else merged
    return rows


def _book_bits(books) -> np.ndarray:
    """int64[nbooks, 256]: the exact bits each book spends on each symbol."""
    return np.stack([np.rint(b.symbol_bits()).astype(np.int64) for b in books])


def _beats_raw(rows: np.ndarray, book: Codebook, need: float = _RAW_MIN_GAIN) -> bool:
    """Whether book, with each chunk's raw fallback, saves the share need of raw storage on rows."""
    raw = 8 * rows.sum(axis=1)
    coded = _costs(rows, raw, [book]).min(axis=1)
    return int(coded.sum()) <= (1.0 - need) * int(raw.sum())


def _costs(rows: np.ndarray, base: np.ndarray, books: list) -> np.ndarray:
    """int64[nrows, 1 + len(books)]: column 0 the base cost of each row, then each book's bits."""
    cost = np.empty((len(rows), 1 + len(books)), dtype=np.int64)
    cost[:, 0] = base
    if books:
        cost[:, 1:] = rows @ _book_bits(books).T
    return cost


def grow_group(rows: np.ndarray, first: Codebook | None, max_books: int, min_gain: float, raw_gain: float = 0.0):
    """Grow a group of books from a first book (or from raw storage) over per-chunk histograms.

    Each round adds a book fitted to the chunk that the current books code worst
    relative to its own optimal Huffman code, then refits every added book to the
    chunks that choose it (the first book stays fixed: the group never codes a chunk
    worse than it), until a round saves less than ``min_gain`` of the bits or the group
    is full. With ``first=None`` the stream's average does not pay for coding (its book
    is raw) and the base is 8 bits per symbol, what the encoder stores a chunk in when
    no book of the group beats it: the group then holds only books for the chunks that
    are compressible (e.g. the low mantissa bytes of fp32 layers that were once fp16 or
    bf16), and is empty (raw) when none save ``min_gain``. Only integers are compared
    and ties go to the lower index: the same rows give the same books on every machine.

    Args:
        rows: int64[nrows, 256] symbol counts, one row per chunk.
        first: the group's first book (fitted to the average distribution), or None.
        max_books: the largest group to build.
        min_gain: the smallest share of the bits a round must save to be kept.
        raw_gain: with ``first=None``, the smallest share the first book must save
            (coding a raw stream at all costs the planner a pass over every chunk).

    Returns:
        ``(group, stats)``: the :class:`CodebookGroup` (the raw book's group when no book
        pays) and a dict with the rows' bits per symbol under the first book (or raw)
        alone, the group and per-chunk optimal codes.
    """
    rows = np.asarray(rows, dtype=np.int64)
    rows = rows[rows.sum(axis=1) > 0]
    symbols = int(rows.sum())
    fixed = [first] if first is not None else []
    base = (rows @ _book_bits(fixed).T)[:, 0] if fixed else 8 * rows.sum(axis=1)
    added: list = []
    best = base.copy()
    alone = total = int(best.sum())
    own = np.zeros(len(rows), dtype=np.int64)
    huffman_costs(rows, own)
    while len(fixed) + len(added) < max_books and len(rows):
        seed = int(np.argmax(best - own))
        trial = added + [Codebook.from_counts(rows[seed], raw_threshold=None)]
        if any(b.id == trial[-1].id for b in fixed + added):
            break
        choice = None
        for _ in range(_LLOYD_ROUNDS):
            new_choice = np.argmin(_costs(rows, base, trial), axis=1)  # 0: the base
            if choice is not None and np.array_equal(new_choice, choice):
                break
            choice = new_choice
            refit: list = []
            for k in range(1, len(trial) + 1):
                members = rows[choice == k]
                if len(members):
                    book = Codebook.from_counts(members.sum(axis=0), raw_threshold=None)
                    if all(book.id != b.id for b in fixed + refit):
                        refit.append(book)
            trial = refit
        trial_best = _costs(rows, base, trial).min(axis=1)
        trial_total = int(trial_best.sum())
        needed = max(min_gain, raw_gain) if not fixed and not added else min_gain
        if len(trial) <= len(added) or (total - trial_total) < needed * total:
            break
        added, best, total = trial, trial_best, trial_total
    books = fixed + added
    denom = max(symbols, 1)
    stats = {
        "group_size": len(books),
        "chunk_bits_one_book": round(alone / denom, 4),
        "chunk_bits_group": round(total / denom, 4),
        "chunk_bits_optimal": round(int(own.sum()) / denom, 4),
    }
    return CodebookGroup(books if books else Codebook.raw_book()), stats


def book_cost(books: CodebookSet, kind: str, dtype, counts: np.ndarray) -> tuple[float, float, float]:
    """Price per-stream symbol counts under fixed books, optimal codes and Shannon.

    Counts summed over chunks cannot say which book of a group each chunk would take:
    a group is priced by its first book here (:func:`coding_cost` prices whole groups).

    Args:
        books: the set whose (kind, dtype) books are priced (or a path to one; None: the defaults).
        kind: which books.
        dtype: torch dtype or short name.
        counts: int64[nstreams, 256] counts (e.g. from :func:`stream_counts`).

    Returns:
        ``(fixed_bits, optimal_bits, entropy_bits)``: total bits under the fixed books,
        under optimal Huffman codes built for these very counts (per stream, never worse
        than raw), and the Shannon bound of the counts.

    Raises:
        ValueError: no book for this kind and dtype.
    """
    books = as_codebook_set(books)
    name = spec_for(dtype).name
    fixed = optimal = entropy = 0.0
    for s in range(counts.shape[0]):
        c = counts[s]
        total = float(c.sum())
        if total == 0:
            continue
        fixed += float((c * books.get(kind, name, s).symbol_bits()).sum())
        optimal += min(float((c * optimal_lengths(c)).sum()), 8.0 * total)
        entropy += entropy_bits(c) * total
    return fixed, optimal, entropy


def coding_cost(
    tensor: torch.Tensor, books: CodebookSet, kind: str = "gradient", chunk_elems: int = DEFAULT_CHUNK_ELEMS
) -> tuple[float, float, float]:
    """Measure what fixed books cost on a tensor against the tensor's own optimum.

    Zeros count as :func:`stream_counts` counts them (where the codec codes them), so
    the comparison is of the books alone. A group of books is priced as the encoder
    uses it, each chunk with its cheapest book, so with groups the fixed bits can come
    out below one optimal code for the whole tensor.

    Args:
        tensor: the data.
        books: the set whose (kind, dtype) books are measured (or a path to one; None: the defaults).
        kind: which books.
        chunk_elems: the codec's chunk size.

    Returns:
        ``(fixed_bits, optimal_bits, entropy_bits)``: fixed as described; optimal and
        entropy as :func:`book_cost` gives them for the whole tensor's counts.

    Raises:
        TypeError: unsupported dtype. ValueError: no book for this kind and dtype.
    """
    books = as_codebook_set(books)
    per_chunk, _ = chunk_counts(tensor, chunk_elems)
    counts = per_chunk.sum(axis=0)
    _, optimal, entropy = book_cost(books, kind, tensor.dtype, counts)
    name = spec_for(tensor.dtype).name
    fixed = 0.0
    for s in range(counts.shape[0]):
        bits = books.group(kind, name, s).symbol_bits()  # float64[nbooks, 256]
        fixed += float((per_chunk[:, s].astype(np.float64) @ bits.T).min(axis=1).sum()) if len(per_chunk) else 0.0
    return fixed, optimal, entropy
