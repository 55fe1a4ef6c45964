"""The benchmark's data: pretrained models, TinyLM trained in-process, synthetic tensors.

Each source returns :class:`Dataset` blocks (one per table block): evaluation buckets,
the books to code them with, and a maker of the larger throughput input. See
:mod:`comm_codec.tools.bench` for what each source holds and how its books are made.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable

import torch

from ..books.profiler import WarmupProfiler
from ..core.codebooks import CodebookSet
from ..core.streams import ACCUMULABLE_DTYPES, spec_for

__all__ = ["MIB", "Dataset", "tensor_bytes", "pretrained_datasets", "tinylm_datasets", "synthetic_datasets"]

log = logging.getLogger(__name__)

MIB = 1 << 20
_ACT_MODULE = re.compile(r"blocks\.\d+\.(attn|mlp)")


@dataclasses.dataclass
class Dataset:
    """One table block: evaluation buckets, the book to code them with, a bulk input."""

    name: str
    kind: str
    buckets: list  # list[torch.Tensor], 1-D, coded one by one for ratios and bounds
    books: CodebookSet
    book_note: str
    make_bulk: Callable[[], torch.Tensor]

    @property
    def dtype(self) -> torch.dtype:
        return self.buckets[0].dtype

    @property
    def spec_name(self) -> str:
        return spec_for(self.dtype).name

    @property
    def nbytes(self) -> int:
        return sum(tensor_bytes(t) for t in self.buckets)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tiled(buckets: list, nbytes: int) -> Callable[[], torch.Tensor]:
    """Return a maker of the throughput input: the buckets concatenated, tiled, cut to nbytes."""

    def make() -> torch.Tensor:
        flat = torch.cat([b.reshape(-1) for b in buckets])
        numel = max(1, nbytes // flat.element_size())
        reps = -(-numel // flat.numel())
        return (flat.repeat(reps) if reps > 1 else flat)[:numel].clone()

    return make


def _train(dtype: torch.dtype, steps: int, batch: int, seed: int, corpus: bytes) -> dict:
    """Train TinyLM and return kind -> list of per-step flat buckets (None where absent)."""
    from .tinylm import TinyLM, batches, train_steps

    torch.manual_seed(seed)
    model = TinyLM().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acts: dict = {}
    for name, module in model.named_modules():
        if _ACT_MODULE.fullmatch(name):
            module.register_forward_hook(lambda m, i, o, name=name: acts.__setitem__(name, o.detach()))
    params = list(model.parameters())
    out: dict = {"gradient": [], "weight": [], "optimizer_state": [], "activation": []}

    def on_step(step, model, optimizer, loss):
        with torch.no_grad():
            out["gradient"].append(torch.cat([p.grad.reshape(-1) for p in params]))
            out["weight"].append(torch.cat([p.reshape(-1) for p in params]))
            moments = [
                optimizer.state[p][k].reshape(-1)
                for k in ("exp_avg", "exp_avg_sq")
                for p in params
                if k in optimizer.state.get(p, {})
            ]
            out["optimizer_state"].append(torch.cat(moments) if moments else None)
            out["activation"].append(torch.cat([a.reshape(-1) for _, a in sorted(acts.items())]).to(dtype))
        log.debug("%s step %d loss %.4f", dtype, step, loss)

    data = batches(corpus, batch, model.seq_len, seed=seed)
    losses = train_steps(model, opt, data, steps, on_step=on_step)
    log.info(
        "trained TinyLM %s: %d steps, loss %.3f -> %.3f", str(dtype).replace("torch.", ""), steps, losses[0], losses[-1]
    )
    return out


def tinylm_datasets(args) -> list:
    from .tinylm import load_corpus

    corpus = load_corpus(2_000_000)
    split_at = args.steps // 2
    datasets = []
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            per_kind = _train(dtype, args.steps, args.batch, args.seed, corpus)
            prof = WarmupProfiler(args.chunk_elems)
            for kind, steps in per_kind.items():
                for t in steps[:split_at]:
                    if t is not None:
                        prof.observe(t, kind)
            books = prof.build(meta={"source": f"comm_codec.tools.bench TinyLM {tag} steps 0-{split_at - 1}"})
            for kind, steps in per_kind.items():
                evaluation = [t for t in steps[split_at:] if t is not None]
                datasets.append(
                    Dataset(
                        name=f"lm-{tag}/{kind}",
                        kind=kind,
                        buckets=evaluation,
                        books=books,
                        book_note=f"book: steps 0-{split_at - 1}, eval {split_at}-{args.steps - 1}",
                        make_bulk=_tiled(evaluation, int(args.bulk_mb * MIB)),
                    )
                )
    finally:
        torch.set_num_threads(previous_threads)
    return datasets


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _weight_datasets(name: str, tensors: dict, args) -> list:
    """fp32, bf16 and fp16 copies of a model's floating-point weights, coded with the shipped books."""
    datasets = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        flat = _flat(t.to(dtype) for t in tensors.values())
        buckets = list(flat.chunk(4))  # ~ a checkpoint's shards; each coded on its own
        datasets.append(
            Dataset(
                name=f"{name}/weight",
                kind="weight",
                buckets=buckets,
                books=CodebookSet.default(),
                book_note="book: shipped defaults",
                make_bulk=_tiled(buckets, int(args.bulk_mb * MIB)),
            )
        )
    return datasets


