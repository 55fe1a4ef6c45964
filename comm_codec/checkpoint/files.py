"""Files for the checkpoint compressors: read-only views, atomic outputs, streaming digests.

Used by the exact (:mod:`.exact`) and lossy (:mod:`.lossy`) formats: a source is read
piece by piece (so memory stays bounded by the pieces in flight, and a file that shrinks
while it is read is an error, not a crash), an output appears only once complete (temp file, fsync, rename), and the digest of what
passes through is computed on a thread of its own when there are threads to spare.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hashlib
import io
import os
import re
import stat
import sys
import threading

import numpy as np

from ..core.atomic import TEMP_MARK, create_temp, host_name, temp_prefix, umask
from .errors import CheckpointError

__all__ = [
    "FileMap",
    "AtomicFile",
    "DigestStream",
    "atomic_output",
    "check_paths",
    "file_digest",
    "new_hasher",
    "recorded_digest",
    "KEEP_BYTES",
    "WRITE_DIGEST",
    "DIGESTS",
    "open_regular",
    "is_regular",
    "temp_name",
    "sweep_stale_temps",
    "TEMP_MARK",
    "track_temp",
    "untrack_temp",
    "remove_live_temps",
    "pinned",
    "stat_of",
    "sweep_scope",
]

# Buffers waiting for the background digest thread (DigestStream).
_SHA_QUEUE = 8
# Bytes a FileMap keeps read for the next reader of the same range (FileMap.u8's keep).
KEEP_BYTES = 16 << 20
# Bytes hashed per step when a whole file is hashed.
_HASH_BLOCK = 4 << 20
# AtomicFile.write: payloads this large are written straight to the file (the buffer
# gathers the headers, padding and small segments between them).
DIRECT_WRITE_BYTES = 64 << 10
# AtomicFile.copy_from: bytes per copy_file_range call.
_COPY_BLOCK = 8 << 20


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


# -- files ----------------------------------------------------------------------------------
def _not_regular(path: str, st: os.stat_result) -> OSError:
    what = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
    if stat.S_ISDIR(st.st_mode):
        return IsADirectoryError(21, "Is a directory", path)
    return CheckpointError(
        f"{path} is {what}, not a regular file; give a checkpoint file (copy a stream to a file first)"
    )


def is_regular(path: str) -> bool:
    """Return whether path is (or links to) a regular file; never opens it."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def open_regular(path: str):
    """Open a regular file for reading, refusing FIFOs, devices, sockets and /proc files.

    The type is checked before ``open`` (a FIFO would block in it) and again on the open
    file (it cannot have been swapped in between). A file that says it is empty but
    reads bytes (procfs, sysfs) has no size to trust and is refused too.

    Raises:
        FileNotFoundError, PermissionError, IsADirectoryError: as ``open``.
        CheckpointError: not a regular file.
    """
    held = _pinned_fd(path)
    if held is not None:  # a file a directory walk opened: that very file, never the name again
        fd = os.dup(held)
        os.lseek(fd, 0, os.SEEK_SET)
        return os.fdopen(fd, "rb")
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    fh = os.fdopen(fd, "rb")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st)
        if st.st_size == 0 and fh.read(1):
            raise CheckpointError(
                f"{path} reports a size of 0 but has contents (a /proc or /sys file?); copy it to a regular file first"
            )
        fh.seek(0)
    except BaseException:
        fh.close()
        raise
    return fh


# This thread's {path: descriptor} of files a directory walk opened and checked; see pinned().
_pins = threading.local()


def _pinned_fd(path: str) -> int | None:
    return getattr(_pins, "fds", {}).get(path)


@contextlib.contextmanager
def pinned(path: str, fh):
    """Make :func:`open_regular` (and so :class:`FileMap`) of ``path`` use the open file ``fh``.

    A directory walk (:mod:`.walk`) opens each file once, through directory descriptors
    with ``O_NOFOLLOW``, and checks it is the file it listed; the compressors it then
    calls with the file's path read that descriptor (a duplicate, from offset 0), not
    whatever the name leads to by then. The pin holds on the calling thread only (where
    a compressor opens its source), so concurrent runs never see each other's files.
    """
    fds = _pins.__dict__.setdefault("fds", {})
    before = fds.get(path)
    fds[path] = fh.fileno()
    try:
        yield fh
    finally:
        if before is None:
            fds.pop(path, None)
        else:
            fds[path] = before


