"""Train TinyLM with FSDP2 and comm_codec's coded collectives under torchrun.

Same training as ``comm-codec demo --fsdp`` (:func:`comm_codec.tools.fsdp_demo.train_fsdp`),
but the processes come from a launcher: rank, world size and rendezvous are read from the
environment torchrun sets, so one command line covers one machine or many. See
``launch_scripts/run_fsdp.sh``.

Usage::

    torchrun --standalone --nproc-per-node 2 launch_scripts/train_fsdp.py --steps 40
    torchrun ... launch_scripts/train_fsdp.py --save-codebooks books.json   # keep the online books
    torchrun ... launch_scripts/train_fsdp.py --codebooks books.json        # code from step 1
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
    from comm_codec.tools.fsdp_demo import train_fsdp

    return torchrun_main(
        train_fsdp,
        argv,
        description=__doc__.split("\n\n")[0],
        prog="train_fsdp.py",
        launcher="launch_scripts/run_fsdp.sh",
        never="FSDP2's own collectives",
    )


if __name__ == "__main__":
    sys.exit(main())
