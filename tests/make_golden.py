"""Write the golden frames and containers that pin the byte formats (tests/data/golden/).

The inputs are made from a seeded numpy generator (bit patterns, so NaN, +-Inf, -0.0
and subnormals are in every float input), identically here and in
``tests/test_golden.py``; only the encoded bytes are committed. Rerun this only when a
format change is intended, and say so in the commit:

    python tests/make_golden.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "golden")

# name -> (torch dtype name, kind, elements, chunk_elems)
CASES = {
    "bf16_gradient": ("bfloat16", "gradient", 20000, 16384),
    "bf16_weight_small_chunks": ("bfloat16", "weight", 3000, 256),
    "fp16_activation": ("float16", "activation", 20000, 16384),
    "fp32_optimizer_state": ("float32", "optimizer_state", 20000, 16384),
    "fp32_reduced_gradient": ("float32", "reduced_gradient", 5000, 1024),
    "fp8_e4m3_weight": ("float8_e4m3fn", "weight", 9000, 4096),
    "fp8_e5m2_gradient": ("float8_e5m2", "gradient", 9000, 4096),
    "int8_activation": ("int8", "activation", 9000, 4096),
    "uint8_weight": ("uint8", "weight", 9000, 4096),
}


# The cases whose dtype has bits under its exponent: also written with split exponents
# (frame version 3) as <name>.split.frame; <name>.frame is the frame without (versions 1-2).
SPLIT_CASES = ("fp16_activation", "fp8_e4m3_weight", "fp8_e5m2_gradient")


def make_input(name: str):
    """Return the deterministic input tensor of a golden case (torch imported lazily)."""
    import torch

    dtype_name, _, n, _ = CASES[name]
    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(sum(map(ord, name)))
    width = torch.empty(0, dtype=dtype).element_size()
    if width == 1:
        if dtype.is_floating_point:
            x = torch.from_numpy((rng.standard_normal(n) * 0.5).astype(np.float32)).to(dtype)
        else:
            x = torch.from_numpy(np.clip(rng.standard_normal(n) * 20, -128, 127).astype(np.int8))
            x = x.view(dtype) if dtype == torch.uint8 else x
    else:
        x = torch.from_numpy((rng.standard_normal(n) * 1e-2).astype(np.float32)).to(dtype)
    x = x.clone()
    x[n // 4 : n // 2] = 0  # an exact-zero run: all-zero and masked chunks
    # special bit patterns: NaN, +-Inf, -0.0, the smallest subnormal, random bits
    ints = x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[width])
    raw = rng.integers(0, 1 << (8 * width), size=64, dtype=np.uint64)
    for i, v in enumerate(raw):
        ints[7 + i * 13] = (
            int(
                np.array(v)
                .astype({1: np.uint8, 2: np.uint16, 4: np.uint32}[width])
                .view({1: np.int8, 2: np.int16, 4: np.int32}[width])
            )
            if width > 1
            else int(v) & 0xFF
        )
    if dtype.is_floating_point and width > 1:
        for i, v in enumerate((float("nan"), float("inf"), float("-inf"), -0.0)):
            x[3 + i] = v
        ints[2] = 1  # smallest positive subnormal
    return x


def checkpoint_inputs(dirname: str) -> tuple[str, str]:
    """Write the deterministic safetensors and torch files the container goldens code."""
    import torch
    from safetensors.torch import save_file

    tensors = {
        "w_bf16": make_input("bf16_gradient").view(100, 200),
        "w_fp32": make_input("fp32_optimizer_state").view(200, 100),
        "w_fp16": make_input("fp16_activation"),
        "count": torch.arange(10, dtype=torch.int64),
    }
    st = os.path.join(dirname, "golden.safetensors")
    save_file(tensors, st, metadata={"format": "pt"})
    pt = os.path.join(dirname, "golden.pt")
    torch.save({"model": {k: v for k, v in tensors.items() if k != "count"}, "step": 7}, pt)
    return st, pt


def main() -> int:
    import tempfile

    import comm_codec as cc
    from comm_codec import checkpoint

    os.makedirs(OUT, exist_ok=True)
    for name, (_, kind, _, chunk_elems) in CASES.items():
        for split, suffix in ((False, ".frame"), (True, ".split.frame")):
            if split and name not in SPLIT_CASES:
                continue
            codec = cc.Codec(chunk_elems=chunk_elems, threads=1, split_exponent=split)
            frame = codec.encode(make_input(name), kind=kind)
            with open(os.path.join(OUT, name + suffix), "wb") as fh:
                fh.write(frame.numpy().tobytes())
    with tempfile.TemporaryDirectory() as tmp:
        st, pt = checkpoint_inputs(tmp)
        for src, name in ((st, "golden_safetensors.cckp"), (pt, "golden_pt.cckp")):
            checkpoint.compress_file(src, os.path.join(OUT, name), threads=1, progress=False, force=True)
    print("wrote", sorted(os.listdir(OUT)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
