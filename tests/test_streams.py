"""Byte streams: split/join against the plain-Python reference, every dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import comm_codec as cc
from comm_codec.core import streams

import naive
from helpers import bits_equal, random_bits

pytestmark = pytest.mark.unit

SIZES = [0, 1, 2, 7, 1000]
SUPPORTED_MESSAGE = "supported dtypes are bfloat16, float16, float32, float8_e4m3fn, float8_e5m2, int8, uint8"


def _sample(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + n)
    return random_bits(n, dtype, g)


def test_supported_dtypes_are_the_documented_seven():
    assert cc.SUPPORTED_DTYPES == tuple(naive.LAYOUT)


@pytest.mark.parametrize("dtype", cc.SUPPORTED_DTYPES, ids=str)
def test_spec_matches_documented_layout(dtype):
    width, rotate, exp_shift, code = naive.LAYOUT[dtype]
    spec = streams.spec_for(dtype)
    assert (spec.itemsize, spec.nstreams, spec.rotate, spec.code) == (width, width, rotate, code)
    assert spec.exp_shift == (-1 if exp_shift is None else exp_shift)
    assert streams.spec_for(spec.name) is spec
    assert streams.spec_for_code(code) is spec


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", cc.SUPPORTED_DTYPES, ids=str)
def test_split_matches_naive(dtype, n):
    t = _sample(n, dtype)
    got = streams.split(t)
    want = naive.split(t)
    assert len(got) == len(want) == naive.LAYOUT[dtype][0]
    for s, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == np.uint8 and g.shape == (n,), s
        assert g.tolist() == w, f"stream {s}"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", cc.SUPPORTED_DTYPES, ids=str)
def test_join_matches_naive_and_inverts_split(dtype, n):
    t = _sample(n, dtype, seed=1)
    parts = naive.split(t)
    joined = streams.join([np.array(p, dtype=np.uint8) for p in parts], dtype)
    bits_equal(joined, t)
    bits_equal(naive.join(parts, dtype), t)
    bits_equal(streams.join(streams.split(t), dtype), t)


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2], ids=str
)
def test_sign_is_the_last_bit_and_exponent_sits_at_exp_shift(dtype):
    # +x and -x differ only in the last stream's lowest bit; the exponent stream holds the
    # IEEE exponent field exp_shift bits up.
    exp_bits = {torch.bfloat16: 8, torch.float16: 5, torch.float32: 8, torch.float8_e4m3fn: 4, torch.float8_e5m2: 5}[
        dtype
    ]
    x32 = torch.tensor([1.0, 0.5, 2.0, 0.375, 3.0], dtype=torch.float32)
    x = x32.to(dtype)
    pos, neg = streams.split(x), streams.split((-x32).to(dtype))
    for s in range(len(pos) - 1):
        assert pos[s].tolist() == neg[s].tolist()
    assert (pos[-1] ^ neg[-1]).tolist() == [1] * 5
    assert (pos[-1] & 1).tolist() == [0] * 5
    width = x.element_size() * 8
    exponents = [(b >> (width - 1 - exp_bits)) & ((1 << exp_bits) - 1) for b in naive.element_bits(x)]
    shift = streams.spec_for(dtype).exp_shift
    assert (pos[0] >> shift).tolist() == exponents


@pytest.mark.parametrize("dtype", cc.SUPPORTED_DTYPES, ids=str)
def test_non_contiguous_input_is_accepted(dtype):
    base = _sample(6 * 35, dtype, seed=2).reshape(6, 35)
    for t in (base.t(), base[:, ::3], base.reshape(-1)[5::7]):
        assert not t.is_contiguous()
        got = streams.split(t)
        want = naive.split(t.contiguous())
        assert [g.tolist() for g in got] == want
        bits, spec = streams.as_bits(t)
        assert bits.dtype == spec.bits_dtype and bits.shape == (t.numel(),)


def test_contiguous_input_is_viewed_without_copy():
    t = torch.arange(10, dtype=torch.float32)
    bits, _ = streams.as_bits(t)
    assert bits.ctypes.data == t.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.bool, torch.complex64], ids=str)
def test_unsupported_dtype_raises_type_error_naming_supported(dtype):
    t = torch.zeros(4, dtype=dtype)
    with pytest.raises(TypeError, match=SUPPORTED_MESSAGE):
        streams.split(t)
    with pytest.raises(TypeError, match=SUPPORTED_MESSAGE):
        streams.join([np.zeros(4, np.uint8)], dtype)
    with pytest.raises(TypeError, match=SUPPORTED_MESSAGE):
        cc.Codec().encode(t)


def test_not_a_tensor_raises_type_error():
    with pytest.raises(TypeError, match="expected a torch.Tensor, got ndarray"):
        streams.split(np.zeros(3, dtype=np.float32))


def test_join_rejects_wrong_stream_count_and_ragged_streams():
    with pytest.raises(ValueError, match="bf16 has 2 streams, got 1"):
        streams.join([np.zeros(3, np.uint8)], torch.bfloat16)
    with pytest.raises(ValueError, match="same length"):
        streams.join([np.zeros(3, np.uint8), np.zeros(4, np.uint8)], torch.bfloat16)
