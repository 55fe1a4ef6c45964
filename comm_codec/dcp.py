"""The public path of the DCP storage: everything of :mod:`comm_codec.checkpoint.dcp`, under its documented name."""

from .checkpoint.dcp import *  # noqa: F401,F403 (the public names, listed in its __all__)
from .checkpoint.dcp import __all__  # noqa: F401
