"""``comm-codec compress / decompress / verify / ls``: checkpoint files on the command line.

Registered by :mod:`comm_codec.tools.cli`, which turns the errors a user can cause (missing or
unreadable files, corrupt input, a wrong base, a full disk) into one line on stderr and
exit status 2. The work is done by :mod:`comm_codec.checkpoint.exact` (exact, the default)
and, with ``compress --lossy {excp,precision}``, by :mod:`comm_codec.checkpoint.lossy`;
``decompress``, ``verify`` and ``ls`` recognize a lossy file by its magic and hand it to
the latter. A directory is handed to :mod:`comm_codec.checkpoint.directory`. The parsers
import nothing of the checkpoint package: each command imports it when it runs, so that
``comm-codec --help`` does not load torch and numba.

Names follow zstd's conventions: ``compress x`` writes ``x.cckp`` and ``decompress
x.cckp`` writes ``x`` (any other name needs DST), ``-m`` takes several inputs (as lz4's
``-m``: two names without it are SRC DST), ``-`` is stdin or stdout, ``-q`` and
``--progress`` turn the progress line off or on, and a terminal is never written to.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import sys
import tempfile

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
        log.warning("--threads %d is more than the %d cores this process may use; using %d", args.threads, cores, cores)
        return cores
    return args.threads


def _refuse_existing(dst: str, force: bool) -> None:
    if not force and dst != "-" and os.path.lexists(dst):
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
    # By the magic alone: the lossy module imports torch, which exact files never need.
    from ..checkpoint.container import identify
    from ..checkpoint.files import open_regular

    try:
        with open_regular(os.fspath(path)) as fh:
            return identify(fh.read(8)) == "lossy"
    except (IsADirectoryError, FileNotFoundError, PermissionError):
        return False  # the command itself reports it, with its own wording


def _progress(args) -> bool | None:
    """--progress: on; -q: off; neither: only when stderr is a terminal."""
    return True if args.progress else False if args.quiet else None


def _say(args, line: str, to_stderr: bool = False) -> None:
    """Print a summary line (on stderr when stdout carries the data), unless -q."""
    if not args.quiet:
        print(line, file=sys.stderr if to_stderr else sys.stdout, flush=True)


# -- names: SRC [DST], -m FILE..., and - for stdin/stdout -----------------------------------
def _default_name(src: str, op: str) -> str:
    """The output a command writes for ``src`` without DST: x -> x.cckp, and back."""
    from ..checkpoint.directory import SUFFIX

    if src == "-":
        return "-"
    if op == "compress":
        return src.rstrip("/") + SUFFIX
    stem = src.rstrip("/")
    if not stem.endswith(SUFFIX) or not os.path.basename(stem)[: -len(SUFFIX)]:
        raise ValueError(
            f"cannot tell where to decompress {src}: its name does not end in {SUFFIX}; give DST (or - for stdout)"
        )
    return stem[: -len(SUFFIX)]


def _pairs(args, op: str) -> list[tuple[str, str]]:
    """(input, output) for each input of a compress or decompress call."""
    paths = args.paths
    if args.multiple:
        if "-" in paths:
            raise ValueError("- (stdin) cannot be one of several inputs (-m); give it alone: SRC - or - DST")
        if args.base is not None and len(paths) > 1:
            raise ValueError("--base applies to one input; give the files one call each")
        return [(p, _default_name(p, op)) for p in paths]
    if len(paths) > 2:
        raise ValueError(
            f"{op} takes SRC [DST]; for several inputs pass -m (each FILE to "
            f"{'FILE.cckp' if op == 'compress' else 'FILE without .cckp'})"
        )
    return [(paths[0], paths[1] if len(paths) == 2 else _default_name(paths[0], op))]


def _refuse_terminal(dst: str, what: str) -> None:
    if dst == "-" and sys.stdout.isatty():
        raise ValueError(f"refusing to write {what} to a terminal; redirect stdout (> FILE or | ...) or give DST")


@contextlib.contextmanager
def _local_input(src: str, dst: str):
    """Yield a path for ``src``: itself, or for ``-`` stdin spooled to a temp file.

    The containers are read by offset (index at the end), so a stream is copied to a temp
    file first, in 1 MiB blocks: memory stays bounded, disk holds one copy. It goes in the
    output's directory, or in $TMPDIR when the output is stdout, and is removed afterwards
    (on SIGTERM or SIGHUP too; one a SIGKILL leaves is removed by the next run there).
    """
    if src != "-":
        yield src
        return
    from ..checkpoint.files import track_temp, untrack_temp
    from ..core.atomic import create_temp

    folder = tempfile.gettempdir() if dst == "-" else os.path.dirname(os.path.abspath(dst))
    fd, tmp = create_temp(os.path.join(folder, "stdin"))
    track_temp(tmp)
    try:
        with os.fdopen(fd, "wb") as fh:
            shutil.copyfileobj(sys.stdin.buffer, fh, _BLOCK)
        yield tmp
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        untrack_temp(tmp)


@contextlib.contextmanager
def _local_output(dst: str):
    """Yield a path to write for ``dst``: itself, or for ``-`` a temp file in $TMPDIR that is
    copied to stdout (in 1 MiB blocks) once complete, then removed."""
    if dst != "-":
        yield dst
        return
    from ..checkpoint.files import track_temp, untrack_temp
    from ..core.atomic import create_temp

    fd, tmp = create_temp(os.path.join(tempfile.gettempdir(), "stdout"))
    os.close(fd)
    track_temp(tmp)
    try:
        yield tmp
        with open(tmp, "rb") as fh:
            shutil.copyfileobj(fh, sys.stdout.buffer, _BLOCK)
        sys.stdout.buffer.flush()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        untrack_temp(tmp)


_BLOCK = 1 << 20


def _print_file(args):
    """A per-file progress line printer for the directory commands (None with -q)."""
    return None if args.quiet else (lambda result: print(result.line(), flush=True))


# -- the commands ---------------------------------------------------------------------------
def _cmd_compress(args) -> int:
    if args.lossy is None:
        used = [
            f"--{n.replace('_', '-')}"
            for n in ("max_error", "bits", "alpha", "beta", "keep_bits")
            if getattr(args, n) is not None
        ]
        if used:
            raise ValueError(
                f"{', '.join(used)} only apply to lossy compression; add --lossy excp "
                "(or --lossy precision for --keep-bits)"
            )
        if args.base is not None and _is_lossy(args.base):
            raise ValueError(
                f"base {args.base} is a lossy file; an exact delta needs the previous checkpoint's "
                "original or its exact compressed file (or use --lossy excp to continue the lossy "
                "chain)"
            )
    else:
        if args.codebooks is not None:
            raise ValueError("--codebooks applies to exact compression; the lossy modes use the shipped books")
        if args.lossy == "excp" and args.keep_bits is not None:
            raise ValueError(
                "--keep-bits applies to --lossy precision; excp takes --max-error (or --alpha), --bits and --beta"
            )
        if args.max_error is not None and args.alpha is not None:
            raise ValueError("give --max-error (an error budget) or --alpha (ExCP's pruning rule), not both")
        if args.lossy == "precision":
            extra = [
                f"--{n.replace('_', '-')}"
                for n in ("max_error", "bits", "alpha", "beta")
                if getattr(args, n) is not None
            ]
            if extra:
                raise ValueError(f"{', '.join(extra)} apply to --lossy excp; precision takes --keep-bits")
            if args.keep_bits is None:
                raise ValueError("--lossy precision needs --keep-bits K, the mantissa bits to keep (e.g. 7)")
    pairs = _pairs(args, "compress")
    books = None
    if args.codebooks is not None:
        from ..core.codebooks import CodebookSet

        books = CodebookSet.load(args.codebooks)
    for src, dst in pairs:
        _compress_one(args, src, dst, books)
    return 0


def _run_tree(args, run, src: str, dst: str, **options) -> None:
    """Compress or decompress a directory (``run``) with the command line's options; print its summary."""
    _refuse_existing(dst, args.force)
    summary = run(
        src,
        dst,
        threads=_used_threads(args),
        force=args.force,
        progress=_progress(args),
        on_file=_print_file(args),
        base=args.base,
        **options,
    )
    _say(args, summary.line())


