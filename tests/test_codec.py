"""Codec round trips: bit-exact over dtypes, sizes, distributions and settings; API contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import comm_codec as cc
from comm_codec.books.profiler import WarmupProfiler
from comm_codec.core import frame as _frame
from comm_codec.core.codec import DECODE_CACHE_SIZE

from helpers import MAX_THREADS, bits_equal, fix_header_crc, int_view, random_bits

pytestmark = pytest.mark.unit

_CODECS: dict = {}


def make_codec(chunk_elems: int, checksum: bool, threads: int) -> cc.Codec:
    key = (chunk_elems, checksum, threads)
    if key not in _CODECS:
        _CODECS[key] = cc.Codec(cc.CodebookSet.default(), threads=threads, chunk_elems=chunk_elems, checksum=checksum)
    return _CODECS[key]


# -- inputs -----------------------------------------------------------------------------------------
def make_tensor(dtype, n, dist, seed, scale=1.0) -> torch.Tensor:
    """Build a 1-D test tensor; every distribution is a function of its arguments only."""
    g = torch.Generator().manual_seed(seed)
    if dist == "zeros":
        return torch.zeros(n, dtype=dtype)
    if dist == "bits":
        return random_bits(n, dtype, g)
    if dist == "bits_specials":
        x = random_bits(n, dtype, g).clone()
        if n:
            specials = special_bits(dtype)
            idx = torch.randint(0, n, (min(n, 3 * len(specials)),), generator=g)
            vals = torch.tensor(specials * 3, dtype=torch.int64)[: idx.numel()]
            iv = int_view(x)
            iv[idx] = vals.to(iv.dtype) if iv.dtype != torch.uint8 else (vals & 0xFF).to(torch.uint8)
        return x
    # normal / mostly_zeros / runs
    v = torch.randn(n, generator=g) * scale
    if dtype in (torch.int8, torch.uint8):
        v = v.round().clamp(-128, 127).to(torch.int8)
        x = v.view(torch.uint8).clone() if dtype == torch.uint8 else v
    else:
        x = v.to(dtype)
    if dist == "mostly_zeros":
        keep = torch.rand(n, generator=g) < 0.05
        int_view(x)[~keep] = 0
    elif dist == "runs":  # zero runs of random lengths, as embedding-gradient rows
        pos = 0
        while pos < n:
            run = int(torch.randint(1, 200, (1,), generator=g))
            if torch.rand(1, generator=g) < 0.5:
                int_view(x)[pos : pos + run] = 0
            pos += run
    return x


def special_bits(dtype) -> list[int]:
    """Bit patterns of NaNs (with payloads), ±Inf, -0.0, the smallest/largest subnormals, ±max."""
    return {
        torch.float32: [
            0x7FC00000,
            0x7F800001,
            0xFFC00123,
            0x7FBFFFFF,
            0x7F800000,
            0xFF800000,
            0x80000000,
            0x00000001,
            0x80000001,
            0x007FFFFF,
            0x7F7FFFFF,
            0xFF7FFFFF,
        ],
        torch.bfloat16: [
            0x7FC0,
            0x7F81,
            0xFFC1,
            0x7FFF,
            0x7F80,
            0xFF80,
            0x8000,
            0x0001,
            0x8001,
            0x007F,
            0x7F7F,
            0xFF7F,
        ],
        torch.float16: [0x7E00, 0x7C01, 0xFE3F, 0x7FFF, 0x7C00, 0xFC00, 0x8000, 0x0001, 0x8001, 0x03FF, 0x7BFF, 0xFBFF],
        torch.float8_e4m3fn: [0x7F, 0xFF, 0x80, 0x01, 0x81, 0x07, 0x7E, 0xFE],
        torch.float8_e5m2: [0x7D, 0x7E, 0xFF, 0x7C, 0xFC, 0x80, 0x01, 0x81, 0x03, 0x7B, 0xFB],
        torch.int8: [0x80, 0x7F, 0xFF, 0x01],
        torch.uint8: [0xFF, 0x80, 0x7F, 0x01],
    }[dtype]


def _signed(bits: list[int], width: int) -> list[int]:
    top = 1 << (8 * width)
    return [b - top if width > 1 and b >= top // 2 else b for b in bits]


def tensor_of_bits(bits: list[int], dtype) -> torch.Tensor:
    width = torch.empty(0, dtype=dtype).element_size()
    itype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[width]
    return torch.tensor(_signed(bits, width), dtype=itype).view(dtype)


DISTS = ["normal", "zeros", "mostly_zeros", "runs", "bits", "bits_specials"]


# -- round trips ----------------------------------------------------------------------------------
@settings(max_examples=60)
@given(
    dtype=st.sampled_from(cc.SUPPORTED_DTYPES),
    n=st.integers(0, 5000),
    dist=st.sampled_from(DISTS),
    log_scale=st.floats(-8, 4),
    seed=st.integers(0, 2**31),
    chunk_elems=st.sampled_from([8, 64, 65536]),
    checksum=st.booleans(),
    threads=st.sampled_from(sorted({1, MAX_THREADS})),
    kind=st.sampled_from(cc.KINDS),
)
def test_round_trip_is_bit_exact(dtype, n, dist, log_scale, seed, chunk_elems, checksum, threads, kind):
    x = make_tensor(dtype, n, dist, seed, scale=10.0**log_scale)
    codec = make_codec(chunk_elems, checksum, threads)
    f = codec.encode(x, kind=kind)
    assert f.dtype == torch.uint8 and f.dim() == 1
    p = cc.get_frame_parameters(f)
    assert (p.dtype, p.numel, p.chunk_elems, p.checksums) == (dtype, n, chunk_elems, checksum)
    assert p.nchunks == -(-n // chunk_elems)
    bits_equal(codec.decode(f), x)


@settings(max_examples=60)
@given(
    dtype=st.sampled_from(cc.SUPPORTED_DTYPES),
    n=st.integers(0, 5000),
    seed=st.integers(0, 2**31),
    chunk_elems=st.sampled_from([8, 64, 65536]),
    checksum=st.booleans(),
    specials=st.booleans(),
)
def test_frames_never_grow_much_beyond_raw(dtype, n, seed, chunk_elems, checksum, specials):
    x = make_tensor(dtype, n, "bits_specials" if specials else "bits", seed)
    codec = make_codec(chunk_elems, checksum, 1)
    f = codec.encode(x)
    ns = x.element_size()
    nchunks = -(-n // chunk_elems)
    bound = n * ns + _frame.header_size(ns, nchunks) + 8 * ns * nchunks + 8 * nchunks + 16
    assert len(f) <= bound
    bits_equal(codec.decode(f), x)


@settings(max_examples=30)
@given(
    dtype=st.sampled_from(cc.SUPPORTED_DTYPES),
    n=st.integers(1, 3000),
    seed=st.integers(0, 2**31),
    dist=st.sampled_from(["normal", "mostly_zeros", "bits"]),
)
def test_frames_are_deterministic_across_threads_and_calls(dtype, n, seed, dist):
    # Same input, same books -> same bytes, whatever the thread count (design principle 5).
    x = make_tensor(dtype, n, dist, seed, scale=1e-2)
    frames = [make_codec(64, True, t).encode(x).numpy().tobytes() for t in sorted({1, MAX_THREADS})]
    frames.append(make_codec(64, True, 1).encode(x.clone()).numpy().tobytes())
    assert len(set(frames)) == 1


def test_compresses_typical_bf16_gradients(codec):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(1 << 17, generator=g) * 1e-3).to(torch.bfloat16)
    f = codec.encode(x, kind="gradient")
    assert len(f) < 0.8 * x.numel() * 2
    bits_equal(codec.decode(f), x)
    z = torch.zeros(1 << 17, dtype=torch.bfloat16)
    z[::1000] = 1.0
    assert len(codec.encode(z)) < 0.1 * z.numel() * 2


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8],
    ids=str,
)
@pytest.mark.parametrize("zeros", [0, 50, 2000])
def test_special_values_round_trip(small_codec, codec, dtype, zeros):
    # NaN payloads, ±Inf, -0.0 and subnormals among many +0.0 (masked chunks) and alone.
    specials = special_bits(dtype)
    bits = (specials * 7)[: 5 * len(specials)]
    bits = [0] * zeros + bits + [0] * zeros
    x = tensor_of_bits(bits, dtype)
    for c in (small_codec, codec):
        y = c.decode(c.encode(x))
        bits_equal(y, x)
    if dtype.is_floating_point and dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert torch.isnan(y).any() and (torch.signbit(y) & (y == 0)).any()


def test_negative_zero_is_not_treated_as_zero(small_codec):
    x = torch.zeros(1000, dtype=torch.float32)
    x[::7] = -0.0
    f = small_codec.encode(x)
    flags = cc.get_frame_parameters(f).table["cflags"]
    assert not (flags & _frame.CHUNK_ZERO).all()
    bits_equal(small_codec.decode(f), x)


# -- decode into out, frame forms ----------------------------------------------------------------
@pytest.fixture(scope="module")
def sample():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(1200, generator=g) * 1e-2).to(torch.bfloat16)
    x[100:400] = 0
    return x


def test_decode_into_out_writes_and_returns_it(small_codec, sample):
    f = small_codec.encode(sample)
    out = torch.full((40, 30), float("nan"), dtype=torch.bfloat16)  # any shape, same numel
    res = small_codec.decode(f, out=out)
    assert res is out
    bits_equal(out.reshape(-1), sample)
    # Into a contiguous slice of a larger buffer; its neighbours are untouched.
    big = torch.full((1300,), 7.0, dtype=torch.bfloat16)
    res = small_codec.decode(f, out=big[50:1250])
    assert res.data_ptr() == big[50:1250].data_ptr()
    bits_equal(big[50:1250], sample)
    assert (big[:50] == 7).all() and (big[1250:] == 7).all()


def test_decode_out_errors(small_codec, sample):
    f = small_codec.encode(sample)
    with pytest.raises(TypeError, match="out has dtype torch.float16, the frame holds torch.bfloat16"):
        small_codec.decode(f, out=torch.empty(1200, dtype=torch.float16))
    with pytest.raises(ValueError, match="out has 1199 elements, the frame holds 1200"):
        small_codec.decode(f, out=torch.empty(1199, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        small_codec.decode(f, out=torch.empty(30, 40, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="contiguous"):
        small_codec.decode(f, out=torch.empty(2400, dtype=torch.bfloat16)[::2])
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        small_codec.decode(f, out=torch.empty(1200, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(TypeError, match="out must be a torch.Tensor"):
        small_codec.decode(f, out=np.empty(1200, dtype=np.float32))


@pytest.mark.slow
def test_frames_from_numpy_bytes_and_buffers_decode(small_codec, sample):
    f = small_codec.encode(sample)
    arr = f.numpy()
    for form in (arr, arr.copy(), arr.tobytes(), bytearray(arr.tobytes()), memoryview(arr.tobytes())):
        bits_equal(small_codec.decode(form), sample)


@pytest.mark.parametrize("offset", [1, 3, 4, 5, 7, 8, 9])
def test_frame_sliced_at_unaligned_offset_decodes(small_codec, sample, offset):
    f = small_codec.encode(sample)
    big = torch.full((len(f) + 24,), 0xAB, dtype=torch.uint8)
    big[offset : offset + len(f)] = f
    view = big[offset : offset + len(f)]
    bits_equal(small_codec.decode(view), sample)
    bits_equal(small_codec.decode(big.numpy()[offset : offset + len(f)]), sample)
    assert (big[offset : offset + len(f)] == f).all()  # the caller's buffer is not modified


def test_strided_numpy_frame_decodes(small_codec, sample):
    # A 1-D uint8 numpy array that is a strided view (every other byte of a buffer) is
    # still "a numpy uint8 array"; the torch path makes such frames contiguous first.
    f = small_codec.encode(sample).numpy()
    doubled = np.repeat(f, 2)[::2]
    assert not doubled.flags.c_contiguous and np.array_equal(doubled, f)
    bits_equal(small_codec.decode(doubled), sample)


def test_strided_torch_frame_decodes(small_codec, sample):
    f = small_codec.encode(sample)
    doubled = f.repeat_interleave(2)[::2]
    assert not doubled.is_contiguous()
    bits_equal(small_codec.decode(doubled), sample)


@pytest.mark.parametrize("dtype", cc.SUPPORTED_DTYPES, ids=str)
def test_non_contiguous_input_is_encoded_correctly(small_codec, dtype):
    base = make_tensor(dtype, 50 * 37, "normal", 11, scale=0.01).reshape(50, 37)
    for x in (base.t(), base[:, ::2], base[3:40:3, 1:30:4]):
        assert not x.is_contiguous()
        f = small_codec.encode(x)
        assert f.numpy().tobytes() == small_codec.encode(x.contiguous()).numpy().tobytes()
        bits_equal(small_codec.decode(f), x.reshape(-1))


def test_any_shape_and_scalar_inputs(small_codec):
    x = torch.randn(3, 4, 5, dtype=torch.float32)
    bits_equal(small_codec.decode(small_codec.encode(x)), x.reshape(-1))
    s = torch.tensor(2.5, dtype=torch.bfloat16)
    bits_equal(small_codec.decode(small_codec.encode(s)), s.reshape(1))
    w = torch.randn(10, requires_grad=True)
    bits_equal(small_codec.decode(small_codec.encode(w)), w.detach())


# -- misuse and foreign frames --------------------------------------------------------------------
def _books_from(x: torch.Tensor) -> cc.CodebookSet:
    prof = WarmupProfiler(chunk_elems=64)
    prof.observe(x, kind="gradient")
    return prof.build()


def test_wrong_codebook_raises_frame_error_naming_the_id():
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(20000, generator=g) * 1e-3).to(torch.bfloat16)
    b = (torch.randn(20000, generator=g) ** 5).to(torch.bfloat16)  # heavy tails: other exponents
    codec_a = cc.Codec(_books_from(a), chunk_elems=64)
    codec_b = cc.Codec(_books_from(b), chunk_elems=64)
    id_a = codec_a.codebooks.group("gradient", "bf16", 0).id  # a book, or a group of them
    assert id_a != codec_b.codebooks.group("gradient", "bf16", 0).id
    f = codec_a.encode(a)
    assert cc.get_frame_parameters(f).book_ids[0] == id_a
    with pytest.raises(cc.FrameError, match=f"frame stream 0 was coded with codebook {id_a}, which this codec"):
        codec_b.decode(f)
    bits_equal(codec_a.decode(f), a)


def test_unknown_kind_raises_value_error(codec):
    with pytest.raises(
        ValueError,
        match="unknown tensor kind 'gradients'; expected one of gradient, "
        "reduced_gradient, activation, weight, optimizer_state",
    ):
        codec.encode(torch.zeros(4), kind="gradients")


def test_non_cpu_tensor_raises_value_error(codec):
    with pytest.raises(ValueError, match="expected a CPU tensor, got one on meta"):
        codec.encode(torch.empty(16, dtype=torch.bfloat16, device="meta"))


def test_not_a_tensor_raises_type_error(codec):
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        codec.encode(np.zeros(4, dtype=np.float32))


def test_codec_argument_errors():
    with pytest.raises(ValueError, match="chunk_elems must be in 8"):
        cc.Codec(chunk_elems=7)
    with pytest.raises(ValueError, match="threads must be in 1"):
        cc.Codec(threads=0)
    with pytest.raises(ValueError, match="threads must be in 1"):
        cc.Codec(threads=10_000)


def test_codec_restores_numba_thread_count():
    import numba

    before = numba.get_num_threads()
    c = cc.Codec(threads=1, chunk_elems=64)
    c.decode(c.encode(torch.randn(1000)))
    assert numba.get_num_threads() == before


def test_default_codec_uses_default_books():
    c = cc.Codec()
    assert c.codebooks is cc.CodebookSet.default()
    f = c.encode(torch.randn(5000).to(torch.bfloat16) * 1e-3)
    assert cc.get_frame_parameters(f).book_ids[0] == c.codebooks.group("gradient", "bf16", 0).id


def test_one_codec_shared_by_python_threads(small_codec):
    # "safe to share between threads": concurrent encodes and decodes stay bit-exact.
    import threading

    failures = []

    def work(i):
        dtype = cc.SUPPORTED_DTYPES[i % len(cc.SUPPORTED_DTYPES)]
        for k in range(15):
            x = make_tensor(dtype, 3000 + 37 * k, "mostly_zeros" if k % 2 else "normal", i * 100 + k, 1e-2)
            try:
                bits_equal(small_codec.decode(small_codec.encode(x)), x)
            except AssertionError as exc:
                failures.append((i, k, str(exc)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def test_max_output_bytes_refuses_large_frames(codec):
    x = torch.zeros(1 << 16, dtype=torch.float32)  # all-zero chunks: a tiny frame for 256 KiB
    f = codec.encode(x)
    assert f.numel() < 200
    with pytest.raises(cc.FrameError, match=r"decodes to 262144 bytes, more than max_output_bytes=1000"):
        codec.decode(f, max_output_bytes=1000)
    bits_equal(codec.decode(f, max_output_bytes=1 << 18), x)


def test_kernels_leave_torch_thread_count_alone(codec):
    from comm_codec.books.profiler import stream_counts

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.randn(100000, dtype=torch.bfloat16)
        codec.decode(codec.encode(x))
        cc.Codec(threads=1).decode(cc.Codec(threads=1).encode(x))
        stream_counts(x)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("numel", [0, 1, (32 << 20) - 1, (32 << 20) + 3, 17 << 21])
def test_outputs_on_huge_pages_are_plain_tensors(numel):
    from comm_codec.core.memory import empty_output

    t = empty_output(numel, torch.uint8)
    assert t.shape == (numel,) and t.dtype == torch.uint8 and t.is_contiguous() and t.device.type == "cpu"
    t.fill_(7)  # every byte writable, including those outside the advised huge pages
    assert int(t.sum()) == 7 * numel


def test_large_round_trip_through_huge_page_outputs():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(17 << 20, generator=g) * 1e-3).to(torch.bfloat16)  # 34 MiB: huge-page output
    codec = cc.Codec()
    bits_equal(codec.decode(codec.encode(x)), x)


# -- untrusted frames and misuse, API promises ----------------------------------------------------
def _empty_frame(ids: tuple[int, int], numel: int = 0, chunk_elems: int = 64) -> bytes:
    """A bf16 frame with the given stream ids whose chunks (if any) are all flagged ZERO."""
    nchunks = -(-numel // chunk_elems) if numel else 0
    head = bytearray(
        b"CCFR"
        + bytes([1, 1, 2, 0])
        + numel.to_bytes(8, "little")
        + chunk_elems.to_bytes(4, "little")
        + nchunks.to_bytes(4, "little")
    )
    head += b"".join(i.to_bytes(8, "little") for i in ids)
    head += bytes([_frame.CHUNK_ZERO] + [0] * 15) * nchunks  # entry: 8 + 2 x 4 bytes
    return fix_header_crc(bytes(head) + bytes(8))


def test_decode_table_cache_is_bounded():
    codec = cc.Codec(chunk_elems=64)
    ids = sorted({int(b.id, 16) for _, g in codec.codebooks.groups() for b in g if not b.raw})
    assert len(ids) ** 2 > 3 * DECODE_CACHE_SIZE
    seen = 0
    for a in ids:
        for b in ids[:3]:
            out = codec.decode(_empty_frame((a, b)))
            assert out.numel() == 0
            seen += 1
    assert seen > 2 * DECODE_CACHE_SIZE
    assert len(codec.decode_cache) == DECODE_CACHE_SIZE
    # The most recent frames' tables are the ones kept.
    last = (f"{ids[-1]:016x}", f"{ids[2]:016x}")
    assert last in codec.decode_cache
    first = (f"{ids[0]:016x}", f"{ids[0]:016x}")
    assert first not in codec.decode_cache


def test_frame_claiming_more_memory_than_exists_is_a_frame_error():
    codec = cc.Codec()
    # 2^40 bf16 elements in 2^14 all-zero chunks of 2^26: a 128 KiB frame asking for 2 TiB.
    frame = _empty_frame((0, 0), numel=1 << 40, chunk_elems=1 << 26)
    with pytest.raises(
        cc.FrameError,
        match=r"frame decodes to 2199023255552 bytes .* cannot be allocated"
        r".*max_output_bytes",
    ):
        codec.decode(frame)
    with pytest.raises(cc.FrameError, match="more than max_output_bytes=1000"):
        codec.decode(frame, max_output_bytes=1000)


def test_non_contiguous_memoryview_frame_is_a_type_error(small_codec, sample):
    f = bytes(small_codec.encode(sample).numpy().repeat(2))
    view = memoryview(f)[::2]
    assert not view.contiguous
    with pytest.raises(TypeError, match=r"memoryview must be contiguous.*pass bytes\(view\)"):
        small_codec.decode(view)
    bits_equal(small_codec.decode(bytes(view)), sample)


def test_decode_refuses_out_that_requires_grad(small_codec, sample):
    f = small_codec.encode(sample)
    leaf = torch.zeros(1200, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match=r"out requires grad.*out.detach\(\)"):
        small_codec.decode(f, out=leaf)
    assert not leaf.detach().any()  # untouched
    bits_equal(small_codec.decode(f, out=leaf.detach()), sample)
    bits_equal(leaf.detach(), sample)


def test_decode_returns_a_flat_tensor_and_out_keeps_the_shape(small_codec):
    # Frames do not record a shape (the docstring says so and shows how).
    x = torch.randn(6, 7, 8, dtype=torch.float32)
    f = small_codec.encode(x)
    flat = small_codec.decode(f)
    assert flat.shape == (x.numel(),)
    bits_equal(flat.view(x.shape), x)
    bits_equal(small_codec.decode(f, out=torch.empty_like(x)), x)
    assert "1-D" in cc.Codec.decode.__doc__ and "view(shape)" in cc.Codec.decode.__doc__


def test_codec_takes_a_path_to_books(tmp_path, default_books):
    path = tmp_path / "books.json"
    default_books.save(path)
    for arg in (path, str(path)):
        c = cc.Codec(arg, chunk_elems=64)
        assert c.codebooks == default_books
    with pytest.raises(cc.CodebookError, match="no such file"):
        cc.Codec(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="codebooks must be a CodebookSet, a path to a saved one, or None, got dict"):
        cc.Codec({})


def test_kernels_import_only_numpy_numba_and_each_other():
    # Kernels are leaves, "arrays in, status out": no import of the package above them
    # or of torch, at module level or inside a function.
    import ast
    import pathlib

    allowed = {"numpy", "numba", "llvmlite", "__future__"}
    root = pathlib.Path(cc.__file__).parent / "kernels"
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                inside = node.level == 1 or (node.module or "").startswith("comm_codec.kernels")
                assert inside or (not node.level and node.module.split(".")[0] in allowed), (
                    f"{path.name} imports {'.' * node.level}{node.module}"
                )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name.split(".")[0] in allowed, f"{path.name} imports {alias.name}"


def test_frame_parameters_of_a_cpu_frame(small_codec, sample):
    f = small_codec.encode(sample)
    for form in (f, f.numpy(), f.numpy().tobytes()):
        params = cc.Codec.frame_parameters(form)
        assert (params.numel, params.dtype) == (1200, torch.bfloat16)
    with pytest.raises(cc.FrameError, match="not a comm_codec frame"):
        cc.Codec.frame_parameters(bytes(64))


@pytest.mark.slow
def test_precompile_loads_kernels_and_reports_per_dtype(caplog):
    import logging

    from comm_codec.core import precompile
    from comm_codec.core.streams import spec_for

    codec = cc.Codec(threads=1)
    spent = codec.precompile([torch.bfloat16, "fp32"])
    assert set(spent) == {"bf16", "fp32"} and all(s >= 0 for s in spent.values())
    assert precompile.is_precompiled(torch.float16)  # shares bf16's kernels
    assert not precompile.is_precompiled("bf16", profiler=True)
    with pytest.raises(TypeError, match="cannot code dtype torch.float64"):
        codec.precompile([torch.float64])
    # A process's first use of a kernel says whether it compiled or loaded from the
    # cache, once per operation and element type; the codec's own decode was used above.
    frame = codec.encode(torch.ones(10, dtype=torch.bfloat16))
    with caplog.at_level(logging.DEBUG, logger="comm_codec.core.precompile"):
        for _ in range(2):
            with precompile.first_use("test decode", spec_for(torch.bfloat16)):
                codec.decode(frame)
    said = [r.getMessage() for r in caplog.records if r.name == "comm_codec.core.precompile"]
    assert len(said) == 1 and said[0].startswith("test decode of bf16 ") and "2-byte float kernels" in said[0], said


@settings(max_examples=40)
@given(
    chunk_elems=st.integers(8, 300),
    n=st.integers(1, 3000),
    spread=st.integers(0, 3),
    seed=st.integers(0, 2**31),
    masked=st.booleans(),
)
def test_short_codes_at_lane_ends_round_trip(chunk_elems, n, spread, seed, masked):
    # One- and two-bit exponent codes: each lookup yields four symbols and writes four
    # bytes, so lanes end right at the fast loop's limit (12 slots) in every position.
    g = torch.Generator().manual_seed(seed)
    e = torch.randint(0, spread + 1, (n,), generator=g).float()
    x = (torch.exp2(e) * (1 + torch.rand(n, generator=g))).to(torch.bfloat16)
    if masked:
        x[torch.rand(n, generator=g) < 0.4] = 0
        x[0] = 1.0  # something to build books from
    prof = WarmupProfiler(chunk_elems=chunk_elems, max_books=2)
    prof.observe(x, "gradient")
    codec = cc.Codec(prof.build(), chunk_elems=chunk_elems)
    bits_equal(codec.decode(codec.encode(x)), x)


# -- recycled output memory (kernels.output_pool) ----------------------------------------------
@pytest.mark.slow
def test_output_memory_returns_to_the_pool_only_when_no_tensor_uses_it():
    import gc

    from comm_codec.core.memory import POOL_MIN_BYTES, empty_output, output_pool

    output_pool.clear()
    n = POOL_MIN_BYTES + 4096
    a = empty_output(n, torch.uint8)
    ptr = a.data_ptr()
    view = a[10:20].view(-1)  # a view keeps the memory in use
    del a
    gc.collect()
    b = empty_output(n, torch.uint8)
    assert b.data_ptr() != ptr  # still used by `view`: not handed out again
    del view
    gc.collect()
    c = empty_output(n - 100, torch.uint8)  # fits the freed block
    assert c.data_ptr() == ptr and c.numel() == n - 100
    assert c.untyped_storage().nbytes() == n - 100  # the tensor sees its own size only
    del b, c
    output_pool.clear()


def test_output_pool_is_bounded_and_can_be_off():
    from comm_codec.core.memory import OutputPool

    pool = OutputPool(limit=3 << 20)
    blocks = [np.empty(1 << 20, dtype=np.uint8) for _ in range(4)]
    for block in blocks:
        pool.give(block)
    assert pool.free_bytes == 3 << 20
    assert pool.take(1 << 20) is blocks[1]  # the oldest (blocks[0]) was dropped
    assert pool.take(4 << 20).size == 4 << 20  # nothing that fits: fresh
    assert pool.take(300 << 10).size == 300 << 10  # blocks over 1.5x the request are not taken
    assert [pool.take(1 << 20) is b for b in blocks[2:]] == [True, True] and pool.free_bytes == 0
    off = OutputPool(limit=0)
    off.give(np.empty(1 << 20, dtype=np.uint8))
    assert off.free_bytes == 0


def test_the_front_of_a_pooled_array_keeps_its_block_out_of_the_pool():
    import gc

    from comm_codec.core.memory import POOL_MIN_BYTES, empty_bytes, front, output_pool

    output_pool.clear()
    n = POOL_MIN_BYTES + 4096
    a = empty_bytes(n)
    ptr = a.ctypes.data
    part = front(a, 1000)
    assert part.size == 1000 and part.ctypes.data == ptr
    del a
    gc.collect()
    b = empty_bytes(n)
    assert output_pool.free_bytes == 0 and b.ctypes.data != ptr  # still in use by `part`
    del part
    gc.collect()
    assert output_pool.free_bytes == n and empty_bytes(n).ctypes.data == ptr
    del b
    small = np.empty(100, dtype=np.uint8)  # not pooled: a plain slice
    assert front(small, 10).base is small
    output_pool.clear()


@pytest.mark.parametrize("threads", [None, 1])  # the planned path, and the single pass into pooled blocks
def test_pooled_outputs_of_codec_round_trips_are_independent(threads):
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(1 << 20, generator=g) * 1e-3).to(torch.bfloat16)  # 2 MiB: pooled outputs
    y = (torch.randn(1 << 20, generator=g) * 1e-2).to(torch.bfloat16)
    codec = cc.Codec(threads=threads)
    fx, fy = codec.encode(x), codec.encode(y)
    dx = codec.decode(fx)
    del fy
    dy = codec.decode(codec.encode(y))
    bits_equal(dx, x)
    bits_equal(dy, y)
    bits_equal(codec.decode(fx), x)


# -- decode and accumulate (the compressed all-reduce's rank-order sum) ------------------------
_F32_SPECIAL = [
    0x00000000,
    0x80000000,
    0x7F800000,
    0xFF800000,
    0x7FC00000,
    0xFFC00001,
    0x7F800001,
    0xFFA00003,
    0x00000001,
    0x807FFFFF,
    0x00800000,
    0x3F800000,
    0xBF800000,
    0x7F7FFFFF,
    0xFF7FFFFF,
    0x33800000,
]
_BF16_SPECIAL = [
    0x0000,
    0x8000,
    0x7F80,
    0xFF80,
    0x7FC0,
    0xFFC1,
    0x7F81,
    0xFFA3,
    0x0001,
    0x807F,
    0x0080,
    0x3F80,
    0xBF80,
    0x7F7F,
    0xFF7F,
    0x3380,
]
_F16_SPECIAL = [
    0x0000,
    0x8000,
    0x7C00,
    0xFC00,
    0x7E00,
    0xFE01,
    0x7C01,
    0xFD03,
    0x0001,
    0x83FF,
    0x0400,
    0x3C00,
    0xBC00,
    0x7BFF,
    0xFBFF,
    0x1400,
]


def _special_pairs(dtype: torch.dtype, n: int, seed: int):
    """(x, acc): every special value of dtype against every special float32 value, then
    random bit patterns and gradient-like values (so that chunks code, mask and raw)."""
    rng = np.random.default_rng(seed)
    special = {torch.bfloat16: _BF16_SPECIAL, torch.float16: _F16_SPECIAL, torch.float32: _F32_SPECIAL}[dtype]
    xs, accs = np.meshgrid(np.array(special, dtype=np.uint64), np.array(_F32_SPECIAL, dtype=np.uint64))
    width = torch.finfo(dtype).bits
    xbits = np.concatenate([xs.ravel(), rng.integers(0, 1 << width, n // 4, dtype=np.uint64)])
    abits = np.concatenate([accs.ravel(), rng.integers(0, 1 << 32, n // 4, dtype=np.uint64)])
    g = torch.Generator().manual_seed(seed)
    dense = (torch.randn(n - xbits.size, generator=g) * 1e-3).to(dtype)
    dense[: dense.numel() // 3] = 0  # masked and all-zero chunks
    idt = {16: np.uint16, 32: np.uint32}[width]
    x = torch.cat([torch.from_numpy(xbits.astype(idt).view({16: np.int16, 32: np.int32}[width])).view(dtype), dense])
    acc = torch.cat(
        [
            torch.from_numpy(abits.astype(np.uint32).view(np.int32)).view(torch.float32),
            torch.randn(n - abits.size, generator=g),
        ]
    )
    return x, acc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk_elems", [64, 1 << 14])
def test_decode_accumulate_equals_decode_then_add_bit_for_bit(dtype, chunk_elems):
    x, acc = _special_pairs(dtype, 40_000, seed=chunk_elems)
    codec = cc.Codec(chunk_elems=chunk_elems)
    frame = codec.encode(x)
    if dtype == torch.float32:  # what the all-reduce does today: part added as is, or widened first
        expect = acc.clone().add_(codec.decode(frame))
    else:
        expect = acc.clone().add_(torch.empty(x.numel()).copy_(codec.decode(frame)))
    got = acc.clone()
    assert codec.decode_accumulate(frame, got) is got
    bits_equal(got, expect)
    first = torch.full((x.numel(),), 5.0)
    bits_equal(codec.decode_accumulate(frame, first, add=False), torch.empty(x.numel()).copy_(x))


def test_decode_accumulate_sums_shards_in_rank_order_like_the_all_reduce():
    g = torch.Generator().manual_seed(11)
    parts = [(torch.randn(30_000, generator=g) * 10.0**-k).to(torch.bfloat16) for k in range(4)]
    codec = cc.Codec()
    frames = [codec.encode(p) for p in parts]
    expect = torch.empty(30_000).copy_(parts[0])
    for p in parts[1:]:
        expect.add_(torch.empty(30_000).copy_(p))
    acc = torch.empty(3, 10_000)  # any shape with the frame's element count
    codec.decode_accumulate(frames[0], acc, add=False)
    for f in frames[1:]:
        codec.decode_accumulate(f, acc)
    bits_equal(acc.view(-1), expect)


def test_decode_accumulate_refuses_what_it_cannot_add_into():
    codec = cc.Codec()
    frame = codec.encode(torch.ones(100, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="acc must be a float32 tensor, got torch.float64"):
        codec.decode_accumulate(frame, torch.zeros(100, dtype=torch.float64))
    with pytest.raises(ValueError, match="acc has 99 elements, the frame holds 100"):
        codec.decode_accumulate(frame, torch.zeros(99))
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        codec.decode_accumulate(frame, torch.zeros(200)[::2])
    with pytest.raises(ValueError, match="requires grad"):
        codec.decode_accumulate(frame, torch.zeros(100, requires_grad=True))
    with pytest.raises(TypeError, match="adds bfloat16, float16 or float32 frames; this one holds torch.int8"):
        codec.decode_accumulate(codec.encode(torch.ones(100, dtype=torch.int8)), torch.zeros(100))
    bad = frame.clone()
    bad[-3] ^= 0x10
    acc = torch.zeros(100)
    with pytest.raises(cc.FrameError, match="chunk 0 of 1 is bad"):
        codec.decode_accumulate(bad, acc)
    assert codec.decode_accumulate(codec.encode(torch.zeros(0, dtype=torch.bfloat16)), torch.zeros(0)).numel() == 0


# -- the frame parser's layout kernel ---------------------------------------------------------------
def _naive_layout(params) -> tuple[list, int]:
    """Payload offsets and frame length from the chunk table, chunk by chunk (frame_format.md)."""
    pos, offsets = params.header_bytes, []
    for c, entry in enumerate(params.table):
        count = min(params.chunk_elems, params.numel - c * params.chunk_elems)
        offsets.append(pos)
        if entry["cflags"] & _frame.CHUNK_MASK:
            pos += _frame.pad8((count + 7) // 8)
        pos += sum(_frame.pad8(int(n)) for n in entry["sizes"])
    return offsets, pos


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
def test_frame_layout_kernel_matches_a_naive_reference(dtype):
    # Dense, masked (half zeros), all-zero and random-bits (raw streams) chunks, a short last one.
    parts = [
        make_tensor(dtype, 3000, "normal", 1),
        torch.zeros(2048, dtype=dtype),
        make_tensor(dtype, 2500, "bits", 2),
        make_tensor(dtype, 1700, "normal", 3),
    ]
    parts[3][::2] = 0
    f = make_codec(1024, True, 1).encode(torch.cat(parts), kind="weight")
    p = cc.get_frame_parameters(f)
    flags = p.table["cflags"]
    assert (flags & _frame.CHUNK_MASK).any() and (flags & _frame.CHUNK_ZERO).any()
    offsets, total = _naive_layout(p)
    assert p.offsets.tolist() == offsets and total == p.frame_bytes == f.numel()


def test_frame_layout_reports_the_first_failed_check_in_order():
    # Chunk 2 has unknown flags, chunk 1 a stream size no chunk can hold: the flags are
    # reported (checks in the order the format lists them, not chunk order).
    f = make_codec(64, True, 1).encode(make_tensor(torch.bfloat16, 256, "normal", 0), kind="weight")
    buf = bytearray(f.numpy().tobytes())
    entry = lambda c: 40 + 16 * c  # noqa: E731  (bf16: 24-byte header, 2 book ids, 16-byte entries)
    buf[entry(1) + 8 : entry(1) + 12] = (10_000).to_bytes(4, "little")
    with pytest.raises(cc.FrameError, match="chunk 1 stream 0 size 10000 is impossible for 64 elements"):
        cc.get_frame_parameters(fix_header_crc(bytes(buf)))
    buf[entry(2)] = 0x40
    with pytest.raises(cc.FrameError, match="chunk 2 has unknown flags 0x40"):
        cc.get_frame_parameters(fix_header_crc(bytes(buf)))


# -- the decode path's fixed per-frame cost: serial kernel, book checks, shared tables ---------
def test_one_thread_codec_decodes_many_chunks_serially_and_reports_bad_chunks():
    x = torch.randn(4096, dtype=torch.bfloat16)
    serial, threaded = cc.Codec(threads=1, chunk_elems=1024), cc.Codec(threads=min(2, MAX_THREADS), chunk_elems=1024)
    f = serial.encode(x).numpy()
    bits_equal(serial.decode(f), x)
    bits_equal(threaded.decode(f), x)
    p = cc.get_frame_parameters(f)
    assert p.nchunks == 4
    bad = f.copy()
    bad[int(p.offsets[2])] ^= 0x40  # chunk 2's payload: its checksum no longer matches
    for codec in (serial, threaded):
        with pytest.raises(cc.FrameError, match="chunk 2 of 4 is bad"):
            codec.decode(bad)
        with pytest.raises(cc.FrameError, match="chunk 2 of 4 is bad"):
            codec.decode_into(bad, np.empty(2 * 4096, dtype=np.uint8))


@pytest.mark.parametrize("nchunks", [1, 3, 8, 9, 40])
def test_book_beyond_its_group_is_refused_for_any_number_of_chunks(nchunks):
    from comm_codec.core.tables import KernelTables

    books = cc.CodebookSet.default()
    groups = [books.group("gradient", "bf16", 0), books.group("gradient", "bf16", 1)]
    tables = KernelTables(groups)
    n0, n1 = (len(g) for g in groups)
    field = np.zeros(nchunks, dtype=np.uint16)
    field[:] = (n0 - 1) | ((n1 - 1) << 4)
    tables.check_books(field)  # the last book of each group is fine
    for s, n in ((0, n0), (1, n1)):
        bad = field.copy()
        bad[-1] = (int(bad[-1]) & (0xFFFF ^ (15 << (4 * s)))) | (n << (4 * s))
        if n < 16:
            with pytest.raises(
                cc.FrameError,
                match=f"chunk {nchunks - 1} says stream {s} was coded with book {n} of its group, which holds {n}",
            ):
                tables.check_books(bad)


def test_equal_books_share_decode_tables_across_codecs(tmp_path):
    x = torch.randn(3000, dtype=torch.bfloat16)
    books = cc.CodebookSet.default()
    books.save(tmp_path / "books")
    a, b = cc.Codec(cc.CodebookSet.load(tmp_path / "books")), cc.Codec(cc.CodebookSet.load(tmp_path / "books"))
    f = a.encode(x).numpy()
    bits_equal(a.decode(f), x)
    bits_equal(b.decode(f), x)
    ids = cc.get_frame_parameters(f).book_ids
    assert a.decode_cache.get(a.codebooks, ids) is b.decode_cache.get(b.codebooks, ids)
    other = cc.Codec(_books_from(torch.randn(5000, dtype=torch.bfloat16) * 1e-4))
    g = other.encode(x).numpy()
    bits_equal(other.decode(g), x)
    gids = cc.get_frame_parameters(g).book_ids
    assert other.decode_cache.get(other.codebooks, gids) is not a.decode_cache.get(a.codebooks, ids)


def test_one_thread_threads_and_decode_add_share_one_decode_kernel():
    # A one-chunk frame, a many-chunk frame on threads, a frame in read-only bytes and a
    # decode-and-add run the same compiled decode kernel: a process that used one waits
    # for no other, and precompile has one specialization per element type to cache.
    from comm_codec.kernels.decode import decode_range

    for n in (100, 40000):
        codec = cc.Codec(chunk_elems=1024, threads=2)
        x = torch.randn(n).to(torch.bfloat16)
        frame = codec.encode(x)
        assert torch.equal(codec.decode(frame).view(torch.int16), x.view(torch.int16))
        assert torch.equal(codec.decode(frame.numpy().tobytes()).view(torch.int16), x.view(torch.int16))
        acc = torch.zeros(n)
        codec.decode_accumulate(frame, acc)
        assert torch.equal(acc, x.float())
    uint16 = [sig for sig in decode_range.signatures if str(sig[15].dtype) == "uint16"]
    assert len(uint16) == 1 and not uint16[0][0].mutable, decode_range.signatures
