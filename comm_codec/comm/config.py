"""The settings of coded communication: one frozen record, validated once, for every adapter.

:class:`CommConfig` is what the DDP hook's :class:`~comm_codec.ddp.HuffmanState`, FSDP2's
:class:`~comm_codec.fsdp.FSDPState` and the DeepSpeed ``"comm_codec"`` section all take:
the same keywords, checked here and nowhere else, with messages that name the key, the
value given and what is allowed::

    from comm_codec.comm.config import CommConfig
    config = CommConfig(warmup_steps=5, mode="auto", log_every=100)
    HuffmanState(config=config)                        # or HuffmanState(warmup_steps=5, ...)
    comm_codec.fsdp.register(model, config=config)     # or register(model, warmup_steps=5, ...)
    {"comm_codec": {"warmup_steps": 5, "mode": "auto", "log_every": 100}}   # ds_config.json

What an adapter takes beside it is its own and documented there: ``writer`` (a
TensorBoard ``SummaryWriter``; DDP and FSDP2), ``overlap`` (FSDP2), and the DeepSpeed
section's ``enabled``, ``kinds`` and ``monitor`` (:data:`DEEPSPEED_ONLY`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import numba

from ..core.codebooks import CodebookSet, as_codebook_set
from ..core.errors import ConfigError

__all__ = ["CommConfig", "CASTS", "MODES", "check", "make_config"]

# mode=: code only where it measures faster, code every step after warmup, never code.
MODES = ("auto", "always", "never")
# cast=: None is lossless; "bf16" (or "bfloat16") rounds fp32 tensors to bf16 before coding (lossy).
CASTS = (None, "bf16", "bfloat16")


def _int(key: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(key, value, f"an integer >= {minimum}")


def _fraction(key: str, value, allowed: str, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ConfigError(key, value, allowed)


def _check_threads(value) -> None:
    if value is not None:
        top = numba.config.NUMBA_NUM_THREADS
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
            raise ConfigError("threads", value, f"None or an integer in 1..{top} (NUMBA_NUM_THREADS)")


def _check_mode(value) -> None:
    if value not in MODES:
        raise ConfigError("mode", value, ", ".join(repr(m) for m in MODES))


def _check_cast(value) -> None:
    if value not in CASTS:
        raise ConfigError("cast", value, "None (lossless) or 'bf16'")


def _check_threshold(value) -> None:
    if value is not None:
        _fraction("refresh_threshold", value, "None or a fraction > 0", lambda v: v > 0)


# One check per setting that stands alone: CommConfig runs them all, and the parts of the
# engine that take a few settings (AutoSwitch, BookRefresh) run theirs through check().
_CHECKS = {
    "warmup_steps": lambda v: _int("warmup_steps", v, 0),
    "mode": _check_mode,
    "cast": _check_cast,
    "min_bytes": lambda v: _int("min_bytes", v, 0),
    "threads": _check_threads,
    "log_every": lambda v: _int("log_every", v, 0),
    "drift_every": lambda v: _int("drift_every", v, 0),
    "refresh_threshold": _check_threshold,
    "refresh_steps": lambda v: _int("refresh_steps", v, 1),
    "recheck_every": lambda v: _int("recheck_every", v, 1),
    "probe_steps": lambda v: _int("probe_steps", v, 1),
    "hysteresis": lambda v: _fraction("hysteresis", v, "a fraction in [0, 1)", lambda x: 0 <= x < 1),
}


def check(**settings) -> None:
    """Validate settings of :class:`CommConfig` by name, as CommConfig does (one place for every rule).

    Args:
        **settings: some of CommConfig's fields (``codebooks`` excepted).

    Raises:
        ConfigError: a value out of range or of the wrong type; ``refresh_threshold``
            without ``drift_every`` when both are given.
        TypeError: a name that is not a setting.
    """
    for key, value in settings.items():
        if key not in _CHECKS:
            raise TypeError(f"{key!r} is not a comm_codec setting; allowed: {', '.join(_CHECKS)}")
        _CHECKS[key](value)
    if settings.get("refresh_threshold") is not None and "drift_every" in settings and not settings["drift_every"]:
        raise ConfigError(
            "refresh_threshold",
            settings["refresh_threshold"],
            "None while drift_every is 0 (refresh_threshold needs drift_every > 0: drift is what triggers a refresh)",
        )


@dataclass(frozen=True, kw_only=True)
class CommConfig:
    """How coded communication runs: books, warmup, the coding decision, drift and logging.

    Every field is a keyword; the record is frozen (``dataclasses.replace`` makes a
    changed copy) and validated when made.

    Args:
        codebooks: a :class:`~comm_codec.CodebookSet`, the path of a saved one (loaded
            here), or None: the shipped defaults, or books built online when
            ``warmup_steps`` > 0.
        warmup_steps: steps run plainly while a profiler observes the traffic, before
            books are built (summed over the ranks) and coding starts; 0 codes from the
            start. Excludes ``codebooks``.
        mode: "auto" (code only where it measures faster on this run, agreed across
            ranks), "always" (code every step after warmup) or "never" (the framework's
            own collectives).
        cast: None (lossless) or "bf16": fp32 tensors are rounded to bf16 before coding.
            **Lossy**; only collectives that sum (all-reduce) accept it.
        min_bytes: a collective whose per-rank input is smaller than this runs plainly.
        threads: codec threads per rank (None: the rank's share of the node's cores,
            :func:`comm_codec.comm.engine.default_threads`).
        log_every: a traffic line every this many steps on rank 0 (0: never).
        drift_every: every this many steps, measure how much the books lose against
            optimal codes on the step's first coded tensor; 0 = off.
        refresh_threshold: past this measured loss (a fraction) on any rank, profile
            ``refresh_steps`` more steps and swap in rebuilt books; None = never. Needs
            ``drift_every``.
        refresh_steps: steps profiled for a refresh.
        recheck_every: auto mode: steps between two measurements of both modes.
        probe_steps: auto mode: steps timed per mode in a measurement.
        hysteresis: auto mode: the fraction by which the other mode must be faster to
            switch to it, in [0, 1).

    Raises:
        ConfigError: a value out of range or of the wrong type (the message names the
            key, the value and what is allowed); both ``codebooks`` and ``warmup_steps``.
        CodebookError: ``codebooks`` names a file that is missing or not a codebook set.
    """

    codebooks: CodebookSet | str | os.PathLike | None = None
    warmup_steps: int = 0
    mode: str = "auto"
    cast: str | None = None
    min_bytes: int = 4096
    threads: int | None = None
    log_every: int = 50
    drift_every: int = 0
    refresh_threshold: float | None = None
    refresh_steps: int = 3
    recheck_every: int = 200
    probe_steps: int = 4
    hysteresis: float = field(default=0.05)

    def __post_init__(self):
        check(**{name: getattr(self, name) for name in _CHECKS})
        books = self.codebooks
        if isinstance(books, (str, os.PathLike)):
            object.__setattr__(self, "codebooks", as_codebook_set(books))
        elif books is not None and not isinstance(books, CodebookSet):
            raise TypeError(f"codebooks must be a CodebookSet, a path or None, got {type(books).__name__}")
        if self.codebooks is not None and self.warmup_steps:
            raise ConfigError(
                "warmup_steps",
                self.warmup_steps,
                "0 when codebooks are given: give either codebooks (fixed books) or "
                "warmup_steps > 0 (books built online), not both",
            )

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """Return the names of the settings, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def shared(self) -> dict:
        """Return the settings that decide which collectives a rank issues (the ranks must agree on them)."""
        return {
            name: getattr(self, name) for name in self.fields() if name not in ("codebooks", "threads", "log_every")
        }

    def as_dict(self) -> dict:
        """Return the settings as a dict (``codebooks`` as its digest, or None)."""
        d = {name: getattr(self, name) for name in self.fields()}
        d["codebooks"] = self.codebooks.digest if self.codebooks is not None else None
        return d


def make_config(config: CommConfig | None, options: dict, owner: str) -> CommConfig:
    """Return ``config``, or one made from ``options`` (keywords of :class:`CommConfig`); not both.

    Args:
        config: a ready config, or None.
        options: keyword settings; with ``config``, they replace its fields.
        owner: who takes them, for the message.

    Raises:
        TypeError: an option that is not a :class:`CommConfig` field.
        ConfigError, CodebookError: as :class:`CommConfig`.
    """
    unknown = sorted(set(options) - set(CommConfig.fields()))
    if unknown:
        raise TypeError(f"{owner} got unknown option {unknown[0]!r}; allowed: {', '.join(CommConfig.fields())}")
    if config is None:
        return CommConfig(**options)
    if not isinstance(config, CommConfig):
        raise TypeError(f"config must be a CommConfig or None, got {type(config).__name__}")
    return dataclasses.replace(config, **options) if options else config
