"""Frames and containers stay byte-identical to the ones committed in tests/data/golden/.

The fixtures were written by ``tests/make_golden.py`` with the code as it was before the
package was reorganised into layers (``<name>.frame``, frame versions 1 and 2), and the
split-exponent frames (``<name>.split.frame``, version 3) when they were introduced; the
same inputs must give the same bytes now, and the committed bytes must decode to the
inputs bit for bit, by a codec of either setting.
"""

from __future__ import annotations

import os

import pytest
import torch
from make_golden import CASES, OUT, SPLIT_CASES, checkpoint_inputs, make_input

import comm_codec as cc
from comm_codec import checkpoint

from helpers import bits_equal

pytestmark = pytest.mark.unit


def _read(name: str) -> bytes:
    with open(os.path.join(OUT, name), "rb") as fh:
        return fh.read()


@pytest.mark.parametrize("name,split", [(n, False) for n in sorted(CASES)] + [(n, True) for n in SPLIT_CASES])
def test_frame_bytes_unchanged(name, split):
    _, kind, _, chunk_elems = CASES[name]
    golden = _read(name + (".split.frame" if split else ".frame"))
    assert golden[4] == 3 if split else golden[4] in (1, 2)  # the version byte
    x = make_input(name)
    frame = cc.Codec(chunk_elems=chunk_elems, threads=1, split_exponent=split).encode(x, kind=kind)
    assert frame.numpy().tobytes() == golden
    for either in (False, True):
        codec = cc.Codec(chunk_elems=chunk_elems, threads=1, split_exponent=either)
        bits_equal(codec.decode(torch.frombuffer(bytearray(golden), dtype=torch.uint8)), x)


def test_split_frames_are_the_default_where_the_dtype_has_them():
    for name, (_, kind, _, chunk_elems) in CASES.items():
        frame = cc.Codec(chunk_elems=chunk_elems, threads=1).encode(make_input(name), kind=kind)
        want = _read(name + (".split.frame" if name in SPLIT_CASES else ".frame"))
        assert frame.numpy().tobytes() == want, name


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
