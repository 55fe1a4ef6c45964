"""The public path of FSDP2's coded reduce-scatter and all-gather: everything of :mod:`comm_codec.comm.fsdp`, under its documented name."""

from .comm.fsdp import *  # noqa: F401,F403 (the public names, listed in its __all__)
from .comm.fsdp import __all__  # noqa: F401
