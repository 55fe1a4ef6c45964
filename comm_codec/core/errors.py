"""Every error comm_codec raises for bad data or a failed collective, under one base.

Each class keeps the built-in base it has always had (so ``except ValueError`` goes on
working) and adds :class:`CommCodecError`, so that one ``except`` catches them all.
They live in one leaf module (no torch, no numba) so that any layer, and the command
line before it imports anything heavy, can raise and catch them.
"""

from __future__ import annotations

__all__ = [
    "CommCodecError",
    "FrameError",
    "CodebookError",
    "CheckpointError",
    "ChainError",
    "CollectiveError",
    "AgreementError",
    "ConfigError",
    "LinkShapingError",
]


class CommCodecError(Exception):
    """The base of every error comm_codec raises for bad input or a failed collective."""


class FrameError(CommCodecError, ValueError):
    """A frame is truncated, corrupted, foreign, or needs a codebook this codec lacks."""


class CodebookError(CommCodecError, ValueError):
    """A codebook file or dict is malformed: bad lengths, wrong id, Kraft violated."""


class CheckpointError(CommCodecError, ValueError):
    """A checkpoint cannot be compressed or restored: corrupt, wrong base, unwritable."""


class ChainError(CheckpointError):
    """A lossy file's base is missing: ``missing`` is the path that was looked for."""

    def __init__(self, message: str, missing: str):
        super().__init__(message)
        self.missing = missing


class CollectiveError(CommCodecError, RuntimeError):
    """A compressed collective failed on some rank; raised on every rank of the group."""


class AgreementError(CollectiveError):
    """Ranks disagree where they must agree: settings, books, observed dtypes, an auto decision.

    Raised on every rank of the group, at the same agreement.
    """


class ConfigError(CommCodecError, ValueError):
    """A setting has a value that is not allowed: ``key``, ``value`` and ``allowed`` say which and what.

    Args:
        key: the setting's name (``"warmup_steps"``; ``"comm_codec.warmup_steps"`` in a
            DeepSpeed config).
        value: the value given.
        allowed: what the setting takes, in words.
    """

    def __init__(self, key: str, value, allowed: str):
        super().__init__(f"{key}={value!r}; allowed: {allowed}")
        self.key, self.value, self.allowed = key, value, allowed


class LinkShapingError(CommCodecError, RuntimeError):
    """A benchmark's shaped link cannot be made: not root, no iproute2, a namespace taken, tc failing."""


for _cls in (
    CommCodecError,
    FrameError,
    CodebookError,
    CheckpointError,
    ChainError,
    CollectiveError,
    AgreementError,
    ConfigError,
    LinkShapingError,
):
    _cls.__module__ = "comm_codec"  # shown (and caught) as comm_codec.FrameError etc.
del _cls
