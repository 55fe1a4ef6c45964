"""One exception base: every error comm_codec raises derives from CommCodecError and keeps its built-in base."""

from __future__ import annotations

import pytest
import torch

import comm_codec as cc
from comm_codec import checkpoint

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "name, builtin",
    [
        ("FrameError", ValueError),
        ("CodebookError", ValueError),
        ("CheckpointError", ValueError),
        ("ChainError", ValueError),
        ("CollectiveError", RuntimeError),
        ("AgreementError", RuntimeError),
        ("ConfigError", ValueError),
    ],
)
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


def test_future_work_wait_honours_its_timeout():
    import concurrent.futures
    import datetime
    import time

    from comm_codec.comm.engine import FutureWork

    never = concurrent.futures.Future()
    work = FutureWork(never)
    start = time.monotonic()
    with pytest.raises(cc.CollectiveError, match="not done after 0.2 s"):
        work.wait(datetime.timedelta(seconds=0.2))
    with pytest.raises(cc.CollectiveError, match="not done after 0.1 s"):
        work.wait(0.1)
    assert time.monotonic() - start < 5
    never.set_result(None)
    assert work.wait(datetime.timedelta(seconds=0.2)) is True and work.wait() is True


def test_disagreeing_ranks_raise_an_agreement_error_under_the_base():
    from comm_codec.comm.autoswitch import check_rows

    with pytest.raises(cc.AgreementError, match="ranks reached the decision at different steps") as info:
        check_rows([[3, 1, 1.0, 1, 1.0], [4, 1, 1.0, 1, 1.0]], 3)
    assert isinstance(info.value, cc.CommCodecError) and isinstance(info.value, RuntimeError)
