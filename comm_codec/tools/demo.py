"""The DDP demo: TinyLM trained with DDP and ``huffman_hook``, and what crossed the wire.

``comm-codec demo`` (:mod:`comm_codec.tools.demo_cli`) spawns ``--world-size`` processes
(gloo on 127.0.0.1) that each run :func:`train`: :class:`comm_codec.tools.tinylm.TinyLM`
learns the Python standard library's own source with DDP and
:func:`comm_codec.ddp.huffman_hook`, and rank 0 prints one line per step, then a summary:
gradient bytes a plain all-reduce would have sent against the bytes sent, the ratio,
codec time, and a check that every rank ended with bit-identical parameters.

The demo codes every step after warmup (``mode="always"``), so that the bytes saved
show even on loopback, where the wire is fast and coding costs more time than it saves.
At the end it times both all-reduces of the last step's gradients (alternating, on
every rank) and prints what ``mode="auto"``, the hook's default, would decide from them
and why.

:func:`train` runs on any initialized process group, so ``launch_scripts/train_ddp.py``
runs the same training under torchrun.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .train_config import LEARNING_RATE, TrainConfig

__all__ = ["TrainConfig", "train"]

log = logging.getLogger(__name__)

_MB = 1e6


# -- the training loop ------------------------------------------------------------------------
def _precompile_kernels(config: TrainConfig, main: bool) -> None:
    """Precompile the codec's and the profiler's kernels before step 1, and say what it cost.

    A first run in a fresh environment compiles them, which takes tens of seconds; inside
    the loop that would be a silent pause in the first coded step. numba caches them, so
    later runs load them in well under a second.
    """
    from ..core.codec import Codec
    from .precompile_cli import precompile

    coded = config.cast or config.dtype
    start = time.perf_counter()
    precompile(Codec(), [coded], profiler=True)
    seconds = time.perf_counter() - start
    if main:
        note = "compiled: a first run's cost, numba caches them" if seconds > 2 else "from numba's cache"
        print(f"codec kernels for {coded}: ready in {seconds:.1f} s ({note})")
        print()


def train(config: TrainConfig, group=None) -> dict:
    """Train TinyLM with DDP and ``huffman_hook`` on an initialized process group.

    Every rank calls this; rank 0 prints a line per step and the summary.

    Args:
        config: the :class:`TrainConfig`.
        group: the process group (default: the world).

    Returns:
        The summary (same on every rank): steps, losses, bytes, ratio, codec seconds,
        ``identical`` (bool: parameters bit-identical on every rank) and ``books``.

    Raises:
        RuntimeError: ranks ended with different parameters, or a collective failed.
    """
    from torch.nn.parallel import DistributedDataParallel

    from ..comm.ddp import HuffmanState, huffman_hook
    from .tinylm import TinyLM, batches, load_corpus

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    main = rank == 0
    torch.manual_seed(config.seed)
    model = TinyLM().to(config.torch_dtype)
    ddp = DistributedDataParallel(model, process_group=group)
    warmup = 0 if config.codebooks else config.warmup_steps
    state = HuffmanState(
        group,
        codebooks=config.codebooks,
        warmup_steps=warmup,
        cast=config.cast,
        threads=config.threads,
        log_every=0,
        mode=config.mode,
    )
    ddp.register_comm_hook(state, huffman_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LEARNING_RATE)
    data = batches(load_corpus(), config.batch, model.seq_len, seed=config.seed, rank=rank, world_size=world)

    params = sum(p.numel() for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Bytes all ranks send per step in ring all-reduces of every gradient (CommStats's count).
    plain_step = 2 * (world - 1) / world * grad_bytes * world
    if main:
        _print_header(config, params, world, warmup)
    _precompile_kernels(config, main)
    if main:
        print(" step     loss  phase        ratio  MB saved  step ms", flush=True)

    losses, saved_before, coded_steps, start = [], 0, 0, time.perf_counter()
    for step in range(1, config.steps + 1):
        warming = state.warming_up
        t0 = time.perf_counter()
        x, y = next(data)
        opt.zero_grad(set_to_none=True)
        logits = ddp(x)  # through DDP's forward, which arms the gradient all-reduce
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))  # as TinyLM.loss
        loss.backward()  # DDP waits here for every bucket's hook
        phase = "warmup" if warming else ("compressed" if state.stats()["coding"] else "plain")
        coded_steps += phase == "compressed"
        opt.step()
        step_ms = (time.perf_counter() - t0) * 1e3
        # One small all-reduce per step: mean loss, and the bytes saved by all ranks.
        packed = torch.tensor([loss.item(), float(state.stats()["bytes_saved"])], dtype=torch.float64)
        dist.all_reduce(packed, group=group)
        mean_loss, saved = packed[0].item() / world, packed[1].item()
        losses.append(mean_loss)
        if main:
            step_saved = saved - saved_before
            ratio = f"{plain_step / (plain_step - step_saved):.2f}x" if phase == "compressed" else "-"
            print(
                f"{step:5d}  {mean_loss:7.4f}  {phase:<10}  {ratio:>6}  {saved / _MB:8.2f}  {step_ms:7.0f}", flush=True
            )
        saved_before = saved
    wall = time.perf_counter() - start

    d = state.stats()
    # With mode="auto" the run decided itself: report that decision, not a second measurement.
    auto = d["decision"] if config.mode == "auto" and d["decision"] is not None else _auto_verdict(model, state, group)
    totals = torch.tensor(
        [d["coded_bytes_in"], d["coded_bytes_out"], d["encode_seconds"], d["decode_seconds"]], dtype=torch.float64
    )
    dist.all_reduce(totals, group=group)
    identical, digest = _same_parameters(model, group)
    plain_total = plain_step * config.steps
    summary = {
        "world_size": world,
        "steps": config.steps,
        "warmup_steps": warmup,
        "losses": losses,
        "plain_bytes": plain_total,
        "sent_bytes": plain_total - saved,
        "coded_bytes_in": totals[0].item(),
        "coded_bytes_out": totals[1].item(),
        "coded_ratio": totals[0].item() / totals[1].item() if totals[1].item() else 1.0,
        "mode": config.mode,
        "ratio": plain_total / (plain_total - saved),
        "bytes_saved": saved,
        "encode_seconds": totals[2].item() / world,
        "decode_seconds": totals[3].item() / world,
        "identical": identical,
        "param_digest": digest,
        "books": state.codebooks.digest,
        "seconds": wall,
        "auto": auto,
        "coded_steps": coded_steps,
    }
    if main:
        if config.save_codebooks:
            state.codebooks.save(config.save_codebooks)
            log.info("saved the books to %s", config.save_codebooks)
        _print_summary(summary, config)
    if not identical:
        raise RuntimeError("ranks ended with different parameters; the compressed all-reduce is broken")
    return summary


def _auto_verdict(model: torch.nn.Module, state, group, reps: int = 4) -> dict:
    """Time plain and coded all-reduces of the last gradients; decide as mode="auto" would.

    Collective: every rank times the same all-reduces, alternating plain and coded, and
    :func:`comm_codec.comm.autoswitch.agree` weighs the slowest rank's medians.
    """
    from ..comm import collectives
    from ..comm.autoswitch import agree

    grads = [p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]
    flat = torch.cat(grads[::-1])  # DDP's bucket order: parameters reversed
    buf = torch.empty_like(flat)
    world = dist.get_world_size(group)
    times = {False: [], True: []}
    workspace = collectives.Workspace()
    for rep in range(reps + 1):  # the first round warms both up, untimed
        for coded in (False, True):
            buf.copy_(flat)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            if coded:
                collectives.all_reduce(buf, state.codec, group, average=True, workspace=workspace)
            else:
                buf.div_(world)
                dist.all_reduce(buf, group=group)
            if rep:
                times[coded].append(time.perf_counter() - t0)
    return agree(times[False], times[True], state.step, group, state.switch.hysteresis, unit="ms per all-reduce")


def _same_parameters(model: torch.nn.Module, group) -> tuple[bool, str]:
    """Return (all ranks hold bit-identical parameters, this rank's sha256 digest)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    mine = torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    return all(torch.equal(g, mine) for g in gathered), h.hexdigest()


def _print_header(config: TrainConfig, params: int, world: int, warmup: int) -> None:
    cast = ", cast to bf16 for the wire (lossy)" if config.cast and config.dtype == "fp32" else ""
    print(
        f"comm_codec: TinyLM ({params / 1e3:.0f}K parameters, {config.dtype}) on {world} processes "
        f"({dist.get_backend()}), {config.batch} x 128 bytes of Python stdlib source per rank and step"
    )
    if config.codebooks:
        print(f"gradients: DDP + huffman_hook, coded from step 1 with the books in {config.codebooks}{cast}")
    else:
        print(
            f"gradients: DDP + huffman_hook; steps 1-{warmup} all-reduce plainly while the books are "
            f"profiled, then every bucket is Huffman-coded{cast}"
        )
    sys.stdout.flush()


def _print_summary(s: dict, config: TrainConfig) -> None:
    coded = s["coded_steps"]
    plain = s["steps"] - s["warmup_steps"] - coded
    coded_ratio = s["coded_ratio"]
    ok = "bit-identical" if s["identical"] else "DIFFERENT (bug)"
    rows = [
        (
            "steps",
            f"{s['steps']} ({s['warmup_steps']} warmup + {coded} compressed"
            + (f" + {plain} plain" if plain else "")
            + f"), {s['seconds']:.1f} s",
        ),
        ("loss", f"{s['losses'][0]:.4f} -> {s['losses'][-1]:.4f} (mean over ranks)"),
        (
            "gradient traffic",
            f"{s['plain_bytes'] / _MB:.2f} MB with a plain all-reduce, {s['sent_bytes'] / _MB:.2f} MB sent (all ranks)",
        ),
        ("ratio", f"{s['ratio']:.3f}x overall, {coded_ratio:.3f}x on compressed buckets"),
        ("saved", f"{s['bytes_saved'] / _MB:.2f} MB"),
        ("codec time", f"encode {s['encode_seconds']:.2f} s, decode {s['decode_seconds']:.2f} s per rank"),
        ("books", s["books"][:16] + (f" (saved to {config.save_codebooks})" if config.save_codebooks else "")),
        ("parameters", f"{ok} on all {s['world_size']} ranks (sha256 {s['param_digest'][:16]})"),
    ]
    print()
    for name, value in rows:
        print(f"{name:<17} {value}")
    auto = s["auto"]
    if s["mode"] == "auto":
        print(
            f"{'mode=auto':<17} this run decided: {auto['reason']} ({coded} of "
            f"{s['steps'] - s['warmup_steps']} steps after warmup coded)"
        )
    else:
        print(
            f"{'mode=auto':<17} {auto['reason']}, so the default mode would "
            f"{'code' if auto['coded'] else 'send plainly'} on this link (one step's gradients all-reduced 4 "
            f"times each way, slowest rank); this run used mode={s['mode']}"
            + (", to show the bytes saved" if s["mode"] == "always" else "")
        )
    sys.stdout.flush()
