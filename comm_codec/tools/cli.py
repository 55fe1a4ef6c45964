"""The ``comm-codec`` command line (also ``python -m comm_codec``).

Each subcommand's parser is registered by its own module (``*_cli``); errors a user can
cause (missing files, corrupt input, bad options) print one clear line to stderr and exit
with status 2, never a traceback. Building the parser imports neither torch nor numba
(``--help``, ``--version`` and usage errors answer at once): every command imports what
it needs when it runs.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading

from ..core.errors import CodebookError, FrameError
from ..core.quoting import printable
from ..core.version import __version__
from . import checkpoint_cli, demo_cli, precompile_cli, profile_cli

__all__ = ["main"]

log = logging.getLogger("comm_codec")

# The longest error line the command prints (names from files in it are escaped).
_ERROR_LIMIT = 1000


def _cmd_inspect(args) -> int:
    """Print what a frame file's header says, or list a compressed (exact or lossy) checkpoint."""
    from ..checkpoint import container, exact
    from ..checkpoint.files import open_regular
    from ..core.errors import CheckpointError
    from ..core.frame import CHUNK_MASK, CHUNK_RAW0, CHUNK_ZERO, HEADER_BYTES, get_frame_parameters, header_size

    if args.file.endswith(".distcp"):
        from ..checkpoint import dcp_tools  # a DCP data file: its book table and items, not a frame

        print(dcp_tools.describe_dcp_file(args.file))
        return 0
    with open_regular(args.file) as fh:
        kind = container.identify(fh.read(8))
        if kind == "exact":
            print(exact.describe(args.file))
            return 0
        if kind == "lossy":
            from ..checkpoint import lossy  # imports torch, which the other kinds never need

            print(lossy.describe(args.file))
            return 0
        if kind is None:
            raise CheckpointError(f"{args.file}: {container.NOT_OURS}")
        data = _frame_head(fh, args.file, HEADER_BYTES, header_size)
    p = get_frame_parameters(data)
    raw = p.numel * p.spec.itemsize
    print(f"file        {printable(args.file, 4096)}")
    print(f"frame       comm_codec v{p.version}, {p.frame_bytes} bytes, header {p.header_bytes}")
    print(f"tensor      {p.spec.name}, {p.numel} elements ({raw} bytes raw), ratio {raw / max(1, p.frame_bytes):.3f}")
    print(f"chunks      {p.nchunks} x {p.chunk_elems} elements, checksums {'on' if p.checksums else 'off'}")
    if p.split:
        print(f"exponents   split: stream 0 codes the exponent alone, the {p.split} bits under it raw")
    flags = p.table["cflags"].astype(int)
    print(
        f"            {int((flags & CHUNK_ZERO).astype(bool).sum())} all-zero, "
        f"{int((flags & CHUNK_MASK).astype(bool).sum())} zero-masked"
    )
    for s, book in enumerate(p.book_ids):
        nraw = int(((flags & (CHUNK_RAW0 << s)) != 0).sum())
        print(f"stream {s}    book {book if int(book, 16) else 'raw'}, {nraw} of {p.nchunks} chunks raw")
    return 0


# Largest frame header and chunk table inspect reads (4 M chunks: a tensor of 2^40 elements).
_MAX_FRAME_HEAD = 64 << 20


def _frame_head(fh, path: str, head_bytes: int, header_size):
    """Read a frame file's header and chunk table, not its payload; refuse a file whose size
    the header does not declare. Returns the frame as a zero-copy view (header, table and,
    unread, the payload) so the frame's own checks run on it."""
    import mmap

    import numpy as np

    from ..core.errors import CheckpointError

    size = os.fstat(fh.fileno()).st_size
    fh.seek(0)
    head = fh.read(head_bytes)
    if len(head) < head_bytes:
        raise FrameError(f"{path}: frame too short: {len(head)} bytes, a header alone is {head_bytes}")
    hsize = header_size(head[6], int.from_bytes(head[20:24], "little"))
    if hsize > min(size, _MAX_FRAME_HEAD):
        raise CheckpointError(
            f"{path}: frame header and chunk table of {hsize} bytes, but the file has {size} "
            f"(inspect reads at most {_MAX_FRAME_HEAD}): truncated or corrupted"
        )
    # Mapped, never read as a whole: the checks touch the header and table pages only, and
    # compare the size the table declares with the file's.
    return np.frombuffer(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)


def _cmd_bench(args) -> int:
    from . import bench

    return bench.run(args.rest)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="comm-codec",
        description="Lossless fixed-codebook Huffman coding for distributed training traffic and checkpoints.",
    )
    parser.add_argument("--version", action="version", version=f"comm_codec {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "inspect",
        help="show the header of a frame file, or list a compressed (exact or lossy) checkpoint",
        description="Describe a comm_codec file without decoding it: a codec frame's header "
        "(dtype, elements, chunks, books), or a compressed checkpoint's table of "
        "tensors, dtypes, ratios and books (as `comm-codec ls`). Reads only FILE.",
    )
    p.add_argument("file", help="a frame file, or a file written by `comm-codec compress`")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("bench", help="codec benchmark against zstd, bz2 and zipnn (see --help)", add_help=False)
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)

    for register in (profile_cli.register, demo_cli.register, checkpoint_cli.register, precompile_cli.register):
        register(sub)
    parser.subcommands = sub.choices  # name -> parser, for usage errors in the subcommand's words
    return parser


def console_main() -> int:
    """The ``comm-codec`` program (and ``python -m comm_codec``): :func:`main` on this
    process's arguments, then a quick exit.

    A process that has loaded numba's registries spends a large part of its exit (about
    a quarter of a small file's ``compress``) collecting garbage among their objects.
    Frozen (``gc.freeze``), the objects alive at the end are not scanned again, and the
    exit is short. By then every output is committed and the command's
    threads are done; shutdown (atexit, flushing the streams) runs as usual.

    Returns:
        :func:`main`'s exit status.
    """
    status = main()
    gc.freeze()
    return status


