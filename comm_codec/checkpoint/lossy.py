"""Lossy checkpoint compression, as an explicit opt-in: ExCP-style series and precision cuts.

:mod:`comm_codec.checkpoint` restores a checkpoint bit for bit. Users who keep every
checkpoint of a long run can trade exactness for size, as ExCP does (Li et al., "ExCP:
Extreme LLM Checkpoint Compression via Weight-Momentum Joint Shrinking", ICML 2024,
arXiv 2406.11257: ≈70× on Pythia-410M), or cut mantissa bits as ZipNN suggests
(Hershcovitch et al., 2024). Both modes write a container of their own magic
(:data:`~comm_codec.checkpoint.LOSSY_MAGIC`), which the exact reader refuses, and both
decompress to a file of the *same format* as the source (safetensors or ``torch.save``
zip) that ``safetensors.torch.load_file`` / ``torch.load(weights_only=True)`` read: every
non-tensor byte is the source's, every rewritten zip record has its CRC-32 patched in
its local header, data descriptor and central directory.

Example::

    >>> from comm_codec import lossy
    >>> lossy.compress_file("step00060.pt", "step00060.ccl")                    # doctest: +SKIP
    >>> s = lossy.compress_file("step00070.pt", "step00070.ccl", base="step00060.ccl")  # doctest: +SKIP
    >>> lossy.decompress_file("step00070.ccl", "step00070.recon.pt")           # doctest: +SKIP
    >>> lossy.compress_file("w.safetensors", "w.ccl", mode="precision", keep_bits=7)  # doctest: +SKIP

Modes
-----
``excp`` (a checkpoint holding weights and AdamW state): for each weight ``W`` with its
first moment ``exp_avg`` (m) and second moment ``exp_avg_sq`` (v):

1. residual ``R = W - Ŵ_prev`` against the *reconstructed* previous checkpoint (closed
   loop: what one file drops is still in the next residual, so a chain never drifts);
2. weight pruning: keep ``|R| > f · median|R|`` with ``f = min(2.5, alpha / sqrt(mean v))``
   (ExCP's per-tensor rule: tensors with large second moments change more and keep
   more). Vectors (biases, norm scales) are quantized but not pruned
   (:func:`lossy_transforms.prunable`);
3. moment pruning (not for vectors): keep ``|m| > beta · mean|m|`` *and* where the residual
   was kept; v is kept where m is (ExCP prunes both moments with one mask). Pruned m is restored as 0;
   pruned v as one number per tensor, the mean sqrt(v) of its pruned elements, squared
   (ExCP restores 0, after which Adam takes oversized steps for ~1000 steps: see
   :func:`lossy_transforms.fill_value`);
4. non-uniform quantization of what survives: 1-D k-means (Lloyd's algorithm on the
   sorted values, exact and deterministic) with ``2**bits - 1`` centroids plus zero. m
   and R are quantized as values; v in the sqrt domain (Adam divides by sqrt(v), so that
   is where its error matters, and v spans decades that linear centroids would lump);
5. masks (bit-packed; the m mask only over the positions where R was kept, since it is
   zero elsewhere) and centroid indices (numbered by frequency, so one book fits every
   tensor) are concatenated per stream over the whole file and coded with the codec's
   Huffman frames, one book per stream built from the file's own counts. Five books cost
   ~0.8 kB of a file of ~560 kB (TinyLM, 3.3 M parameters), so a fixed shipped book could
   save at most 0.15 % and would fit worse; per-tensor books would cost more than that.
   Measured there: 0.53 bit per weight for the mask at 14 % kept (its entropy if bits were
   independent: 0.59) and 3.5 bits per kept value with 15 centroids.

The first checkpoint of a series has no base (a *keyframe*): its weights are stored
exactly (coded losslessly), because every later reconstruction is built on them and a
4-bit copy of full weights (not residuals) would cost the model accuracy; its moments are
pruned and quantized like any other's. A weights-only checkpoint (no Adam state) falls
back to magnitude pruning of the residual at ``median|R|`` (no v to scale by) and says
so. Decompressing the n-th file needs files 0..n-1: each file names its base and its
base's sha256; bases are looked for beside the file (``base=`` overrides the first).

``precision``: every float tensor of 4 kB or more is rounded to nearest (ties to even)
to ``keep_bits`` mantissa bits (non-finite values untouched), then coded losslessly; an
fp32 tensor kept to at most 7 bits is coded as the bf16 it then equals, an fp16 one kept
to at most 2 bits as fp8 e5m2. Relative error <= 2**-(keep_bits+1) for normal values.

Tensors no mode rewrites (integers, unmatched floats, small tensors) pass through
exactly: 4 kB or more as lossless frames, the rest with the file's other bytes.

Container format, version 1 (integers little-endian)::

    header    LOSSY_MAGIC b"\\x89CCKL\\r\\n\\x1a" | version u16 | flags u16 (0) | 0 u32
    blobs     codec frames (streams, exact tensors) and the zstd "skeleton" (the source
              bytes outside rewritten tensors), each padded with zeros to 8 bytes
    index     zstd-compressed UTF-8 JSON (never pickle)
    trailer   index offset u64 | index length u64 | index CRC-32 u32 | version u16 |
              flags u16 (bit 0: index is zstd-compressed) | LOSSY_MAGIC   (32 bytes)

Index (``"format": "comm_codec.lossy"``)::

    mode, params      "excp" {bits, alpha, beta} | "precision" {keep_bits}
    source            {name, size, sha256, format}: the original file
    reconstruction    {size, sha256}: what decompression writes (checked on the way back)
    base              null, or {name, sha256} of the previous *lossy* file
    notes             [str]: fallbacks taken (weights-only pruning...)
    books             {id: book}: every Huffman book a frame uses
    streams           {name: {offset, length, size, book} | null}   (excp)
    skeleton          {offset, length, size, crc32}
    tensors           [{name, dtype, shape, offset, nbytes, role, coding, param, centroids,
                        domain, kept, fill, frame, skeleton_offset, crc_at, stats}]
    errors            {role: worst tensor's relative RMS error, role_all: all tensors' of that role}

Streams are read in tensor order: a residual takes ceil(n/8) bytes of weight_mask and
``kept`` symbols of weight_index; an exp_avg takes ceil(kept of its weight / 8) bytes of
exp_avg_mask and ``kept`` symbols; an exp_avg_sq ``kept`` symbols (its exp_avg's mask).
Symbol s > 0 is ``centroids[s-1]`` (squared in the sqrt domain), 0 is ``fill``.

``role`` is weight / exp_avg / exp_avg_sq / tensor; ``coding`` is residual (pruned and
quantized against the base), value (pruned and quantized values), frame (a lossless
or precision-cut frame) or skeleton (exact, with the other bytes). ``stats`` holds what
was *achieved*, measured on the reconstruction: ``max_abs_error``, ``rel_rms_error``
(‖Ŵ−W‖/‖W‖), and per mode ``threshold``, ``bound`` (max(threshold, largest quantization
error): no element's residual error exceeds it), ``max_rel_error``/``bound_rel``.

Untrusted input: the source is parsed without unpickling (:mod:`.formats`), the
container's index is JSON and checked field by field, frames carry CRCs, and the
reconstruction's sha256 is checked before any output appears. Memory: one checkpoint's
tensors and the previous reconstruction's weights (the most recent two reconstructions
stay cached in the process, keyed by the lossy file's sha256, so compressing a series
one file after the other never decodes a chain twice).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import logging
import math
import os
import struct
import threading
import time
import zlib

import numpy as np
import torch
import zstandard

from ..core.codebooks import CodebookSet
from ..core.errors import ChainError
from ..core.codec import Codec
from ..core.frame import FrameError, get_frame_parameters
from ..core.huffman import Codebook
from ..books.profiler import stream_counts
from ..core.streams import spec_for
from .container import HEADER, LOSSY_MAGIC, created_by, encode_index, identify, index_file, read_container_index, zstd_bounded
from . import schema
from .errors import CheckpointError, fail
from .exact import MIN_CODED_BYTES, NOT_OURS, human_bytes
from .files import FileMap, atomic_output, check_paths, open_regular
from .formats import CODABLE, FileTensor, find_tensors, is_int, zip_crc_fields
from .schema import Anything, Int, ListOf, MapOf, Nullable, Num, OneOf, Record, Str
from .lossy_transforms import LOSSY_DTYPES, MANTISSA, dequantize, error_stats, fill_value, pair_moments, prunable, quantize, round_mantissa

__all__ = [
    "ChainError",
    "LossySummary",
    "compress_file",
    "decompress_file",
    "verify_file",
    "load",
    "read_index",
    "describe",
    "is_lossy",
    "clear_cache",
    "MODES",
    "VERSION",
    "DEFAULT_BITS",
    "DEFAULT_ALPHA",
    "DEFAULT_BETA",
]

log = logging.getLogger("comm_codec.checkpoint.lossy")

VERSION = 1
MODES = ("excp", "precision")
DEFAULT_BITS = 4
# ExCP's alpha is relative to sqrt(mean v), i.e. to the gradient scale of the run (their
# Pythia default, 5e-5, prunes almost nothing on TinyLM, whose sqrt(mean v) is 2e-4..7e-3).
# Measured on TinyLM (d_model 256, 10 checkpoints 10 steps apart, 40 resumed steps;
# launch_scripts/bench_lossy.py): alpha 1e-3 -> 67x on the deltas, held-out loss after
# resuming +1.00 %; 7e-4 -> 62x, +0.92 %; 5e-4 -> 54x, +0.76 %; 3e-4 -> 36x, +0.45 %.
# The default keeps the 1 % resume target with a margin.
DEFAULT_ALPHA = 5e-4
DEFAULT_BETA = 2.0
_MAX_FACTOR = 2.5  # ExCP caps f: beyond it pruning removes residuals that matter
_WEIGHTS_ONLY_FACTOR = 1.0  # no v to scale by: prune the smaller half of the residual
_INDEX_FORMAT = "comm_codec.lossy"
_CHUNK = 1 << 16
_BOOK_COST_BYTES = 160  # a book's place in the (compressed) index
_STREAMS = ("weight_mask", "weight_index", "exp_avg_mask", "exp_avg_index", "exp_avg_sq_index")
_INTS = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}
# Narrower dtypes a precision-cut tensor equals: (dtype, min dropped bits) -> dtype of its
# high bytes.
_PACK = {("float32", 16): "bfloat16", ("float16", 8): "float8_e5m2"}
_CACHE_SIZE = 2


# -- results --------------------------------------------------------------------------------
@dataclasses.dataclass
class LossySummary:
    """What one lossy compress, decompress or verify call did.

    Attributes:
        op: "compress", "decompress" or "verify".
        mode: "excp" or "precision".
        original_bytes: size of the source checkpoint.
        compressed_bytes: size of the lossy file.
        seconds: wall time of the call.
        format: "safetensors" or "torch_zip".
        lossy_tensors: tensors rewritten lossily.
        errors: relative RMS error per role, of the worst tensor ("weight") and of all
            tensors together ("weight_all"); likewise exp_avg, exp_avg_sq, tensor.
        notes: fallbacks taken.
        base: the base file's name, or None for a keyframe / precision file.
    """

    op: str
    mode: str
    original_bytes: int
    compressed_bytes: int
    seconds: float
    format: str
    lossy_tensors: int = 0
    errors: dict = dataclasses.field(default_factory=dict)
    notes: list = dataclasses.field(default_factory=list)
    base: str | None = None

    @property
    def ratio(self) -> float:
        return self.original_bytes / max(1, self.compressed_bytes)

    def line(self) -> str:
        """Return the one-line summary the command line prints."""
        a, b = human_bytes(self.original_bytes), human_bytes(self.compressed_bytes)
        what = {"compress": f"compressed (lossy {self.mode}) {a} -> {b}",
                "decompress": f"decompressed (lossy {self.mode}) {b} -> {a}",
                "verify": f"verified (lossy {self.mode}) {b} ({a} reconstructed, sha256 ok)"}[self.op]
        errs = ", ".join(f"{k[:-4]} {v:.2e}" for k, v in self.errors.items() if k.endswith("_all"))
        if "weight" in self.errors:
            errs += f" (worst weight tensor {self.errors['weight']:.2e})"
        return (f"{what} (ratio {self.ratio:.2f}) in {self.seconds:.2f} s; "
                f"{self.lossy_tensors} tensors lossy" + (f", rel. RMS error {errs}" if errs else "")
                + (f"; base {self.base}" if self.base else ""))


# -- coding streams and tensors with the Huffman core ---------------------------------------
class _Books:
    """The Huffman books of one file, and codecs that code with them."""

    def __init__(self, threads: int | None):
        self.threads = threads
        self.books: dict[str, Codebook] = {}
        self._codecs: dict = {}

    def codec(self, books: list[Codebook], dtype: torch.dtype) -> Codec:
        spec = spec_for(dtype)
        key = (spec.name, tuple(b.id for b in books))
        codec = self._codecs.get(key)
        if codec is None:
            keyed = {("weight", spec.name, s): b for s, b in enumerate(books)}
            codec = self._codecs[key] = Codec(CodebookSet(keyed), threads=self.threads, chunk_elems=_CHUNK)
        return codec

    def fit(self, tensor: torch.Tensor) -> list[Codebook]:
        """Return one book per stream fitted to the tensor, raw where a book does not pay."""
        counts, _ = stream_counts(tensor, _CHUNK)
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
        books = self.fit(tensor)
        return self.codec(books, tensor.dtype).encode(tensor, kind="weight").numpy(), [b.id for b in books]

    def decode(self, frame: np.ndarray, ids: list[str], dtype: torch.dtype, numel: int, where: str):
        books = [Codebook.raw_book() if i == "0" * 16 else self.books[i] for i in ids]
        try:
            # The frame's own header must agree with the index before anything is allocated.
            p = get_frame_parameters(frame)
            if p.numel != numel or p.chunk_elems != _CHUNK or p.spec.dtype != dtype:
                raise FrameError(f"frame holds {p.numel} {p.spec.name} elements in chunks of {p.chunk_elems}, "
                                 f"the index says {numel} {spec_for(dtype).name} in chunks of {_CHUNK}")
            out = torch.empty(numel, dtype=dtype)
            self.codec(books, dtype).decode(frame, out=out, max_output_bytes=numel * out.element_size())
        except (FrameError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        return out


# -- the ExCP transform ---------------------------------------------------------------------
def _floats(t: FileTensor, m: FileMap) -> np.ndarray:
    """A tensor's values as float32 (a copy)."""
    raw = torch.from_numpy(m.u8(t.offset, t.nbytes).copy()).view(CODABLE[t.dtype])
    return raw.float().numpy()


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the bytes of dtype (round to nearest even)."""
    return torch.from_numpy(values).to(CODABLE[dtype]).view(torch.uint8).numpy()


def _back(u8: np.ndarray, dtype: str) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(u8)).view(CODABLE[dtype]).float().numpy()


def _as_weight(u8: np.ndarray, dtype: str, shape) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(u8)).view(CODABLE[dtype])
    return t.reshape(shape) if shape is not None and math.prod(shape) == t.numel() else t


def _record(t: FileTensor, role: str, coding: str, **extra) -> dict:
    rec = {"name": t.name, "dtype": t.dtype, "shape": t.shape, "offset": t.offset, "nbytes": t.nbytes,
           "role": role, "coding": coding, "param": None, "centroids": None, "domain": None, "kept": None,
           "fill": 0.0, "frame": None, "skeleton_offset": None, "crc_at": [], "stats": {}}
    rec.update(extra)
    return rec


class _Encoder:
    """Turns a source checkpoint into records, stream pieces and frames (in memory)."""

    def __init__(self, m: FileMap, books: _Books):
        self.m = m
        self.books = books
        self.records: list[dict] = []
        self.values: dict[int, np.ndarray] = {}  # record number -> reconstructed bytes
        self.frames: list[tuple[dict, np.ndarray]] = []  # (record["frame"], frame bytes)
        self.streams = {s: [] for s in _STREAMS}
        self.weights: dict[str, torch.Tensor] = {}  # reconstructed weights, for the next link

    def add(self, rec: dict, recon: np.ndarray | None) -> None:
        if recon is not None:
            self.values[len(self.records)] = recon
        self.records.append(rec)

    def exact(self, t: FileTensor, role: str = "tensor") -> dict:
        """Pass a tensor through exactly: a lossless frame, or with the other bytes."""
        if t.codable and t.nbytes >= MIN_CODED_BYTES:
            tensor = torch.from_numpy(self.m.u8(t.offset, t.nbytes).copy()).view(CODABLE[t.dtype])
            frame, ids = self.books.encode(tensor)
            rec = _record(t, role, "frame", frame={"dtype": t.dtype, "books": ids}, stats={"max_abs_error": 0.0,
                                                                                           "rel_rms_error": 0.0})
            self.frames.append((rec["frame"], frame))
            self.add(rec, self.m.u8(t.offset, t.nbytes))
        else:
            rec = _record(t, role, "skeleton", stats={"max_abs_error": 0.0, "rel_rms_error": 0.0})
            self.add(rec, None)
        return rec

    def param(self, w: FileTensor, m1: FileTensor | None, m2: FileTensor | None, base: torch.Tensor | None,
              p: dict) -> None:
        """Code one weight (a residual against base, or exactly in a keyframe) and its moments."""
        k = (1 << p["bits"]) - 1
        W = _floats(w, self.m)
        n = W.size
        if base is None:
            self.exact(w, "weight")
            recon_u8 = self.m.u8(w.offset, w.nbytes).copy()
            kept = np.ones(n, bool)
        else:
            B = base.float().numpy().reshape(-1)
            R = W - B
            if m2 is not None:
                v_mean = float(np.mean(_floats(m2, self.m), dtype=np.float64))
                factor = min(_MAX_FACTOR, p["alpha"] / math.sqrt(v_mean)) if v_mean > 0 else _MAX_FACTOR
            else:
                factor = _WEIGHTS_ONLY_FACTOR
            if not prunable(w):
                factor = 0.0
            absR = np.abs(R)
            threshold = float(np.median(absR)) * factor if n else 0.0
            kept = absR > threshold
            sym, cents = quantize(R[kept], k)
            deq = np.zeros(n, np.float32)
            deq[kept] = dequantize(sym, cents, "value")
            recon_u8 = _cast(B + deq, w.dtype)
            qerr = float(np.max(np.abs(R[kept] - deq[kept]))) if sym.size else 0.0
            stats = {"factor": factor, "threshold": threshold, "bound": max(threshold, qerr),
                     **error_stats(_back(recon_u8, w.dtype), W)}
            self.streams["weight_mask"].append(np.packbits(kept, bitorder="little"))
            self.streams["weight_index"].append(sym)
            self.add(_record(w, "weight", "residual", centroids=cents.tolist(), domain="value",
                             kept=int(kept.sum()), stats=stats), recon_u8)
        self.weights[w.name] = _as_weight(recon_u8, w.dtype, w.shape)
        if m1 is None:
            return
        M = _floats(m1, self.m)
        beta = p["beta"] if prunable(w) else 0.0
        threshold = beta * float(np.mean(np.abs(M), dtype=np.float64)) if n else 0.0
        mask = (np.abs(M) > threshold) & kept
        self.streams["exp_avg_mask"].append(np.packbits(mask[kept], bitorder="little"))
        for mt, role, x, domain in ((m1, "exp_avg", M, "value"),
                                    (m2, "exp_avg_sq", _floats(m2, self.m), "sqrt")):
            sym, cents = quantize(np.sqrt(x[mask]) if domain == "sqrt" else x[mask], k)
            fill = fill_value(x, mask) if role == "exp_avg_sq" else 0.0
            vals = np.full(n, dequantize(np.zeros(1, np.uint8), np.zeros(0, np.float32), domain, fill)[0])
            vals[mask] = dequantize(sym, cents, domain)
            recon_u8 = _cast(vals, mt.dtype)
            stats = {"threshold": threshold if role == "exp_avg" else None, **error_stats(_back(recon_u8, mt.dtype), x)}
            self.streams[f"{role}_index"].append(sym)
            self.add(_record(mt, role, "value", param=w.name, centroids=cents.tolist(), domain=domain,
                             kept=int(mask.sum()), fill=fill, stats=stats), recon_u8)

    def precision(self, t: FileTensor, keep_bits: int) -> None:
        """Round a float tensor's mantissas to keep_bits and code it losslessly."""
        if not (t.codable and t.dtype in LOSSY_DTYPES and t.nbytes >= MIN_CODED_BYTES):
            self.exact(t)
            return
        ints = self.m.u8(t.offset, t.nbytes).copy().view(_INTS[t.dtype])
        drop = MANTISSA[t.dtype] - min(keep_bits, MANTISSA[t.dtype])
        cut = round_mantissa(ints, drop, t.dtype)
        packed = next((d for (src, least), d in _PACK.items() if src == t.dtype and drop >= least), None)
        if packed is not None:
            shift = 8 * (cut.itemsize - spec_for(CODABLE[packed]).itemsize)
            narrow = (cut >> shift).astype(np.uint16 if spec_for(CODABLE[packed]).itemsize == 2 else np.uint8)
            tensor = torch.from_numpy(narrow).view(CODABLE[packed])
        else:
            tensor = torch.from_numpy(cut).view(CODABLE[t.dtype])
        frame, ids = self.books.encode(tensor)
        orig, recon = _back(ints.view(np.uint8), t.dtype), _back(cut.view(np.uint8), t.dtype)
        # The relative bound holds for normal values; subnormals have fewer bits to keep.
        normal = np.isfinite(orig) & (np.abs(orig) >= float(torch.finfo(CODABLE[t.dtype]).tiny))
        rel = np.abs(recon[normal].astype(np.float64) - orig[normal]) / np.abs(orig[normal])
        stats = {"keep_bits": keep_bits, "bound_rel": 2.0 ** -(min(keep_bits, MANTISSA[t.dtype]) + 1),
                 "max_rel_error": float(rel.max()) if rel.size else 0.0,
                 **error_stats(np.where(np.isfinite(orig), recon, 0), np.where(np.isfinite(orig), orig, 0))}
        rec = _record(t, "tensor", "precision", frame={"dtype": packed or t.dtype, "books": ids}, stats=stats)
        self.frames.append((rec["frame"], frame))
        self.add(rec, cut.view(np.uint8))


