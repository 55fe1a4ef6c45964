"""The codecs under test: comm_codec (profiled, single-book and shipped books), zstd, bz2, zipnn, OpenZL.

Every comparator has the same small interface (:class:`Comparator`): a per-dataset
``setup``, an untimed ``prepare`` of the input, ``encode`` and ``decode`` with a thread
count, the ``size`` of a payload and the ``expected`` result of a round trip.

The huff0 rows (huff0 on the exponent stream and the codec on that stream alone) come
from ``launch_scripts/huff0.py``, which needs a C library the user builds: ``python
launch_scripts/bench_codec.py`` is this bench with them (:func:`comm_codec.tools.bench.run`'s
``extra``).
"""

from __future__ import annotations

import bz2
import importlib.metadata
import logging

import numba
import numpy as np
import torch

from ..core.codebooks import CodebookSet
from ..core.codec import Codec
from .bench_data import MIB, Dataset

__all__ = [
    "Comparator",
    "Unsupported",
    "CommCodec",
    "Zstd",
    "Bz2",
    "ZipNN",
    "as_u8",
    "comparators",
    "threads_available",
]

log = logging.getLogger(__name__)

_ZIPNN_DTYPES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


def as_u8(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).view(torch.uint8).numpy()
    return np.frombuffer(x, dtype=np.uint8)


class Unsupported(Exception):
    """This comparator has no mode for this dtype; the row is skipped with a note."""


class Comparator:
    """One codec under test: prepare (untimed), encode, decode, size of the payload."""

    name = ""
    enc_threads: tuple = (1,)
    dec_threads: tuple = (1,)
    note = ""
    # None: ratios over every evaluation bucket, speeds from the alternating rounds; a
    # byte count: ratio and one timed call on a sample of that size (for slow codecs).
    sample_bytes: int | None = None

    def setup(self, ds: Dataset) -> None:
        """Per-dataset configuration; raise Unsupported to skip."""

    def prepare(self, t: torch.Tensor):
        return as_u8(t)

    def encode(self, x, threads: int):
        raise NotImplementedError

    def decode(self, payload, threads: int):
        raise NotImplementedError

    @staticmethod
    def size(payload) -> int:
        return len(payload)

    def expected(self, t: torch.Tensor) -> np.ndarray:
        """The bytes a round trip of t must give back."""
        return as_u8(t)


class CommCodec(Comparator):
    dec_threads = enc_threads = (1, 2)

    def __init__(self, default: bool, chunk_elems: int, single: bool = False):
        self.default = default
        self.single = single
        self.chunk_elems = chunk_elems
        self.name = "comm_codec:default" if default else "comm_codec:fixed-1book" if single else "comm_codec:fixed"

    def setup(self, ds):
        books = CodebookSet.default() if self.default else ds.books
        if self.single:  # each group's first book alone: what the groups add
            books = CodebookSet({key: group.primary for key, group in books.groups()}, books.meta)
        self.kind = ds.kind
        self.note = "" if self.default else ds.book_note
        self.codecs = {th: Codec(books, threads=th, chunk_elems=self.chunk_elems) for th in threads_available()}

    def prepare(self, t):
        return t

    def encode(self, x, threads):
        return self.codecs[threads].encode(x, kind=self.kind)

    def decode(self, payload, threads):
        return self.codecs[threads].decode(payload)

    @staticmethod
    def size(payload) -> int:
        return payload.numel()


class Zstd(Comparator):
    enc_threads = (1, 2)

    def __init__(self, level: int):
        import zstandard

        self.name = f"zstd-{level}"
        self.compressors = {
            1: zstandard.ZstdCompressor(level=level, threads=0),
            2: zstandard.ZstdCompressor(level=level, threads=2),
        }
        self.decompressor = zstandard.ZstdDecompressor()

    def encode(self, x, threads):
        return self.compressors[threads].compress(x)

    def decode(self, payload, threads):
        return self.decompressor.decompress(payload)


class Bz2(Comparator):
    name = "bz2-9"

    def __init__(self, sample_mb: float):
        self.sample_bytes = int(sample_mb * MIB)
        self.note = f"ratio+time on a {sample_mb:g} MiB sample, 1 call"

    def encode(self, x, threads):
        return bz2.compress(x, 9)

    def decode(self, payload, threads):
        return bz2.decompress(payload)


class ZipNN(Comparator):
    name = "zipnn"
    dec_threads = enc_threads = (1, 2)

    def __init__(self):
        import zipnn  # noqa: F401  (fails early, before any timing, if it is missing)

        self.version = importlib.metadata.version("zipnn")

    def setup(self, ds):
        import zipnn

        name = _ZIPNN_DTYPES.get(ds.spec_name)
        if name is None:
            raise Unsupported(f"zipnn {self.version} has no {ds.spec_name} mode")
        self.enc = {th: zipnn.ZipNN(input_format="byte", bytearray_dtype=name, threads=th) for th in (1, 2)}
        self.dec = {th: zipnn.ZipNN(input_format="byte", bytearray_dtype=name, threads=th) for th in (1, 2)}

    def prepare(self, t):
        # zipnn.compress rewrites its input buffer in place (checked per row), so it gets a
        # fresh copy every call, made outside the timed region.
        return bytearray(as_u8(t))

    def encode(self, x, threads):
        return self.enc[threads].compress(x)

    def decode(self, payload, threads):
        return self.dec[threads].decompress(payload)


class OpenZL(Comparator):
    """OpenZL's float graph (:mod:`comm_codec.tools.openzl_graph`); one thread only."""

    name = "openzl"

    def __init__(self):
        from .openzl_graph import OpenZL as _Graph  # fails early, before any timing, if openzl is missing

        self.graph_type = _Graph
        self.version = importlib.metadata.version("openzl")
        self.note = "float graph: exponent Fse, sign+fraction Entropy"

    def setup(self, ds):
        if ds.spec_name not in ("bf16", "fp16", "fp32"):
            raise Unsupported(f"openzl {self.version}: no float graph for {ds.spec_name}")
        self.graph = self.graph_type(ds.spec_name)

    def encode(self, x, threads):
        return self.graph.compress(x)

    def decode(self, payload, threads):
        return self.graph.decompress(payload)


def threads_available() -> tuple:
    return (1, 2) if numba.config.NUMBA_NUM_THREADS >= 2 else (1,)


def comparators(chunk_elems: int, bz2_mb: float) -> list:
    """Every comparator, in table order; zipnn is left out (with a warning) when it is not installed."""
    found = [
        CommCodec(False, chunk_elems),
        CommCodec(False, chunk_elems, single=True),
        CommCodec(True, chunk_elems),
        Zstd(1),
        Zstd(3),
        Bz2(bz2_mb),
    ]
    try:
        found.append(ZipNN())
    except ImportError as exc:
        log.warning("zipnn not importable (%s); its rows are left out (pip install comm_codec[bench])", exc)
    try:
        found.append(OpenZL())
    except ImportError as exc:
        log.warning("openzl not importable (%s); its rows are left out (pip install comm_codec[bench])", exc)
    return found
