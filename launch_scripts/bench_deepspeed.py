"""DeepSpeed ZeRO-3 training steps of a real pretrained model, plain and with comm_codec, link by link.

all-MiniLM-L6-v2 (22.7 M pretrained parameters, ``comm_codec.tools.pretrained``'s
``minilm``) in bf16 trains with masked-token steps on 2 gloo CPU ranks under DeepSpeed
ZeRO-3 (AdamW, ``stage3_param_persistence_threshold: 0`` so every parameter is gathered),
in one engine per row, all from the same weights on the same batches:

* ``zero3``: plain ZeRO-3 (the comparator);
* ``always``: ZeRO-3 + ``"comm_codec": {"mode": "always", "warmup_steps": 2}``;
* ``auto``: ZeRO-3 + ``"comm_codec": {"mode": "auto", "warmup_steps": 2}`` (it measures both
  and picks; the table says what it picked);
* ``zero++``: ``zero_quantized_weights`` + ``zero_quantized_gradients`` (lossy), where
  DeepSpeed runs them on CPU; otherwise the error DeepSpeed gives is printed.

For each link (loopback shaped with tbf in a network namespace at 1 and 10 Gbit/s, and
unshaped loopback) the rows run ``--warm`` untimed steps each (the codec's warmup and
auto's first measurement), then ``--rounds`` rounds of ``--steps`` timed steps, the rows
alternating in a rotating order (A B C, B C A, ...). A step's time is the slowest rank's.
The table gives the median and minimum ms/step, the ratio to plain ZeRO-3's median,
the bytes per step and rank (what was sent: the plugin's own counters; for plain ZeRO-3
what its collectives move, the plugin's ``bytes_in``), and the loss after all steps beside
plain ZeRO-3's. Every rank prints the cores it may run on and its CPU time over wall time.

Needs root and iproute2 for the shaped links (``--links 0`` runs unshaped only). Keep the
whole run short: ``--links 1,10,0 --warm 6 --rounds 3 --steps 2`` takes a few minutes.

    flock /tmp/cc-bench.lock python launch_scripts/bench_deepspeed.py
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec.core.errors import LinkShapingError  # noqa: E402
from comm_codec.tools.pretrained import minilm_masked_lm  # noqa: E402

import netns  # noqa: E402  (launch_scripts/netns.py, beside this script)

ROWS = ("zero3", "always", "auto", "zero++")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--links", default="1,10,0", help="Gbit/s, comma-separated; 0 = unshaped (default: 1,10,0)")
    p.add_argument(
        "--warm",
        type=int,
        default=None,
        help="untimed steps per row (default: enough for warmup and auto's first probe)",
    )
    p.add_argument(
        "--probe-steps",
        type=int,
        default=4,
        help="auto's steps timed per mode in a probe (default 4, the engine's default)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds of timed steps (default 3)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per row and round (default 2)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step (default 4)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--inside", help=argparse.SUPPRESS)  # the link this process runs (inside its namespace)
    args = p.parse_args(argv)
    if args.probe_steps < 1:
        p.error(f"--probe-steps takes a positive integer, got {args.probe_steps}")
    if args.warm is None:
        # auto decides after the warmup and one probe (probe_steps of each mode plus one uncounted step)
        args.warm = _WARMUP_STEPS + 2 * args.probe_steps + 2
    return args


# -- the namespace ---------------------------------------------------------------------------
def _run_link(gbit: float, argv, out_path: str) -> int:
    """Run this script for one link: in a shaped namespace (deleted afterwards), or unshaped."""
    me = [sys.executable, os.path.abspath(__file__), *argv, "--inside", f"{gbit}:{out_path}"]
    if gbit == 0:
        return subprocess.run(me).returncode
    ns = os.environ.get("CCDS_NS", "ccds-bench")
    try:
        with netns.namespace(ns, f"{gbit:g}gbit"):
            return subprocess.run(netns.exec_argv(ns, me)).returncode
    except LinkShapingError as exc:
        print(f"bench_deepspeed.py: {exc} (or pass --links 0)", file=sys.stderr)
        return 2


# -- model and data --------------------------------------------------------------------------
def _batches(tokenizer, batch, seq, rank, world, count):
    from comm_codec.tools.tinylm import load_corpus

    ids = torch.tensor(tokenizer(load_corpus(400_000).decode("utf-8", "replace"))["input_ids"])
    rows = ids[: (ids.numel() // seq) * seq].view(-1, seq)
    order = torch.randperm(rows.shape[0], generator=torch.Generator().manual_seed(1234))
    return [rows[order[((k * world + rank) * batch + torch.arange(batch)) % rows.shape[0]]] for k in range(count)]


_WARMUP_STEPS = 2


def _config(row: str, batch: int, probe_steps: int) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}},
        "bf16": {"enabled": True},
        "zero_optimization": zero,
    }
    if row in ("always", "auto"):
        config["comm_codec"] = {
            "enabled": True,
            "mode": row,
            "warmup_steps": _WARMUP_STEPS,
            "probe_steps": probe_steps,
            "recheck_every": 10**6,
            "log_every": 0,
        }
    if row == "zero++":
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
    return config


# -- the ranks --------------------------------------------------------------------------------
def _rank(rank, world, port, args, out_path):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    import deepspeed

    import comm_codec.deepspeed as ccds

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=300))
    model, tokenizer = minilm_masked_lm(torch.bfloat16)
    total = args.warm + args.rounds * args.steps
    data = _batches(tokenizer, args.batch, args.seq, rank, world, total)
    engines, errors = {}, {}
    for row in ROWS:
        fresh, _ = minilm_masked_lm(torch.bfloat16) if row != ROWS[0] else (model, None)
        try:
            engines[row] = ccds.initialize(
                model=fresh, model_parameters=fresh.parameters(), config=_config(row, args.batch, args.probe_steps)
            )[0]
        except Exception as exc:  # noqa: BLE001 - ZeRO++ on CPU: DeepSpeed's own error, printed in the table
            errors[row] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    rows = [r for r in ROWS if r in engines]
    done = {r: 0 for r in rows}
    times = {r: [] for r in rows}
    losses = {r: None for r in rows}
    bytes_at = {}

    def step(row):
        engine = engines[row]
        dist.barrier()
        start = time.perf_counter()
        loss = engine(data[done[row]])
        engine.backward(loss)
        engine.step()
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        done[row] += 1
        losses[row] = float(loss.detach())
        return float(took)

    for row in rows:
        for _ in range(args.warm):
            step(row)
        if row in ("always", "auto"):
            bytes_at[row] = (ccds.stats(engines[row])["bytes_in"], ccds.stats(engines[row])["bytes_out"])
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for k in range(args.rounds):
        order = rows[k % len(rows) :] + rows[: k % len(rows)]
        for row in order:
            for _ in range(args.steps):
                times[row].append(step(row))
    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    timed = args.rounds * args.steps
    result = {
        "rank": rank,
        "cores": sorted(os.sched_getaffinity(0)),
        "cpu_per_wall": cpu_share,
        "rows": {},
        "errors": errors,
    }
    for row in rows:
        entry = {"median_ms": 1e3 * statistics.median(times[row]), "min_ms": 1e3 * min(times[row]), "loss": losses[row]}
        if row in bytes_at:
            st = ccds.stats(engines[row])
            entry["bytes_out"] = (st["bytes_out"] - bytes_at[row][1]) / timed
            entry["bytes_in"] = (st["bytes_in"] - bytes_at[row][0]) / timed
            entry["ratio_rs"] = st["reduce_scatter"]["coded_ratio"]
            entry["ratio_ag"] = st["all_gather"]["coded_ratio"]
            entry["decision"] = (st["decision"] or {}).get("reason")
            entry["coding"] = st["coding"]
        result["rows"][row] = entry
    # JSON through byte tensors, sized before parsing: all_gather_object would unpickle what peers send.
    from comm_codec.comm import agreement

    texts = agreement.gather_texts(json.dumps(result), device=agreement.collective_device(None))
    gathered = [agreement.peer_json(t, f"rank {r} sent results that are not JSON") for r, t in enumerate(texts)]
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(gathered, fh)


def _inside(args) -> int:
    gbit, out_path = args.inside.split(":", 1)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(2, port, args, out_path), nprocs=2)
    return 0


def _report(gbit: float, results: list) -> None:
    r0 = results[0]
    link = f"{gbit:g} Gbit/s (tbf)" if gbit else "unshaped loopback"
    print(
        f"\n## {link}: 2 ranks; "
        + "; ".join(f"rank {r['rank']}: cores {r['cores']}, CPU/wall {r['cpu_per_wall']:.2f}" for r in results)
    )
    rows = r0["rows"]
    plain = rows["zero3"]
    plain_bytes = rows.get("always", {}).get("bytes_in")
    print("| row | median ms | min ms | vs plain ZeRO-3 | MB/step/rank | loss after N | note |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for row in ROWS:
        if row in r0["errors"]:
            print(f"| {row} | - | - | - | - | - | DeepSpeed: {r0['errors'][row]} |")
            continue
        e = rows[row]
        sent = e.get("bytes_out", plain_bytes if row == "zero3" else None)
        mb = f"{sent / 1e6:.1f}" if sent is not None else "n/a"
        note = ""
        if "ratio_rs" in e:
            note = f"reduce-scatter {e['ratio_rs']:.3f}x, all-gather {e['ratio_ag']:.3f}x"
            if row == "auto":
                note += f"; {'coding' if e['coding'] else 'plain'}: {e['decision']}"
        same = "= plain" if e["loss"] == plain["loss"] else f"({e['loss'] - plain['loss']:+.2e})"
        print(
            f"| {row} | {e['median_ms']:.0f} | {e['min_ms']:.0f} | {e['median_ms'] / plain['median_ms']:.3f}x "
            f"| {mb} | {e['loss']:.5f} {same} | {note} |"
        )


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.inside:
        return _inside(args)
    links = [float(x) for x in args.links.split(",")]
    print(
        f"all-MiniLM-L6-v2 bf16, ZeRO-3, 2 gloo ranks; {args.warm} untimed + {args.rounds} x {args.steps} timed "
        f"steps per row, {args.batch} x {args.seq} tokens per rank and step; this process may run on "
        f"{len(os.sched_getaffinity(0))} cores"
    )
    everything = {}
    for gbit in links:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
            out = fh.name
        try:
            code = _run_link(gbit, argv, out)
            if code != 0:
                print(f"link {gbit:g}: the ranks failed (exit {code})", file=sys.stderr)
                return code
            with open(out) as fh:
                everything[gbit] = json.load(fh)
        finally:
            os.unlink(out)
        _report(gbit, everything[gbit])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({str(k): v for k, v in everything.items()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
