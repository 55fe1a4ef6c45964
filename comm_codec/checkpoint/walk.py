"""Walking a directory tree that someone else may change while it is read.

A tree given to ``compress`` may be writable by others (a shared checkpoint directory).
Between listing an entry and opening it, a process that can write there may swap a
subdirectory for a symlink to any directory, a file for a symlink to a file outside the
tree, or a file for a FIFO (an ``open`` of which blocks forever). Paths are therefore
never opened by name from the root: :class:`Tree` holds the root open and reaches every
entry through directory file descriptors, one component at a time, each opened with
``O_NOFOLLOW | O_NONBLOCK`` and its ``(st_dev, st_ino)`` checked against what the walk
saw. A symlink is never followed, a FIFO never waited on, and anything swapped in after
the walk is refused with one :class:`~comm_codec.CheckpointError` naming the entry.

Example::

    >>> with Tree("ckpt") as tree:                                      # doctest: +SKIP
    ...     for entry in tree.walk():
    ...         if entry.kind == "file":
    ...             with tree.open(entry) as fh:
    ...                 head = fh.read(8)

The seam for tests that race the walk deterministically is :data:`before_open`: called
with each entry's relative path just before it is opened (a file, or a directory the
walk or an open descends into).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
from collections.abc import Callable, Iterator
from typing import Self

from ..core.quoting import printable
from .errors import CheckpointError

__all__ = ["Entry", "Tree", "before_open", "kind_of"]

# Called with an entry's relative path just before it is opened (tests race it; None: nothing).
before_open: Callable[[str], None] | None = None

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One entry of a tree, as the walk saw it.

    Attributes:
        rel: its path relative to the root, with ``os.sep`` between components.
        kind: "dir", "file", or why it is skipped ("a symlink (never followed)", "a FIFO"...).
        ident: its ``(st_dev, st_ino)``; an open that finds another file there is refused.
        size: its size in bytes (0 for a directory).
        mode: its ``st_mode``.
    """

    rel: str
    kind: str
    ident: tuple
    size: int
    mode: int


def kind_of(st: os.stat_result) -> str:
    """Return "file" or "dir" for a regular file or directory, else why the entry is skipped."""
    mode = st.st_mode
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    for test, name in (
        (stat.S_ISLNK, "a symlink (never followed)"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _ident(st: os.stat_result) -> tuple:
    return st.st_dev, st.st_ino


class Tree:
    """A directory tree held open for reading: every entry reached through directory fds.

    Args:
        root: the directory (the user named it: a symlink given as the root is followed,
            nothing below it is).

    Raises:
        NotADirectoryError, FileNotFoundError, PermissionError: root cannot be opened as a directory.
    """

    def __init__(self, root):
        self.root = os.fspath(root)
        self._fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
        self._dirs: dict = {"": _ident(os.fstat(self._fd))}  # rel -> ident the walk saw

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the root's descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def path(self, rel: str) -> str:
        """The entry's path as the user would name it (root joined with ``rel``)."""
        return os.path.join(self.root, rel) if rel else self.root

    def walk(self) -> Iterator[Entry]:
        """Yield every entry under the root, sorted, parents before children; never follow a symlink.

        Raises:
            CheckpointError: a directory cannot be listed, or was swapped while walked.
        """
        todo = [""]
        while todo:
            rel = todo.pop()
            fd = self._open_dir(rel)
            try:
                try:
                    names = sorted(os.listdir(fd))
                except OSError as exc:
                    raise CheckpointError(f"cannot list {printable(self.path(rel))}: {exc.strerror or exc}") from None
                subdirs = []
                for name in names:
                    child = os.path.join(rel, name) if rel else name
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed since it was listed: it is not part of the tree
                    kind = kind_of(st)
                    entry = Entry(child, kind, _ident(st), st.st_size if kind == "file" else 0, st.st_mode)
                    if kind == "dir":
                        self._dirs[child] = entry.ident
                        subdirs.append(child)
                    yield entry
            finally:
                os.close(fd)
            todo.extend(reversed(subdirs))

    def open(self, entry: Entry):
        """Open a file the walk saw, for reading (binary, unbuffered offset: use pread or read).

        The file is opened through its parent's descriptor with ``O_NOFOLLOW | O_NONBLOCK``
        and must be the regular file the walk saw (same device and inode).

        Returns:
            A binary file object.

        Raises:
            CheckpointError: the entry is now a symlink, a FIFO or anything but that same
                file, or is gone (the tree changed while it was read).
        """
        fh, _ = self.open_stat(entry)
        return fh

    def open_stat(self, entry: Entry) -> tuple:
        """:meth:`open`, and the opened file's ``os.fstat`` (the check's own: no second call).

        Returns:
            (binary file object, its ``os.stat_result``).

        Raises:
            CheckpointError: as :meth:`open`.
        """
        if before_open is not None:
            before_open(entry.rel)
        parent, name = os.path.split(entry.rel)
        # A file of the root goes through the root's own descriptor, held since the walk
        # (no dup, no close); a deeper one through its directory, reached afresh.
        dfd = self._fd if not parent else self._open_dir(parent)
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dfd)
        except OSError as exc:
            raise self._changed(entry.rel, exc) from None
        finally:
            if parent:
                os.close(dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or _ident(st) != entry.ident:
                now = kind_of(st)
                raise CheckpointError(
                    f"{printable(self.path(entry.rel))} changed while the directory was read: "
                    f"{'another file' if now == 'file' else now} is there now; run again once nothing writes into it"
                )
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb"), st

    def _open_dir(self, rel: str) -> int:
        """A descriptor of directory ``rel``, reached from the root one component at a time."""
        fd = os.dup(self._fd)
        done = ""
        try:
            for part in rel.split(os.sep) if rel else ():
                done = os.path.join(done, part) if done else part
                if before_open is not None and done == rel:
                    before_open(rel)
                try:
                    nfd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    raise self._changed(done, exc) from None
                os.close(fd)
                fd = nfd
                seen = self._dirs.get(done)
                if seen is not None and _ident(os.fstat(fd)) != seen:
                    raise CheckpointError(
                        f"{printable(self.path(done))} changed while the directory was read: "
                        "another directory is there now; run again once nothing writes into it"
                    )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _changed(self, rel: str, exc: OSError) -> CheckpointError:
        shown = printable(self.path(rel))
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            what = "a symlink (never followed) or no longer a directory"
            with contextlib.suppress(OSError):  # only to name what is there: lstat reads, never follows
                what = kind_of(os.lstat(self.path(rel)))
            return CheckpointError(
                f"{shown} changed while the directory was read: {what} is there now; run "
                "again once nothing writes into it"
            )
        if exc.errno == errno.ENOENT:
            return CheckpointError(
                f"{shown} was removed while the directory was read; run again once nothing writes into it"
            )
        return CheckpointError(f"cannot open {shown}: {exc.strerror or exc}")
