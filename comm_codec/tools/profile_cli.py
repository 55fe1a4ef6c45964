"""``comm-codec profile``: build books from a training run (``--entry``) or a checkpoint.

Two sources:

* ``--entry module:function`` — the user's training code, called as
  ``function(prof, steps)``: it runs ``steps`` training steps and, in each, hands the
  step's tensors to ``prof`` (``prof.observe(t, kind)``, or the helpers
  ``prof.observe_gradients(model)``, ``observe_parameters``, ``observe_optimizer``,
  ``attach_activations``), then calls ``prof.step()``. The first ``--steps`` steps build
  the books; the ``--holdout`` steps after them measure how the fixed books do on data
  they were not built from, against per-step optimal Huffman codes. Under ``torchrun``
  the process group is set up first (gloo) and histograms are summed over ranks, so every
  rank writes the same books; rank 0 prints the report.
* ``--checkpoint FILE`` — the tensors of a safetensors or torch file, found and given the
  kind ``weight`` or ``optimizer_state`` as ``comm-codec compress`` finds and records them.

The work is done by :mod:`comm_codec.tools.profiling`; this module imports neither torch
nor numba until the command runs. Example entry: ``launch_scripts/profile_entry_example.py``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

__all__ = ["register"]


def _load_entry(spec: str):
    if ":" not in spec:
        raise ValueError(f"--entry must be module:function, got {spec!r}")
    module_name, func_name = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--entry: cannot import {module_name!r}: {exc}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise ValueError(f"--entry: {module_name!r} has no function {func_name!r}")
    return func


def _cmd_profile(args) -> int:
    from ..books.profiler import WarmupProfiler
    from .profiling import SteppedProfiler, plot_books, profile_checkpoint, report

    if bool(args.entry) == bool(args.checkpoint):
        raise ValueError("give exactly one of --entry module:function or --checkpoint FILE")
    group_ready = False
    if args.entry:
        func = _load_entry(args.entry)
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo")
            group_ready = True
        prof = SteppedProfiler(args.steps, args.holdout, max_books=args.max_books)
        func(prof, args.steps + args.holdout)
        if prof.current < args.steps:
            raise ValueError(
                f"--entry ran {prof.current} steps (called prof.step() {prof.current} times); "
                f"expected {args.steps + args.holdout}"
            )
        heldout = prof.heldout
    else:
        prof = profile_checkpoint(args.checkpoint, WarmupProfiler(max_books=args.max_books))
        heldout = None
    meta = {"source": args.entry or args.checkpoint}
    if group_ready:  # every rank builds the same books from the histograms summed over ranks
        from ..comm.agreement import build_books

        books = build_books(prof, None, meta)
    else:
        books = prof.build(meta=meta)
    rank = 0
    if group_ready:
        import torch.distributed as dist

        rank = dist.get_rank()
    if rank == 0:
        books.save(args.out)
        print(report(books, heldout))
        print(f"\nwrote {args.out}: {len(books)} books, digest {books.digest}")
        if args.plot:
            plot_books(books, args.plot, prof)
    return 0


_ENTRY_CONTRACT = """\
Two sources, exactly one of them:

  --entry module:function   your training code, imported from the current directory and
                            called once as function(prof, steps), with
                            steps = --steps + --holdout. It must run that many training
                            steps; in each, hand the step's tensors to prof
                            (prof.observe(tensor, kind), or prof.observe_gradients(model),
                            prof.observe_parameters(model), prof.observe_optimizer(opt),
                            prof.attach_activations(modules)) and then call prof.step().
                            The first --steps steps build the books, the --holdout steps
                            after them score the books on data they were not built from.
                            Fewer prof.step() calls than --steps is an error.
  --checkpoint FILE         the tensors of a safetensors or torch (zip) file, as compress
                            finds them, with the kind compress records (optimizer_state
                            for optimizer state: exp_avg, momentum, optim*, a .state. key;
                            weight for the rest, model_state_dict/state_dict included).

Several processes (the histograms are summed over ranks, so every rank builds the same
books; rank 0 writes --out and prints the report):

  torchrun --standalone --nproc-per-node 2 launch_scripts/profile_codebooks.py \\
      --entry launch_scripts.profile_entry_example:train --steps 6 --holdout 6

Example entry: launch_scripts/profile_entry_example.py.
"""


def register(sub) -> None:
    """Add the ``profile`` subcommand to the CLI's subparsers."""
    p = sub.add_parser(
        "profile",
        help="build codebooks from a training run (--entry) or a checkpoint",
        description="Build codebooks from a training run or a checkpoint.",
        epilog=_ENTRY_CONTRACT,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--entry",
        metavar="MODULE:FUNCTION",
        help="training code called as function(prof, steps); see the contract below",
    )
    p.add_argument("--checkpoint", metavar="FILE", help="a safetensors or torch file to profile")
    p.add_argument("--steps", type=int, default=5, help="steps that build the books, with --entry (default: 5)")
    p.add_argument("--holdout", type=int, default=0, help="later steps that score the books, with --entry (default: 0)")
    p.add_argument("--out", default="codebooks.json", help="where to write the books (default: codebooks.json)")
    p.add_argument(
        "--max-books",
        type=int,
        default=8,
        help="largest group of books per stream, each chunk coded with its best; 1 = single books (default: 8)",
    )
    p.add_argument(
        "--plot",
        help="also draw each book's code lengths over its averaged distribution "
        "into this PNG (needs matplotlib: the 'plot' extra)",
    )
    p.set_defaults(func=_cmd_profile)
