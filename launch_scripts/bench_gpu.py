"""GPU codec benchmark: correctness and encode/decode GB/s against copy and cast bandwidth.

One prepared script for a machine with a CUDA GPU. For each size (default
64, 256 and 1024 MiB of bf16 gradient-like data, built on the GPU: per-"layer" scales
spread over 2**-20..2**-6 and 5 % of rows exactly zero, like an embedding's gradient):

1. checks correctness: the GPU frame decodes on the GPU bit-exactly; at the first size
   it also equals the CPU encoder's frame byte for byte, and the CPU decodes it;
2. times ``Codec.encode`` and ``Codec.decode`` on CUDA tensors (CUDA events, median of
   ``--repeat`` runs after one warm-up; the encode includes its one host synchronisation,
   for the frame's length), a device-to-device copy of the same bytes, and torch's
   fp32 -> bf16 cast producing the same number of bf16 bytes (what a lossy
   ``bf16_compress_hook`` pays);
3. prints a table last: ratio, GB/s of each (GB = 1e9 bytes of *uncoded* input, for the
   cast of bf16 output), and encode/decode as a fraction of the copy's bandwidth.

Sizes are bounded (at most 1 GiB) and the run stops starting new sizes after
``--budget`` seconds (default 200), so it ends in under 5 minutes; ``--json`` writes the
rows. Without a CUDA GPU it exits with status 2 and says so.

Usage::

    python launch_scripts/bench_gpu.py                      # 64, 256, 1024 MiB
    python launch_scripts/bench_gpu.py --sizes-mib 64 --repeat 3 --json /tmp/gpu.json

``--simulate`` runs the same steps on tiny CPU tensors in numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``), to check the script itself; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

log = logging.getLogger("bench_gpu")

MAX_MIB = 1024


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--sizes-mib",
        type=int,
        nargs="+",
        default=[64, 256, 1024],
        help=f"input sizes in MiB of bf16 (each at most {MAX_MIB})",
    )
    p.add_argument("--repeat", type=int, default=5, help="timed runs per measurement (median)")
    p.add_argument("--chunk-elems", type=int, default=None, help="codec chunk size (default: the codec's)")
    p.add_argument("--budget", type=float, default=200.0, help="start no new size after this many seconds")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--simulate", action="store_true", help="tiny sizes in the CUDA simulator (script check)")
    args = p.parse_args(argv)
    if any(not 1 <= s <= MAX_MIB for s in args.sizes_mib):
        p.error(f"--sizes-mib must be in 1..{MAX_MIB}, got {args.sizes_mib}")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    return args


def _no_gpu(reason: str) -> None:
    print(
        f"bench_gpu: no CUDA GPU to benchmark ({reason}). This benchmark needs one; "
        "CPU numbers come from launch_scripts/bench_codec.py.",
        file=sys.stderr,
    )
    sys.exit(2)


class _Timer:
    """Median seconds of fn() over repeats: CUDA events on a GPU, perf_counter in the simulator."""

    def __init__(self, torch, gpu: bool):
        self.torch = torch
        self.gpu = gpu

    def __call__(self, fn, repeat: int) -> float:
        torch = self.torch
        fn()  # warm-up (JIT compilation, allocator)
        times = []
        for _ in range(repeat):
            if self.gpu:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def _gradient_like(torch, numel: int, device, seed: int):
    """bf16 data shaped like a gradient bucket: layers of different scale, some zero rows."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(numel, generator=g, device=device, dtype=torch.float32)
    layer = 1 << 16
    nlayers = -(-numel // layer)
    scales = torch.exp2(-6 - 14 * torch.rand(nlayers, generator=g, device=device))
    x.mul_(scales.repeat_interleave(layer)[:numel])
    rows = torch.rand(-(-numel // 256), generator=g, device=device) < 0.05  # rows of 256 elements
    x[rows.repeat_interleave(256)[:numel]] = 0
    return x.to(torch.bfloat16)


def _bits(torch, t):
    return t.view(torch.int16)


def _measure(torch, codec, encode, decode, timer, device, nbytes: int, k: int, repeat: int) -> dict | None:
    """Check one size and time it; None if a round trip (or, at k = 0, CPU agreement) fails."""
    x = _gradient_like(torch, nbytes // 2, device, seed=k)
    frame = encode(x)
    ok = torch.equal(_bits(torch, decode(frame)), _bits(torch, x))
    if k == 0:  # the CPU path agrees byte for byte, both ways
        x_cpu = x.cpu()
        f_cpu = codec.encode(x_cpu)
        ok = ok and torch.equal(f_cpu, frame.cpu())
        ok = ok and torch.equal(_bits(torch, codec.decode(frame.cpu())), _bits(torch, x_cpu))
        ok = ok and torch.equal(_bits(torch, decode(f_cpu.to(device)).cpu()), _bits(torch, x_cpu))
    if not ok:
        return None
    out = torch.empty_like(x)
    t_enc = timer(lambda: encode(x), repeat)
    t_dec = timer(lambda: decode(frame, out=out), repeat)
    t_copy = timer(lambda: out.copy_(x), repeat)
    src32 = x.float()
    t_cast = timer(lambda: src32.to(torch.bfloat16), repeat)
    row = {
        "mib": nbytes / 2**20,
        "ratio": nbytes / frame.numel(),
        "encode_gbs": nbytes / t_enc / 1e9,
        "decode_gbs": nbytes / t_dec / 1e9,
        "copy_gbs": nbytes / t_copy / 1e9,
        "cast_bf16_gbs": nbytes / t_cast / 1e9,
        "correct": True,
    }
    row["encode_vs_copy"] = row["encode_gbs"] / row["copy_gbs"]
    row["decode_vs_copy"] = row["decode_gbs"] / row["copy_gbs"]
    return row


def main(argv=None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.simulate:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before numba is imported
    elif os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        _no_gpu("NUMBA_ENABLE_CUDASIM=1 is set; unset it, or pass --simulate for a script check")
    import torch

    if not args.simulate:
        if not torch.cuda.is_available():
            _no_gpu("torch.cuda.is_available() is False")
        from numba import cuda

        if not cuda.is_available():
            _no_gpu("numba.cuda.is_available() is False: install numba-cuda (pip install 'comm_codec[cuda]')")
    import comm_codec as cc

    gpu = not args.simulate
    device = torch.device("cuda") if gpu else torch.device("cpu")
    sizes = [s << 20 for s in args.sizes_mib] if gpu else [4096, 16384]  # bytes; tiny in the simulator
    kw = {} if args.chunk_elems is None else {"chunk_elems": args.chunk_elems}
    if not gpu and args.chunk_elems is None:
        kw["chunk_elems"] = 1024
    codec = cc.Codec(**kw)
    encode = codec.encode if gpu else codec.encode_cuda
    decode = codec.decode if gpu else codec.decode_cuda
    timer = _Timer(torch, gpu)
    name = torch.cuda.get_device_name(device) if gpu else "numba CUDA simulator (timings meaningless)"
    log.info(
        "bench_gpu on %s: sizes %s MiB, repeat %d, chunk_elems %d",
        name,
        [round(s / 2**20, 3) for s in sizes],
        args.repeat,
        codec.chunk_elems,
    )
    t_start = time.perf_counter()
    rows = []
    for k, nbytes in enumerate(sizes):
        if time.perf_counter() - t_start > args.budget:
            log.info("budget of %.0f s spent: skipping %d MiB and larger", args.budget, nbytes >> 20)
            break
        row = _measure(torch, codec, encode, decode, timer, device, nbytes, k, args.repeat)
        if row is None:
            log.error("bench_gpu: size %.4g MiB: GPU round trip or CPU agreement FAILED", nbytes / 2**20)
            return 1
        rows.append(row)
        log.info(
            "%8.4g MiB: ok, ratio %.3f, encode %.2f GB/s, decode %.2f GB/s",
            row["mib"],
            row["ratio"],
            row["encode_gbs"],
            row["decode_gbs"],
        )
        if gpu:
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": name, "chunk_elems": codec.chunk_elems, "rows": rows}, fh, indent=2)
    head = ("MiB", "ratio", "encode GB/s", "decode GB/s", "d2d copy GB/s", "bf16 cast GB/s", "enc/copy", "dec/copy")
    print()
    print(f"comm_codec GPU codec on {name} (bf16 gradient-like data, bit-exact round trips checked)")
    print(" | ".join(f"{h:>14}" for h in head))
    for r in rows:
        cells = (
            f"{r['mib']:.4g}",
            f"{r['ratio']:.3f}",
            f"{r['encode_gbs']:.2f}",
            f"{r['decode_gbs']:.2f}",
            f"{r['copy_gbs']:.2f}",
            f"{r['cast_bf16_gbs']:.2f}",
            f"{r['encode_vs_copy']:.4f}",
            f"{r['decode_vs_copy']:.4f}",
        )
        print(" | ".join(f"{c:>14}" for c in cells))
    print("GB = 1e9 bytes of uncoded bf16 input (for the cast: of bf16 output); ratio = input / frame bytes.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
