"""Train TinyLM with DDP and huffman_hook under torchrun: the demo, launched for real.

Same training as ``comm-codec demo`` (:func:`comm_codec.tools.demo.train`), but the
processes come from a launcher: rank, world size and rendezvous are read from the
environment torchrun sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so one command
line covers one machine or many. See ``launch_scripts/run_ddp.sh``.

Usage::

    torchrun --standalone --nproc-per-node 2 launch_scripts/train_ddp.py --steps 40
    # fixed books instead of the online warmup, and saving the online-built ones:
    torchrun ... launch_scripts/train_ddp.py --save-codebooks books.json
    torchrun ... launch_scripts/train_ddp.py --codebooks books.json
"""

from __future__ import annotations

import os
import sys

try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec.tools.procs import torchrun_main  # noqa: E402


def main(argv=None) -> int:
    from comm_codec.tools.demo import train

    return torchrun_main(
        train,
        argv,
        description=__doc__.split("\n\n")[0],
        prog="train_ddp.py",
        launcher="launch_scripts/run_ddp.sh",
        never="plain all-reduce",
    )


if __name__ == "__main__":
    sys.exit(main())
