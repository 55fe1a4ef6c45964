"""What a checkpoint call reports: its summary, sizes as the command line prints them, a progress line.

Used by the exact format (:mod:`.exact`), the lossy one and directories: the numbers a
call returns (:class:`Summary`), the one convention for sizes (:func:`human_bytes`), and
the progress meter on stderr (:class:`Progress`).
"""

from __future__ import annotations

import dataclasses
import sys
import time

__all__ = ["Summary", "SizesRecord", "human_bytes", "Progress"]


class SizesRecord:
    """The traffic record's names over a checkpoint summary's sizes, and ``as_dict()``.

    Mixed into :class:`Summary`, :class:`~comm_codec.checkpoint.lossy.LossySummary` and
    :class:`~comm_codec.checkpoint.directory.DirSummary` (dataclasses with
    ``original_bytes`` and the stored size under :attr:`_STORED`), so that what means the
    same as in :class:`comm_codec.comm.stats.TrafficStats` reads under the same name.
    """

    _STORED = "compressed_bytes"

    @property
    def bytes_in(self) -> int:
        """The uncompressed bytes (``original_bytes``)."""
        return self.original_bytes  # type: ignore[attr-defined]

    @property
    def bytes_out(self) -> int:
        """The stored bytes (the compressed file or files)."""
        return getattr(self, self._STORED)

    @property
    def bytes_saved(self) -> int:
        return self.bytes_in - self.bytes_out

    def as_dict(self) -> dict:
        """Return the fields and the derived figures (``bytes_in``, ``bytes_out``,
        ``bytes_saved``, ``ratio``) as a plain dict, for JSON and loggers."""
        d = dataclasses.asdict(self)  # type: ignore[call-overload]
        d.update(
            original_bytes=self.bytes_in,
            bytes_in=self.bytes_in,
            bytes_out=self.bytes_out,
            bytes_saved=self.bytes_saved,
            ratio=self.ratio,  # type: ignore[attr-defined]
        )
        return d


@dataclasses.dataclass
class Summary(SizesRecord):
    """What one compress, decompress or verify call did, or a DCP Writer's saves / Reader's loads.

    The checkpoint sibling of the traffic record (:class:`comm_codec.comm.stats.TrafficStats`):
    the fields that mean the same thing there read under the same names, ``bytes_in``
    (uncompressed: ``original_bytes``), ``bytes_out`` (stored: ``compressed_bytes``),
    ``bytes_saved`` and ``ratio`` (:class:`SizesRecord`); :meth:`as_dict` gives them all
    as a plain dict.

    Attributes:
        op: "compress", "decompress" or "verify"; "save" (:meth:`comm_codec.dcp.Writer.stats`)
            or "load" (:meth:`comm_codec.dcp.Reader.stats`).
        original_bytes: size of the uncompressed checkpoint.
        compressed_bytes: size of the compressed file.
        seconds: wall time of the call.
        threads: worker threads used.
        format: the source's format ("safetensors", "torch_zip", "distcp", "torch_legacy",
            "generic"; "dcp" for a DCP Writer or Reader).
        tensors: tensors found; coded: those coded with frames; delta: those XOR-coded.
        note: for a compress whose tensors all stay opaque, one line: why, and what
            would help (None otherwise).
        digest: ``"blake3:<hex>"`` (``"sha256:<hex>"`` for a file that records sha256) of
            the original checkpoint, as checked; None when verify could not check it.
    """

    op: str
    original_bytes: int
    compressed_bytes: int
    seconds: float
    threads: int
    format: str
    tensors: int = 0
    coded: int = 0
    delta: int = 0
    digest: str | None = None
    note: str | None = None

    @property
    def sha256(self) -> str | None:
        """The original's sha256, for files that record one instead of BLAKE3."""
        return self.digest[7:] if self.digest and self.digest.startswith("sha256:") else None

    @property
    def ratio(self) -> float:
        return self.original_bytes / max(1, self.compressed_bytes)

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1e9 bytes/s) of uncompressed bytes over the call's wall time.

        The call runs from opening the files to the committed output: it includes a
        first-call kernel compile (numba's cache makes that once per install), not the
        interpreter's start-up and imports (seconds, for torch and numba).
        """
        return self.original_bytes / max(self.seconds, 1e-9) / 1e9

    def line(self) -> str:
        """Return the one-line summary the command line prints."""
        a, b = human_bytes(self.original_bytes), human_bytes(self.compressed_bytes)
        what = {
            "compress": f"compressed {a} -> {b}",
            "decompress": f"decompressed {b} -> {a}",
            "verify": f"verified {b} ({a} original, "
            f"{self.digest.split(':')[0] + ' ok' if self.digest else 'digest NOT checked'})",
            "save": f"saved {a} -> {b} (DCP, {self.coded} of {self.tensors} tensors coded)",
            "load": f"loaded {b} -> {a} (DCP, {self.coded} of {self.tensors} tensors coded)",
        }
        # An empty original has no ratio: the container's header and index are all there is.
        ratio = "empty original, no ratio" if self.original_bytes == 0 else f"ratio {self.ratio:.3f}"
        return (
            f"{what[self.op]} ({ratio}) in {self.seconds:.2f} s, "
            f"{self.gbps:.3f} GB/s (original bytes over this call's wall time, start-up excluded)"
        )


def human_bytes(n: int) -> str:
    """Return a size in the one convention the command line prints: decimal units, one decimal.

    ``human_bytes(14_000_000) == "14.0 MB"``, ``human_bytes(30_700_000) == "30.7 MB"``,
    ``human_bytes(512) == "512 B"`` (kB = 1e3, MB = 1e6, GB = 1e9 bytes, as GB/s is).
    """
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


# -- progress -------------------------------------------------------------------------------
class Progress:
    """A one-line progress meter on stderr, only when stderr is a terminal."""

    def __init__(self, label: str, total: int, enabled: bool | None):
        self.label, self.total, self.done = label, total, 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.start = self.last = time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and now - self.last >= 0.2:
            self.last = now
            pct = 100.0 * self.done / max(1, self.total)
            rate = self.done / max(now - self.start, 1e-9) / 1e9
            sys.stderr.write(
                f"\r{self.label} {pct:5.1f}% {human_bytes(self.done)} of {human_bytes(self.total)}, {rate:.3f} GB/s "
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