# -- the file -------------------------------------------------------------------------------
def _skeleton(m_or_bytes, size: int, records: list[dict]) -> tuple[bytes, list]:
    """Return the source bytes outside rewritten tensors, and those tensors' (offset, nbytes)."""
    cut = sorted((r["offset"], r["nbytes"]) for r in records if r["coding"] != "skeleton")
    parts, pos = [], 0
    for off, nb in cut:
        parts.append(bytes(m_or_bytes(pos, off - pos)))
        pos = off + nb
    parts.append(bytes(m_or_bytes(pos, size - pos)))
    return b"".join(parts), cut


def _rebuild(size: int, skeleton: bytes, records: list[dict], values: dict) -> bytearray:
    """Lay the skeleton and the reconstructed tensors out as the source was; patch zip CRCs."""
    out = bytearray(size)
    cut = sorted((r["offset"], r["nbytes"], i) for i, r in enumerate(records) if r["coding"] != "skeleton")
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


def _skeleton_offsets(records: list[dict]) -> None:
    """Set each skeleton-coded record's offset inside the skeleton blob."""
    cut = sorted((r["offset"], r["nbytes"]) for r in records if r["coding"] != "skeleton")
    for r in records:
        if r["coding"] == "skeleton":
            r["skeleton_offset"] = r["offset"] - sum(nb for off, nb in cut if off < r["offset"])


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open_regular(path) as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_lossy(path) -> bool:
    """Return True when the file starts with the lossy container's magic.

    Args:
        path: any file.

    Returns:
        Whether it is a lossy comm_codec checkpoint (by its first 8 bytes).

    Raises:
        OSError: the file cannot be opened.
    """
    with open_regular(os.fspath(path)) as fh:
        return fh.read(len(LOSSY_MAGIC)) == LOSSY_MAGIC


