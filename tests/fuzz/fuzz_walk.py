"""atheris fuzz target: the directory walker and directory mode, with entries swapped mid-run.

Not collected by pytest (no ``test_`` prefix). Each input builds a small tree (names,
regular files, subdirectories, symlinks out of the tree, FIFOs, files named like a dead
run's temp files) and picks one entry to swap, when the run is about to open it
(``walk.before_open``), for a symlink to a secret outside the tree, a FIFO, another file
or a directory. Then compress, verify, ls and decompress of the tree run. A finding is
any exception other than CheckpointError/OSError, a hang (-timeout), the secret's bytes
in any output, or a restored tree that differs from the input when nothing was swapped.

    python tests/fuzz/fuzz_walk.py -max_total_time=600 -rss_limit_mb=1024 -timeout=20 CORPUS_DIR
"""

import os
import shutil
import sys
import tempfile

import atheris

import comm_codec.core.codec  # noqa: F401  (numba kernels uninstrumented: numba cannot compile atheris's hooks)

with atheris.instrument_imports(
    include=["comm_codec.checkpoint.walk", "comm_codec.checkpoint.directory", "comm_codec.checkpoint.files"]
):
    from comm_codec.checkpoint import directory, walk
    from comm_codec.checkpoint.errors import CheckpointError
    from comm_codec.checkpoint.files import temp_name

_DIR = tempfile.mkdtemp(prefix="cc-fuzz-walk-")
_SECRET = b"SECRET-never-read-through-a-link"
os.makedirs(f"{_DIR}/outside", exist_ok=True)
with open(f"{_DIR}/outside/secret", "wb") as _fh:
    _fh.write(_SECRET)
_NAMES = [
    "a",
    "b.safetensors",
    "c.pt",
    "d.distcp",
    ".metadata",
    "e.json",
    temp_name("f", 999_999_999) + "abcdefgh.tmp",
    "\x1b[2J",
    "g h",
    "sub",
]
_SAFETENSORS = b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"__metadata__":{}}'[:16]


def _files_of(root):
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            p = os.path.join(folder, name)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = fh.read()
    return out


def _build(fdp, src):
    entries = []
    for _ in range(fdp.ConsumeIntInRange(1, 8)):
        parent = src if fdp.ConsumeBool() or not os.path.isdir(f"{src}/sub") else f"{src}/sub"
        name = _NAMES[fdp.ConsumeIntInRange(0, len(_NAMES) - 1)]
        path = os.path.join(parent, name)
        if os.path.lexists(path):
            continue
        kind = fdp.ConsumeIntInRange(0, 5)
        if kind == 0 or name == "sub":
            os.mkdir(path)
        elif kind == 1:
            os.symlink(f"{_DIR}/outside/secret", path)
        elif kind == 2:
            os.mkfifo(path)
        elif kind == 3:
            with open(path, "wb") as fh:
                fh.write(_SAFETENSORS + fdp.ConsumeBytes(64))
        else:
            with open(path, "wb") as fh:
                fh.write(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 200)))
        entries.append(os.path.relpath(path, src))
    return entries


def _swapper(fdp, src, entries):
    if not entries or fdp.ConsumeIntInRange(0, 2) == 0:
        return None, []
    target = entries[fdp.ConsumeIntInRange(0, len(entries) - 1)]
    how = fdp.ConsumeIntInRange(0, 3)
    done = []

    def hook(rel):
        if rel != target or done:
            return
        done.append(rel)
        path = os.path.join(src, rel)
        moved = path + ".moved"
        os.rename(path, moved)
        if how == 0:
            os.symlink(f"{_DIR}/outside" if os.path.isdir(moved) else f"{_DIR}/outside/secret", path)
        elif how == 1:
            os.mkfifo(path)
        elif how == 2:
            with open(path, "wb") as fh:
                fh.write(b"another file")
        else:
            os.mkdir(path)

    return hook, done


def TestOneInput(data: bytes):
    fdp = atheris.FuzzedDataProvider(data)
    work = tempfile.mkdtemp(dir=_DIR)
    src, out, back = f"{work}/src", f"{work}/out", f"{work}/back"
    os.mkdir(src)
    try:
        entries = _build(fdp, src)
        before = _files_of(src)
        hook, done = _swapper(fdp, src, entries)
        walk.before_open = hook
        try:
            directory.compress_dir(src, out, threads=1 + fdp.ConsumeIntInRange(0, 1))
            directory.verify_dir(out, threads=1)
            directory.describe_dir(out)
            directory.decompress_dir(out, back, threads=1)
        except (CheckpointError, OSError):
            pass
        finally:
            walk.before_open = None
        for root in (out, back):
            if os.path.isdir(root) and any(_SECRET in v for v in _files_of(root).values()):
                raise AssertionError(f"the secret outside the tree reached {root}")
        if not done and os.path.isdir(back) and _files_of(back) != before:
            raise AssertionError("the restored tree differs from the input")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
