"""Offline checkpoint compression: any checkpoint file in, the same bytes back out.

:func:`compress_file` finds the tensors inside a safetensors file or a ``torch.save`` zip
*without unpickling anything* and codes each one with :class:`~comm_codec.Codec`; every
other byte (headers, pickles, zip directories, tensors of dtypes the codec cannot code,
files of unknown format) is coded with zstd. :func:`decompress_file` writes the original
file back, byte for byte, and checks its digest before the output appears. ``base=``
codes each tensor as the XOR of its bit pattern with the same-named tensor of a previous
checkpoint (the *original* file), which is cheap when training changed few bits.

Example::

    >>> from comm_codec import checkpoint
    >>> s = checkpoint.compress_file("weights_bf16.safetensors", "w.cckp")      # doctest: +SKIP
    >>> print(s.line())                                                        # doctest: +SKIP
    compressed 6.65 MB -> 4.41 MB (ratio 1.509) in 0.03 s, 0.260 GB/s
    >>> checkpoint.compress_file("step1100.safetensors", "step1100.cckp",
    ...                          base="step1000.safetensors")                  # doctest: +SKIP

The file is a container (:mod:`.container`: header, coded segments, JSON index,
trailer) under its own magic (:data:`MAGIC`), which differs from a frame's and from the
lossy container's, so no reader takes a lossy file for an exact one. The source is cut
into *segments* that cover it in order: pieces of about :data:`PIECE_BYTES` of each
tensor (whole chunks), coded as codec frames, and the bytes between tensors, coded with
zstd (level 3) or stored. Pieces bound memory and code in parallel, in order, on worker
threads. What the index records, and every check a reader makes of it, is
:mod:`.exact_index`; every byte of the container is checked on the way back (header
fields, segment layout and zero padding, CRCs, frame checksums, and the digest of the
restored file).

How a tensor is coded is decided from a sample of its chunks, by expected coded bits
(:mod:`.plan`): per stream, a book built for the tensor (stored in the index, or one
built for an earlier tensor that fits as well), the shipped book of its kind, or raw;
chunks of 64 Ki or 256 Ki elements; with a base, XOR or not. Tensors under
:data:`MIN_CODED_BYTES` stay with the zstd-coded bytes around them. The lossy ExCP-style
mode is :mod:`comm_codec.checkpoint.lossy`, a container of its own (:data:`LOSSY_MAGIC`).

Untrusted input: nothing read from a source, base or compressed file is ever unpickled
(torch pickles are scanned opcode by opcode, :mod:`.pickle_scan`); codebooks and
metadata are JSON; every length and offset is checked before use; a failure raises
:class:`CheckpointError` and leaves no output file behind. Files are read, written and
hashed by :mod:`.files`.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
import io
import logging
import os
import tempfile
import threading
import time
import zlib

import numpy as np
import zstandard

from ..core.atomic import create_temp
from ..core.codebooks import CodebookSet, as_codebook_set
from ..core.frame import FrameError
from ..core.huffman import Codebook
from ..core.quoting import printable
from ..core.streams import spec_for
from .container import HEADER, MAGIC, created_by, encode_index, identify, zstd_bounded
from .errors import CheckpointError
from .exact_index import INDEX_FORMAT, VERSION, is_checkpoint, load_index, read_index
from .files import (
    WRITE_DIGEST,
    AtomicFile,
    DigestStream,
    FileMap,
    atomic_output,
    check_paths,
    file_digest,
    new_hasher,
    recorded_digest,
    stat_of,
    track_temp,
    untrack_temp,
)
from .formats import FileTensor, find_tensors, find_tensors_noted
from .pipeline import Budget, Buffers, batched, ordered_map, unbatched
from .plan import CHUNK_SIZES, TRANSFORMS, BookChooser, make_codec, plan_tensor
from .report import Progress, Summary, human_bytes

__all__ = [
    "compress_file",
    "decompress_file",
    "verify_file",
    "read_index",
    "describe",
    "is_checkpoint",
    "save",
    "load",
    "VERSION",
    "PIECE_BYTES",
    "MIN_CODED_BYTES",
]

log = logging.getLogger("comm_codec.checkpoint")

# Source bytes per segment: memory stays bounded, and pieces code in parallel.
PIECE_BYTES = 4 << 20
_ZSTD_LEVEL = 3
# Tensors smaller than this are left to zstd with the bytes around them: a frame's header
# and a codebook cost more than coding saves.
MIN_CODED_BYTES = 4096
# Files under this size get one thread unless more are asked for: on 2 cores a 6.7 MB
# checkpoint compressed and restored 20 % slower on 2 threads than on 1, a 13 MB one 9 % faster.
SMALL_FILE_BYTES = 8 << 20
# Bytes of a source (or compressed file) read ahead of the segment being handed out.
_READ_AHEAD = 2 * PIECE_BYTES
# Segment bytes in flight at once (being coded, waiting to be written or hashed), whatever
# the threads: a file of 64 MiB segments cannot make each of many workers hold one.
_IN_FLIGHT_BYTES = 128 << 20
# Segments go to a worker together until they hold _BATCH_BYTES source bytes or are
# _BATCH_JOBS segments: a segment handed over alone costs two thread wake-ups, more than
# coding a small tensor (on 2 cores, 13-90 MB files compress on 2 threads 0.95-1.3x as fast
# as on 1 with one segment a hand-over, 1.08-1.46x batched). The count bounds a batch's
# budget where each restored segment holds a pooled buffer of PIECE_BYTES.
_BATCH_BYTES = 1 << 20
_BATCH_JOBS = 8
# A file whose original is this many times its own size (all-zero chunks cost a table
# entry, zstd blocks of one byte repeated four bytes) is restored twice: once to check its
# digest, writing nothing, then into the output. Real checkpoints are 1-4x; a crafted one
# claiming what it does not hold then fails before it writes a byte.
_CHECK_FIRST_RATIO = 64


# -- segments, coded on worker threads ------------------------------------------------------
@dataclasses.dataclass
class _Job:
    src_offset: int
    length: int
    tensor: int  # index into the tensor list, -1 for opaque bytes


def _jobs(size: int, tensors: list[FileTensor], plan, src: FileMap | None = None):
    """Yield the segments that cover 0..size in order: tensor pieces and opaque runs.

    ``plan(t)`` decides how a codable tensor is coded just before its first piece is
    yielded: under threads it runs here, on the caller's thread, while workers code
    earlier pieces. With ``src``, the bytes after each yielded segment are read ahead.
    """
    for job in _segments(size, tensors, plan):
        if src is not None:
            src.prefetch(job.src_offset + job.length, _READ_AHEAD)
        yield job


def _segments(size: int, tensors: list[FileTensor], plan):
    pos = 0
    for i, t in enumerate(tensors):
        if not (t.codable and t.nbytes >= MIN_CODED_BYTES):
            continue  # coded with the bytes around it
        plan(t)
        yield from _opaque_jobs(pos, t.offset)
        chunk = t.chunk_elems * t.spec.itemsize  # pieces are whole chunks
        step = max(1, PIECE_BYTES // chunk) * chunk
        for start in range(t.offset, t.offset + t.nbytes, step):
            yield _Job(start, min(step, t.offset + t.nbytes - start), i)
        pos = t.offset + t.nbytes
    yield from _opaque_jobs(pos, size)


def _batch_bytes(threads: int) -> int:
    """:func:`~.pipeline.batched`'s ``least``: one job a batch on one thread, where nothing
    is handed over (a segment is then written and hashed while its bytes are still in cache)."""
    return _BATCH_BYTES if threads > 1 else 0


def _opaque_jobs(start: int, end: int):
    for a in range(start, end, PIECE_BYTES):
        yield _Job(a, min(PIECE_BYTES, end - a), -1)


_tls = threading.local()


def _zstd_c() -> zstandard.ZstdCompressor:
    if not hasattr(_tls, "zc"):
        _tls.zc = zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_checksum=False)
    return _tls.zc


def _encode_job(job: _Job, src: FileMap, base: FileMap | None, tensors: list[FileTensor], buffers: Buffers):
    """Read and code one segment; return (method, payload, crc32 or None, the source bytes read,
    the pooled buffer they lie in or None)."""
    raw, buf = src.take_kept(job.src_offset, job.length), None
    if raw is None:
        buf = buffers.take(job.length)
        raw = src.read_into(job.src_offset, buf[:job.length])
    return (*_code_segment(job, raw, base, tensors), raw, buf)


def _code_segment(job: _Job, raw: np.ndarray, base: FileMap | None, tensors: list[FileTensor]):
    if job.tensor >= 0:
        t = tensors[job.tensor]
        spec = t.spec
        base_bytes = None
        if t.transform != "none":
            base_start = t.base_offset + job.src_offset - t.offset
            base_bytes = base.u8(base_start, job.length)
        coded = TRANSFORMS[t.transform].forward(raw, base_bytes, spec)
        if coded.ctypes.data % spec.itemsize:
            coded = coded.copy()  # the kernels read whole elements
        frame = t.codec.encode_array(coded, spec, kind="weight")
        if frame.size < job.length:
            return "frame", frame, None
    elif job.length >= 64:
        z = _zstd_c().compress(raw)
        if len(z) < job.length:
            return "zstd", z, zlib.crc32(z)
    return "stored", raw, zlib.crc32(raw)


def _size(path) -> int | None:
    """A file's size for choosing threads, None when it cannot be read (its opener says why)."""
    with contextlib.suppress(OSError, TypeError, ValueError):
        return stat_of(path).st_size
    return None


