"""Codebook drift and refresh: when fixed books have aged, rebuild them on every rank at once.

Symbol statistics move during training. Every ``drift_every`` steps
an owner (the DDP hook, the DeepSpeed plugin, an FSDP2 state) samples, on one coded
tensor of the step, how much its fixed books lose against optimal codes for that tensor
(:meth:`BookRefresh.measure`, a fraction). With a ``refresh_threshold`` the ranks agree
on the largest loss (one small all-reduce, :meth:`BookRefresh.agree`), so that all of
them open a *refresh window* at the same step when it passes the threshold: the owner
profiles ``refresh_steps`` more steps (still coding), then every rank builds the new
books from statistics summed over all ranks and swaps them in at the same step
(:meth:`BookRefresh.rebuild`). The owner decides where a step starts and which tensor
is sampled; this module decides when, and keeps the counts.
"""

from __future__ import annotations

import logging

import torch

from ..books.profiler import WarmupProfiler, coding_cost
from ..core.codebooks import CodebookSet
from .agreement import build_books, max_over_ranks
from .config import check

__all__ = ["BookRefresh"]

log = logging.getLogger(__name__)


class BookRefresh:
    """When to measure drift and when to rebuild books, the same on every rank.

    Args:
        drift_every: measure every this many steps (0: never).
        refresh_threshold: open a refresh window when the largest loss over the ranks
            exceeds this fraction; None: measure only (``drift``), never refresh.
        refresh_steps: steps profiled in a refresh window.

    Raises:
        ConfigError: a negative ``drift_every``, a threshold that is not positive or has no
            drift measurement to trigger it, ``refresh_steps`` < 1 (CommConfig's rules).
    """

    __slots__ = (
        # what users tune
        "drift_every",
        "refresh_threshold",
        "refresh_steps",
        # the refresh window, and what was measured
        "until",
        "drift",
        "refreshes",
    )

    def __init__(self, drift_every: int = 0, refresh_threshold: float | None = None, refresh_steps: int = 3):
        check(drift_every=drift_every, refresh_threshold=refresh_threshold, refresh_steps=refresh_steps)
        self.drift_every = drift_every
        self.refresh_threshold = refresh_threshold
        self.refresh_steps = refresh_steps
        self.until: int | None = None  # the step at which the open window's books are built
        self.drift: float | None = None
        self.refreshes = 0

    def due(self, step: int) -> bool:
        """Whether step ``step`` samples the drift."""
        return bool(self.drift_every) and step % self.drift_every == 0

    @property
    def refreshing(self) -> bool:
        """True while a refresh window is open (the owner profiles what it codes)."""
        return self.until is not None

    def swap_due(self, step: int) -> bool:
        """Whether the open window ends at step ``step`` (then :meth:`rebuild`, on every rank)."""
        return self.until is not None and step >= self.until

    @staticmethod
    def measure(tensor: torch.Tensor, books: CodebookSet, kind: str = "gradient") -> float:
        """Return how much ``books`` lose on ``tensor`` against optimal codes for it (a fraction)."""
        fixed, optimal, _ = coding_cost(tensor, books, kind)
        return fixed / optimal - 1.0 if optimal else 0.0

    def agree(self, loss: float, step: int, group, device=None) -> bool:
        """Publish this step's loss; open a window if the worst rank's passes the threshold.

        Collective over ``group`` when there is a threshold (every rank calls it at the
        same step, with its own loss); local otherwise.

        Args:
            loss: this rank's :meth:`measure`.
            step: the owner's step counter.
            group: the process group the ranks agree over.
            device: where the agreement's tensor lives (NCCL: a CUDA device).

        Returns:
            True when a refresh window opened: the owner starts a fresh profiler now.
        """
        opened = False
        if self.refresh_threshold is not None:
            loss = max_over_ranks(loss, group, device)
            if loss > self.refresh_threshold and self.until is None:
                log.info(
                    "comm_codec: books lose %.2f%% (> %.2f%%) at step %d; re-profiling for %d steps",
                    100 * loss,
                    100 * self.refresh_threshold,
                    step,
                    self.refresh_steps,
                )
                self.until = step + self.refresh_steps
                opened = True
        self.drift = loss
        return opened

    def rebuild(self, profiler: WarmupProfiler, group, step: int, source: str, device=None) -> CodebookSet:
        """Build the window's books from every rank's statistics (collective) and close it.

        Returns:
            The new books, identical on every rank by construction.
        """
        books = build_books(profiler, group, meta={"source": source, "step": step}, device=device)
        self.until = None
        self.refreshes += 1
        log.info("comm_codec: swapped in refreshed books %s at step %d (%s)", books.digest[:12], step, source)
        return books
