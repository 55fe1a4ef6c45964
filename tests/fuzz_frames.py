"""atheris target for the frame decoder: run by hand, not collected by pytest.

    for i in 1 2 3 4 5; do python tests/fuzz_frames.py -max_total_time=120 -rss_limit_mb=3500 CORPUS_DIR; done

(Ten minutes in five runs that share the corpus: under atheris the process grows by
1.3-1.8 KB per execution, 13 000 executions a second here, so one 10-minute run ends in
libFuzzer's out-of-memory stop. The growth is the fuzzer's own: the inputs it stopped on
decode alone with no growth, and 150 000 mutated frames decoded by this same
``test_one_input`` without atheris keep the process at 385 MB.)

Each input is a frame to decode (``Codec.decode`` with ``max_output_bytes=64 MiB``). Its
first byte chooses how it is fed: bit 0 set = chunk checksums and header CRC recomputed
first (so mutations reach the stream decoders instead of the checksum); bit 1 set = the
header CRC alone. The seed corpus (written when CORPUS_DIR is empty or absent) holds
frames of every dtype made with the shipped books, weights (groups on every fp32 stream)
and gradients with zero masks and all-zero chunks. Anything but a clean return or
``FrameError`` (a ``TypeError`` for a frame of the wrong type cannot happen here) is a
finding: atheris reports the exception and saves the input as ``crash-*``.
"""

from __future__ import annotations

import os
import sys

import atheris
import numpy as np
import torch

import comm_codec as cc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import fix_header_crc, reseal  # noqa: E402

CODEC = cc.Codec(chunk_elems=128, threads=1)
LIMIT = 64 << 20


def _seeds() -> list[bytes]:
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in cc.SUPPORTED_DTYPES:
        for kind in ("weight", "gradient"):
            x = torch.randn(700, generator=g) * 0.02
            x[100:300] = 0
            x[400:528] = 0
            if dtype in (torch.int8, torch.uint8):
                x = (x * 4000).round().clamp(-128, 127).to(torch.int8)
                x = x.view(torch.uint8) if dtype == torch.uint8 else x
            else:
                x = x.to(dtype)
            out.append(b"\x01" + CODEC.encode(x, kind).numpy().tobytes())
    return out


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, frame = data[0], data[1:]
    if mode & 1:
        frame = reseal(frame)
    elif mode & 2:
        frame = fix_header_crc(frame)
    try:
        out = CODEC.decode(np.frombuffer(bytearray(frame), dtype=np.uint8), max_output_bytes=LIMIT)
    except cc.FrameError:
        return
    params = cc.get_frame_parameters(frame)
    assert out.dtype == params.dtype and out.numel() == params.numel


def _instrument_package() -> None:
    """Add coverage to the package's Python layers (frame parsing, codec checks, books).

    atheris rewrites bytecode; numba compiles from it, so the kernels (numba dispatchers,
    skipped here: they are not plain functions) were compiled above. Instrumenting
    everything loaded (torch included: 45 000 functions) took over ten minutes here.
    """
    import inspect

    done = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("comm_codec") or name.startswith("comm_codec.kernels"):
            continue
        for obj in list(vars(module).values()):
            members = [obj]
            if inspect.isclass(obj) and obj.__module__ == name:
                members = [getattr(m, "__func__", m) for m in vars(obj).values()]
                members += [m.fget for m in vars(obj).values() if isinstance(m, property) and m.fget]
            for fn in members:
                if inspect.isfunction(fn) and fn.__module__ == name:
                    atheris.instrument_func(fn)
                    done += 1
    print(f"instrumented {done} functions of comm_codec", file=sys.stderr)


def main() -> None:
    corpus = [a for a in sys.argv[1:] if not a.startswith("-")]
    seeds = _seeds()
    for seed in seeds:  # every kernel signature compiled (or loaded) before instrumenting
        test_one_input(seed)
    if corpus and (not os.path.isdir(corpus[0]) or not os.listdir(corpus[0])):
        os.makedirs(corpus[0], exist_ok=True)
        for i, seed in enumerate(seeds):
            with open(os.path.join(corpus[0], f"seed-{i:02d}"), "wb") as fh:
                fh.write(seed)
    _instrument_package()
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