def _threads(threads: int | None, nbytes: int | None = None) -> int:
    """``threads``, checked; by default the CPU count (at most NUMBA_NUM_THREADS), or 1 for
    a file of ``nbytes`` under SMALL_FILE_BYTES."""
    if threads is None:
        import numba  # after the kernels: kernels.jit names a bad NUMBA_* setting in its error

        if nbytes is not None and nbytes < SMALL_FILE_BYTES:
            return 1
        return max(1, min(os.cpu_count() or 1, numba.config.NUMBA_NUM_THREADS))
    if not isinstance(threads, int) or not 1 <= threads <= 1024:
        raise ValueError(f"threads must be an integer from 1 to 1024, got {threads!r}")
    return threads


# -- compress -------------------------------------------------------------------------------
@contextlib.contextmanager
def _base_file(base, scratch_dir: str | None, threads: int):
    """Open a base checkpoint: the original file, or a standalone compressed one. Yield
    (map, digest): ``digest(name)`` hashes it (once per name).

    A compressed base is restored to a temp file in ``scratch_dir`` (the output's
    directory), or, with ``scratch_dir`` None, read through :class:`_CompressedBase`
    (decoded piece by piece in memory: nothing is written).
    """
    if base is None:
        yield None, None
        return
    base = os.fspath(base)
    tmp = None
    try:
        m = None
        if is_checkpoint(base):
            index = read_index(base)
            if index["base"] is not None:
                raise CheckpointError(f"base {base} is itself a delta checkpoint; give the original file "
                                      "(decompress it first)")
            if scratch_dir is None:
                m = _CompressedBase(base, threads)
            else:
                fd, tmp = create_temp(os.path.join(scratch_dir, "base"))
                track_temp(tmp)
                os.close(fd)
                decompress_file(base, tmp, threads=threads, progress=False, force=True)
                path = tmp
        else:
            path = base
        if m is None:
            m = FileMap(path)
        cache = {}

        def digest(name: str = WRITE_DIGEST) -> str:
            if name not in cache:
                cache[name] = m.digest(name) if isinstance(m, _CompressedBase) else file_digest(m, name)
            return cache[name]

        try:
            yield m, digest
        finally:
            m.close()
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            untrack_temp(tmp)


