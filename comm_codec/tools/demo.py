"""``comm-codec demo``: train a small transformer on CPU processes with coded gradients.

The README's first command. It spawns ``--world-size`` processes (gloo on 127.0.0.1),
trains :class:`comm_codec.tools.tinylm.TinyLM` on the Python standard library's own source
with DDP and :func:`comm_codec.ddp.huffman_hook`, and prints on rank 0 one line per
step, then a summary: gradient bytes a plain all-reduce would have sent against the
bytes sent, the ratio, codec time, and a check that every rank ended with bit-identical
parameters.

The demo codes every step after warmup (``mode="always"``), so that the bytes saved
show even on loopback, where the wire is fast and coding costs more time than it saves.
At the end it times both all-reduces of the last step's gradients (alternating, on
every rank) and prints what ``mode="auto"``, the hook's default, would decide from them
and why.

The training loop, :func:`train`, runs on any initialized process group, so
``launch_scripts/train_ddp.py`` runs the same training under torchrun. ``--fsdp`` runs
:mod:`comm_codec.tools.fsdp_demo` instead: TinyLM sharded with FSDP2, its reduce-scatters and
all-gathers coded. Both spawn their ranks with :func:`spawn_ranks`.

Example::

    $ comm-codec demo --steps 40 --warmup-steps 5
    $ comm-codec demo --fsdp --steps 20
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["TrainConfig", "add_training_arguments", "register", "spawn_ranks", "train"]

log = logging.getLogger(__name__)

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# AdamW at 3e-3 brings TinyLM from ln(256) = 5.55 to about 2.8 nats in 40 steps, so the
# demo shows a model learning, not a flat line.
_LR = 3e-3
_MB = 1e6


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """What :func:`train` trains, and how its gradients travel.

    Args:
        steps: optimizer steps.
        warmup_steps: steps all-reduced plainly while the books are profiled; ignored
            (0) when ``codebooks`` is given.
        dtype: "bf16" or "fp32": the model's (and so the gradients') dtype.
        batch: sequences of 128 bytes per rank and step.
        cast: None or "bf16": cast fp32 gradients to bf16 before coding (lossy).
        seed: seed of the weights and of the data order.
        codebooks: path of a saved :class:`~comm_codec.CodebookSet` to code with from
            the first step, instead of books built online.
        save_codebooks: path where rank 0 saves the books the run used.
        threads: torch and numba threads per process.
        mode: the hook's mode: "always" (the demo: show the bytes saved), "auto" or
            "never" (see :class:`~comm_codec.ddp.HuffmanState`).
    """

    steps: int = 40
    warmup_steps: int = 5
    dtype: str = "bf16"
    batch: int = 8
    cast: str | None = None
    seed: int = 0
    codebooks: str | None = None
    save_codebooks: str | None = None
    threads: int = 1
    mode: str = "always"

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.codebooks is None and not 0 < self.warmup_steps < self.steps:
            raise ValueError(
                f"--warmup-steps must be in 1..{self.steps - 1} (below --steps {self.steps}) so that "
                f"books are built and then used; got {self.warmup_steps}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.batch < 1:
            raise ValueError(f"--batch must be >= 1, got {self.batch}")
        if self.cast not in (None, "bf16"):
            raise ValueError(f"--cast must be none or bf16, got {self.cast!r}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.mode not in ("always", "auto", "never"):
            raise ValueError(f"--mode must be one of always, auto, never, got {self.mode!r}")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> "TrainConfig":
        """Build a config from the options :func:`add_training_arguments` defines."""
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in fields}
        values["cast"] = None if values.get("cast") in (None, "none") else values["cast"]
        values.update(overrides)
        return cls(**values)


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options the demo and ``launch_scripts/train_ddp.py`` share."""
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: 40)")
    parser.add_argument("--warmup-steps", type=int, default=5,
                        help="plain all-reduce steps that profile the books (default: 5)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16",
                        help="model and gradient dtype (default: bf16)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank and step (default: 8)")
    parser.add_argument("--cast", choices=("none", "bf16"), default="none",
                        help="bf16: cast fp32 gradients to bf16 before coding (lossy; no effect on "
                             "--dtype bf16) (default: none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and data order (default: 0)")


def register(sub) -> None:
    """Add the ``demo`` subcommand to the ``comm-codec`` subparsers."""
    p = sub.add_parser("demo", help="train a small transformer on 2 CPU processes with compressed gradients",
                       description="Train comm_codec's TinyLM with DDP on CPU processes (gloo, 127.0.0.1), "
                                   "gradients all-reduced by huffman_hook, and show what crossed the wire.")
    p.add_argument("--world-size", type=int, default=2, help="processes to spawn (default: 2)")
    add_training_arguments(p)
    p.add_argument("--port", type=int, default=0, help="TCP port of the rendezvous (default: 0, a free one)")
    p.add_argument("--fsdp", action="store_true", help="shard TinyLM with FSDP2 and code its reduce-scatters and all-gathers")
    p.set_defaults(func=_cmd_demo)