def _load_index(m: FileMap) -> dict:
    """Read and check a lossy file's index; books are parsed into index["_books"]."""
    path = m.path
    kind = identify(bytes(m.u8(0, min(8, m.size))))
    if kind != "lossy":
        if kind == "exact":
            fail(path, "is an exact (lossless) comm_codec checkpoint, not a lossy one; restore it with "
                       "`comm-codec decompress` or comm_codec.checkpoint.decompress_file")
        fail(path, NOT_OURS)
    return read_container_index(m, LOSSY_MAGIC, VERSION, _check_index, "lossy checkpoint")


def _check_blob(b, end: int) -> bool:
    return is_int(b["offset"], HEADER.size, end) and is_int(b["length"], 0, end) and b["offset"] + b["length"] <= end


_SHA = Str(length=64)
_BLOB = {"offset": Int(), "length": Int()}
# The lossy index (module docstring), as read: every field the readers use.
_INDEX = Record({
    "format": OneOf(_INDEX_FORMAT), "version": OneOf(VERSION), "mode": OneOf(*MODES),
    "params": MapOf(Str(32), Num()),
    "source": Record({"name": Str(), "size": Int(), "sha256": _SHA, "format": OneOf("safetensors", "torch_zip")}),
    "reconstruction": Record({"size": Int(), "sha256": _SHA}),
    "base": Nullable(Record({"name": Str(), "sha256": _SHA})),
    "notes": ListOf(Str(), 64),
    "books": MapOf(Str(length=16), Anything(dict)),
    "streams": Record({name: Nullable(Record({**_BLOB, "size": Int(), "book": Str(length=16)}))
                       for name in _STREAMS}),
    "skeleton": Record({**_BLOB, "size": Int(), "crc32": Int(0, 0xFFFFFFFF)}),
    "tensors": ListOf(Record({
        "name": Str(1 << 16), "dtype": Str(64), "shape": Nullable(ListOf(Int(), 64)), "offset": Int(),
        "nbytes": Int(), "role": OneOf("weight", "exp_avg", "exp_avg_sq", "tensor"),
        "coding": OneOf("residual", "value", "frame", "precision", "skeleton"), "param": Nullable(Str(1 << 16)),
        "centroids": Nullable(ListOf(Num(), 255)), "domain": Nullable(OneOf("value", "sqrt")),
        "kept": Nullable(Int()), "fill": Num(lo=0.0),
        "frame": Nullable(Record({**_BLOB, "dtype": Str(64), "books": ListOf(Str(length=16), 8)})),
        "skeleton_offset": Nullable(Int()), "crc_at": ListOf(Int(), 8),
        "stats": MapOf(Str(32), Nullable(Num(finite=False)))})),
    "errors": MapOf(Str(64), Num(finite=False)),
}, optional=("created_by",))