class _HashSink:
    """A sink for :func:`_restore` that only hashes what is written to it."""

    def __init__(self, name: str):
        self._h = new_hasher(name)

    def write(self, data) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


class _CompressedBase:
    """A standalone compressed checkpoint read as its original's bytes, decoded as asked for.

    What a delta needs of its base (``size``, ``u8``) without restoring the
    base anywhere: the segments holding the bytes asked for are decoded in memory, the last
    few kept (deltas ask in order). Thread-safe; decoding is serialized.
    """

    _KEEP = 3  # segments kept decoded

    def __init__(self, path: str, threads: int):
        self.path, self._threads = path, threads
        self._m = FileMap(path)
        try:
            index = load_index(self._m)
        except BaseException:
            self._m.close()
            raise
        attach_codecs(index["tensors"], index.pop("_books"))
        self._index = index
        self.size = index["source"]["size"]
        self._starts = [seg[0] for seg in index["segments"]]
        self._kept: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def digest(self, name: str) -> str:
        """Return the original's digest ``name``, from a full decode (which checks the recorded one)."""
        sink = _HashSink(name)
        _restore(self.path, sink, None, self._threads, False, "verify")
        return sink.hexdigest()

    def _segment(self, k: int) -> np.ndarray:
        if k not in self._kept:
            data, _ = _decode_segment(self._index["segments"][k], self._m, None, self._index["tensors"], self.path,
                                      Buffers(0, PIECE_BYTES))
            self._kept[k] = np.array(np.frombuffer(data, dtype=np.uint8))  # a copy: the buffer is not pooled
            while len(self._kept) > self._KEEP:
                self._kept.popitem(last=False)
        return self._kept[k]

    def u8(self, offset: int, length: int) -> np.ndarray:
        """Return the original's bytes offset..offset+length (a new array)."""
        out = np.empty(length, dtype=np.uint8)
        pos, end = offset, offset + length
        with self._lock:
            while pos < end:
                k = bisect.bisect_right(self._starts, pos) - 1
                seg_off, seg_len = self._index["segments"][k][:2]
                data = self._segment(k)
                n = min(seg_off + seg_len, end) - pos
                out[pos - offset:pos - offset + n] = data[pos - seg_off:pos - seg_off + n]
                pos += n
        return out

    def close(self) -> None:
        self._kept.clear()
        self._m.close()


def _shown(record: dict, width: int = 16) -> str:
    """'blake3 ab12...' for a source or base record."""
    name, hexdigest = recorded_digest(record)
    return f"{name} {printable(hexdigest[:width], width)}{'...' if width < len(hexdigest) else ''}"


