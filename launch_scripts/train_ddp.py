"""Train TinyLM with DDP and huffman_hook under torchrun: the demo, launched for real.

Same training as ``comm-codec demo`` (it imports :func:`comm_codec.tools.demo.train`), but the
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

import argparse
import logging
import os
import sys

# Before numba is imported: its OpenMP layer sets the OpenMP thread count of the thread
# that first runs a parallel kernel to NUMBA_NUM_THREADS (default: all cores), overriding
# torch's; give it this process's share of the cores (torchrun sets LOCAL_WORLD_SIZE).
os.environ.setdefault("NUMBA_NUM_THREADS",
                      str(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec.tools.demo import TrainConfig, add_training_arguments, train  # noqa: E402

log = logging.getLogger("train_ddp")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_arguments(parser)
    parser.add_argument("--codebooks", metavar="PATH",
                        help="code every step with these books (from --save-codebooks or "
                             "comm-codec profile) instead of building them in a warmup")
    parser.add_argument("--save-codebooks", metavar="PATH", help="rank 0 saves the books used to PATH")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch and numba threads per process (default: cores / local processes)")
    parser.add_argument("--mode", choices=("auto", "always", "never"), default="auto",
                        help="auto: code only where it measures faster (default); always: code every step "
                             "after warmup; never: plain all-reduce")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("train_ddp.py: RANK is not set; start it with torchrun (see launch_scripts/run_ddp.sh)",
              file=sys.stderr)
        return 2
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.DEBUG if args.verbose else (logging.INFO if rank == 0 else logging.WARNING),
                        format=f"%(levelname)s rank {rank} %(name)s: %(message)s", stream=sys.stderr)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = args.threads or max(1, (os.cpu_count() or 1) // local)
    threads = min(threads, int(os.environ["NUMBA_NUM_THREADS"]))  # the codec's limit
    try:
        config = TrainConfig.from_args(args, threads=threads)
    except ValueError as exc:
        print(f"train_ddp.py: error: {exc}", file=sys.stderr)
        return 2
    if config.codebooks and args.warmup_steps:
        log.info("--codebooks given: coding from step 1, no warmup")
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    try:
        train(config)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
