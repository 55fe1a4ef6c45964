"""Untrusted input, round 3: directory trees that change while they are read (issue 46, #4, #9, #10).

The races are made deterministic: ``comm_codec.checkpoint.walk.before_open`` stops the
run between the walk and the open of one entry, the test swaps the entry (a directory for
a symlink, a file for a symlink to an outside file, for a FIFO, for another file), and the
run goes on. Each must fail with one CheckpointError naming the entry, never follow the
link, never wait on the FIFO, and leave no output behind. Stale temp files are swept once
per directory per run, never a name the run writes or copies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from comm_codec.checkpoint import directory, files, walk
from comm_codec.checkpoint.errors import CheckpointError
from comm_codec.checkpoint.files import temp_name

pytestmark = pytest.mark.unit


def _files(root) -> dict:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as fh:
                    out[os.path.relpath(path, root)] = fh.read()
    return out


@pytest.fixture
def tree(tmp_path):
    """A small tree (a checkpoint file and plain files, one level down) and a secret outside it."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    save_file(
        {"w": (torch.randn(4096, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()}, src / "m.safetensors"
    )
    (src / "a.txt").write_bytes(b"plain a")
    (src / "sub" / "b.txt").write_bytes(b"plain b")
    secret = tmp_path / "outside"
    secret.mkdir()
    (secret / "b.txt").write_bytes(b"SECRET, never read through a link")
    (secret / "key").write_bytes(b"SECRET, never read through a link")
    return src, secret


@pytest.fixture
def stop_at(monkeypatch):
    """Install a swap to run once, when the run is about to open ``rel``."""

    def install(rel, swap):
        done = []

        def hook(seen):
            if seen == rel and not done:
                done.append(seen)
                swap()

        monkeypatch.setattr(walk, "before_open", hook)
        return done

    return install


@pytest.fixture(autouse=True)
def _alarm():
    """A hang fails the test instead of stopping the run (the FIFO case)."""

    def timeout(*_):
        raise TimeoutError("hung")

    old = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(120)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _swap_for_link(path, target):
    def swap():
        os.rename(path, str(path) + ".moved")
        os.symlink(target, path)

    return swap


def _swap_for_fifo(path):
    def swap():
        os.unlink(path)
        os.mkfifo(path)

    return swap


def _swap_for_copy(path):
    def swap():
        data = Path(path).read_bytes()
        with open(str(path) + ".new", "wb") as fh:  # made while the old one exists: another inode
            fh.write(data)
        os.rename(str(path) + ".new", path)

    return swap


@pytest.mark.parametrize(
    "rel,make_swap,shows",
    [
        (
            "sub/b.txt",
            lambda src, secret: _swap_for_link(src / "sub", secret),
            "sub changed while the directory was read",
        ),
        ("a.txt", lambda src, secret: _swap_for_link(src / "a.txt", secret / "key"), "a.txt changed"),
        (
            "m.safetensors",
            lambda src, secret: _swap_for_link(src / "m.safetensors", secret / "key"),
            "m.safetensors changed",
        ),
        (
            "a.txt",
            lambda src, secret: _swap_for_fifo(src / "a.txt"),
            "a.txt changed while the directory was read: a FIFO",
        ),
        ("m.safetensors", lambda src, secret: _swap_for_fifo(src / "m.safetensors"), "a FIFO is there now"),
        ("a.txt", lambda src, secret: _swap_for_copy(src / "a.txt"), "another file is there now"),
    ],
    ids=[
        "dir-for-symlink",
        "file-for-symlink",
        "checkpoint-for-symlink",
        "file-for-fifo",
        "checkpoint-for-fifo",
        "file-for-another-file",
    ],
)
def test_an_entry_swapped_after_the_walk_is_refused_not_followed(tree, tmp_path, stop_at, rel, make_swap, shows):
    src, secret = tree
    done = stop_at(rel, make_swap(src, secret))
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=shows) as info:
        directory.compress_dir(src, out, threads=1)
    assert done, "the hook never ran: the race was not exercised"
    assert "\n" not in str(info.value) and len(str(info.value)) < 1024
    assert not os.path.exists(out), "a failed run leaves nothing behind"


