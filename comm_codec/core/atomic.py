"""Atomic outputs: a temp file created exclusively beside the output, renamed into place.

Every file the package writes (codebook sets, checkpoints) first exists under a temp name
in the output's own directory, created with ``O_CREAT | O_EXCL | O_NOFOLLOW``: a file or
symlink someone planted at that name makes the creation fail (and another name is
tried), it is never written through. The name is hidden, carries :data:`TEMP_MARK`, this
host's name and pid (so a later run can tell a dead run's leftovers from anyone else's),
and always fits in a directory entry, however long the output's own name is.

Example::

    >>> from comm_codec.core.atomic import atomic_write
    >>> atomic_write("books.json", b"{}")                                # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import re
import socket

__all__ = ["TEMP_MARK", "NAME_MAX", "host_name", "temp_prefix", "create_temp", "atomic_write", "umask"]

# Every temp file we make carries this mark, our host name and pid.
TEMP_MARK = "comm_codec-tmp"
# Bytes in one directory entry's name (Linux, macOS and the usual file systems).
NAME_MAX = 255
# What create_temp adds after the prefix: 8 random hex digits and ".tmp".
_RANDOM_CHARS = 8
_SUFFIX = ".tmp"


def host_name() -> str:
    """This host's name as temp names carry it (first label, [A-Za-z0-9-] only).

    Computed again only when ``socket.gethostname()`` changes: a directory run makes a
    temp name per file.
    """
    raw = socket.gethostname()
    if _HOST[0] != raw:
        _HOST[:] = [raw, re.sub(r"[^A-Za-z0-9-]", "-", raw.split(".")[0])[:64] or "host"]
    return _HOST[1]


_HOST = ["", ""]  # (gethostname(), the name temp files carry)


def _fit(name: str, room: int) -> str:
    """Return name cut to at most ``room`` bytes in the file system's encoding (whole characters)."""
    raw = os.fsencode(name)
    if len(raw) <= room:
        return name
    # A character cut in two is dropped (errors="ignore"): a temp name need not be exact.
    return raw[: max(0, room)].decode("utf-8", "ignore")


def temp_prefix(name: str, pid: int | None = None) -> str:
    """Return the prefix of our temp files for output ``name``: hidden, marked, host, pid.

    ``.NAME.comm_codec-tmp.HOST.PID.`` then 8 random characters and ``.tmp``; NAME is
    shortened (whole characters) so that the whole name fits in :data:`NAME_MAX` bytes.
    """
    tail = f".{TEMP_MARK}.{host_name()}.{os.getpid() if pid is None else pid}."
    room = NAME_MAX - 1 - len(tail) - _RANDOM_CHARS - len(_SUFFIX)
    return f".{_fit(name, room)}{tail}"


def create_temp(path, mode: int = 0o600) -> tuple[int, str]:
    """Create a new, empty temp file for output ``path`` in the same directory.

    Created as ``tempfile.mkstemp`` creates its files: ``O_CREAT | O_EXCL | O_NOFOLLOW``
    (never an existing file, never through a symlink; a taken name is retried with other
    random characters), then it gets ``mode`` less the umask. Made here rather than by
    mkstemp, whose argument handling cost a tree of many small files more than the
    file's own system calls.

    Returns:
        (file descriptor open for reading and writing, the temp file's path).

    Raises:
        OSError: the directory cannot be written (the error names ``path``).
    """
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    prefix = os.path.join(folder, temp_prefix(name))
    for _ in range(_TRIES):
        tmp = f"{prefix}{_random_chars()}{_SUFFIX}"
        try:
            fd = os.open(tmp, _TEMP_FLAGS, 0o600)
            break
        except FileExistsError:
            continue  # a name taken (ours or planted): another one
        except OSError as exc:  # name the file the user asked for, not our temp file
            raise type(exc)(exc.errno, exc.strerror, path) from None
    else:
        raise FileExistsError(17, f"no free temp file name after {_TRIES} tries", path)
    if mode != 0o600:
        os.fchmod(fd, mode & ~umask())
    return fd, tmp


def _random_chars() -> str:
    """The random part of a temp name: _RANDOM_CHARS hex digits."""
    return os.urandom(_RANDOM_CHARS // 2).hex()


_TEMP_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_TRIES = 100  # random names tried before giving up (mkstemp tries 10 000; a clash is 2**-32)


def umask() -> int:
    """The process umask, read without changing it (os.umask would, for every thread)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    return 0o022


def atomic_write(path, data, mode: int = 0o666) -> None:
    """Write ``data`` (bytes, or str as UTF-8) to ``path`` atomically.

    A temp file from :func:`create_temp` gets the bytes and ``mode`` (less the umask),
    is fsynced and renamed over ``path``; on any error it is removed and ``path`` is
    untouched. A symlink at ``path`` itself is replaced (rename), never written through.

    Raises:
        OSError: the file cannot be written.
    """
    path = os.fspath(path)
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd, tmp = create_temp(path, mode & 0o777)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):
        dfd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