def _compress_one(args, src: str, dst: str, books) -> None:
    from ..checkpoint import exact as checkpoint

    if src != "-" and os.path.isdir(src):
        from ..checkpoint import directory

        if args.lossy is not None or dst == "-":
            raise ValueError(
                f"{src} is a directory: it compresses into a directory, exactly "
                "(--lossy and - apply to single files; --base takes the previous directory)"
            )
        _run_tree(args, directory.compress_dir, src, dst, codebooks=books)
        return
    _refuse_existing(dst, args.force)
    _refuse_terminal(dst, "compressed data")
    with _local_input(src, dst) as path, _local_output(dst) as out:
        if args.lossy is None:
            summary = checkpoint.compress_file(
                path,
                out,
                base=args.base,
                threads=_used_threads(args),
                codebooks=books,
                progress=_progress(args),
                force=True,
            )
        else:
            from ..checkpoint import lossy

            summary = lossy.compress_file(
                path,
                out,
                method=args.lossy,
                base=args.base,
                max_error=args.max_error,
                bits=args.bits,
                alpha=args.alpha,
                beta=lossy.DEFAULT_BETA if args.beta is None else args.beta,
                keep_bits=args.keep_bits,
                threads=_used_threads(args),
                force=True,  # refused above without --force; "-" writes a temp file made for it
            )
    # lossy notes (keyframe, fallbacks) were logged by comm_codec.checkpoint.lossy
    _say(args, summary.line(), to_stderr=dst == "-")
    if getattr(summary, "note", None):
        _say(args, f"note: {summary.note}", to_stderr=dst == "-")