@pytest.mark.parametrize("op", ["decompress", "verify", "ls"])
def test_a_compressed_member_swapped_for_a_fifo_or_link_is_refused(tree, tmp_path, stop_at, op):
    src, secret = tree
    mirror = tmp_path / "mirror"
    directory.compress_dir(src, mirror, threads=1)
    stop_at(
        "m.safetensors.cckp",
        _swap_for_fifo(mirror / "m.safetensors.cckp")
        if op != "ls"
        else _swap_for_link(mirror / "m.safetensors.cckp", secret / "key"),
    )
    call = {
        "decompress": lambda: directory.decompress_dir(mirror, tmp_path / "back", threads=1),
        "verify": lambda: directory.verify_dir(mirror, threads=1),
        "ls": lambda: directory.describe_dir(mirror),
    }[op]
    with pytest.raises(CheckpointError, match="m.safetensors.cckp changed while the directory was read"):
        call()
    assert not os.path.exists(tmp_path / "back")


def test_the_walk_reads_the_file_it_opened_not_the_name(tree, tmp_path, monkeypatch):
    """Once open, a file renamed away and replaced by a link is still the one read (one open per file)."""
    src, secret = tree
    opened = []
    real_open = walk.Tree.open_stat  # what the directory functions open files with (open calls it too)

    def open_then_swap(self, entry):
        got = real_open(self, entry)
        if entry.rel == "m.safetensors":
            _swap_for_link(src / "m.safetensors", secret / "key")()
            opened.append(entry.rel)
        return got

    monkeypatch.setattr(walk.Tree, "open_stat", open_then_swap)
    original = (src / "m.safetensors").read_bytes()
    directory.compress_dir(src, tmp_path / "out", threads=1)
    assert opened
    monkeypatch.undo()
    directory.decompress_dir(tmp_path / "out", tmp_path / "back", threads=1)
    assert (tmp_path / "back" / "m.safetensors").read_bytes() == original


def test_is_checkpoint_file_never_waits_on_a_fifo_nor_follows_a_link(tmp_path):
    os.mkfifo(tmp_path / "p")
    save_file({"w": torch.zeros(4)}, tmp_path / "m.safetensors")
    os.symlink(tmp_path / "m.safetensors", tmp_path / "link")
    assert not directory.is_checkpoint_file(str(tmp_path / "p"))
    assert not directory.is_checkpoint_file(str(tmp_path / "link"))
    assert directory.is_checkpoint_file(str(tmp_path / "m.safetensors"))


# -- stale temp files: swept once per directory, never a name the run writes ---------------------
def _dead_pid() -> int:
    return int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], check=True, capture_output=True, text=True
        ).stdout
    )


def test_a_file_named_like_a_dead_runs_temp_is_copied_and_restored(tree, tmp_path):
    src, _ = tree
    pid = _dead_pid()
    lookalikes = [temp_name("x", pid) + "abcdefgh.tmp", temp_name("m.safetensors.cckp", pid) + "zzzzzzzz.tmp"]
    for i, name in enumerate(lookalikes):
        (src / name).write_bytes(b"user data %d" % i)
        (src / "sub" / name).write_bytes(b"user data in sub %d" % i)
    mirror, back = tmp_path / "mirror", tmp_path / "back"
    directory.compress_dir(src, mirror, threads=2)
    directory.decompress_dir(mirror, back, threads=2)
    assert _files(back) == _files(src)
    # Written again into the existing outputs (--force): still every file.
    directory.compress_dir(src, mirror, threads=2, force=True)
    directory.decompress_dir(mirror, back, threads=2, force=True)
    assert _files(back) == _files(src)


