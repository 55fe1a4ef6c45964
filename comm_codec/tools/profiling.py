"""Offline profiling: books from a training run's steps or a checkpoint's tensors, and their report.

* :class:`SteppedProfiler` is what ``comm-codec profile --entry`` hands the user's training
  code: the first ``build_steps`` steps build the books, the held-out steps after them
  keep histograms that :func:`report` scores the books on.
* :func:`profile_checkpoint` observes the tensors of a safetensors or torch file, found
  and classified (``weight`` or ``optimizer_state``) as ``comm-codec compress`` finds and
  classifies them (:func:`checkpoint_tensors`; nothing is unpickled).
* :func:`plot_books` draws each book over the distribution it was built from.

The command itself is :mod:`comm_codec.tools.profile_cli`.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from ..books.profiler import WarmupProfiler, book_cost, stream_counts
from ..core.codebooks import CodebookSet
from ..core.quoting import printable
from ..core.streams import SUPPORTED_DTYPES, spec_for

__all__ = ["SteppedProfiler", "report", "checkpoint_tensors", "profile_checkpoint", "plot_books"]

log = logging.getLogger(__name__)


class SteppedProfiler(WarmupProfiler):
    """A profiler that knows steps: the first ``build_steps`` build, the rest are held out.

    Args:
        build_steps: steps whose tensors build the books.
        holdout_steps: steps after them whose histograms are kept for evaluation.
    """

    def __init__(self, build_steps: int, holdout_steps: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.build_steps = build_steps
        self.holdout_steps = holdout_steps
        self.current = 0
        # (kind, dtype) -> list over held-out steps of int64[ns, 256]
        self.heldout: dict[tuple[str, str], list[np.ndarray]] = {}

    def observe(self, tensor: torch.Tensor, kind: str = "gradient") -> None:
        """Observe for the books during build steps, keep histograms during held-out steps."""
        if self.current < self.build_steps:
            super().observe(tensor, kind)
            return
        if self.current >= self.build_steps + self.holdout_steps or tensor.numel() == 0:
            return
        counts, _ = stream_counts(tensor, self.chunk_elems)
        key = (kind, spec_for(tensor.dtype).name)
        steps = self.heldout.setdefault(key, [])
        index = self.current - self.build_steps
        while len(steps) <= index:
            steps.append(np.zeros_like(counts))
        steps[index] += counts

    def step(self) -> None:
        """Mark the end of a training step."""
        self.current += 1


def report(books: CodebookSet, heldout: dict | None = None) -> str:
    """Return a text report: per key entropy, expected bits, ratio and group; held-out gaps.

    Args:
        books: the set to report on (with the stats the profiler stored).
        heldout: optional (kind, dtype) -> list of per-step int64[ns, 256] histograms;
            for each, the fixed books' bits are compared with per-step optimal Huffman
            codes (every stream, raw streams at 8 bits) and with the Shannon bound.

    Returns:
        The report.
    """
    lines = [
        f"{'kind':<17}{'dtype':<9}{'stream':>6}{'entropy':>9}{'bits':>8}{'ratio':>8}{'books':>6}"
        f"{'chunk bits: 1 book':>19}{'group':>7}{'optimal':>9}  id"
    ]
    for key, group in books.groups():
        st = books.stats(key)
        h, e = st.get("entropy_bits"), st.get("expected_bits")
        ratio = 8.0 / e if e else float("nan")
        chunk = "".join(
            f"{st[k]:>{w}.3f}" if k in st else f"{'-':>{w}}"
            for k, w in (("chunk_bits_one_book", 19), ("chunk_bits_group", 7), ("chunk_bits_optimal", 9))
        )
        lines.append(
            f"{key[0]:<17}{key[1]:<9}{key[2]:>6}{h if h is not None else float('nan'):>9.3f}"
            f"{e if e is not None else 8.0:>8.3f}{ratio:>8.3f}{len(group):>6}{chunk}"
            f"  {'raw' if group.raw else group.id}"
        )
    if heldout:
        lines.append("")
        lines.append("held-out steps (books built from earlier steps; each group's first book, whole steps):")
        lines.append(f"{'kind':<17}{'dtype':<9}{'steps':>6}{'fixed bits':>14}{'vs per-step opt':>17}{'vs Shannon':>12}")
        for (kind, dtype), steps in sorted(heldout.items()):
            fixed = optimal = shannon = 0.0
            for counts in steps:
                f, o, h = book_cost(books, kind, dtype, counts)
                fixed, optimal, shannon = fixed + f, optimal + o, shannon + h
            if optimal:
                lines.append(
                    f"{kind:<17}{dtype:<9}{len(steps):>6}{fixed:>14.0f}"
                    f"{100 * (fixed / optimal - 1):>+16.2f}%{100 * (fixed / shannon - 1):>+11.2f}%"
                )
    return "\n".join(lines)


def plot_books(books: CodebookSet, path: str, prof: WarmupProfiler | None = None) -> None:
    """Draw each coded book's implied probabilities 2^-len (bars) over the averaged
    distribution it was built from (line, when the profiler is given) into a PNG.

    Raises:
        ValueError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'comm_codec[plot]'") from None
    coded = [(k, b) for k, b in books.items() if not b.raw]
    fig, axes = plt.subplots(len(coded), 1, figsize=(8, 1.6 * len(coded) + 1), squeeze=False)
    for ax, (key, book) in zip(axes[:, 0], coded):
        bits = book.symbol_bits()
        ax.bar(np.arange(256), 2.0**-bits, width=1.0, color="tab:blue", label="2^-code length")
        dist = prof.distribution(key[0], key[1]) if prof is not None else None
        if dist is not None:
            p = np.where(dist[key[2]] > 0, dist[key[2]], np.nan)
            ax.plot(np.arange(256), p, color="tab:orange", lw=0.8, label="averaged distribution")
            ax.legend(fontsize=6, loc="upper center")
        ax.set_yscale("log")
        ax.set_xlim(0, 255)
        ax.set_ylabel("probability", fontsize=7)
        ax.set_title("%s / %s / stream %d  (book %s)" % (*key, book.id), fontsize=8)
        ax.tick_params(labelsize=6)
    axes[-1, 0].set_xlabel("symbol (stream 0: exponent relative to the chunk reference)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    log.info("wrote %s", printable(os.fspath(path), 4096))


def checkpoint_tensors(path: str):
    """Yield (name, kind, tensor) for each codable tensor of a safetensors or torch file.

    The tensors are found as ``comm-codec compress`` finds them
    (:func:`comm_codec.checkpoint.formats.find_tensors`: nested state dicts, optimizer
    state, any depth; nothing is unpickled), each with the kind compress records for it
    (``weight`` or ``optimizer_state``) and in the file's own dtype. Storages shared by
    several state-dict entries come once, named after the first; a storage whose shape is
    not recorded comes flat.

    Raises:
        FileNotFoundError, PermissionError: unreadable. ValueError: neither format.
    """
    import numpy as np

    from ..checkpoint.files import FileMap
    from ..checkpoint.formats import CODABLE, find_tensors

    m = FileMap(path)  # a FIFO or device is refused before it is opened
    try:
        fmt, found = find_tensors(m)
        if fmt == "generic":
            raise ValueError(f"{path}: neither a torch zip checkpoint nor a safetensors file")
        for t in found:
            if not t.codable:
                continue
            data = torch.from_numpy(np.array(m.u8(t.offset, t.nbytes)))  # a copy: the map closes
            tensor = data.view(CODABLE[t.dtype])
            yield t.name, t.kind, tensor.reshape(t.shape) if t.shape is not None else tensor
    finally:
        m.close()


def profile_checkpoint(path: str, prof: WarmupProfiler | None = None) -> WarmupProfiler:
    """Observe every supported tensor of a checkpoint file.

    Args:
        path: a safetensors or torch (zip) file.
        prof: a profiler to add to (default: a new one).

    Returns:
        The profiler.

    Raises:
        FileNotFoundError: no such file. ValueError: not a readable checkpoint.
    """
    prof = prof or WarmupProfiler()
    n = 0
    for _name, kind, tensor in checkpoint_tensors(path):
        if tensor.dtype not in SUPPORTED_DTYPES or tensor.numel() == 0:
            continue
        prof.observe(tensor, kind)
        n += 1
    log.info("observed %d tensors of %s", n, printable(os.fspath(path), 4096))
    return prof
