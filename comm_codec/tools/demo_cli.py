"""``comm-codec demo``: train TinyLM on spawned CPU processes with coded collectives.

The README's first command. It spawns ``--world-size`` processes (gloo on 127.0.0.1) that
train :class:`comm_codec.tools.tinylm.TinyLM` with DDP and
:func:`comm_codec.ddp.huffman_hook` (:func:`comm_codec.tools.demo.train`), or, with
``--fsdp``, sharded with FSDP2 and its reduce-scatters and all-gathers coded
(:func:`comm_codec.tools.fsdp_demo.train_fsdp`).

This module imports neither torch nor numba, so that ``comm-codec --help`` stays fast:
the command imports the training code when it runs.

Example::

    $ comm-codec demo --steps 40 --warmup-steps 5
    $ comm-codec demo --fsdp --steps 20
"""

from __future__ import annotations

from .train_config import TrainConfig, add_training_arguments

__all__ = ["register"]


def register(sub) -> None:
    """Add the ``demo`` subcommand to the ``comm-codec`` subparsers."""
    p = sub.add_parser(
        "demo",
        help="train a small transformer on 2 CPU processes with compressed gradients",
        description="Train comm_codec's TinyLM with DDP on CPU processes (gloo, 127.0.0.1), "
        "gradients all-reduced by huffman_hook, and show what crossed the wire.",
    )
    p.add_argument("--world-size", type=int, default=2, help="processes to spawn (default: 2)")
    add_training_arguments(p)
    p.add_argument("--port", type=int, default=0, help="TCP port of the rendezvous (default: 0, a free one)")
    p.add_argument(
        "--fsdp", action="store_true", help="shard TinyLM with FSDP2 and code its reduce-scatters and all-gathers"
    )
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
    if args.fsdp:
        from .fsdp_demo import run

        return run(args)
    from .demo import train
    from .procs import spawn_ranks

    config = TrainConfig.from_args(args)
    return spawn_ranks(train, config, args.world_size, port=args.port, verbose=getattr(args, "verbose", False))
