"""Lossy checkpoint compression, as an explicit opt-in: ExCP-style series and precision cuts.

:mod:`comm_codec.checkpoint` restores a checkpoint bit for bit. Users who keep every
checkpoint of a long run can trade exactness for size, as ExCP does (Li et al., "ExCP:
Extreme LLM Checkpoint Compression via Weight-Momentum Joint Shrinking", ICML 2024,
arXiv 2406.11257: ≈70× on Pythia-410M), or cut mantissa bits as ZipNN suggests
(Hershcovitch et al., 2024). Both modes write a container of their own magic
(:data:`~comm_codec.checkpoint.LOSSY_MAGIC`), which the exact reader refuses, and both
decompress to a file of the *same format* as the source (safetensors or ``torch.save``
zip) that ``safetensors.torch.load_file`` / ``torch.load(weights_only=True)`` read.

Example::

    >>> from comm_codec.checkpoint import lossy
    >>> lossy.compress_file("step00060.pt", "step00060.ccl")                    # doctest: +SKIP
    >>> s = lossy.compress_file("step00070.pt", "step00070.ccl", base="step00060.ccl")  # doctest: +SKIP
    >>> s = lossy.compress_file("step00080.pt", "step00080.ccl", base="step00070.ccl", max_error=1e-3)  # doctest: +SKIP
    >>> lossy.decompress_file("step00070.ccl", "step00070.recon.pt")           # doctest: +SKIP
    >>> lossy.compress_file("w.safetensors", "w.ccl", method="precision", keep_bits=7)  # doctest: +SKIP

``excp`` (a checkpoint holding weights and AdamW state) codes each weight's residual
against the *reconstructed* previous checkpoint (closed loop: a chain never drifts),
prunes residuals and moments and quantizes what survives with 1-D k-means; one knob,
``max_error`` (the relative RMS error every weight tensor may have), decides how hard
each weight is pruned and with how many bits (:mod:`.lossy_budget`), or ExCP's own rule
(``alpha``) does; the first file of a series (no base) is a *keyframe* whose weights are kept
exactly. Decompressing the n-th file needs files 0..n-1, looked for beside it.
``precision`` rounds every float tensor of 4 kB or more to ``keep_bits`` mantissa bits
and codes it losslessly. Tensors neither mode rewrites pass through exactly.

The format (container, index, streams, what each mode stores and why) is specified in
``comm_codec/checkpoint/lossy_format.md``. This module is the public face; the work is
done by :mod:`.lossy_index` (reading and checking the index), :mod:`.lossy_blobs` (frames
with the file's own books, the skeleton of untouched bytes), :mod:`.lossy_tensors` (each
tensor coded and decoded), :mod:`.lossy_chain` (bases and the cache of reconstructions),
:mod:`.lossy_transforms` (quantization, pruning rules, mantissa rounding) and
:mod:`.lossy_budget` (thresholds and bits from an error budget).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import io
import logging
import math
import os
import time
import zlib

import numpy as np
import torch
import zstandard

from ..core.quoting import printable, shown
from ..core.streams import spec_for
from .container import HEADER, LOSSY_MAGIC, created_by, encode_index
from .errors import ChainError, CheckpointError, fail
from .files import FileMap, atomic_output, check_paths
from .formats import CODABLE, FileTensor, find_tensors, zip_crc_fields
from .lossy_blobs import FileBooks, SkeletonReader, cut_skeleton, lay_out, skeleton_offsets
from .lossy_chain import chain_files, chain_weights, clear_cache, file_sha256, find_base, remember
from .lossy_index import INDEX_FORMAT, MODES, STREAMS, VERSION, is_lossy, load_index, read_index
from .lossy_tensors import WEIGHTS_ONLY_FACTOR, Decoder, Encoder
from .lossy_transforms import pair_moments
from .report import SizesRecord, human_bytes

# The lossy methods (``compress_file(method=...)``); a file records its method as "mode".
METHODS = MODES

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
    "METHODS",
    "VERSION",
    "DEFAULT_MAX_ERROR",
    "DEFAULT_MOMENT_BITS",
    "DEFAULT_BITS",
    "DEFAULT_ALPHA",
    "DEFAULT_BETA",
]

log = logging.getLogger("comm_codec.checkpoint.lossy")

DEFAULT_BITS = 4
# ExCP's alpha is relative to sqrt(mean v), i.e. to the gradient scale of the run (their
# Pythia default, 5e-5, prunes almost nothing on TinyLM, whose sqrt(mean v) is 2e-4..7e-3).
# Measured on TinyLM (d_model 256, 10 checkpoints 10 steps apart, 40 resumed steps;
# launch_scripts/bench_lossy.py): alpha 1e-3 -> 67x on the deltas, held-out loss after
# resuming +1.00 %; 7e-4 -> 62x, +0.92 %; 5e-4 -> 54x, +0.76 %; 3e-4 -> 36x, +0.45 %.
# The default keeps the 1 % resume target with a margin.
DEFAULT_ALPHA = 5e-4
DEFAULT_BETA = 2.0
# The error budget of every weight tensor of a delta, ‖Ŵ−W‖/‖W‖. Measured on
# all-MiniLM-L6-v2 fine-tuned with AdamW (masked-token loss, lr 5e-5, 5 checkpoints 10
# steps apart, 10 resumed steps; launch_scripts/bench_lossy.py): 1e-3 -> 30x on the
# deltas, held-out loss after resuming +0.33 %; 3e-3 -> 63x, +0.80 %; 3.5e-3 -> 70x,
# +0.97 %; 4e-3 -> 76x, +1.17 %; 1e-2 -> 161x, +4.5 %. The default is the loosest that
# kept the 1 % target there (with no margin: a run that must stay well inside 1 % wants
# 3e-3 or less).
DEFAULT_MAX_ERROR = 3.5e-3
# Moments lose nothing measurable at 3 bits against 4 (same resumed loss, 3 % smaller).
DEFAULT_MOMENT_BITS = 3


# -- results --------------------------------------------------------------------------------
@dataclasses.dataclass
class LossySummary(SizesRecord):
    """What one lossy compress, decompress or verify call did.

    ``bytes_in``, ``bytes_out``, ``bytes_saved`` and ``as_dict()`` as for
    :class:`~comm_codec.checkpoint.Summary`.

    Attributes:
        op: "compress", "decompress" or "verify".
        method: "excp" or "precision" (the ``method=`` of :func:`compress_file`).
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
    method: str
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
        what = {
            "compress": f"compressed (lossy {self.method}) {a} -> {b}",
            "decompress": f"decompressed (lossy {self.method}) {b} -> {a}",
            "verify": f"verified (lossy {self.method}) {b} ({a} reconstructed, sha256 ok)",
        }[self.op]
        errs = ", ".join(f"{printable(k[:-4], 64)} {v:.2e}" for k, v in self.errors.items() if k.endswith("_all"))
        if "weight" in self.errors:
            errs += f" (worst weight tensor {self.errors['weight']:.2e})"
        return (
            f"{what} (ratio {self.ratio:.2f}) in {self.seconds:.2f} s; "
            f"{self.lossy_tensors} tensors lossy"
            + (f", rel. RMS error {errs}" if errs else "")
            + (f"; base {printable(self.base)}" if self.base else "")
        )


