"""The FSDP2 demo: TinyLM sharded with ``fully_shard``, its collectives coded by comm_codec.fsdp.

``comm-codec demo --fsdp`` (and ``python -m comm_codec.tools.fsdp_demo``) spawns
``--world-size`` processes (gloo on 127.0.0.1), shards :class:`comm_codec.tools.tinylm.TinyLM`
with ``fully_shard`` (each block, then the root), codes its reduce-scatters and
all-gathers with :func:`comm_codec.fsdp.compress` after a warmup,
and prints on rank 0 a line per step and a summary: bytes the default collectives would
have sent against the bytes sent, per collective, codec time, and a check that the full
parameters gathered on every rank are bit-identical.

:func:`train_fsdp` runs on any initialized process group, so
``launch_scripts/train_fsdp.py`` runs the same training under torchrun.

Example::

    $ python -m comm_codec.tools.fsdp_demo --steps 20 --warmup-steps 5
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
import warnings

import torch
import torch.distributed as dist

from .procs import spawn_ranks
from .train_config import LEARNING_RATE, TrainConfig, add_training_arguments

__all__ = ["train_fsdp", "add_arguments", "run", "main"]

_MB = 1e6


def train_fsdp(config: TrainConfig, group=None) -> dict:
    """Train TinyLM with FSDP2 and comm_codec's coded collectives on an initialized group.

    Every rank calls this; rank 0 prints a line per step and the summary.

    Args:
        config: the :class:`~comm_codec.tools.train_config.TrainConfig` (``cast`` does not apply:
            FSDP's reduce dtype is the model's; ``mode`` is "always" in the demo, to show
            the bytes saved).
        group: the process group books are built over (default: the world); FSDP
            shards over the world.

    Returns:
        The summary (same on every rank): steps, losses, bytes per collective, ratios,
        codec seconds, ``identical`` (full parameters bit-identical on every rank).

    Raises:
        RuntimeError: ranks ended with different parameters, or a collective failed.
    """
    from torch.distributed.fsdp import fully_shard

    from ..comm.fsdp import compress
    from .tinylm import TinyLM, batches, load_corpus

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    main = rank == 0
    # TinyLM returns a view of its logits, and FSDP2 warns that an in-place op on it would
    # skip a hook; the loss takes none.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    torch.manual_seed(config.seed)
    model = TinyLM().to(config.torch_dtype)
    params = sum(p.numel() for p in model.parameters())
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    warmup = 0 if config.codebooks else config.warmup_steps
    state = compress(
        model,
        process_group=group,
        codebooks=config.codebooks,
        warmup_steps=warmup,
        mode=config.mode,
        threads=config.threads,
        log_every=0,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    data = batches(load_corpus(), config.batch, model.seq_len, seed=config.seed, rank=rank, world_size=world)
    if main:
        print(
            f"comm_codec: TinyLM ({params / 1e3:.0f}K parameters, {config.dtype}) sharded with FSDP2 over {world} "
            f"processes ({dist.get_backend()}); steps 1-{warmup} use FSDP's own collectives while the books are "
            "profiled, then every reduce-scatter and all-gather is Huffman-coded"
        )
        print()
        print(" step     loss  phase       reduce-scatter  all-gather  step ms")
        sys.stdout.flush()
    losses, before, coded_steps, start = [], state.stats(), 0, time.perf_counter()
    for step in range(1, config.steps + 1):
        phase = "warmup" if state.warming_up else ("coded" if state.coding else "plain")
        coded_steps += phase == "coded"
        t0 = time.perf_counter()
        x, y = next(data)
        loss = model.loss(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_ms = (time.perf_counter() - t0) * 1e3
        mean = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(mean, group=group)
        losses.append(mean.item() / world)
        now = state.stats()
        if main:
            rs, ag = (_step_ratio(before[k], now[k]) for k in ("reduce_scatter", "all_gather"))
            print(f"{step:5d}  {losses[-1]:7.4f}  {phase:<10}  {rs:>14}  {ag:>10}  {step_ms:7.0f}", flush=True)
        before = now
    wall = time.perf_counter() - start
    d = state.stats()
    totals = torch.tensor(
        [d["bytes_in"], d["bytes_out"], d["encode_seconds"], d["decode_seconds"]], dtype=torch.float64
    )
    dist.all_reduce(totals, group=group)
    identical, digest = _same_full_parameters(model, group)
    summary = {
        "world_size": world,
        "steps": config.steps,
        "warmup_steps": warmup,
        "losses": losses,
        "seconds": wall,
        "bytes_in": totals[0].item(),
        "bytes_out": totals[1].item(),
        "ratio": totals[0].item() / totals[1].item() if totals[1].item() else 1.0,
        "reduce_scatter_ratio": d["reduce_scatter"]["ratio"],
        "all_gather_ratio": d["all_gather"]["ratio"],
        "encode_seconds": totals[2].item() / world,
        "decode_seconds": totals[3].item() / world,
        "identical": identical,
        "param_digest": digest,
        "books": d["books"],
        "coded_steps": coded_steps,
    }
    if main:
        if config.save_codebooks:
            state.codebooks.save(config.save_codebooks)
        _print_summary(summary)
    if not identical:
        raise RuntimeError("ranks gathered different full parameters; the coded collectives are broken")
    return summary


def _step_ratio(before: dict, now: dict) -> str:
    """This step's ratio of one collective, from two stats() snapshots ('-' if nothing was coded)."""
    sent = now["bytes_out"] - before["bytes_out"]
    return f"{(now['bytes_in'] - before['bytes_in']) / sent:.2f}x" if sent else "-"


