"""The error every checkpoint reader and writer raises, and the helper that raises it."""

from __future__ import annotations

__all__ = ["CheckpointError", "fail"]


class CheckpointError(ValueError):
    """A checkpoint cannot be compressed or restored: corrupt, wrong base, unwritable."""


def fail(path, what: str):
    """Raise CheckpointError("<path>: <what>")."""
    raise CheckpointError(f"{path}: {what}")
