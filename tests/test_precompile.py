"""After `comm-codec precompile`, no public path compiles anything; before it, the wait is said first.

Each test runs fresh interpreters on an empty numba cache of its own (NUMBA_CACHE_DIR), so
that what they see is what a new install sees. numba's own compile events are the
witness: a compile is an event, a cache load is none.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.cli

# Every public path, in a fresh process: which numba functions it compiled, one per line.
_EVERY_PATH = textwrap.dedent("""
    import logging, os, sys, tempfile
    from numba.core import event

    compiled = []

    class Witness(event.Listener):
        def on_start(self, ev):
            d = ev.data["dispatcher"]
            compiled.append(f"{d.py_func.__module__}.{d.py_func.__name__}{tuple(str(a) for a in ev.data['args'])}")

        def on_end(self, ev):
            pass

    event.register("numba:compile", Witness())

    import torch
    import comm_codec as cc
    from comm_codec import checkpoint
    from comm_codec.checkpoint import lossy

    g = torch.Generator().manual_seed(1)
    for dtype in cc.SUPPORTED_DTYPES:
        for n in (5, 1000, 50000, 300000):
            x = torch.randn(n, generator=g) * 1e-2
            x[n // 3: n // 2] = 0
            x = x.to(dtype) if dtype.is_floating_point else (x * 1e3).round().clamp(-100, 100).to(torch.int8).view(dtype)
            for codec in (cc.Codec(), cc.Codec(threads=1), cc.Codec(threads=2), cc.Codec(chunk_elems=4096, threads=2)):
                frame = codec.encode(x, "gradient")
                assert torch.equal(codec.decode(frame).view(torch.uint8), x.view(torch.uint8))
                if dtype in (torch.bfloat16, torch.float16, torch.float32):
                    acc = torch.ones(n)
                    codec.decode_accumulate(frame, acc)
        prof = cc.WarmupProfiler()
        prof.observe(x, kind="gradient")
        prof.build()

    d = tempfile.mkdtemp()
    sd = {"w": torch.randn(700, 900, generator=g).to(torch.bfloat16), "b": torch.randn(900, generator=g),
          "h": torch.randn(5000, generator=g).half(), "i": torch.arange(4000, dtype=torch.int8)}
    torch.save(sd, f"{d}/a.pt")
    sd["w"][::7] += 1
    torch.save(sd, f"{d}/b.pt")
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in sd.items()}, f"{d}/c.safetensors")
    for threads in (1, 2):
        checkpoint.compress_file(f"{d}/a.pt", f"{d}/a.cc", threads=threads, force=True)
        checkpoint.decompress_file(f"{d}/a.cc", f"{d}/a.out", threads=threads, force=True)
        checkpoint.compress_file(f"{d}/b.pt", f"{d}/b.cc", base=f"{d}/a.pt", threads=threads, force=True)
        checkpoint.decompress_file(f"{d}/b.cc", f"{d}/b.out", base=f"{d}/a.pt", threads=threads, force=True)
        checkpoint.compress_file(f"{d}/c.safetensors", f"{d}/c.cc", threads=threads, force=True)
        checkpoint.decompress_file(f"{d}/c.cc", f"{d}/c.out", threads=threads, force=True)
    lossy.compress_file(f"{d}/b.pt", f"{d}/b.ccl")
    lossy.decompress_file(f"{d}/b.ccl", f"{d}/b.lossy.pt")

    import torch.distributed.checkpoint as dcp
    import comm_codec.dcp
    dcp.save({"w": sd["w"], "b": sd["b"]}, storage_writer=comm_codec.dcp.Writer(f"{d}/dcp"))
    back = {"w": torch.empty_like(sd["w"]), "b": torch.empty_like(sd["b"])}
    dcp.load(back, storage_reader=comm_codec.dcp.Reader(f"{d}/dcp"))
    assert torch.equal(back["w"].view(torch.int16), sd["w"].view(torch.int16))

    print("COMPILED", len(compiled))
    for line in compiled:
        print("  " + line)
""")


def _env(cache) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONUNBUFFERED="1", NUMBA_NUM_THREADS="2")
    env.pop("NUMBA_DEBUG_CACHE", None)
    return env


@pytest.mark.slow
def test_after_precompile_no_public_path_compiles(tmp_path):
    cache = tmp_path / "numba"
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "comm_codec", "precompile"],
        env=_env(cache),
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr
    seconds = time.perf_counter() - start
    assert "checkpoint" in run.stdout and "kernels ready" in run.stdout
    # The precompile itself says it is compiling, before it does, at WARNING.
    assert "comm_codec is compiling its numba kernels" in run.stderr

    every = subprocess.run(
        [sys.executable, "-c", _EVERY_PATH], env=_env(cache), capture_output=True, text=True, timeout=1200, cwd=tmp_path
    )
    assert every.returncode == 0, every.stderr[-4000:]
    assert "COMPILED 0" in every.stdout, f"compiled after a precompile of {seconds:.0f} s:\n{every.stdout}"
    assert "comm_codec is compiling" not in every.stderr


@pytest.mark.slow
def test_a_first_compile_is_said_before_it_is_waited_for(tmp_path):
    # An empty cache: the first encode compiles. The line must come before numba's first
    # compile event (numba's set-up before it takes seconds on a first use), within 2 s of
    # the first use, once for the whole wait, on stderr through the logging module's
    # last-resort handler.
    script = textwrap.dedent("""
        import sys, time, threading, torch
        from numba.core import event
        import comm_codec as cc
        said = []
        compiles = []

        class Witness(event.Listener):
            def on_start(self, ev):
                if ev.data["dispatcher"].py_func.__module__.startswith("comm_codec."):
                    compiles.append(time.perf_counter() - t0)

            def on_end(self, ev):
                pass

        event.register("numba:compile", Witness())

        class Stderr:
            def __init__(self, inner):
                self.inner = inner
            def write(self, s):
                if "comm_codec is compiling" in s:
                    said.append(time.perf_counter() - t0)
                return self.inner.write(s)
            def flush(self):
                self.inner.flush()

        sys.stderr = Stderr(sys.stderr)
        t0 = time.perf_counter()  # the wait: from the first use, imports done
        x = torch.randn(1000).to(torch.bfloat16)
        codec = cc.Codec(threads=1)
        assert torch.equal(codec.decode(codec.encode(x)).view(torch.int16), x.view(torch.int16))
        total = time.perf_counter() - t0
        print("SAID", len(said), said[0] if said else -1, compiles[0], total)
    """)
    run = subprocess.run(
        [sys.executable, "-c", script],
        env=_env(tmp_path / "numba"),
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    _, count, first, compile_start, total = run.stdout.split()[-5:]
    assert int(count) == 1, run.stderr
    assert 0 <= float(first) < float(compile_start), run.stdout
    assert float(first) < 2.0, run.stdout
    assert "`comm-codec precompile`" in run.stderr


@pytest.mark.unit
@pytest.mark.parametrize("name", ["plan_range", "encode_range", "decode_range", "encode_frame_into"])
def test_no_kernel_is_compiled_with_numba_parallel(name):
    # Threads share chunks through core.parallel: a parfor kernel would be compiled again
    # for every element type, for no speed a Python thread pool does not give.
    from comm_codec.kernels import decode, encode

    kernel = getattr(encode, name, None) or getattr(decode, name)
    assert not kernel.targetoptions.get("parallel")
