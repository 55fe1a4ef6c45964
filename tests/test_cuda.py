"""GPU codec (numba.cuda kernels): the same frames as the CPU path, bit for bit, and safe on bad input.

Where these tests run:

* On a machine with a CUDA GPU, in-process, on CUDA tensors.
* Everywhere else, in numba's CUDA simulator. ``NUMBA_ENABLE_CUDASIM`` must be set before
  numba is first imported, and the rest of the suite has imported numba long before this
  module, so :func:`test_cuda_kernels_in_simulator` runs this file again in a child
  ``python -m pytest`` with the variable set; in the parent only that test and the
  bench_gpu check (which needs neither) remain. Nothing the simulator can run is skipped:
  only the device-dispatch test, which needs real CUDA tensors, is left to a GPU run.

The simulator interprets every GPU thread in Python, so inputs are small: a few chunks of
``CHUNK`` elements.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comm_codec as cc
from comm_codec.core import frame as _frame
from comm_codec.core.streams import spec_for

from helpers import (
    bits_equal,
    fix_header_crc,
    int_view,
    low_byte_books,
    low_byte_segments,
    low_byte_tensor,
    random_bits,
)
from test_codec import DISTS, make_tensor, special_bits, tensor_of_bits

pytestmark = pytest.mark.unit

SIM = bool(numba.config.ENABLE_CUDASIM)


def _real_gpu() -> bool:
    if SIM or not torch.cuda.is_available():
        return False
    from numba import cuda

    return cuda.is_available()  # torch sees a GPU; numba's CUDA target must too


GPU = _real_gpu()
RUN_HERE = SIM or GPU  # where the kernel tests run in this process
DEV = torch.device("cuda") if GPU else torch.device("cpu")
CHUNK = 192
ROOT = Path(__file__).resolve().parent.parent
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8]

_CODECS: dict = {}


def make_codec(chunk_elems: int = CHUNK, checksum: bool = True, split: bool = True) -> cc.Codec:
    key = (chunk_elems, checksum, split)
    if key not in _CODECS:
        _CODECS[key] = cc.Codec(
            cc.CodebookSet.default(), chunk_elems=chunk_elems, checksum=checksum, split_exponent=split
        )
    return _CODECS[key]


def gpu_encode(codec: cc.Codec, x: torch.Tensor, kind: str = "gradient") -> torch.Tensor:
    return codec.encode_cuda(x.to(DEV), kind).cpu()


def gpu_decode(codec: cc.Codec, frame, out=None) -> torch.Tensor:
    frame = torch.as_tensor(np.frombuffer(bytes(frame), dtype=np.uint8).copy()) if isinstance(frame, bytes) else frame
    return codec.decode_cuda(frame.to(DEV), out=out).cpu()


def mixed_tensor(dtype, seed: int) -> torch.Tensor:
    """Chunks of every kind: coded (with escapes), all-zero, masked and coded, raw, a short tail.

    Chunk 0: a few powers of two and every special value (NaN payloads, ±Inf, -0.0, subnormals,
    ±max): coded (escapes included) where the shipped book allows. Chunk 1: +0.0 only. Chunk 2: 30 % zeros (masked) at another scale.
    Chunk 3: random bits (raw streams). Then a 37-element tail.
    """
    g = torch.Generator().manual_seed(seed)
    n = 4 * CHUNK + 37
    if dtype.is_floating_point:
        scale = 1.0 if dtype.itemsize == 1 else 1e-2
        x = (torch.randn(n, generator=g) * scale).to(dtype)
        x[2 * CHUNK : 3 * CHUNK] = (torch.randn(CHUNK, generator=g) * 1e3 * scale).to(dtype)
        # Chunk 0: ±scale/2, ±scale, ±2 scale: few symbols, so that stream 0 codes.
        e = torch.randint(-1, 2, (CHUNK,), generator=g).float()
        x[:CHUNK] = (torch.exp2(e) * scale * (torch.randint(0, 2, (CHUNK,), generator=g) * 2 - 1)).to(dtype)
    else:
        v = (torch.randn(n, generator=g) * 3).round().clamp(-128, 127).to(torch.int8)
        x = v.view(torch.uint8).clone() if dtype == torch.uint8 else v
    iv = int_view(x)
    iv[CHUNK : 2 * CHUNK] = 0
    iv[2 * CHUNK : 3 * CHUNK][torch.rand(CHUNK, generator=g) < 0.3] = 0
    x[3 * CHUNK : 4 * CHUNK] = random_bits(CHUNK, dtype, g)
    specials = int_view(tensor_of_bits(special_bits(dtype), dtype))
    iv[40 : 40 + specials.numel()] = specials
    iv[4 * CHUNK + 3] = specials[0]
    return x


def assert_same_frames(codec, x, kind="gradient") -> torch.Tensor:
    """Encode on both devices, compare the bytes, decode each frame on the other device."""
    f_cpu = codec.encode(x, kind)
    f_gpu = gpu_encode(codec, x, kind)
    assert f_gpu.dtype == torch.uint8 and f_gpu.dim() == 1
    if not torch.equal(f_cpu, f_gpu):
        diff = (f_cpu != f_gpu).nonzero().reshape(-1) if f_cpu.numel() == f_gpu.numel() else None
        raise AssertionError(
            f"GPU frame ({f_gpu.numel()} bytes) differs from the CPU's ({f_cpu.numel()} bytes)"
            + (f"; first differing bytes at {diff[:8].tolist()}" if diff is not None else "")
        )
    bits_equal(codec.decode(f_gpu), x.reshape(-1))
    bits_equal(gpu_decode(codec, f_cpu), x.reshape(-1))
    return f_cpu


# -- same frames as the CPU -------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_frames_equal_cpu_bit_for_bit(dtype):
    x = mixed_tensor(dtype, seed=DTYPES.index(dtype))
    f = assert_same_frames(make_codec(), x)
    params = _frame.get_frame_parameters(f)
    assert params.split == spec_for(dtype).split_bits  # fp16 and fp8 split their exponents
    cflags = params.table["cflags"].astype(int)
    assert cflags[1] == _frame.CHUNK_ZERO
    assert cflags[2] & _frame.CHUNK_MASK
    assert cflags[3] & _frame.CHUNK_RAW0  # random bits: stored raw
    if dtype in (torch.bfloat16, torch.float32):
        assert not cflags[0] & _frame.CHUNK_RAW0 and not cflags[2] & _frame.CHUNK_RAW0  # coded; masked + coded


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_frames_without_split_exponents_equal_cpu_bit_for_bit(dtype):
    x = mixed_tensor(dtype, seed=DTYPES.index(dtype))
    f = assert_same_frames(make_codec(split=False), x)
    assert _frame.get_frame_parameters(f).split == 0
    # Each kind of frame decodes on the GPU with a codec of the other setting too.
    bits_equal(gpu_decode(make_codec(split=True), f), x)
    bits_equal(gpu_decode(make_codec(split=False), make_codec(split=True).encode(x)), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_coded_streams_of_every_dtype(dtype):
    # Low-entropy data under the first kind whose book codes it (the shipped uint8
    # gradient book, for one, spends 9+ bits on every small value). uint8 books are of
    # quantized values with zero point 128: small values sit just above it.
    small = [1, 2, 1, 1, 3, 1, 2, 1]
    if dtype == torch.uint8:
        small = [128 + v for v in small]
    x = torch.tensor(small * (CHUNK // 8), dtype=torch.float32).to(dtype)
    x[17] = 0
    for kind in cc.KINDS:
        f = make_codec().encode(x, kind)
        cflags = _frame.get_frame_parameters(f).table["cflags"]
        if not cflags[0] & _frame.CHUNK_RAW0:
            break
    else:
        pytest.fail(f"no shipped book codes {dtype} stream 0 of this input")
    assert_same_frames(make_codec(), x, kind)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8], ids=str)
def test_frames_equal_cpu_without_checksums(dtype):
    x = mixed_tensor(dtype, seed=10 + DTYPES.index(dtype))
    f = assert_same_frames(make_codec(checksum=False), x)
    assert not _frame.get_frame_parameters(f).checksums


@pytest.mark.parametrize("n", [0, 1, 3, 7, 9, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8], ids=str)
def test_tiny_tensors_and_short_chunks(dtype, n):
    # Fewer elements than lanes, empty tensors, and chunks smaller than a thread block.
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e-3).to(dtype)
    assert_same_frames(make_codec(chunk_elems=64), x)


@settings(max_examples=12)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 300),
    dist=st.sampled_from(DISTS),
    log_scale=st.floats(-8, 4),
    seed=st.integers(0, 2**31),
    chunk_elems=st.sampled_from([16, 64, 256]),
    checksum=st.booleans(),
)
def test_random_inputs_give_the_cpu_frames(dtype, n, dist, log_scale, seed, chunk_elems, checksum):
    x = make_tensor(dtype, n, dist, seed, scale=10.0**log_scale)
    assert_same_frames(make_codec(chunk_elems, checksum), x)


@pytest.mark.parametrize("kind", ["weight", "optimizer_state"])
def test_other_kinds_and_a_2d_non_contiguous_tensor(kind):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(24, 20, generator=g) * 0.05).to(torch.bfloat16).t()  # 480 elements, not contiguous
    assert_same_frames(make_codec(), x, kind)


@pytest.mark.parametrize("n", [0, 7, 511, 512, 513, 1500, 3 * 512])
def test_device_header_crc_equals_zlib(n):
    # The header CRC is joined from 512-byte segment CRCs on the device.
    from comm_codec.core import gpu
    from comm_codec.core.tables import encode_tables

    data = np.random.default_rng(n).integers(0, 256, n + 4, dtype=np.uint8)
    buf = torch.from_numpy(data).to(DEV)
    launch = gpu.Launch(DEV)
    tables = encode_tables(make_codec().codebooks, "gradient", spec_for("bf16"))
    gpu.header_crc(launch, buf, n, gpu.DeviceTables(launch, tables))
    assert int.from_bytes(buf[n:].cpu().numpy().tobytes(), "little") == zlib.crc32(data[:n].tobytes())


def test_long_chunk_table_crc_and_header_read():
    # 40 fp32 chunks (most all-zero, which is quick): a 1 KiB header, so the frame's CRC
    # takes the segment path end to end.
    g = torch.Generator().manual_seed(9)
    x = torch.zeros(320, dtype=torch.float32)
    x[:48] = torch.randn(48, generator=g) * 1e-2
    x[200:216] = random_bits(16, torch.float32, g)
    f = assert_same_frames(make_codec(chunk_elems=8), x)
    assert _frame.get_frame_parameters(f).header_bytes > 1000
    # A header over 4 KiB is read from the device in two copies.
    from comm_codec.core import gpu as _gpu

    big = make_codec(chunk_elems=8).encode(torch.zeros(4000, dtype=torch.bfloat16))
    hsize = _frame.get_frame_parameters(big).header_bytes
    assert hsize > 4096
    host = _gpu.read_header(big.to(DEV))
    assert host.size == big.numel() and host[:hsize].tobytes() == big[:hsize].numpy().tobytes()
    for form in (big.to(DEV), big):
        params = cc.Codec.frame_parameters(form)
        assert (params.numel, params.dtype, params.header_bytes) == (4000, torch.bfloat16, hsize)


def test_zero_heavy_runs_and_negative_zero():
    x = torch.zeros(3 * CHUNK, dtype=torch.float32)
    x[5::9] = 1.5
    x[CHUNK : 2 * CHUNK : 7] = -0.0  # -0.0 is not a zero for the mask
    f = assert_same_frames(make_codec(), x)
    cflags = _frame.get_frame_parameters(f).table["cflags"]
    assert not (cflags & _frame.CHUNK_ZERO).any()


def test_decode_into_out_and_from_a_misaligned_slice():
    codec = make_codec()
    x = mixed_tensor(torch.bfloat16, seed=3)
    f = codec.encode(x)
    out = torch.full((x.numel(),), float("nan"), dtype=torch.bfloat16, device=DEV)
    res = codec.decode_cuda(f.to(DEV), out=out)
    assert res is out
    bits_equal(out.cpu(), x)
    big = torch.zeros(f.numel() + 3, dtype=torch.uint8)
    big[3:] = f
    bits_equal(gpu_decode(codec, big[3:]), x)  # not 8-byte aligned: copied first
    with pytest.raises(ValueError, match="out has 10 elements"):
        codec.decode_cuda(f.to(DEV), out=torch.empty(10, dtype=torch.bfloat16, device=DEV))
    with pytest.raises(TypeError, match="out has dtype torch.float16"):
        codec.decode_cuda(f.to(DEV), out=torch.empty(x.numel(), dtype=torch.float16, device=DEV))


def test_max_output_bytes_and_unknown_books():
    codec = make_codec()
    x = torch.zeros(4 * CHUNK, dtype=torch.bfloat16)
    f = codec.encode(x)
    with pytest.raises(cc.FrameError, match="more than max_output_bytes=100"):
        codec.decode_cuda(f.to(DEV), max_output_bytes=100)
    y = (torch.randn(300) * 1e-2).to(torch.bfloat16)
    f = codec.encode(y)
    other = cc.Codec(cc.CodebookSet({}), chunk_elems=CHUNK)  # holds no book
    with pytest.raises(cc.FrameError, match="which this codec's codebook set does not hold"):
        other.decode_cuda(f.to(DEV))


# -- bad input ---------------------------------------------------------------------------------------
def _outcome(decode, data: bytes):
    try:
        return decode(data)
    except cc.FrameError as exc:
        return exc


@pytest.mark.parametrize("checksum", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_mutated_frames_fail_or_decode_as_on_the_cpu(dtype, checksum):
    # Mutated payloads and chunk tables (header CRC repaired, so the kernels see them):
    # the GPU decoder raises FrameError exactly when the CPU's does, and otherwise
    # returns the same bits. The simulator turns any out-of-bounds access into an error.
    codec = make_codec(chunk_elems=96, checksum=checksum)
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(300, generator=g) * 1e-2).to(dtype)
    int_view(x)[100:190][torch.rand(90, generator=g) < 0.8] = 0  # a masked chunk
    data = codec.encode(x).numpy().tobytes()
    params = _frame.get_frame_parameters(data)
    rng = np.random.default_rng(11 + checksum)

    def position(trial):
        if trial % 3 == 0:  # a chunk-table field
            return params.header_bytes - 8 - int(rng.integers(1, params.nchunks * params.table.dtype.itemsize + 1))
        return int(rng.integers(params.header_bytes, len(data)))  # the payload

    _flips_fail_alike(codec, data, 14, position, rng)


def _flips_fail_alike(codec, data: bytes, trials: int, position, rng) -> None:
    """Flip one bit per trial at position(trial), header CRC repaired: the GPU decoder must
    raise FrameError exactly when the CPU's does, and otherwise return the same bits."""
    failures = 0
    for trial in range(trials):
        buf = bytearray(data)
        buf[position(trial)] ^= 1 << int(rng.integers(0, 8))
        bad = fix_header_crc(bytes(buf))
        cpu = _outcome(lambda d: codec.decode(d), bad)
        gpu = _outcome(lambda d: gpu_decode(codec, d), bad)
        if isinstance(cpu, cc.FrameError):
            failures += 1
            assert isinstance(gpu, cc.FrameError), f"trial {trial}: CPU raised {cpu}, GPU decoded"
        else:
            assert not isinstance(gpu, cc.FrameError), f"trial {trial}: GPU raised {gpu}, CPU decoded"
            bits_equal(gpu, cpu)
    assert failures > 0


