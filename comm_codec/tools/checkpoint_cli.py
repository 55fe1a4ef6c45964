"""``comm-codec compress / decompress / verify / ls``: checkpoint files on the command line.

Registered by :mod:`comm_codec.tools.cli`, which turns the errors a user can cause (missing or
unreadable files, corrupt input, a wrong base, a full disk) into one line on stderr and
exit status 2. The work is done by :mod:`comm_codec.checkpoint.exact` (exact, the default)
and, with ``compress --lossy {excp,precision}``, by :mod:`comm_codec.checkpoint.lossy`;
``decompress``, ``verify`` and ``ls`` recognize a lossy file by its magic and hand it to
the latter. The parsers import nothing of the checkpoint package: each command imports
it when it runs, so that ``comm-codec --help`` does not load torch and numba.
"""

from __future__ import annotations

import argparse
import logging
import os

__all__ = ["register"]

log = logging.getLogger("comm_codec")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _used_threads(args) -> int | None:
    """--threads, capped at the cores this process may run on (saying so when it caps)."""
    if args.threads is None:
        return None
    cores = _cores()
    if args.threads > cores:
        log.warning("--threads %d is more than the %d cores this process may use; using %d", args.threads, cores,
                    cores)
        return cores
    return args.threads


def _refuse_existing(dst: str, force: bool) -> None:
    if not force and os.path.lexists(dst):
        raise ValueError(f"{dst} exists; pass --force to replace it")


