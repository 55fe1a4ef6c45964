"""Untrusted input and hostile environments: memory, disk and time bounded by what a file holds.

Crafted files are built with the project's own writer code and resealed (``tests/crafted.py``),
so every checksum holds and the readers are reached. Each test measures what a bound is
about (peak RSS of a child process, bytes written, files left) on a claim small enough to
stay cheap, and checks that a larger claim is refused before anything is written.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch
from safetensors.torch import save_file

from comm_codec import checkpoint as ck
from comm_codec.core import atomic
from helpers import REPO, run_cli

import crafted

_MB = 1 << 20
_GEN = torch.Generator().manual_seed(11)


def _weights(n, dtype=torch.bfloat16):
    return (torch.randn(n, generator=_GEN) * 0.02).to(dtype)


def _one_line_error(r) -> str:
    """Assert a CLI run failed with status 2 and one short line; return the line."""
    lines = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith("INFO ")]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr and len(lines[0]) < 1024, r.stderr[-2000:]
    return lines[0]


# -- temp files: exclusive, never through a symlink, names that fit -------------------------
def test_temp_names_fit_any_valid_output_name(tmp_path):
    src = tmp_path / "a.bin"
    src.write_bytes(os.urandom(5000))
    for name in ("x" * 220, "y" * 255, "é" * 127 + "z"):  # 255 bytes: the longest valid name
        assert len(os.fsencode(name)) <= 255
        ck.compress_file(src, tmp_path / name)
        ck.decompress_file(tmp_path / name, tmp_path / (name[:-1] + "r"))
        assert (tmp_path / (name[:-1] + "r")).read_bytes() == src.read_bytes()
        assert len(os.fsencode(atomic.temp_prefix(name))) + 12 <= atomic.NAME_MAX
    assert not [n for n in os.listdir(tmp_path) if atomic.TEMP_MARK in n]


def test_temp_file_is_never_written_through_a_planted_symlink(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    out = tmp_path / "books.json"
    tokens = iter(["0badf00d", "c0ffee00", "0badf00d", "c0ffee01"])
    monkeypatch.setattr(atomic.secrets, "token_hex", lambda n: next(tokens))
    planted = tmp_path / f"{atomic.temp_prefix(out.name)}0badf00d.tmp"
    planted.symlink_to(victim)
    atomic.atomic_write(out, b"{}")
    assert victim.read_bytes() == b"keep me"
    assert not out.is_symlink() and out.read_bytes() == b"{}"
    # The checkpoint writer's temp files are made the same way.
    src = tmp_path / "a.bin"
    src.write_bytes(os.urandom(3000))
    dst = tmp_path / "a.cckp"
    planted = tmp_path / f"{atomic.temp_prefix(dst.name)}0badf00d.tmp"
    planted.symlink_to(victim)
    ck.compress_file(src, dst)
    assert victim.read_bytes() == b"keep me" and not dst.is_symlink()


def test_atomic_write_leaves_nothing_on_error(tmp_path):
    with pytest.raises(OSError):
        atomic.atomic_write(tmp_path / "missing-dir" / "x", b"data")
    (tmp_path / "ro").mkdir()
    with pytest.raises(TypeError):
        atomic.atomic_write(tmp_path / "ro" / "x", 5)
    assert os.listdir(tmp_path / "ro") == []


# -- numba without a writable cache ----------------------------------------------------------
def test_every_command_works_without_a_writable_numba_cache(tmp_path):
    """A copy of the package where no cache can be written, even by root: ``__pycache__`` is a
    file beside every module, HOME and NUMBA_CACHE_DIR lie under /dev/null."""
    copy = tmp_path / "ro"
    shutil.copytree(os.path.join(REPO, "comm_codec"), copy / "comm_codec",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for folder, _, _ in os.walk(copy / "comm_codec"):
        open(os.path.join(folder, "__pycache__"), "w").close()
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(HOME="/dev/null", NUMBA_CACHE_DIR="/dev/null/numba", PYTHONPATH=f"{copy}{os.pathsep}{REPO}/tests",
               PYTHONDONTWRITEBYTECODE="1")
    src = tmp_path / "w.bin"  # opaque bytes: no kernel to compile (that takes minutes in memory)
    src.write_bytes(os.urandom(50_000))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "comm_codec", *map(str, args)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=240)

    r = cli("--version")
    assert r.returncode == 0 and "comm_codec" in r.stdout, r.stderr[-2000:]
    r = cli("compress", src, tmp_path / "w.cckp", "--threads", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("numba has no writable cache directory") == 1 and "Traceback" not in r.stderr
    for args in (("ls", tmp_path / "w.cckp"), ("verify", tmp_path / "w.cckp"),
                 ("decompress", tmp_path / "w.cckp", tmp_path / "w.out")):
        r = cli(*args)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stderr[-2000:])
    assert (tmp_path / "w.out").read_bytes() == src.read_bytes()
    # Every kernel module imports (each decorates its kernels), caching off.
    r = subprocess.run([sys.executable, "-c", "import comm_codec.core.codec, comm_codec.kernels.plan, "
                        "comm_codec.kernels.histogram; from comm_codec.kernels import jit; assert not jit.CACHING; "
                        "print(jit.cache_location())"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0 and "NUMBA_CACHE_DIR" in r.stdout, r.stderr[-2000:]
    assert not any(os.path.isdir(os.path.join(f, "__pycache__")) for f, _, _ in os.walk(copy))


def test_a_bad_numba_thread_setting_is_one_line():
    r = run_cli("precompile", env={"NUMBA_NUM_THREADS": "0"}, timeout=120)
    assert "NUMBA_NUM_THREADS" in _one_line_error(r)
