"""Starting training processes: spawned gloo ranks on 127.0.0.1, or the ranks torchrun made.

The demos (``comm-codec demo``, ``comm-codec demo --fsdp``) spawn their ranks with
:func:`spawn_ranks`; ``launch_scripts/train_ddp.py`` and ``train_fsdp.py`` run the same
training under torchrun with :func:`torchrun_main`; the benchmarks that spawn their own
ranks take a rendezvous port from :func:`free_port`.

Threads: numba's OpenMP layer sets the OpenMP thread count of the thread that first runs
a parallel kernel to ``NUMBA_NUM_THREADS`` (default: all cores), overriding
``torch.set_num_threads``. Ranks that share a machine would then oversubscribe its cores,
so both launchers give every process its share through the environment, before numba is
imported.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from .train_config import TrainConfig, add_training_arguments

__all__ = ["free_port", "spawn_ranks", "torchrun_main"]

log = logging.getLogger(__name__)


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- spawned ranks ------------------------------------------------------------------------------
def _worker(rank: int, world: int, port: int, train_fn, config: TrainConfig, log_level: int) -> None:
    """One spawned process: join the group, train, leave."""
    import torch
    import torch.distributed as dist

    logging.basicConfig(
        level=log_level if rank == 0 else max(log_level, logging.WARNING),
        format=f"%(levelname)s rank {rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    torch.set_num_threads(config.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        train_fn(config)
    finally:
        dist.destroy_process_group()


def spawn_ranks(
    train_fn,
    config: TrainConfig,
    world_size: int,
    *,
    port: int = 0,
    verbose: bool = False,
    prog: str = "comm-codec demo",
) -> int:
    """Spawn ``world_size`` gloo ranks on 127.0.0.1 that each run ``train_fn(config)``.

    A rank that raises or dies is reported in one line on stderr (the traceback with -v).

    Args:
        train_fn: a module-level function (spawn pickles it), e.g.
            :func:`comm_codec.tools.demo.train`.
        config: the :class:`TrainConfig` (its ``threads`` is each rank's torch and numba
            thread count).
        world_size: processes to spawn (at least 2).
        port: TCP port of the rendezvous (0: a free one).
        verbose: let the workers log at DEBUG and print their tracebacks.
        prog: the command's name, for error lines.

    Returns:
        The exit status: 0, or 1 if a rank failed.

    Raises:
        ValueError: fewer than 2 ranks or a port outside 0..65535 (before spawning).
    """
    import torch.multiprocessing as mp

    if world_size < 2:
        raise ValueError(f"--world-size must be >= 2 (a data-parallel run needs peers), got {world_size}")
    if not 0 <= port < 65536:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    port = port or free_port()
    for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):  # the workers inherit these
        os.environ.setdefault(var, str(config.threads))
    # Workers are quiet unless -v: their INFO lines would break the table.
    level = logging.DEBUG if verbose else logging.WARNING
    try:
        mp.spawn(_worker, args=(world_size, port, train_fn, config, level), nprocs=world_size, join=True)
    except mp.ProcessRaisedException as exc:
        lines = [line for line in exc.msg.strip().splitlines() if line.strip()]
        log.debug("worker %d traceback:\n%s", exc.error_index, exc.msg)
        print(f"{prog}: error on rank {exc.error_index}: {lines[-1] if lines else 'unknown error'}", file=sys.stderr)
        if not verbose:
            print(f"{prog}: run with -v for the worker's traceback", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as exc:
        print(f"{prog}: rank {exc.error_index} (pid {exc.error_pid}) died: {exc.msg.strip()}", file=sys.stderr)
        return 1
    return 0


# -- ranks started by torchrun ------------------------------------------------------------------
def _local_share() -> int:
    """This process's share of the machine's cores (torchrun sets LOCAL_WORLD_SIZE)."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def _torchrun_parser(description: str, never: str) -> argparse.ArgumentParser:
    """The demos' training options and those a torchrun script adds to them."""
    parser = argparse.ArgumentParser(description=description)
    add_training_arguments(parser)
    parser.add_argument(
        "--codebooks",
        metavar="PATH",
        help="code every step with these books (from --save-codebooks or "
        "comm-codec profile) instead of building them in a warmup",
    )
    parser.add_argument("--save-codebooks", metavar="PATH", help="rank 0 saves the books used to PATH")
    parser.add_argument(
        "--threads", type=int, default=0, help="torch and numba threads per process (default: cores / local processes)"
    )
    parser.add_argument(
        "--mode",
        choices=("auto", "always", "never"),
        default="auto",
        help="auto: code only where it measures faster (default); always: code every step "
        f"after warmup; never: {never}",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    return parser


def torchrun_main(train_fn, argv=None, *, description: str, prog: str, launcher: str, never: str) -> int:
    """Parse a torchrun training script's options and run ``train_fn(config)`` on its rank.

    Rank, world size and rendezvous come from the environment torchrun sets (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so one command line covers one machine or
    many; the group is gloo. Call it before anything imports numba: it sets
    ``NUMBA_NUM_THREADS`` (unless set) to this process's share of the cores.

    Args:
        train_fn: the training loop, e.g. :func:`comm_codec.tools.demo.train`.
        argv: the script's arguments (None: ``sys.argv[1:]``).
        description: the script's ``--help`` description.
        prog: the script's name, for error lines.
        launcher: the shell script that starts it, named when RANK is missing.
        never: what ``--mode never`` sends, for its help (e.g. "plain all-reduce").

    Returns:
        The exit status: 0, or 2 for bad options or a missing torchrun environment.
    """
    args = _torchrun_parser(description, never).parse_args(argv)
    os.environ.setdefault("NUMBA_NUM_THREADS", str(_local_share()))
    if "RANK" not in os.environ:
        print(f"{prog}: RANK is not set; start it with torchrun (see {launcher})", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else (logging.INFO if rank == 0 else logging.WARNING),
        format=f"%(levelname)s rank {rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    threads = min(args.threads or _local_share(), int(os.environ["NUMBA_NUM_THREADS"]))  # the codec's limit
    try:
        config = TrainConfig.from_args(args, threads=threads)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if config.codebooks and args.warmup_steps:
        log.info("--codebooks given: coding from step 1, no warmup")
    torch.set_num_threads(threads)
    dist.init_process_group("gloo")
    try:
        train_fn(config)
    finally:
        dist.destroy_process_group()
    return 0