@pytest.mark.parametrize("cut", [0, 5, 24, 60, -8, -1])
def test_truncated_frames_raise(cut):
    codec = make_codec()
    data = codec.encode(mixed_tensor(torch.bfloat16, seed=4)).numpy().tobytes()
    short = data[:cut] if cut >= 0 else data[: len(data) + cut]
    if len(short) == 0:
        with pytest.raises((cc.FrameError, ValueError)):
            gpu_decode(codec, torch.zeros(0, dtype=torch.uint8))
        return
    with pytest.raises(cc.FrameError):
        gpu_decode(codec, short)


def test_kernel_bounds_hold_without_the_host_checks():
    # The kernel is called with a chunk table the host never checked: offsets past the
    # frame, and sizes that disagree with the lane headers. It reports, never reads out
    # of bounds (the simulator would raise).
    from comm_codec.core import gpu as _cuda
    from comm_codec.core.tables import decode_tables
    from comm_codec.kernels.layout import STATUS_MESSAGES, STATUS_SIZE

    codec = make_codec(checksum=False)
    x = mixed_tensor(torch.bfloat16, seed=6)
    frame = codec.encode(x).to(DEV)
    params = _frame.get_frame_parameters(frame.cpu())
    dev_tables = _cuda.DeviceTables(_cuda.Launch(frame.device), decode_tables(codec.codebooks, params.book_ids))
    out = torch.empty(params.numel, dtype=torch.bfloat16, device=DEV)
    far = dataclasses.replace(params, offsets=params.offsets + frame.numel())
    status = _cuda.decode_frame(frame, far, dev_tables, out)
    assert (status == STATUS_SIZE).all() and STATUS_MESSAGES[STATUS_SIZE].startswith("stream size")
    table = params.table.copy()
    table["sizes"][:, 0] = np.where(table["cflags"] & _frame.CHUNK_ZERO, 0, 16)  # lane header only
    status = _cuda.decode_frame(frame, dataclasses.replace(params, table=table), dev_tables, out)
    coded = (params.table["cflags"] & (_frame.CHUNK_ZERO | _frame.CHUNK_RAW0)) == 0
    assert (status[coded] != 0).all()


