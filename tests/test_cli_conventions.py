"""The command line as a zstd user expects it: default names, several inputs, - for streams,
-q/--progress, --codebooks, usage errors in the subcommand's words, one size convention;
and what profile, bench and ls say about a checkpoint's tensors (the same as compress).

Most checks run ``comm_codec.tools.cli.main`` in this process (each subprocess costs seconds of
start-up); streams are real pipes and a terminal a real pty, in this process too."""

from __future__ import annotations

import argparse
import os
import pty
import sys
import threading

import pytest
import torch

import comm_codec as cc
from comm_codec import checkpoint as ck
from comm_codec.checkpoint.report import human_bytes
from comm_codec.tools import cli

pytestmark = pytest.mark.unit


@pytest.fixture
def files(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    save_file(
        {"w": (torch.randn(1 << 20, generator=g) * 0.02).bfloat16(), "b": torch.randn(3000, generator=g)},
        tmp_path / "a.safetensors",
    )
    torch.save(
        {
            "model_state_dict": {"l.weight": torch.randn(200, 200, generator=g)},
            "state_dict": {"lightning.weight": torch.randn(200, 100, generator=g).half()},
            "optimizer_state_dict": {"state": {0: {"exp_avg": torch.randn(200, 200, generator=g)}}},
        },
        tmp_path / "b.pt",
    )
    (tmp_path / "empty").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _bytes(path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


def test_default_names_several_inputs_quiet_progress_and_empty_files(files, capsys):
    assert cli.main(["compress", "a.safetensors"]) == 0
    assert os.path.isfile("a.safetensors.cckp") and "ratio 1." in capsys.readouterr().out
    assert cli.main(["compress", "-m", "-q", "b.pt", "empty"]) == 0
    out = capsys.readouterr()
    assert out.out == "" and os.path.isfile("b.pt.cckp") and os.path.isfile("empty.cckp")
    # Back to the original names, refusing to replace them or to guess a name.
    assert cli.main(["decompress", "a.safetensors.cckp"]) == 2
    assert "a.safetensors exists; pass --force to replace it" in capsys.readouterr().err
    os.mkdir("orig")
    for name in ("a.safetensors", "b.pt", "empty"):
        os.rename(name, f"orig/{name}")
    assert cli.main(["decompress", "-m", "a.safetensors.cckp", "b.pt.cckp", "empty.cckp"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in ("a.safetensors", "b.pt", "empty"):
        assert _bytes(name) == _bytes(f"orig/{name}")
    assert cli.main(["decompress", "orig/b.pt"]) == 2
    assert "its name does not end in .cckp; give DST" in capsys.readouterr().err
    assert cli.main(["compress", "a.safetensors", "b.pt", "empty"]) == 2
    assert "for several inputs pass -m" in capsys.readouterr().err
    # An empty original has no ratio; it does not print one of 0.
    assert "empty original, no ratio" in lines[-1] and "ratio 0.000" not in lines[-1]
    assert cli.main(["ls", "empty.cckp"]) == 0
    assert "0.000" not in capsys.readouterr().out
    # --progress forces the meter on a non-terminal stderr (it clears its line at the end); -q keeps it off.
    assert cli.main(["compress", "--progress", "--force", "a.safetensors"]) == 0
    assert "\r\033[K" in capsys.readouterr().err
    assert cli.main(["compress", "-q", "--force", "a.safetensors"]) == 0
    assert capsys.readouterr().err == ""


def test_codebooks_base_of_a_compressed_file_usage_errors_and_sizes(files, capsys):
    cc.CodebookSet({}).save("none.json")
    assert cli.main(["compress", "a.safetensors", "own.cckp", "--codebooks", "none.json", "-q"]) == 0
    assert cli.main(["compress", "a.safetensors", "shipped.cckp", "-q"]) == 0
    assert cli.main(["ls", "own.cckp", "shipped.cckp"]) == 0
    own, shipped = capsys.readouterr().out.split("\n\n")
    assert "0 shipped" in own and "shipped weight/bf16/0" not in own
    # A shipped book or group by its name, not as "own".
    assert "shipped weight/bf16/0" in shipped and "own x" not in shipped
    # --base may be the .cckp compressed from the previous checkpoint.
    assert cli.main(["compress", "a.safetensors", "d.cckp", "--base", "shipped.cckp", "-q"]) == 0
    assert cli.main(["decompress", "d.cckp", "d.out"]) == 2
    assert "or the compressed file made from it, as base (--base)" in capsys.readouterr().err
    assert cli.main(["decompress", "d.cckp", "d.out", "--base", "shipped.cckp", "-q"]) == 0
    assert _bytes("d.out") == _bytes("a.safetensors")
    with pytest.raises(SystemExit):
        cli.main(["compress", "--help"])
    assert ".cckp compressed from it" in " ".join(capsys.readouterr().out.split())
    # A usage error names the subcommand's usage, not the top level's.
    with pytest.raises(SystemExit) as exc:
        cli.main(["compress", "--frobnicate", "a", "b"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("usage: comm-codec compress")
    assert "comm-codec compress: error: unrecognized arguments: --frobnicate" in err
    # One convention: decimal units, one decimal.
    assert [human_bytes(n) for n in (14_000_000, 30_700_000, 999, 1500, 2 * 10**9)] == [
        "14.0 MB",
        "30.7 MB",
        "999 B",
        "1.5 kB",
        "2.0 GB",
    ]


def test_the_api_refuses_an_existing_output_when_force_is_false(files):
    ck.compress_file("a.safetensors", "x.cckp")
    with pytest.raises(FileExistsError, match="x.cckp exists"):
        ck.compress_file("a.safetensors", "x.cckp")  # the default refuses it, as the command line does
    ck.compress_file("a.safetensors", "x.cckp", force=True)
    with open("out", "wb") as fh:
        fh.write(b"keep")
    with pytest.raises(FileExistsError, match="out exists"):
        ck.decompress_file("x.cckp", "out", force=False)
    assert _bytes("out") == b"keep"
    os.symlink("nowhere", "dangling")
    with pytest.raises(FileExistsError):
        ck.decompress_file("x.cckp", "dangling", force=False)


def test_profile_bench_and_compress_see_the_same_tensors_and_kinds(files):
    from comm_codec.tools import bench_data, profiling

    ck.compress_file("b.pt", "b.cckp")
    recorded = {t["name"]: t["kind"] for t in ck.read_index("b.cckp")["tensors"] if t["coding"] == "frame"}
    found = {name: kind for name, kind, _ in profiling.checkpoint_tensors("b.pt")}
    assert found == recorded
    assert found == {
        "model_state_dict.l.weight": "weight",
        "state_dict.lightning.weight": "weight",
        "optimizer_state_dict.state.0.exp_avg": "optimizer_state",
    }
    books = profiling.profile_checkpoint("b.pt").build()
    assert ("weight", "fp16", 0) in books and ("optimizer_state", "fp32", 0) in books
    args = argparse.Namespace(pretrained=[], model=["b.pt"], bulk_mb=0.25)
    rows = {(d.name, d.spec_name) for d in bench_data.pretrained_datasets(args)}
    # The file's own dtypes (fp16 rows included), then its weights cast to bf16.
    assert rows == {
        ("file:b/weight", "fp16"),
        ("file:b/weight", "fp32"),
        ("file:b/optimizer_state", "fp32"),
        ("file:b/weight", "bf16"),
    }


def _pipe_in(data: bytes):
    """A real pipe whose read end is returned as a text stream (with .buffer), fed by a thread."""
    r, w = os.pipe()

    def feed():
        with os.fdopen(w, "wb") as fh:
            fh.write(data)

    threading.Thread(target=feed, daemon=True).start()
    return os.fdopen(r, "r")


def _pipe_out():
    """A real pipe: (its write end as a text stream, a function returning all that was written)."""
    r, w = os.pipe()
    got, done = [], threading.Event()

    def drain():
        with os.fdopen(r, "rb") as fh:
            got.append(fh.read())
        done.set()

    threading.Thread(target=drain, daemon=True).start()
    out = os.fdopen(w, "w")

    def result() -> bytes:
        out.close()
        done.wait(60)
        return got[0]

    return out, result


def test_streams_through_real_pipes_and_a_terminal_is_refused(files, monkeypatch, capfd):
    """stdin and stdout are pipes (no seeking): stdin is spooled to a temp file, stdout gets the bytes."""
    original = _bytes("a.safetensors")
    out, packed = _pipe_out()
    monkeypatch.setattr(sys, "stdin", _pipe_in(original))
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main(["compress", "-", "-"]) == 0
    compressed = packed()
    assert compressed[: len(ck.MAGIC)] == ck.MAGIC
    with open("s.cckp", "wb") as fh:
        fh.write(compressed)
    out, restored = _pipe_out()
    monkeypatch.setattr(sys, "stdin", _pipe_in(compressed))
    monkeypatch.setattr(sys, "stdout", out)
    assert cli.main(["decompress", "-", "-"]) == 0
    assert restored() == original
    err = capfd.readouterr().err
    assert "compressed 2.1 MB -> " in err and "decompressed " in err  # summaries on stderr, data on stdout
    assert not [n for n in os.listdir(files) if "comm_codec-tmp" in n]
    # A terminal (a real pty) as stdout is refused, as zstd refuses it.
    master, slave = pty.openpty()
    tty = os.fdopen(slave, "w")
    try:
        monkeypatch.setattr(sys, "stdout", tty)
        assert cli.main(["decompress", "s.cckp", "-"]) == 2
    finally:
        monkeypatch.undo()
        tty.close()
        os.close(master)
    assert "refusing to write a decompressed checkpoint to a terminal" in capfd.readouterr().err


def test_ls_lists_every_entry_and_which_share_a_storage(tmp_path, capsys):
    # An LSTM's weights and views of them: five state-dict entries on two storages.
    g = torch.Generator().manual_seed(9)
    flat = torch.randn(4 * 64 * 32, generator=g)
    sd = {
        "lstm.weight_ih_l0": flat.view(4 * 64, 32),
        "lstm.gates.i": flat[: 64 * 32].view(64, 32),
        "lstm.gates.f": flat[64 * 32 : 2 * 64 * 32].view(64, 32),
        "lstm.flat": flat,
        "bias": torch.randn(256, generator=g),
    }
    torch.save(sd, tmp_path / "lstm.pt")
    assert cli.main(["compress", "-q", str(tmp_path / "lstm.pt"), str(tmp_path / "lstm.cckp")]) == 0
    capsys.readouterr()
    assert cli.main(["ls", str(tmp_path / "lstm.cckp")]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("lstm.", "bias"))}
    assert set(rows) == set(sd), out
    assert "64x32" in rows["lstm.gates.f"] and "8192" in rows["lstm.flat"]
    for name in ("lstm.gates.i", "lstm.gates.f", "lstm.flat"):
        assert "shares the storage of lstm.weight_ih_l0" in rows[name], out
    assert "shares" not in rows["bias"] and "shares" not in rows["lstm.weight_ih_l0"]
    assert "5 entries on 2 storages" in out
    # The restored file is still the original, byte for byte.
    assert cli.main(["decompress", "-q", str(tmp_path / "lstm.cckp"), str(tmp_path / "back.pt")]) == 0
    assert _bytes(tmp_path / "back.pt") == _bytes(tmp_path / "lstm.pt")


@pytest.mark.slow
def test_the_program_sets_numba_up_without_blas_and_leaves_scipy_importable(tmp_path):
    """The command line keeps numba from importing scipy.linalg to look for BLAS (no kernel
    does linear algebra); scipy.linalg still imports afterwards, the kernels still run, and
    the program (console_main, with its frozen exit) returns main's status."""
    code = (
        "import sys\n"
        "from comm_codec.tools import cli\n"
        "cli._numba_without_blas()\n"
        "import numba.np.arraymath as am\n"
        "assert not am._HAVE_BLAS and 'scipy.linalg' not in sys.modules\n"
        "import scipy.linalg\n"
        "assert not any(isinstance(f, cli._Refuse) for f in sys.meta_path)\n"
        f"sys.argv = ['comm-codec', 'compress', {str(tmp_path / 'a.bin')!r}, {str(tmp_path / 'a.cckp')!r}]\n"
        "sys.exit(cli.console_main())\n"
    )
    (tmp_path / "a.bin").write_bytes(os.urandom(1000) * 20)
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "compressed 20.0 kB" in done.stdout
    back = tmp_path / "a.out"
    assert cli.main(["decompress", str(tmp_path / "a.cckp"), str(back), "-q"]) == 0
    assert back.read_bytes() == (tmp_path / "a.bin").read_bytes()


def test_the_program_loads_cached_kernels_without_numbas_setup_and_still_compiles(tmp_path):
    """The command line loads kernels from numba's cache without numba's typing and lowering
    set-up (none of it is used by cached machine code); a function compiled afterwards
    still gets all of it, from numba's compiler."""
    code = (
        "import sys\n"
        "import numpy as np\n"
        "from comm_codec.tools import cli\n"
        "cli._numba_without_blas()\n"
        "cli._numba_without_extensions()\n"
        "cli._numba_cache_loads_without_setup()\n"
        "cli._numba_cache_loads_without_setup()\n"  # twice: patched once
        f"assert cli.main(['compress', '-q', {str(tmp_path / 'a.bin')!r}, {str(tmp_path / 'a.cckp')!r}]) == 0\n"
        f"assert cli.main(['decompress', '-q', {str(tmp_path / 'a.cckp')!r}, {str(tmp_path / 'a.out')!r}]) == 0\n"
        "assert 'numba.typed.typeddict' not in sys.modules and 'numba.np.random.generator_core' not in sys.modules\n"
        "import numba\n"
        "@numba.njit\n"
        "def f(n):\n"
        "    d = {}\n"
        "    a = np.sort(np.random.random(n))\n"
        "    for i in range(n):\n"
        "        d[i] = a[i]\n"
        "    return len(d), a[0] <= a[-1]\n"
        "assert f(10) == (10, True)\n"
        "print('OK')\n"
    )
    (tmp_path / "a.bin").write_bytes(os.urandom(1000) * 20)
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "OK" in done.stdout
    assert (tmp_path / "a.out").read_bytes() == (tmp_path / "a.bin").read_bytes()
