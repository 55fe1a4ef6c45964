"""The public path of the DeepSpeed config plugin: everything of :mod:`comm_codec.comm.deepspeed`, under its documented name."""

from .comm.deepspeed import *  # noqa: F401,F403 (the public names, listed in its __all__)
from .comm.deepspeed import __all__  # noqa: F401
