"""The errors checkpoint readers and writers raise, and the helper that raises them.

:class:`CheckpointError` (a file cannot be compressed or restored) and its subclass
:class:`ChainError` (a lossy file's base is missing) are defined with every other
comm_codec error in :mod:`comm_codec.core.errors`; this module names them for the
checkpoint package.
"""

from __future__ import annotations

from ..core.errors import ChainError, CheckpointError

__all__ = ["CheckpointError", "ChainError", "fail"]


def fail(path, what: str):
    """Raise CheckpointError("<path>: <what>")."""
    raise CheckpointError(f"{path}: {what}")
