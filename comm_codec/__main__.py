"""``python -m comm_codec`` is the ``comm-codec`` command line."""

import sys

from .tools.cli import console_main

sys.exit(console_main())