def test_real_stale_temps_in_the_output_are_swept_once_per_directory(tree, tmp_path, monkeypatch):
    src, _ = tree
    for i in range(30):
        (src / "sub" / f"f{i}.txt").write_bytes(b"%d" % i)
    mirror = tmp_path / "mirror"
    (mirror / "sub").mkdir(parents=True)
    stale = temp_name("gone.cckp", _dead_pid()) + "abcdefgh.tmp"
    (mirror / "sub" / stale).write_bytes(b"a dead run's leftover")
    sweeps = []
    real = files.sweep_stale_temps
    monkeypatch.setattr(
        files, "sweep_stale_temps", lambda folder, keep=frozenset(): sweeps.append(folder) or real(folder, keep)
    )
    directory.compress_dir(src, mirror, threads=2, force=True)
    assert sorted(sweeps) == sorted({str(mirror), str(mirror / "sub")}), sweeps
    assert not os.path.exists(mirror / "sub" / stale)


# -- every path the user passed is printed escaped (#11) -------------------------------------------
_EVIL = "x\x1b]0;owned\x07\x1b[2J\nverified ok"


@pytest.mark.parametrize("kind", ["exact", "lossy", "frame"])
def test_ls_and_inspect_print_the_path_argument_escaped(tmp_path, kind, capsys):
    import comm_codec as cc
    from comm_codec.checkpoint import exact, lossy
    from comm_codec.tools import cli

    w = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 0.02
    path = tmp_path / (_EVIL + {"exact": ".cckp", "lossy": ".ccl", "frame": ".ccf"}[kind])
    if kind == "exact":
        save_file({"w": w.bfloat16()}, tmp_path / "m.safetensors")
        exact.compress_file(tmp_path / "m.safetensors", path, threads=1)
    elif kind == "lossy":
        torch.save({"model": {"w": w}}, tmp_path / "a.pt")
        lossy.compress_file(tmp_path / "a.pt", path, threads=1)
    else:
        path.write_bytes(bytes(cc.Codec().encode(w.bfloat16(), kind="weight").numpy()))
    for argv in (["inspect", str(path)], ["ls", str(path)]) if kind != "frame" else (["inspect", str(path)],):
        capsys.readouterr()
        assert cli.main(argv) == 0
        out, err = capsys.readouterr()
        assert "\x1b" not in out + err and "\x07" not in out + err, (argv[0], out)
        assert "\\x1b]0;owned\\x07\\x1b[2J\\x0averified ok" in out, (argv[0], out)
        assert not any(line.startswith("verified ok") for line in out.splitlines())


# -- a lossy delta read from stdin finds its base in the working directory ------------------------
def test_decompress_of_a_lossy_delta_from_stdin_looks_for_its_base_in_the_working_directory(
    tmp_path, monkeypatch, capsys
):
    import io

    from comm_codec.checkpoint import lossy
    from comm_codec.tools import cli

    g = torch.Generator().manual_seed(5)
    w = torch.randn(20_000, generator=g) * 0.02
    torch.save({"model": {"w": w}}, tmp_path / "a.pt")
    torch.save({"model": {"w": w + 1e-3}}, tmp_path / "b.pt")
    lossy.compress_file(tmp_path / "a.pt", tmp_path / "a.ccl", threads=1)
    lossy.compress_file(tmp_path / "b.pt", tmp_path / "b.ccl", base=tmp_path / "a.ccl", threads=1)
    lossy.decompress_file(tmp_path / "b.ccl", tmp_path / "want.pt", threads=1)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "spool"))
    (tmp_path / "spool").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    data = (tmp_path / "b.ccl").read_bytes()
    for argv in (["decompress", "-", "-"], ["verify", "-"]):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
        out = io.TextIOWrapper(io.BytesIO())
        monkeypatch.setattr(sys, "stdout", out)
        rc = cli.main(argv)
        assert rc == 0, (argv, capsys.readouterr().err)
        if argv[0] == "decompress":
            out.flush()
            assert out.buffer.getvalue() == (tmp_path / "want.pt").read_bytes()
    assert os.listdir(tmp_path / "spool") == []