def _check_index(index: dict, end: int, path) -> None:
    """Check the whole index (schema, then layout); raise CheckpointError naming the first bad field."""
    if index.get("format") != _INDEX_FORMAT or index.get("version") != VERSION:
        fail(path, f"index format {str(index.get('format'))[:40]!r} version {str(index.get('version'))[:10]!r}")
    schema.check(index, _INDEX, path)
    size = index["reconstruction"]["size"]
    if size != index["source"]["size"]:
        fail(path, "index: the reconstruction and the source differ in size")
    books = {}
    for book_id, entry in index["books"].items():
        book = Codebook.from_dict(entry)
        if book.id != book_id:
            fail(path, f"index: codebook listed as {book_id} is {book.id}")
        books[book_id] = book
    index["_books"] = books
    if not _check_blob(index["skeleton"], end):
        fail(path, "index: skeleton lies outside the file")
    for name, s in index["streams"].items():
        if name not in _STREAMS or (s is not None and not (_check_blob(s, end) and is_int(s["size"])
                                                           and (s["book"] == "0" * 16 or s["book"] in books))):
            fail(path, f"index: stream {name!r} is malformed")
    weights = set()
    for i, r in enumerate(index["tensors"]):
        ok = (isinstance(r["name"], str) and is_int(r["offset"]) and is_int(r["nbytes"])
              and r["offset"] + r["nbytes"] <= size and (r["dtype"] in CODABLE or r["coding"] == "skeleton")
              and (r["dtype"] not in CODABLE or r["nbytes"] % spec_for(CODABLE[r["dtype"]]).itemsize == 0)
              and all(is_int(a, 0, size - 4) for a in r["crc_at"]))
        if r["coding"] in ("frame", "precision"):
            f = r["frame"]
            ok = ok and _check_blob(f, end) and f["dtype"] in CODABLE and all(
                b == "0" * 16 or b in books for b in f["books"])
        elif r["coding"] in ("residual", "value"):
            ok = ok and r["dtype"] in LOSSY_DTYPES and isinstance(r["centroids"], list) and len(
                r["centroids"]) <= 255 and r["domain"] in ("value", "sqrt") and is_int(r["kept"])
            ok = ok and (r["coding"] == "residual" or r["param"] in weights)
            ok = ok and isinstance(r["fill"], (int, float)) and math.isfinite(r["fill"]) and r["fill"] >= 0
        elif r["coding"] == "skeleton":
            ok = ok and is_int(r["skeleton_offset"]) and r["skeleton_offset"] + r["nbytes"] <= index["skeleton"]["size"]
        else:
            ok = False
        if not ok:
            fail(path, f"index: tensor {i} ({r.get('name')!r}) is malformed")
        if r["role"] == "weight":
            weights.add(r["name"])
    # Rewritten tensors tile the reconstruction without overlap; the skeleton is the rest.
    pos = cut = 0
    for off, nb in sorted((r["offset"], r["nbytes"]) for r in index["tensors"] if r["coding"] != "skeleton"):
        if off < pos:
            fail(path, "index: rewritten tensors overlap")
        pos, cut = off + nb, cut + nb
    if index["skeleton"]["size"] != size - cut:
        fail(path, f"index: the skeleton holds {index['skeleton']['size']} bytes, the tensors leave {size - cut}")