def _cmd_decompress(args) -> int:
    for src, dst in _pairs(args, "decompress"):
        _decompress_one(args, src, dst)
    return 0


def _decompress_one(args, src: str, dst: str) -> None:
    from ..checkpoint import exact as checkpoint

    if src != "-" and os.path.isdir(src):
        from ..checkpoint import directory

        if dst == "-":
            raise ValueError(f"{src} is a directory: it decompresses into a directory, not to stdout")
        _run_tree(args, directory.decompress_dir, src, dst)
        return
    _refuse_existing(dst, args.force)
    _refuse_terminal(dst, "a decompressed checkpoint")
    threads = _used_threads(args)
    with _local_input(src, dst) as path:
        if _is_lossy(path):
            from ..checkpoint import lossy

            with _local_output(dst) as out:
                # A stream has no directory: its base is looked for in the working directory.
                summary = lossy.decompress_file(
                    path, out, base=args.base, threads=threads, beside=os.getcwd() if src == "-" else None, force=True
                )
        elif dst == "-":
            # Streamed: the bytes reach stdout as they are decoded, in order.
            summary = checkpoint.decompress_file(
                path, sys.stdout.buffer, base=args.base, threads=threads, progress=_progress(args), force=True
            )
            sys.stdout.buffer.flush()
        else:
            summary = checkpoint.decompress_file(
                path, dst, base=args.base, threads=threads, progress=_progress(args), force=True
            )
    _say(args, summary.line(), to_stderr=dst == "-")


def _cmd_verify(args) -> int:
    from ..checkpoint import exact as checkpoint

    for file in args.files:
        if file != "-" and os.path.isdir(file) and os.path.isfile(os.path.join(file, ".metadata")):
            from ..checkpoint import dcp_tools  # a DCP directory: every frame, book table and item

            _say(args, dcp_tools.verify_dcp(file))
            continue
        if file != "-" and os.path.isdir(file):
            from ..checkpoint import directory

            _say(
                args,
                directory.verify_dir(
                    file, threads=_used_threads(args), progress=_progress(args), on_file=_print_file(args)
                ).line(),
            )
            continue
        with _local_input(file, "-") as path:
            if _is_lossy(path):
                from ..checkpoint import lossy

                _say(
                    args,
                    lossy.verify_file(
                        path, base=args.base, threads=_used_threads(args), beside=os.getcwd() if file == "-" else None
                    ).line(),
                )
                continue
            summary = checkpoint.verify_file(
                path, base=args.base, threads=_used_threads(args), progress=_progress(args)
            )
        _say(args, summary.line())
        if summary.digest is None:
            _say(
                args,
                "note: a delta checkpoint's restored bytes can only be checked against its original's "
                "digest with --base; every frame and segment checksum was checked",
            )
    return 0