# -- the training loop ------------------------------------------------------------------------
def _load_kernels(config: TrainConfig, main: bool) -> None:
    """Load the codec's and the profiler's kernels before step 1, and say what it cost.

    A first run in a fresh environment compiles them (~20 s here): inside the loop that
    was a silent 20-second step 6 (the first coded one). numba caches them, so later runs
    load them in well under a second.
    """
    from ..core.codec import Codec
    from ..core.precompile import warm

    coded = config.cast or config.dtype
    start = time.perf_counter()
    warm(Codec(), [coded], profiler=True)
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
    model = TinyLM().to(_DTYPES[config.dtype])
    ddp = DistributedDataParallel(model, process_group=group)
    warmup = 0 if config.codebooks else config.warmup_steps
    state = HuffmanState(group, codebooks=config.codebooks, warmup_steps=warmup, cast=config.cast,
                         threads=config.threads, log_every=0, mode=config.mode)
    ddp.register_comm_hook(state, huffman_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=_LR)
    data = batches(load_corpus(), config.batch, model.seq_len, seed=config.seed, rank=rank, world_size=world)

    params = sum(p.numel() for p in model.parameters())
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # Bytes all ranks send per step in ring all-reduces of every gradient (CommStats's count).
    plain_step = 2 * (world - 1) / world * grad_bytes * world
    if main:
        _print_header(config, params, world, warmup)
    _load_kernels(config, main)
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
            print(f"{step:5d}  {mean_loss:7.4f}  {phase:<10}  {ratio:>6}  {saved / _MB:8.2f}  {step_ms:7.0f}",
                  flush=True)
        saved_before = saved
    wall = time.perf_counter() - start

    auto = _auto_verdict(model, state, group)
    d = state.stats()
    totals = torch.tensor([d["bytes_in"], d["bytes_out"], d["encode_seconds"], d["decode_seconds"]],
                          dtype=torch.float64)
    dist.all_reduce(totals, group=group)
    identical, digest = _same_parameters(model, group)
    plain_total = plain_step * config.steps
    summary = {
        "world_size": world, "steps": config.steps, "warmup_steps": warmup, "losses": losses,
        "plain_bytes": plain_total, "sent_bytes": plain_total - saved,
        "coded_bytes_in": totals[0].item(), "coded_bytes_out": totals[1].item(),
        "ratio": plain_total / (plain_total - saved), "bytes_saved": saved,
        "encode_seconds": totals[2].item() / world, "decode_seconds": totals[3].item() / world,
        "identical": identical, "param_digest": digest, "books": state.codebooks.digest,
        "seconds": wall, "auto": auto, "coded_steps": coded_steps,
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
    print(f"comm_codec: TinyLM ({params / 1e3:.0f}K parameters, {config.dtype}) on {world} processes "
          f"({dist.get_backend()}), {config.batch} x 128 bytes of Python stdlib source per rank and step")
    if config.codebooks:
        print(f"gradients: DDP + huffman_hook, coded from step 1 with the books in {config.codebooks}{cast}")
    else:
        print(f"gradients: DDP + huffman_hook; steps 1-{warmup} all-reduce plainly while the books are "
              f"profiled, then every bucket is Huffman-coded{cast}")
    sys.stdout.flush()


def _print_summary(s: dict, config: TrainConfig) -> None:
    coded = s["coded_steps"]
    plain = s["steps"] - s["warmup_steps"] - coded
    coded_ratio = s["coded_bytes_in"] / s["coded_bytes_out"] if s["coded_bytes_out"] else 1.0
    ok = "bit-identical" if s["identical"] else "DIFFERENT (bug)"
    rows = [
        ("steps", f"{s['steps']} ({s['warmup_steps']} warmup + {coded} compressed"
                  + (f" + {plain} plain" if plain else "") + f"), {s['seconds']:.1f} s"),
        ("loss", f"{s['losses'][0]:.4f} -> {s['losses'][-1]:.4f} (mean over ranks)"),
        ("gradient traffic", f"{s['plain_bytes'] / _MB:.2f} MB with a plain all-reduce, "
                             f"{s['sent_bytes'] / _MB:.2f} MB sent (all ranks)"),
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
    print(f"{'mode=auto':<17} {auto['reason']}, so the default mode would "
          f"{'code' if auto['coded'] else 'send plainly'} on this link (one step's gradients all-reduced 4 times "
          "each way, slowest rank); this demo codes always, to show the bytes saved")
    sys.stdout.flush()


# -- the command --------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, train_fn, config: TrainConfig, log_level: int) -> None:
    """One spawned process: join the group, train, leave."""
    logging.basicConfig(level=log_level if rank == 0 else max(log_level, logging.WARNING),
                        format=f"%(levelname)s rank {rank} %(name)s: %(message)s", stream=sys.stderr)
    torch.set_num_threads(config.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        train_fn(config)
    finally:
        dist.destroy_process_group()


def spawn_ranks(train_fn, config: TrainConfig, world_size: int, *, port: int = 0, verbose: bool = False,
                prog: str = "comm-codec demo") -> int:
    """Spawn ``world_size`` gloo ranks on 127.0.0.1 that each run ``train_fn(config)``.

    The demos' shared launcher (``comm-codec demo``, ``comm-codec demo --fsdp``). A rank
    that raises or dies is reported in one line on stderr (the traceback with -v).

    Args:
        train_fn: a module-level function (spawn pickles it), e.g. :func:`train`.
        config: the :class:`TrainConfig`.
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
    port = port or _free_port()
    # The workers inherit these. numba's OpenMP layer sets the OpenMP thread count of the
    # thread that first runs a parallel kernel to NUMBA_NUM_THREADS (default: all cores),
    # overriding torch.set_num_threads: keep both at the per-process budget so that the
    # ranks do not oversubscribe the cores.
    for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):
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


def _cmd_demo(args) -> int:
    if args.fsdp:
        from .fsdp_demo import run

        return run(args)
    config = TrainConfig.from_args(args)
    return spawn_ranks(train, config, args.world_size, port=args.port, verbose=getattr(args, "verbose", False))
