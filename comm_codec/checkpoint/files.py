"""Files for the checkpoint compressors: read-only maps, atomic outputs, streaming sha256.

Used by the exact (:mod:`.exact`) and lossy (:mod:`.lossy`) formats: a source is
mapped read-only (and its pages handed back as work moves on, so memory stays bounded),
an output appears only once complete (temp file, fsync, rename), and the sha256 of what
passes through is computed on a thread of its own when there are threads to spare.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import queue
import tempfile
import threading

import numpy as np

from .errors import CheckpointError

__all__ = ["FileMap", "AtomicFile", "Sha256Stream", "atomic_output", "check_paths", "sha256_file"]

# Buffers waiting for the background sha256 thread.
_SHA_QUEUE = 8
# Bytes hashed per step when a whole file is hashed (its pages are released after each).
_HASH_BLOCK = 4 << 20


# -- files ----------------------------------------------------------------------------------
class FileMap:
    """A read-only view of a whole file: a private mmap (never written), or nothing if empty.

    Pages a caller is done with are handed back (``release``), so resident memory stays
    bounded by the pieces in flight, not the file size.
    """

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            self.size, self.stamp = st.st_size, (st.st_size, st.st_mtime_ns, st.st_ino)
            # ACCESS_COPY: a private mapping, so views are writable numpy arrays (no
            # read-only kernel specializations) while the file itself can never change.
            self.mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if self.size else None
        self._released = 0

    def u8(self, offset: int, length: int) -> np.ndarray:
        """Return bytes offset..offset+length as a uint8 array (no copy)."""
        if length == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.frombuffer(self.mm, dtype=np.uint8, count=length, offset=offset)

    def release(self, start: int, end: int) -> None:
        """Drop the resident pages that lie wholly inside start..end."""
        if self.mm is None:
            return
        page = mmap.PAGESIZE
        lo, hi = -(-start // page) * page, (end // page) * page
        if hi > lo:
            self.mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def release_upto(self, end: int) -> None:
        """Release every page before ``end`` (callers move forward through the file)."""
        if end > self._released:
            self.release(self._released - self._released % mmap.PAGESIZE, end)
            self._released = end

    def unchanged(self) -> bool:
        """Whether the file still has the size, mtime and inode it had when mapped."""
        st = os.stat(self.path)
        return (st.st_size, st.st_mtime_ns, st.st_ino) == self.stamp

    def close(self) -> None:
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a view is still alive (an exception unwinding); GC closes it
                pass


def sha256_file(m: FileMap) -> str:
    h = hashlib.sha256()
    for start in range(0, m.size, _HASH_BLOCK):
        end = min(m.size, start + _HASH_BLOCK)
        h.update(m.u8(start, end - start))
        m.release(start, end)
    return h.hexdigest()


class Sha256Stream:
    """sha256 of bytes fed in order, hashed on a thread of its own when ``background``.

    Hashing runs at about 2 GB/s; on the caller's thread it serialized with writing the
    output and capped two-thread compression at 1.1x one thread. ``update`` hands over a
    buffer (kept alive until hashed; at most ``_SHA_QUEUE`` are waiting, which bounds
    memory) and ``then``, called once it is hashed (to release source pages).
    """

    def __init__(self, background: bool):
        self._h = hashlib.sha256()
        self._q = queue.Queue(_SHA_QUEUE) if background else None
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="comm_codec-sha256", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            data, then = item
            self._h.update(data)
            del data
            if then is not None:
                then()

    def update(self, data, then=None) -> None:
        if self._thread is None:
            self._h.update(data)
            if then is not None:
                then()
        else:
            self._q.put((data, then))

    def close(self) -> None:
        """Wait until everything handed over is hashed (idempotent)."""
        if self._thread is not None:
            self._q.put(None)
            self._thread.join()
            self._thread = None

    def hexdigest(self) -> str:
        self.close()
        return self._h.hexdigest()


class AtomicFile:
    """Write a file under a temporary name; it appears at ``path`` only on :meth:`commit`."""

    def __init__(self, path: str):
        self.path = path
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(2, "No such directory", folder)
        fd, self.tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
        os.fchmod(fd, 0o666 & ~_umask())
        self.fh = os.fdopen(fd, "wb", buffering=1 << 20)
        self.pos = 0

    def write(self, data) -> None:
        try:
            self.fh.write(data)
        except OSError as exc:
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror or exc}") from exc
        self.pos += memoryview(data).nbytes

    def reserve(self, size: int) -> None:
        """Allocate the file's final size up front: a full disk fails now, not half way."""
        try:
            self.fh.flush()
            if size:
                os.posix_fallocate(self.fh.fileno(), 0, size)
        except OSError as exc:
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror or exc}") from exc

    def pwrite(self, data, offset: int) -> None:
        """Write data at offset (thread-safe; for callers that never use :meth:`write`)."""
        view = memoryview(data).cast("B")
        try:
            while view.nbytes:
                n = os.pwrite(self.fh.fileno(), view, offset)
                view, offset = view[n:], offset + n
        except OSError as exc:
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror or exc}") from exc

    def pad8(self) -> None:
        if self.pos % 8:
            self.write(b"\0" * (8 - self.pos % 8))

    def commit(self) -> None:
        try:
            self.fh.flush()
            os.fsync(self.fh.fileno())
            self.fh.close()
            os.replace(self.tmp, self.path)
        except OSError as exc:
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror or exc}") from exc
        with contextlib.suppress(OSError):
            dfd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.fh.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)


def _umask() -> int:
    """The process umask, read without changing it (os.umask would, for every thread)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    return 0o022


@contextlib.contextmanager
def atomic_output(path: str):
    out = AtomicFile(path)
    try:
        yield out
    finally:
        if os.path.exists(out.tmp):  # not committed: an exception is unwinding
            out.abort()


def check_paths(src: str, dst: str, base: str | None) -> None:
    if os.path.isdir(dst):
        raise IsADirectoryError(21, "Is a directory", dst)
    for other, what in ((src, "source"), (base, "base")):
        if other is not None and os.path.exists(dst) and os.path.samefile(other, dst):
            raise CheckpointError(f"output {dst} is the {what} file; choose another output path "
                                  "(the input is never modified)")


