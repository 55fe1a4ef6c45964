"""CPU encode on one thread: the kernels, a whole encode and the fixed cost per call, beside zipnn and huff0.

For each dataset (MiniLM's weights flattened, bf16 and fp32, and its word-embedding
table cast to fp16), one thread, rounds alternated, the best of ``--repeat`` kept:

* ``plan`` / ``pack``: :func:`~comm_codec.kernels.encode.plan_chunks` and
  :func:`~comm_codec.kernels.encode.encode_chunks` alone, on the arguments that
  :meth:`Codec.encode_array` prepares;
* ``encode``: :meth:`Codec.encode` (host code included);
* ``zipnn``: zipnn's compress of the same bytes (a fresh copy each time: it rewrites its
  input);
* ``s0``: the planner and packer given stream 0's tables only (they then plan and write
  the exponent stream alone), and ``huff0``: huff0 on that stream (when it is built; see
  ``launch_scripts/build_huff0.sh``), both in Msym/s.

Then the fixed cost per call: :meth:`Codec.encode_array` on tensors of 384, 1536 and
16384 elements (slices of the same weights), in microseconds per call, as a checkpoint
writer makes hundreds of them per save.

Run: ``python launch_scripts/bench_encode.py [--repeat 9] [--clock cpu] [--json out.json]``.
To compare two trees, run it with ``PYTHONPATH`` set to each, alternately.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numba
import numpy as np
import torch

from comm_codec.core import frame as _frame
from comm_codec.core.codec import Codec
from comm_codec.core.streams import as_bits
from comm_codec.kernels.encode import encode_chunks, plan_chunks
from comm_codec.tools.bench_measure import best_of

ZIPNN_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
SMALL = (384, 1536, 16384)


def datasets():
    from comm_codec.tools.pretrained import load_weights, model_path

    weights = load_weights(model_path("minilm"))
    flat = torch.cat([w.reshape(-1).float() for w in weights.values()])
    emb = next(w for k, w in weights.items() if "word_embeddings" in k)
    return [
        ("minilm bf16", flat.to(torch.bfloat16)),
        ("minilm fp32", flat),
        (f"minilm emb {tuple(emb.shape)} fp16", emb.reshape(-1).to(torch.float16)),
    ]


def kernels(codec: Codec, tensor: torch.Tensor, kind: str, streams: int | None = None):
    """Two closures on prepared arrays: the planner alone, and the packer alone.

    With ``streams=1`` the kernels get stream 0's tables only, so they plan and write
    the exponent stream alone (same references, books and symbols as in the frame): the
    codec's side of the comparison with huff0 on that stream.
    """
    bits, spec = as_bits(tensor)
    t = codec._encode_tables(kind, spec)
    ce, ns = codec.chunk_elems, streams or spec.nstreams
    nchunks = -(-bits.size // ce)
    cflags = np.zeros(nchunks, np.uint8)
    refs = np.zeros(nchunks, np.uint8)
    books = np.zeros(nchunks, np.uint16)
    sizes = np.zeros((nchunks, ns), np.uint32)
    checksums = np.zeros(nchunks, np.uint32)
    enc_code, enc_len, nbooks, raw = t.enc_code[:ns], t.enc_len[:ns], t.nbooks[:ns], t.raw[:ns]
    # trees before split exponents take no split argument
    layout = (spec.exp_shift, t.split) if hasattr(t, "split") else (spec.exp_shift,)
    plan_chunks(bits, ce, *layout, enc_len, nbooks, raw, cflags, refs, books, sizes)
    lengths = _frame.payload_bytes(cflags.astype(np.int64), sizes, _frame.chunk_counts(bits.size, ce, nchunks))
    offsets = np.cumsum(lengths) - lengths
    out = np.zeros(int(lengths.sum()) + 8, np.uint8)
    pairs = getattr(t, "pairs", None)  # trees before the pair packer have none
    extra = tuple(pairs) if pairs is not None else ()

    def plan():
        plan_chunks(bits, ce, *layout, enc_len, nbooks, raw, cflags, refs, books, sizes)

    def pack():
        encode_chunks(
            bits,
            ce,
            *layout,
            enc_code,
            enc_len,
            *extra,
            cflags,
            refs,
            books,
            sizes,
            offsets,
            out,
            out.view(np.uint64),
            checksums,
            True,
        )

    return plan, pack


def measure(codec, zn_module, huff, huff0, name, tensor, args) -> dict:
    """Time one dataset (all configurations alternated); print its line; return its row."""
    nbytes = tensor.numel() * tensor.element_size()
    frame = codec.encode(tensor, args.kind)
    zn = zn_module.ZipNN(input_format="byte", bytearray_dtype=ZIPNN_DTYPES[tensor.dtype], threads=1)
    raw = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    zpayload = zn.compress(bytearray(raw))
    plan, pack = kernels(codec, tensor, args.kind)
    plan0, pack0 = kernels(codec, tensor, args.kind, streams=1)
    fns = {
        "plan": plan,
        "pack": pack,
        "encode": lambda: codec.encode(tensor, args.kind),
        "s0": lambda: (plan0(), pack0()),
    }
    copies = []
    fns["zn prep"] = lambda: copies.append(bytearray(raw))  # zipnn rewrites its input: fresh copies
    fns["zipnn"] = lambda: zn.compress(copies.pop())
    if huff is not None:
        stream = huff0.exponent_stream(tensor)
        fns["huff0"] = lambda: huff.compress(stream)
    t = best_of(fns, args.repeat, time.perf_counter if args.clock == "wall" else time.process_time)
    ms = {k: 1e3 * v for k, v in t.items()}
    msym = tensor.numel() / 1e6
    h0 = f"{msym / t['huff0']:7.0f}" if huff else "    n/a"
    print(
        f"{name:<30} {nbytes / 1e6:6.1f} {ms['plan']:7.2f} {ms['pack']:7.2f} {ms['encode']:7.2f} "
        f"{nbytes / t['encode'] / 1e9:6.2f} {msym / t['encode']:7.0f} {ms['zipnn']:7.2f} "
        f"{ms['zipnn'] / ms['encode']:5.2f} {msym / t['s0']:7.0f} {h0} {nbytes / frame.numel():6.3f} "
        f"{nbytes / len(zpayload):6.3f}"
    )
    return {
        "data": name,
        "bytes": nbytes,
        "ms": ms,
        "ratio": nbytes / frame.numel(),
        "zipnn_ratio": nbytes / len(zpayload),
        "stream0_msym_s": msym / t["s0"],
        "huff0_msym_s": msym / t["huff0"] if huff else None,
    }


def small_calls(codec, tensor, args) -> dict:
    """Microseconds per Codec.encode_array call on small slices of tensor; print one line."""
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    row = {}
    for n in SMALL:
        bits, spec = as_bits(tensor[1_000_000 : 1_000_000 + n].contiguous())
        codec.encode_array(bits, spec, args.kind)
        calls = 200_000 // max(n // 64, 50)
        best = float("inf")
        for _ in range(args.repeat):
            start = clock()
            for _ in range(calls):
                codec.encode_array(bits, spec, args.kind)
            best = min(best, (clock() - start) / calls)
        row[n] = 1e6 * best
    print(f"  encode_array {tensor.dtype}, us/call: " + "  ".join(f"{n}: {us:6.1f}" for n, us in row.items()))
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--kind", default="weight")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time, or the process's CPU time (one thread: the work alone, for a loaded machine)",
    )
    args = parser.parse_args(argv)
    numba.set_num_threads(1)
    torch.set_num_threads(1)
    import zipnn

    import huff0 as _huff0  # launch_scripts/huff0.py, beside this script

    try:
        huff = _huff0.Huff0()
    except (FileNotFoundError, OSError) as exc:
        print(f"huff0 left out: {exc}", file=sys.stderr)
        huff = None
    codec = Codec(threads=1)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    print(
        f"ms ({args.clock} clock), 1 thread, best of {args.repeat} alternated rounds; x zn = zipnn time / encode "
        "time; s0 = the codec's planner and packer on the exponent stream alone, huff0 = huff0 on it, Msym/s"
    )
    print(
        f"{'data':<30} {'MB':>6} {'plan':>7} {'pack':>7} {'encode':>7} {'GB/s':>6} {'Melem/s':>7} {'zipnn':>7} "
        f"{'x zn':>5} {'s0 Msym':>7} {'huff0':>7} {'ratio':>6} {'zn rt':>6}"
    )
    rows = []
    small = {}
    for name, tensor in datasets():
        rows.append(measure(codec, zipnn, huff, _huff0, name, tensor, args))
        if tensor.dtype in (torch.bfloat16, torch.float32) and "emb" not in name:
            small[str(tensor.dtype)] = small_calls(codec, tensor, args)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print(
        f"cores: {len(os.sched_getaffinity(0))} in affinity, process CPU/wall {cpu / wall:.2f}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "small_us": small}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