def stat_of(path: str) -> os.stat_result:
    """``os.stat(path)``, or of the file :func:`pinned` holds for that path."""
    held = _pinned_fd(path)
    return os.fstat(held) if held is not None else os.stat(path)


class FileMap:
    """A read-only view of a whole file: byte ranges read (``pread``) into arrays of their own.

    The file is not mapped: a mapped file that shrinks under a reader kills it with SIGBUS
    on its next access past the new end, and a checkpoint being written by another process
    does shrink (it is truncated and rewritten). Here a read that comes up short raises
    :class:`CheckpointError` (its message says the file changed), and the output being
    written is removed as after any other error. Reads of a few MiB per segment cost a
    copy from the page cache, less than faulting the same pages into a mapping and
    dropping them again (each drop flushes the TLB of every core the process runs on).
    Memory is what callers hold: the arrays they read and have not let go.
    """

    def __init__(self, path: str):
        self.path = path
        self._fh = open_regular(path)
        st = os.fstat(self._fh.fileno())
        self.size, self.stamp = st.st_size, (st.st_size, st.st_mtime_ns, st.st_ino)
        self._advised = 0  # bytes 0.._advised were prefetched
        self._kept: dict = {}  # (offset, length) -> bytes read once, for the next reader of that range
        self._kept_lock = threading.Lock()

    def u8(self, offset: int, length: int, keep: bool = False) -> np.ndarray:
        """Return bytes offset..offset+length as a new (writable) uint8 array.

        Args:
            offset, length: the range.
            keep: also keep the array for the next call that asks for exactly this range,
                which then gets it instead of reading the file again (the checkpoint
                planner reads a small tensor whole, and its coder reads the same bytes
                next). The array is handed on, not copied: the caller must be done with
                it, and not change it, before that call. At most :data:`KEEP_BYTES` are
                kept (the oldest go first).

        Raises:
            ValueError: the range is not inside the size the file had when opened.
            CheckpointError: the file is shorter now (it changed while being read).
        """
        if length == 0:
            return np.zeros(0, dtype=np.uint8)
        self._check_range(offset, length)
        out = self.take_kept(offset, length)
        if out is not None:
            return out
        out = self._read(offset, length)
        if keep and length <= KEEP_BYTES:
            with self._kept_lock:
                self._kept[(offset, length)] = out
                while sum(a.size for a in self._kept.values()) > KEEP_BYTES:
                    del self._kept[next(iter(self._kept))]
        return out

    def take_kept(self, offset: int, length: int) -> np.ndarray | None:
        """Return the array kept for exactly this range (see :meth:`u8`), or None; it is not kept after."""
        if not self._kept:
            return None
        with self._kept_lock:
            return self._kept.pop((offset, length), None)

    def read_into(self, offset: int, out: np.ndarray) -> np.ndarray:
        """Read bytes offset..offset+out.size into ``out`` (a contiguous uint8 array); return it.

        For callers that recycle their buffers: a fresh array per read is a fresh mapping
        for large reads, whose pages fault in and are unmapped again (and with threads,
        each unmap interrupts every core the process runs on).

        Raises:
            ValueError, CheckpointError: as :meth:`u8`.
        """
        self._check_range(offset, out.size)
        return self._read(offset, out.size, out)

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"bytes {offset}..{offset + length} are outside {self.path} ({self.size} bytes)")

    def _read(self, offset: int, length: int, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(length, dtype=np.uint8) if out is None else out
        view, done, fd = memoryview(out), 0, self._fh.fileno()
        while done < length:
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise CheckpointError(
                    f"{self.path} changed while it was being read: it is now shorter than the "
                    f"{self.size} bytes it had (read again once it is complete)"
                )
            done += got
        return out

    def prefetch(self, start: int, length: int) -> None:
        """Ask the kernel to read bytes start..start+length ahead, in the background.

        Advice only (``POSIX_FADV_WILLNEED``): a file on disk and not cached is then read
        while earlier pieces are coded.
        """
        # Callers move forward: only what was not advised yet is (a small file is advised
        # once, not once per segment).
        start, end = max(start, self._advised), min(self.size, start + length)
        if end <= start or not hasattr(os, "posix_fadvise"):
            return
        with contextlib.suppress(OSError, ValueError):
            os.posix_fadvise(self._fh.fileno(), start, end - start, os.POSIX_FADV_WILLNEED)
        self._advised = end

    def unchanged(self) -> bool:
        """Whether the open file still has the size, mtime and inode it had when opened.

        The open descriptor, not the name: a file renamed over the name meanwhile is not
        what was read, and a symlink there is never followed.
        """
        st = os.fstat(self._fh.fileno())
        return (st.st_size, st.st_mtime_ns, st.st_ino) == self.stamp

    def close(self) -> None:
        self._kept.clear()
        self._fh.close()


# The whole-file digest new files record: BLAKE3, several times faster than sha256 on one
# core (sha256 would be a large share of a checkpoint's time). A file may record sha256
# instead; readers check whichever it records.
WRITE_DIGEST = "blake3"
DIGESTS = ("blake3", "sha256")


def new_hasher(name: str):
    """Return a hashlib-style object (update, hexdigest) for a digest name in DIGESTS."""
    if name == "blake3":
        import blake3

        return blake3.blake3()
    if name == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest {name!r}; expected one of {DIGESTS}")


def recorded_digest(record: dict) -> tuple[str, str]:
    """Return (name, hex) of the digest a source/base record holds (blake3 first)."""
    for name in DIGESTS:
        if name in record:
            return name, record[name]
    raise KeyError("no digest")


def file_digest(m: FileMap, name: str = WRITE_DIGEST) -> str:
    """Return the hex digest of a whole file, read a block at a time."""
    h = new_hasher(name)
    for start in range(0, m.size, _HASH_BLOCK):
        h.update(m.u8(start, min(m.size, start + _HASH_BLOCK) - start))
    return h.hexdigest()


class DigestStream:
    """A digest of bytes fed in order, hashed on a thread of its own when ``background``.

    On the caller's thread, hashing serialized with writing the output and capped
    two-thread compression at 1.1x one thread. ``update`` hands over a buffer (kept
    alive until hashed; at most ``_SHA_QUEUE`` are waiting, which bounds memory) and
    ``then``, called once it is hashed (to release source pages).

    With ``background``, any thread may also :meth:`help`: hash the oldest buffer waiting,
    itself, when no other thread is hashing. The buffers are hashed one at a time in the
    order they were handed over, whoever hashes them. A restore on two cores has three
    threads with work (the writer, a decoder, the digest); the two that have their own
    work to do hash between their items, and the digest's thread, ``helped``, runs at a
    lower priority (nice +5 on Linux) and takes what is left while a core is free. With
    the digest's thread competing at the same priority, a 4 GB restore on two threads ran
    1.53x one thread. A compress, whose workers do not help, ran 4 % slower with it lowered.
    """

    def __init__(self, background: bool, name: str = WRITE_DIGEST, helped: bool = False):
        self.name = name
        self._nice = _DIGEST_NICE if helped else 0
        self._h = new_hasher(name)
        self._items: collections.deque = collections.deque()  # (data, then), in order
        self._cv = threading.Condition()
        self._busy = False  # a thread is hashing (the oldest item is out of the deque)
        self._closing = False
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="comm_codec-digest", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        if self._nice:
            _lower_priority(self._nice)
        while self._hash_one(block=True):
            pass

    def _hash_one(self, block: bool) -> bool:
        """Hash the oldest waiting buffer on this thread; False when there was none to take
        (without ``block``: also when another thread is hashing; with it: only once closed)."""
        with self._cv:
            while self._busy or not self._items:
                if not block or (self._closing and not self._items and not self._busy):
                    return False
                self._cv.wait()
            self._busy = True
            data, then = self._items.popleft()
            self._cv.notify_all()  # room for update()
        try:
            self._h.update(data)
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()
        del data
        if then is not None:
            then()
        return True

    def update(self, data, then=None) -> None:
        if self._thread is None:
            self._h.update(data)
            if then is not None:
                then()
            return
        with self._cv:
            while len(self._items) >= _SHA_QUEUE:
                self._cv.wait()
            self._items.append((data, then))
            self._cv.notify_all()

    def help(self) -> bool:
        """Hash the oldest buffer handed over, on the caller's thread, unless none is waiting or
        another thread is hashing; return whether one was hashed. Without ``background``,
        ``update`` hashes at once and this does nothing."""
        return self._thread is not None and self._hash_one(block=False)

    def close(self) -> None:
        """Wait until everything handed over is hashed (idempotent)."""
        if self._thread is not None:
            with self._cv:
                self._closing = True
                self._cv.notify_all()
            self._thread.join()
            self._thread = None

    def hexdigest(self) -> str:
        self.close()
        return self._h.hexdigest()


# How much the digest's own thread yields to the threads that help it (see DigestStream).
_DIGEST_NICE = 5


def _lower_priority(nice: int) -> None:
    """Lower the calling thread's scheduling priority by ``nice`` (Linux: nice is per thread)."""
    if sys.platform.startswith("linux") and hasattr(threading, "get_native_id"):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(
                os.PRIO_PROCESS,
                threading.get_native_id(),
                os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + nice,
            )


class AtomicFile:
    """Write a file under a temporary name; it appears at ``path`` only on :meth:`commit`.

    The temp file is named by :func:`temp_name` (so a later run can find it if this one is
    killed) and gets ``mode`` (default: 0o666 less the umask) before it is renamed. With
    ``release_in_background``, a file it replaces is freed on a thread of its own.

    Bytes go in with ``write`` or ``pwrite``, not through a shared mapping of the file:
    a write fault that the file system cannot back (no room, an I/O error, the file cut
    short by another process) kills the process with SIGBUS, and a mapping does not pay
    on tmpfs either. Faulting fresh pages in (``MADV_POPULATE_WRITE`` after a
    ``posix_fallocate``, which report an error instead of SIGBUS) cost more than pwrite's
    allocation and copy (6.65 MB: 4.9 against 2.7 ms), a 1 GB restore took 1.05 s mapped
    against 0.70 s, and two threads faulting one mapping ran no faster than one.
    """

    def __init__(self, path: str, mode: int | None = None, release_in_background: bool = False):
        self.path = path
        self._release_in_background = release_in_background
        self.committed = False
        where = os.path.abspath(path)
        self._folder = os.path.dirname(where)
        self._scope = _scope_of(self._folder)
        # Within a run's scope its folders were made or listed: no check per file.
        if self._scope is None and not os.path.isdir(self._folder):
            raise FileNotFoundError(2, "No such directory", self._folder)
        _sweep_before_writing(self._folder, self._scope)
        fd, self.tmp = create_temp(where)  # O_EXCL | O_NOFOLLOW, beside path
        track_temp(self.tmp)
        mask = umask() if self._scope is None else self._scope.umask
        os.fchmod(fd, (0o666 if mode is None else mode & 0o777) & ~mask)
        # The 1 MiB buffer is allocated on the first write (a copied file never needs it:
        # allocating and freeing it cost a tree of small files more than the copies).
        self.fh = os.fdopen(fd, "wb", buffering=0)
        self._buffered = False
        self.pos = 0
        self._pwrite_lock = threading.Lock()

    def write(self, data) -> None:
        """Append data (bytes-like); payloads of :data:`DIRECT_WRITE_BYTES` and more skip the buffer."""
        view = memoryview(data).cast("B")
        n = view.nbytes
        try:
            if n < DIRECT_WRITE_BYTES:
                if not self._buffered:
                    self.fh = io.BufferedWriter(self.fh, buffer_size=1 << 20)
                    self._buffered = True
                self.fh.write(view)
            else:
                # A coded tensor's payload: through the buffer it would be copied once
                # more. What the buffer holds goes out first, so bytes stay in order.
                self.fh.flush()
                fd = self.fh.fileno()
                while view.nbytes:
                    view = view[os.write(fd, view) :]
        except OSError as exc:
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror or exc}") from exc
        self.pos += n

    def copy_from(self, fd: int) -> None:
        """Append the whole file open at ``fd`` (from its offset 0), copied in the kernel when it can be.

        Raises:
            CheckpointError: a read or write failed.
        """
        self.fh.flush()
        out, offset = self.fh.fileno(), 0
        try:
            while True:
                try:
                    n = os.copy_file_range(fd, out, _COPY_BLOCK, offset)
                except OSError as exc:  # EXDEV on old kernels, ENOSYS, EINVAL: copy through user space
                    if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP) or offset:
                        raise
                    n = -1
                if n < 0:
                    while block := os.pread(fd, _COPY_BLOCK, offset):
                        view = memoryview(block)
                        while view.nbytes:
                            view = view[os.write(out, view) :]
                        offset += len(block)
                    break
                if n == 0:
                    break
                offset += n
        except OSError as exc:
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror or exc}") from exc
        self.pos += offset

    def reserve(self, size: int) -> None:
        """Say the file will be ``size`` bytes: fail now if its file system has no room for them.

        A check, not an allocation: ``posix_fallocate`` on tmpfs zeroes every page it
        allocates, which the writes then overwrite (8 % of restoring a 40 MB file there),
        and it holds the file's inode lock meanwhile, so that a worker's :meth:`pwrite`
        waits on it. Writes that find the disk full later (someone else took the room)
        fail as any write does.

        Raises:
            CheckpointError: fewer than ``size`` bytes free.
        """
        try:
            st = os.fstatvfs(self.fh.fileno())
        except OSError:
            return  # no figure to check against: the writes will tell
        free = st.f_bavail * st.f_frsize
        if size > free:
            raise CheckpointError(
                f"cannot write {self.path}: No space left on device ({size} bytes to write, {free} free)"
            )

    def pwrite(self, data, offset: int) -> None:
        """Write data at offset (thread-safe; for callers that never use :meth:`write`).

        One writer at a time: the kernel holds the file's inode lock for a whole write,
        and writers waiting for it spin on its owner (optimistic spinning) while the
        owner copies megabytes, so two threads writing segments at once can spend many
        times the copy's time in the kernel. A Python lock makes the other one sleep.
        """
        view = memoryview(data).cast("B")
        try:
            with self._pwrite_lock:
                while view.nbytes:
                    n = os.pwrite(self.fh.fileno(), view, offset)
                    view, offset = view[n:], offset + n
        except OSError as exc:
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror or exc}") from exc

    def _hold_replaced(self) -> int | None:
        """Open the regular file that the rename will replace, if it has no other name; return the fd.

        Replacing a file frees its pages inside the rename (on tmpfs 0.2 s per GB, a
        sixth of restoring it): held open, the file is freed when the fd is closed, on a
        thread of its own, after this call has returned.
        """
        try:
            st = os.lstat(self.path)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                return None
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        held = os.fstat(fd)
        if (held.st_ino, held.st_dev) != (st.st_ino, st.st_dev):
            os.close(fd)  # swapped in between: not the file to hold
            return None
        return fd

    def pad8(self) -> None:
        if self.pos % 8:
            self.write(b"\0" * (8 - self.pos % 8))

    def commit(self) -> None:
        try:
            self.fh.flush()
            # An empty file has no data to make durable: the rename is, by its folder's fsync.
            if os.fstat(self.fh.fileno()).st_size:
                os.fsync(self.fh.fileno())
            self.fh.close()
            replaced = self._hold_replaced() if self._release_in_background else None
            try:
                os.replace(self.tmp, self.path)
            finally:
                if replaced is not None:
                    threading.Thread(target=os.close, args=(replaced,), name="comm_codec-release", daemon=True).start()
        except OSError as exc:
            raise CheckpointError(f"cannot write {self.path}: {exc.strerror or exc}") from exc
        self.committed = True
        untrack_temp(self.tmp)
        _fsync_folder_after(self._folder, self._scope)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.fh.close()
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)
        untrack_temp(self.tmp)


