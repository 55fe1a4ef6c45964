"""What a checkpoint call reports: its summary, sizes as the command line prints them, a progress line.

Used by the exact format (:mod:`.exact`), the lossy one and directories: the numbers a
call returns (:class:`Summary`), the one convention for sizes (:func:`human_bytes`), and
the progress meter on stderr (:class:`Progress`).
"""

from __future__ import annotations

import dataclasses
import sys
import time

__all__ = ["Summary", "human_bytes", "Progress"]


@dataclasses.dataclass
class Summary:
    """What one compress, decompress or verify call did.

    Attributes:
        op: "compress", "decompress" or "verify".
        original_bytes: size of the uncompressed checkpoint.
        compressed_bytes: size of the compressed file.
        seconds: wall time of the call.
        threads: worker threads used.
        format: the source's format ("safetensors", "torch_zip", "distcp", "torch_legacy", "generic").
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
