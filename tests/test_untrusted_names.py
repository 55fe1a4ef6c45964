"""Untrusted input, second round: what files say is shown safely, and is checked before it is used.

Crafted with the project's own writer code and resealed (``tests/crafted.py``), so the
parsers are reached: names with terminal escapes, values nested past ``repr``'s reach,
lossy records whose dtype disagrees with their frame, a lossy file claiming gigabytes
of zeros, codebook files with non-finite or huge numbers, special files where books are
read, and an output that is a file of the input's own chain. Each must end in one
clean line (exit 2, or 0 where the input is valid), never a traceback or a hang.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from comm_codec import checkpoint as ck
from comm_codec.checkpoint import lossy
from comm_codec.core.codebooks import CodebookSet
from comm_codec.core.errors import CheckpointError, CodebookError
from comm_codec.tools import cli

import crafted
from helpers import run_crafted

pytestmark = [pytest.mark.cli, pytest.mark.slow]  # 12 command-line runs: out of the quick tier

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GEN = torch.Generator().manual_seed(11)
# What a crafted name tries: clear the screen, set the title, forge a line of output.
EVIL = "w\x1b[2J\x1b]0;owned\x07\n" + "verified 1 GB ok\r"


def _weights(n, dtype=torch.float32):
    return (torch.randn(n, generator=_GEN) * 0.02).to(dtype)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """An exact file, a two-link excp chain and a precision file, all of small tensors."""
    d = tmp_path_factory.mktemp("corpus")
    w = _weights(8192)
    sd = {
        "model": {"w": w, "b": _weights(64)},
        "optimizer": {
            "state": {
                0: {"exp_avg": w * 0.1, "exp_avg_sq": w * w},
                1: {"exp_avg": _weights(64), "exp_avg_sq": _weights(64) ** 2},
            },
            "param_groups": [{"params": [0, 1]}],
        },
    }
    torch.save(sd, d / "a.pt")
    sd["model"]["w"] = w + 1e-3
    torch.save(sd, d / "b.pt")
    save_file(
        {
            "w": _weights(8192),
            "u": torch.arange(8192, dtype=torch.uint8),
            "h": _weights(8192, torch.bfloat16),
            "s": _weights(16),
        },
        d / "m.safetensors",
    )
    ck.compress_file(d / "m.safetensors", d / "m.cckp")
    lossy.compress_file(d / "a.pt", d / "key0.ccl")
    lossy.compress_file(d / "b.pt", d / "link1.ccl", base=d / "key0.ccl")
    lossy.compress_file(d / "m.safetensors", d / "p.ccl", method="precision", keep_bits=23)
    lossy.clear_cache()
    return d


def _cli(argv, capsys) -> tuple[int, str, str]:
    """Run the command line in this process; return (status, stdout, stderr)."""
    lossy.clear_cache()
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, err


def _one_clean_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith(("INFO ", "WARNING "))]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert len(lines[0]) < 1024, lines[0][:300]
    return lines[0]


def _no_control(text: str) -> None:
    bad = sorted({hex(ord(c)) for c in text if not c.isprintable() and c not in "\n"})
    assert not bad, f"control characters {bad} reach the terminal: {text[:400]!r}"


def _edit(src, dst, edit) -> str:
    c = crafted.Container.read(src)
    edit(c.index)
    c.write(dst)
    return str(dst)


def _tensor(index, pred):
    return next(r for r in index["tensors"] if pred(r))


# -- names with terminal escapes -----------------------------------------------------------------
def test_names_from_files_are_printed_with_control_characters_escaped(corpus, tmp_path, capsys):
    def exact_names(ix):
        ix["tensors"][0]["name"] = EVIL
        ix["source"]["name"] = EVIL

    def lossy_names(ix):
        w = _tensor(ix, lambda r: r["role"] == "weight")
        for r in ix["tensors"]:
            if r["param"] == w["name"]:
                r["param"] = EVIL
        w["name"] = EVIL
        ix["source"]["name"] = EVIL
        ix["base"]["name"] = EVIL
        ix["notes"] = [EVIL]

    exact = _edit(corpus / "m.cckp", tmp_path / "m.cckp", exact_names)
    link = _edit(corpus / "link1.ccl", tmp_path / "link1.ccl", lossy_names)
    for argv in (["ls", exact], ["inspect", exact], ["ls", link], ["inspect", link]):
        rc, out, err = _cli(argv, capsys)
        assert rc == 0, err
        _no_control(out + err)
        assert "\\x1b[2J" in out and "verified 1 GB ok" in out
        assert not any(line.startswith("verified") for line in out.splitlines())
    # the base a delta names, in the error that says it is missing
    for argv in (["verify", link], ["decompress", link, tmp_path / "out.pt"]):
        rc, out, err = _cli(argv, capsys)
        assert rc == 2
        line = _one_clean_line(err)
        _no_control(out + err)
        assert "\\x1b]0;owned\\x07" in line
    assert not (tmp_path / "out.pt").exists()


def test_a_base_name_with_escapes_in_a_valid_chain_is_escaped_in_the_summary(corpus, tmp_path, capsys):
    c = crafted.Container.read(corpus / "link1.ccl")
    name = "k\x1b[31m0.ccl"
    (tmp_path / name).write_bytes((corpus / "key0.ccl").read_bytes())
    c.index["base"]["name"] = name
    c.write(tmp_path / "link1.ccl")
    rc, out, err = _cli(["verify", tmp_path / "link1.ccl"], capsys)
    assert rc == 0, err
    _no_control(out + err)
    assert "base k\\x1b[31m0.ccl" in out


# -- values nested past repr's reach ---------------------------------------------------------------
def test_messages_quote_values_nested_deeper_than_repr_can_go():
    from comm_codec.checkpoint import schema

    deep = []
    for _ in range(50_000):
        deep = [deep]
    with pytest.raises(CheckpointError, match=r"f: index.created_by: expected a string, got \[\[\[.*\.\.\.$"):
        schema.check({"created_by": deep}, schema.Record({"created_by": schema.Str()}), "f")
    with pytest.raises(CheckpointError, match="expected one of 'excp'"):
        schema.check(deep, schema.OneOf("excp"), "f")


def test_values_nested_near_the_parsers_limit_are_refused_in_one_line(corpus, tmp_path):
    # In a fresh process, as the command line runs, over the depths where json.loads
    # stops: whatever it returns is quoted in one line, never a RecursionError.
    cases = []
    for depth in range(950, 1000, 2):
        files = []
        for name, field in (("m.cckp", "created_by"), ("p.ccl", "mode")):
            c = crafted.Container.read(corpus / name)
            c.index[field] = "@nested@"
            text = json.dumps(c.index, separators=(",", ":")).replace('"@nested@"', "[" * depth + "]" * depth)
            files.append(str(tmp_path / f"{depth}{name}"))
            c.write(files[-1], index_bytes=text.encode())
        for f in files:
            cases += [["ls", f], ["inspect", f], ["verify", f], ["decompress", f, f + ".out"]]
    results = run_crafted(cases, tmp_path, ["/"])
    bad = [
        f"{r['argv'][:2]}: rc {r['rc']}, {r['stderr'][-300:]!r}"
        for r in results
        if r["rc"] != 2 or "Traceback" in r["stderr"] or len(r["stderr"].strip().splitlines()) != 1
    ]
    assert not bad, "\n".join(bad[:5])
    assert not [n for n in os.listdir(tmp_path) if n.endswith((".out", ".tmp"))]


# -- lossy records whose dtype disagrees with their frame ------------------------------------------
def _skeleton_complex(c):
    _tensor(c.index, lambda r: r["coding"] == "skeleton" and r["role"] == "weight")["dtype"] = "complex64"


def _bf16_record_f32_frame(c):
    # as many float32 elements in the frame as the record's bytes hold bf16 ones
    r = _tensor(c.index, lambda r: r["coding"] == "precision" and r["dtype"] == "float32")
    r["dtype"] = "bfloat16"
    _put_frame(c, r, _zero_frame(r["nbytes"] // 2, torch.float32))


def _uint8_record_bf16_frame(c):
    r = _tensor(c.index, lambda r: r["dtype"] == "uint8" and r["coding"] == "frame")
    r["frame"]["dtype"] = "bfloat16"
    _put_frame(c, r, _zero_frame(r["nbytes"], torch.bfloat16))


def _exp_avg_twice_the_elements(c):
    r = _tensor(c.index, lambda r: r["role"] == "exp_avg")
    r["dtype"] = "bfloat16"  # same bytes, twice the elements of its float32 weight


MISMATCHES = {
    "skeleton complex64": ("key0.ccl", _skeleton_complex),
    "bf16 record, float32 frame": ("p.ccl", _bf16_record_f32_frame),
    "uint8 record, bf16 frame": ("p.ccl", _uint8_record_bf16_frame),
    "exp_avg of twice its weight's elements": ("key0.ccl", _exp_avg_twice_the_elements),
}


@pytest.mark.parametrize("label", sorted(MISMATCHES))
def test_a_dtype_that_disagrees_with_its_frame_or_weight_is_one_line(corpus, tmp_path, capsys, label):
    name, edit = MISMATCHES[label]
    c = crafted.Container.read(corpus / name)
    edit(c)
    c.write(tmp_path / name)
    path = tmp_path / name
    for argv in (["ls", path], ["inspect", path], ["verify", path], ["decompress", path, tmp_path / "out"]):
        rc, out, err = _cli(argv, capsys)
        assert rc == 2, (argv[0], out, err)
        assert "is malformed" in _one_clean_line(err)
    assert not (tmp_path / "out").exists()


def test_the_skeleton_may_hold_tensors_of_any_dtype(corpus, tmp_path, capsys):
    # A tensor lossy modes pass through with the other bytes may be of a dtype no codec
    # knows: only a weight or a moment must be a float the decoder rewrites.
    c = crafted.Container.read(corpus / "p.ccl")
    r = _tensor(c.index, lambda r: r["coding"] == "skeleton" and r["role"] == "tensor")
    r["dtype"] = "complex64"
    c.write(tmp_path / "k.ccl")
    assert lossy.read_index(tmp_path / "k.ccl")["tensors"]
    rc, out, err = _cli(["ls", tmp_path / "k.ccl"], capsys)
    assert rc == 0 and "complex64" in out, err


# -- a lossy file that claims gigabytes of zeros ---------------------------------------------------
def _zero_frame(numel: int, dtype=torch.float32) -> bytes:
    """A frame of ``numel`` zeros in the lossy format's chunks, built without the zeros."""
    from comm_codec.checkpoint.lossy_blobs import CHUNK
    from comm_codec.core import frame as fr
    from comm_codec.core.codec import Codec
    from comm_codec.core.streams import spec_for

    one = Codec(threads=1, chunk_elems=CHUNK).encode(torch.zeros(CHUNK, dtype=dtype), kind="weight").numpy()
    p = fr.get_frame_parameters(one)
    nchunks = -(-numel // CHUNK)
    table = np.repeat(p.table[:1], nchunks)
    buf = np.zeros(fr.header_size(p.spec.nstreams, nchunks), np.uint8)
    fr.write_header(
        buf, spec_for(dtype), numel, CHUNK, int(one[7]), np.zeros(p.spec.nstreams, np.uint64), table
    )  # raw books: zero chunks have no payload
    assert fr.get_frame_parameters(buf).numel == numel
    return buf.tobytes()


def _put_frame(c, r, frame: bytes) -> None:
    """Append a frame to the file's body and point record r at it."""
    at = len(c.body)
    c.body += frame + bytes(-len(frame) % 8)
    r["frame"].update(offset=at, length=len(frame), books=["0" * 16] * len(r["frame"]["books"]))


def _claim_zeros(src, dst, numel: int) -> None:
    """Make the precision file's float32 tensor a frame of ``numel`` zeros; the sizes follow it."""
    c = crafted.Container.read(src)
    r = _tensor(c.index, lambda r: r["coding"] == "precision" and r["frame"]["dtype"] == "float32")
    _put_frame(c, r, _zero_frame(numel))
    grow = numel * 4 - r["nbytes"]
    for u in c.index["tensors"]:
        if u["offset"] > r["offset"]:
            u["offset"] += grow
            u["crc_at"] = [a + grow for a in u["crc_at"]]
    r["nbytes"] = numel * 4
    r["shape"] = [numel]
    for key in ("source", "reconstruction"):
        c.index[key]["size"] += grow
    c.write(dst)


def test_a_tiny_lossy_file_claiming_gigabytes_fails_fast_and_small(corpus, tmp_path):
    path = tmp_path / "bomb.ccl"
    _claim_zeros(corpus / "p.ccl", path, 3 << 30 >> 2)  # 3 GiB of float32 zeros in ~300 kB
    assert path.stat().st_size < 400_000
    assert lossy.read_index(path)["reconstruction"]["size"] > 3 << 30
    cases = [
        ["verify", str(path)],
        ["decompress", str(path), str(tmp_path / "bomb.out")],
        ["verify", str(path), "--threads", "2"],
    ]
    for res in run_crafted(cases, tmp_path, ["/"]):
        assert res["rc"] == 2 and len(res["stderr"].strip().splitlines()) == 1, res["stderr"][-600:]
        assert "decompression bomb" in res["stderr"]
        assert res["rss_mb"] < 1024 and res["seconds"] < 30, res
    assert not (tmp_path / "bomb.out").exists()
    with pytest.raises(CheckpointError, match="more than 4096 times its size"):
        lossy.load(path)


# -- codebook files ----------------------------------------------------------------------------------
def _book_file(tmp_path, edit=None, text=None) -> str:
    data = CodebookSet.default().to_dict()
    data["books"] = [e for e in data["books"] if "book" in e][:2]
    if edit is not None:
        edit(data)
    path = tmp_path / "books.json"
    path.write_text(text if text is not None else json.dumps(data))
    return str(path)


@pytest.mark.parametrize("number", ["Infinity", "-Infinity", "NaN", "7" * 5000, "1.5", "true", "-1", '"0"'])
def test_codebook_numbers_must_be_small_ints(tmp_path, number):
    path = _book_file(tmp_path)
    text = re.sub(r'"stream": \d+', f'"stream": {number}', open(path).read(), count=1)
    assert text != open(path).read()
    open(path, "w").write(text)
    from comm_codec import Codec

    with pytest.raises(CodebookError) as info:
        Codec(path)
    assert len(str(info.value)) < 300


def test_a_huge_codebook_field_is_quoted_short(tmp_path, capsys):
    path = _book_file(tmp_path, lambda d: d["books"][0]["book"].update(format="0" * 3_000_000))
    with pytest.raises(CodebookError) as info:
        CodebookSet.load(path)
    assert len(str(info.value)) < 400
    deep = _book_file(
        tmp_path,
        text=json.dumps(CodebookSet.default().to_dict()).replace(
            '"version": 2', '"version": ' + "[" * 900 + "]" * 900, 1
        ),
    )
    with pytest.raises(CodebookError) as info:
        CodebookSet.load(deep)
    assert len(str(info.value)) < 400


# -- special files -------------------------------------------------------------------------------------
def test_fifos_and_devices_are_refused_where_books_and_checkpoints_are_read(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    from comm_codec import Codec

    for path in (fifo, "/dev/zero"):
        with pytest.raises(CodebookError, match="not a regular file"):
            Codec(str(path))
        rc, out, err = _cli(["profile", "--checkpoint", path, "--out", tmp_path / "o.json"], capsys)
        assert rc == 2 and "not a regular file" in _one_clean_line(err)
    assert sorted(os.listdir(tmp_path)) == ["fifo"]


def test_an_oversized_codebook_file_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from comm_codec.core import codebooks

    path = _book_file(tmp_path)
    monkeypatch.setattr(codebooks, "MAX_FILE_BYTES", 1000)
    with pytest.raises(CodebookError, match="larger than 1000 bytes"):
        CodebookSet.load(path)


# -- outputs that are files of the input's chain -------------------------------------------------------
def test_decompress_never_overwrites_a_file_of_the_chain(corpus, tmp_path, capsys):
    for name in ("key0.ccl", "link1.ccl"):
        (tmp_path / name).write_bytes((corpus / name).read_bytes())
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}
    link, key = tmp_path / "link1.ccl", tmp_path / "key0.ccl"
    for argv in (
        ["decompress", link, key, "--force"],
        ["decompress", link, link, "--force"],
        ["decompress", link, key, "--force", "--base", key],
    ):
        rc, out, err = _cli(argv, capsys)
        assert rc == 2, (argv, out, err)
        assert "choose another output path" in _one_clean_line(err)
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before
    rc, out, err = _cli(["decompress", link, tmp_path / "ok.pt"], capsys)
    assert rc == 0, err