# Temp files this process is writing: a termination signal removes them and exits at once
# (unwinding through a numba or zstd call from a signal handler is not safe).
_LIVE: set = set()
_LIVE_LOCK = threading.Lock()


def track_temp(path: str) -> None:
    """Remember a temp file, for :func:`remove_live_temps`."""
    with _LIVE_LOCK:
        _LIVE.add(path)


def untrack_temp(path: str) -> None:
    """Forget a temp file (renamed into place, or removed)."""
    with _LIVE_LOCK:
        _LIVE.discard(path)


def remove_live_temps() -> list:
    """Remove every temp file this process is writing; return their paths (signal-safe enough:
    no locks are waited for, only unlink is called)."""
    removed = []
    for path in list(_LIVE):
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path)
    return removed


def temp_name(name: str, pid: int | None = None) -> str:
    """Return the prefix of our temp files for output ``name``: hidden, marked, host, pid.

    Files made by :func:`comm_codec.core.atomic.create_temp` (and :class:`AtomicFile`)
    are ``.NAME.comm_codec-tmp.HOST.PID.XXXXXXXX.tmp``, which :func:`sweep_stale_temps`
    knows; NAME is shortened so that the whole name fits in 255 bytes.
    """
    return temp_prefix(name, pid)


_STALE = re.compile(r"^\..+\.%s\.(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.[^.]+\.tmp$" % TEMP_MARK)


