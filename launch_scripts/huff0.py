"""huff0, the Huffman coder inside zstd, through ctypes: the reference for the codec's entropy stage.

huff0 (FiniteStateEntropy's ``HUF_compress``/``HUF_decompress``) is what zipnn's entropy
stage is, and what a compression engineer holds a Huffman coder to. It adapts a table
to every block; the codec codes with fixed books. Timing both on the very bytes the
codec codes (the exponent stream, :func:`exponent_stream`) shows what each design costs
and buys. The library is not shipped: ``launch_scripts/build_huff0.sh SOURCE_DIR`` builds
it from a checkout of https://github.com/Cyan4973/FiniteStateEntropy into
:func:`default_path` (``COMM_CODEC_HUFF0`` names another file).

Blocks are :data:`BLOCK` bytes (64 KiB, zstd's block size is 128 KiB at most): each is
stored as huff0 returns it, raw where ``HUF_compress`` returns 0 (incompressible) and
one byte where it returns 1 (a single symbol); ``HUF_decompress`` reads all three from
the stored size, so a payload is the blocks plus their u32 sizes.

Run as a script (``python launch_scripts/huff0.py``) it times huff0 against the codec on
the exponent streams of real weights, alternating the two in one process;
:func:`comparators` gives ``launch_scripts/bench_codec.py`` (``comm-codec bench`` with
the huff0 rows) its two extra rows. It lives beside the launchers, not in the package,
because it needs a C library the user builds.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import sys
import time

import numpy as np
import torch

from comm_codec.tools.bench_codecs import Comparator, Unsupported

__all__ = [
    "BLOCK",
    "BUILD_HINT",
    "CodecExponents",
    "Huff0",
    "Huff0Rows",
    "comparators",
    "default_path",
    "exponent_codec",
    "exponent_stream",
    "main",
]

log = logging.getLogger(__name__)

BLOCK = 64 * 1024
BUILD_HINT = (
    "build it with: launch_scripts/build_huff0.sh SOURCE_DIR, SOURCE_DIR a checkout of "
    "https://github.com/Cyan4973/FiniteStateEntropy (or set COMM_CODEC_HUFF0 to a built libhuff0.so)"
)


def default_path() -> str:
    """Return where the built library is looked for: ``COMM_CODEC_HUFF0``, else the user's cache."""
    env = os.environ.get("COMM_CODEC_HUFF0")
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "comm_codec", "libhuff0.so")


