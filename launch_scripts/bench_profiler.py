"""Benchmark the warmup profiler: how good are fixed books on later steps, and what does profiling cost?

Trains the in-repo TinyLM on Python stdlib text (bf16 and fp32 runs) and reports, for
gradients and activations:

* the fixed books (built from the warmup steps' averaged distributions) against per-step
  optimal Huffman codes and the Shannon bound, on every later step: per-kind books, and
  one book shared by all kinds;
* the same gap over training steps, without refresh and with a refresh every
  ``--refresh-every`` steps (books rebuilt from the steps just before);
* the overhead of profiling during warmup: a training step with the profiler observing
  the gradient bucket (what the DDP warmup hook does) vs a plain step.

Observations are one flat bucket per step and kind — what the hook profiles and codes.

Bit counts take exact zeros where the codec codes them inline (see stream_counts).
Prints a table; ``--json`` writes the rows.

    python launch_scripts/bench_profiler.py [--steps 60] [--warmup 10] [--quick]
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

try:
    import comm_codec  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec.books.profiler import WarmupProfiler, book_cost, stream_counts
from comm_codec.tools.tinylm import TinyLM, batches, load_corpus

log = logging.getLogger("bench_profiler")
KINDS = ("gradient", "activation")


def collect(dtype, steps, corpus, seed=0):
    """Train and return per step {kind: [tensors]} (gradients and block outputs)."""
    torch.manual_seed(seed)
    model = TinyLM().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acts = []
    for name, m in model.named_modules():
        if name.endswith((".attn", ".mlp")):
            m.register_forward_hook(lambda mod, i, o: acts.append(o.detach().clone()))
    data = batches(corpus, 8, 128, seed=seed)
    out = []
    for step in range(steps):
        acts.clear()
        x, y = next(data)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(x, y)
        loss.backward()
        out.append({"gradient": [p.grad.detach().clone() for p in model.parameters()], "activation": list(acts)})
        opt.step()
        if step % 10 == 0:
            log.info("%s step %d loss %.3f", str(dtype).replace("torch.", ""), step, loss.item())
    return out


def step_counts(tensors):
    """Sum of the encoder's symbol histograms over a step's tensors of one kind."""
    total = None
    for t in tensors:
        c, _ = stream_counts(t)
        total = c if total is None else total + c
    return total


def flat(tensors):
    """One bucket per step and kind, as DDP (gradients) or a gather (activations) sees it."""
    return torch.cat([t.reshape(-1) for t in tensors])


def build(steps_data, lo, hi, shared):
    """Books from steps lo..hi-1, one observation per step and kind (a bucket)."""
    prof = WarmupProfiler()
    for step in steps_data[lo:hi]:
        for kind in KINDS:
            prof.observe(flat(step[kind]), "gradient" if shared else kind)
    return prof.build()


def quality(args, corpus, rows):
    for dtype in (torch.bfloat16, torch.float32):
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        data = collect(dtype, args.steps, corpus)
        per_kind = build(data, 0, args.warmup, shared=False)
        shared = build(data, 0, args.warmup, shared=True)
        refreshed = per_kind
        for step in range(args.warmup, args.steps):
            if args.refresh_every and step > args.warmup and (step - args.warmup) % args.refresh_every == 0:
                refreshed = build(data, step - args.warmup_refresh, step, shared=False)
            for kind in KINDS:
                counts = step_counts(data[step][kind])
                for label, books, k in (
                    ("per-kind", per_kind, kind),
                    ("shared", shared, "gradient"),
                    ("refreshed", refreshed, kind),
                ):
                    fixed, opt, sh = book_cost(books, k, name, counts)
                    rows.append(
                        {
                            "dtype": name,
                            "kind": kind,
                            "books": label,
                            "step": step,
                            "vs_optimal": fixed / opt - 1,
                            "vs_shannon": fixed / sh - 1,
                        }
                    )


def overhead(args, corpus, rows):
    """ms per training step, plain vs observing the gradient bucket (the warmup hook's work)."""
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        model = TinyLM().to(dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = batches(corpus, 8, 128, seed=1)
        # Gradients live in one flat buffer, as in DDP's buckets (gradient_as_bucket_view).
        params = list(model.parameters())
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype)
        offset = 0
        for p in params:
            p.grad = buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        prof = WarmupProfiler()
        times = {"plain": [], "profiled": []}
        for rep in range(args.overhead_reps):
            for mode in ("plain", "profiled"):
                x, y = next(data)
                t0 = time.perf_counter()
                buffer.zero_()
                model.loss(x, y).backward()
                if mode == "profiled":
                    prof.observe(buffer, "gradient")
                opt.step()
                if rep:  # first round compiles and warms caches
                    times[mode].append(time.perf_counter() - t0)
        plain, prof_t = statistics.median(times["plain"]), statistics.median(times["profiled"])
        rows.append(
            {
                "dtype": "bf16" if dtype == torch.bfloat16 else "fp32",
                "plain_ms": 1e3 * plain,
                "profiled_ms": 1e3 * prof_t,
                "overhead": prof_t / plain - 1,
            }
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--refresh-every", type=int, default=20)
    parser.add_argument("--warmup-refresh", type=int, default=5, help="steps a refresh profiles")
    parser.add_argument("--overhead-reps", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="20 steps, 6 warmup, 5 overhead reps")
    parser.add_argument("--json", help="write rows to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.refresh_every, args.overhead_reps = 20, 6, 7, 5
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    torch.set_num_threads(2)
    corpus = load_corpus(2_000_000)
    q, o = [], []
    quality(args, corpus, q)
    overhead(args, corpus, o)

    print(
        f"Fixed books from steps 0..{args.warmup - 1}, applied to steps {args.warmup}..{args.steps - 1} "
        "(TinyLM on stdlib text)"
    )
    print(f"{'dtype':<6}{'kind':<12}{'books':<11}{'mean vs per-step opt':>22}{'worst':>9}{'mean vs Shannon':>17}")
    summary = {}
    for dtype in ("bf16", "fp32"):
        for kind in KINDS:
            for label in ("per-kind", "shared", "refreshed"):
                sel = [r for r in q if r["dtype"] == dtype and r["kind"] == kind and r["books"] == label]
                mo = statistics.mean(r["vs_optimal"] for r in sel)
                ms = statistics.mean(r["vs_shannon"] for r in sel)
                worst = max(r["vs_optimal"] for r in sel)
                summary[(dtype, kind, label)] = (mo, ms)
                print(f"{dtype:<6}{kind:<12}{label:<11}{100 * mo:>21.2f}%{100 * worst:>8.2f}%{100 * ms:>16.2f}%")
    print(
        "\nGap to per-step optimal over training (per-kind books; without / with refresh every "
        f"{args.refresh_every} steps):"
    )
    for dtype in ("bf16", "fp32"):
        for kind in KINDS:
            line = []
            for step in range(args.warmup, args.steps, max(1, (args.steps - args.warmup) // 8)):
                a = next(
                    r for r in q if (r["dtype"], r["kind"], r["books"], r["step"]) == (dtype, kind, "per-kind", step)
                )
                b = next(
                    r for r in q if (r["dtype"], r["kind"], r["books"], r["step"]) == (dtype, kind, "refreshed", step)
                )
                line.append(f"{step}:{100 * a['vs_optimal']:.1f}/{100 * b['vs_optimal']:.1f}")
            print(f"  {dtype} {kind:<10} " + "  ".join(line))
    print("\nProfiling overhead (observe the gradient bucket, as the DDP warmup hook does; median ms/step):")
    for r in o:
        print(
            f"  {r['dtype']}: plain {r['plain_ms']:.1f} ms, profiled {r['profiled_ms']:.1f} ms, "
            f"overhead {100 * r['overhead']:+.1f}%"
        )
    print("\nTargets:")
    for dtype in ("bf16", "fp32"):
        for kind in KINDS:
            mo, ms = summary[(dtype, kind, "per-kind")]
            ok = mo <= 0.01 and ms <= 0.02
            print(
                f"  {dtype} {kind:<10} <=1% vs per-step optimal, <=2% vs Shannon: "
                f"{100 * mo:.2f}% / {100 * ms:.2f}%  {'PASS' if ok else 'MISS'}"
            )
    for r in o:
        print(
            f"  profiling overhead {r['dtype']} <= 5%: {100 * r['overhead']:+.1f}%  "
            f"{'PASS' if r['overhead'] <= 0.05 else 'MISS'}"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"quality": q, "overhead": o}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
