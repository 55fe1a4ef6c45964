"""Bandwidth benchmark: Huffman-coded all-reduce against PyTorch's, on real gradient buckets.

Three steps (``launch_scripts/bench_allreduce.sh`` runs them all, inside a network
namespace whose loopback is shaped to 1 and 10 Gbit/s, then on plain loopback):

``prepare``
    Trains a larger TinyLM (d_model 512, 4 layers, 12.9 M parameters) on Python
    standard-library source, in bf16 and in fp32. The first ``--warmup`` steps profile
    the gradients as ``HuffmanState``'s online warmup does (per-rank buckets as
    "gradient", their average as "reduced_gradient", two ranks' batches per step) and
    build the books; a few steps later every rank's gradients (up to 4 ranks, each its
    own batch) are flattened in DDP's bucket order (parameters reversed) and cut to one
    25 MB bucket. Books and buckets are written to ``--out``.

``run``
    Spawns ``--world-size`` gloo processes on 127.0.0.1; rank r loads bucket r and times
    repeated all-reduces of it, each started from the same gradients after a barrier:

    * default hook: ``tensor.div_(W); dist.all_reduce(tensor)`` -- what DDP's default
      hook (and its built-in all-reduce) runs;
    * fp16_compress_hook's operations (fp32 buckets): cast to fp16, divide, all-reduce,
      copy back. Lossy. It stands in for ``bf16_compress_hook``, which refuses gloo
      ("requires CUDA 11+ and NCCL 2.10+");
    * bf16_compress_hook's operations (fp32), run by hand since PyTorch refuses them on
      gloo: the plain bf16 cast, without coding;
    * huffman_hook: ``comm_codec.collectives.all_reduce(tensor, codec, average=True)``,
      what the hook runs after warmup; lossless, checked bit-exact against the
      rank-order sum computed locally from all ranks' buckets;
    * huffman_hook with ``cast="bf16"`` (fp32): lossy, checked against the same sum of
      the bf16-cast buckets.

    Reports the median over repetitions of the slowest rank's time, bytes on the wire
    per rank (ring all-reduce ``2 (W-1)/W`` of the buffer for the plain ones, CommStats
    for the coded ones) and the bytes the loopback interface actually carried, codec
    seconds per all-reduce, speedup against the default, and the error against the
    exact (float64) average. Optionally (``--e2e-steps``) times whole DDP training steps
    of the same model: no communication (``no_sync``), DDP's built-in all-reduce, and
    ``huffman_hook`` with the prepared books.

``summarize``
    Prints one table from the JSON files of several runs, with the target check.

The loopback of a namespace is one interface: all ranks share its shaped rate, as if
every rank sat behind one link, so the time of a wire-bound all-reduce scales with the
bytes of *all* ranks.

Usage::

    python launch_scripts/bench_allreduce.py prepare --out /tmp/ccbench
    python launch_scripts/bench_allreduce.py run --data /tmp/ccbench --world-size 2 --network "unshaped"
    python launch_scripts/bench_allreduce.py summarize /tmp/ccbench/results/*.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec import CodebookSet, Codec, collectives
from comm_codec.books.profiler import WarmupProfiler
from comm_codec.comm.stats import CommStats
from comm_codec.tools.procs import free_port
from comm_codec.tools.tinylm import TinyLM, batches, load_corpus

log = logging.getLogger("bench_allreduce")

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_MODEL = {"d_model": 512, "n_layers": 4}
_LR = 3e-4
_MB = 1e6


# -- prepare --------------------------------------------------------------------------------
def _bucket(model: torch.nn.Module, numel: int) -> torch.Tensor:
    """Flatten the gradients in DDP's bucket order (parameters reversed); keep numel."""
    flat = torch.cat([p.grad.reshape(-1) for p in reversed(list(model.parameters()))])
    if flat.numel() < numel:
        raise ValueError(f"the model has {flat.numel()} gradient elements, fewer than the bucket's {numel}")
    return flat[:numel].clone()


