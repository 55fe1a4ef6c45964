"""The CPU decoder alone, one thread, beside zipnn and huff0 on the same bytes (issue #26).

For each dataset (MiniLM's weights flattened, bf16 and fp32, and its word-embedding
table cast to fp16; ``--grads`` adds MiniLM's dense bf16 gradients), rounds alternated
(codec, zipnn, huff0, ...), the best of ``--repeat`` kept:

* ``decode``: ``Codec.decode(frame)`` into a new tensor, with the shipped books;
* ``out=``: the same into a given tensor;
* ``no-ck``: the same into a given tensor, on a frame written without checksums (what
  the checksum costs is the difference);
* ``zipnn``: zipnn's decompress (1 thread) of the same tensor's bytes;
* ``exp``: the exponent stream alone, coded as int8 with a book fitted to it and decoded
  into a given array, in chunks of huff0's block (64 Ki symbols), beside ``huff0`` on the
  same stream (64 KiB blocks, ``launch_scripts/build_huff0.sh`` builds the library):
  Msym/s; ``exp16K`` the same in the codec's default chunks (16 Ki elements, what the
  wire codes), whose per-chunk costs weigh four times as much.
* ``--ceiling`` adds what moving the same bytes costs, in the same rounds: ``copy``
  (numpy copy of the tensor's bytes: read and write) and ``stream`` (a numba loop that
  reads the frame's words once and writes the output's once, no compute: the least a
  decoder must move); the decode's share of ``stream`` says how near memory it runs.

``--clock cpu`` times process CPU time (the work alone, for a loaded machine); the load
average and the cores got are printed with the table.

Run: ``NUMBA_NUM_THREADS=1 python launch_scripts/bench_decode.py [--repeat 15] [--clock cpu] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec.books.profiler import WarmupProfiler
from comm_codec.core.codec import DEFAULT_CHUNK_ELEMS, Codec
from comm_codec.tools.bench_measure import best_of

from huff0 import BLOCK, Huff0, exponent_stream  # launch_scripts/huff0.py, beside this script

ZIPNN_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}
_EXP_KEYS = ("exp", "exp16K", "huff0")  # timed on the exponent stream: Msym/s, not GB/s


def datasets(grads: bool) -> list:
    """(name, flat tensor) pairs of real data."""
    from comm_codec.tools.pretrained import load_weights, minilm_gradients, model_path

    weights = load_weights(model_path("minilm"))
    flat = torch.cat([w.reshape(-1).float() for w in weights.values()])
    emb = next(w for k, w in weights.items() if "word_embeddings" in k)
    out = [
        ("minilm bf16", flat.to(torch.bfloat16)),
        ("minilm fp32", flat),
        (f"minilm emb {tuple(emb.shape)} fp16", emb.reshape(-1).to(torch.float16)),
    ]
    if grads:
        step = minilm_gradients(1)[0]
        dense = torch.cat([g.reshape(-1) for k, g in step.items() if "word_embeddings" not in k])
        out.append(("minilm dense grads bf16", dense.to(torch.bfloat16)))
    return out


def exp_codec(stream: np.ndarray, chunk_elems: int = BLOCK):
    """A one-thread codec in chunks of chunk_elems whose int8 book is fitted to stream's
    bytes, and stream as an int8 tensor."""
    prof = WarmupProfiler(chunk_elems=DEFAULT_CHUNK_ELEMS, max_books=1)
    t = torch.from_numpy(stream.view(np.int8))
    prof.observe(t, kind="weight")
    return Codec(prof.build(), threads=1, chunk_elems=chunk_elems), t


def _stream_kernel():
    """A numba loop that writes every word of dst from the words of src (wrapping): the
    least memory traffic of a decode, the frame in and the tensor out."""
    import numba

    @numba.njit(nogil=True)
    def stream(src, dst):
        j = 0
        for i in range(dst.size):
            dst[i] = src[j]
            j += 1
            if j == src.size:
                j = 0

    return stream


def measure(name, tensor, zipnn, huff, args, clock) -> dict:
    """Time one dataset (everything alternated); check every round trip; return its row."""
    nbytes = tensor.numel() * tensor.element_size()
    iv = INT_VIEW[tensor.element_size()]
    codec = Codec(threads=1)
    plain = Codec(threads=1, checksum=False)
    frame = codec.encode(tensor, kind="weight")
    frame_nock = plain.encode(tensor, kind="weight")
    given = torch.empty_like(tensor)
    assert torch.equal(codec.decode(frame).view(iv), tensor.view(iv)), name
    assert torch.equal(plain.decode(frame_nock, out=given).view(iv), tensor.view(iv)), name
    fns = {
        "decode": lambda: codec.decode(frame),
        "out=": lambda: codec.decode(frame, out=given),
        "no-ck": lambda: plain.decode(frame_nock, out=given),
    }
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    if zipnn is not None:
        zn = zipnn.ZipNN(input_format="byte", bytearray_dtype=ZIPNN_DTYPES[tensor.dtype], threads=1)
        zpayload = zn.compress(bytearray(raw))
        assert bytes(zn.decompress(zpayload)) == raw, name
        fns["zipnn"] = lambda: zn.decompress(zpayload)
    stream = exponent_stream(tensor)
    ecodec, et = exp_codec(stream)
    eframe = ecodec.encode(et, kind="weight")
    eout = torch.empty_like(et)
    assert np.array_equal(ecodec.decode(eframe, out=eout).numpy().view(np.uint8), stream), name
    fns["exp"] = lambda: ecodec.decode(eframe, out=eout)
    scodec = Codec(ecodec.codebooks, threads=1, chunk_elems=DEFAULT_CHUNK_ELEMS)  # the same book, wire chunks
    sframe = scodec.encode(et, kind="weight")
    assert np.array_equal(scodec.decode(sframe, out=eout).numpy().view(np.uint8), stream), name
    fns["exp16K"] = lambda: scodec.decode(sframe, out=eout)
    if huff is not None:
        hpayload, hsizes = huff.compress(stream)
        assert np.array_equal(huff.decompress(hpayload, hsizes, stream.size), stream), name
        fns["huff0"] = lambda: huff.decompress(hpayload, hsizes, stream.size)
    if args.ceiling:
        src = tensor.contiguous().view(torch.uint8).numpy()
        copied = np.empty_like(src)
        words = frame.numpy()[: frame.numel() // 8 * 8].view(np.uint64)
        out_words = given.view(torch.uint8).numpy()[: nbytes // 8 * 8].view(np.uint64)
        move = _stream_kernel()
        move(words, out_words)
        fns["copy"] = lambda: np.copyto(copied, src)
        fns["stream"] = lambda: move(words, out_words)
    t = best_of(fns, args.repeat, clock)
    row = {
        "name": name,
        "bytes": nbytes,
        "numel": tensor.numel(),
        "ratio": nbytes / frame.numel(),
        "times_s": t,
        "gbps": {k: nbytes / v / 1e9 for k, v in t.items() if k not in _EXP_KEYS},
    }
    row["exp_msym_s"] = {k: stream.size / t[k] / 1e6 for k in _EXP_KEYS if k in t}
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=15, help="alternating rounds, best kept (15)")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: perf_counter; cpu: process CPU time (the work alone on a loaded machine)",
    )
    parser.add_argument("--only", default="", help="comma-separated substrings: datasets whose name holds one")
    parser.add_argument("--grads", action="store_true", help="also MiniLM's dense bf16 gradients (one step)")
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="also time a copy of the tensor's bytes and a frame-in, tensor-out streaming loop",
    )
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)
    import numba

    numba.set_num_threads(1)
    torch.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    try:
        import zipnn
    except ImportError:
        zipnn = None
        print("zipnn: not installed, its column is skipped")
    try:
        huff = Huff0()
    except (FileNotFoundError, OSError) as exc:
        huff = None
        print(f"huff0: {exc}")
    load0 = os.getloadavg()
    cores = sorted(os.sched_getaffinity(0))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    only = [s for s in args.only.split(",") if s]
    rows = []
    print(
        f"{'data':<34} {'MB':>6} {'ratio':>6}  {'GB/s decode / out= / no-ck / zipnn':>36}  {'x zipnn':>7}  "
        f"{'exp Msym/s cc / cc16K / huff0':>30}  {'x huff0':>7}"
    )
    for name, tensor in datasets(args.grads):
        if only and not any(s in name for s in only):
            continue
        r = measure(name, tensor, zipnn, huff, args, clock)
        rows.append(r)
        g, e = r["gbps"], r["exp_msym_s"]
        zn = g.get("zipnn", float("nan"))
        h0 = e.get("huff0", float("nan"))
        print(
            f"{name:<34} {r['bytes'] / 1e6:>6.1f} {r['ratio']:>6.3f}  {g['decode']:>8.2f} / {g['out=']:>5.2f} / "
            f"{g['no-ck']:>5.2f} / {zn:>5.2f}  {g['decode'] / zn:>7.2f}  {e['exp']:>10.0f} / "
            f"{e['exp16K']:>6.0f} / {h0:>7.0f}  {e['exp'] / h0:>7.2f}"
        )
        if args.ceiling:
            print(
                f"{'':<34} ceiling GB/s: copy {g['copy']:.2f}, stream {g['stream']:.2f}; decode / stream "
                f"{g['decode'] / g['stream']:.2f}, no-ck / stream {g['no-ck'] / g['stream']:.2f}"
            )
    share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    print(
        f"clock {args.clock}, best of {args.repeat} alternating rounds, 1 thread; cores {cores}; load average "
        f"{load0} at start, {os.getloadavg()} at end; CPU time / wall {share:.2f}"
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(
                {
                    "clock": args.clock,
                    "repeat": args.repeat,
                    "cores": cores,
                    "load": [load0, os.getloadavg()],
                    "rows": rows,
                },
                fh,
                indent=1,
            )
            fh.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