def _base_matches(tensors: list[FileTensor], bm: FileMap | None) -> dict:
    """Map each coded tensor's name to the base's tensor of the same name, dtype and size."""
    if bm is None:
        return {}
    by_name = {}
    for bt in find_tensors(bm)[1]:
        by_name.setdefault(bt.name, bt)
    out = {}
    for t in tensors:
        bt = by_name.get(t.name)
        if (t.codable and t.nbytes >= MIN_CODED_BYTES and bt is not None and bt.codable and bt.dtype == t.dtype
                and bt.nbytes == t.nbytes and (t.shape is None or bt.shape is None or bt.shape == t.shape)):
            out[t.name] = bt
    return out


def _mode(path: str) -> int:
    """The permission bits an output made from ``path`` gets: the input's (less the umask)."""
    return stat_of(path).st_mode & 0o777


def compress_file(src, dst, *, base=None, threads: int | None = None, codebooks=None,
                  progress: bool | None = None, force: bool = False) -> Summary:
    """Compress a checkpoint file losslessly.

    Args:
        src: the checkpoint: safetensors, a ``torch.save`` file (zip or legacy), a DCP
            data file (``.distcp``), or any file (coded as opaque bytes). It is only read.
        dst: the compressed file, written atomically (temp file, fsync, rename).
        base: the *original* file of a previous checkpoint (or a standalone compressed
            one): tensors with the same name, dtype and size are coded as the XOR with
            it when that is smaller. Decompression then needs the same base.
        threads: CPU threads that code (default: the CPU count, at most NUMBA_NUM_THREADS; 1 for
            a file under :data:`SMALL_FILE_BYTES`).
        codebooks: the books to weigh against per-tensor books: a
            :class:`~comm_codec.CodebookSet`, the path of a saved one, or None (the
            shipped books).
        progress: progress line on stderr; None: only when stderr is a terminal.
        force: replace an existing dst. Default: refuse any existing dst, a dangling
            symlink included, as the command line does without ``--force`` and as
            :func:`compress_dir` does.

    Returns:
        A :class:`Summary`.

    Raises:
        FileNotFoundError, PermissionError, IsADirectoryError: src or base unreadable.
        FileExistsError: dst exists and force is False.
        CheckpointError: dst is src or base, dst cannot be written (full disk...).
        CodebookError: codebooks is a missing or invalid file.
        ValueError: threads out of range.
    """
    src, dst = os.fspath(src), os.fspath(dst)
    threads = _threads(threads, _size(src))
    if codebooks is not None:
        codebooks = as_codebook_set(codebooks)
    started = time.perf_counter()
    check_paths(src, dst, None if base is None else os.fspath(base))
    if not force and os.path.lexists(dst):  # after check_paths: dst is src, or a directory, say so first
        raise FileExistsError(17, f"{dst} exists; pass force=True to replace it", dst)
    m = FileMap(src)
    try:
        kind = identify(bytes(m.u8(0, min(8, m.size))))
        # A whole container (its magic at both ends), not bytes that merely start alike.
        if kind in ("exact", "lossy") and m.size >= 40 and bytes(m.u8(m.size - 8, 8)) == bytes(m.u8(0, 8)):
            raise CheckpointError(f"{src} is already a {'lossy ' if kind == 'lossy' else ''}comm_codec checkpoint; "
                                  "compressing it again would only make it larger (decompress it first)")
        with _base_file(base, os.path.dirname(os.path.abspath(dst)), threads) as (bm, base_sha):
            fmt, tensors, note = find_tensors_noted(m)
            matches = _base_matches(tensors, bm)
            if bm is not None and not matches:
                raise CheckpointError(
                    f"base {os.fspath(base)} shares no tensor with {src} (none has the same name, dtype and "
                    "size), so it cannot make the file smaller and would only be needed to restore it; "
                    "compress without --base, or give the previous checkpoint of the same model")
            chooser = BookChooser(CodebookSet.default() if codebooks is None else codebooks)

            def plan(t: FileTensor) -> None:
                plan_tensor(t, m, bm, matches.get(t.name), chooser)

            segments = []
            h = DigestStream(background=threads > 1)
            meter = Progress("compressing", m.size, progress)
            with atomic_output(dst, mode=_mode(src), release_in_background=threads > 1) as out, contextlib.closing(h):
                out.write(HEADER.pack(MAGIC, VERSION, 0, 0))
                budget = Budget(_IN_FLIGHT_BYTES)
                buffers = Buffers(_IN_FLIGHT_BYTES, PIECE_BYTES)
                batches = batched(_jobs(m.size, tensors, plan, m), _batch_bytes(threads), _BATCH_JOBS)
                work = ordered_map(lambda b: [_encode_job(j, m, bm, tensors, buffers) for j in b], batches, threads,
                                   budget, lambda b: sum(j.length for j in b))
                with contextlib.closing(work):
                    for job, (method, payload, crc, raw, buf) in unbatched(work):
                        offset = out.pos
                        out.write(payload)  # before the digest: a stored payload is raw, reused once hashed
                        segments.append([job.src_offset, job.length, offset, out.pos - offset, method, crc, job.tensor])
                        out.pad8()
                        h.update(raw, None if buf is None else functools.partial(buffers.give, buf))
                        del payload, raw, buf
                        budget.give(job.length)
                        meter.update(job.length)
                meter.close()
                index = {
                    "format": INDEX_FORMAT, "version": VERSION,
                    "created_by": created_by(),
                    "source": {"name": os.path.basename(src), "size": m.size, h.name: h.hexdigest(), "format": fmt,
                               **({"note": note} if note else {})},
                    # A base no tensor was coded against is not recorded: the file stands alone.
                    "base": None if not any(t.transform != "none" for t in tensors) else {
                        "name": os.path.basename(os.fspath(base)), "size": bm.size, WRITE_DIGEST: base_sha()},
                    "books": chooser.books,
                    **({"groups": chooser.groups} if chooser.groups else {}),
                    "tensors": [t.record() for t in tensors],
                    "segments": segments,
                }
                blob, trailer = encode_index(index, out.pos, VERSION, MAGIC)
                out.write(blob)
                out.write(trailer)
                total = out.pos
                for mp, what in ((m, "source"), (bm, "base")):
                    if mp is not None and not mp.unchanged():
                        raise CheckpointError(f"{what} {mp.path} changed while it was being compressed; "
                                              "compress it again once it is complete")
                out.commit()
    finally:
        m.close()
    summary = Summary("compress", m.size, total, time.perf_counter() - started, threads, fmt, len(tensors),
                      sum(t.coding == "frame" for t in tensors), sum(t.transform != "none" for t in tensors),
                      digest=f"{h.name}:{index['source'][h.name]}", note=note)
    log.debug("%s: %s", src, summary.line())
    return summary