def read_index(path) -> dict:
    """Return the checked JSON index of a lossy file (see the module docstring).

    Args:
        path: a lossy file.

    Returns:
        The index dict: mode, parameters, source, base, errors achieved, tensors.

    Raises:
        CheckpointError: not a lossy file, truncated, or corrupted.
    """
    return index_file(path, _load_index)


# -- decoding -------------------------------------------------------------------------------
_cache: collections.OrderedDict = collections.OrderedDict()
_cache_lock = threading.Lock()


def clear_cache() -> None:
    """Forget the cached reconstructions (the next decode walks its whole chain)."""
    with _cache_lock:
        _cache.clear()


def _cache_get(sha: str):
    with _cache_lock:
        hit = _cache.get(sha)
        if hit is not None:
            _cache.move_to_end(sha)
        return hit


def _cache_put(sha: str, weights: dict) -> None:
    with _cache_lock:
        _cache[sha] = weights
        _cache.move_to_end(sha)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)


def _decode(path: str, m: FileMap, index: dict, base: dict | None, full: bool, threads: int | None):
    """Decode a lossy file: reconstructed weights, and (full) every rewritten tensor's bytes."""
    books = _Books(threads)
    books.books = index["_books"]
    streams = {}
    for name, s in index["streams"].items():
        if s is None or not (full or name.startswith("weight_")):  # a chain link needs weights only
            streams[name] = np.zeros(0, np.uint8)
            continue
        frame = m.u8(s["offset"], s["length"])
        streams[name] = books.decode(frame, [s["book"]], torch.uint8, s["size"], f"{path}: stream {name}").numpy()
    cursor = dict.fromkeys(_STREAMS, 0)

    def take(name, count):
        at = cursor[name]
        if at + count > streams[name].size:
            fail(path, f"stream {name} is shorter than its tensors need")
        cursor[name] = at + count
        return streams[name][at:at + count]

    skeleton = None
    if full or any(r["coding"] == "skeleton" and r["role"] == "weight" for r in index["tensors"]):
        skeleton = _skeleton_bytes(path, m, index)
    values, weights, kept_of = {}, {}, {}
    for i, r in enumerate(index["tensors"]):
        if r["coding"] == "skeleton" and r["role"] != "weight":
            continue  # restored with the other bytes
        n = r["nbytes"] // spec_for(CODABLE[r["dtype"]]).itemsize
        if not full and r["role"] != "weight":
            continue
        where = f"{path}: tensor {r['name']!r}"
        if r["coding"] in ("frame", "precision"):
            f = r["frame"]
            narrow = spec_for(CODABLE[f["dtype"]])
            out = books.decode(m.u8(f["offset"], f["length"]), f["books"], CODABLE[f["dtype"]], n, where)
            out = out.view(torch.uint8).numpy()
            u8 = _widen(out, r["dtype"], f["dtype"]) if narrow.itemsize != spec_for(CODABLE[r["dtype"]]).itemsize \
                else out.view(np.uint8)
            kept_of[r["name"]] = np.ones(n, bool)
        elif r["coding"] == "skeleton":
            u8 = np.frombuffer(skeleton, np.uint8, r["nbytes"], r["skeleton_offset"]).copy()
            kept_of[r["name"]] = np.ones(n, bool)
        elif r["coding"] == "residual":
            if base is None or r["name"] not in base:
                fail(path, f"tensor {r['name']!r} is a residual, but its base holds no such weight")
            kept = np.unpackbits(take("weight_mask", -(-n // 8)), count=n, bitorder="little").astype(bool)
            sym = take("weight_index", r["kept"])
            if int(kept.sum()) != r["kept"] or (sym.size and sym.max() > len(r["centroids"])) or not sym.all():
                fail(path, f"tensor {r['name']!r}: its mask or indices are corrupted")
            deq = np.zeros(n, np.float32)
            deq[kept] = dequantize(sym, np.array(r["centroids"], np.float32), "value")
            u8 = _cast(base[r["name"]].float().numpy().reshape(-1) + deq, r["dtype"])
            kept_of[r["name"]] = kept
        else:  # value: a moment, pruned where its weight's residual was
            wkept = kept_of[r["param"]]
            if r["role"] == "exp_avg":
                bits = take("exp_avg_mask", -(-int(wkept.sum()) // 8))
                mask = np.zeros(n, bool)
                mask[wkept] = np.unpackbits(bits, count=int(wkept.sum()), bitorder="little").astype(bool)
                kept_of["exp_avg:" + r["param"]] = mask
            else:
                mask = kept_of.get("exp_avg:" + r["param"])
                if mask is None:
                    fail(path, f"tensor {r['name']!r} comes before its first moment")
            sym = take(f"{r['role']}_index", r["kept"])
            if int(mask.sum()) != r["kept"] or (sym.size and sym.max() > len(r["centroids"])) or not sym.all():
                fail(path, f"tensor {r['name']!r}: its mask or indices are corrupted")
            fill = dequantize(np.zeros(1, np.uint8), np.zeros(0, np.float32), r["domain"], r["fill"])[0]
            vals = np.full(n, fill, np.float32)
            vals[mask] = dequantize(sym, np.array(r["centroids"], np.float32), r["domain"])
            u8 = _cast(vals, r["dtype"])
        if r["role"] == "weight":
            weights[r["name"]] = _as_weight(u8, r["dtype"], r["shape"])
        if r["coding"] != "skeleton":
            values[i] = u8
    left = [name for name in _STREAMS if cursor[name] != streams[name].size]
    if left:
        fail(path, f"stream {left[0]} holds more than its tensors use: corrupted")
    return weights, values, skeleton


def _widen(narrow: np.ndarray, dtype: str, packed: str) -> np.ndarray:
    """The bytes of a precision-cut tensor coded as the narrower dtype of its high bytes."""
    wide = _INTS[dtype]
    shift = 8 * (np.dtype(wide).itemsize - spec_for(CODABLE[packed]).itemsize)
    ints = narrow.view(np.uint8 if spec_for(CODABLE[packed]).itemsize == 1 else np.uint16)
    return (ints.astype(wide) << wide(shift)).view(np.uint8)


def _skeleton_bytes(path: str, m: FileMap, index: dict) -> bytes:
    s = index["skeleton"]
    blob = m.u8(s["offset"], s["length"])
    if zlib.crc32(blob) != s["crc32"]:
        fail(path, "the bytes around the tensors are corrupted (CRC-32 mismatch)")
    out = zstd_bounded(blob, s["size"], path, "the bytes around the tensors")
    if len(out) != s["size"]:
        fail(path, "the bytes around the tensors have the wrong size")
    return out


def _base_path(path: str, index: dict, override) -> tuple[str, str]:
    """Find and check the base a lossy file names; return (path, sha256).

    The recorded name comes from the file, so it is never followed as a path: it must be
    a plain file name, looked for beside the file, and a regular file. Only a base the
    user names (``override``) may lie anywhere.
    """
    rec = index["base"]
    if override is not None:
        cand = os.fspath(override)
    else:
        name = rec["name"]
        if name in ("", ".", "..") or os.path.basename(name) != name or "\0" in name:
            fail(path, f"records its base as {name[:80]!r}, which is not a plain file name: the file is "
                       "corrupted or crafted; pass the base's path yourself (--base)")
        cand = os.path.join(os.path.dirname(os.path.abspath(path)), name)
    if not os.path.exists(cand):
        raise ChainError(
            f"{path} is a lossy delta against {rec['name']} (sha256 {rec['sha256'][:16]}...), which is "
            f"missing: no file {cand}. Decompressing it needs every earlier file of its chain back to the "
            "keyframe: keep them side by side, or pass the base's path (--base)", cand)
    sha = _sha256(cand)
    if sha != rec["sha256"]:
        raise CheckpointError(f"wrong base: {cand} has sha256 {sha[:16]}..., but {path} was compressed against "
                              f"{rec['name']} with sha256 {rec['sha256'][:16]}...")
    return cand, sha


def _chain_weights(path: str, sha: str, threads: int | None) -> dict:
    """Reconstructed weights of a lossy file, decoding its chain back to the nearest cached
    link or keyframe (iteratively: chains may be long)."""
    chain, seen = [], set()
    cur, cur_sha = path, sha
    weights = None
    while True:
        weights = _cache_get(cur_sha)
        if weights is not None:
            break
        if cur_sha in seen:
            fail(path, "its chain of bases loops")
        seen.add(cur_sha)
        m = FileMap(cur)
        try:
            index = _load_index(m)
        finally:
            m.close()
        if index["mode"] != "excp":
            fail(cur, f"is a lossy {index['mode']} file; only excp files form chains")
        chain.append((cur, cur_sha))
        if index["base"] is None:
            break
        cur, cur_sha = _base_path(cur, index, None)
    for link, link_sha in reversed(chain):
        m = FileMap(link)
        try:
            index = _load_index(m)
            weights, _, _ = _decode(link, m, index, weights, False, threads)
        finally:
            m.close()
        _cache_put(link_sha, weights)
    return weights


# -- compress -------------------------------------------------------------------------------
def compress_file(src, dst, mode: str = "excp", base=None, bits: int = DEFAULT_BITS, alpha: float = DEFAULT_ALPHA,
                  beta: float = DEFAULT_BETA, keep_bits: int | None = None,
                  threads: int | None = None) -> LossySummary:
    """Compress a checkpoint lossily (an explicit opt-in; :func:`checkpoint.compress_file` is exact).

    Args:
        src: a safetensors file or a ``torch.save`` zip; only read.
        dst: the lossy file, written atomically.
        mode: "excp" (pruned residuals and moments, quantized) or "precision"
            (mantissa rounding).
        base: excp only: the previous checkpoint's *lossy* file; None makes a keyframe.
        bits: excp: quantization bits (1..8): ``2**bits - 1`` centroids plus zero.
        alpha: excp: weight pruning strength, relative to sqrt(mean exp_avg_sq).
        beta: excp: moment pruning threshold, in units of mean |exp_avg|.
        keep_bits: precision: mantissa bits kept (0..23; dtypes with fewer keep all).
        threads: numba threads for coding (default: numba's setting).

    Returns:
        A :class:`LossySummary`.

    Raises:
        ValueError: bad mode or parameters.
        CheckpointError: the source is not a torch or safetensors checkpoint; the base
            is not a lossy excp file, is from another run (tensor names or shapes
            differ), or its chain is incomplete (:class:`ChainError`); dst unwritable.
        FileNotFoundError, PermissionError: src or base unreadable.
    """
    started = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    params = _check_params(mode, base, bits, alpha, beta, keep_bits)
    check_paths(src, dst, None if base is None else os.fspath(base))
    base_rec, base_weights = None, None
    if base is not None:
        base = os.fspath(base)
        if not is_lossy(base):
            raise CheckpointError(f"base {base} is not a lossy comm_codec file: --base takes the previous "
                                  "checkpoint's lossy file (residuals are taken against its reconstruction, "
                                  "so a chain does not drift)")
        bsha = _sha256(base)
        base_weights = _chain_weights(base, bsha, threads)
        base_rec = {"name": os.path.basename(base), "sha256": bsha}
    m = FileMap(src)
    try:
        fmt, tensors = find_tensors(m)
        if fmt not in ("safetensors", "torch_zip"):
            raise CheckpointError(f"{src} is not a safetensors or torch.save checkpoint; lossy modes rewrite "
                                  "tensors in place and need one (compress other files losslessly)")
        books = _Books(threads)
        enc = _Encoder(m, books)
        notes = []
        if mode == "excp":
            pairs, rest = pair_moments(src, fmt, tensors)
            if base_weights is not None:
                _check_same_run(base, base_weights, [p for p, _, _ in pairs])
            alone = [p.name for p, m1, _ in pairs if m1 is None]
            if pairs and len(alone) == len(pairs):
                notes.append("no Adam state (exp_avg/exp_avg_sq) found: weights-only fallback, residuals "
                             f"pruned below {_WEIGHTS_ONLY_FACTOR:g} x median|residual|, no moments coded")
            elif alone:
                notes.append(f"{len(alone)} weights have no Adam state ({', '.join(alone[:3])}"
                             f"{'...' if len(alone) > 3 else ''}): pruned by magnitude only")
            if base is None:
                notes.append("keyframe: weights stored exactly; later files code residuals against them")
            for w, m1, m2 in pairs:
                enc.param(w, m1, m2, None if base_weights is None else base_weights[w.name], params)
            for t in rest:
                enc.exact(t)
        else:
            for t in tensors:
                enc.precision(t, params["keep_bits"])
        for note in notes:  # fallbacks warn; a keyframe is the expected start of a series
            log.log(logging.INFO if note.startswith("keyframe") else logging.WARNING, "%s: %s", src, note)
        records = enc.records
        crcs = zip_crc_fields(src) if fmt == "torch_zip" else {}
        for r in records:
            if r["coding"] != "skeleton":
                r["crc_at"] = crcs.get(r["offset"], [])
        _skeleton_offsets(records)
        skeleton, _ = _skeleton(m.u8, m.size, records)
        source_sha = hashlib.sha256(m.u8(0, m.size)).hexdigest() if m.size else hashlib.sha256().hexdigest()
        recon = _rebuild(m.size, skeleton, records, enc.values)
        stream_frames = {}
        for name, parts in enc.streams.items():
            data = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
            if data.size:
                frame, ids = books.encode(torch.from_numpy(data))
                stream_frames[name] = (frame, ids[0], data.size)
        index = {
            "format": _INDEX_FORMAT, "version": VERSION, "created_by": created_by(),
            "mode": mode, "params": params,
            "source": {"name": os.path.basename(src), "size": m.size, "sha256": source_sha, "format": fmt},
            "reconstruction": {"size": len(recon), "sha256": hashlib.sha256(recon).hexdigest()},
            "base": base_rec, "notes": notes,
            "books": {}, "streams": {}, "skeleton": None, "tensors": records, "errors": _worst(records),
        }
        with atomic_output(dst, mode=os.stat(src).st_mode) as out:
            h = hashlib.sha256()

            def put(data) -> int:
                at = out.pos
                out.write(data)
                h.update(data)
                if out.pos % 8:
                    pad = b"\0" * (8 - out.pos % 8)
                    out.write(pad)
                    h.update(pad)
                return at

            put(HEADER.pack(LOSSY_MAGIC, VERSION, 0, 0))
            for name in _STREAMS:
                if name in stream_frames:
                    frame, book, size = stream_frames[name]
                    index["streams"][name] = {"offset": put(frame), "length": frame.size, "size": size, "book": book}
                else:
                    index["streams"][name] = None
            for rec, frame in enc.frames:
                rec.update(offset=put(frame), length=frame.size)
            blob = zstandard.ZstdCompressor(level=9).compress(skeleton)
            index["skeleton"] = {"offset": put(blob), "length": len(blob), "size": len(skeleton),
                                 "crc32": zlib.crc32(blob)}
            index["books"] = {bid: b.to_dict() for bid, b in books.books.items()}
            text, trailer = encode_index(index, out.pos, VERSION, LOSSY_MAGIC)
            out.write(text)
            h.update(text)
            out.write(trailer)
            h.update(trailer)
            total = out.pos
            if not m.unchanged():
                raise CheckpointError(f"source {src} changed while it was being compressed; compress it again "
                                      "once it is complete")
            out.commit()
        if mode == "excp":
            _cache_put(h.hexdigest(), enc.weights)
    finally:
        m.close()
    summary = LossySummary("compress", mode, m.size, total, time.perf_counter() - started, fmt,
                           sum(r["coding"] in ("residual", "value", "precision") for r in records),
                           index["errors"], notes, None if base_rec is None else base_rec["name"])
    log.debug("%s: %s", src, summary.line())
    return summary


def _check_params(mode, base, bits, alpha, beta, keep_bits) -> dict:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "precision":
        if base is not None:
            raise ValueError("precision mode codes single checkpoints; --base is for --lossy excp")
        if not (isinstance(keep_bits, int) and not isinstance(keep_bits, bool) and 0 <= keep_bits <= 23):
            raise ValueError(f"precision mode needs keep_bits, the mantissa bits to keep (0..23), got {keep_bits!r}")
        return {"keep_bits": keep_bits}
    if keep_bits is not None:
        raise ValueError("keep_bits applies to precision mode, not excp")
    if not (isinstance(bits, int) and 1 <= bits <= 8):
        raise ValueError(f"bits must be an integer from 1 to 8, got {bits!r}")
    for name, value in (("alpha", alpha), ("beta", beta)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return {"bits": bits, "alpha": float(alpha), "beta": float(beta)}


def _check_same_run(base: str, base_weights: dict, params: list[FileTensor]) -> None:
    """Refuse a base from another run: every weight must be there, same shape and dtype."""
    names = {p.name for p in params}
    for p in params:
        bw = base_weights.get(p.name)
        if bw is None:
            raise CheckpointError(f"base {base} is not from the same run: it holds no weight {p.name!r} "
                                  f"(it holds {len(base_weights)} weights, e.g. {next(iter(base_weights), '-')!r})")
        shape = list(p.shape) if p.shape is not None else None
        if str(bw.dtype).replace("torch.", "") != p.dtype or bw.numel() * bw.element_size() != p.nbytes \
                or (shape is not None and list(bw.shape) != shape):
            raise CheckpointError(f"base {base} is not from the same run: weight {p.name!r} is "
                                  f"{str(bw.dtype).replace('torch.', '')} with {bw.numel()} elements there, "
                                  f"{p.dtype} {shape} here")
    missing = sorted(set(base_weights) - names)
    if missing:
        raise CheckpointError(f"base {base} is not from the same run: it holds weights this checkpoint does "
                              f"not ({', '.join(repr(n) for n in missing[:3])}{'...' if len(missing) > 3 else ''})")


def _worst(records: list[dict]) -> dict:
    """Per role, the worst tensor's relative RMS error and (``<role>_all``) all tensors'."""
    worst: dict = {}
    sums = collections.defaultdict(lambda: [0.0, 0.0])
    for r in records:
        if r["coding"] in ("residual", "value", "precision"):
            s = r["stats"]
            worst[r["role"]] = max(worst.get(r["role"], 0.0), s["rel_rms_error"])
            sums[r["role"]][0] += (s["rel_rms_error"] * s["norm"]) ** 2
            sums[r["role"]][1] += s["norm"] ** 2
    for role, (err, ref) in sums.items():
        worst[f"{role}_all"] = math.sqrt(err / ref) if ref else 0.0
    return worst


# -- decompress -----------------------------------------------------------------------------
def _restore(src: str, base, threads: int | None) -> tuple[bytearray, dict, int]:
    """Rebuild the reconstructed checkpoint's bytes in memory; check their sha256."""
    m = FileMap(src)
    try:
        index = _load_index(m)
        weights = None
        if index["base"] is not None:
            bpath, bsha = _base_path(src, index, base)
            weights = _chain_weights(bpath, bsha, threads)
        elif base is not None:
            log.warning("%s is not a delta (no base); ignoring base %s", src, base)
        _, values, skeleton = _decode(src, m, index, weights, True, threads)
        out = _rebuild(index["reconstruction"]["size"], skeleton, index["tensors"], values)
        if hashlib.sha256(out).hexdigest() != index["reconstruction"]["sha256"]:
            fail(src, "the reconstruction's sha256 does not match the one recorded: the file or its chain "
                      "is corrupted")
        return out, index, m.size
    finally:
        m.close()


def decompress_file(src, dst, base=None, threads: int | None = None) -> LossySummary:
    """Write the reconstructed checkpoint, in the source's format, from a lossy file.

    Args:
        src: a file written by :func:`compress_file`.
        dst: where to write the reconstruction (atomically, after its sha256 matched).
        base: the base lossy file, if not beside src under the name it records; earlier
            links of the chain are looked for beside each file.
        threads: numba threads for decoding.

    Returns:
        A :class:`LossySummary`.

    Raises:
        ChainError: a base of the chain is missing (names the file looked for).
        CheckpointError: src is not a lossy file, is corrupted, or a base is wrong.
    """
    started = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    check_paths(src, dst, None if base is None else os.fspath(base))
    out, index, size = _restore(src, base, threads)
    with atomic_output(dst, mode=os.stat(src).st_mode) as fh:
        fh.write(out)
        fh.commit()
    return _summary("decompress", index, size, started)


def verify_file(src, base=None, threads: int | None = None) -> LossySummary:
    """Decode a lossy file (and its chain) and check the reconstruction's sha256; write nothing.

    Args:
        src: the lossy file.
        base: its base lossy file, when not beside it under its recorded name.
        threads: numba threads for decoding.

    Returns:
        A :class:`LossySummary`.

    Raises:
        ChainError, CheckpointError: as :func:`decompress_file`.
    """
    started = time.perf_counter()
    _, index, size = _restore(os.fspath(src), base, threads)
    return _summary("verify", index, size, started)


def _summary(op: str, index: dict, size: int, started: float) -> LossySummary:
    recs = index["tensors"]
    return LossySummary(op, index["mode"], index["source"]["size"], size, time.perf_counter() - started,
                        index["source"]["format"], sum(r["coding"] in ("residual", "value", "precision") for r in recs),
                        index["errors"], index["notes"], None if index["base"] is None else index["base"]["name"])


def load(path, base=None, map_location="cpu"):
    """Reconstruct a lossy checkpoint in memory and load it.

    torch files are loaded with ``torch.load(..., weights_only=True)``, safetensors with
    ``safetensors.torch.load``.

    Args:
        path: the lossy file.
        base: its base lossy file, when not beside it under its recorded name.
        map_location: passed to ``torch.load`` for torch files.

    Returns:
        What the reconstructed file loads as: a state dict (or the saved object).

    Raises:
        ChainError, CheckpointError: as :func:`decompress_file`.
    """
    out, index, _ = _restore(os.fspath(path), base, None)
    if index["source"]["format"] == "safetensors":
        from safetensors.torch import load as st_load

        return st_load(bytes(out))
    return torch.load(io.BytesIO(out), map_location=map_location, weights_only=True)


# -- description ----------------------------------------------------------------------------
def describe(path) -> str:
    """Return a table of a lossy file: mode, parameters, base, and each tensor's achieved error.

    Args:
        path: the lossy file.

    Returns:
        Text for ``comm-codec inspect`` / ``ls``.

    Raises:
        CheckpointError: not a lossy file, truncated, or corrupted.
    """
    path = os.fspath(path)
    index = read_index(path)
    size = os.path.getsize(path)
    src, base = index["source"], index["base"]
    params = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in index["params"].items())
    lines = [
        f"file      {path}: LOSSY comm_codec checkpoint v{index['version']} (mode {index['mode']}), {human_bytes(size)}",
        f"params    {params}",
        f"source    {src['name']}: {src['format']}, {human_bytes(src['size'])}, sha256 {src['sha256']}",
        f"restores  an approximation: sha256 {index['reconstruction']['sha256']} (not the source's)",
        "base      " + ("none (keyframe)" if base is None else f"{base['name']}: sha256 {base['sha256']} "
                                                              "(its chain is needed to decompress)"),
        f"ratio     {src['size'] / max(1, size):.2f} ({human_bytes(src['size'])} -> {human_bytes(size)})",
        "errors    " + (", ".join(f"{k}: rel. RMS <= {v:.3e}" for k, v in index["errors"].items()) or "none"),
    ]
    lines += [f"note      {n}" for n in index["notes"]]
    width = max([len(r["name"]) for r in index["tensors"]] + [6])
    lines.append(f"{'tensor':<{width}}  {'role':<10} {'dtype':<9} {'coding':<9} {'kept':>7} {'max|err|':>9} "
                 f"{'relRMS':>9} {'bound':>9}")
    for r in index["tensors"]:
        s = r["stats"]
        kept = "-"
        if r["kept"] is not None:
            kept = f"{100 * r['kept'] / max(1, r['nbytes'] // spec_for(CODABLE[r['dtype']]).itemsize):6.2f}%"
        # the schema admits null for every stat (a bound may be none): "-", never a format error
        cells = [s.get("max_abs_error", 0), s.get("rel_rms_error", 0), s.get("bound", s.get("bound_rel"))]
        lines.append(f"{r['name']:<{width}}  {r['role']:<10} {r['dtype']:<9} {r['coding']:<9} {kept:>7} "
                     + " ".join(f"{'-' if v is None else format(v, '9.2e'):>9}" for v in cells))
    return "\n".join(lines)
