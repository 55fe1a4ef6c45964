"""Assembly of stream bytes into elements: the streaming-store path against a plain join."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

import comm_codec as cc
from comm_codec.kernels.assemble import STREAM_MIN_BYTES, assemble

from helpers import bits_equal, random_bits

pytestmark = pytest.mark.unit


@numba.njit
def _run(v0, v1, v2, v3, present, add, dst, streaming):
    assemble(v0, v1, v2, v3, present, add, dst, streaming)


def _joined(rows, present, add, width, rotate):
    """The plain join (frame_format.md's streams): stream 0 plus add, bytes most
    significant first, the sign rotated back from bit 0."""
    x = (rows[0][:present].astype(np.int64) + add) & 255
    for s in range(1, width):
        x = (x << 8) | rows[s][:present]
    if rotate:
        top = 8 * width
        x = (x >> 1) | ((x & 1) << (top - 1))
    return x


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16, np.uint32])
@pytest.mark.parametrize("present", [0, 1, 15, 16, 17, 63, 64, 65, 1000, 16384])
@pytest.mark.parametrize("offset", [0, 4])  # elements into a 64-byte aligned buffer: aligned, or not
def test_streaming_and_plain_stores_give_the_join(dtype, present, offset):
    width = np.dtype(dtype).itemsize
    rng = np.random.default_rng(present * 7 + width)
    rows = [rng.integers(0, 256, present + 8, dtype=np.uint8) for _ in range(4)]
    v = [rows[min(s, width - 1)] for s in range(4)]
    want = _joined(rows, present, 37, width, np.dtype(dtype).kind == "u").astype(np.uint64)
    for streaming in (False, True):
        raw = np.full(present * width + 128 + 64, 0xEE, dtype=np.uint8)
        start = -raw.ctypes.data % 64 + offset * width
        dst = raw[start : start + present * width].view(dtype)
        _run(v[0], v[1], v[2], v[3], present, 37, dst, streaming)
        mask = (1 << (8 * width)) - 1
        assert np.array_equal(dst.astype(np.uint64) & mask, want & mask), (streaming, offset)
        assert (raw[:start] == 0xEE).all() and (raw[start + present * width :] == 0xEE).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn], ids=str)
def test_outputs_past_the_streaming_size_decode_bit_exactly(dtype):
    # Past STREAM_MIN_BYTES of output, aligned outputs are streamed: the codec's own (a
    # pooled block), a given one at a line, one that is not (plain stores), each with a
    # tail shorter than a line and every special value.
    g = torch.Generator().manual_seed(3)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = STREAM_MIN_BYTES // itemsize + 1000 + 13
    x = (torch.randn(n, generator=g) * 0.1).to(dtype)
    x[5000 : 5000 + 4096] = random_bits(4096, dtype, g)
    x[70000:90000] = 0  # a masked chunk and an all-zero one (not streamed)
    codec = cc.Codec(threads=1)
    frame = codec.encode(x)
    bits_equal(codec.decode(frame), x)
    backing = torch.empty(n + 64, dtype=dtype)
    lead = (-backing.data_ptr() % 64) // itemsize
    for skip in (lead, lead + 1):
        out = backing[skip : skip + n]
        assert (out.data_ptr() % 64 == 0) == (skip == lead)
        bits_equal(codec.decode(frame, out=out), x)
    bits_equal(cc.Codec(threads=2).decode(frame), x)