# -- decompress -----------------------------------------------------------------------------
def _restore(path: str, sink, base, threads: int, progress: bool | None, op: str,
             scratch: str | None = None) -> Summary:
    """Decode every segment in order into ``sink`` (None: decode and check only).

    ``scratch``: the directory a compressed base may be restored into (the output's);
    None: nothing is written anywhere (a compressed base is then decoded piece by piece).
    """
    started = time.perf_counter()
    m = FileMap(path)
    try:
        index = load_index(m)
        books = index.pop("_books")
        tensors = index["tensors"]
        need = index["base"]
        if need is None and base is not None:
            log.warning("%s was compressed without a base; ignoring base %s", printable(path, 4096),
                        printable(os.fspath(base), 4096))
            base = None
        if need is not None and base is None and sink is not None:
            raise CheckpointError(
                f"{path} was compressed against base {printable(need['name'])} ({_shown(need)}); "
                "pass that original file, or the compressed file made from it, as base (--base)")
        with _base_file(base if need is not None else None, scratch, threads) as (bm, base_sha):
            if bm is not None:
                name, want = recorded_digest(need)
                if bm.size != need["size"] or base_sha(name) != want:
                    raise CheckpointError(
                        f"wrong base: {base} has {name} {base_sha(name)[:16]}... ({bm.size} bytes), but {path} was "
                        f"compressed against {printable(need['name'])} with {name} {want[:16]}... ({need['size']} bytes)")
            attach_codecs(tensors, books)
            checked = bm is not None or need is None
            size = index["source"]["size"]
            label = "decompressing" if sink is not None else "verifying"
            if sink is not None and checked and size > _CHECK_FIRST_RATIO * m.size:
                _check_digest(path, index, _decode_all(m, index, bm, None, threads, progress, "checking"))
            h = _decode_all(m, index, bm, sink, threads, progress, label)
            if checked:
                _check_digest(path, index, h)
    finally:
        m.close()
    return Summary(op, index["source"]["size"], m.size, time.perf_counter() - started, threads,
                   index["source"]["format"], len(tensors), sum(t["coding"] == "frame" for t in tensors),
                   sum(t["transform"] != "none" for t in tensors),
                   digest=f"{h.name}:{index['source'][h.name]}" if checked else None)


def attach_codecs(tensors: list, books: dict) -> None:
    """Give every frame-coded tensor record the codec that decodes it (under ``"_codec"``).

    Args:
        tensors: the index's tensor records (changed in place).
        books: ``{id: Codebook | CodebookGroup}``, as :func:`~.exact_index.load_index` returns
            them under ``"_books"``.
    """
    codecs = {}
    for t in tensors:
        if t["coding"] == "frame":
            spec = spec_for(t["dtype"])
            key = (spec.name, tuple(t["books"]))
            if key not in codecs:
                # Frames carry their chunk size; the codec's own is not used to decode.
                codecs[key] = make_codec([books.get(b) or Codebook.raw_book() for b in t["books"]], spec,
                                         CHUNK_SIZES[0])
            t["_codec"] = codecs[key]


