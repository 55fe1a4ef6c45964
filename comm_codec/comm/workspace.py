"""Scratch buffers the coded collectives reuse from call to call."""

from __future__ import annotations

import torch

__all__ = ["Workspace"]


class Workspace:
    """Scratch buffers that the reductions reuse from call to call.

    The rank-order sum needs float32 accumulators and decode targets the size of a
    shard. Fresh ones cost their page faults on every call, several times the work of
    filling a reused one. A workspace keeps one buffer per role, grown as needed; give one to each thread that
    calls the collectives (the DDP hook keeps one per state). It is not thread-safe.
    """

    __slots__ = ("_buffers",)

    def __init__(self):
        self._buffers: dict = {}

    def take(self, role: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Return a 1-D tensor of ``numel`` elements for ``role``, reusing memory."""
        device = torch.device(device)
        key = (role, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._buffers[key] = torch.empty(max(numel, 1), dtype=dtype, device=device)
        return buf[:numel]

    def clear(self) -> None:
        """Free every buffer."""
        self._buffers.clear()

    def __getstate__(self):  # scratch memory never travels
        return {}

    def __setstate__(self, state):
        self._buffers = {}
