"""Lossy files written by earlier versions still decode (tests/data/golden/lossy_*).

The fixtures are a keyframe and a delta of a small safetensors series (two weights with
their AdamW moments, made from a seeded generator here) written by the lossy format's
version 1 with ExCP's rule (``alpha``), before error budgets existed. Run this file as a
script to write them again, only when a format change is intended:

    python tests/test_lossy_golden.py
"""

from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

pytestmark = pytest.mark.unit

HERE = os.path.dirname(os.path.abspath(__file__))
GOLDEN = os.path.join(HERE, "data", "golden")
FILES = ("lossy_v1_key.ccl", "lossy_v1_delta.ccl")


def series() -> list[dict]:
    """Two checkpoints of a made-up AdamW run: weights, exp_avg, exp_avg_sq (fp32 and bf16)."""
    rng = np.random.default_rng(50)
    w = {
        "a.weight": rng.normal(0, 0.05, (64, 96)).astype(np.float32),
        "b.weight": rng.normal(0, 0.05, (96, 64)).astype(np.float32),
        "b.bias": rng.normal(0, 0.01, 4096).astype(np.float32),
    }
    out = []
    for _ in range(2):
        state = {}
        for name, x in w.items():
            g = rng.normal(0, 1e-3, x.shape).astype(np.float32)
            x += (1e-3 * np.sign(g)).astype(np.float32)
            state[name] = torch.from_numpy(x.copy())
            state[f"exp_avg/{name}"] = torch.from_numpy(0.1 * g)
            state[f"exp_avg_sq/{name}"] = torch.from_numpy((1e-3 * g * g).astype(np.float32))
        state["a.weight"] = state["a.weight"].to(torch.bfloat16)
        out.append(state)
    return out


def test_version1_files_decode_within_their_recorded_errors(tmp_path):
    from comm_codec.checkpoint import lossy

    lossy.clear_cache()
    for name in FILES:
        shutil.copy(os.path.join(GOLDEN, name), tmp_path / name)
    for name, source in zip(FILES, series()):
        index = lossy.read_index(tmp_path / name)
        assert index["version"] == 1 and "alpha" in index["params"]
        out = tmp_path / (name + ".safetensors")
        lossy.decompress_file(tmp_path / name, out)  # checks the recorded sha256 of the reconstruction
        recon = load_file(out)
        assert recon.keys() == source.keys()
        for rec in index["tensors"]:
            a, b = recon[rec["name"]].double(), source[rec["name"]].double()
            err = (a - b).norm() / b.norm()
            assert float(err) == pytest.approx(rec["stats"]["rel_rms_error"], rel=1e-6, abs=1e-12), rec["name"]
    lossy.clear_cache()


def _write(folder: str) -> None:
    from comm_codec.checkpoint import lossy

    prev = None
    for name, state in zip(FILES, series()):
        src = os.path.join(folder, name + ".src.safetensors")
        save_file(state, src)
        lossy.compress_file(src, os.path.join(folder, name), base=prev, alpha=lossy.DEFAULT_ALPHA, force=True)
        prev = os.path.join(folder, name)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _write(tmp)
        for name in FILES:
            shutil.copy(os.path.join(tmp, name), os.path.join(GOLDEN, name))
            print(name, os.path.getsize(os.path.join(GOLDEN, name)))