def _check_digest(path: str, index: dict, h: DigestStream) -> None:
    want = index["source"][h.name]
    if h.hexdigest() != want:
        raise CheckpointError(f"{path}: restored bytes have {h.name} {h.hexdigest()[:16]}..., the "
                              f"original had {want[:16]}...: corrupted")


def _segment_cost(seg) -> int:
    """Bytes one segment holds while in flight: its restored bytes, in a pooled buffer of at least PIECE_BYTES."""
    return max(seg[1], PIECE_BYTES)


def _decode_all(m: FileMap, index: dict, bm, sink, threads: int, progress: bool | None, label: str) -> DigestStream:
    """Restore every segment in order into ``sink`` (None: nothing written); return the digest of the bytes."""
    tensors = index["tensors"]
    # Workers decode; this thread writes each segment at its source offset (pwrite) and
    # hands it to the digest. Writes into one file take turns on its inode lock (tmpfs,
    # ext4), and a worker waiting there would be a worker not decoding. The writing is
    # most of a thread's work, so this thread counts as one of ``threads``: a third
    # thread decoding beside two left the writer with a smaller share of two cores. The
    # digest is hashed by a worker between two decodes and by this thread while it waits
    # for one, the digest's own (lower-priority) thread taking the rest: a 4 GB file
    # restored on 2 threads 1.53x as fast as on 1 with the digest's thread doing it all,
    # 1.8x so (DigestStream).
    positional = isinstance(sink, AtomicFile)
    if positional:
        sink.reserve(index["source"]["size"])
    budget = Budget(_IN_FLIGHT_BYTES)
    buffers = Buffers(_IN_FLIGHT_BYTES, PIECE_BYTES)

    def decode(seg):
        out = _decode_segment(seg, m, bm, tensors, m.path, buffers)
        h.help()  # one buffer already written, hashed between two decodes (see DigestStream)
        return out

    def finished(seg, buf) -> None:  # written and hashed: the buffer and its bytes go back
        if buf is not None:
            buffers.give(buf)
        budget.give(_segment_cost(seg))

    h = DigestStream(threads > 1, recorded_digest(index["source"])[0], helped=True)
    meter = Progress(label, index["source"]["size"], progress)
    workers = threads - 1 if positional and threads > 1 else threads
    batches = batched(_read_ahead(index["segments"], m), _batch_bytes(threads), _BATCH_JOBS, lambda seg: seg[1])
    work = ordered_map(lambda b: [decode(seg) for seg in b], batches, workers, budget,
                       lambda b: sum(_segment_cost(seg) for seg in b), inline=threads == 1, idle=h.help)
    with contextlib.closing(work), contextlib.closing(h):
        for seg, (data, buf) in unbatched(work):
            if data is not None:
                # Written before the digest: once hashed, the buffer is reused.
                if positional:
                    sink.pwrite(data, seg[0])
                elif sink is not None:
                    sink.write(data)
                h.update(data, functools.partial(finished, seg, buf))
            else:
                finished(seg, buf)
            del data, buf
            meter.update(seg[1])
    meter.close()
    return h


def _read_ahead(segments, m: FileMap):
    """Yield the segments, asking for the coded bytes after each to be read ahead."""
    for seg in segments:
        m.prefetch(seg[2] + seg[3], _READ_AHEAD)
        yield seg


