"""Build the default codebook set shipped in ``codebooks/default.json``.

Trains the in-repo TinyLM (comm_codec.tinylm) on Python standard-library source for a
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

Usage (from the repository root; ~1 minute on 2 cores)::

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

from comm_codec.profiler import WarmupProfiler
from comm_codec.tinylm import TinyLM, batches, load_corpus

log = logging.getLogger("build_default_codebooks")


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


def profile_run(prof: WarmupProfiler, dtype: torch.dtype, steps: int, corpus: bytes, seed: int) -> None:
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


def observe(prof: WarmupProfiler, tensor: torch.Tensor, kind: str, model_dtype: torch.dtype) -> None:
    prof.observe(tensor, kind)
    if model_dtype == torch.float32:  # the other dtypes come from full-precision values
        for t in derived(tensor):
            prof.observe(t, kind)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="codebooks/default.json")
    parser.add_argument("--steps", type=int, default=20, help="warmup steps per model dtype")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(2)
    corpus = load_corpus(2_000_000)
    prof = WarmupProfiler()
    for dtype in (torch.float32, torch.bfloat16):
        profile_run(prof, dtype, args.steps, corpus, args.seed)
    books = prof.build(meta={
        "source": "comm_codec.tinylm TinyLM on Python stdlib source (launch_scripts/build_default_codebooks.py)",
        "steps": args.steps,
        "seed": args.seed,
        "torch": torch.__version__,
    })
    books.save(args.out)
    for key, book in books.items():
        st = books.stats(key)
        log.info("%-16s %-8s s%d  H=%.3f  L=%.3f  %s", *key, st["entropy_bits"], st["expected_bits"],
                 "raw" if book.raw else book.id)
    log.info("wrote %s (%d keys, %d books, digest %s)", args.out, len(books), sum(len(g) for _, g in books.groups()),
             books.digest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