def _same_full_parameters(model: torch.nn.Module, group) -> tuple[bool, str]:
    """Return (every rank gathered bit-identical full parameters, this rank's sha256)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.full_tensor().detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    # The digests travel as bytes in a tensor: all_gather_object would unpickle what each peer sends.
    mine = torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)
    seen = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(seen, mine, group=group)
    return all(torch.equal(s, mine) for s in seen), h.hexdigest()


def _print_summary(s: dict) -> None:
    ok = "bit-identical" if s["identical"] else "DIFFERENT (bug)"
    plain = s["steps"] - s["warmup_steps"] - s["coded_steps"]
    rows = [
        (
            "steps",
            f"{s['steps']} ({s['warmup_steps']} warmup + {s['coded_steps']} coded"
            + (f" + {plain} plain" if plain else "")
            + f"), {s['seconds']:.1f} s",
        ),
        ("loss", f"{s['losses'][0]:.4f} -> {s['losses'][-1]:.4f} (mean over ranks)"),
        (
            "coded traffic",
            f"{s['bytes_in'] / _MB:.2f} MB with FSDP's collectives, {s['bytes_out'] / _MB:.2f} MB "
            "sent (all ranks, coded steps)",
        ),
        ("saved", f"{(s['bytes_in'] - s['bytes_out']) / _MB:.2f} MB"),
        (
            "ratio",
            f"{s['ratio']:.3f}x (reduce-scatter {s['reduce_scatter_ratio']:.3f}x, all-gather "
            f"{s['all_gather_ratio']:.3f}x)",
        ),
        ("codec time", f"encode {s['encode_seconds']:.2f} s, decode {s['decode_seconds']:.2f} s per rank"),
        ("books", (s["books"] or "-")[:16]),
        ("parameters", f"{ok} full parameters on all {s['world_size']} ranks (sha256 {s['param_digest'][:16]})"),
    ]
    print()
    for name, value in rows:
        print(f"{name:<17} {value}")
    sys.stdout.flush()


# -- the command ----------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the demo's options: the DDP demo's training options and ``--world-size``."""
    parser.add_argument("--world-size", type=int, default=2, help="processes to spawn (default: 2)")
    add_training_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Spawn the ranks and train; return the exit status (errors: one line, status 1 or 2)."""
    prog = "comm-codec demo --fsdp"
    try:
        config = TrainConfig.from_args(args)
        return spawn_ranks(
            train_fsdp,
            config,
            args.world_size,
            port=getattr(args, "port", 0),
            verbose=getattr(args, "verbose", False),
            prog=prog,
        )
    except ValueError as exc:  # (bad options: raised before any rank is spawned)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    """``python -m comm_codec.tools.fsdp_demo``: parse the options and :func:`run`."""
    parser = argparse.ArgumentParser(prog="python -m comm_codec.tools.fsdp_demo", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