def _decode_segment(seg, m: FileMap, bm: FileMap | None, tensors, path, buffers: Buffers):
    """Restore one segment's source bytes; return them and the pooled buffer they lie in (or None).

    The coded bytes are read into a pooled buffer too, given back once decoded (a stored
    segment's bytes are its restored bytes: their buffer is the one returned).
    """
    src_off, src_len, off, length, method, crc, ti = seg
    padded = length + -length % 8  # the payload and its zero padding, in one read
    inbuf = buffers.take(padded)
    data = m.read_into(off, inbuf[:padded])
    payload = data[:length]
    where = f"segment at source bytes {src_off}..{src_off + src_len}"
    if np.count_nonzero(data[length:]):  # (.any() cost 4x as much on these few bytes)
        raise CheckpointError(f"{path}: padding after the {where} is corrupted (not zero)")
    if method != "frame":
        if zlib.crc32(payload) != crc:
            raise CheckpointError(f"{path}: {where} is corrupted (CRC-32 mismatch)")
        if method == "stored":
            return payload, inbuf
        out = zstd_bounded(payload, src_len, path, where)
        buffers.give(inbuf)
        if len(out) != src_len:
            raise CheckpointError(f"{path}: {where} decompressed to {len(out)} bytes, expected {src_len}")
        return out, None
    t = tensors[ti]
    spec = spec_for(t["dtype"])
    buf = buffers.take(src_len)
    coded = buf[:src_len]
    try:
        t["_codec"].decode_into(payload, coded, max_output_bytes=src_len)
    except (FrameError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: tensor {printable(t['name'])!r}, {where}: {exc}") from None
    del data, payload
    buffers.give(inbuf)
    if t["transform"] == "none":
        return coded, buf
    if bm is None:  # verify without the base: the frames were checked, the bytes cannot be
        return None, buf
    base_start = t["base_offset"] + src_off - t["offset"]
    restored = TRANSFORMS[t["transform"]].inverse(coded, bm.u8(base_start, src_len), spec)
    return restored, buf


def decompress_file(src, dst, *, base=None, threads: int | None = None, progress: bool | None = None,
                    force: bool = False) -> Summary:
    """Restore the original checkpoint, byte for byte, from a compressed file.

    Args:
        src: a file written by :func:`compress_file`.
        dst: where to write the original; it appears only once its digest matched. Or a
            binary file object open for writing (``sys.stdout.buffer``): the bytes are
            streamed into it in order as they are decoded, so they are there before the
            digest is checked (a mismatch still raises, after the last byte).
        base: the base the file was compressed against (the original file, or a
            standalone compressed one); required for delta files, refused if different.
        threads: CPU threads that decode (default: the CPU count, at most NUMBA_NUM_THREADS; 1 for
            a compressed file under :data:`SMALL_FILE_BYTES`).
        progress: progress line on stderr; None: only when stderr is a terminal.
        force: replace an existing dst. Default: refuse any existing dst (a file
            object is always written to).

    Returns:
        A :class:`Summary`.

    Raises:
        CheckpointError: src is not a checkpoint, is truncated or corrupted; the base
            is missing or wrong; dst cannot be written. No dst is left behind.
        FileExistsError: dst exists and force is False.
        FileNotFoundError, PermissionError: src or base unreadable.
    """
    if hasattr(dst, "write"):
        # A compressed base goes to the temp directory: a stream has no directory of its own.
        return _restore(os.fspath(src), dst, base, _threads(threads, _size(src)), progress, "decompress",
                        tempfile.gettempdir())
    src, dst = os.fspath(src), os.fspath(dst)
    threads = _threads(threads, _size(src))
    check_paths(src, dst, None if base is None else os.fspath(base))
    if not force and os.path.lexists(dst):
        raise FileExistsError(17, f"{dst} exists; pass force=True to replace it", dst)
    with atomic_output(dst, mode=_mode(src), release_in_background=threads > 1) as out:
        summary = _restore(src, out, base, threads, progress, "decompress", os.path.dirname(os.path.abspath(dst)))
        out.commit()
    return summary


def verify_file(src, *, base=None, threads: int | None = None, progress: bool | None = None) -> Summary:
    """Decode a compressed checkpoint and check it, writing nothing.

    Every checksum is checked (index CRC, segment CRCs, frame header CRCs and chunk
    checksums) and, when the original can be rebuilt (no base needed, or base given),
    the digest of the restored bytes. ``Summary.digest`` is None when it was not.

    Raises:
        CheckpointError: the file is corrupted, or the base is wrong.
    """
    return _restore(os.fspath(src), None, base, _threads(threads, _size(src)), progress, "verify")


# -- description ----------------------------------------------------------------------------
def describe(path) -> str:
    """Return a table of a compressed checkpoint: tensors, dtypes, ratios and books."""
    path = os.fspath(path)
    index = read_index(path)
    size = os.path.getsize(path)
    src, base = index["source"], index["base"]
    coded = collections.Counter()
    for _s_off, _s_len, _off, length, _method, _crc, ti in index["segments"]:
        coded[ti] += length
    # Every string below comes from the file or the user: printable() escapes what could
    # drive the terminal or start a line of its own.
    ratio = f"{src['size'] / max(1, size):.3f}" if src["size"] else "- (empty original)"
    lines = [
        f"file      {printable(path, 4096)}: comm_codec checkpoint v{index['version']}, {human_bytes(size)}",
        f"source    {printable(src['name'])}: {src['format']}, {human_bytes(src['size'])}, {_shown(src, 64)}",
        "base      " + ("none" if base is None else
                        f"{printable(base['name'])}: {human_bytes(base['size'])}, {_shown(base, 64)}"),
        f"ratio     {ratio} ({human_bytes(src['size'])} -> {human_bytes(size)}); "
        f"{len(index['tensors'])} tensors, {sum(t['coding'] == 'frame' for t in index['tensors'])} coded, "
        f"{sum(t['transform'] != 'none' for t in index['tensors'])} as deltas",
    ]
    if src.get("note"):
        lines.append(f"note      {printable(src['note'], 400)}")
    nentries = sum(len(t.get("entries") or [None]) for t in index["tensors"])
    if nentries != len(index["tensors"]):
        lines.append(f"entries   {nentries} entries on {len(index['tensors'])} storages "
                     "(views and tied weights share one; each is listed)")
    origin = {bid: e["origin"] for bid, e in index["books"].items()}
    own = sum(o == "tensor" for o in origin.values())
    lines.append(f"books     {own} per-tensor, {len(origin) - own} shipped")
    names = [printable(t["name"]) for t in index["tensors"]]
    shared = [printable(e[0]) for t in index["tensors"] for e in (t.get("entries") or [])[1:]]
    width = max([len(n) for n in names + shared] + [6])
    lines.append(f"{'tensor':<{width}}  {'dtype':<13} {'shape':<16} {'kind':<15} {'coding':<10} {'chunk':>6} "
                 f"{'ratio':>6}  books")
    for i, (name, t) in enumerate(zip(names, index["tensors"])):
        shape = "-" if t["shape"] is None else "x".join(map(str, t["shape"])) or "scalar"
        if t["coding"] == "frame":
            ratio = f"{t['nbytes'] / max(1, coded[i]):.3f}"
            how = "xor-frame" if t["transform"] == "xor" else "frame"
            bk = ",".join(_book_label(b, index.get("groups", {}), origin) for b in t["books"])
        else:
            ratio, how, bk = "-", "opaque", "zstd"
        chunk = f"{t['chunk_elems'] >> 10}Ki" if t.get("chunk_elems") else "-"
        lines.append(f"{name:<{width}}  {printable(t['dtype'], 64):<13} {shape:<16} {printable(t['kind'], 64):<15} "
                     f"{how:<10} {chunk:>6} {ratio:>6}  {bk}")
        for entry, eshape in (t.get("entries") or [])[1:]:
            eshape = "-" if eshape is None else "x".join(map(str, eshape)) or "scalar"
            lines.append(f"{printable(entry):<{width}}  {printable(t['dtype'], 64):<13} {eshape:<16} "
                         f"shares the storage of {name}")
    opaque_in = sum(s[1] for s in index["segments"] if s[6] < 0)
    opaque_out = sum(s[3] for s in index["segments"] if s[6] < 0)
    other = f"{opaque_in / max(1, opaque_out):.3f}" if opaque_in else "-"
    lines.append(f"{'(other bytes)':<{width}}  {'-':<13} {'-':<16} {'-':<15} {'opaque':<10} {'-':>6} "
                 f"{other:>6}  zstd/stored, {human_bytes(opaque_in)}")
    return "\n".join(lines)


def _book_label(book: str, groups: dict, origin: dict) -> str:
    """How ``ls`` names a stream's book: raw, own, own xN (a group), or the shipped book or
    group by its name (``shipped weight/bf16/0 x4``: 4 books of that shipped group)."""
    if book == "0" * 16:
        return "raw"
    members = groups.get(book, [book])
    where = str(origin.get(members[0], ""))
    count = f" x{len(members)}" if book in groups else ""
    if where.startswith("shipped:"):
        return f"shipped {printable(where[len('shipped:'):], 64)}{count}"
    return f"own{count}"


# -- torch.save / torch.load stand-ins ------------------------------------------------------
def save(state_dict, path, *, base=None, threads: int | None = None) -> Summary:
    """``torch.save`` a state dict and compress it into ``path``.

    Args:
        state_dict: anything torch.save accepts (load() reads back with weights_only=True,
            so keep to tensors, containers and plain values).
        path: the compressed file.
        base: a previous checkpoint's original file (or standalone compressed file).
        threads: CPU threads that code (as for :func:`compress_file`).

    Returns:
        The compression :class:`Summary`.
    """
    import torch

    path = os.fspath(path)
    fd, tmp = create_temp(path + ".pt")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state_dict, fh)
        return compress_file(tmp, path, base=base, threads=threads, progress=False, force=True)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def load(path, *, base=None, threads: int | None = None, map_location="cpu"):
    """Restore a checkpoint written by :func:`save` or :func:`compress_file` and load it.

    torch files are read with ``torch.load(..., weights_only=True)`` (no arbitrary
    unpickling); safetensors files with ``safetensors.torch.load``.

    Raises:
        CheckpointError: corrupted, wrong or missing base, or the original is neither a
            torch nor a safetensors file.
    """
    buf = io.BytesIO()
    _restore(os.fspath(path), buf, base, _threads(threads, _size(path)), False, "decompress")
    fmt = read_index(path)["source"]["format"]
    if fmt == "safetensors":
        from safetensors.torch import load as st_load

        return st_load(buf.getvalue())
    if fmt not in ("torch_zip", "torch_legacy"):
        raise CheckpointError(f"{path} holds a {fmt} file, not a torch or safetensors checkpoint; "
                              "use decompress_file")
    import torch

    buf.seek(0)
    return torch.load(buf, map_location=map_location, weights_only=True)
