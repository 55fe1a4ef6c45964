"""``comm-codec compress / decompress / verify / ls``: checkpoint files on the command line.

Registered by :mod:`comm_codec.cli`, which turns the errors a user can cause (missing or
unreadable files, corrupt input, a wrong base, a full disk) into one line on stderr and
exit status 2. The work is done by :mod:`comm_codec.checkpoint`.
"""

from __future__ import annotations

import argparse

__all__ = ["register"]


def _threads(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads takes a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--threads takes a positive integer, got {value}")
    return value


def _cmd_compress(args) -> int:
    from . import checkpoint

    summary = checkpoint.compress_file(args.src, args.dst, base=args.base, threads=args.threads)
    print(summary.line())
    return 0


def _cmd_decompress(args) -> int:
    from . import checkpoint

    summary = checkpoint.decompress_file(args.src, args.dst, base=args.base, threads=args.threads)
    print(summary.line())
    return 0


def _cmd_verify(args) -> int:
    from . import checkpoint

    summary = checkpoint.verify_file(args.file, base=args.base, threads=args.threads)
    print(summary.line())
    if summary.sha256 is None:
        print("note: a delta checkpoint's restored bytes can only be checked against its original with "
              "--base; every frame and segment checksum was checked")
    return 0


def _cmd_ls(args) -> int:
    from . import checkpoint

    print(checkpoint.describe(args.file))
    return 0


def register(subparsers) -> None:
    """Add the checkpoint subcommands to the ``comm-codec`` parser."""
    threads = dict(type=_threads, default=None, metavar="N",
                   help="worker threads (default: all cores, at most NUMBA_NUM_THREADS)")
    p = subparsers.add_parser(
        "compress", help="compress a checkpoint (safetensors, torch .pt/.bin, or any file) losslessly",
        description="Compress a checkpoint file; decompress restores it byte for byte. The output is "
                    "written atomically and the source is only read.")
    p.add_argument("src", help="checkpoint to compress")
    p.add_argument("dst", help="compressed file to write")
    p.add_argument("--base", metavar="PREV",
                   help="previous checkpoint's original file: code tensors as deltas against it "
                        "(decompression will need it)")
    p.add_argument("--threads", **threads)
    p.set_defaults(func=_cmd_compress)

    p = subparsers.add_parser("decompress", help="restore a compressed checkpoint, byte for byte",
                              description="Restore the original checkpoint; its sha256 is checked before "
                                          "the output file appears.")
    p.add_argument("src", help="compressed checkpoint")
    p.add_argument("dst", help="where to write the original")
    p.add_argument("--base", metavar="PREV", help="the base it was compressed against (original file)")
    p.add_argument("--threads", **threads)
    p.set_defaults(func=_cmd_decompress)

    p = subparsers.add_parser("verify", help="check a compressed checkpoint without writing anything")
    p.add_argument("file", help="compressed checkpoint")
    p.add_argument("--base", metavar="PREV", help="the base it was compressed against, to check the sha256")
    p.add_argument("--threads", **threads)
    p.set_defaults(func=_cmd_verify)

    p = subparsers.add_parser("ls", help="list a compressed checkpoint's tensors, dtypes, ratios and books")
    p.add_argument("file", help="compressed checkpoint")
    p.set_defaults(func=_cmd_ls)
