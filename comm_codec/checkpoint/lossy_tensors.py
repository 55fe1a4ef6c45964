"""How each tensor of a lossy file is coded, and decoded back: the per-tensor side of the format.

:class:`Encoder` turns a source checkpoint's tensors into index records, pieces of the
five excp streams and frames: residuals of weights against the base's reconstruction
and moments, pruned and quantized (mode excp); mantissas cut (mode precision); or the
tensor exactly. :class:`Decoder` reads them back from a lossy file, a tensor and a piece
of a tensor at a time, in any order, checking each tensor's mask and indices against its
record. The streams and
roles are specified in ``lossy_format.md``; the numeric transforms (k-means, fill value,
mantissa rounding) are :mod:`.lossy_transforms`.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..core.quoting import printable
from ..core.streams import spec_for
from .errors import fail
from .exact import MIN_CODED_BYTES
from .files import FileMap
from .formats import CODABLE, FileTensor
from .lossy_blobs import CHUNK, PIECE, FileBooks, SkeletonReader
from .lossy_budget import choose
from .lossy_index import STREAMS
from .lossy_transforms import (
    LOSSY_DTYPES,
    MANTISSA,
    PACKED,
    dequantize,
    error_stats,
    fill_value,
    prunable,
    quantize,
    quantize_with,
    round_mantissa,
)

__all__ = ["Encoder", "Decoder", "check_expansion", "WEIGHTS_ONLY_FACTOR", "MAX_EXPANSION"]

_MAX_FACTOR = 2.5  # ExCP caps f: beyond it pruning removes residuals that matter
_RETRIES = 4  # budgeted residuals: tightenings tried before a weight is stored exactly
WEIGHTS_ONLY_FACTOR = 1.0  # no v to scale by: prune the smaller half of the residual
# Most bytes a lossy file may restore per byte it holds. A frame chunk of zeros costs a
# 16- or 24-byte table entry whatever its size, so only a checkpoint of whole chunks of
# zeros (64 Ki elements each) comes near this; excp deltas reach ~70x and a keyframe
# or a precision cut far less. Past it a file is refused before anything is decoded:
# a 99 kB file claiming 1 GiB (or 3.9 MB claiming 40 GiB) is a decompression bomb.
MAX_EXPANSION = 4096
# Files smaller than this may restore up to MAX_EXPANSION times this many bytes.
_SMALL_FILE = 16 << 10
_INTS = {"float32": np.uint32, "bfloat16": np.uint16, "float16": np.uint16}


def _floats(t: FileTensor, m: FileMap) -> np.ndarray:
    """A tensor's values as float32 (a copy)."""
    raw = torch.from_numpy(m.u8(t.offset, t.nbytes).copy()).view(CODABLE[t.dtype])
    return raw.float().numpy()


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values -> the bytes of dtype (round to nearest even)."""
    return torch.from_numpy(values).to(CODABLE[dtype]).view(torch.uint8).numpy()


def _back(u8: np.ndarray, dtype: str) -> np.ndarray:
    """The bytes of dtype -> float32 values."""
    return torch.from_numpy(np.ascontiguousarray(u8)).view(CODABLE[dtype]).float().numpy()


def _as_weight(u8: np.ndarray, dtype: str, shape) -> torch.Tensor:
    """The bytes of a reconstructed weight as a tensor of its dtype and (when it fits) shape."""
    t = torch.from_numpy(np.ascontiguousarray(u8)).view(CODABLE[dtype])
    return t.reshape(shape) if shape is not None and math.prod(shape) == t.numel() else t


def _record(t: FileTensor, role: str, coding: str, **extra) -> dict:
    """A tensor's index record, every field at its default but those given."""
    rec = {
        "name": t.name,
        "dtype": t.dtype,
        "shape": t.shape,
        "offset": t.offset,
        "nbytes": t.nbytes,
        "role": role,
        "coding": coding,
        "param": None,
        "centroids": None,
        "domain": None,
        "kept": None,
        "fill": 0.0,
        "frame": None,
        "skeleton_offset": None,
        "crc_at": [],
        "stats": {},
    }
    rec.update(extra)
    return rec