def sweep_stale_temps(folder: str, keep=frozenset()) -> list:
    """Remove temp files that runs of ours on this host left in folder and that are dead.

    A run killed by SIGKILL (or a power cut) cannot remove its temp file; the next run
    that writes into the same folder does. Only files with our mark, this host's name and
    the pid of a process that no longer exists are removed; anything else is left alone.

    Args:
        folder: the directory.
        keep: names in ``folder`` never removed, whatever they look like (the outputs a
            run writes or copies there: a file of the input tree may be named like a
            temp file).

    Returns:
        The names removed.
    """
    host, removed = host_name(), []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        m = _STALE.match(name)
        if m is None or m["host"] != host or name in keep or _alive(int(m["pid"])):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))
            removed.append(name)
    return removed


class _SweepScope:
    """One run writing a tree: each folder swept once, the run's own output names kept."""

    def __init__(self, root: str, outputs):
        self.root = os.path.abspath(root)
        self.keep: dict = {}  # folder -> names the run writes there
        for rel in outputs:  # plain names joined by os.sep: no abspath needed per output
            sub, _, name = rel.rpartition(os.sep)
            self.keep.setdefault(sub, set()).add(name)
        self.keep = {os.path.join(self.root, sub) if sub else self.root: names for sub, names in self.keep.items()}
        self.swept: set = set()
        self.renamed: set = set()  # folders whose renames are made durable when the run ends
        self.umask = umask()  # read once per run: /proc/self/status is an open and a read per file
        self.lock = threading.Lock()

    def covers(self, folder: str) -> bool:
        return folder == self.root or folder.startswith(self.root + os.sep)

    def sweep(self, folder: str) -> None:
        with self.lock:  # writers into a folder wait until it is swept
            if folder not in self.swept:
                sweep_stale_temps(folder, frozenset(self.keep.get(folder, ())))
                self.swept.add(folder)


