"""One exception base: every error comm_codec raises derives from CommCodecError and keeps its built-in base."""

from __future__ import annotations

import pytest
import torch

import comm_codec as cc
from comm_codec import checkpoint


@pytest.mark.parametrize("name, builtin", [
    ("FrameError", ValueError), ("CodebookError", ValueError), ("CheckpointError", ValueError),
    ("ChainError", ValueError), ("CollectiveError", RuntimeError), ("AgreementError", RuntimeError),
    ("ConfigError", ValueError),
])
def test_every_error_is_a_comm_codec_error_and_keeps_its_builtin_base(name, builtin):
    cls = getattr(cc, name)
    assert name in cc.__all__
    assert issubclass(cls, cc.CommCodecError) and issubclass(cls, builtin)
    assert cls.__module__ == "comm_codec"


def test_errors_raised_by_each_layer_are_caught_by_the_base(tmp_path):
    codec = cc.Codec()
    frame = codec.encode(torch.zeros(100, dtype=torch.bfloat16))
    with pytest.raises(cc.CommCodecError, match="truncated|too short|frame"):
        codec.decode(frame[:10])
    bad_books = tmp_path / "books.json"
    bad_books.write_text('{"format": "something else"}')
    with pytest.raises(cc.CommCodecError):
        cc.CodebookSet.load(bad_books)
    not_ours = tmp_path / "x.cckp"
    not_ours.write_bytes(b"\0" * 64)
    with pytest.raises(cc.CommCodecError):
        checkpoint.decompress_file(not_ours, tmp_path / "out")
    assert checkpoint.CheckpointError is cc.CheckpointError