def _rank_gradients(model, streams, numel):
    """Run one batch per stream (rank) at the current weights.

    Returns each rank's bucket and the mean loss, and leaves the ranks' average gradient
    in ``p.grad`` (what DDP's all-reduce would leave there) for the optimizer step.
    """
    buckets, losses, summed = [], [], None
    for data in streams:
        model.zero_grad(set_to_none=True)
        x, y = next(data)
        loss = model.loss(x, y)
        loss.backward()
        buckets.append(_bucket(model, numel))
        losses.append(loss.item())
        grads = [p.grad.float() for p in model.parameters()]
        summed = grads if summed is None else [s.add_(g) for s, g in zip(summed, grads)]
    for p, s in zip(model.parameters(), summed):
        p.grad = s.div_(len(streams)).to(p.dtype)
    return buckets, sum(losses) / len(losses)


def prepare(args) -> int:
    """Train, profile, and write books and per-rank buckets to args.out."""
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    corpus = load_corpus()
    prof = WarmupProfiler()
    meta = {
        "model": dict(_MODEL),
        "bucket_bytes": args.bucket_bytes,
        "ranks": args.ranks,
        "warmup_steps": args.warmup,
        "gap_steps": args.gap,
        "batch": args.batch,
        "dtypes": {},
    }
    for name, dtype in _DTYPES.items():
        t0 = time.perf_counter()
        torch.manual_seed(args.seed)
        model = TinyLM(**_MODEL).to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=_LR)
        numel = args.bucket_bytes // torch.empty(0, dtype=dtype).element_size()
        # Warmup and gap steps train data-parallel over 2 ranks' batches (profiling as
        # HuffmanState's warmup does); the bucket step gives each of args.ranks ranks its own.
        two = [batches(corpus, args.batch, model.seq_len, seed=args.seed, rank=r, world_size=2) for r in range(2)]
        losses = []
        for step in range(args.warmup + args.gap):
            buckets, loss = _rank_gradients(model, two, numel)
            losses.append(loss)
            if step < args.warmup:
                for b in buckets:
                    prof.observe(b, "gradient")
                prof.observe(torch.stack([b.float() for b in buckets]).mean(0).to(dtype), "reduced_gradient")
            opt.step()
        streams = [
            batches(corpus, args.batch, model.seq_len, seed=args.seed + 1, rank=r, world_size=args.ranks)
            for r in range(args.ranks)
        ]
        buckets, loss = _rank_gradients(model, streams, numel)
        losses.append(loss)
        for r, b in enumerate(buckets):
            torch.save(b, os.path.join(args.out, f"grad_{name}_r{r}.pt"))
        meta["dtypes"][name] = {
            "numel": numel,
            "losses": [round(v, 4) for v in losses],
            "seconds": round(time.perf_counter() - t0, 1),
        }
        log.info(
            "%s: %d elements per bucket, losses %s, %.1f s",
            name,
            numel,
            " ".join(f"{v:.3f}" for v in losses),
            time.perf_counter() - t0,
        )
    books = prof.build(
        meta={"source": "launch_scripts/bench_allreduce.py prepare", **_MODEL, "warmup_steps": args.warmup}
    )
    books.save(os.path.join(args.out, "books.json"))
    meta["books"] = books.digest
    with open(os.path.join(args.out, "meta.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
    print(
        f"prepared {args.out}: books {books.digest[:12]}, buckets of {args.bucket_bytes / _MB:.1f} MB "
        f"for {args.ranks} ranks in {', '.join(_DTYPES)}"
    )
    return 0


# -- run: the timed operations --------------------------------------------------------------
def _op_default(buf, world, ctx):
    buf.div_(world)
    dist.all_reduce(buf)


def _op_cast(dtype):
    def op(buf, world, ctx):
        # fp16_compress_hook / bf16_compress_hook: cast, divide, all-reduce, copy back.
        compressed = buf.to(dtype).div_(world)
        dist.all_reduce(compressed)
        buf.copy_(compressed)

    return op


def _op_huffman(cast):
    def op(buf, world, ctx):
        collectives.all_reduce(
            buf,
            ctx["codec"],
            average=True,
            cast=cast,
            stats=ctx["stats"],
            workspace=ctx.setdefault("workspace", collectives.Workspace()),
        )

    return op


# (name, timed op, bytes-per-element factor on the wire vs the bucket, lossy, coded, cast)
def _methods(dtype_name: str):
    rows = [("default hook", _op_default, 1.0, False, False, None)]
    if dtype_name == "fp32":
        rows += [
            ("fp16_compress_hook", _op_cast(torch.float16), 0.5, True, False, None),
            ("bf16 cast, uncoded *", _op_cast(torch.bfloat16), 0.5, True, False, None),
        ]
    rows.append(("huffman_hook", _op_huffman(None), None, False, True, None))
    if dtype_name == "fp32":
        rows.append(("huffman_hook cast=bf16", _op_huffman(torch.bfloat16), None, True, True, torch.bfloat16))
    return rows


def _lo_tx_bytes() -> int:
    """Bytes sent on this network namespace's loopback so far (/proc/net/dev is per namespace)."""
    with open("/proc/net/dev") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


def _runqueue_wait_s() -> float:
    """Seconds the calling thread has waited for a CPU (run queue), from schedstat.

    On shared cores this is time other processes took from the benchmark: the thread
    that runs the codec and the summing (gloo's I/O threads are not counted).
    """
    try:
        with open("/proc/thread-self/schedstat") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):  # a kernel without schedstats
        return 0.0


def _gather(values: list[float]) -> torch.Tensor:
    """All-gather a list of floats from every rank: a [world, len] float64 tensor."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return torch.stack(out)


def _reference(buckets: list[torch.Tensor], cast) -> torch.Tensor:
    """The compressed all-reduce's result, computed locally: rank-order fp32 sum / W."""
    parts = [b.to(cast) if cast is not None else b for b in buckets]
    acc = parts[0].to(torch.float32).clone()
    for p in parts[1:]:
        acc.add_(p.to(torch.float32))
    acc.div_(len(buckets))
    return acc.to(cast if cast is not None else buckets[0].dtype).to(buckets[0].dtype)


def _time_method(op, src, buf, world, reps, warm, ctx):
    """Time reps all-reduces of src (after warm untimed ones).

    Returns the times, the loopback bytes and the run-queue wait of the timed ones;
    ctx["stats"] counts the timed repetitions only.
    """
    times, waited = [], 0.0
    for i in range(warm + reps):
        buf.copy_(src)
        dist.barrier()
        if i == warm:  # the untimed repetitions' counts (first calls load the kernels) go
            ctx["stats"].reset()
            lo0 = _lo_tx_bytes()
        w0 = _runqueue_wait_s()
        t0 = time.perf_counter()
        op(buf, world, ctx)
        times.append(time.perf_counter() - t0)
        if i >= warm:
            waited += _runqueue_wait_s() - w0
    dist.barrier()
    lo_bytes = _lo_tx_bytes() - lo0
    return times[warm:], lo_bytes, waited / reps


def _bench_dtype(name, args, rank, world, codec, threads):
    dtype = _DTYPES[name]
    src = torch.load(os.path.join(args.data, f"grad_{name}_r{rank}.pt"))
    if src.dtype != dtype:
        raise ValueError(f"{args.data}: grad_{name}_r{rank}.pt holds {src.dtype}, expected {dtype}")
    n, es = src.numel(), src.element_size()
    everyone = None
    exact = None
    if rank == 0:
        everyone = [torch.load(os.path.join(args.data, f"grad_{name}_r{r}.pt")) for r in range(world)]
        exact = torch.stack([b.double() for b in everyone]).mean(0)
    buf = torch.empty_like(src)
    ring = 2 * (world - 1) / world * n * es
    rows = []
    for label, op, factor, lossy, coded, cast in _methods(name):
        stats = CommStats()
        ctx = {"codec": codec, "stats": stats}
        times, lo_bytes, waited = _time_method(op, src, buf, world, args.reps, args.warm, ctx)
        d = stats.as_dict()
        calls = max(1, d["calls"])
        per_rank = _gather(
            [d["bytes_in"] / calls, d["bytes_out"] / calls, (d["encode_seconds"] + d["decode_seconds"]) / calls, waited]
            + times
        )
        slowest = per_rank[:, 4:].max(0).values.tolist()
        row = {
            "dtype": name,
            "method": label,
            "lossy": lossy,
            "coded": coded,
            "ms": statistics.median(slowest) * 1e3,
            "ms_reps": [round(t * 1e3, 2) for t in slowest],
            "lo_bytes_per_rank": lo_bytes / args.reps / world,
            "cpu_wait_ms": per_rank[:, 3].mean().item() * 1e3,
        }
        if coded:
            row["wire_bytes_per_rank"] = per_rank[:, 1].mean().item()
            row["ratio"] = per_rank[:, 0].sum().item() / per_rank[:, 1].sum().item()
            row["codec_ms"] = per_rank[:, 2].mean().item() * 1e3
        else:
            row["wire_bytes_per_rank"] = ring * factor
            row["ratio"] = 1.0 / factor
            row["codec_ms"] = 0.0
        if rank == 0:  # buf holds the last repetition's result, the same on every rank
            diff = (buf.double() - exact).norm() / exact.norm()
            row["rel_err"] = diff.item()
            if coded:
                same = torch.equal(buf.view(torch.uint8), _reference(everyone, cast).view(torch.uint8))
                row["check"] = "bit-exact" if same else "MISMATCH"
                if not same:
                    log.error("%s %s: result differs from the rank-order sum computed locally", name, label)
            else:
                row["check"] = "-"
        rows.append(row)
    default_ms = rows[0]["ms"]
    for row in rows:
        row["speedup"] = default_ms / row["ms"]
    return {"dtype": name, "numel": n, "bucket_bytes": n * es, "ring_bytes_per_rank": ring, "rows": rows}


# -- run: end-to-end DDP steps ------------------------------------------------------------------
def _e2e(args, rank, world, threads):
    """Median ms per DDP training step: no comm, DDP's built-in all-reduce, huffman_hook."""
    from torch.nn.parallel import DistributedDataParallel

    from comm_codec.ddp import HuffmanState, huffman_hook

    corpus = load_corpus()
    rows = []
    for label in ("no communication (no_sync)", "DDP default all-reduce", "huffman_hook"):
        torch.manual_seed(args.seed)
        model = TinyLM(**_MODEL).to(torch.bfloat16)
        ddp = DistributedDataParallel(model)
        state = None
        if label == "huffman_hook":
            state = HuffmanState(
                codebooks=os.path.join(args.data, "books.json"), threads=threads, log_every=0, mode="always"
            )
            ddp.register_comm_hook(state, huffman_hook)
        opt = torch.optim.AdamW(ddp.parameters(), lr=_LR)
        data = batches(corpus, 8, model.seq_len, seed=args.seed, rank=rank, world_size=world)
        times = []
        for step in range(2 + args.e2e_steps):
            if step == 2 and state is not None:
                state.reset_stats()
            x, y = next(data)
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if label.startswith("no communication"):
                with ddp.no_sync():
                    logits = ddp(x)
                    torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1)).backward()
            else:
                logits = ddp(x)
                torch.nn.functional.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1)).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        slowest = _gather(times[2:]).max(0).values.tolist()
        row = {"method": label, "ms": statistics.median(slowest) * 1e3}
        if state is not None:
            d = state.stats()
            row["ratio"] = d["ratio"]
            row["codec_ms"] = (d["encode_seconds"] + d["decode_seconds"]) / max(1, args.e2e_steps) * 1e3
        rows.append(row)
        del ddp, model, opt
    base = rows[1]["ms"]
    for row in rows:
        row["speedup"] = base / row["ms"]
    return {"params": sum(p.numel() for p in TinyLM(**_MODEL).parameters()), "steps": args.e2e_steps, "rows": rows}


