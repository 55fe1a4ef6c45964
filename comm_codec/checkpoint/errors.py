"""The error every checkpoint reader and writer raises, and the helper that raises it."""

from __future__ import annotations

__all__ = ["CheckpointError", "ChainError", "fail"]


from ..core.errors import ChainError, CheckpointError


def fail(path, what: str):
    """Raise CheckpointError("<path>: <what>")."""
    raise CheckpointError(f"{path}: {what}")