_SCOPES: list = []
_SCOPES_LOCK = threading.Lock()


@contextlib.contextmanager
def sweep_scope(root: str, outputs):
    """Within, outputs under ``root`` sweep each folder's stale temps once, never removing ``outputs``.

    Without a scope, every :class:`AtomicFile` sweeps its folder: for a tree of many files
    in one directory that is a listing per file (quadratic), and a file of the tree that
    is named like a dead run's temp, once copied, would be removed by the next file's sweep.

    Args:
        root: the output tree's root.
        outputs: every path the run may write or copy, relative to ``root`` (plain names
            joined by ``os.sep``, as :class:`.walk.Tree` lists them).
    """
    scope = _SweepScope(root, outputs)
    with _SCOPES_LOCK:
        _SCOPES.append(scope)
    try:
        yield scope
    finally:
        with _SCOPES_LOCK:
            _SCOPES.remove(scope)
        for folder in sorted(scope.renamed):
            _fsync_folder(folder)


def _scope_of(folder: str):
    with _SCOPES_LOCK:
        return next((sc for sc in reversed(_SCOPES) if sc.covers(folder)), None)


def _fsync_folder(folder: str) -> None:
    with contextlib.suppress(OSError):
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def _fsync_folder_after(folder: str, scope) -> None:
    """Make a rename into ``folder`` durable: now, or once for the folder when its run ends
    (a tree of 20 000 small files would otherwise pay 20 000 directory fsyncs)."""
    if scope is None:
        _fsync_folder(folder)
    else:
        with scope.lock:
            scope.renamed.add(folder)


def _sweep_before_writing(folder: str, scope) -> None:
    """Sweep ``folder`` as the run writing it (``scope``, from :func:`_scope_of`) says (see
    :func:`sweep_scope`), else every time."""
    if scope is None:
        sweep_stale_temps(folder)
    else:
        scope.sweep(folder)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process: alive
        return True
    return True


@contextlib.contextmanager
def atomic_output(path: str, mode: int | None = None, release_in_background: bool = False):
    """Yield an :class:`AtomicFile` for path; it is removed unless committed.

    ``release_in_background``: a file that the output replaces is freed on a thread of
    its own (for callers that may use more than one thread), not inside the commit.
    """
    out = AtomicFile(path, mode, release_in_background)
    try:
        yield out
    finally:
        if not out.committed:  # an exception is unwinding
            out.abort()


def check_paths(src: str, dst: str, base: str | None) -> None:
    if os.path.isdir(dst):
        raise IsADirectoryError(21, "Is a directory", dst)
    for other, what in ((src, "source"), (base, "base")):
        if other is not None and os.path.exists(dst) and os.path.samefile(other, dst):
            raise CheckpointError(
                f"output {dst} is the {what} file; choose another output path (the input is never modified)"
            )