def _worker(rank, world, port, args):
    logging.basicConfig(
        level=logging.WARNING, format=f"%(levelname)s rank {rank} %(name)s: %(message)s", stream=sys.stderr
    )
    cores = os.cpu_count() or 1
    threads = max(1, cores // world)
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        codec = Codec(CodebookSet.load(os.path.join(args.data, "books.json")), threads=threads)
        codec.decode(codec.encode(torch.zeros(1 << 16)))  # start numba's threads, then check
        if torch.get_num_threads() != threads:
            log.warning(
                "torch threads %d after the first codec call, expected %d: resetting", torch.get_num_threads(), threads
            )
            torch.set_num_threads(threads)
        result = {
            "network": args.network,
            "rate_gbit": args.rate_gbit,
            "world_size": world,
            "cores": cores,
            "threads_per_rank": threads,
            "reps": args.reps,
            "dtypes": [],
        }
        for name in args.dtypes.split(","):
            result["dtypes"].append(_bench_dtype(name, args, rank, world, codec, threads))
            if rank == 0:
                _print_dtype(result, result["dtypes"][-1])
        if args.e2e_steps:
            result["e2e"] = _e2e(args, rank, world, threads)
            if rank == 0:
                _print_e2e(result)
        if rank == 0 and args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
    finally:
        dist.destroy_process_group()


def run(args) -> int:
    import torch.multiprocessing as mp

    for name in args.dtypes.split(","):
        if name not in _DTYPES:
            raise SystemExit(f"bench_allreduce.py: unknown dtype {name!r}; expected {', '.join(_DTYPES)}")
        for r in range(args.world_size):
            path = os.path.join(args.data, f"grad_{name}_r{r}.pt")
            if not os.path.exists(path):
                raise SystemExit(f"bench_allreduce.py: {path} missing; run 'prepare --ranks {args.world_size}' first")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on the (shaped) loopback
    # The workers inherit these. numba's OpenMP layer sets the OpenMP thread count of the
    # thread that first runs a parallel kernel to NUMBA_NUM_THREADS (default: all cores),
    # overriding torch.set_num_threads; ranks would then oversubscribe the cores.
    threads = str(max(1, (os.cpu_count() or 1) // args.world_size))
    os.environ["OMP_NUM_THREADS"] = os.environ["NUMBA_NUM_THREADS"] = threads
    _print_run_header(args)
    t0 = time.perf_counter()
    try:
        mp.spawn(_worker, args=(args.world_size, args.port or free_port(), args), nprocs=args.world_size)
    except mp.ProcessRaisedException as exc:
        lines = [line for line in exc.msg.strip().splitlines() if line.strip()]
        print(
            f"bench_allreduce.py: rank {exc.error_index} failed: {lines[-1] if lines else '?'}\n{exc.msg}",
            file=sys.stderr,
        )
        return 1
    print(f"({time.perf_counter() - t0:.0f} s)\n")
    return 0


# -- printing -----------------------------------------------------------------------------------
def _print_run_header(args) -> None:
    cores = os.cpu_count() or 1
    print(
        f"== {args.network}: {args.world_size} ranks, gloo on 127.0.0.1, real TinyLM gradient buckets, "
        f"median of {args.reps} (slowest rank each) =="
    )
    if args.rate_gbit:
        print(
            f"   the loopback's {args.rate_gbit:g} Gbit/s is shared by all ranks: a wire-bound all-reduce takes "
            "(all ranks' bytes) / rate"
        )
    if args.world_size > cores:
        print(
            f"   {args.world_size} ranks on {cores} cores: ranks share CPUs, so the codec and gloo's own copies "
            "run slower than on one core each: these timings are partly CPU-bound, not only wire-bound"
        )
    sys.stdout.flush()


def _print_dtype(result: dict, block: dict) -> None:
    world = result["world_size"]
    print(
        f"\n{block['dtype']} bucket: {block['bucket_bytes'] / _MB:.1f} MB ({block['numel']} elements); "
        f"ring all-reduce sends {block['ring_bytes_per_rank'] / _MB:.1f} MB per rank"
    )
    print(
        f"  {'method':<24}{'ms/all-reduce':>14}{'speedup':>9}{'wire MB/rank':>13}{'ratio':>7}"
        f"{'lo MB/rank':>11}{'lo Gbit/s':>10}{'codec ms':>9}{'cpu wait':>9}  {'rel. error':<11}check"
    )
    for row in block["rows"]:
        gbit = row["lo_bytes_per_rank"] * world * 8 / (row["ms"] / 1e3) / 1e9
        codec = f"{row['codec_ms']:.0f}" if row["coded"] else "-"
        err = f"{row['rel_err']:.1e}" if "rel_err" in row else "?"
        lossy = " (lossy)" if row["lossy"] else ""
        print(
            f"  {row['method']:<24}{row['ms']:>14.1f}{row['speedup']:>8.2f}x{row['wire_bytes_per_rank'] / _MB:>13.2f}"
            f"{row['ratio']:>7.2f}{row['lo_bytes_per_rank'] / _MB:>11.2f}{gbit:>10.2f}{codec:>9}"
            f"{row['cpu_wait_ms']:>9.0f}  "
            f"{err:<11}{row['check']}{lossy}"
        )
    print(
        "  wire MB/rank: ring all-reduce 2(W-1)/W x bucket (plain) or CommStats (coded); lo: bytes the loopback "
        "carried; cpu wait: ms per all-reduce the calling thread\n  waited for a CPU "
        "(taken by other processes: large values mean the timing measured contention)"
    )
    if block["dtype"] == "fp32":
        print(
            "  * bf16_compress_hook's operations run by hand: PyTorch's hook refuses gloo. fp16_compress_hook is "
            "PyTorch's lossy hook that runs on CPU."
        )
    _print_analysis(result, block)
    sys.stdout.flush()


def _print_analysis(result: dict, block: dict) -> None:
    """Split the coded all-reduce's time into codec, wire and the rest; say what the codec needs."""
    rows = {r["method"]: r for r in block["rows"]}
    default, huff = rows["default hook"], rows["huffman_hook"]
    world, n, rate = result["world_size"], block["bucket_bytes"], result["rate_gbit"]
    decoded = 2 * (world - 1) / world * n
    coded_bytes = n + decoded  # raw bytes encoded + decoded per rank and all-reduce
    if rate:  # the link's time for the bytes the loopback carried, all ranks sharing it
        wire_default = default["lo_bytes_per_rank"] * world * 8 / (rate * 1e9) * 1e3
        wire_huff = huff["lo_bytes_per_rank"] * world * 8 / (rate * 1e9) * 1e3
        wire_how = f"its bytes at {rate:g} Gbit/s"
    else:  # unshaped: take the default as wire time, the coded bytes as that / ratio
        wire_default = default["ms"]
        wire_huff = default["ms"] / huff["ratio"]
        wire_how = "the default's time / ratio"
    other = huff["ms"] - huff["codec_ms"] - wire_huff
    speed = coded_bytes / (huff["codec_ms"] / 1e3) / 1e9 if huff["codec_ms"] else float("inf")
    print(
        f"  default hook: {default['ms']:.0f} ms, the wire needs {wire_default:.0f} of them"
        + (f" ({100 * wire_default / default['ms']:.0f} % link use)" if rate else "")
    )
    print(
        f"  huffman_hook: {huff['ms']:.0f} ms = codec {huff['codec_ms']:.0f} (encodes {n / _MB:.1f} MB, decodes "
        f"{decoded / _MB:.1f} MB per rank: {speed:.2f} GB/s, {result['threads_per_rank']} thread(s)) + wire "
        f"{wire_huff:.0f} ({wire_how}) + {other:.0f} other (fp32 summing, padding, copies, sync; the link "
        "idles while ranks compute)"
    )
    # The link rate below which the coded all-reduce wins, its codec and other costs fixed:
    # default bytes / R > coded bytes / R + overhead.
    overhead = (huff["codec_ms"] + max(other, 0.0)) / 1e3
    bits_default = default["lo_bytes_per_rank"] * world * 8
    bits_huff = huff["lo_bytes_per_rank"] * world * 8
    if overhead > 0 and bits_default > bits_huff:
        line = (
            f"  with codec + other fixed at {overhead * 1e3:.0f} ms, coding wins on links below "
            f"{(bits_default - bits_huff) / overhead / 1e9:.2f} Gbit/s"
        )
        if 0.8 * bits_default > bits_huff:
            line += f" and reaches 0.8x below {(0.8 * bits_default - bits_huff) / overhead / 1e9:.2f} Gbit/s"
        print(line + f" (all {world} ranks sharing the link)")
    budget = default["ms"] - wire_huff - max(other, 0.0)
    target = 0.8 * default["ms"] - wire_huff - max(other, 0.0)
    if budget <= 0:
        print(
            f"  even a free codec would not break even: wire {wire_huff:.0f} ms + other {max(other, 0):.0f} ms "
            f">= the default's {default['ms']:.0f} ms"
        )
        return
    need = coded_bytes / (budget / 1e3) / 1e9
    verdict = "the codec is the bottleneck" if huff["codec_ms"] > budget else "the codec fits"
    line = f"  {verdict}: to break even it must take <= {budget:.0f} ms ({need:.2f} GB/s per rank)"
    if target > 0:
        line += (
            f"; for 0.8x <= {target:.0f} ms ({coded_bytes / (target / 1e3) / 1e9:.2f} GB/s), other costs as measured"
        )
    else:
        line += "; 0.8x is out of reach even with a free codec unless the other costs shrink"
    print(line)


def _print_e2e(result: dict) -> None:
    e = result["e2e"]
    print(
        f"\nend to end: DDP training step of TinyLM {_MODEL} ({e['params'] / 1e6:.1f} M parameters, bf16, "
        f"batch 8 x 128 per rank), median of {e['steps']} steps"
    )
    print(f"  {'':<30}{'ms/step':>9}{'speedup':>9}{'ratio':>7}{'codec ms/step':>15}")
    for row in e["rows"]:
        ratio = f"{row['ratio']:.2f}" if "ratio" in row else "-"
        codec = f"{row['codec_ms']:.0f}" if "codec_ms" in row else "-"
        print(f"  {row['method']:<30}{row['ms']:>9.0f}{row['speedup']:>8.2f}x{ratio:>7}{codec:>15}")
    sys.stdout.flush()


def summarize(args) -> int:
    """Print one table of every run, and the 1 Gbit/s target check."""
    results = []
    for path in args.files:
        with open(path) as fh:
            results.append(json.load(fh))
    if not results:
        print("no results")
        return 1
    print("all-reduce of one 25 MB bucket of real gradients; speedup = default hook's time / this time")
    print(
        f"{'network':<10}{'ranks':>6}  {'dtype':<6}{'method':<24}{'ms':>9}{'speedup':>9}{'ratio':>7}"
        f"{'codec ms':>9}{'cpu wait':>9}  check"
    )
    for res in results:
        for block in res["dtypes"]:
            for row in block["rows"]:
                codec = f"{row['codec_ms']:.0f}" if row["coded"] else "-"
                lossy = " (lossy)" if row["lossy"] else ""
                print(
                    f"{res['network']:<10}{res['world_size']:>6}  {block['dtype']:<6}{row['method']:<24}"
                    f"{row['ms']:>9.1f}{row['speedup']:>8.2f}x{row['ratio']:>7.2f}{codec:>9}"
                    f"{row.get('cpu_wait_ms', 0):>9.0f}  {row.get('check', '')}{lossy}"
                )
    e2e = [r for r in results if "e2e" in r]
    if e2e:
        print(f"\n{'network':<10}{'ranks':>6}  {'end-to-end DDP step':<30}{'ms/step':>9}{'speedup':>9}")
        for res in e2e:
            for row in res["e2e"]["rows"]:
                print(
                    f"{res['network']:<10}{res['world_size']:>6}  {row['method']:<30}{row['ms']:>9.0f}"
                    f"{row['speedup']:>8.2f}x"
                )
    print("\ntarget: at 1 Gbit/s, bf16 gradients, huffman_hook's all-reduce time <= 0.8x the default hook's")
    if not any(res.get("rate_gbit") == 1 for res in results):
        print("  (no 1 Gbit/s run among these)")
    for res in results:
        if res.get("rate_gbit") != 1:
            continue
        for block in res["dtypes"]:
            if block["dtype"] != "bf16":
                continue
            rows = {r["method"]: r for r in block["rows"]}
            x = rows["huffman_hook"]["ms"] / rows["default hook"]["ms"]
            print(
                f"  {res['world_size']} ranks: {x:.2f}x the default's time ({'met' if x <= 0.8 else 'missed'}; "
                f"ideal 1/ratio = {1 / rows['huffman_hook']['ratio']:.2f}x)"
            )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="all-reduce bandwidth benchmark (see the module docstring)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="train TinyLM, build books, save per-rank gradient buckets")
    p.add_argument("--out", required=True)
    p.add_argument("--ranks", type=int, default=4, help="buckets to save, one per rank (default: 4)")
    p.add_argument("--bucket-bytes", type=int, default=25_000_000, help="bucket size (default: 25 MB)")
    p.add_argument("--warmup", type=int, default=3, help="steps profiled for the books (default: 3)")
    p.add_argument("--gap", type=int, default=1, help="steps between warmup and the buckets (default: 1)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=prepare)
    p = sub.add_parser("run", help="time all-reduces of the prepared buckets")
    p.add_argument("--data", required=True, help="directory written by prepare")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--network", default="loopback", help="label of the network, e.g. '1 Gbit/s'")
    p.add_argument("--rate-gbit", type=float, default=0.0, help="the shaped rate (0: unshaped)")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per method (default: 5)")
    p.add_argument("--warm", type=int, default=1, help="untimed repetitions first (default: 1)")
    p.add_argument("--e2e-steps", type=int, default=0, help="also time this many DDP steps per mode (0: skip)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.set_defaults(func=run)
    p = sub.add_parser("summarize", help="one table from several runs' JSON files")
    p.add_argument("files", nargs="*")
    p.set_defaults(func=summarize)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