class Encoder:
    """Turns a source checkpoint into records, stream pieces and frames (in memory)."""

    def __init__(self, m: FileMap, books: FileBooks):
        self.m = m
        self.books = books
        self.records: list[dict] = []
        self.values: dict[int, np.ndarray] = {}  # record number -> reconstructed bytes
        self.frames: list[tuple[dict, np.ndarray]] = []  # (record["frame"], frame bytes)
        self.streams = {s: [] for s in STREAMS}
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
            rec = _record(
                t,
                role,
                "frame",
                frame={"dtype": t.dtype, "books": ids},
                stats={"max_abs_error": 0.0, "rel_rms_error": 0.0},
            )
            self.frames.append((rec["frame"], frame))
            self.add(rec, self.m.u8(t.offset, t.nbytes))
        else:
            rec = _record(t, role, "skeleton", stats={"max_abs_error": 0.0, "rel_rms_error": 0.0})
            self.add(rec, None)
        return rec

    def param(
        self, w: FileTensor, m1: FileTensor | None, m2: FileTensor | None, base: torch.Tensor | None, p: dict
    ) -> None:
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
            with np.errstate(invalid="ignore", over="ignore"):  # Inf - Inf: such weights are kept exact
                R = W - B
            coded = self._residual(w, m2, W, B, R, p)
            if coded is None:  # no choice meets the budget: the weight is stored exactly
                self.exact(w, "weight")
                recon_u8 = self.m.u8(w.offset, w.nbytes).copy()
                kept = np.ones(n, bool)
            else:
                kept, sym, cents, recon_u8, stats = coded
                self.streams["weight_mask"].append(np.packbits(kept, bitorder="little"))
                self.streams["weight_index"].append(sym)
                self.add(
                    _record(
                        w,
                        "weight",
                        "residual",
                        centroids=cents.tolist(),
                        domain="value",
                        kept=int(kept.sum()),
                        stats=stats,
                    ),
                    recon_u8,
                )
        self.weights[w.name] = _as_weight(recon_u8, w.dtype, w.shape)
        if m1 is None:
            return
        M = _floats(m1, self.m)
        beta = p["beta"] if prunable(w) else 0.0
        threshold = beta * float(np.mean(np.abs(M), dtype=np.float64)) if n else 0.0
        mask = (np.abs(M) > threshold) & kept
        self.streams["exp_avg_mask"].append(np.packbits(mask[kept], bitorder="little"))
        for mt, role, x, domain in ((m1, "exp_avg", M, "value"), (m2, "exp_avg_sq", _floats(m2, self.m), "sqrt")):
            sym, cents = quantize(np.sqrt(x[mask]) if domain == "sqrt" else x[mask], k)
            fill = fill_value(x, mask) if role == "exp_avg_sq" else 0.0
            vals = np.full(n, dequantize(np.zeros(1, np.uint8), np.zeros(0, np.float32), domain, fill)[0])
            vals[mask] = dequantize(sym, cents, domain)
            recon_u8 = _cast(vals, mt.dtype)
            stats = {
                "threshold": threshold if role == "exp_avg" else None,
                "bits": p["bits"],
                **error_stats(_back(recon_u8, mt.dtype), x),
            }
            self.streams[f"{role}_index"].append(sym)
            self.add(
                _record(
                    mt,
                    role,
                    "value",
                    param=w.name,
                    centroids=cents.tolist(),
                    domain=domain,
                    kept=int(mask.sum()),
                    fill=fill,
                    stats=stats,
                ),
                recon_u8,
            )

    def _residual(self, w: FileTensor, m2: FileTensor | None, W: np.ndarray, B: np.ndarray, R: np.ndarray, p: dict):
        """Prune and quantize a weight's residual: (kept, symbols, centroids, reconstruction, stats).

        With ``p["max_error"]`` the threshold and bits come from :func:`.lossy_budget.choose`
        and are tightened until the achieved relative RMS error is within the budget
        (None when no choice gets there: the caller stores the weight exactly); without it,
        from ExCP's rule (``alpha``, ``bits``).
        """
        n = W.size
        absR = np.abs(R)
        budget = p.get("max_error")
        if budget is None:
            if m2 is not None:
                v_mean = float(np.mean(_floats(m2, self.m), dtype=np.float64))
                factor = min(_MAX_FACTOR, p["alpha"] / math.sqrt(v_mean)) if v_mean > 0 else _MAX_FACTOR
            else:
                factor = WEIGHTS_ONLY_FACTOR
            if not prunable(w):
                factor = 0.0
            tries = [(float(np.median(absR)) * factor if n else 0.0, p["bits"])]
            extra = {"factor": factor}
        else:
            if not (np.isfinite(W).all() and np.isfinite(R).all()):
                return None  # a relative error of a tensor holding Inf or NaN is not defined
            # float64 per element, no float64 copy of W (and no BLAS threads: see error_stats)
            norm = math.sqrt(float(np.einsum("i,i->", W.ravel(), W.ravel(), dtype=np.float64)))
            choice = choose(R, norm, budget, prunable(w))
            if choice is None:
                return None
            # The estimate can miss (k-means run shorter, the cast to the weight's dtype):
            # each retry halves the threshold and adds a bit.
            tries = [(choice.threshold / 2**a, min(8, choice.bits + a)) for a in range(_RETRIES)]
            first = choice.centroids
            extra = {"budget": budget, "bits": None, "est_error": choice.est_error}
        for a, (threshold, bits) in enumerate(tries):
            kept = absR > threshold
            if a == 0 and budget is not None and first is not None:
                sym, cents = quantize_with(R[kept], first)
            else:
                sym, cents = quantize(R[kept], (1 << bits) - 1)
            deq = np.zeros(n, np.float32)
            deq[kept] = dequantize(sym, cents, "value")
            recon_u8 = _cast(B + deq, w.dtype)
            qerr = float(np.max(np.abs(R[kept] - deq[kept]))) if sym.size else 0.0
            stats = {
                **extra,
                "threshold": threshold,
                "bound": max(threshold, qerr),
                **error_stats(_back(recon_u8, w.dtype), W),
            }
            if budget is None or stats["rel_rms_error"] <= budget:
                if budget is not None:
                    stats["bits"] = bits
                return kept, sym, cents, recon_u8, stats
        return None

    def precision(self, t: FileTensor, keep_bits: int) -> None:
        """Round a float tensor's mantissas to keep_bits and code it losslessly."""
        if not (t.codable and t.dtype in LOSSY_DTYPES and t.nbytes >= MIN_CODED_BYTES):
            self.exact(t)
            return
        ints = self.m.u8(t.offset, t.nbytes).copy().view(_INTS[t.dtype])
        drop = MANTISSA[t.dtype] - min(keep_bits, MANTISSA[t.dtype])
        cut = round_mantissa(ints, drop, t.dtype)
        narrow, least = PACKED.get(t.dtype, (None, 0))
        packed = narrow if narrow is not None and drop >= least else None
        if packed is not None:
            shift = 8 * (cut.itemsize - spec_for(CODABLE[packed]).itemsize)
            narrow = (cut >> shift).astype(np.uint16 if spec_for(CODABLE[packed]).itemsize == 2 else np.uint8)
            tensor = torch.from_numpy(narrow).view(CODABLE[packed])
        else:
            tensor = torch.from_numpy(cut).view(CODABLE[t.dtype])
        frame, ids = self.books.encode(tensor)
        orig, recon = _back(ints.view(np.uint8), t.dtype), _back(cut.view(np.uint8), t.dtype)
        # The relative bound holds for normal values. A subnormal's bits are a count of the
        # smallest subnormal step, so dropping them errs by at most half the kept step:
        # 2**-(K+1) times the smallest normal, an absolute bound (its relative error can be 1).
        tiny = float(torch.finfo(CODABLE[t.dtype]).tiny)
        normal = np.isfinite(orig) & (np.abs(orig) >= tiny)
        sub = (np.abs(orig) < tiny) & (orig != 0)
        rel = np.abs(recon[normal].astype(np.float64) - orig[normal]) / np.abs(orig[normal])
        bound_rel = 2.0 ** -(min(keep_bits, MANTISSA[t.dtype]) + 1)
        sub_err = np.abs(recon[sub].astype(np.float64) - orig[sub])
        stats = {
            "keep_bits": keep_bits,
            "bound_rel": bound_rel,
            "max_rel_error": float(rel.max()) if rel.size else 0.0,
            "bound_abs_subnormal": bound_rel * tiny,
            "max_abs_error_subnormal": float(sub_err.max()) if sub_err.size else 0.0,
            **error_stats(np.where(np.isfinite(orig), recon, 0), np.where(np.isfinite(orig), orig, 0)),
        }
        rec = _record(t, "tensor", "precision", frame={"dtype": packed or t.dtype, "books": ids}, stats=stats)
        self.frames.append((rec["frame"], frame))
        self.add(rec, cut.view(np.uint8))