# -- groups of books (frame version 2) --------------------------------------------------------------
GCHUNK = 128


def two_part_tensor(dtype, seed: int, n: int = 5 * GCHUNK + 37) -> tuple[torch.Tensor, torch.Tensor]:
    """Two tensors of n elements: "narrow" (two binades, eight mantissas) and "wide" (13 binades,
    sixteen mantissas of other bits: 1 + j/4 + k/256).

    For int8/uint8: small integers and large ones. Chunks cut from one or the other differ
    in distribution in every stream that is not all zeros, so their fitted books differ.
    """
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        narrow = torch.randint(-2, 3, (n,), generator=g).to(torch.int8)
        wide = torch.randint(-60, 61, (n,), generator=g).to(torch.int8)
        if dtype == torch.uint8:
            return narrow.view(torch.uint8).clone(), wide.view(torch.uint8).clone()
        return narrow, wide
    scale = 1.0 if dtype.itemsize == 1 else 2.0**-4
    sign = torch.randint(0, 2, (n,), generator=g) * 2.0 - 1
    narrow = (
        sign
        * (1 + torch.randint(0, 8, (n,), generator=g) / 8)
        * torch.exp2(torch.randint(-1, 1, (n,), generator=g).float())
    )
    mant = 1 + torch.randint(0, 4, (n,), generator=g) / 4 + torch.randint(0, 4, (n,), generator=g) / 256
    wide = sign * mant * torch.exp2(torch.randint(-6, 7, (n,), generator=g).float())
    return (narrow * scale).to(dtype), (wide * scale).to(dtype)


