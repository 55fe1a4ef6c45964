"""Train TinyLM with FSDP2 and comm_codec's coded collectives under torchrun.

Same training as ``python -m comm_codec.tools.fsdp_demo`` (it imports
:func:`comm_codec.tools.fsdp_demo.train_fsdp`), but the processes come from a launcher: rank,
world size and rendezvous are read from the environment torchrun sets, so one command
line covers one machine or many. See ``launch_scripts/run_fsdp.sh``.

Usage::

    torchrun --standalone --nproc-per-node 2 launch_scripts/train_fsdp.py --steps 40
    torchrun ... launch_scripts/train_fsdp.py --save-codebooks books.json   # keep the online books
    torchrun ... launch_scripts/train_fsdp.py --codebooks books.json        # code from step 1
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Before numba is imported: give its OpenMP layer this process's share of the cores.
os.environ.setdefault("NUMBA_NUM_THREADS",
                      str(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec.tools.demo import TrainConfig, add_training_arguments  # noqa: E402
from comm_codec.tools.fsdp_demo import train_fsdp  # noqa: E402

log = logging.getLogger("train_fsdp")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser)
    parser.add_argument("--codebooks", metavar="PATH", help="code every step with these books instead of a warmup")
    parser.add_argument("--save-codebooks", metavar="PATH", help="rank 0 saves the books used to PATH")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch and numba threads per process (default: cores / local processes)")
    parser.add_argument("--mode", choices=("auto", "always", "never"), default="auto",
                        help="auto: code only where it measures faster (default); always: code every step "
                             "after warmup; never: FSDP2's own collectives")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("train_fsdp.py: RANK is not set; start it with torchrun (see launch_scripts/run_fsdp.sh)",
              file=sys.stderr)
        return 2
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.DEBUG if args.verbose else (logging.INFO if rank == 0 else logging.WARNING),
                        format=f"%(levelname)s rank {rank} %(name)s: %(message)s", stream=sys.stderr)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = min(args.threads or max(1, (os.cpu_count() or 1) // local), int(os.environ["NUMBA_NUM_THREADS"]))
    try:
        config = TrainConfig.from_args(args, threads=threads)
    except ValueError as exc:
        print(f"train_fsdp.py: error: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    try:
        train_fsdp(config)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
