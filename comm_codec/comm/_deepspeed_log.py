"""What DeepSpeed users see of comm_codec: the plugin's lines, and a section nobody installed.

**The plugin's lines** (the codec is on, auto's decisions, the periodic traffic line) go
where DeepSpeed's own go: its logger, whose handler prints on stdout with DeepSpeed's
format, and whose level is the ds_config's ``"log_level"`` (DeepSpeed 0.19 defaults to
WARNING, which hides its INFO lines and ours alike). comm_codec's own switch
(``COMM_CODEC_VERBOSITY=info`` or ``comm_codec.set_verbosity("info")``) shows them too, on
its stderr handler, when DeepSpeed's level would hide them. Each line is written once.

**A "comm_codec" section that nothing installs** -- the user called
``deepspeed.initialize`` (or HF Trainer or Accelerate did) instead of
``comm_codec.deepspeed.initialize``, and registered nothing -- would train uncoded without
a word. :func:`watch`, run when comm_codec is first imported, wraps
``DeepSpeedEngine.backward`` (at once if DeepSpeed is imported, else when it is) so that an
engine's first backward checks its config: an enabled section with no plugin installed
logs one WARNING through DeepSpeed's logger, on global rank 0. That is the first place the
codec can see an engine it was not handed; nothing is imported or patched before DeepSpeed
itself is.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import logging
import sys

__all__ = ["PluginLog", "watch", "SILENT_SECTION"]

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


class PluginLog:
    """The DeepSpeed plugin's logger: DeepSpeed's logger where its level shows the line, else comm_codec's switch.

    Has the methods the coding engine calls (``info``, ``warning``, ``debug``, ``log``,
    ``isEnabledFor``).
    """

    def __init__(self, ds_logger: logging.Logger, name: str = "comm_codec.deepspeed"):
        self.ds = ds_logger
        self.ours = logging.getLogger(name)

    def isEnabledFor(self, level: int) -> bool:
        return self.ds.isEnabledFor(level) or self.ours.isEnabledFor(level)

    def log(self, level: int, msg, *args, **kwargs) -> None:
        kwargs.setdefault("stacklevel", 3)  # the caller's line in DeepSpeed's format, not this wrapper's
        if self.ds.isEnabledFor(level):
            self.ds.log(level, msg, *args, **kwargs)
        elif self.ours.isEnabledFor(level):
            self.ours.log(level, msg, *args, **kwargs)

    def debug(self, msg, *args, **kwargs) -> None:
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg, *args, **kwargs) -> None:
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg, *args, **kwargs) -> None:
        self.log(logging.WARNING, msg, *args, **kwargs)


def watch() -> None:
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
