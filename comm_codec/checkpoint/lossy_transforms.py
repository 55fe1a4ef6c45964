"""The lossy transforms: which moments belong to which weight, quantization, rounding.

Used by the lossy format's modules (:mod:`.lossy`, :mod:`.lossy_index`,
:mod:`.lossy_tensors`). Pure functions of arrays and tensor lists: pairing a weight with
its AdamW ``exp_avg`` and ``exp_avg_sq``, an exact 1-D k-means, the value a pruned second
moment comes back as, the error statistics recorded per tensor, and ZipNN-style mantissa
rounding.
"""

from __future__ import annotations

import logging
import math
import re

import numpy as np

from .formats import FileTensor, storage_keys

__all__ = [
    "LOSSY_DTYPES",
    "MANTISSA",
    "PACKED",
    "pair_moments",
    "quantize",
    "quantize_with",
    "dequantize",
    "fill_value",
    "error_stats",
    "prunable",
    "round_mantissa",
]

log = logging.getLogger("comm_codec.checkpoint.lossy")

LOSSY_DTYPES = ("float32", "bfloat16", "float16")
MANTISSA = {"float32": 23, "bfloat16": 7, "float16": 10}
# A precision-cut tensor whose dropped bits cover its low bytes is coded as the narrower
# dtype of its high bytes: dtype -> (that dtype, the fewest dropped bits that allow it).
PACKED = {"float32": ("bfloat16", 16), "float16": ("float8_e5m2", 8)}
_OPT_STATE = re.compile(r"^(?P<prefix>(?:.*\.)?)state\.(?P<index>\d+)\.(?P<moment>exp_avg|exp_avg_sq)$")
_ANY_STATE = re.compile(r"(^|\.)state\.\d+\.")  # optimizer state of any kind (step counters...)


# -- finding weights and their Adam moments -------------------------------------------------
def pair_moments(path: str, fmt: str, tensors: list[FileTensor]):
    """Return [(weight, exp_avg or None, exp_avg_sq or None)] and the tensors left over.

    safetensors: ``exp_avg/<param>`` and ``exp_avg_sq/<param>`` belong to ``<param>``.
    torch zip (``{"model": ..., "optimizer": opt.state_dict()}``): optimizer state is keyed
    by parameter index, in param_groups order, which is the model's parameter order; the
    file's float tensors outside the optimizer, in pickling order (= state_dict order),
    are matched to state indices in order, skipping tensors whose shape differs (buffers).
    """
    floats = [t for t in tensors if t.codable and t.dtype in LOSSY_DTYPES]
    moments: dict = {}  # weight name (safetensors) or (prefix, index) -> {moment: tensor}
    if fmt == "safetensors":
        for t in floats:
            head, sep, rest = t.name.partition("/")
            if sep and head in ("exp_avg", "exp_avg_sq"):
                moments.setdefault(rest, {})[head] = t
        params = [t for t in floats if t.name.partition("/")[0] not in ("exp_avg", "exp_avg_sq")]
        slots = {p.name: moments.get(p.name, {}) for p in params}
    else:
        prefixes = set()
        for t in floats:
            hit = _OPT_STATE.match(t.name)
            if hit:
                prefixes.add(hit["prefix"])
                moments.setdefault((hit["prefix"], int(hit["index"])), {})[hit["moment"]] = t
        keys = storage_keys(path)
        params = [
            t for t in floats if not any(p and t.name.startswith(p) for p in prefixes) and not _ANY_STATE.search(t.name)
        ]
        params.sort(key=lambda t: (keys.get(t.offset, 1 << 62), t.offset))
        slots = {p.name: {} for p in params}
        for prefix in sorted(prefixes):
            j = 0
            for (pre, i), pair in sorted(((k, v) for k, v in moments.items() if k[0] == prefix), key=lambda kv: kv[0]):
                shape = next(iter(pair.values())).shape
                while j < len(params) and params[j].shape != shape:
                    j += 1
                if j == len(params):
                    log.debug("%s: optimizer state %s%d matches no remaining parameter", path, pre, i)
                    break
                slots[params[j].name] = pair
                log.debug("%s: optimizer state %sstate.%d belongs to %s", path, pre, i, params[j].name)
                j += 1
    out, used = [], set()
    for p in params:
        pair = slots[p.name]
        m1, m2 = pair.get("exp_avg"), pair.get("exp_avg_sq")
        ok = (
            m1 is not None
            and m2 is not None
            and m1.dtype in LOSSY_DTYPES
            and m2.dtype in LOSSY_DTYPES
            and m1.nbytes // m1.spec.itemsize == m2.nbytes // m2.spec.itemsize == p.nbytes // p.spec.itemsize
        )
        out.append((p, m1 if ok else None, m2 if ok else None))
        if ok:
            used.update((id(m1), id(m2)))
    used.update(id(p) for p in params)
    return out, [t for t in tensors if id(t) not in used]