class _Stream:
    """Random access to one excp stream: the runs of chunks a read needs, decoded on demand.

    The last run decoded is kept (tensors read their sections in order, pieces in order).
    """

    def __init__(self, books: FileBooks, m: FileMap, rec: dict | None, name: str, where: str):
        self.books, self.where = books, f"{where}: stream {name}"
        self.size = 0 if rec is None else rec["size"]
        if rec is not None:
            self.frame = m.u8(rec["offset"], rec["length"])
            self.ids = [rec["book"]]
            self.p = books.check(self.frame, torch.uint8, rec["size"], self.where)
        self._lo, self._data = 0, np.zeros(0, np.uint8)

    def read(self, start: int, count: int) -> np.ndarray:
        """Elements start..start+count (checked against the stream's size by the index)."""
        if start < self._lo or start + count > self._lo + self._data.size:
            c0, c1 = start // CHUNK, -(-(start + count) // CHUNK)
            self._lo = c0 * CHUNK
            self._data = np.concatenate(
                list(self.books.pieces(self.frame, self.ids, self.p, c0, c1, self.where, step=(c1 - c0) * CHUNK))
                or [np.zeros(0, np.uint8)]
            )
        return self._data[start - self._lo : start - self._lo + count]


def _bits(stream: _Stream, bit: int, count: int) -> np.ndarray:
    """``count`` bits of a bit-packed stream (little bit order) from bit ``bit`` on, as bools."""
    lo = bit // 8
    raw = stream.read(lo, -(-(bit + count) // 8) - lo)
    return np.unpackbits(raw, count=bit - 8 * lo + count, bitorder="little")[bit - 8 * lo :].astype(bool)


class Decoder:
    """Decode a lossy file's tensors from its streams, frames and skeleton, a piece at a time.

    Every claim the index makes is checked when the decoder is made, before anything is
    decoded or written: the expansion limit (:func:`check_expansion`), every frame's
    header against its record, the excp streams' sizes against what their tensors take
    (computed from the records: each tensor's section of each stream is known up front,
    so tensors decode in any order), and each residual against its base weight. Then
    :meth:`pieces` yields a tensor's reconstructed bytes :data:`PIECE` elements at a time
    and :meth:`weights` returns the weights whole (what the next link of a chain needs).

    Args:
        path: the file's name, for messages.
        m: the mapped file.
        index: its checked index (:func:`.lossy_index.load_index`).
        base: the base's reconstructed weights by name (None for a keyframe).
        threads: numba threads for decoding.

    Raises:
        CheckpointError: a claim of the index does not hold.
    """

    def __init__(self, path: str, m: FileMap, index: dict, base: dict | None, threads: int | None):
        check_expansion(path, m.size, index)
        self.path, self.m, self.index, self.base = path, m, index, base or {}
        self.records = index["tensors"]
        self.books = FileBooks(threads, index["_books"])
        self.streams = {name: _Stream(self.books, m, index["streams"][name], name, path) for name in STREAMS}
        self.frames = {}
        self.at: dict[int, dict] = {}  # record number -> where its sections of the streams start
        self.weight_of: dict[str, int] = {}  # weight name -> its record number
        self.first_moment: dict[str, int] = {}  # weight name -> its exp_avg's record number
        used = dict.fromkeys(STREAMS, 0)
        for i, r in enumerate(self.records):
            n = 0 if r["coding"] == "skeleton" else self.numel(r)
            where = f"{path}: tensor {printable(r['name'])}"
            if r["coding"] in ("frame", "precision"):
                f = r["frame"]
                self.frames[i] = self.books.check(m.u8(f["offset"], f["length"]), CODABLE[f["dtype"]], n, where)
            elif r["coding"] == "residual":
                prev = self.base.get(r["name"])
                if prev is None:
                    fail(path, f"tensor {printable(r['name'])} is a residual, but its base holds no such weight")
                if prev.numel() != n:
                    fail(
                        path,
                        f"tensor {printable(r['name'])} is a residual of {n} elements against a base weight "
                        f"of {prev.numel()}: the file or its base is corrupted",
                    )
                self.at[i] = {"mask": 8 * used["weight_mask"], "index": used["weight_index"]}
                used["weight_mask"] += -(-n // 8)
                used["weight_index"] += r["kept"]
            elif r["coding"] == "value":
                w = self.records[self.weight_of[r["param"]]]
                if r["role"] == "exp_avg":
                    wkept = w["kept"] if w["coding"] == "residual" else n
                    self.at[i] = {"mask": 8 * used["exp_avg_mask"], "index": used["exp_avg_index"]}
                    used["exp_avg_mask"] += -(-wkept // 8)
                    self.first_moment[r["param"]] = i
                else:
                    m1 = self.first_moment.get(r["param"])
                    if m1 is None or self.records[m1]["kept"] != r["kept"]:
                        fail(
                            path,
                            f"tensor {printable(r['name'])} comes before its first moment, or keeps "
                            "other elements than it: corrupted",
                        )
                    self.at[i] = {"index": used["exp_avg_sq_index"]}
                used[f"{r['role']}_index"] += r["kept"]
            if r["role"] == "weight":
                self.weight_of[r["name"]] = i
        for name in STREAMS:
            if used[name] != self.streams[name].size:
                more = "more" if used[name] < self.streams[name].size else "less"
                fail(path, f"stream {name} holds {more} than its tensors use: corrupted")

    @staticmethod
    def numel(r: dict) -> int:
        return r["nbytes"] // spec_for(CODABLE[r["dtype"]]).itemsize

    def pieces(self, i: int):
        """Yield record i's reconstructed bytes, in order, at most :data:`PIECE` elements at a time."""
        r = self.records[i]
        where = f"{self.path}: tensor {printable(r['name'])}"
        if r["coding"] in ("frame", "precision"):
            f, p = r["frame"], self.frames[i]
            wide = spec_for(CODABLE[r["dtype"]]).itemsize != p.spec.itemsize
            for u8 in self.books.pieces(self.m.u8(f["offset"], f["length"]), f["books"], p, 0, p.nchunks, where):
                yield _widen(u8, r["dtype"], f["dtype"]) if wide else u8
            return
        if r["coding"] == "skeleton":
            raise ValueError("skeleton-coded tensors come with the skeleton")
        n = self.numel(r)
        counts = {"w_kept": 0, "m": 0}  # before the piece: elements the weight kept, symbols used
        cents = np.array(r["centroids"], np.float32)
        for a in range(0, n, PIECE):
            b = min(n, a + PIECE)
            kept = self._weight_mask(r["name"] if r["coding"] == "residual" else r["param"], a, b, counts)
            if r["coding"] == "residual":
                mask = kept
            else:
                first = self.at[self.first_moment[r["param"]]]
                mask = np.zeros(b - a, bool)
                mask[kept] = _bits(self.streams["exp_avg_mask"], first["mask"] + counts["w_kept"], int(kept.sum()))
                counts["w_kept"] += int(kept.sum())
            nk = int(mask.sum())
            stream = "weight_index" if r["coding"] == "residual" else f"{r['role']}_index"
            if counts["m"] + nk > r["kept"]:
                fail(self.path, f"tensor {printable(r['name'])}: its mask or indices are corrupted")
            sym = self.streams[stream].read(self.at[i]["index"] + counts["m"], nk)
            counts["m"] += nk
            if (sym.size and sym.max() > cents.size) or not sym.all():
                fail(self.path, f"tensor {printable(r['name'])}: its mask or indices are corrupted")
            if r["coding"] == "residual":
                # base + 0 where pruned, as the encoder computed it (-0.0 + 0.0 is +0.0)
                deq = np.zeros(b - a, np.float32)
                deq[mask] = dequantize(sym, cents, "value")
                vals = self.base[r["name"]].reshape(-1)[a:b].float().numpy() + deq
            else:
                fill = dequantize(np.zeros(1, np.uint8), np.zeros(0, np.float32), r["domain"], r["fill"])[0]
                vals = np.full(b - a, fill, np.float32)
                vals[mask] = dequantize(sym, cents, r["domain"])
            yield _cast(vals, r["dtype"])
        if counts["m"] != r["kept"]:
            fail(self.path, f"tensor {printable(r['name'])}: its mask or indices are corrupted")

    def _weight_mask(self, name: str, a: int, b: int, counts: dict) -> np.ndarray:
        """Which of elements a..b of weight ``name`` its residual kept (all for a keyframe's weight)."""
        i = self.weight_of.get(name)
        if i is None or self.records[i]["coding"] != "residual":
            return np.ones(b - a, bool)
        return _bits(self.streams["weight_mask"], self.at[i]["mask"] + a, b - a)

    def weights(self) -> dict:
        """Return the reconstructed weights by name, each whole (what the next link of a chain needs)."""
        out = {}
        for i, r in enumerate(self.records):
            if r["role"] == "weight" and r["coding"] != "skeleton":
                u8 = np.concatenate(list(self.pieces(i)) or [np.zeros(0, np.uint8)])
                out[r["name"]] = _as_weight(u8, r["dtype"], r["shape"])
        small = sorted(
            (r["skeleton_offset"], i)
            for i, r in enumerate(self.records)
            if r["role"] == "weight" and r["coding"] == "skeleton"
        )
        if small:
            skeleton = SkeletonReader(self.path, self.m, self.index)
            for off, i in small:
                if off < skeleton.pos:
                    fail(self.path, "index: skeleton-coded weights overlap")
                skeleton.skip(off - skeleton.pos)
                r = self.records[i]
                out[r["name"]] = _as_weight(
                    np.frombuffer(skeleton.read(r["nbytes"]), np.uint8).copy(), r["dtype"], r["shape"]
                )
        return out


def check_expansion(path: str, file_size: int, index: dict) -> None:
    """Refuse a file whose declared reconstruction is more than it can hold (:data:`MAX_EXPANSION`).

    Raises:
        CheckpointError: before anything is allocated.
    """
    claimed = index["reconstruction"]["size"]
    if claimed > MAX_EXPANSION * max(file_size, _SMALL_FILE):
        fail(
            path,
            f"claims to restore {claimed} bytes from {file_size}, more than {MAX_EXPANSION} times its size, "
            "which no checkpoint but one of nearly all zeros compresses to: corrupted or crafted "
            "(a decompression bomb); refused before decoding",
        )


def _widen(narrow: np.ndarray, dtype: str, packed: str) -> np.ndarray:
    """The bytes of a precision-cut tensor coded as the narrower dtype of its high bytes."""
    wide = _INTS[dtype]
    shift = 8 * (np.dtype(wide).itemsize - spec_for(CODABLE[packed]).itemsize)
    ints = narrow.view(np.uint8 if spec_for(CODABLE[packed]).itemsize == 1 else np.uint16)
    return (ints.astype(wide) << wide(shift)).view(np.uint8)
