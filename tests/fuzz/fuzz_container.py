"""atheris fuzz target: the checkpoint container readers (exact and lossy), run by hand.

Not collected by pytest (no ``test_`` prefix). Each input is used three ways, chosen by
its first byte, so that edits get past the CRCs to the parsers (as tests/crafted.py
does): the whole file as is; a new JSON index resealed into a real file; or new bytes
for one segment of a real file, its CRC resealed. A finding is any exception other than
CheckpointError/OSError, a hang (-timeout) or memory past -rss_limit_mb.

    python tests/fuzz/fuzz_container.py -max_total_time=600 -rss_limit_mb=1024 -timeout=20 CORPUS_DIR
"""

import os
import sys
import tempfile

import atheris

import comm_codec.books.profiler  # noqa: E402,F401

# The codec and its numba kernels first, uninstrumented: numba cannot compile atheris's
# branch hooks. Only the checkpoint package (the parsers under test) is instrumented.
import comm_codec.core.codec  # noqa: E402,F401

with atheris.instrument_imports(include=["comm_codec.checkpoint"]):
    from comm_codec import checkpoint as ck
    from comm_codec.checkpoint import lossy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import crafted  # noqa: E402

_DIR = tempfile.mkdtemp(prefix="cc-fuzz-")
_SEEDS = {}


def _seed(name):
    """A real exact and a real lossy file, made once."""
    if not _SEEDS:
        import torch
        from safetensors.torch import save_file

        g = torch.Generator().manual_seed(0)
        w = torch.randn(20000, generator=g) * 0.02
        save_file({"w": w.bfloat16(), "v": w, "i": torch.arange(3000)}, f"{_DIR}/m.safetensors")
        ck.compress_file(f"{_DIR}/m.safetensors", f"{_DIR}/m.cckp", threads=1)
        torch.save(
            {
                "model": {"w": w},
                "optimizer": {
                    "state": {0: {"exp_avg": w * 0.1, "exp_avg_sq": w * w}},
                    "param_groups": [{"params": [0]}],
                },
            },
            f"{_DIR}/a.pt",
        )
        lossy.compress_file(f"{_DIR}/a.pt", f"{_DIR}/a.ccl", threads=1)
        for n in ("m.cckp", "a.ccl"):
            _SEEDS[n] = open(f"{_DIR}/{n}", "rb").read()
    return _SEEDS[name]


def _read_all(path):
    for call in (
        lambda: ck.read_index(path),
        lambda: ck.describe(path),
        lambda: ck.verify_file(path, threads=1),
        lambda: lossy.read_index(path),
        lambda: lossy.describe(path),
        lambda: lossy.verify_file(path),
    ):
        try:
            call()
        except (ck.CheckpointError, OSError):
            pass


def TestOneInput(data: bytes):
    if not data:
        return
    mode, rest = data[0] % 4, data[1:]
    path = f"{_DIR}/in.bin"
    if mode == 0:
        blob = rest
    else:
        name = "m.cckp" if mode != 3 else "a.ccl"
        c = crafted.Container(_seed(name))
        if mode in (1, 3):
            blob = c.seal(index_bytes=rest)
        else:
            segs = c.index["segments"]
            k = rest[0] % len(segs) if rest else 0
            seg = segs[k]
            payload = (rest[1:] * (1 + seg[3] // max(1, len(rest) - 1)))[: seg[3]] if len(rest) > 1 else b""
            if len(payload) == seg[3]:
                c.put_segment(k, payload)
            blob = c.seal()
    with open(path, "wb") as fh:
        fh.write(blob)
    _read_all(path)


if __name__ == "__main__":
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
