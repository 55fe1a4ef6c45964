"""Helpers the tests share: bit-pattern comparison, random bit patterns, frame resealing, free ports.

Imported by test modules (``from helpers import bits_equal``) and by conftest.py; kept
out of conftest so that scripts beside the tests (fuzz harnesses) can import them too.
"""

from __future__ import annotations

import socket
import zlib

import numba
import torch

import comm_codec as cc
from comm_codec.core import frame as _frame

# Most threads a Codec may be given on this machine (tests use 1 and this).
MAX_THREADS = min(2, numba.config.NUMBA_NUM_THREADS)

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def int_view(t: torch.Tensor) -> torch.Tensor:
    """View a tensor's elements as same-width integers (bit patterns)."""
    return t.view(_INT_VIEW[t.element_size()])


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Assert that two tensors have the same dtype, shape and bit pattern; return True.

    float8/int8/uint8 are compared as uint8, 16-bit types as int16, 32-bit ones as int32,
    so NaN payloads and -0.0 count and NaN == NaN.
    """
    assert a.dtype == b.dtype, f"dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"shape {tuple(a.shape)} != {tuple(b.shape)}"
    ia, ib = int_view(a.contiguous()), int_view(b.contiguous())
    if not torch.equal(ia, ib):
        diff = (ia != ib).reshape(-1).nonzero().reshape(-1)
        first = int(diff[0])
        raise AssertionError(
            f"{diff.numel()} of {a.numel()} elements differ; first at flat index {first}: "
            f"bits {int(ia.reshape(-1)[first]):#x} != {int(ib.reshape(-1)[first]):#x}"
        )
    return True


def random_bits(n: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Return n elements of dtype with uniformly random bit patterns (NaN, Inf, -0.0 included)."""
    width = torch.empty(0, dtype=dtype).element_size()
    if width == 1:
        ints = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator)
    else:
        lo = -(1 << (8 * width - 1))
        ints = torch.randint(lo, -lo, (n,), dtype=_INT_VIEW[width], generator=generator)
    return ints.view(dtype)


def fix_header_crc(data) -> bytes:
    """Return a frame's bytes with the header CRC recomputed after an edit.

    Uses comm_codec.core.frame's layout: CRC-32 over bytes[0:header_size-8], stored
    little-endian at header_size-8, with nstreams and nchunks read from the header.
    Frames too short to hold their CRC are returned unchanged.
    """
    buf = bytearray(bytes(data))
    if len(buf) < _frame.HEADER_BYTES:
        return bytes(buf)
    nstreams = buf[6]
    nchunks = int.from_bytes(buf[20:24], "little")
    end = _frame.header_size(nstreams, nchunks) - 8
    if end + 4 <= len(buf):
        buf[end : end + 4] = zlib.crc32(bytes(buf[:end])).to_bytes(4, "little")
    return bytes(buf)


def reseal(data) -> bytes:
    """Return a frame's bytes with every chunk checksum and the header CRC recomputed.

    So that edits to a payload reach the stream decoders instead of stopping at the
    checksum. A frame whose header or chunk table does not parse comes back with only
    its CRC fixed (see :func:`fix_header_crc`).
    """
    import naive

    buf = bytearray(fix_header_crc(data))
    try:
        params = _frame.get_frame_parameters(bytes(buf))
    except cc.FrameError:
        return bytes(buf)
    if params.checksums and params.nchunks:
        ns = params.spec.nstreams
        entry = _frame.table_dtype(ns).itemsize
        table_at = _frame.HEADER_BYTES + 8 * ns
        ends = list(params.offsets[1:]) + [params.frame_bytes]
        for c, (start, end) in enumerate(zip(params.offsets, ends)):
            value = naive.payload_hash(bytes(buf[int(start):int(end)]), c)
            at = table_at + c * entry + 4
            buf[at:at + 4] = value.to_bytes(4, "little")
    return fix_header_crc(bytes(buf))


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
