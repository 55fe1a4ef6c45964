"""Helpers the tests share: bit-pattern comparison, random bit patterns, frame resealing, free ports,
the command line in a subprocess.

Imported by test modules (``from helpers import bits_equal``) and by conftest.py; kept
out of conftest so that scripts beside the tests (fuzz harnesses) can import them too.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import zlib

import numba
import numpy as np
import torch

import comm_codec as cc
from comm_codec.core import frame as _frame

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


def low_byte_tensor(chunk_elems: int, kinds, seed: int, skew: float = 0.36) -> torch.Tensor:
    """fp32 chunks whose lowest byte (stream 3) barely compresses (kind 0) or compresses well (1).

    Kind 0's low mantissa bits come from 32 values with probability ``skew``, else from
    128: a book fitted to both kinds codes such a chunk 1-2 % under raw, less than the
    share a later stream must save (kernels.layout.MIN_SAVING_SHIFT). Kind 1's take 24
    values. Exponents and high mantissa bits are random over a small range.
    """
    rng = np.random.default_rng(seed)
    out = []
    for k in kinds:
        exp = rng.integers(120, 124, chunk_elems).astype(np.uint32)
        hi = rng.integers(0, 1 << 16, chunk_elems).astype(np.uint32)
        if k == 0:
            low = np.where(
                rng.random(chunk_elems) < skew, rng.integers(0, 32, chunk_elems), rng.integers(0, 128, chunk_elems)
            )
        else:
            low = rng.integers(0, 24, chunk_elems)
        sign = rng.integers(0, 2, chunk_elems).astype(np.uint32)
        out.append((sign << 31) | (exp << 23) | (hi << 7) | low.astype(np.uint32))
    return torch.from_numpy(np.concatenate(out).view(np.int32)).view(torch.float32)


def low_byte_books(chunk_elems: int) -> cc.CodebookSet:
    """Weight books fitted to :func:`low_byte_tensor` chunks of both kinds (stream 3 coded)."""
    from comm_codec.books.profiler import WarmupProfiler

    prof = WarmupProfiler(chunk_elems=chunk_elems, max_books=1)
    for seed in range(3):
        prof.observe(low_byte_tensor(chunk_elems, [0, 1, 0, 0], seed), "weight")
    return prof.build()


def low_byte_segments(x: torch.Tensor, book: cc.Codebook, chunk_elems: int) -> np.ndarray:
    """Bytes stream 3's coded segment of each chunk of fp32 ``x`` (no zeros) takes under ``book``:
    lane lengths, then four lanes over the chunk's quarters, each padded to 8 bytes."""
    u = int_view(x).numpy().view(np.uint32)
    sym = ((u << 1) | (u >> 31)) & 255  # rotated left by one: the sign is bit 0 of the low byte
    bits = book.symbol_bits().astype(np.int64)
    sizes = []
    for lo in range(0, u.size, chunk_elems):
        chunk = sym[lo : lo + chunk_elems]
        n = chunk.size
        size = 4 * 4
        for k in range(4):
            lane = int(bits[chunk[k * n // 4 : (k + 1) * n // 4]].sum())
            size += ((lane + 7) // 8 + 7) // 8 * 8
        sizes.append(size)
    return np.array(sizes, dtype=np.int64)


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
            value = naive.payload_hash(bytes(buf[int(start) : int(end)]), c)
            at = table_at + c * entry + 4
            buf[at : at + 4] = value.to_bytes(4, "little")
    return fix_header_crc(bytes(buf))


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free now (for a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli_command(args, limit_bytes: int | None, limit_memory: int | None) -> list[str]:
    """``python -m comm_codec ARGS``, or the same through ``runpy`` after setting resource limits.

    The limits are set in the child before the package is imported rather than in a
    ``preexec_fn``, which is not safe in a test process that runs threads (numba, torch).
    """
    args = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in args]
    if limit_bytes is None and limit_memory is None:
        return [sys.executable, "-m", "comm_codec", *args]
    limits = []
    if limit_bytes is not None:
        limits.append(f"resource.setrlimit(resource.RLIMIT_FSIZE, ({int(limit_bytes)}, {int(limit_bytes)}))")
    if limit_memory is not None:
        limits.append(f"resource.setrlimit(resource.RLIMIT_AS, ({int(limit_memory)}, {int(limit_memory)}))")
    code = "; ".join(
        ["import resource, runpy", *limits, "runpy.run_module('comm_codec', run_name='__main__', alter_sys=True)"]
    )
    return [sys.executable, "-c", code, *args]


def _cli_env(env: dict | None) -> dict:
    """The environment for a CLI subprocess: this one, with ``env`` applied (a None value removes a
    variable) and this checkout first on PYTHONPATH, so the package under test runs from any cwd."""
    out = dict(os.environ)
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = str(value)
    path = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != REPO]
    out["PYTHONPATH"] = os.pathsep.join([REPO, *path])
    return out


def run_cli(
    *args,
    cwd=None,
    env: dict | None = None,
    timeout: float | None = 120,
    input: str | None = None,
    limit_bytes: int | None = None,
    limit_memory: int | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python -m comm_codec ARGS`` (the ``comm-codec`` command) and return its outcome.

    Args:
        args: command-line arguments; paths and numbers are turned into strings.
        cwd: working directory (default: the repository root).
        env: variables to set (or, with the value None, remove) over this process's environment.
        timeout: seconds before ``subprocess.TimeoutExpired`` (None: no limit).
        input: text for the command's stdin (default: none, stdin is closed).
        limit_bytes: largest file the command may write (``RLIMIT_FSIZE``): a bigger write fails
            with ``File too large``.
        limit_memory: the command's address-space limit in bytes (``RLIMIT_AS``).

    Returns:
        The completed process, with ``returncode``, and ``stdout`` and ``stderr`` as text.
    """
    return subprocess.run(
        _cli_command(args, limit_bytes, limit_memory),
        cwd=REPO if cwd is None else cwd,
        env=_cli_env(env),
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_cli(
    *args, cwd=None, env: dict | None = None, limit_bytes: int | None = None, limit_memory: int | None = None
) -> subprocess.Popen:
    """Start ``python -m comm_codec ARGS`` without waiting (to signal it, or watch its files).

    Arguments as for :func:`run_cli`; stdout and stderr are text pipes, stdin is closed.
    """
    return subprocess.Popen(
        _cli_command(args, limit_bytes, limit_memory),
        cwd=REPO if cwd is None else cwd,
        env=_cli_env(env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_crafted(cases: list, work, allowed: list[str], timeout: float = 300) -> list[dict]:
    """Run CLI cases in one child that watches them (``tests/crafted.py``); return one result per case.

    Args:
        cases: argv lists for ``comm-codec``.
        work: the directory the child runs in (the spec and results are written there).
        allowed: path prefixes the cases may open; any other open is reported.
        timeout: seconds for the whole child.

    Returns:
        Per case: ``rc``, ``stderr``, ``rss_mb``, ``seconds`` and what it opened outside ``allowed``.
    """
    import json

    spec = os.path.join(work, "cases.json")
    with open(spec, "w", encoding="utf-8") as fh:
        json.dump({"cases": cases, "allowed": allowed}, fh)
    results = os.path.join(work, "r.json")
    r = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "crafted.py"), spec, results],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=work,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    with open(results, encoding="utf-8") as fh:
        return json.load(fh)


def error_text(fn) -> str:
    """Run fn; return "Type: message" of the ValueError or RuntimeError it raised, or "no error"."""
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def join_deepspeed(rank: int, world: int) -> None:
    """Hand DeepSpeed the gloo group a dist_utils rank has already joined (it wants the variables set)."""
    import deepspeed

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="1"
    )
    deepspeed.init_distributed(dist_backend="gloo")


def slow_but(quick, *axes):
    """Every combination of parametrize axes as ``pytest.param`` cases, each marked ``slow``
    unless its id is in ``quick`` (the quick tier keeps a few cases of a large product).

    Args:
        quick: the ids of the cases the quick tier runs.
        axes: each a list of ``(value, id)``; a case's values and id ("sum-bf16-world2")
            follow the order of the axes, so the argnames must too.

    Returns:
        A list of ``pytest.param`` for ``pytest.mark.parametrize``.

    Raises:
        ValueError: an id in ``quick`` names no case (a renamed axis value).
    """
    import itertools

    import pytest

    cases = []
    for combo in itertools.product(*axes):
        case_id = "-".join(i for _, i in combo)
        marks = () if case_id in quick else (pytest.mark.slow,)
        cases.append(pytest.param(*(v for v, _ in combo), id=case_id, marks=marks))
    unknown = set(quick) - {c.id for c in cases}
    if unknown:
        raise ValueError(f"slow_but: no case has the id(s) {sorted(unknown)}")
    return cases


def launch_script(name: str):
    """Import ``launch_scripts/<name>.py`` (the lab tools that are not installed with the package).

    Args:
        name: the module's file name without ``.py``.

    Returns:
        The module, loaded once per process under ``name``.
    """
    import importlib.util
    from pathlib import Path

    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "launch_scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module