def exponent_stream(tensor: torch.Tensor) -> np.ndarray:
    """Return stream 0 of a float tensor as the codec cuts it: the byte above the sign.

    The codec rotates the sign to bit 0 and codes the top byte of the result: bf16 and
    fp32 the exponent, fp16 its 5 exponent bits and 3 mantissa bits, fp8 the whole
    rotated byte. This is that byte before the chunk's reference is subtracted (huff0
    gets no reference; a reference shifts symbols, it does not change their entropy
    within a chunk).

    Args:
        tensor: a CPU tensor of a 1-, 2- or 4-byte float type.

    Returns:
        uint8[numel], a new array.

    Raises:
        TypeError: not a floating-point tensor.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.dtype.is_floating_point:
        raise TypeError(
            f"exponent_stream needs a floating-point tensor, got {type(tensor).__name__}"
            f"{'' if not isinstance(tensor, torch.Tensor) else ' of ' + str(tensor.dtype)}"
        )
    width = tensor.element_size()
    bits = tensor.detach().contiguous().reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[width])
    v = bits.numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32}[width]).astype(np.int64)
    if width == 1:
        return (((v << 1) | (v >> 7)) & 255).astype(np.uint8)
    return ((v >> (8 * width - 9)) & 255).astype(np.uint8)


class Huff0:
    """huff0 on 64 KiB blocks of a byte array, one thread.

    Args:
        path: the built library (default :func:`default_path`).

    Raises:
        FileNotFoundError: no library at path (the message says how to build it).
        OSError: the file is not a loadable library with huff0's functions.
    """

    def __init__(self, path: str | None = None):
        path = path or default_path()
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no huff0 library at {path}: {BUILD_HINT}")
        lib = ctypes.CDLL(path)
        try:
            self._compress = lib.HUF_compress
            self._decompress = lib.HUF_decompress
            self._is_error = lib.HUF_isError
            bound = lib.HUF_compressBound
        except AttributeError as exc:
            raise OSError(f"{path} is not a huff0 library ({exc})") from None
        for fn in (self._compress, self._decompress):
            fn.restype = ctypes.c_size_t
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
        self._is_error.restype = ctypes.c_uint
        self._is_error.argtypes = [ctypes.c_size_t]
        bound.restype = ctypes.c_size_t
        bound.argtypes = [ctypes.c_size_t]
        self._bound = int(bound(BLOCK))
        self.path = path

    def compress(self, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Compress data block by block: (payload uint8, stored size of each block uint32).

        Args:
            data: uint8[n], contiguous.

        Returns:
            The blocks back to back, and each one's stored size (its block's size: raw).

        Raises:
            RuntimeError: huff0 reported an error.
        """
        data = np.ascontiguousarray(data, dtype=np.uint8)
        nblocks = -(-data.size // BLOCK)
        out = np.empty(nblocks * self._bound + 8, dtype=np.uint8)
        sizes = np.empty(nblocks, dtype=np.uint32)
        src = data.ctypes.data
        dst = out.ctypes.data
        pos = 0
        for b in range(nblocks):
            n = min(BLOCK, data.size - b * BLOCK)
            r = self._compress(dst + pos, self._bound, src + b * BLOCK, n)
            if self._is_error(r):
                raise RuntimeError(f"HUF_compress failed on block {b} (code {r})")
            if r == 0:  # incompressible: stored raw, which HUF_decompress knows by its size
                ctypes.memmove(dst + pos, src + b * BLOCK, n)
                r = n
            sizes[b] = r
            pos += r
        return out[:pos], sizes

    def decompress(self, payload: np.ndarray, sizes: np.ndarray, n: int) -> np.ndarray:
        """Decompress what :meth:`compress` made of n bytes.

        Raises:
            ValueError: sizes and n disagree with the payload.
            RuntimeError: huff0 reported an error (corrupted payload).
        """
        payload = np.ascontiguousarray(payload, dtype=np.uint8)
        if len(sizes) != -(-n // BLOCK) or int(np.sum(sizes, dtype=np.int64)) != payload.size:
            raise ValueError(
                f"{len(sizes)} block sizes summing to {int(np.sum(sizes, dtype=np.int64))} do not "
                f"describe {n} bytes in a {payload.size}-byte payload"
            )
        out = np.empty(n, dtype=np.uint8)
        src = payload.ctypes.data
        dst = out.ctypes.data
        pos = 0
        for b in range(len(sizes)):
            size = int(sizes[b])
            m = min(BLOCK, n - b * BLOCK)
            r = self._decompress(dst + b * BLOCK, m, src + pos, size)
            if self._is_error(r) or r != m:
                raise RuntimeError(f"HUF_decompress failed on block {b} (code {r})")
            pos += size
        return out


def exponent_codec(stream: np.ndarray, chunk_elems: int, max_books: int = 8):
    """A codec for an exponent stream alone: its bytes as int8, with books fitted to them.

    What huff0 is fairly timed against: the codec's coder on the same bytes, with fixed
    books as the codec codes any stream (a group of up to ``max_books``, each chunk
    coded with its best, as the shipped books' groups are; no reference exponent, as
    int8 has none), where huff0 fits a table to every block. A single book (``max_books=1``)
    cannot follow exponents that span several scales, as an optimizer's second moments'
    do (TinyLM's Adam state: 1.797 against huff0's 2.375, and a decode at 0.98 of huff0's).

    Args:
        stream: uint8[n], an :func:`exponent_stream`.
        chunk_elems: the codec's chunk size.

    Returns:
        (the Codec, the stream as an int8 tensor sharing its memory); code it as kind
        ``"weight"``.
    """
    from comm_codec.books.profiler import WarmupProfiler
    from comm_codec.core.codec import Codec

    prof = WarmupProfiler(chunk_elems=chunk_elems, max_books=max_books)
    t = torch.from_numpy(stream.view(np.int8))
    prof.observe(t, kind="weight")
    return Codec(prof.build(), threads=1, chunk_elems=chunk_elems), t


def _best(fn, repeat: int, out: list) -> None:
    start = time.perf_counter()
    fn()
    out.append(time.perf_counter() - start)


def _datasets(names: list) -> list:
    """(name, tensor) pairs: the packaged models' weights, flattened, in bf16 and fp32, and
    MiniLM's word-embedding table cast to fp16 (no packaged model ships fp16 weights)."""
    from comm_codec.tools.pretrained import load_weights, model_path

    out = []
    for name in names:
        weights = load_weights(model_path(name))
        flat = torch.cat([w.reshape(-1).float() for w in weights.values()])
        out.append((f"{name} weights fp32", flat))
        out.append((f"{name} weights bf16", flat.to(torch.bfloat16)))
        emb = [w for k, w in weights.items() if "word_embeddings" in k]
        if emb:
            out.append((f"{name} word embeddings {tuple(emb[0].shape)} as fp16", emb[0].reshape(-1).to(torch.float16)))
    return out


def self_test(lib: str | None = None) -> None:
    """Round-trip a single-symbol, a raw and a skewed block through the built library.

    Raises:
        AssertionError: the library does not give back what it was given, or accepts sizes
            that do not describe its payload.
    """
    coder = Huff0(lib)
    g = np.random.default_rng(0)
    parts = [
        np.full(BLOCK, 7, np.uint8),  # one symbol: huff0 stores one byte
        g.integers(0, 256, BLOCK, dtype=np.uint8),  # incompressible: stored raw
        (120 + g.geometric(0.5, 3 * BLOCK + 123)).astype(np.uint8),
    ]
    data = np.concatenate(parts)
    payload, sizes = coder.compress(data)
    assert sizes[0] == 1 and sizes[1] == BLOCK and payload.size < data.size, sizes
    assert np.array_equal(coder.decompress(payload, sizes, data.size), data)
    try:
        coder.decompress(payload[:-1], sizes, data.size)
    except ValueError as exc:
        assert "do not describe" in str(exc), exc
    else:
        raise AssertionError("a truncated payload was accepted")


def main(argv=None) -> int:
    """Time huff0 against the codec on exponent streams; print a table (symbols per second)."""
    parser = argparse.ArgumentParser(prog="python launch_scripts/huff0.py", description=main.__doc__)
    parser.add_argument("--models", default="minilm", help="comma-separated packaged models (minilm, efficientnet)")
    parser.add_argument("--repeat", type=int, default=7, help="alternating rounds, best kept (7)")
    parser.add_argument(
        "--lib", default=None, help="the built huff0 library (default: %(default)s -> " + default_path() + ")"
    )
    parser.add_argument("--self-test", action="store_true", help="check the built library's round trip, then exit")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    if args.self_test:
        try:
            self_test(args.lib)
        except (FileNotFoundError, OSError) as exc:
            print(f"huff0: {exc}", file=sys.stderr)
            return 2
        print("huff0: the library round-trips")
        return 0
    from comm_codec.tools.pretrained import MODELS, model_path

    models = [m for m in args.models.split(",") if m]
    if not models:
        print(f"huff0: no models given (--models: a comma-separated list of {', '.join(MODELS)})", file=sys.stderr)
        return 2
    for name in models:  # before the library: what to install, whether or not huff0 is built
        try:
            model_path(name)
        except (ValueError, ModuleNotFoundError) as exc:
            print(f"huff0: {exc}", file=sys.stderr)
            return 2
    try:
        huff = Huff0(args.lib)
    except (FileNotFoundError, OSError) as exc:
        print(f"huff0: {exc}", file=sys.stderr)
        return 2
    import numba

    from comm_codec.core.codec import DEFAULT_CHUNK_ELEMS, Codec

    numba.set_num_threads(1)
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    print(
        f"{'data':<44} {'Msym':>6} {'ratio h0/cc':>12}  {'enc Msym/s h0 / exp / full':>28}  "
        f"{'dec Msym/s h0 / exp / full':>28}  enc x h0 (exp/full)  dec x h0 (exp/full)"
    )
    for name, tensor in _datasets(models):
        stream = exponent_stream(tensor)
        n = stream.size
        exp_codec, exp_t = exponent_codec(stream, DEFAULT_CHUNK_ELEMS)
        full_codec = Codec(threads=1)
        payload, sizes = huff.compress(stream)
        assert np.array_equal(huff.decompress(payload, sizes, n), stream)
        frame = exp_codec.encode(exp_t, kind="weight")
        assert np.array_equal(exp_codec.decode(frame).numpy().view(np.uint8), stream)
        full = full_codec.encode(tensor, kind="weight")
        assert torch.equal(
            full_codec.decode(full).view(
                torch.int8 if tensor.element_size() == 1 else {2: torch.int16, 4: torch.int32}[tensor.element_size()]
            ),
            tensor.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[tensor.element_size()]),
        )
        t = {k: [] for k in ("he", "hd", "ce", "cd", "fe", "fd")}
        for _ in range(args.repeat):  # alternating: huff0, the codec on the stream, the codec on the tensor
            _best(lambda: huff.compress(stream), 1, t["he"])
            _best(lambda: exp_codec.encode(exp_t, kind="weight"), 1, t["ce"])
            _best(lambda: full_codec.encode(tensor, kind="weight"), 1, t["fe"])
            _best(lambda: huff.decompress(payload, sizes, n), 1, t["hd"])
            _best(lambda: exp_codec.decode(frame), 1, t["cd"])
            _best(lambda: full_codec.decode(full), 1, t["fd"])
        r = {k: n / min(v) / 1e6 for k, v in t.items()}
        ratio_h = n / (payload.size + 4 * len(sizes))
        ratio_c = n / frame.numel()
        print(
            f"{name:<44} {n / 1e6:>6.2f} {ratio_h:>5.3f}/{ratio_c:<5.3f}  "
            f"{r['he']:>8.0f} / {r['ce']:>6.0f} / {r['fe']:>6.0f}  "
            f"{r['hd']:>8.0f} / {r['cd']:>6.0f} / {r['fd']:>6.0f}  "
            f"{r['ce'] / r['he']:>8.2f} / {r['fe'] / r['he']:<6.2f}  {r['cd'] / r['hd']:>8.2f} / {r['fd'] / r['hd']:<6.2f}"
        )
    wall = time.perf_counter() - wall0
    print(
        f"huff0: {huff.path}; 64 KiB blocks; codec 1 thread, exp = the exponent stream alone as int8 with a "
        f"book fitted to it, full = the whole tensor with the shipped books (elements/s); best of "
        f"{args.repeat} alternating rounds; cores available {cores}, CPU time / wall {(time.process_time() - cpu0) / wall:.2f}"
    )
    return 0


class Huff0Rows(Comparator):
    """huff0 on the exponent stream of each row, 64 KiB blocks, one thread."""

    name = "huff0:exponents"

    def __init__(self):
        self.coder = Huff0()  # FileNotFoundError (with how to build it) when it is not built
        self.note = "exponent stream only (ratio of that stream; GB/s of the tensor's bytes)"

    def setup(self, ds):
        if not ds.dtype.is_floating_point:
            raise Unsupported(f"no exponent stream in {ds.spec_name}")

    def prepare(self, t):
        return exponent_stream(t)

    def encode(self, x, threads):
        return self.coder.compress(x) + (x.size,)

    def decode(self, payload, threads):
        return self.coder.decompress(*payload)

    @staticmethod
    def size(payload) -> int:
        data, sizes, _ = payload
        return data.size + 4 * len(sizes)

    def expected(self, t):
        return exponent_stream(t)


class CodecExponents(Comparator):
    """The codec on the exponent stream of each row alone, one thread: what huff0's row is
    measured against, symbol for symbol (the stream's bytes as int8, a group of books
    fitted to the row's evaluation buckets, each chunk coded with its best, as huff0
    fits a table to each block; see :func:`exponent_codec`)."""

    name = "comm_codec:exponents"
    note = "exponent stream only, as int8 with books fitted to it (the like of huff0's row)"

    def __init__(self, chunk_elems: int):
        self.chunk_elems = chunk_elems

    def setup(self, ds):
        if not ds.dtype.is_floating_point:
            raise Unsupported(f"no exponent stream in {ds.spec_name}")
        stream = np.concatenate([exponent_stream(b) for b in ds.buckets])
        self.codec, _ = exponent_codec(stream, self.chunk_elems)

    def prepare(self, t):
        return torch.from_numpy(exponent_stream(t).view(np.int8))

    def encode(self, x, threads):
        return self.codec.encode(x, kind="weight")

    def decode(self, payload, threads):
        return self.codec.decode(payload)

    @staticmethod
    def size(payload) -> int:
        return payload.numel()

    def expected(self, t):
        return exponent_stream(t)


def comparators(chunk_elems: int) -> list:
    """The two huff0 rows for ``comm-codec bench``'s table (:func:`comm_codec.tools.bench.run`'s
    ``extra``): the codec on the exponent stream alone and huff0 on it.

    Args:
        chunk_elems: the bench's chunk size, for the exponent codec's books.

    Returns:
        The comparators, or an empty list (with a warning saying how to build it) when the
        huff0 library is not built here.
    """
    try:
        huff = Huff0Rows()
    except OSError as exc:  # FileNotFoundError included: not built here
        log.warning("huff0 rows left out: %s", exc)
        return []
    return [CodecExponents(chunk_elems), huff]


if __name__ == "__main__":
    sys.exit(main())
