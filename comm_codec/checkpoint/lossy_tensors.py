"""How each tensor of a lossy file is coded, and decoded back: the per-tensor side of the format.

:class:`Encoder` turns a source checkpoint's tensors into index records, pieces of the
five excp streams and frames: residuals of weights against the base's reconstruction
and moments, pruned and quantized (mode excp); mantissas cut (mode precision); or the
tensor exactly. :func:`decode_tensors` reads them back from a lossy file, in the same
order, checking each tensor's mask and indices against its record. The streams and
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
from .lossy_blobs import FileBooks, read_skeleton
from .lossy_index import STREAMS
from .lossy_transforms import (LOSSY_DTYPES, MANTISSA, PACKED, dequantize, error_stats, fill_value, prunable,
                               quantize, round_mantissa)

__all__ = ["Encoder", "decode_tensors", "check_expansion", "WEIGHTS_ONLY_FACTOR", "MAX_EXPANSION"]

_MAX_FACTOR = 2.5  # ExCP caps f: beyond it pruning removes residuals that matter
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
    rec = {"name": t.name, "dtype": t.dtype, "shape": t.shape, "offset": t.offset, "nbytes": t.nbytes,
           "role": role, "coding": coding, "param": None, "centroids": None, "domain": None, "kept": None,
           "fill": 0.0, "frame": None, "skeleton_offset": None, "crc_at": [], "stats": {}}
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
                factor = WEIGHTS_ONLY_FACTOR
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
        # The relative bound holds for normal values; subnormals have fewer bits to keep.
        normal = np.isfinite(orig) & (np.abs(orig) >= float(torch.finfo(CODABLE[t.dtype]).tiny))
        rel = np.abs(recon[normal].astype(np.float64) - orig[normal]) / np.abs(orig[normal])
        stats = {"keep_bits": keep_bits, "bound_rel": 2.0 ** -(min(keep_bits, MANTISSA[t.dtype]) + 1),
                 "max_rel_error": float(rel.max()) if rel.size else 0.0,
                 **error_stats(np.where(np.isfinite(orig), recon, 0), np.where(np.isfinite(orig), orig, 0))}
        rec = _record(t, "tensor", "precision", frame={"dtype": packed or t.dtype, "books": ids}, stats=stats)
        self.frames.append((rec["frame"], frame))
        self.add(rec, cut.view(np.uint8))


def decode_tensors(path: str, m: FileMap, index: dict, base: dict | None, full: bool, threads: int | None):
    """Decode a lossy file's tensors from its streams, frames and skeleton.

    Args:
        path: the file's name, for messages.
        m: the mapped file.
        index: its checked index (:func:`.lossy_index.load_index`).
        base: the base's reconstructed weights by name (None for a keyframe).
        full: decode every tensor; False: only the weights (what a chain link needs).
        threads: numba threads for decoding.

    Returns:
        (weights by name as tensors, record number -> reconstructed bytes of each rewritten
        tensor, the skeleton or None when it was not needed).

    Raises:
        CheckpointError: a stream, frame or tensor is corrupted or disagrees with the index.
    """
    check_expansion(path, m.size, index)
    books = FileBooks(threads, index["_books"])
    streams = {}
    for name, s in index["streams"].items():
        if s is None or not (full or name.startswith("weight_")):  # a chain link needs weights only
            streams[name] = np.zeros(0, np.uint8)
            continue
        frame = m.u8(s["offset"], s["length"])
        streams[name] = books.decode(frame, [s["book"]], torch.uint8, s["size"], f"{path}: stream {name}").numpy()
    cursor = dict.fromkeys(STREAMS, 0)

    def take(name, count):
        at = cursor[name]
        if at + count > streams[name].size:
            fail(path, f"stream {name} is shorter than its tensors need")
        cursor[name] = at + count
        return streams[name][at:at + count]

    skeleton = None
    if full or any(r["coding"] == "skeleton" and r["role"] == "weight" for r in index["tensors"]):
        skeleton = read_skeleton(path, m, index)
    values, weights, kept_of = {}, {}, {}
    for i, r in enumerate(index["tensors"]):
        if r["coding"] == "skeleton" and r["role"] != "weight":
            continue  # restored with the other bytes
        n = r["nbytes"] // spec_for(CODABLE[r["dtype"]]).itemsize
        if not full and r["role"] != "weight":
            continue
        where = f"{path}: tensor {printable(r['name'])}"
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
                fail(path, f"tensor {printable(r['name'])} is a residual, but its base holds no such weight")
            kept = np.unpackbits(take("weight_mask", -(-n // 8)), count=n, bitorder="little").astype(bool)
            sym = take("weight_index", r["kept"])
            if int(kept.sum()) != r["kept"] or (sym.size and sym.max() > len(r["centroids"])) or not sym.all():
                fail(path, f"tensor {printable(r['name'])}: its mask or indices are corrupted")
            deq = np.zeros(n, np.float32)
            deq[kept] = dequantize(sym, np.array(r["centroids"], np.float32), "value")
            prev = base[r["name"]]
            if prev.numel() != n:
                fail(path, f"tensor {printable(r['name'])} is a residual of {n} elements against a base weight of "
                           f"{prev.numel()}: the file or its base is corrupted")
            u8 = _cast(prev.float().numpy().reshape(-1) + deq, r["dtype"])
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
                    fail(path, f"tensor {printable(r['name'])} comes before its first moment")
            sym = take(f"{r['role']}_index", r["kept"])
            if int(mask.sum()) != r["kept"] or (sym.size and sym.max() > len(r["centroids"])) or not sym.all():
                fail(path, f"tensor {printable(r['name'])}: its mask or indices are corrupted")
            fill = dequantize(np.zeros(1, np.uint8), np.zeros(0, np.float32), r["domain"], r["fill"])[0]
            vals = np.full(n, fill, np.float32)
            vals[mask] = dequantize(sym, np.array(r["centroids"], np.float32), r["domain"])
            u8 = _cast(vals, r["dtype"])
        if r["role"] == "weight":
            weights[r["name"]] = _as_weight(u8, r["dtype"], r["shape"])
        if r["coding"] != "skeleton":
            values[i] = u8
    left = [name for name in STREAMS if cursor[name] != streams[name].size]
    if left:
        fail(path, f"stream {left[0]} holds more than its tensors use: corrupted")
    return weights, values, skeleton


def check_expansion(path: str, file_size: int, index: dict) -> None:
    """Refuse a file whose declared reconstruction is more than it can hold (:data:`MAX_EXPANSION`).

    Raises:
        CheckpointError: before anything is allocated.
    """
    claimed = index["reconstruction"]["size"]
    if claimed > MAX_EXPANSION * max(file_size, _SMALL_FILE):
        fail(path, f"claims to restore {claimed} bytes from {file_size}, more than {MAX_EXPANSION} times its size, "
                   "which no checkpoint but one of nearly all zeros compresses to: corrupted or crafted "
                   "(a decompression bomb); refused before decoding")


def _widen(narrow: np.ndarray, dtype: str, packed: str) -> np.ndarray:
    """The bytes of a precision-cut tensor coded as the narrower dtype of its high bytes."""
    wide = _INTS[dtype]
    shift = 8 * (np.dtype(wide).itemsize - spec_for(CODABLE[packed]).itemsize)
    ints = narrow.view(np.uint8 if spec_for(CODABLE[packed]).itemsize == 1 else np.uint16)
    return (ints.astype(wide) << wide(shift)).view(np.uint8)
