"""One switch for what comm_codec says: an environment variable and a function, like transformers' verbosity.

By default a library stays quiet: comm_codec's INFO lines (the codec is on, auto's
decisions, the periodic traffic line) go to loggers without handlers, and only WARNINGs
reach stderr (Python's last-resort handler) -- among them a wait on compiling kernels,
which the user did not ask for. To see the INFO lines::

    COMM_CODEC_VERBOSITY=info torchrun ... train.py       # or, in the script:
    import comm_codec; comm_codec.set_verbosity("info")

Inside DeepSpeed the plugin logs through DeepSpeed's own logger, so its lines show beside
DeepSpeed's when the ds_config's ``"log_level"`` is "info"; where DeepSpeed's level hides
them, this switch shows them (:mod:`comm_codec.comm._deepspeed_log`). The library never calls ``logging.basicConfig``: the switch gives the
``comm_codec`` logger one stderr handler and a level, and ``set_verbosity(None)`` takes
them away again.
"""

from __future__ import annotations

import logging
import os

__all__ = ["ENV", "set_verbosity", "verbosity_from_env"]

ENV = "COMM_CODEC_VERBOSITY"
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_handler: logging.Handler | None = None


def set_verbosity(level: str | int | None) -> None:
    """Show comm_codec's log lines from ``level`` up on stderr (None: back to the library default).

    Args:
        level: "debug", "info", "warning", "error", a ``logging`` level number, or None.

    Raises:
        ValueError: an unknown level name.
    """
    global _handler
    logger = logging.getLogger("comm_codec")
    if _handler is not None:
        logger.removeHandler(_handler)
        _handler = None
    if level is None:
        logger.setLevel(logging.NOTSET)
        return
    if isinstance(level, str):
        if level.lower() not in _LEVELS:
            raise ValueError(f"verbosity {level!r}; allowed: {', '.join(_LEVELS)} or None")
        level = _LEVELS[level.lower()]
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter("[comm_codec %(levelname)s] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(level)


def verbosity_from_env() -> None:
    """Apply :data:`ENV` if it is set (an unknown value is ignored with a warning, not an import failure)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return
    try:
        set_verbosity(value)
    except ValueError as exc:
        logging.getLogger("comm_codec").warning("%s: %s", ENV, exc)