# -- quantization ---------------------------------------------------------------------------
def _kmeans_1d(x: np.ndarray, k: int, iters: int = 300) -> np.ndarray:
    """Return at most k float32 centroids (ascending) that minimize the squared error of x.

    Lloyd's algorithm in one dimension is exact on sorted data: clusters are runs of the
    sorted values between centroid midpoints, so each iteration is k binary searches and
    prefix sums (ExCP uses faiss k-means; this is the same fixed point, deterministic).
    Starts from k equal-count slices.
    """
    s = np.sort(x.astype(np.float64))
    n = s.size
    distinct = np.concatenate(([True], s[1:] != s[:-1])) if n else np.zeros(0, bool)
    if int(distinct.sum()) <= k:
        return np.unique(s[distinct].astype(np.float32))
    csum = np.concatenate(([0.0], np.cumsum(s)))
    edges = np.linspace(0, n, k + 1).round().astype(np.int64)
    c = (csum[edges[1:]] - csum[edges[:-1]]) / np.maximum(edges[1:] - edges[:-1], 1)
    for _ in range(iters):
        cut = np.searchsorted(s, (c[1:] + c[:-1]) / 2, side="right")
        e = np.concatenate(([0], cut, [n]))
        cnt = e[1:] - e[:-1]
        new = np.where(cnt > 0, (csum[e[1:]] - csum[e[:-1]]) / np.maximum(cnt, 1), c)
        if not (new != c).any():  # converged (array_equal's checks cost more than this)
            break
        c = new
    return np.unique(c.astype(np.float32))


