"""Checkpoint directories: every checkpoint file of a tree compressed, every other file copied.

Training and model hubs write directories, not files: a sharded HF model
(``model-00001-of-00004.safetensors`` ... and ``model.safetensors.index.json``), a
``torch.distributed.checkpoint`` directory (``__0_0.distcp`` ... and ``.metadata``), or any
tree of ``.pt`` files beside configs. :func:`compress_dir` mirrors the tree: each
checkpoint file ``F`` becomes ``F.cckp`` (:func:`~comm_codec.checkpoint.exact.compress_file`),
every other regular file is copied as it is, and :func:`decompress_dir` turns the mirror
back into the original tree, byte for byte. :func:`verify_dir` checks every compressed
file of a mirror; :func:`describe_dir` lists it.

What counts as a checkpoint file (:func:`is_checkpoint_file`): a safetensors file or a
``torch.save`` zip (by their first bytes), or a DCP data file (``*.distcp``, which has no
header of its own). Everything else (JSON, tokenizers, DCP's ``.metadata`` pickle) is
copied, since zstd-sized savings on a few kB are not worth a container.

Files are coded in parallel, up to ``threads`` at once (a worker gets the threads left
over when there are fewer files than threads). Each output file is written atomically
(:mod:`.files`); a run that fails removes the files and directories it made, and leaves
those that were there before. Symlinks are never followed (a link could lead out of the
tree) and, like FIFOs, sockets and devices, they are skipped with a warning naming each.
The tree is read through :class:`.walk.Tree`: each file is opened once, through directory
descriptors with ``O_NOFOLLOW | O_NONBLOCK``, and must be the file the walk listed; an
entry swapped meanwhile (for a symlink, a FIFO, another file) fails the run, naming it.
Stale temp files of dead runs are swept once per output directory, never a name the run
writes or copies (:func:`.files.sweep_scope`).
The output is never inside the input tree (nor the input inside the output), and a tree
that already holds ``.cckp`` files is refused: their names would be ambiguous on the way
back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import stat
import threading
import time
from collections.abc import Callable

from ..core.quoting import printable
from .errors import CheckpointError
from .report import SizesRecord
from .walk import Tree

__all__ = [
    "SUFFIX",
    "DirSummary",
    "FileResult",
    "is_checkpoint_file",
    "compress_dir",
    "decompress_dir",
    "verify_dir",
    "describe_dir",
]

log = logging.getLogger("comm_codec.checkpoint")

# What a compressed file's name gets; decompress strips it.
SUFFIX = ".cckp"


@dataclasses.dataclass
class FileResult:
    """What happened to one file of a tree.

    Attributes:
        path: its path relative to the tree's root (the input's name).
        action: "compressed", "decompressed", "verified", "copied" or "skipped".
        original_bytes: the original file's size (None for a skipped entry).
        stored_bytes: the compressed (or copied) file's size.
        note: a skipped entry's reason, what a copied entry is, or what a verify checked.
    """

    path: str
    action: str
    original_bytes: int | None = None
    stored_bytes: int | None = None
    note: str = ""

    def line(self) -> str:
        """Return the progress line the command line prints for this file."""
        from .report import human_bytes

        shown = printable(self.path)
        if self.action == "skipped":
            return f"skipped {shown}: {self.note}"
        if self.action == "copied":
            return f"{self.note or 'copied'} {shown} ({human_bytes(self.original_bytes)})"
        a, b = human_bytes(self.original_bytes), human_bytes(self.stored_bytes)
        sizes = f"{b} -> {a}" if self.action == "decompressed" else f"{a} -> {b}"
        ratio = f"ratio {self.original_bytes / max(1, self.stored_bytes):.3f}" if self.original_bytes else "empty"
        return f"{self.action} {shown}: {sizes} ({ratio}{self.note})"


@dataclasses.dataclass
class DirSummary(SizesRecord):
    """What one compress_dir, decompress_dir or verify_dir call did.

    ``bytes_in`` (``original_bytes``), ``bytes_out`` (``stored_bytes``), ``bytes_saved``
    and ``as_dict()`` as for :class:`~comm_codec.checkpoint.Summary`.

    Attributes:
        op: "compress", "decompress" or "verify".
        files: the per-file results, in tree order.
        seconds: wall time of the call.
        threads: files coded at once.
    """

    op: str
    files: list
    seconds: float
    threads: int

    _STORED = "stored_bytes"

    def _count(self, action: str) -> int:
        return sum(f.action == action for f in self.files)

    @property
    def original_bytes(self) -> int:
        return sum(f.original_bytes or 0 for f in self.files if f.action != "skipped")

    @property
    def stored_bytes(self) -> int:
        return sum(f.stored_bytes or 0 for f in self.files if f.action != "skipped")

    @property
    def ratio(self) -> float:
        return self.original_bytes / max(1, self.stored_bytes)

    def line(self) -> str:
        """Return the one-line summary the command line prints after the per-file lines."""
        from .report import human_bytes

        coded = {"compress": "compressed", "decompress": "decompressed", "verify": "verified"}[self.op]
        a, b = human_bytes(self.original_bytes), human_bytes(self.stored_bytes)
        sizes = f"{b} -> {a}" if self.op == "decompress" else f"{a} -> {b}"
        if self.op == "verify":
            sizes = f"{b} ({a} original)"
        skipped = self._count("skipped")
        return (
            f"{coded} a directory of {len(self.files) - skipped} files: {self._count(coded)} {coded}, "
            f"{self._count('copied')} {'copied' if self.op != 'verify' else 'not compressed'}, "
            f"{skipped} skipped; {sizes} (ratio {self.ratio:.3f}) in {self.seconds:.2f} s, "
            f"{self.threads} at once"
        )


def is_checkpoint_file(path: str) -> bool:
    """Return whether a regular file is one :func:`compress_dir` compresses (else it is copied).

    safetensors (an 8-byte header length, then ``{``) and ``torch.save`` zips (``PK``)
    are known by their first bytes; DCP data files (``*.distcp``) by their name. A symlink
    is not followed and a FIFO not waited on: neither is a checkpoint file.
    """
    if path.endswith(".distcp"):
        return True
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and _is_checkpoint_head(path, os.pread(fd, 9, 0))
    except OSError:
        return False
    finally:
        os.close(fd)


def _is_checkpoint_head(path: str, head: bytes) -> bool:
    return path.endswith(".distcp") or head[:4] == b"PK\x03\x04" or (len(head) == 9 and head[8:9] == b"{")


# -- walking a tree -------------------------------------------------------------------------
def _entries(src: str) -> tuple[Tree, list]:
    """Open the tree and walk it (see :mod:`.walk`): every entry, parents before children."""
    tree = Tree(src)
    try:
        return tree, list(tree.walk())
    except BaseException:
        tree.close()
        raise


def _check_trees(src: str, dst: str, force: bool) -> None:
    """Refuse an output inside the input (or around it), and an existing output without force."""
    if not os.path.isdir(src):
        raise NotADirectoryError(20, "Not a directory", src)
    real_src, real_dst = os.path.realpath(src), os.path.realpath(dst)
    if real_dst == real_src or real_dst.startswith(real_src + os.sep):
        raise CheckpointError(f"output {dst} is inside the input directory {src}; choose an output outside it")
    if real_src.startswith(real_dst + os.sep):
        raise CheckpointError(f"output {dst} holds the input directory {src}; choose an output beside it")
    if os.path.lexists(dst) and not (force and os.path.isdir(dst) and not os.path.islink(dst)):
        if force:
            raise CheckpointError(f"{dst} exists and is not a directory; give a directory as output")
        raise FileExistsError(17, f"{dst} exists; pass --force to write into it (same names are replaced)", dst)


class _Made:
    """What a run created, to remove on failure (never what was there before)."""

    def __init__(self):
        self.files, self.dirs, self._lock = [], [], threading.Lock()

    def mkdir(self, path: str) -> None:
        if not os.path.isdir(path):
            os.mkdir(path)
            self.dirs.append(path)

    def file(self, path: str, existed: bool) -> None:
        if not existed:
            with self._lock:
                self.files.append(path)

    def undo(self) -> None:
        for path in self.files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        for path in reversed(self.dirs):
            with contextlib.suppress(OSError):
                os.rmdir(path)


def _copy(fh, st: os.stat_result, dst: str) -> None:
    """Copy one open regular file (``st`` its fstat) atomically (temp file, fsync, rename),
    keeping its permission bits."""
    from .files import atomic_output

    with atomic_output(dst, mode=st.st_mode & 0o777) as out:
        if st.st_size:  # an empty file: nothing to copy (one system call per file less)
            out.copy_from(fh.fileno())
        out.commit()


def _pool_size(threads: int | None, nfiles: int) -> tuple[int, int]:
    """(files at once, threads per file) for ``threads`` worker threads in all."""
    if threads is None:
        import numba  # after the kernels: kernels.jit names a bad NUMBA_* setting in its error

        threads = max(1, min(os.cpu_count() or 1, numba.config.NUMBA_NUM_THREADS))
    if not isinstance(threads, int) or not 1 <= threads <= 1024:
        raise ValueError(f"threads must be an integer from 1 to 1024, got {threads!r}")
    at_once = max(1, min(threads, nfiles))
    return at_once, max(1, threads // at_once)


def _meter(progress: bool | None, at_once: int) -> bool | None:
    """Each file's own progress meter, only when files are coded one at a time (several
    meters on one line would overwrite each other)."""
    return progress if at_once == 1 else False


def _map_files(jobs: list, at_once: int, on_file) -> list:
    """Run the per-file jobs, ``at_once`` at a time, in order of the list; report each as it
    finishes. The first failure cancels those not started.

    Args:
        jobs: (callable returning a FileResult, the file's size) pairs.

    Small files go to a worker together (up to :data:`_BATCH_FILES` of them, or
    :data:`_BATCH_BYTES`): copying an empty file costs less than handing a job to a
    thread and back.
    """
    results: list = [None] * len(jobs)
    lock = threading.Lock()

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            result = jobs[i][0]()
            results[i] = result
            if on_file is not None:
                with lock:
                    on_file(result)

    if at_once == 1:
        run(0, len(jobs))
        return results
    batches, lo, size = [], 0, 0
    for i, (_, nbytes) in enumerate(jobs):
        if i > lo and (size + nbytes > _BATCH_BYTES or i - lo >= _BATCH_FILES):
            batches.append((lo, i))
            lo, size = i, 0
        size += nbytes
    if lo < len(jobs):
        batches.append((lo, len(jobs)))
    with concurrent.futures.ThreadPoolExecutor(max_workers=at_once) as pool:
        futures = [pool.submit(run, lo, hi) for lo, hi in batches]
        try:
            for f in concurrent.futures.as_completed(futures):
                f.result()
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    return results


# Files handed to a worker at once: up to this many, or until they hold this many bytes
# (a larger file goes alone, and files in parallel).
_BATCH_FILES = 64
_BATCH_BYTES = 1 << 20


def _tree_jobs(src: str, entries: list, dst: str | None, made: _Made | None, make_job) -> tuple[list, list]:
    """Make the mirror's directories under dst; return (a (job, size) pair per file, skipped results)."""
    jobs, skipped = [], []
    for entry in entries:
        if entry.kind == "dir":
            if made is not None:
                made.mkdir(os.path.join(dst, entry.rel))
        elif entry.kind == "file":
            jobs.append((make_job(entry), entry.size))
        else:
            log.warning("skipping %s: %s", printable(os.path.join(src, entry.rel)), entry.kind)
            skipped.append(FileResult(entry.rel, "skipped", note=entry.kind))
    return jobs, skipped


def _finish(op: str, started: float, at_once: int, results: list, skipped: list) -> DirSummary:
    files = sorted([*results, *skipped], key=lambda f: f.path)
    return DirSummary(op, files, time.perf_counter() - started, at_once)


# -- the three operations -------------------------------------------------------------------
def compress_dir(
    src,
    dst,
    *,
    threads: int | None = None,
    force: bool = False,
    progress: bool | None = None,
    on_file: Callable[[FileResult], None] | None = None,
    codebooks=None,
    base=None,
) -> DirSummary:
    """Compress every checkpoint file of a tree into a mirror of it; copy every other file.

    Args:
        src: the directory (a sharded HF model, a DCP checkpoint, any tree).
        dst: the mirror to write: ``F`` becomes ``F.cckp`` for each checkpoint file
            (:func:`is_checkpoint_file`), other files keep their names and bytes.
        threads: CPU threads that code, in all; files are coded in parallel up to this many.
        force: write into an existing directory dst (files of the same names are
            replaced; nothing else there is touched). Default: refuse an existing dst.
        progress: each file's progress line on stderr (None: only on a terminal).
        on_file: called with each file's :class:`FileResult` as it finishes (one at a time).
        codebooks: the books to weigh against per-tensor books: a
            :class:`~comm_codec.CodebookSet`, the path of a saved one, or None (the shipped books).
        base: the previous checkpoint's directory (original, or its compressed mirror):
            each checkpoint file is coded as a delta against the file of the same
            relative path there (``compress_file(base=...)``); a file with no partner,
            or none that shares a tensor, is coded standalone and its line says so.

    Returns:
        A :class:`DirSummary`.

    Raises:
        NotADirectoryError: src (or base) is not a directory.
        FileExistsError: dst exists and force is False.
        CodebookError: codebooks is a missing or invalid file.
        CheckpointError: dst inside src (or src inside dst), a ``.cckp`` file in src, or
            a file failed (the files and directories this call made are removed).
    """
    from .exact import compress_file
    from .files import pinned

    src, dst = os.fspath(src), os.fspath(dst)
    base = _base_dir(base)
    started = time.perf_counter()
    if codebooks is not None:
        from ..core.codebooks import as_codebook_set

        codebooks = as_codebook_set(codebooks)  # loaded once, and refused before dst is made
    _check_trees(src, dst, force)
    tree, entries = _entries(src)
    with tree:
        files = [e.rel for e in entries if e.kind == "file"]
        ours = [rel for rel in files if rel.endswith(SUFFIX)]
        if ours:
            raise CheckpointError(
                f"{os.path.join(src, ours[0])}: the directory already holds {len(ours)} {SUFFIX} "
                f"file(s); decompress or move them first (their names would be ambiguous when the "
                "mirror is decompressed)"
            )
        at_once, per_file = _pool_size(threads, len(files))
        made = _Made()

        def make_job(entry):
            def job() -> FileResult:
                rel, path = entry.rel, os.path.join(src, entry.rel)
                fh, st = tree.open_stat(entry)
                with fh:
                    head = os.pread(fh.fileno(), 9, 0) if st.st_size else b""  # (no read of an empty file)
                    if not _is_checkpoint_head(rel, head):
                        return _copied(
                            rel, fh, st, os.path.join(dst, rel), force, made, "copied (not a checkpoint file)"
                        )
                    out = os.path.join(dst, rel + SUFFIX)
                    existed = os.path.lexists(out)
                    partner = _partner(base, rel)
                    with pinned(path, fh):
                        s, note = _compress_against(
                            compress_file, path, out, partner, per_file, codebooks, _meter(progress, at_once), force
                        )
                made.file(out, existed)
                if base is not None and partner is None:
                    note = "; no partner in the base directory: coded standalone"
                return FileResult(
                    rel,
                    "compressed",
                    s.original_bytes,
                    s.compressed_bytes,
                    note + (f"; note: {s.note}" if s.note else ""),
                )

            return job

        outputs = [rel + tail for rel in files for tail in ("", SUFFIX)]
        return _run_tree("compress", src, dst, entries, outputs, made, make_job, at_once, on_file, started)


def _base_dir(base) -> str | None:
    if base is None:
        return None
    base = os.fspath(base)
    if not os.path.isdir(base):
        raise NotADirectoryError(20, "Not a directory (a directory's base is a directory)", base)
    return base


def _partner(base: str | None, rel: str, compressed_ok: bool = True) -> str | None:
    """The file of the same relative path in the base directory (its original, else its
    compressed mirror), or None. ``rel`` comes from the walk of our own tree (no ``..``);
    the partner must be a regular file reached through no symlink, inside ``base``."""
    if base is None:
        return None
    root = os.path.realpath(base)
    for candidate in (rel, rel + SUFFIX) if compressed_ok else (rel,):
        path = os.path.join(base, candidate)
        real = os.path.realpath(path)
        if real == os.path.join(root, candidate) and os.path.isfile(real):
            return path
    return None


def _compress_against(compress_file, path, out, partner, threads, codebooks, progress, force):
    """Compress one file against its partner; standalone when there is none or it shares no
    tensor with the file. Return (summary, what the file's line adds)."""
    if partner is not None:
        try:
            s = compress_file(
                path, out, base=partner, threads=threads, codebooks=codebooks, progress=progress, force=force
            )
            return s, (f", {s.delta} tensors as deltas" if s.delta else "; no tensor coded as a delta")
        except CheckpointError as exc:
            if "shares no tensor" not in str(exc):
                raise
            s = compress_file(path, out, threads=threads, codebooks=codebooks, progress=progress, force=force)
            return s, "; shares no tensor with its partner in the base directory: coded standalone"
    return compress_file(path, out, threads=threads, codebooks=codebooks, progress=progress, force=force), ""


def _copied(rel: str, fh, st: os.stat_result, out: str, force: bool, made, note: str = "") -> FileResult:
    """Copy a file that is not coded (``st``: its fstat), recording it among the outputs a
    failed run removes."""
    existed = os.path.lexists(out)
    if existed and not force:
        raise FileExistsError(17, f"{out} exists; pass --force to replace it", out)
    _copy(fh, st, out)
    made.file(out, existed)
    return FileResult(rel, "copied", st.st_size, st.st_size, note)


def _run_tree(
    op: str, src: str, dst: str, entries: list, outputs: list, made, make_job, at_once: int, on_file, started: float
) -> DirSummary:
    """Make the output tree, run every file's job, and undo what was made if any fails.

    Stale temp files of dead runs are swept once per output folder, never one of
    ``outputs`` (what this run writes or copies, relative to dst: a file of the tree may look
    like a temp).
    """
    from .files import sweep_scope

    try:
        if not os.path.isdir(dst):
            made.mkdir(dst)
        jobs, skipped = _tree_jobs(src, entries, dst, made, make_job)
        with sweep_scope(dst, outputs):
            results = _map_files(jobs, at_once, on_file)
    except BaseException:
        made.undo()
        raise
    return _finish(op, started, at_once, results, skipped)


def decompress_dir(
    src,
    dst,
    *,
    threads: int | None = None,
    force: bool = False,
    progress: bool | None = None,
    on_file: Callable[[FileResult], None] | None = None,
    base=None,
) -> DirSummary:
    """Restore a tree written by :func:`compress_dir`, byte for byte.

    Every ``F.cckp`` is decompressed into ``F`` (its digest checked before it appears);
    every other file is copied. Arguments, results and errors as :func:`compress_dir`;
    a ``.cckp`` file that is not a comm_codec checkpoint fails with its name, and a tree
    with no ``.cckp`` file is refused (CheckpointError) before anything is written.
    ``base``: the directory the mirror's deltas were taken against (as given to
    :func:`compress_dir`, or its own compressed mirror); each delta file gets the file of
    the same relative path there.
    """
    from .exact import decompress_file, read_index
    from .files import pinned

    src, dst = os.fspath(src), os.fspath(dst)
    base = _base_dir(base)
    started = time.perf_counter()
    _check_trees(src, dst, force)
    tree, entries = _entries(src)
    with tree:
        files = [e.rel for e in entries if e.kind == "file"]
        _refuse_uncompressed(src, files, "decompress")
        at_once, per_file = _pool_size(threads, len(files))
        made = _Made()

        def make_job(entry):
            def job() -> FileResult:
                rel, path = entry.rel, os.path.join(src, entry.rel)
                fh, st = tree.open_stat(entry)
                with fh:
                    if not rel.endswith(SUFFIX):
                        return _copied(rel, fh, st, os.path.join(dst, rel), force, made)
                    out = os.path.join(dst, rel[: -len(SUFFIX)])
                    existed = os.path.lexists(out)
                    with pinned(path, fh):
                        # Only a delta gets its partner (a standalone file given one warns).
                        partner = (
                            _partner(base, rel[: -len(SUFFIX)])
                            if base is not None and read_index(path)["base"] is not None
                            else None
                        )
                        s = decompress_file(
                            path, out, base=partner, threads=per_file, progress=_meter(progress, at_once), force=force
                        )
                made.file(out, existed)
                return FileResult(rel, "decompressed", s.original_bytes, s.compressed_bytes)

            return job

        outputs = [rel[: -len(SUFFIX)] if rel.endswith(SUFFIX) else rel for rel in files]
        return _run_tree("decompress", src, dst, entries, outputs, made, make_job, at_once, on_file, started)


def _refuse_uncompressed(src: str, files: list, op: str) -> None:
    """Refuse a tree with no compressed file: there would be nothing to check or restore,
    and a command that did nothing must not look like one that succeeded."""
    if not any(rel.endswith(SUFFIX) for rel in files):
        raise CheckpointError(
            f"{src} holds no compressed file ({SUFFIX}), so there is nothing to {op} "
            f"({len(files)} other files); give a directory written by 'comm-codec compress DIR OUT'"
        )


def verify_dir(
    src,
    *,
    threads: int | None = None,
    progress: bool | None = None,
    on_file: Callable[[FileResult], None] | None = None,
) -> DirSummary:
    """Check every ``.cckp`` file of a tree written by :func:`compress_dir`; write nothing.

    Returns:
        A :class:`DirSummary` (other files are listed as copied: there is nothing to check).

    Raises:
        CheckpointError: a compressed file is corrupted (named in the message), or the
            tree holds no ``.cckp`` file (nothing would be checked).
    """
    from .exact import verify_file
    from .files import pinned

    src = os.fspath(src)
    if not os.path.isdir(src):
        raise NotADirectoryError(20, "Not a directory", src)
    started = time.perf_counter()
    tree, entries = _entries(src)
    with tree:
        _refuse_uncompressed(src, [e.rel for e in entries if e.kind == "file"], "verify")
        at_once, per_file = _pool_size(threads, sum(e.kind == "file" for e in entries))

        def make_job(entry):
            def job() -> FileResult:
                rel, path = entry.rel, os.path.join(src, entry.rel)
                if not rel.endswith(SUFFIX):
                    return FileResult(rel, "copied", entry.size, entry.size, "not compressed, nothing to check:")
                with tree.open(entry) as fh, pinned(path, fh):
                    s = verify_file(path, threads=per_file, progress=_meter(progress, at_once))
                checked = f", {s.digest.split(':')[0]} ok" if s.digest else ", digest NOT checked (a delta)"
                return FileResult(rel, "verified", s.original_bytes, s.compressed_bytes, checked)

            return job

        jobs, skipped = _tree_jobs(src, entries, None, None, make_job)
        return _finish("verify", started, at_once, _map_files(jobs, at_once, on_file), skipped)


def describe_dir(src) -> str:
    """Return a table of a tree written by :func:`compress_dir`: per file, how it is stored,
    its original and stored sizes and ratio (from each index; nothing is decoded)."""
    from .exact_index import read_index
    from .files import pinned
    from .report import human_bytes

    src = os.fspath(src)
    if not os.path.isdir(src):
        raise NotADirectoryError(20, "Not a directory", src)
    rows, total_in, total_out = [], 0, 0
    tree, entries = _entries(src)
    with tree:
        for entry in entries:
            rel, kind = entry.rel, entry.kind
            if kind == "dir":
                continue
            if kind != "file":
                rows.append((printable(rel), "skipped", "-", "-", "-", kind))
                continue
            size = entry.size
            if rel.endswith(SUFFIX):
                path = os.path.join(src, rel)
                with tree.open(entry) as fh, pinned(path, fh):
                    index = read_index(path)
                orig = index["source"]["size"]
                n = len(index["tensors"])
                rows.append(
                    (
                        printable(rel[: -len(SUFFIX)]),
                        "compressed",
                        human_bytes(orig),
                        human_bytes(size),
                        f"{orig / max(1, size):.3f}",
                        f"{index['source']['format']}, {n} tensors, "
                        f"{sum(t['coding'] == 'frame' for t in index['tensors'])} coded"
                        + (f"; note: {printable(index['source']['note'], 400)}" if index["source"].get("note") else ""),
                    )
                )
            else:
                orig = size
                rows.append((printable(rel), "copied", human_bytes(size), human_bytes(size), "1.000", ""))
            total_in, total_out = total_in + orig, total_out + size
    width = max([len(r[0]) for r in rows] + [4])
    lines = [
        f"directory {printable(src)}: {sum(r[1] == 'compressed' for r in rows)} compressed, "
        f"{sum(r[1] == 'copied' for r in rows)} copied, {sum(r[1] == 'skipped' for r in rows)} skipped; "
        f"{human_bytes(total_in)} -> {human_bytes(total_out)} (ratio {total_in / max(1, total_out):.3f})",
        f"{'file':<{width}}  {'stored as':<10} {'original':>10} {'stored':>10} {'ratio':>6}  what",
    ]
    lines += [f"{r[0]:<{width}}  {r[1]:<10} {r[2]:>10} {r[3]:>10} {r[4]:>6}  {r[5]}" for r in rows]
    return "\n".join(lines)
