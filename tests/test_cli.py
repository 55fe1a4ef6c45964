"""CLI smoke tests: the real ``python -m comm_codec`` in a subprocess, exit codes and messages."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import comm_codec as cc

from helpers import run_cli

pytestmark = pytest.mark.cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_version_and_help():
    r = run_cli("--version")
    assert r.returncode == 0 and "comm_codec" in r.stdout
    r = run_cli("--help")
    assert r.returncode == 0
    for command in (
        "inspect",
        "bench",
        "profile",
        "demo",
        "compress",
        "decompress",
        "verify",
        "ls",
        "precompile",
        "warmup",
    ):
        assert command in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "args", [["--help"], ["--version"], ["no-such-command"], ["demo", "--bogus"], ["precompile", "--help"]]
)
def test_help_version_and_usage_errors_import_neither_torch_nor_numba(args):
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "comm_codec", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert r.returncode in (0, 2), r.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "numba"}


@pytest.mark.slow
@pytest.mark.parametrize("command", ["precompile", "warmup"])
def test_precompile_and_its_alias_warmup_print_a_table(command):
    r = run_cli(command, "--dtypes", "bf16", "--codec-only")
    assert r.returncode == 0, r.stderr
    assert "bf16" in r.stdout and "comm_codec kernels ready in" in r.stdout and "cache:" in r.stdout


def test_inspect_frame(tmp_path):
    frame = cc.Codec().encode(torch.randn(50000, dtype=torch.bfloat16) * 1e-3, kind="gradient")
    path = tmp_path / "g.ccf"
    frame.numpy().tofile(path)
    r = run_cli("inspect", str(path))
    assert r.returncode == 0, r.stderr
    assert "bf16, 50000 elements (100000 bytes raw)" in r.stdout
    assert "stream 1    book raw" in r.stdout
    assert "exponents" not in r.stdout
    frame = cc.Codec().encode(torch.randn(50000, dtype=torch.float16) * 1e-3, kind="gradient")
    frame.numpy().tofile(path)
    r = run_cli("inspect", str(path))
    assert r.returncode == 0, r.stderr
    assert "comm_codec v3" in r.stdout
    assert "exponents   split: stream 0 codes the exponent alone, the 3 bits under it raw" in r.stdout


@pytest.mark.slow
def test_inspect_errors(tmp_path):
    r = run_cli("inspect", str(tmp_path / "missing"))
    assert r.returncode == 2 and "No such file or directory" in r.stderr and "Traceback" not in r.stderr
    junk = tmp_path / "junk"
    junk.write_bytes(b"hello world, not a frame at all")
    r = run_cli("inspect", str(junk))
    assert r.returncode == 2 and "not a comm_codec checkpoint or frame" in r.stderr


def test_unknown_option_is_a_usage_error():
    r = run_cli("inspect", "--bogus", "x")
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr


@pytest.mark.slow
def test_bench_quick_synthetic_prints_a_table():
    r = run_cli("bench", "--quick", "--skip-real", timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "comm_codec" in r.stdout and "zstd" in r.stdout


@pytest.mark.slow
def test_profile_checkpoint(tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "w.safetensors"
    save_file(
        {"a.weight": torch.randn(20000, dtype=torch.bfloat16) * 0.02, "b.weight": torch.randn(300, 40) * 0.02}, str(src)
    )
    out = tmp_path / "books.json"
    r = run_cli("profile", "--checkpoint", str(src), "--out", str(out))
    assert r.returncode == 0, r.stderr
    books = cc.CodebookSet.load(out)
    assert ("weight", "bf16", 0) in books and ("weight", "fp32", 0) in books
    assert "weight" in r.stdout and "entropy" in r.stdout and "chunk bits" in r.stdout
    # --max-books 1: single books, whose ids are the groups' first books.
    r = run_cli("profile", "--checkpoint", str(src), "--out", str(tmp_path / "one.json"), "--max-books", "1")
    assert r.returncode == 0, r.stderr
    single = cc.CodebookSet.load(tmp_path / "one.json")
    assert all(len(g) == 1 for _, g in single.groups())
    assert [b.id for _, b in single.items()] == [b.id for _, b in books.items()]


@pytest.mark.slow
def test_profile_entry_with_holdout(tmp_path):
    (tmp_path / "my_entry.py").write_text(
        textwrap.dedent("""
        import torch
        def train(prof, steps):
            torch.manual_seed(0)
            for step in range(steps):
                prof.observe(torch.randn(30000, dtype=torch.bfloat16) * 1e-3, "gradient")
                prof.step()
    """)
    )
    out = tmp_path / "books.json"
    r = run_cli(
        "profile", "--entry", "my_entry:train", "--steps", "2", "--holdout", "2", "--out", str(out), cwd=str(tmp_path)
    )
    assert r.returncode == 0, r.stderr
    assert "held-out steps" in r.stdout and "vs per-step opt" in r.stdout
    assert ("gradient", "bf16", 0) in cc.CodebookSet.load(out)


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["profile"], "give exactly one of --entry module:function or --checkpoint FILE"),
        (["profile", "--entry", "nomodule_xyz:f"], "cannot import 'nomodule_xyz'"),
        (["profile", "--entry", "badformat"], "--entry must be module:function"),
        (["profile", "--checkpoint", "/nonexistent/file.safetensors"], "No such file or directory"),
        (["profile", "--checkpoint", "x.safetensors", "--max-books", "0"], "max_books must be in 1..16, got 0"),
    ],
)
def test_profile_errors(args, message):
    r = run_cli(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_inspect_lists_a_compressed_checkpoint_and_survives_a_closed_pipe(tmp_path):
    from safetensors.torch import save_file

    from comm_codec import checkpoint

    src, dst = tmp_path / "w.safetensors", tmp_path / "w.cckp"
    save_file({f"layer{i}.weight": torch.randn(64, 64) * 0.02 for i in range(40)}, str(src))
    checkpoint.compress_file(str(src), str(dst))
    r = run_cli("inspect", str(dst))
    assert r.returncode == 0, r.stderr
    assert "layer0.weight" in r.stdout and "layer39.weight" in r.stdout
    # A reader that stops early (| head) must not produce a traceback.
    p = subprocess.run(
        f"{sys.executable} -m comm_codec inspect {dst} | head -1",
        shell=True,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in p.stderr and p.stdout.count("\n") == 1


@pytest.mark.slow
def test_profile_plot_draws_a_png(tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "w.safetensors"
    save_file({"a.weight": torch.randn(20000, dtype=torch.bfloat16) * 0.02}, str(src))
    png = tmp_path / "books.png"
    r = run_cli("profile", "--checkpoint", str(src), "--out", str(tmp_path / "b.json"), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


# -- checkpoint commands: one-line errors, --force, --threads, help text --------------
def _one_safetensors(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.randn(4096, dtype=torch.float32)}, tmp_path / "m.safetensors")
    return tmp_path / "m.safetensors"


@pytest.mark.slow
def test_a_file_that_is_neither_gets_one_message_from_every_command(tmp_path):
    src = str(_one_safetensors(tmp_path))
    errors = set()
    for argv in (["inspect", src], ["ls", src], ["verify", src], ["decompress", src, str(tmp_path / "o")]):
        r = run_cli(*argv)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        errors.add(r.stderr.strip())
    assert errors == {
        f"comm-codec: error: {src}: not a comm_codec checkpoint or frame (bad magic): give a file "
        "written by `comm-codec compress` (or a codec frame, for inspect)"
    }
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_existing_output_needs_force_and_a_compressed_input_is_refused(tmp_path):
    src = _one_safetensors(tmp_path)
    dst = tmp_path / "m.cckp"
    dst.write_bytes(b"keep me")
    r = run_cli("compress", str(src), str(dst))
    assert r.returncode == 2 and f"{dst} exists; pass --force to replace it" in r.stderr
    assert dst.read_bytes() == b"keep me"
    r = run_cli("compress", str(src), str(dst), "--force", "--threads", "999")
    assert r.returncode == 0, r.stderr
    cores = len(os.sched_getaffinity(0))
    assert f"--threads 999 is more than the {cores} cores this process may use; using {cores}" in r.stderr
    assert "GB/s (original bytes over this call's wall time, start-up excluded)" in r.stdout
    r = run_cli("decompress", str(dst), str(src))
    assert r.returncode == 2 and "exists; pass --force" in r.stderr
    r = run_cli("compress", str(dst), str(tmp_path / "again.cckp"))
    assert r.returncode == 2 and "is already a comm_codec checkpoint; compressing it again" in r.stderr
    assert not (tmp_path / "again.cckp").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "command,words",
    [
        ("inspect", "Describe a comm_codec file"),
        ("verify", "check every checksum"),
        ("ls", "Print FILE's index"),
        ("compress", "keeps the source's permission bits"),
    ],
)
def test_checkpoint_commands_have_help_text(command, words):
    r = run_cli(command, "--help")
    assert r.returncode == 0 and words in " ".join(r.stdout.split()), r.stdout


@pytest.mark.slow
def test_a_sharded_directory_round_trips_through_the_command(tmp_path):
    """The real command on an HF-style sharded directory: one line per file, one summary, and the
    restored tree byte for byte (the library side is tests/test_directories.py)."""
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    src.mkdir()
    for i in (1, 2):
        save_file({f"l{i}.weight": torch.randn(128, 128).bfloat16()}, src / f"model-0000{i}-of-00002.safetensors")
    (src / "model.safetensors.index.json").write_text('{"weight_map": {"l1.weight": "model-00001-of-00002"}}')
    out, back = tmp_path / "hf.cckp", tmp_path / "back"
    r = subprocess.run(
        f"{sys.executable} -m comm_codec compress {src} --threads 2 && "
        f"{sys.executable} -m comm_codec decompress {out} {back} -q",
        shell=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("compressed a directory of 3 files: 2 compressed, 1 copied")
    assert sorted(os.listdir(out)) == [
        "model-00001-of-00002.safetensors.cckp",
        "model-00002-of-00002.safetensors.cckp",
        "model.safetensors.index.json",
    ]
    assert {p.name: p.read_bytes() for p in back.iterdir()} == {p.name: p.read_bytes() for p in src.iterdir()}
