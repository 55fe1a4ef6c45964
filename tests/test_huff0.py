"""The huff0 reference: the exponent stream it is given, its driver, and its bench column."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from comm_codec.tools.bench_codecs import Unsupported, as_u8
from comm_codec.tools.bench_data import Dataset
from comm_codec.tools.bench_report import EXPONENTS, HUFF0, evaluate_targets, format_table

import naive
from helpers import launch_script, random_bits

huff0 = launch_script("huff0")
CodecExponents = huff0.CodecExponents

pytestmark = pytest.mark.unit

_SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3.5, 65504.0]


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
)
def test_exponent_stream_is_the_codecs_stream_0(dtype):
    t = torch.cat([random_bits(3000, dtype, torch.Generator().manual_seed(1)), torch.tensor(_SPECIALS).to(dtype)])
    assert huff0.exponent_stream(t).tolist() == naive.split(t)[0]


def test_exponent_stream_rejects_integers():
    with pytest.raises(TypeError, match="floating-point tensor"):
        huff0.exponent_stream(torch.zeros(4, dtype=torch.int8))


def test_missing_library_says_how_to_build_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="build_huff0.sh"):
        huff0.Huff0(str(tmp_path / "libhuff0.so"))


def test_a_model_it_cannot_load_is_a_message_not_a_traceback(capsys):
    # Checked before the library: the message says what to install (or what is known)
    # whether or not huff0 is built here.
    assert huff0.main(["--models", "nosuch"]) == 2
    assert "unknown pretrained model 'nosuch'" in capsys.readouterr().err
    assert huff0.main(["--models", ""]) == 2
    assert "no models" in capsys.readouterr().err


def test_self_test_without_the_library_is_one_line_and_exit_2(tmp_path, capsys):
    # The round trip itself runs where the library is built: build_huff0.sh calls --self-test.
    assert huff0.main(["--self-test", "--lib", str(tmp_path / "libhuff0.so")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "build_huff0.sh" in err


def _row(codec, enc, dec, ratio=1.5):
    return {
        "dataset": "synth/normal",
        "dtype": "bf16",
        "kind": "gradient",
        "codec": codec,
        "ratio": ratio,
        "exact": True,
        "enc_gbps": {"1": enc},
        "dec_gbps": {"1": dec},
        "eval_bytes": 1e6,
        "notes": [],
        "error": None,
        "cpu_share_1t": 1.0,
        "cpu_share_2t": None,
    }


def test_report_puts_the_codec_beside_huff0():
    # The targets weigh the codec on the exponent stream alone against huff0 on the same
    # stream; the whole tensor's row only shows its speed over huff0's in the table.
    rows = [
        _row("comm_codec:fixed", 1.2, 3.0),
        _row("zipnn", 0.6, 1.5),
        _row(EXPONENTS, 1.6, 1.8, ratio=2.9),
        _row(HUFF0, 0.8, 2.0, ratio=3.0),
    ]
    text = format_table(rows)
    ours = next(line for line in text.splitlines() if "comm_codec:fixed" in line)
    assert "xh0-e" in text and ours.split()[-2:] == ["1.50", "1.50"]
    exp = next(line for line in text.splitlines() if EXPONENTS in line)
    assert exp.split()[-2:] == ["2.00", "0.90"]  # no zipnn columns: it codes one stream
    checks = {c["check"]: c for c in evaluate_targets(rows)}
    assert checks["synth/normal bf16: exponent stream, encode 1T vs huff0"]["value"] == pytest.approx(2.0)
    assert checks["synth/normal bf16: exponent stream, decode 1T vs huff0"]["status"] == "MISS"
    assert not any("vs huff0" in c and "exponent stream" not in c for c in checks)
    assert "build_huff0.sh has built the library" in format_table(rows[:2])


def test_codec_on_the_exponent_stream_codes_that_stream_alone():
    ds = Dataset(
        name="synth/normal",
        kind="weight",
        buckets=[torch.randn(50_000).to(torch.bfloat16) * 3e-2, torch.randn(20_000).to(torch.bfloat16)],
        books=None,
        book_note="",
        make_bulk=lambda: None,
    )
    comp = CodecExponents(4096)
    comp.setup(ds)
    x = ds.buckets[1]
    frame = comp.encode(comp.prepare(x), 1)
    back = comp.decode(frame, 1)
    assert np.array_equal(as_u8(back), comp.expected(x)) and np.array_equal(comp.expected(x), huff0.exponent_stream(x))
    assert comp.size(frame) < 0.7 * x.numel()  # the exponents of normal values: a few bits each
    with pytest.raises(Unsupported):
        comp.setup(
            Dataset(
                name="q",
                kind="weight",
                buckets=[torch.zeros(8, dtype=torch.int8)],
                books=None,
                book_note="",
                make_bulk=lambda: None,
            )
        )
