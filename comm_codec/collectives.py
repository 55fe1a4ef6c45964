"""The public path of the compressed collectives: everything of :mod:`comm_codec.comm.collectives`, under its documented name."""

from .comm.collectives import *  # noqa: F401,F403 (the public names, listed in its __all__)
from .comm.collectives import __all__  # noqa: F401