# -- compress -------------------------------------------------------------------------------
def compress_file(
    src,
    dst,
    *,
    method: str = "excp",
    base=None,
    max_error: float | None = None,
    bits: int | None = None,
    alpha: float | None = None,
    beta: float = DEFAULT_BETA,
    keep_bits: int | None = None,
    threads: int | None = None,
    force: bool = False,
) -> LossySummary:
    """Compress a checkpoint lossily (an explicit opt-in; :func:`checkpoint.compress_file` is exact).

    Args:
        src: a safetensors file or a ``torch.save`` zip; only read.
        dst: the lossy file, written atomically.
        method: "excp" (pruned residuals and moments, quantized) or "precision"
            (mantissa rounding); the file records it as its ``mode``.
        base: excp only: the previous checkpoint's *lossy* file; None makes a keyframe.
        max_error: excp: the relative RMS error ‖Ŵ−W‖/‖W‖ every weight tensor of a delta
            may have (default :data:`DEFAULT_MAX_ERROR` unless ``alpha`` is given). Each
            weight gets the pruning threshold and bits that code it in the fewest bytes
            within it (a weight no choice fits is stored exactly); the file records the
            budget, what was chosen and the error achieved per tensor.
        bits: excp: quantization bits (1..8: ``2**bits - 1`` centroids plus zero) of the
            moments, and with ``alpha`` of the residuals too (default
            :data:`DEFAULT_MOMENT_BITS`, with ``alpha`` :data:`DEFAULT_BITS`).
        alpha: excp: ExCP's rule instead of a budget: weight pruning strength, relative
            to sqrt(mean exp_avg_sq).
        beta: excp: moment pruning threshold, in units of mean |exp_avg|.
        keep_bits: precision: mantissa bits kept (0..23; dtypes with fewer keep all).
        threads: CPU threads that code (default: numba's setting).
        force: replace an existing dst (default: refuse it, as :func:`checkpoint.compress_file`).

    Returns:
        A :class:`LossySummary`.

    Raises:
        ValueError: bad method or parameters.
        FileExistsError: dst exists and force is False.
        CheckpointError: the source is not a torch or safetensors checkpoint; the base
            is not a lossy excp file, is from another run (tensor names or shapes
            differ), or its chain is incomplete (:class:`ChainError`); dst unwritable.
        FileNotFoundError, PermissionError: src or base unreadable.
    """
    started = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    mode = method  # the file format's name for it
    params = _check_params(mode, base, max_error, bits, alpha, beta, keep_bits)
    check_paths(src, dst, None if base is None else os.fspath(base))
    _refuse_existing(dst, force)
    base_rec, base_weights = None, None
    if base is not None:
        base = os.fspath(base)
        if not is_lossy(base):
            raise CheckpointError(
                f"base {base} is not a lossy comm_codec file: --base takes the previous "
                "checkpoint's lossy file (residuals are taken against its reconstruction, "
                "so a chain does not drift)"
            )
        bsha = file_sha256(base)
        base_weights = chain_weights(base, bsha, threads)
        base_rec = {"name": os.path.basename(base), "sha256": bsha}
    m = FileMap(src)
    try:
        fmt, tensors = find_tensors(m)
        if fmt not in ("safetensors", "torch_zip"):
            raise CheckpointError(
                f"{src} is not a safetensors or torch.save checkpoint; lossy modes rewrite "
                "tensors in place and need one (compress other files losslessly)"
            )
        books = FileBooks(threads)
        enc = Encoder(m, books)
        notes = []
        if mode == "excp":
            pairs, rest = pair_moments(src, fmt, tensors)
            if base_weights is not None:
                _check_same_run(base, base_weights, [p for p, _, _ in pairs])
            alone = [p.name for p, m1, _ in pairs if m1 is None]
            if pairs and len(alone) == len(pairs):
                rule = (
                    f"residuals pruned below {WEIGHTS_ONLY_FACTOR:g} x median|residual|"
                    if "alpha" in params
                    else f"residuals pruned within the error budget {params['max_error']:g}"
                )
                notes.append(
                    f"no Adam state (exp_avg/exp_avg_sq) found: weights-only fallback, {rule}, no moments coded"
                )
            elif alone and "alpha" in params:
                notes.append(
                    f"{len(alone)} weights have no Adam state ({', '.join(alone[:3])}"
                    f"{'...' if len(alone) > 3 else ''}): pruned by magnitude only"
                )
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
        skeleton_offsets(records)
        skeleton = cut_skeleton(m.u8, m.size, records)
        source_sha = hashlib.sha256(m.u8(0, m.size).data).hexdigest() if m.size else hashlib.sha256().hexdigest()
        # Each rewritten tensor's zip CRC is recorded: a reader writes it into the local
        # header, which comes before the tensor's bytes, before it decodes them.
        for i, v in enc.values.items():
            if records[i]["crc_at"]:
                records[i]["crc32"] = zlib.crc32(v.data)
        recon_sha = hashlib.sha256()
        lay_out(
            m.size,
            io.BytesIO(skeleton),
            records,
            lambda i: [enc.values[i]],
            {i: r.get("crc32") for i, r in enumerate(records)},
            recon_sha.update,
            src,
        )
        stream_frames = {}
        for name, parts in enc.streams.items():
            data = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
            if data.size:
                frame, ids = books.encode(torch.from_numpy(data))
                stream_frames[name] = (frame, ids[0], data.size)
        index: dict = {
            "format": INDEX_FORMAT,
            "version": VERSION,
            "created_by": created_by(),
            "mode": mode,
            "params": params,
            "source": {"name": os.path.basename(src), "size": m.size, "sha256": source_sha, "format": fmt},
            "reconstruction": {"size": m.size, "sha256": recon_sha.hexdigest()},
            "base": base_rec,
            "notes": notes,
            "books": {},
            "streams": {},
            "skeleton": None,
            "tensors": records,
            "errors": _worst(records),
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
            for name in STREAMS:
                if name in stream_frames:
                    frame, book, size = stream_frames[name]
                    index["streams"][name] = {"offset": put(frame), "length": frame.size, "size": size, "book": book}
                else:
                    index["streams"][name] = None
            for rec, frame in enc.frames:
                rec.update(offset=put(frame), length=frame.size)
            blob = zstandard.ZstdCompressor(level=9).compress(skeleton)
            index["skeleton"] = {
                "offset": put(blob),
                "length": len(blob),
                "size": len(skeleton),
                "crc32": zlib.crc32(blob),
            }
            index["books"] = {bid: b.to_dict() for bid, b in books.books.items()}
            text, trailer = encode_index(index, out.pos, VERSION, LOSSY_MAGIC)
            out.write(text)
            h.update(text)
            out.write(trailer)
            h.update(trailer)
            total = out.pos
            if not m.unchanged():
                raise CheckpointError(
                    f"source {src} changed while it was being compressed; compress it again once it is complete"
                )
            out.commit()
        if mode == "excp":
            remember(h.hexdigest(), enc.weights)
    finally:
        m.close()
    summary = LossySummary(
        "compress",
        mode,
        m.size,
        total,
        time.perf_counter() - started,
        fmt,
        sum(r["coding"] in ("residual", "value", "precision") for r in records),
        index["errors"],
        notes,
        None if base_rec is None else base_rec["name"],
    )
    log.debug("%s: %s", src, summary.line())
    return summary


def _check_params(mode, base, max_error, bits, alpha, beta, keep_bits) -> dict:
    if mode not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {mode!r}")
    if mode == "precision":
        if base is not None:
            raise ValueError("precision mode codes single checkpoints; --base is for --lossy excp")
        if not (isinstance(keep_bits, int) and not isinstance(keep_bits, bool) and 0 <= keep_bits <= 23):
            raise ValueError(f"precision mode needs keep_bits, the mantissa bits to keep (0..23), got {keep_bits!r}")
        if max_error is not None or alpha is not None or bits is not None:
            raise ValueError("max_error, bits and alpha apply to excp mode; precision takes keep_bits")
        return {"keep_bits": keep_bits}
    if keep_bits is not None:
        raise ValueError("keep_bits applies to precision mode, not excp")
    if max_error is not None and alpha is not None:
        raise ValueError("give max_error (an error budget) or alpha (ExCP's pruning rule), not both")
    if bits is None:
        bits = DEFAULT_BITS if alpha is not None else DEFAULT_MOMENT_BITS
    if not (isinstance(bits, int) and not isinstance(bits, bool) and 1 <= bits <= 8):
        raise ValueError(f"bits must be an integer from 1 to 8, got {bits!r}")
    if alpha is None and max_error is None:
        max_error = DEFAULT_MAX_ERROR
    for name, value in (("max_error", max_error), ("alpha", alpha), ("beta", beta)):
        if value is not None and not (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        ):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if alpha is not None:
        return {"bits": bits, "alpha": float(alpha), "beta": float(beta)}
    return {"max_error": float(max_error), "bits": bits, "beta": float(beta)}


def _check_same_run(base: str, base_weights: dict, params: list[FileTensor]) -> None:
    """Refuse a base from another run: every weight must be there, same shape and dtype."""
    names = {p.name for p in params}
    for p in params:
        bw = base_weights.get(p.name)
        if bw is None:
            example = shown(next(iter(base_weights), "-"), 200)
            raise CheckpointError(
                f"base {base} is not from the same run: it holds no weight {shown(p.name, 200)} "
                f"(it holds {len(base_weights)} weights, e.g. {example})"
            )
        shape = list(p.shape) if p.shape is not None else None
        if (
            str(bw.dtype).replace("torch.", "") != p.dtype
            or bw.numel() * bw.element_size() != p.nbytes
            or (shape is not None and list(bw.shape) != shape)
        ):
            raise CheckpointError(
                f"base {base} is not from the same run: weight {shown(p.name, 200)} is "
                f"{str(bw.dtype).replace('torch.', '')} with {bw.numel()} elements there, "
                f"{p.dtype} {shape} here"
            )
    missing = sorted(set(base_weights) - names)
    if missing:
        listed = ", ".join(shown(n, 200) for n in missing[:3]) + ("..." if len(missing) > 3 else "")
        raise CheckpointError(
            f"base {base} is not from the same run: it holds weights this checkpoint does not ({listed})"
        )


def _worst(records: list[dict]) -> dict:
    """Per role, the worst tensor's relative RMS error and (``<role>_all``) all tensors'."""
    worst: dict = {}
    sums: collections.defaultdict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
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
def _restore(src: str, base, threads: int | None, output=None, beside: str | None = None) -> tuple[dict, int]:
    """Reconstruct a lossy file's checkpoint as a stream of pieces; check its sha256 at the end.

    Every claim of the index is checked first (:class:`.lossy_tensors.Decoder`), so a file
    that claims more than it holds fails before ``output`` is called. Then the pieces
    pass, in order, through the digest and to ``output(piece)`` (None: only the digest).
    Memory holds a piece of a tensor at a time (and, for an excp delta, its base's
    weights), whatever the tensors' sizes.

    Returns:
        (the checked index, the lossy file's size).

    Raises:
        CheckpointError: a claim does not hold, or the sha256 differs (``output`` has
            then seen bytes of a reconstruction that must be discarded).
    """
    m = FileMap(src)
    try:
        index = load_index(m)
        weights = None
        if index["base"] is not None:
            bpath, bsha = find_base(src, index, base, beside)
            weights = chain_weights(bpath, bsha, threads)
        elif base is not None:
            log.warning(
                "%s is not a delta (no base); ignoring base %s", printable(src, 4096), printable(os.fspath(base), 4096)
            )
        dec = Decoder(src, m, index, weights, threads)
        records = index["tensors"]
        crcs = {}
        for i, r in enumerate(records):
            if r["coding"] != "skeleton" and r["crc_at"]:
                # A file that does not record a tensor's CRC-32 has it computed by a first pass.
                crcs[i] = r["crc32"] if "crc32" in r else _crc32(dec.pieces(i))
        h = hashlib.sha256()

        def sink(piece) -> None:
            h.update(piece)
            if output is not None:
                output(piece)

        skeleton = SkeletonReader(src, m, index)
        lay_out(index["reconstruction"]["size"], skeleton, records, dec.pieces, crcs, sink, src)
        skeleton.finish()
        if h.hexdigest() != index["reconstruction"]["sha256"]:
            fail(src, "the reconstruction's sha256 does not match the one recorded: the file or its chain is corrupted")
        return index, m.size
    finally:
        m.close()


def _crc32(pieces) -> int:
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
    return crc


def decompress_file(
    src, dst, *, base=None, threads: int | None = None, beside=None, force: bool = False
) -> LossySummary:
    """Write the reconstructed checkpoint, in the source's format, from a lossy file.

    Args:
        src: a file written by :func:`compress_file`.
        dst: where to write the reconstruction: streamed into a temp file beside it,
            which becomes dst once the reconstruction's sha256 matched (and is removed
            otherwise); nothing is written for a file whose index claims more than it
            holds.
        base: the base lossy file, if not beside src under the name it records; earlier
            links of the chain are looked for beside each file.
        threads: CPU threads that decode (default: numba's setting).
        beside: the directory src's own base is looked for in (default: src's): the
            command line gives the working directory for a file read from stdin.
        force: replace an existing dst (default: refuse it).

    Returns:
        A :class:`LossySummary`.

    Raises:
        FileExistsError: dst exists and force is False.
        ChainError: a base of the chain is missing (names the file looked for).
        CheckpointError: src is not a lossy file, is corrupted, or a base is wrong.
    """
    started = time.perf_counter()
    src, dst = os.fspath(src), os.fspath(dst)
    check_paths(src, dst, None if base is None else os.fspath(base))
    _check_not_in_chain(src, dst, base, beside)
    _refuse_existing(dst, force)
    out = None

    def output(piece) -> None:
        nonlocal out
        if out is None:  # opened at the first byte: every claim has been checked by then
            out = stack.enter_context(atomic_output(dst, mode=os.stat(src).st_mode))
        out.write(piece)

    with contextlib.ExitStack() as stack:
        index, size = _restore(src, base, threads, output, beside)
        if out is None:
            out = stack.enter_context(atomic_output(dst, mode=os.stat(src).st_mode))
        out.commit()
    return _summary("decompress", index, size, started)


def _refuse_existing(dst: str, force: bool) -> None:
    if not force and os.path.lexists(dst):
        raise FileExistsError(17, f"{dst} exists; pass force=True to replace it", dst)


def _check_not_in_chain(src: str, dst: str, base, beside=None) -> None:
    """Refuse an output that would replace a file of src's chain (its base found beside it, ...)."""
    if not os.path.exists(dst) or not is_lossy(src):
        return
    m = FileMap(src)
    try:
        index = load_index(m)
    finally:
        m.close()
    for link in chain_files(src, index, base, beside):
        if os.path.samefile(link, dst):
            raise CheckpointError(
                f"output {dst} is {link}, a file of {src}'s chain of bases, which "
                "decompressing it needs; choose another output path (inputs are never modified)"
            )


def verify_file(src, *, base=None, threads: int | None = None, beside=None) -> LossySummary:
    """Decode a lossy file (and its chain) and check the reconstruction's sha256; write nothing.

    Args:
        src: the lossy file.
        base: its base lossy file, when not beside it under its recorded name.
        threads: numba threads for decoding.
        beside: as for :func:`decompress_file`.

    Returns:
        A :class:`LossySummary`.

    Raises:
        ChainError, CheckpointError: as :func:`decompress_file`.
    """
    started = time.perf_counter()
    index, size = _restore(os.fspath(src), base, threads, None, beside)
    return _summary("verify", index, size, started)


def _summary(op: str, index: dict, size: int, started: float) -> LossySummary:
    recs = index["tensors"]
    return LossySummary(
        op,
        index["mode"],
        index["source"]["size"],
        size,
        time.perf_counter() - started,
        index["source"]["format"],
        sum(r["coding"] in ("residual", "value", "precision") for r in recs),
        index["errors"],
        index["notes"],
        None if index["base"] is None else index["base"]["name"],
    )


def load(path, *, base=None, map_location="cpu"):
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
    out = bytearray()
    index, _ = _restore(os.fspath(path), base, None, out.extend)
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
    # Every string below comes from the file or the user: printable() escapes what could
    # drive the terminal or start a line of its own.
    params = ", ".join(
        f"{printable(k, 32)}={v:g}" if isinstance(v, float) else f"{printable(k, 32)}={v}"
        for k, v in index["params"].items()
    )
    lines = [
        f"file      {printable(path, 4096)}: LOSSY comm_codec checkpoint v{index['version']} (mode {index['mode']}), {human_bytes(size)}",
        f"params    {params}",
        f"source    {printable(src['name'])}: {src['format']}, {human_bytes(src['size'])}, "
        f"sha256 {printable(src['sha256'])}",
        f"restores  an approximation: sha256 {printable(index['reconstruction']['sha256'])} (not the source's)",
        "base      "
        + (
            "none (keyframe)"
            if base is None
            else f"{printable(base['name'])}: sha256 {printable(base['sha256'])} (its chain is needed to decompress)"
        ),
        f"ratio     {src['size'] / max(1, size):.2f} ({human_bytes(src['size'])} -> {human_bytes(size)})",
        "errors    "
        + (", ".join(f"{printable(k, 64)}: rel. RMS <= {v:.3e}" for k, v in index["errors"].items()) or "none"),
    ]
    lines += [f"note      {printable(n, 4096)}" for n in index["notes"]]
    budget = index["params"].get("max_error")
    if budget is not None and "weight" in index["errors"]:
        worst = index["errors"]["weight"]
        lines.append(
            f"budget    rel. RMS error <= {budget:.3g} on every weight tensor: worst achieved {worst:.3e} "
            f"({'within' if worst <= budget else 'OVER'} budget); per tensor below: bits and threshold "
            "chosen, error achieved"
        )
    precision = index["mode"] == "precision"
    if precision:
        lines.append(
            "bounds    |error| <= bound * |x| for normal x; <= subn.abs (bound times the dtype's smallest "
            "normal) for subnormal x, whose relative error can reach 1"
        )
    names = [printable(r["name"]) for r in index["tensors"]]
    width = max([len(n) for n in names] + [6])
    lines.append(
        f"{'tensor':<{width}}  {'role':<10} {'dtype':<9} {'coding':<9} {'kept':>7} "
        + (f"{'bits':>4} {'threshold':>9} " if budget is not None else "")
        + f"{'max|err|':>9} {'relRMS':>9} {'bound':>9}"
        + (f" {'subn.abs':>9}" if precision else "")
    )
    for name, r in zip(names, index["tensors"]):
        s = r["stats"]
        kept = "-"
        if r["kept"] is not None:
            kept = f"{100 * r['kept'] / max(1, r['nbytes'] // spec_for(CODABLE[r['dtype']]).itemsize):6.2f}%"
        # the schema admits null for every stat (a bound may be none): "-", never a format error
        cells = [s.get("max_abs_error", 0), s.get("rel_rms_error", 0), s.get("bound", s.get("bound_rel"))]
        if precision:
            cells.append(s.get("bound_abs_subnormal"))
        # bounds are printed rounded up: what is printed must still hold (they are tight)
        text = [format(v, "9.2e") if k < 2 else _ceil_e(v) for k, v in enumerate(cells) if v is not None]
        text = ["-" if v is None else text.pop(0) for v in cells]
        chosen = ""
        if budget is not None:  # what the budget made the search choose
            bits, threshold = s.get("bits"), s.get("threshold")
            chosen = (
                f"{'-' if bits is None else format(bits, 'g'):>4} "
                f"{'-' if threshold is None or r['role'] != 'weight' else format(threshold, '9.2e'):>9} "
            )
        lines.append(
            f"{name:<{width}}  {r['role']:<10} {printable(r['dtype'], 64):<9} {r['coding']:<9} {kept:>7} "
            + chosen
            + " ".join(f"{t:>9}" for t in text)
        )
    return "\n".join(lines)


def _ceil_e(v: float) -> str:
    """v in 3 significant digits (``1.25e-01``), rounded up so that a printed bound still holds."""
    text = f"{v:.2e}"
    if float(text) < v:
        mant, exp = text.split("e")
        text = f"{float(mant) + 0.01:.2f}e{exp}" if float(mant) < 9.99 else f"{1.0:.2f}e{int(exp) + 1:+03d}"
    return text
