"""Choosing how hard to prune and how many bits to spend per tensor, from an error budget.

The user states one number, ``max_error``: the relative RMS error ‖Ŵ−W‖/‖W‖ every weight
tensor of an excp delta may have. For each weight, :func:`choose` searches the pruning
threshold and the quantization bits that code its residual in the fewest estimated bytes
while the estimated error stays within the budget; :class:`.lossy_tensors.Encoder`
then quantizes with that choice, measures the error actually achieved, and tightens (or
stores the weight exactly) until the budget holds. A closed-loop chain puts what one file
prunes into the next file's residual, so a budget per file bounds the weights' error at
every link: it cannot grow along a series.

The search runs on the residual sorted once: the pruned elements ``|R| <= t`` are a
contiguous run of the sorted values, the kept ones the two runs around it, so 1-D k-means
(Lloyd's algorithm, exact on sorted data) of the kept values needs only prefix sums of
the sorted array, whatever the threshold tried.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["BITS", "SEARCH_STEPS", "Choice", "choose", "estimate"]

# The quantization bits a weight's residual may get (2**bits - 1 centroids plus zero).
BITS = (2, 3, 4, 5, 6, 7, 8)
# Bisection steps on the threshold per candidate bits, on a log scale over the _DECADES
# below the largest |residual|: the threshold is found to within 4 % of the largest
# feasible one.
SEARCH_STEPS = 8
_DECADES = 4
_LLOYD_STEPS = 25  # during the search; the chosen threshold's centroids run to convergence


@dataclasses.dataclass
class Choice:
    """What the search chose for one tensor.

    Attributes:
        threshold: prune ``|R| <= threshold`` (-1: keep everything, even exact zeros).
        bits: quantization bits of what is kept.
        est_bytes: estimated coded size (mask and indices).
        est_error: estimated relative RMS error.
        centroids: the k-means centroids of what the threshold keeps (ascending), or None.
    """

    threshold: float
    bits: int
    est_bytes: float
    est_error: float
    centroids: np.ndarray | None = None


class _Sorted:
    """A residual sorted once, with prefix sums of its values and squares."""

    def __init__(self, x: np.ndarray):
        # sorted in float32 (the residual's own precision, half the time of float64)
        self.s = np.sort(x.astype(np.float32, copy=False).reshape(-1)).astype(np.float64)
        self.n = n = self.s.size
        # prefix sums written in place (no concatenated copies of n-element arrays)
        self.c1 = np.empty(n + 1)
        self.c1[0] = 0.0
        np.cumsum(self.s, out=self.c1[1:])
        self.c2 = np.empty(n + 1)
        self.c2[0] = 0.0
        np.square(self.s, out=self.c2[1:])
        np.cumsum(self.c2[1:], out=self.c2[1:])

    def split(self, t: float) -> tuple[int, int]:
        """The pruned run [i, j) of ``|x| <= t`` (empty for t < 0)."""
        if t < 0:
            return 0, 0
        return int(np.searchsorted(self.s, -t, "left")), int(np.searchsorted(self.s, t, "right"))


def _lloyd(z: _Sorted, i: int, j: int, k: int, steps: int = _LLOYD_STEPS) -> tuple[float, np.ndarray, np.ndarray]:
    """k-means of the kept values (sorted indices outside [i, j)): (squared error, counts, centroids).

    Positions are counted in the *virtual* array of kept values (the sorted array with the
    pruned run cut out); its prefix sums are the full array's minus the run's.
    """
    gap, m = j - i, z.n - (j - i)
    if m == 0:
        return 0.0, np.zeros(0, np.int64), np.zeros(0)
    run1, run2 = z.c1[j] - z.c1[i], z.c2[j] - z.c2[i]

    def vsum(c, run, v):
        return np.where(v <= i, c[np.minimum(v, z.n)], c[np.minimum(v + gap, z.n)] - run)

    e = np.linspace(0, m, min(k, m) + 1).round().astype(np.int64)
    c = (vsum(z.c1, run1, e[1:]) - vsum(z.c1, run1, e[:-1])) / np.maximum(e[1:] - e[:-1], 1)
    for _ in range(steps):
        r = np.searchsorted(z.s, (c[1:] + c[:-1]) / 2, side="right")
        v = np.where(r <= i, r, np.where(r >= j, r - gap, i))
        e = np.concatenate(([0], v, [m]))
        cnt = e[1:] - e[:-1]
        s1 = vsum(z.c1, run1, e[1:]) - vsum(z.c1, run1, e[:-1])
        new = np.where(cnt > 0, s1 / np.maximum(cnt, 1), c)
        if not (new != c).any():  # converged (array_equal's checks cost more than this)
            break
        c = new
    r = np.searchsorted(z.s, (c[1:] + c[:-1]) / 2, side="right")
    v = np.where(r <= i, r, np.where(r >= j, r - gap, i))
    e = np.concatenate(([0], v, [m]))
    cnt = e[1:] - e[:-1]
    s1 = vsum(z.c1, run1, e[1:]) - vsum(z.c1, run1, e[:-1])
    s2 = vsum(z.c2, run2, e[1:]) - vsum(z.c2, run2, e[:-1])
    sse = float(np.sum(np.where(cnt > 0, s2 - s1 * s1 / np.maximum(cnt, 1), 0.0)))
    return max(sse, 0.0), cnt, c[cnt > 0]


def _h2(p: float) -> float:
    return 0.0 if p <= 0 or p >= 1 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def estimate(n: int, counts: np.ndarray, mask_cost: float = 1.0) -> float:
    """Estimated bytes of a quantized tensor: its mask (entropy of kept/pruned) and its indices.

    Args:
        n: elements of the tensor.
        counts: elements per centroid (what is kept).
        mask_cost: 0 when the tensor carries no mask of its own.

    Returns:
        Bytes, as the order-0 entropy (the Huffman frames come within a few % of it).
    """
    m = int(counts.sum())
    p = counts[counts > 0] / max(m, 1)
    return (mask_cost * n * _h2(m / max(n, 1)) + m * float(-(p * np.log2(p)).sum())) / 8


def choose(x: np.ndarray, norm: float, budget: float, prune: bool = True, bits=BITS) -> Choice | None:
    """Return the cheapest (threshold, bits) whose estimated relative RMS error is within budget.

    Args:
        x: the residual (float32 or float64, any shape).
        norm: ‖W‖, the norm the error is relative to.
        budget: the relative RMS error allowed.
        prune: False for tensors that are only quantized (nothing but exact zeros pruned).
        bits: candidate quantization bits.

    Returns:
        A :class:`Choice`, or None when no candidate meets the budget (store it exactly).
    """
    z = _Sorted(x)
    allowed = (budget * norm) ** 2
    if z.n == 0 or z.c2[-1] <= allowed and prune:
        return Choice(
            float(np.max(np.abs(z.s))) if z.n else 0.0, min(bits), 0.0, math.sqrt(z.c2[-1]) / norm if norm else 0.0
        )
    top = float(max(-z.s[0], z.s[-1]))
    best = None
    for b in bits:
        k = (1 << b) - 1
        sse, cnt, _ = _lloyd(z, *z.split(0.0), k)
        if sse > allowed:
            continue
        lo, lo_cnt, lo_sse = 0.0, cnt, sse  # the largest threshold known to fit
        if prune:
            a, c = math.log(top) - _DECADES * math.log(10), math.log(top)
            for _ in range(SEARCH_STEPS):
                mid = math.exp((a + c) / 2)
                i, j = z.split(mid)
                sse, cnt, _ = _lloyd(z, i, j, k)
                sse += z.c2[j] - z.c2[i]
                if sse <= allowed:
                    a, lo, lo_cnt, lo_sse = math.log(mid), mid, cnt, sse
                else:
                    c = math.log(mid)
        cost = estimate(z.n, lo_cnt)
        if best is not None and cost >= best.est_bytes:
            break  # the cost in bits is unimodal: more bits only cost more from here
        best = Choice(lo, b, cost, math.sqrt(lo_sse) / norm if norm else 0.0)
    if best is not None:
        # Lloyd run to convergence for the choice: the encoder quantizes on these
        # centroids and never sorts the kept values again.
        best.centroids = np.unique(
            _lloyd(z, *z.split(best.threshold), (1 << best.bits) - 1, steps=300)[2].astype(np.float32)
        )
    return best
