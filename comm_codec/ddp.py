"""The public path of the DDP comm hook: everything of :mod:`comm_codec.comm.ddp`, under its documented name."""

from .comm.ddp import *  # noqa: F401,F403 (the public names, listed in its __all__)
from .comm.ddp import __all__  # noqa: F401
