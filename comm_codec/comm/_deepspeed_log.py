"""What DeepSpeed users see of comm_codec's plugin: its lines, where DeepSpeed's own go.

The plugin's lines (the codec is on, auto's decisions, the periodic traffic line) go to
DeepSpeed's logger, whose handler prints on stdout with DeepSpeed's format and whose level
is the ds_config's ``"log_level"`` (DeepSpeed 0.19 defaults to WARNING, which hides its
INFO lines and ours alike). comm_codec's own switch (``COMM_CODEC_VERBOSITY=info`` or
``comm_codec.set_verbosity("info")``) shows them too, on its stderr handler, when
DeepSpeed's level would hide them. Each line is written once. (A ds_config section that
nothing installs is :func:`comm_codec.core.logs.watch_deepspeed`'s.)
"""

from __future__ import annotations

import logging

__all__ = ["PluginLog"]


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
