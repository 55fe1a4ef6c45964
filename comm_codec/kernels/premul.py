"""A pre-scaled sum of two bf16 halves: DDP's built-in all-reduce arithmetic, fused in one pass.

Without a communication hook DDP multiplies each gradient by ``1 / world_size`` while it
copies it into its bucket (``at::mul_out``, so the scaling costs no pass of its own), and
gloo then sums the scaled buckets. A hook receives the bucket unscaled and must scale it
itself: a whole extra pass over the gradients. For two ranks the hook can do the sum
instead of gloo and fold the scaling into it: each rank receives its peer's half of the
bucket, and :func:`premul_sum_bf16` computes, element by element, what DDP and gloo would
have computed::

    own[i] = bf16(float(bf16(float(own[i]) * scale)) + float(bf16(float(peer[i]) * scale)))

torch's bf16 multiply by a scalar computes in float32 and rounds to nearest even;
gloo's bf16 sum (``c10::BFloat16`` arithmetic) adds in float32 and rounds the same way,
every NaN becoming 0x7FC0. A sum of two terms does not depend on their order, so the
result is the bits of DDP's built-in all-reduce on every input, NaN, infinities,
signed zeros and subnormals included.
"""

from __future__ import annotations

import numpy as np

from .intrinsics import as_f32, f32_bits
from .jit import entry, inline

__all__ = ["premul_sum_bf16"]

_ABS = np.uint32(0x7FFFFFFF)
_INF = np.uint32(0x7F800000)
_NAN_BF16 = np.uint16(0x7FC0)  # c10::BFloat16's NaN: what gloo's sum writes for every NaN


@inline
def _round_bf16(bits):
    """bf16 bits of the float32 bits: round to nearest even, as c10::BFloat16 does (any NaN: 0x7FC0)."""
    if (bits & _ABS) > _INF:
        return _NAN_BF16
    return np.uint16(((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)) & 0xFFFF)


@inline
def _scaled(h, scale):
    """float32 value of bf16(float(h) * scale), h given as bf16 bits."""
    r = _round_bf16(f32_bits(as_f32(np.uint32(h) << np.uint32(16)) * scale))
    return as_f32(np.uint32(r) << np.uint32(16))


@entry
def premul_sum_bf16(own, peer, scale):
    """own[i] = bf16(bf16(own[i] * scale) + bf16(peer[i] * scale)), in place, for i < own.size.

    Args:
        own: uint16[n], bf16 bits; overwritten with the sums.
        peer: uint16[>= n], bf16 bits.
        scale: float32, the factor (DDP's ``1 / world_size``).

    Returns:
        0, or 1 (nothing written) when peer is shorter than own.
    """
    n = own.size
    if peer.size < n:
        return 1
    for i in range(n):
        total = _scaled(own[i], scale) + _scaled(peer[i], scale)
        own[i] = _round_bf16(f32_bits(total))
    return 0
