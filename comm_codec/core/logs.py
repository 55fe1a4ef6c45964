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

:func:`watch_deepspeed` makes a ds_config ``"comm_codec"`` section that nothing installs
say so (a WARNING through DeepSpeed's logger at the engine's first backward).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import os
import sys

__all__ = ["ENV", "SILENT_SECTION", "set_verbosity", "verbosity_from_env", "watch_deepspeed"]

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


# -- a ds_config "comm_codec" section that nothing installs ------------------------------
# The user called deepspeed.initialize (or HF Trainer or Accelerate did) instead of
# comm_codec.deepspeed.initialize, and registered nothing: the run would train uncoded
# without a word. watch_deepspeed(), run when comm_codec is first imported, wraps
# DeepSpeedEngine.backward (at once if DeepSpeed is imported, else as it loads) so that an
# engine's first backward checks its config: an enabled section with no plugin installed
# logs one WARNING through DeepSpeed's logger, on global rank 0. That is the first place
# the codec can see an engine it was not handed; nothing is imported or patched before
# DeepSpeed itself is, and a process that never imports comm_codec cannot be told.
_ENGINE_MODULE = "deepspeed.runtime.engine"
_WATCHED = "_comm_codec_watched"
SILENT_SECTION = (
    'the DeepSpeed config has a "comm_codec" section, but comm_codec is not installed in this engine: '
    "its gradients travel uncoded. Build the engine with comm_codec.deepspeed.initialize(...) instead of "
    "deepspeed.initialize, or call comm_codec.deepspeed.register(engine) after it (HF Trainer: "
    "callbacks=[comm_codec.integrations.hf.CommCodecCallback()]; Accelerate: "
    'comm_codec.integrations.accelerate.register(accelerator, engine)); or set "comm_codec": '
    '{"enabled": false} to silence this'
)


def watch_deepspeed() -> None:
    """Have every DeepSpeed engine's first backward warn when its "comm_codec" section was never installed."""
    module = sys.modules.get(_ENGINE_MODULE)
    if module is not None:
        _patch(module)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Patches ``deepspeed.runtime.engine`` right after it executes (one shot: it then leaves sys.meta_path)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _ENGINE_MODULE:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader_exec = spec.loader.exec_module

        def exec_and_patch(module):
            loader_exec(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def _patch(module) -> None:
    cls = getattr(module, "DeepSpeedEngine", None)
    if cls is None or getattr(cls, _WATCHED, False):
        return
    backward = cls.backward

    @functools.wraps(backward)
    def backward_checked(self, *args, **kwargs):
        if "_comm_codec_checked" not in self.__dict__:
            self.__dict__["_comm_codec_checked"] = True
            _warn_if_silent(self)
        return backward(self, *args, **kwargs)

    cls.backward = backward_checked
    setattr(cls, _WATCHED, True)


def _warn_if_silent(engine) -> None:
    if getattr(engine, "_comm_codec", None) is not None or getattr(engine, "_comm_codec_disabled", False):
        return
    try:
        raw = engine.config if isinstance(engine.config, dict) else engine._config._param_dict
        section = raw.get("comm_codec") if isinstance(raw, dict) else None
        rank = engine.global_rank
    except AttributeError:  # an engine of another shape: nothing to say
        return
    if section is None or (isinstance(section, dict) and section.get("enabled", True) is False) or rank != 0:
        return
    from deepspeed.utils import logger

    logger.warning(SILENT_SECTION)