def _threads(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads takes a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--threads takes a positive integer, got {value}")
    return value


def _is_lossy(path) -> bool:
    from ..checkpoint import lossy

    try:
        return lossy.is_lossy(path)
    except (IsADirectoryError, FileNotFoundError, PermissionError):
        return False  # the command itself reports it, with its own wording


def _cmd_compress(args) -> int:
    from ..checkpoint import exact as checkpoint, lossy

    if args.lossy is None:
        used = [f"--{n.replace('_', '-')}" for n in ("bits", "alpha", "beta", "keep_bits")
                if getattr(args, n) is not None]
        if used:
            raise ValueError(f"{', '.join(used)} only apply to lossy compression; add --lossy excp "
                             "(or --lossy precision for --keep-bits)")
        if args.base is not None and _is_lossy(args.base):
            raise ValueError(f"base {args.base} is a lossy file; an exact delta needs the previous checkpoint's "
                             "original (or use --lossy excp to continue the lossy chain)")
        _refuse_existing(args.dst, args.force)
        summary = checkpoint.compress_file(args.src, args.dst, base=args.base, threads=_used_threads(args))
        print(summary.line())
        return 0
    if args.lossy == "excp" and args.keep_bits is not None:
        raise ValueError("--keep-bits applies to --lossy precision; excp takes --bits, --alpha and --beta")
    if args.lossy == "precision":
        extra = [f"--{n}" for n in ("bits", "alpha", "beta") if getattr(args, n) is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} apply to --lossy excp; precision takes --keep-bits")
        if args.keep_bits is None:
            raise ValueError("--lossy precision needs --keep-bits K, the mantissa bits to keep (e.g. 7)")
    _refuse_existing(args.dst, args.force)
    summary = lossy.compress_file(
        args.src, args.dst, mode=args.lossy, base=args.base,
        bits=lossy.DEFAULT_BITS if args.bits is None else args.bits,
        alpha=lossy.DEFAULT_ALPHA if args.alpha is None else args.alpha,
        beta=lossy.DEFAULT_BETA if args.beta is None else args.beta,
        keep_bits=args.keep_bits, threads=_used_threads(args))
    print(summary.line())  # notes (keyframe, fallbacks) were logged by comm_codec.checkpoint.lossy
    return 0


def _cmd_decompress(args) -> int:
    from ..checkpoint import exact as checkpoint, lossy

    _refuse_existing(args.dst, args.force)
    threads = _used_threads(args)
    if _is_lossy(args.src):
        summary = lossy.decompress_file(args.src, args.dst, base=args.base, threads=threads)
    else:
        summary = checkpoint.decompress_file(args.src, args.dst, base=args.base, threads=threads)
    print(summary.line())
    return 0


def _cmd_verify(args) -> int:
    from ..checkpoint import exact as checkpoint, lossy

    if _is_lossy(args.file):
        print(lossy.verify_file(args.file, base=args.base, threads=_used_threads(args)).line())
        return 0
    summary = checkpoint.verify_file(args.file, base=args.base, threads=_used_threads(args))
    print(summary.line())
    if summary.digest is None:
        print("note: a delta checkpoint's restored bytes can only be checked against its original's digest with "
              "--base; every frame and segment checksum was checked")
    return 0


def _cmd_ls(args) -> int:
    from ..checkpoint import exact as checkpoint, lossy

    print(lossy.describe(args.file) if _is_lossy(args.file) else checkpoint.describe(args.file))
    return 0


def _int_in(flag: str, lo: int, hi: int):
    """An argparse type: an integer from lo to hi, or a one-line error naming the flag."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = lo - 1
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{flag} takes an integer from {lo} to {hi}, got {text!r}")
        return value
    return parse


def _nonneg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"takes a finite number >= 0, got {text!r}")
    return value


def register(subparsers) -> None:
    """Add the checkpoint subcommands to the ``comm-codec`` parser."""
    threads = dict(type=_threads, default=None, metavar="N",
                   help="worker threads (default: all cores, at most NUMBA_NUM_THREADS)")
    p = subparsers.add_parser(
        "compress", help="compress a checkpoint (safetensors, torch .pt/.bin, or any file) losslessly",
        description="Compress a checkpoint file; decompress restores it byte for byte. The output is "
                    "written atomically (a hidden temp file, renamed when complete; removed on error, Ctrl-C, "
                    "SIGTERM or SIGHUP; one left by SIGKILL is removed by the next run into that directory), "
                    "keeps the source's permission bits, and the source is only read. The summary's GB/s is "
                    "the original size over this call's wall time (not the process start-up).")
    p.add_argument("src", help="checkpoint to compress")
    p.add_argument("dst", help="compressed file to write")
    p.add_argument("--base", metavar="PREV",
                   help="previous checkpoint's original file: code tensors as deltas against it "
                        "(decompression will need it); with --lossy excp, the previous *lossy* file")
    p.add_argument("--threads", **threads)
    p.add_argument("--force", action="store_true", help="replace DST if it exists (default: refuse)")
    lossy = p.add_argument_group(
        "lossy (opt-in; decompression then restores an approximation, never the original bytes)")
    lossy.add_argument("--lossy", choices=("excp", "precision"), default=None,
                       help="excp: a checkpoint series with Adam state, ExCP-style (residuals and moments "
                            "pruned and quantized; first file without --base); precision: round mantissas")
    lossy.add_argument("--bits", type=_int_in("--bits", 1, 8), default=None, metavar="B",
                       help="excp: quantization bits, 2^B-1 centroids plus zero (default 4)")
    lossy.add_argument("--alpha", type=_nonneg, default=None, metavar="A",
                       help="excp: weight pruning strength, relative to sqrt(mean exp_avg_sq) (default 5e-4)")
    lossy.add_argument("--beta", type=_nonneg, default=None, metavar="B",
                       help="excp: moment pruning threshold in units of mean |exp_avg| (default 2)")
    lossy.add_argument("--keep-bits", type=_int_in("--keep-bits", 0, 23), default=None, metavar="K",
                       help="precision: mantissa bits to keep (bf16 has 7, fp16 10, fp32 23)")
    p.set_defaults(func=_cmd_compress)

    p = subparsers.add_parser("decompress", help="restore a compressed checkpoint, byte for byte",
                              description="Restore the original checkpoint; its digest (BLAKE3; sha256 for "
                                          "files written before) is checked before the output file appears.")
    p.add_argument("src", help="compressed checkpoint")
    p.add_argument("dst", help="where to write the original")
    p.add_argument("--base", metavar="PREV", help="the base it was compressed against (original file; for a "
                                                  "lossy file, its base lossy file if not beside it)")
    p.add_argument("--threads", **threads)
    p.add_argument("--force", action="store_true", help="replace DST if it exists (default: refuse)")
    p.set_defaults(func=_cmd_decompress)

    p = subparsers.add_parser(
        "verify", help="check a compressed checkpoint without writing anything",
        description="Decode FILE and check every checksum (index, segments, frames) and, when the original "
                    "can be rebuilt (no base needed, or --base given), the digest of the restored bytes. "
                    "Nothing is written. Exit status 0 if it is intact, 2 if not.")
    p.add_argument("file", help="compressed checkpoint")
    p.add_argument("--base", metavar="PREV", help="the base it was compressed against, to check the restored bytes' digest")
    p.add_argument("--threads", **threads)
    p.set_defaults(func=_cmd_verify)

    p = subparsers.add_parser(
        "ls", help="list a compressed checkpoint's tensors, dtypes, ratios and books",
        description="Print FILE's index as a table: source, base, ratio, and per tensor its dtype, shape, "
                    "kind, coding, chunk size, ratio and books (for a lossy file: mode, parameters and the "
                    "error achieved per tensor). Reads only the index; see verify to check the data.")
    p.add_argument("file", help="compressed checkpoint")
    p.set_defaults(func=_cmd_ls)