def _cmd_ls(args) -> int:
    from ..checkpoint import exact as checkpoint

    for k, file in enumerate(args.files):
        if k:
            print()
        if os.path.isdir(file) and os.path.isfile(os.path.join(file, ".metadata")) or file.endswith(".distcp"):
            from ..checkpoint import dcp_tools

            print(dcp_tools.describe_dcp(file) if os.path.isdir(file) else dcp_tools.describe_dcp_file(file))
        elif os.path.isdir(file):
            from ..checkpoint import directory

            print(directory.describe_dir(file))
        elif _is_lossy(file):
            from ..checkpoint import lossy

            print(lossy.describe(file))
        else:
            print(checkpoint.describe(file))
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


_STREAMS = (
    "SRC or DST may be - for stdin or stdout. A stream is spooled to a temp file first (the "
    "container is read by offset), in the output's directory or, when the output is stdout, in "
    "$TMPDIR: memory stays bounded, that disk holds one copy. Writing to a terminal is refused."
)


def _quiet_and_progress(p) -> None:
    p.add_argument("-q", "--quiet", action="store_true", help="no progress and no summary lines (errors still print)")
    p.add_argument(
        "--progress",
        action="store_true",
        help="show the progress line on stderr even when it is not a terminal (default: only on one)",
    )


def _paths_and_base(p, *, paths: str, multiple: str, base: str) -> None:
    """The positional paths, ``-m`` and ``--base`` that compress and decompress share (their helps differ)."""
    p.add_argument("paths", nargs="+", metavar="SRC", help=paths)
    p.add_argument("-m", "--multiple", action="store_true", help=multiple)
    p.add_argument("--base", metavar="PREV", help=base)


