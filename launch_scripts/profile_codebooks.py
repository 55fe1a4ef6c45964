"""Build codebooks offline: the script form of ``comm-codec profile`` (works under torchrun).

    python launch_scripts/profile_codebooks.py --entry launch_scripts.profile_entry_example:train \
        --steps 6 --holdout 6 --out books.json
    python launch_scripts/profile_codebooks.py --checkpoint model.safetensors --out books.json
    torchrun --standalone --nproc-per-node 2 launch_scripts/profile_codebooks.py --entry ...

See comm_codec/profile_cli.py for the entry contract.
"""

import sys

from comm_codec.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["profile", *sys.argv[1:]]))