def pretrained_datasets(args) -> list:
    """The packaged pretrained models (comm_codec.tools.pretrained): weights, and MiniLM's gradients."""
    from . import pretrained

    datasets = []
    for name in args.pretrained:
        try:
            path = pretrained.model_path(name)
        except ModuleNotFoundError as exc:
            log.warning("skipping pretrained model %s: %s", name, exc)
            continue
        weights = pretrained.load_weights(path)
        datasets += _weight_datasets(name, weights, args)
        if name != "minilm":
            continue
        # A real fp16 token-embedding table (30522 x 384) on its own: the one tensor of a
        # model that most of its bytes are, and that the shipped books were not built on.
        table = weights["embeddings.word_embeddings.weight"].to(torch.float16).reshape(-1)
        buckets = list(table.chunk(4))
        datasets.append(
            Dataset(
                name="minilm/word-embeddings",
                kind="weight",
                buckets=buckets,
                books=CodebookSet.default(),
                book_note="book: shipped defaults; 30522 x 384 table",
                make_bulk=_tiled(buckets, int(args.bulk_mb * MIB)),
            )
        )
        if args.grad_steps < 2:
            continue
        split_at = args.grad_steps // 2
        for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            try:
                steps = pretrained.minilm_gradients(args.grad_steps, dtype, seed=args.seed)
            except ModuleNotFoundError as exc:
                log.warning("skipping MiniLM gradients: %s", exc)
                break
            whole = [_flat(g.values()) for g in steps]
            dense = [_flat(v for n, v in g.items() if "word_embeddings" not in n) for g in steps]
            for label, buckets in (("gradient", whole), ("gradient-dense", dense)):
                prof = WarmupProfiler(args.chunk_elems)
                for t in buckets[:split_at]:
                    prof.observe(t, "gradient")
                books = prof.build(
                    meta={"source": f"comm_codec.tools.bench MiniLM {tag} {label} steps 0-{split_at - 1}"}
                )
                evaluation = buckets[split_at:]
                datasets.append(
                    Dataset(
                        name=f"minilm/{label}",
                        kind="gradient",
                        buckets=evaluation,
                        books=books,
                        book_note=f"book: steps 0-{split_at - 1}, eval {split_at}-{args.grad_steps - 1}",
                        make_bulk=_tiled(evaluation, int(args.bulk_mb * MIB)),
                    )
                )
        log.info("pretrained %s ready", name)
    for path in args.model:
        datasets += _file_datasets(path, args)
    return datasets


def _file_datasets(path: str, args) -> list:
    """A checkpoint file's tensors: each kind in the file's own dtype(s), then its weights
    cast to fp32 and bf16 (the rows the packaged models have).

    Tensors are found as ``comm-codec compress`` finds them (nested state dicts, optimizer
    state), with compress's kinds; a legacy (non-zip) torch file is read by
    :func:`comm_codec.tools.pretrained.load_weights`.

    Raises:
        ValueError: neither format, or no floating-point tensor in it.
    """
    from . import pretrained
    from .profiling import checkpoint_tensors

    label = f"file:{os.path.splitext(os.path.basename(path))[0]}"
    try:
        found = [(kind, t) for _, kind, t in checkpoint_tensors(path)]
    except ValueError:
        found = [("weight", t) for t in pretrained.load_weights(path).values()]
    found = [(kind, t) for kind, t in found if t.is_floating_point() and t.numel() and t.dtype in ACCUMULABLE_DTYPES]
    if not found:
        raise ValueError(
            f"--model {path}: no floating-point tensors found (of "
            f"{', '.join(sorted(spec_for(d).name for d in ACCUMULABLE_DTYPES))})"
        )
    datasets = []
    for kind, dtype in sorted({(k, t.dtype) for k, t in found}, key=str):
        buckets = list(_flat(t for k, t in found if k == kind and t.dtype == dtype).chunk(4))
        datasets.append(
            Dataset(
                name=f"{label}/{kind}",
                kind=kind,
                buckets=buckets,
                books=CodebookSet.default(),
                book_note="book: shipped defaults; the file's own dtype",
                make_bulk=_tiled(buckets, int(args.bulk_mb * MIB)),
            )
        )
    weights = {str(i): t for i, (kind, t) in enumerate(found) if kind == "weight"}
    if weights:
        own = {t.dtype for t in weights.values()}
        datasets += [d for d in _weight_datasets(label, weights, args) if d.dtype not in own]
    return datasets


def _synthetic(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(numel, generator=gen) * 1e-3
    if dtype in ACCUMULABLE_DTYPES:
        return t.to(dtype)
    amax = t.abs().max().clamp_min(1e-30)
    if dtype == torch.float8_e4m3fn:
        return (t / amax * 448.0).to(dtype)
    if dtype == torch.float8_e5m2:
        return (t / amax * 57344.0).to(dtype)
    if dtype == torch.int8:
        return torch.round(t / amax * 127).to(dtype)
    raise TypeError(f"no synthetic recipe for {dtype}")


def synthetic_datasets(args) -> list:
    recipes = (
        ("synth/normal", torch.bfloat16),
        ("synth/normal", torch.float16),
        ("synth/normal", torch.float32),
        ("synth/normal-scaled", torch.float8_e4m3fn),
        ("synth/normal-scaled", torch.float8_e5m2),
        ("synth/normal-q127", torch.int8),
    )
    datasets = []
    for name, dtype in recipes:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        numel = int(args.synthetic_mb * MIB) // itemsize
        prof = WarmupProfiler(args.chunk_elems)
        prof.observe(_synthetic(dtype, max(numel // 4, 1 << 16), seed=args.seed + 1000), "gradient")
        books = prof.build(meta={"source": "comm_codec.tools.bench synthetic"})
        data = _synthetic(dtype, numel, seed=args.seed + 2000)
        buckets = list(data.chunk(4))
        datasets.append(
            Dataset(
                name=name,
                kind="gradient",
                buckets=buckets,
                books=books,
                book_note="book: other seed",
                make_bulk=lambda data=data: data,
            )
        )
    return datasets
