"""Frames and containers stay byte-identical to the ones committed in tests/data/golden/.

The fixtures were written by ``tests/make_golden.py`` with the code as it was before the
package was reorganised into layers; the same inputs must give the same bytes now, and
the committed bytes must decode to the inputs bit for bit.
"""

from __future__ import annotations

import os

import pytest
import torch

import comm_codec as cc
from comm_codec import checkpoint

from helpers import bits_equal
from make_golden import CASES, OUT, checkpoint_inputs, make_input

pytestmark = pytest.mark.unit


def _read(name: str) -> bytes:
    with open(os.path.join(OUT, name), "rb") as fh:
        return fh.read()


@pytest.mark.parametrize("name", sorted(CASES))
def test_frame_bytes_unchanged(name):
    _, kind, _, chunk_elems = CASES[name]
    golden = _read(name + ".frame")
    codec = cc.Codec(chunk_elems=chunk_elems, threads=1)
    x = make_input(name)
    frame = codec.encode(x, kind=kind)
    assert frame.numpy().tobytes() == golden
    back = codec.decode(torch.frombuffer(bytearray(golden), dtype=torch.uint8))
    bits_equal(back, x)


@pytest.mark.parametrize("which", ["safetensors", "pt"])
def test_container_bytes_unchanged(tmp_path, which):
    st, pt = checkpoint_inputs(str(tmp_path))
    src = st if which == "safetensors" else pt
    golden = _read(f"golden_{which}.cckp")
    out = tmp_path / "x.cckp"
    checkpoint.compress_file(src, str(out), threads=1, progress=False)
    assert out.read_bytes() == golden
    (tmp_path / "golden.cckp").write_bytes(golden)
    restored = tmp_path / "restored"
    checkpoint.decompress_file(str(tmp_path / "golden.cckp"), str(restored), progress=False)
    with open(src, "rb") as fh:
        assert restored.read_bytes() == fh.read()