def grouped_tensor(dtype, seed: int) -> torch.Tensor:
    """Chunks of GCHUNK: narrow; wide; narrow with every special value; wide, 40 % zeros (masked);
    all +0.0; then a narrow 37-element tail."""
    narrow, wide = two_part_tensor(dtype, seed)
    x = narrow.clone()
    x[GCHUNK : 2 * GCHUNK] = wide[GCHUNK : 2 * GCHUNK]
    x[3 * GCHUNK : 4 * GCHUNK] = wide[3 * GCHUNK : 4 * GCHUNK]
    iv = int_view(x)
    specials = int_view(tensor_of_bits(special_bits(dtype), dtype))
    iv[2 * GCHUNK + 5 : 2 * GCHUNK + 5 + specials.numel()] = specials
    iv[3 * GCHUNK : 4 * GCHUNK][torch.rand(GCHUNK, generator=torch.Generator().manual_seed(seed)) < 0.4] = 0
    iv[4 * GCHUNK : 5 * GCHUNK] = 0
    return x


def _group_books(dtype) -> dict:
    """Per stream of dtype, a group fitted to the two parts of two_part_tensor.

    Stream 0: [flat, narrow, wide] (the mask is priced with the flat book; chunks pick 1
    and 2); later streams: [narrow, wide, flat]. Books that come out equal appear once.
    """
    from comm_codec.books.profiler import stream_counts

    narrow, wide = two_part_tensor(dtype, seed=99)
    cn, _ = stream_counts(narrow, GCHUNK)
    cw, _ = stream_counts(wide, GCHUNK)
    name = spec_for(dtype).name
    groups = {}
    for s in range(cn.shape[0]):
        fit_n = cc.Codebook.from_counts(cn[s] + 1e-9, raw_threshold=None)
        fit_w = cc.Codebook.from_counts(cw[s] + 1e-9, raw_threshold=None)
        both = cn[s] + cw[s]
        flat = cc.Codebook.from_counts(both + both.sum() / 64, raw_threshold=None)
        order = [flat, fit_n, fit_w] if s == 0 else [fit_n, fit_w, flat]
        unique = [b for i, b in enumerate(order) if b not in order[:i]]
        groups[("gradient", name, s)] = cc.CodebookGroup(unique)
    return groups