def quantize(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (symbols 1..k as uint8, centroids float32) for x; symbol s means centroids[s-1].

    Centroids are numbered by how often they are used, most first, so the index streams
    of all tensors share one distribution (and one Huffman book).
    """
    if x.size == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.float32)
    return quantize_with(x, _kmeans_1d(x, k))


def quantize_with(x: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return (symbols, centroids) for x on the given ascending float32 centroids, as :func:`quantize`."""
    if x.size == 0:
        return np.zeros(0, np.uint8), np.zeros(0, np.float32)
    mids = (c[1:].astype(np.float64) + c[:-1]) / 2
    nearest = np.searchsorted(mids, x.astype(np.float64), side="left")
    order = np.argsort(-np.bincount(nearest, minlength=c.size), kind="stable")
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return (rank[nearest] + 1).astype(np.uint8), c[order]


def fill_value(v: np.ndarray, mask: np.ndarray) -> float:
    """What a pruned exp_avg_sq element is restored as: the mean sqrt(v) of the pruned ones.

    ExCP restores pruned second moments as 0. Adam then divides the first steps after a
    resume by a tiny sqrt(v) and takes steps several times too large until v recovers
    (~1/(1-beta2) = 1000 steps): on TinyLM that moved the loss after 20 resumed steps by
    2 %. One number per tensor removes the effect.
    """
    rest = ~mask
    return float(np.float32(np.mean(np.sqrt(v[rest]), dtype=np.float64))) if rest.any() else 0.0


def dequantize(symbols: np.ndarray, centroids: np.ndarray, domain: str, fill: float = 0.0) -> np.ndarray:
    """Map symbols to values: 0 -> fill (0 unless pruned values are filled), s -> centroids[s-1]."""
    table = np.concatenate(([np.float32(fill)], centroids.astype(np.float32)))
    if domain == "sqrt":
        # A centroid over ~1.8e19 (a crafted file's) squares to inf, as float32 says.
        with np.errstate(over="ignore"):
            table = table * table
    return table[symbols]


def error_stats(recon: np.ndarray, orig: np.ndarray) -> dict:
    """Return the max |error|, the relative RMS error and the norm of orig (for summing errors)."""
    # In float64, a block at a time: whole-tensor float64 temporaries (two per call, on every
    # tensor of a checkpoint) cost more in fresh pages than in arithmetic.
    r, o = recon.ravel(), orig.ravel()
    n = o.size
    if n == 0:
        return {"max_abs_error": 0.0, "rel_rms_error": 0.0, "norm": 0.0}
    err = np.empty(min(n, _STATS_BLOCK), np.float64)
    wide = np.empty_like(err)
    peaks = np.empty(-(-n // _STATS_BLOCK), np.float64)
    sq_orig = sq_err = 0.0
    for i, a in enumerate(range(0, n, _STATS_BLOCK)):
        b = min(n, a + _STATS_BLOCK)
        e, w = err[: b - a], wide[: b - a]
        np.subtract(r[a:b], o[a:b], out=e, dtype=np.float64)
        w[...] = o[a:b]
        sq_orig += float(np.einsum("i,i->", w, w))
        sq_err += float(np.einsum("i,i->", e, e))
        peaks[i] = np.max(np.abs(e, out=e))
    norm = math.sqrt(sq_orig)
    return {
        "max_abs_error": float(np.max(peaks)),
        "rel_rms_error": math.sqrt(sq_err) / norm if norm else 0.0,
        "norm": norm,
    }


_STATS_BLOCK = 1 << 16  # elements: two float64 blocks stay in a core's cache


def prunable(w: FileTensor) -> bool:
    """Whether a weight is pruned, or only quantized (vectors: biases, norm scales).

    Adam moves every element of a vector by about the same step (it divides by sqrt(v)),
    so ``|R|`` is nearly constant, ``f · median|R|`` with f at its 2.5 cap prunes ~98 % of
    it, and what is pruned comes back as a drift that only the residual of a later file
    removes: on TinyLM the LayerNorm biases reached 33 % relative error after 9 links.
    Vectors are ~0.4 % of a transformer's parameters; keeping them costs ~2 % of the file.
    """
    if w.shape is not None:
        return len(w.shape) > 1
    return w.nbytes // w.spec.itemsize >= 4096


def round_mantissa(ints: np.ndarray, drop: int, dtype: str) -> np.ndarray:
    """Round IEEE bit patterns to nearest (ties to even), dropping ``drop`` mantissa bits.

    Non-finite values are left as they are (clearing a NaN's payload could make it Inf),
    and a finite value that would round up to Inf is truncated instead.
    """
    if drop <= 0:
        return ints.copy()
    width = 8 * ints.itemsize
    mant = MANTISSA[dtype]
    exp_mask = ((1 << (width - 1 - mant)) - 1) << mant
    big = ints.astype(np.uint64)
    low = np.uint64((1 << drop) - 1)
    rounded = (big + np.uint64((1 << (drop - 1)) - 1) + ((big >> np.uint64(drop)) & np.uint64(1))) & ~low
    rounded &= np.uint64((1 << width) - 1)
    finite = (ints & exp_mask) != exp_mask
    overflow = finite & ((rounded.astype(ints.dtype) & exp_mask) == exp_mask)
    out = np.where(finite, rounded, big).astype(ints.dtype)
    out[overflow] = ints[overflow] & ints.dtype.type(~int(low) & ((1 << width) - 1))
    # A carry into the sign bit cannot happen: the sign sits above the exponent, and an
    # all-ones exponent (the only one a carry could leave) was excluded above.
    return out