def register(subparsers) -> None:
    """Add the checkpoint subcommands to the ``comm-codec`` parser."""
    threads = dict(
        type=_threads,
        default=None,
        metavar="N",
        help="worker threads (default: all cores, at most NUMBA_NUM_THREADS); for a directory, files coded at once",
    )
    p = subparsers.add_parser(
        "compress",
        usage="comm-codec compress [options] SRC [DST]\n       comm-codec compress [options] -m FILE...",
        help="compress a checkpoint (safetensors, torch .pt/.bin, any file, or a directory) losslessly",
        description="Compress a checkpoint file; decompress restores it byte for byte. DST defaults to SRC.cckp "
        "(-m: every argument is an input, each to FILE.cckp; stops at the first that fails). The "
        "output is written atomically (a hidden temp file, renamed when complete; removed on error, "
        "Ctrl-C, SIGTERM or SIGHUP; one left by SIGKILL is removed by the next run into that "
        "directory), keeps the source's permission bits, and the source is only read. The "
        "summary's GB/s is the original size over this call's wall time (not the process "
        "start-up). A directory SRC (sharded safetensors with their index JSON, a "
        "torch.distributed.checkpoint directory, any tree) is mirrored into the directory DST: "
        "each safetensors, torch or .distcp file F becomes F.cckp, every other file is copied, "
        "symlinks and special files are skipped (never followed), files are coded in parallel up "
        "to --threads, one line per file. " + _STREAMS,
        epilog="Sizes print in decimal units (kB, MB, GB: 1e3, 1e6, 1e9 bytes), as GB/s.",
    )
    _paths_and_base(
        p,
        paths="checkpoint file or directory, then the compressed file or directory to write (default SRC.cckp)",
        multiple="every argument is an input, each written to FILE.cckp",
        base="previous checkpoint: its original file or the .cckp compressed from it; code tensors "
        "as deltas against it (decompression will need it); with --lossy excp, the previous "
        "*lossy* file",
    )
    p.add_argument(
        "--codebooks",
        metavar="BOOKS.json",
        help="books to weigh against per-tensor books (from `comm-codec profile`; default: the shipped books)",
    )
    p.add_argument("--threads", **threads)
    p.add_argument(
        "--force",
        action="store_true",
        help="replace DST if it exists; for a directory, write into it (default: refuse)",
    )
    _quiet_and_progress(p)
    lossy = p.add_argument_group(
        "lossy (opt-in; decompression then restores an approximation, never the original bytes)"
    )
    lossy.add_argument(
        "--lossy",
        choices=("excp", "precision"),
        default=None,
        help="excp: a checkpoint series with Adam state, ExCP-style (residuals and moments "
        "pruned and quantized; first file without --base); precision: round mantissas",
    )
    lossy.add_argument(
        "--max-error",
        type=_nonneg,
        default=None,
        metavar="E",
        help="excp: the relative RMS error ||W'-W||/||W|| each weight tensor of a delta may have; "
        "thresholds and bits are chosen per tensor to fit it (default 3.5e-3)",
    )
    lossy.add_argument(
        "--bits",
        type=_int_in("--bits", 1, 8),
        default=None,
        metavar="B",
        help="excp: quantization bits of the moments (and with --alpha of the residuals), "
        "2^B-1 centroids plus zero (default 3; with --alpha 4)",
    )
    lossy.add_argument(
        "--alpha",
        type=_nonneg,
        default=None,
        metavar="A",
        help="excp: ExCP's pruning rule instead of --max-error: weight pruning strength, "
        "relative to sqrt(mean exp_avg_sq) (e.g. 5e-4)",
    )
    lossy.add_argument(
        "--beta",
        type=_nonneg,
        default=None,
        metavar="B",
        help="excp: moment pruning threshold in units of mean |exp_avg| (default 2)",
    )
    lossy.add_argument(
        "--keep-bits",
        type=_int_in("--keep-bits", 0, 23),
        default=None,
        metavar="K",
        help="precision: mantissa bits to keep (bf16 has 7, fp16 10, fp32 23)",
    )
    p.set_defaults(func=_cmd_compress)

    p = subparsers.add_parser(
        "decompress",
        usage="comm-codec decompress [options] SRC [DST]\n       comm-codec decompress [options] -m FILE.cckp...",
        help="restore a compressed checkpoint (file or directory), byte for byte",
        description="Restore the original checkpoint; its digest (BLAKE3; sha256 for files written before) is "
        "checked before the output file appears (when DST is stdout the bytes stream out as they "
        "are decoded, and a mismatch fails at the end). DST defaults to SRC without its .cckp "
        "suffix (a name without it is refused: give DST). A directory written by `compress DIR` "
        "is restored into the directory DST. " + _STREAMS,
    )
    _paths_and_base(
        p,
        paths="compressed file or directory, then where to write the original (default: SRC without .cckp)",
        multiple="every argument is an input FILE.cckp, each written to FILE",
        base="the base it was compressed against (its original file or the "
        ".cckp compressed from it; for a lossy file, its base lossy "
        "file if not beside it)",
    )
    p.add_argument("--threads", **threads)
    p.add_argument(
        "--force",
        action="store_true",
        help="replace DST if it exists; for a directory, write into it (default: refuse)",
    )
    _quiet_and_progress(p)
    p.set_defaults(func=_cmd_decompress)

    p = subparsers.add_parser(
        "verify",
        help="check a compressed checkpoint (or directory) without writing anything",
        description="Decode FILE and check every checksum (index, segments, frames) and, when the original "
        "can be rebuilt (no base needed, or --base given), the digest of the restored bytes. "
        "Nothing is written. A directory: every .cckp file in it, one line each. "
        "Exit status 0 if it is intact, 2 if not.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="compressed checkpoints or directories (- for stdin)")
    p.add_argument(
        "--base",
        metavar="PREV",
        help="the base it was compressed against (its original file or the "
        ".cckp compressed from it), to check the restored bytes' digest",
    )
    p.add_argument("--threads", **threads)
    _quiet_and_progress(p)
    p.set_defaults(func=_cmd_verify)

    p = subparsers.add_parser(
        "ls",
        help="list a compressed checkpoint's tensors, dtypes, ratios and books",
        description="Print FILE's index as a table: source, base, ratio, and per tensor its dtype, shape, "
        "kind, coding, chunk size, ratio and books (a shipped book or group by its name, "
        "kind/dtype/stream; for a lossy file: mode, parameters and the error achieved per tensor). "
        "A directory: one row per file, how it is stored and its ratio. Reads only the index; see "
        "verify to check the data.",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="compressed checkpoints or directories")
    p.set_defaults(func=_cmd_ls)