_GROUP_CODECS: dict = {}


def group_codec(chunk_elems: int = GCHUNK, checksum: bool = True, split: bool = True) -> cc.Codec:
    """A codec whose gradient books are groups for every dtype of DTYPES (see _group_books)."""
    key = (chunk_elems, checksum, split)
    if key not in _GROUP_CODECS:
        books = {}
        for dtype in DTYPES:
            books.update(_group_books(dtype))
        _GROUP_CODECS[key] = cc.Codec(
            cc.CodebookSet(books), chunk_elems=chunk_elems, checksum=checksum, split_exponent=split
        )
    return _GROUP_CODECS[key]


def book_indices(frame, s: int) -> list[int]:
    """The book index of stream s of every chunk of a frame (0 where raw or all-zero)."""
    return [(int(b) >> (4 * s)) & 15 for b in _frame.get_frame_parameters(frame).table["books"]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_frames_equal_cpu_bit_for_bit(dtype):
    # Different chunks pick different books of stream 0's group; the GPU frame equals the
    # CPU's byte for byte, and each decodes the other's frame bit-exactly (NaN payloads,
    # ±Inf, -0.0 and subnormals included). e4m3's chunks of 128 split would all be raw
    # (lane header, lanes and a 48-byte plane never beat 128 bytes), so e4m3 is grouped
    # here without the split; fp16 and e5m2 group with it.
    codec = group_codec(split=dtype != torch.float8_e4m3fn)
    x = grouped_tensor(dtype, seed=DTYPES.index(dtype))
    f = assert_same_frames(codec, x)
    params = _frame.get_frame_parameters(f)
    assert params.version == (3 if params.split else 2)
    cflags = params.table["cflags"].astype(int)
    assert cflags[3] & _frame.CHUNK_MASK and cflags[4] == _frame.CHUNK_ZERO
    assert len(set(book_indices(f, 0))) > 1, book_indices(f, 0)


def test_grouped_split_e4m3_at_chunks_that_code():
    # e4m3 with a group and split exponents, at chunks long enough for the split segment
    # (lane header, lanes, plane) to beat raw: narrow; a quarter wide (all wide, e4m3 is
    # as good as random and stored raw); narrow with every special value. Each chunk picks
    # a book of the group other than its first.
    chunk = 1024
    narrow, wide = two_part_tensor(torch.float8_e4m3fn, seed=41, n=3 * chunk)
    x = narrow.clone()
    x[chunk : chunk + chunk // 4] = wide[chunk : chunk + chunk // 4]
    specials = int_view(tensor_of_bits(special_bits(torch.float8_e4m3fn), torch.float8_e4m3fn))
    int_view(x)[2 * chunk + 3 : 2 * chunk + 3 + specials.numel()] = specials
    f = assert_same_frames(group_codec(chunk, split=True), x)
    params = _frame.get_frame_parameters(f)
    assert params.version == 3 and params.split == spec_for(torch.float8_e4m3fn).split_bits
    assert not (params.table["cflags"] & _frame.CHUNK_RAW0).any(), "stream 0 stored raw: the split never coded"
    assert all(book_indices(f, 0)), book_indices(f, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_grouped_later_streams_pick_books_too(dtype):
    # A nonzero book index for a stream s > 0 (bits 4s..4s+3 of the books field).
    codec = group_codec()
    f = assert_same_frames(codec, grouped_tensor(dtype, seed=20 + DTYPES.index(dtype)))
    later = {(s, k) for s in range(1, dtype.itemsize) for k in book_indices(f, s) if k}
    assert later, "no stream after the first chose a book other than its first"


def test_a_later_stream_saving_under_a_32nd_is_raw_as_on_the_cpu():
    # A chunk's stream 3 whose book codes it 1-2 % under raw is stored raw by both
    # planners (kernels.layout.MIN_SAVING_SHIFT); one that saves more is coded.
    chunk = 1024
    books = low_byte_books(chunk)
    codec = cc.Codec(books, chunk_elems=chunk)
    x = low_byte_tensor(chunk, [0, 1, 0], seed=9, skew=0.5)
    coded = low_byte_segments(x, books.group("weight", "fp32", 3).books[0], chunk)
    limit = chunk - (chunk >> 5)
    assert coded[0] > limit and coded[0] < chunk and coded[1] <= limit, coded
    f = assert_same_frames(codec, x, "weight")
    raw = _frame.get_frame_parameters(f).table["cflags"] & (_frame.CHUNK_RAW0 << 3)
    assert raw[0] and not raw[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=str)
def test_grouped_frames_without_checksums_and_other_chunk_sizes(dtype):
    x = grouped_tensor(dtype, seed=30)
    for chunk_elems, checksum in [(GCHUNK, False), (64, True), (96, False)]:
        assert_same_frames(group_codec(chunk_elems, checksum), x)


@settings(max_examples=10)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(0, 400),
    dist=st.sampled_from(DISTS),
    log_scale=st.floats(-8, 4),
    seed=st.integers(0, 2**31),
    chunk_elems=st.sampled_from([64, 128]),
)
def test_random_inputs_with_groups_give_the_cpu_frames(dtype, n, dist, log_scale, seed, chunk_elems):
    x = make_tensor(dtype, n, dist, seed, scale=10.0**log_scale)
    assert_same_frames(group_codec(chunk_elems), x)


def _uint8_book(lengths: dict, escape_length: int) -> cc.Codebook:
    full = np.zeros(256, dtype=np.int64)
    for sym, ln in lengths.items():
        full[sym] = ln
    return cc.Codebook(full, escape_length=escape_length)


def test_equal_bits_choose_the_lower_index_and_all_16_books_are_reachable():
    # Book A codes 3 in 3 bits, book B in 2; both code 1 and 2 in 2 bits. A chunk of 1s
    # and 2s ties (lower index wins, in either order); a chunk with 3s picks B.
    a = _uint8_book({1: 2, 2: 2, 3: 3, 4: 3}, escape_length=2)
    b = _uint8_book({1: 2, 2: 2, 3: 2}, escape_length=2)
    x = torch.tensor([1, 2, 2, 1] * 16 + [3, 1, 3, 2] * 16, dtype=torch.uint8)
    for group, expected in [([a, b], [0, 1]), ([b, a], [0, 0])]:
        codec = cc.Codec(cc.CodebookSet({("gradient", "uint8", 0): cc.CodebookGroup(group)}), chunk_elems=64)
        f = assert_same_frames(codec, x)
        assert book_indices(f, 0) == expected
    # Sixteen books, book j favouring byte 10 + j: chunks of those bytes pick 0, 7 and 15.
    books = []
    for j in range(16):
        counts = np.ones(256)
        counts[10 + j] = 4000
        books.append(cc.Codebook.from_counts(counts, raw_threshold=None))
    codec = cc.Codec(cc.CodebookSet({("gradient", "uint8", 0): cc.CodebookGroup(books)}), chunk_elems=64)
    x = torch.tensor([10] * 60 + [11] * 4 + [17] * 64 + [25] * 63 + [3], dtype=torch.uint8)
    f = assert_same_frames(codec, x)
    assert book_indices(f, 0) == [0, 7, 15]


def _with_book_index(data: bytes, chunk: int, s: int, k: int) -> bytes:
    """A frame's bytes with stream s of the chunk's books field set to k (header CRC fixed)."""
    params = _frame.get_frame_parameters(data)
    table = params.table.copy()
    books = int(table["books"][chunk])
    table["books"][chunk] = (books & ~(15 << (4 * s))) | (k << (4 * s))
    buf = bytearray(data)
    start = _frame.HEADER_BYTES + 8 * params.spec.nstreams
    buf[start : start + table.nbytes] = table.tobytes()
    return fix_header_crc(bytes(buf))


def _uneven_bf16_codec() -> cc.Codec:
    """bf16 with stream 0's group of three books and stream 1's first book alone."""
    groups = _group_books(torch.bfloat16)
    s1 = groups[("gradient", "bf16", 1)]
    groups[("gradient", "bf16", 1)] = cc.CodebookGroup(s1[0])
    assert len(groups[("gradient", "bf16", 0)]) == 3
    return cc.Codec(cc.CodebookSet(groups), chunk_elems=GCHUNK, checksum=False)


def test_a_book_beyond_its_group_raises_frame_error():
    codec = _uneven_bf16_codec()
    x = grouped_tensor(torch.bfloat16, seed=40)
    data = codec.encode(x).numpy().tobytes()
    cflags = _frame.get_frame_parameters(data).table["cflags"]
    chunk = next(c for c, k in enumerate(book_indices(data, 0)) if k)  # stream 0 coded, book 1 or 2
    for s, k, n in [(0, 3, 3), (0, 15, 3), (1, 2, 1)]:
        c = chunk if s == 0 else next(c for c in range(len(cflags)) if not cflags[c] & (_frame.CHUNK_ZERO | 0x20))
        bad = _with_book_index(data, c, s, k)
        message = f"chunk {c} says stream {s} was coded with book {k} of its group, which holds {n}"
        with pytest.raises(cc.FrameError, match=message):
            gpu_decode(codec, bad)
        with pytest.raises(cc.FrameError, match=message):
            codec.decode(bad)
    # A book of the group, but not the one that coded the chunk: both devices fail alike
    # or decode the same (other) bits.
    wrong = _with_book_index(data, chunk, 0, 3 - book_indices(data, 0)[chunk])
    cpu = _outcome(codec.decode, wrong)
    gpu = _outcome(lambda d: gpu_decode(codec, d), wrong)
    assert isinstance(cpu, cc.FrameError) == isinstance(gpu, cc.FrameError), (cpu, gpu)
    if not isinstance(cpu, cc.FrameError):
        bits_equal(gpu, cpu)


def test_kernel_bounds_book_indices_without_the_host_checks():
    # decode_frame called with book indices the host never checked: past every table
    # (15), and past stream 1's one book but within the tables (2: zero entries). Those
    # chunks report a status, the others decode, and nothing is read out of bounds (the
    # simulator would raise).
    from comm_codec.core import gpu as _cuda
    from comm_codec.core.tables import decode_tables

    codec = _uneven_bf16_codec()
    frame = codec.encode(grouped_tensor(torch.bfloat16, seed=41)).to(DEV)
    params = _frame.get_frame_parameters(frame.cpu())
    tables = decode_tables(codec.codebooks, params.book_ids)
    assert tables.dec.shape[1] == 3 and tables.nbooks.tolist() == [3, 1]
    dev_tables = _cuda.DeviceTables(_cuda.Launch(DEV), tables)
    cflags = params.table["cflags"]
    out = torch.empty(params.numel, dtype=torch.bfloat16, device=DEV)
    for s, k in [(0, 15), (1, 2)]:
        c = next(c for c in range(params.nchunks) if not cflags[c] & (_frame.CHUNK_ZERO | _frame.CHUNK_RAW0 << s))
        table = params.table.copy()
        table["books"][c] = (int(table["books"][c]) & ~(15 << (4 * s))) | (k << (4 * s))
        status = _cuda.decode_frame(frame, dataclasses.replace(params, table=table), dev_tables, out)
        assert status[c] != 0, (s, k)
        assert all(status[i] == 0 for i in range(params.nchunks) if i != c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_mutated_grouped_frames_fail_or_decode_as_on_the_cpu(dtype):
    # Bit flips in the chunk table's books fields and in the payload, header CRC
    # repaired: the GPU raises FrameError exactly when the CPU does, else the same bits.
    codec = group_codec(checksum=False)
    data = codec.encode(grouped_tensor(dtype, seed=42)).numpy().tobytes()
    params = _frame.get_frame_parameters(data)
    table_start = _frame.HEADER_BYTES + 8 * params.spec.nstreams
    rng = np.random.default_rng(43)

    def position(trial):
        if trial % 2 == 0:  # a books field (offset 2 of an entry, u16)
            entry = table_start + int(rng.integers(0, params.nchunks)) * params.table.dtype.itemsize
            return entry + 2 + int(rng.integers(0, 2))
        return int(rng.integers(params.header_bytes, len(data)))

    _flips_fail_alike(codec, data, 10, position, rng)


# -- device dispatch (needs CUDA tensors: a real GPU) ------------------------------------------------
@pytest.mark.skipif(not GPU, reason="needs CUDA tensors; the simulator runs the kernels on CPU tensors")
def test_codec_dispatches_on_the_tensor_device():
    codec = make_codec()
    x = mixed_tensor(torch.bfloat16, seed=8)
    f = codec.encode(x.cuda())
    assert f.is_cuda and torch.equal(f.cpu(), codec.encode(x))
    y = codec.decode(f)
    assert y.is_cuda
    bits_equal(y.cpu(), x)


# -- the parent process --------------------------------------------------------------------------------
_SIM_TIMEOUT_S = 540
_sim_run: dict = {}


def start_simulator_run() -> None:
    """Start the simulator child now, so that it runs beside the rest of the suite.

    tests/conftest.py calls this once the test session's items are known, when
    :func:`test_cuda_kernels_in_simulator` is among them (and moves that test last); the
    child's ~2 minutes of interpreting GPU threads then overlap the other tests' waits
    on their ranks and subprocesses instead of adding to them. Output goes to files: a
    pipe nobody reads until the end would fill and stop the child.
    """
    if _sim_run:
        return
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(Path(__file__)),
        "-q",
        "-p",
        "no:cacheprovider",
        "--durations=5",
        "-W",
        "ignore::pytest.PytestUnraisableExceptionWarning",
    ]
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    _sim_run.update(
        proc=subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True),
        out=out,
        err=err,
        started=time.monotonic(),
    )


def stop_simulator_run() -> None:
    """Kill the child if it still runs (the session ended early: -x, an interrupt)."""
    proc = _sim_run.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_cuda_kernels_in_simulator():
    """Run this file's kernel tests in numba's CUDA simulator, in a child process."""
    start_simulator_run()  # already running unless this test was called some other way
    proc = _sim_run["proc"]
    try:
        proc.wait(timeout=max(1.0, _SIM_TIMEOUT_S - (time.monotonic() - _sim_run["started"])))
    except subprocess.TimeoutExpired:
        stop_simulator_run()
    _sim_run["out"].seek(0)
    _sim_run["err"].seek(0)
    stdout, stderr = _sim_run["out"].read(), _sim_run["err"].read()
    tail = stdout[-6000:] + stderr[-2000:]
    assert proc.returncode == 0, f"simulator run failed (rc {proc.returncode}):\n{tail}"
    assert " passed" in stdout and "skipped" not in stdout, tail


@pytest.mark.slow
def test_bench_gpu_says_clearly_when_there_is_no_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would run")
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch_scripts" / "bench_gpu.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "no CUDA GPU" in proc.stderr


if RUN_HERE:
    # The simulator child (or a GPU run) is where the kernel tests run; don't recurse.
    del test_cuda_kernels_in_simulator
    if SIM:
        del test_bench_gpu_says_clearly_when_there_is_no_gpu  # the parent runs it
        del test_codec_dispatches_on_the_tensor_device  # CUDA tensors only: on a GPU run
else:
    # Kernel tests run in the child started by test_cuda_kernels_in_simulator.
    for _name in [n for n in globals() if n.startswith("test_")]:
        if _name not in ("test_cuda_kernels_in_simulator", "test_bench_gpu_says_clearly_when_there_is_no_gpu"):
            del globals()[_name]
