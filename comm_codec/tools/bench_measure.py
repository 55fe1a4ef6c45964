"""Measuring the codecs: ratios bucket by bucket, then GB/s in rounds that alternate them.

Every round trip is checked bit for bit, and every codec's input is checked to be
unchanged after compressing it. Each timed call also records the CPU share it got, so a
row timed on a contended core says so.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import numpy as np
import torch

from .bench_codecs import Comparator, Unsupported, as_u8, threads_available
from .bench_data import Dataset, tensor_bytes

__all__ = ["BUSY_SHARE", "best_of", "measure"]

log = logging.getLogger(__name__)

# A timed one-thread call that got less CPU than this share of its wall time was sharing
# its core with another process: its GB/s understates the codec. (A two-thread call below
# twice this ran on fewer than two cores: contention, or a codec that did not use both.)
BUSY_SHARE = 0.85


def best_of(fns: dict, repeat: int, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Time functions alternated round by round (A, B, A, B ...); keep each one's best.

    Args:
        fns: name -> function of no arguments.
        repeat: rounds.
        clock: ``time.perf_counter`` (wall) or ``time.process_time`` (this process's CPU:
            steadier on a loaded machine, for one-thread work).

    Returns:
        name -> the least seconds of its calls.
    """
    times = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            start = clock()
            fn()
            times[k].append(clock() - start)
    return {k: min(v) for k, v in times.items()}


def _timed(comp: Comparator, fn: Callable, t: torch.Tensor, prepare: bool):
    """Time one call of fn: wall seconds, the result, and CPU time / wall time (about 1
    for one thread on an idle core; less when other processes took the core)."""
    arg = comp.prepare(t) if prepare else None
    cpu = time.process_time()
    start = time.perf_counter()
    out = fn(arg)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    return wall, out, (cpu / wall if wall > 0 else 1.0)


def _ratio_row(ds: Dataset, comp: Comparator) -> dict:
    """Set comp up for ds and code every evaluation bucket on its own: the row, without speeds."""
    row = {
        "dataset": ds.name,
        "dtype": ds.spec_name,
        "kind": ds.kind,
        "codec": comp.name,
        "ratio": None,
        "exact": None,
        "input_unchanged": None,
        "enc_gbps": {},
        "dec_gbps": {},
        "ratio_bulk": None,
        "eval_bytes": None,
        "bulk_bytes": None,
        "cpu_share_1t": None,
        "cpu_share_2t": None,
        "notes": [],
        "error": None,
    }
    try:
        comp.setup(ds)
    except Unsupported as exc:
        row["notes"].append(f"skipped: {exc}")
        return row
    if comp.note:
        row["notes"].append(comp.note)
    try:
        sample = comp.sample_bytes is not None
        buckets, taken = [], 0
        for b in ds.buckets:  # bz2: whole buckets up to its sample size (one slice if one is larger)
            if sample and taken >= comp.sample_bytes:
                break
            if sample and tensor_bytes(b) > comp.sample_bytes - taken:
                b = b[: max(1, (comp.sample_bytes - taken) // b.element_size())]
            buckets.append(b)
            taken += tensor_bytes(b)
        raw = coded = 0
        exact = unchanged = True
        enc_time = dec_time = 0.0
        for b in buckets:
            ref = as_u8(b).copy()
            want = comp.expected(b)
            x = comp.prepare(b)
            before = as_u8(x).copy()
            start = time.perf_counter()
            payload = comp.encode(x, 1)
            enc_time += time.perf_counter() - start
            if not np.array_equal(as_u8(x), before) or not np.array_equal(as_u8(b), ref):
                unchanged = False
                if not isinstance(x, bytearray):  # a shared bucket: restore it for the next codec
                    as_u8(b)[:] = ref
            start = time.perf_counter()
            out = comp.decode(payload, 1)
            dec_time += time.perf_counter() - start
            exact &= bool(np.array_equal(as_u8(out), want))
            raw += want.size
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


def _throughput(ds: Dataset, timed: list, bulk: torch.Tensor, args) -> None:
    """Fill the rows' GB/s from ``--repeat`` rounds that ALTERNATE the comparators.

    Every round times each (comparator, threads) pair once, encode first, then every
    decode: a burst of load from another process lands on all codecs alike instead of
    on whichever was being timed. The best call of each pair is kept.
    """
    nbytes = tensor_bytes(bulk)
    expected = {id(c): c.expected(bulk) for c, _ in timed}
    threads_ok = threads_available()
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
                row["exact"] &= bool(np.array_equal(as_u8(out), expected[id(comp)]))
        if rnd == 0 and args.warmup:
            best.clear()
    for comp, row in timed:
        if id(comp) in failed:
            continue
        row["bulk_bytes"] = nbytes
        row["ratio_bulk"] = expected[id(comp)].size / comp.size(frames[(id(comp), 1)])
        for (tag, cid, th), (wall, share) in best.items():
            if cid != id(comp):
                continue
            row["enc_gbps" if tag == "enc" else "dec_gbps"][str(th)] = nbytes / wall / 1e9
            shares.setdefault((cid, th), []).append(share)
        for (cid, th), payload in frames.items():  # frames made with more threads must decode too
            if cid == id(comp) and th != 1:
                row["exact"] &= bool(np.array_equal(as_u8(comp.decode(payload, 1)), expected[id(comp)]))
        one = shares.get((id(comp), 1))
        if one:
            row["cpu_share_1t"] = min(one)
            if row["cpu_share_1t"] < BUSY_SHARE:
                row["notes"].append(f"CPU CONTENDED: a best 1T call got {row['cpu_share_1t']:.0%} of a core")
        two = shares.get((id(comp), 2))
        if two:
            row["cpu_share_2t"] = min(two)
            if row["cpu_share_2t"] < 2 * BUSY_SHARE:
                row["notes"].append(f"a best 2T call ran on {row['cpu_share_2t']:.2f} cores")
        if 2 not in threads_ok:
            row["notes"].append("2 threads unavailable (NUMBA_NUM_THREADS < 2)")
    frames.clear()


def measure(ds: Dataset, comparators: list, bulk: torch.Tensor, args) -> list:
    """All rows of one dataset: ratios codec by codec, then speeds in alternating rounds."""
    rows, timed = [], []
    for comp in comparators:
        t1 = time.perf_counter()
        row = _ratio_row(ds, comp)
        rows.append(row)
        log.info(
            "  %-19s ratio %s exact %s  %.1f s",
            comp.name,
            "-" if row["ratio"] is None else f"{row['ratio']:.3f}",
            row["exact"],
            time.perf_counter() - t1,
        )
        if row["ratio"] is not None and not row["error"] and row.pop("timed", True):
            timed.append((comp, row))
    t1 = time.perf_counter()
    _throughput(ds, timed, bulk, args)
    log.info(
        "  throughput of %d codecs, %d alternating rounds: %.1f s", len(timed), args.repeat, time.perf_counter() - t1
    )
    return rows