def main(argv=None) -> int:
    """Run the command line.

    Args:
        argv: arguments (default: sys.argv[1:]).

    Returns:
        The exit status: 0 on success, 2 for user errors (bad input, missing files).
    """
    parser = _build_parser()
    # The benchmark has its own options (comm_codec.tools.bench); hand it whatever follows.
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        # The subcommand's own usage, which names the options it does take.
        parser.subcommands.get(args.command, parser).error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "bench":
        args.rest = [*extra, *args.rest]
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    previous = _on_termination()
    try:
        # numba first, through the modules that set its flags: a bad NUMBA_* setting is then
        # named in the error, and a missing cache is said once, whichever command runs.
        from ..core import precompile  # noqa: F401

        _numba_without_blas()
        _numba_without_extensions()
        _numba_cache_loads_without_setup()

        return int(args.func(args) or 0)
    except BrokenPipeError:
        # The reader went away (e.g. `comm-codec ls FILE | head`): not an error of ours.
        sys.stdout = None
        return 0
    except (FrameError, CodebookError, ValueError, TypeError) as exc:
        print(f"comm-codec: error: {printable(str(exc), _ERROR_LIMIT)}", file=sys.stderr)
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        print(f"comm-codec: error: {printable(str(exc.strerror or exc) + where, _ERROR_LIMIT)}", file=sys.stderr)
    except KeyboardInterrupt:
        print("comm-codec: interrupted; partial output removed", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 2


class _Refuse:
    """A meta path finder that makes one package (and its submodules) fail to import."""

    def __init__(self, name: str):
        self.name = name

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.name or fullname.startswith(self.name + "."):
            raise ImportError(f"{fullname} is not imported while numba sets up for comm-codec")
        return None


def _numba_without_blas() -> None:
    """Set numba's numpy support up without looking for BLAS: no comm_codec kernel does
    linear algebra.

    numba registers numpy's linear algebra when the first kernel of a process is loaded
    from its cache, and looks for BLAS by importing scipy.linalg: where scipy is
    installed that import (and its first call) was about a quarter of a small file's
    ``compress``. With scipy.linalg refused for that one import, numba records that
    it has no BLAS and goes on; scipy.linalg imports as usual afterwards. Only this
    process's command line does this; importing comm_codec changes nothing.
    """
    if "numba.np.arraymath" in sys.modules:
        return
    refuse = _Refuse("scipy.linalg")
    sys.meta_path.insert(0, refuse)
    try:
        import numba.np.arraymath  # noqa: F401
    except ImportError:
        pass  # numba itself broken or missing: the command's own import says so
    finally:
        sys.meta_path.remove(refuse)


def _numba_without_extensions() -> None:
    """Skip numba's search for third-party extensions (``numba_extensions`` entry points).

    numba runs it at the first kernel a process loads: it reads the entry points of every
    installed distribution, a noticeable part of a small ``compress`` in an environment of
    ML packages, and
    the command's kernels use no extension. Only this process's command line skips it;
    importing comm_codec changes nothing.
    """
    try:
        from numba.core import entrypoints
    except ImportError:  # pragma: no cover - numba itself broken: the command's own import says so
        return
    entrypoints._already_initialized = True  # numba keeps no public switch for it


def _numba_cache_loads_without_setup() -> None:
    """Load cached kernels without numba's typing and lowering set-up, which they do not use.

    Before every cache load numba refreshes its CPU target: it imports and registers the
    implementations of everything numba can compile (~70 modules: typed containers,
    numpy's random and linear algebra, cffi, ...) and types every ``@overload`` known so
    far, which was the largest part of a ``compress`` call's kernel loads. Loading machine
    code from the cache needs only numba's runtime (NRT: the allocator the kernels call),
    which this keeps. A kernel that has to be compiled after all goes through numba's
    compiler, which refreshes the target itself. Only this process's command line does
    this; importing comm_codec changes nothing.
    """
    try:
        from numba.core import caching
        from numba.core.registry import cpu_target
        from numba.core.runtime import rtsys
    except ImportError:  # pragma: no cover - numba itself broken: the command's own import says so
        return
    load = caching.Cache.load_overload
    if getattr(load, "_comm_codec", False):
        return

    def load_overload(self, sig, target_context):
        if target_context is not cpu_target.target_context or not hasattr(self, "_load_overload"):
            return load(self, sig, target_context)  # another target, or a numba without it: as numba does
        rtsys.initialize(target_context)
        return self._load_overload(sig, target_context)  # numba keeps no public name for it

    load_overload._comm_codec = True  # type: ignore[attr-defined]
    caching.Cache.load_overload = load_overload  # type: ignore[method-assign]


def _on_termination() -> dict:
    """Make SIGTERM and SIGHUP remove this run's temp files and exit; return the handlers replaced.

    Every output is a temp file until committed, so removing the live ones is all that
    cleaning up takes. The handler does that and exits at once (status 128 + signal):
    raising from a signal handler could unwind through a numba or zstd call. SIGKILL
    cannot be caught: the temp file it leaves (``.DST.comm_codec-tmp.HOST.PID.*.tmp``) is
    removed by the next run that writes into the same directory, once that PID is gone.
    """

    def handler(signum, frame):
        from ..checkpoint.files import remove_live_temps

        remove_live_temps()
        os.write(2, f"comm-codec: terminated by {signal.Signals(signum).name}; partial output removed\n".encode())
        os._exit(128 + signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, handler)
    return previous
