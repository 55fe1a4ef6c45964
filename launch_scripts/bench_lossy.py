"""Benchmark the lossy ExCP-style checkpoint-series mode on an in-repo training run.

Trains :class:`comm_codec.tools.tinylm.TinyLM` with AdamW and writes ``--count`` checkpoints
(``torch.save({"model", "optimizer", "step", "loss"})``, as launch_scripts/make_checkpoints.py
does) ``--every`` steps apart into a temporary folder, then:

1. compresses the series lossily as a closed-loop chain (``comm_codec.checkpoint.lossy``: keyframe,
   then each file against the previous lossy file) and losslessly as XOR deltas
   (``comm_codec.checkpoint.compress_file(src, dst, base=previous original)``), and prints
   per checkpoint and in total the ratio to the raw files, next to ExCP's published ≈70×
   (Pythia-410M, arXiv 2406.11257);
2. resumes training for ``--resume-steps`` steps from the last checkpoint, once from the
   original and once from its reconstruction, on the same batches, and prints both losses
   (mean of the last steps, and on fixed held-out batches) and their relative difference
   (target: within 1 %);
3. times the compression of one checkpoint, lossy (base reconstruction cached, as in a
   series, and cold, decoding the whole chain) against lossless (target: lossy at most 3×
   slower).

Usage::

    python launch_scripts/bench_lossy.py            # d_model 256, 4 layers (a few minutes)
    python launch_scripts/bench_lossy.py --quick    # d_model 128, 2 layers (well under a minute)
    python launch_scripts/bench_lossy.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    from comm_codec import checkpoint
    from comm_codec.checkpoint import lossy
    from comm_codec.tools.tinylm import TinyLM, batches, load_corpus, train_steps
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from comm_codec import checkpoint
    from comm_codec.checkpoint import lossy
    from comm_codec.tools.tinylm import TinyLM, batches, load_corpus, train_steps

log = logging.getLogger("bench_lossy")

EXCP_RATIO = 70.0  # ExCP, Pythia-410M, weights + Adam moments (Li et al., 2024, Table 1)


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=60, help="steps before the first checkpoint")
    p.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--count", type=int, default=10, help="checkpoints in the series (>= 10 for the target)")
    p.add_argument("--resume-steps", type=int, default=40, help="steps trained after resuming")
    p.add_argument("--bits", type=int, default=lossy.DEFAULT_BITS)
    p.add_argument("--alpha", type=float, default=lossy.DEFAULT_ALPHA)
    p.add_argument("--beta", type=float, default=lossy.DEFAULT_BETA)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch and codec threads (default: all cores)")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats (the fastest counts)")
    p.add_argument("--out", type=Path, default=None, help="keep the checkpoints here (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    p.add_argument("--quick", action="store_true", help="d_model 128, 2 layers, warmup 20, every 5, resume 20")
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.n_layers, args.warmup, args.every, args.resume_steps = 128, 2, 20, 5, 20
    return args


def _train_series(args, folder: Path) -> list[Path]:
    torch.manual_seed(args.seed)
    model = TinyLM(d_model=args.d_model, n_layers=args.n_layers, seq_len=args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(load_corpus(), batch_size=args.batch, seq_len=args.seq_len, seed=args.seed)
    log.info("TinyLM d_model=%d n_layers=%d: %.2f M parameters", args.d_model, args.n_layers,
             sum(p.numel() for p in model.parameters()) / 1e6)
    files, step = [], 0
    for k in range(args.count):
        n = args.warmup if k == 0 else args.every
        losses = train_steps(model, opt, data, steps=n)
        step += n
        path = folder / f"step{step:05d}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                    "loss": losses[-1]}, path)
        files.append(path)
        log.info("step %d: loss %.3f", step, losses[-1])
    return files


def _compress_series(args, files: list[Path], folder: Path) -> list[dict]:
    rows = []
    for k, src in enumerate(files):
        lossy_path, exact_path = folder / f"{src.stem}.ccl", folder / f"{src.stem}.cckp"
        s = lossy.compress_file(src, lossy_path, base=None if k == 0 else folder / f"{files[k - 1].stem}.ccl",
                                bits=args.bits, alpha=args.alpha, beta=args.beta, threads=args.threads)
        e = checkpoint.compress_file(src, exact_path, base=None if k == 0 else files[k - 1], threads=args.threads,
                                     progress=False)
        rows.append({"file": src.name, "raw": s.original_bytes, "lossy": s.compressed_bytes,
                     "lossless": e.compressed_bytes, "errors": s.errors, "seconds": s.seconds})
    return rows


def _print_series(rows: list[dict]) -> dict:
    print("\nrelRMS = ||reconstructed - original|| / ||original||, over all weights (all) and for the worst "
          "weight tensor (worst)")
    print(f"{'checkpoint':<14} {'raw MB':>8} {'lossy kB':>9} {'lossy x':>8} {'lossless-delta x':>17} "
          f"{'weights relRMS all':>19} {'worst':>9} {'exp_avg all':>12} {'exp_avg_sq all':>15}")
    for r in rows:
        e = r["errors"]
        print(f"{r['file']:<14} {r['raw'] / 1e6:8.2f} {r['lossy'] / 1e3:9.1f} {r['raw'] / r['lossy']:8.1f} "
              f"{r['raw'] / r['lossless']:17.2f} {e.get('weight_all', 0):19.2e} {e.get('weight', 0):9.2e} "
              f"{e.get('exp_avg_all', 0):12.2e} {e.get('exp_avg_sq_all', 0):15.2e}")
    raw = sum(r["raw"] for r in rows)
    total = {"raw": raw, "lossy": sum(r["lossy"] for r in rows), "lossless": sum(r["lossless"] for r in rows)}
    tail = rows[1:]
    total["lossy_deltas_only"] = sum(r["raw"] for r in tail) / max(1, sum(r["lossy"] for r in tail))
    print(f"{'total':<14} {raw / 1e6:8.2f} {total['lossy'] / 1e3:9.1f} {raw / total['lossy']:8.1f} "
          f"{raw / total['lossless']:17.2f}")
    print(f"deltas only (without the exact keyframe): lossy {total['lossy_deltas_only']:.1f}x   "
          f"| ExCP (Pythia-410M, published): ~{EXCP_RATIO:.0f}x")
    return total


def _eval_loss(model, eval_batches) -> float:
    model.eval()
    with torch.no_grad():
        out = sum(model.loss(x, y).item() for x, y in eval_batches) / len(eval_batches)
    model.train()
    return out


def _resume(args, state: dict, eval_batches) -> tuple[float, float]:
    """Load a checkpoint, train resume_steps on fixed batches; return (mean last-10 loss, eval loss)."""
    torch.manual_seed(args.seed + 1)
    model = TinyLM(d_model=args.d_model, n_layers=args.n_layers, seq_len=args.seq_len)
    model.load_state_dict(state["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    opt.load_state_dict(state["optimizer"])
    data = batches(load_corpus(), batch_size=args.batch, seq_len=args.seq_len, seed=args.seed + 1000)
    losses = train_steps(model, opt, data, steps=args.resume_steps)
    tail = losses[-min(10, len(losses)):]
    return sum(tail) / len(tail), _eval_loss(model, eval_batches)


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("comm_codec.checkpoint.lossy").setLevel(logging.ERROR)  # the keyframe note, once per run
    args = _parse_args(argv)
    if args.count < 2:
        raise SystemExit("--count must be at least 2 (a keyframe and one delta)")
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="bench_lossy.") as tmp:
        folder = args.out or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        files = _train_series(args, folder)
        log.info("trained and saved %d checkpoints in %.0f s", len(files), time.perf_counter() - started)
        rows = _compress_series(args, files, folder)
        results["series"] = rows
        results["total"] = _print_series(rows)

        last, prev = files[-1], files[-2]
        gen_data = batches(load_corpus(), batch_size=args.batch, seq_len=args.seq_len, seed=args.seed + 2000)
        eval_batches = [next(gen_data) for _ in range(8)]
        original = torch.load(last, weights_only=True)
        lossy.clear_cache()  # reconstruct through the whole chain, as a fresh process would
        recon = lossy.load(folder / f"{last.stem}.ccl")
        base_orig, base_eval = _resume(args, original, eval_batches)
        base_recon, recon_eval = _resume(args, recon, eval_batches)
        rel_train = abs(base_recon - base_orig) / base_orig
        rel_eval = abs(recon_eval - base_eval) / base_eval
        print(f"\nresume {args.resume_steps} steps from {last.name}:")
        print(f"  {'from':<16} {'train loss (last 10)':>21} {'held-out loss':>14}")
        print(f"  {'original':<16} {base_orig:21.4f} {base_eval:14.4f}")
        print(f"  {'reconstructed':<16} {base_recon:21.4f} {recon_eval:14.4f}")
        print(f"  relative difference: train {100 * rel_train:.3f} %, held-out {100 * rel_eval:.3f} % "
              f"(target <= 1 %): {'OK' if max(rel_train, rel_eval) <= 0.01 else 'MISSED'}")
        results["resume"] = {"steps": args.resume_steps, "original": base_orig, "reconstructed": base_recon,
                             "original_eval": base_eval, "reconstructed_eval": recon_eval,
                             "rel_train": rel_train, "rel_eval": rel_eval}

        prev_ccl, scratch = folder / f"{prev.stem}.ccl", folder / "timing"
        t_exact = _time(lambda: checkpoint.compress_file(last, f"{scratch}.cckp", base=prev, threads=args.threads,
                                                         progress=False), args.repeats)

        def warm():
            lossy.compress_file(last, f"{scratch}.ccl", base=prev_ccl, bits=args.bits, alpha=args.alpha,
                                beta=args.beta, threads=args.threads)

        def cold():
            lossy.clear_cache()
            warm()

        warm()  # puts the base's reconstruction in the cache
        t_warm = _time(warm, args.repeats)
        t_cold = _time(cold, args.repeats)
        print(f"\ncompress one checkpoint ({last.stat().st_size / 1e6:.1f} MB, best of {args.repeats}):")
        print(f"  lossless delta                      {t_exact:7.3f} s")
        print(f"  lossy, base reconstruction cached   {t_warm:7.3f} s  ({t_warm / t_exact:.2f}x lossless; "
              f"target <= 3x: {'OK' if t_warm <= 3 * t_exact else 'MISSED'})")
        print(f"  lossy, decoding the chain of {len(files) - 1:<2}    {t_cold:7.3f} s  "
              f"({t_cold / t_exact:.2f}x lossless)")
        results["timing"] = {"lossless": t_exact, "lossy_cached": t_warm, "lossy_cold_chain": t_cold}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
