"""Untrusted input, round 3: JSON that lies about its size (issue 46, findings 3 and 8).

Every JSON the package parses goes through ``comm_codec.core._json.loads``, which sizes
the text before parsing (astral strings at 4 bytes per character, containers, numbers)
and shares one budget among parses in flight. The crafted inputs come from
``tests/crafted.py`` (``padded_index``, ``padded_json``); the CLI cases run in one
watched child (peak RSS per case, paths opened, exit status).
"""

from __future__ import annotations

import json
import os
import threading
import time
import tracemalloc

import pytest
import torch
from safetensors.torch import save_file

import comm_codec as cc
from comm_codec import checkpoint as ck
from comm_codec.checkpoint import lossy
from comm_codec.checkpoint.container import parse_json
from comm_codec.comm import agreement
from comm_codec.core import _json

import crafted
from helpers import run_crafted

pytestmark = pytest.mark.unit

_N = 60_000
_SHAPES = {
    "empty dicts": b"[" + b",".join([b"{}"] * _N) + b"]",
    "empty lists": b"[" + b",".join([b"[]"] * _N) + b"]",
    "one-key dicts": b"[" + b",".join([b'{"a":1}'] * _N) + b"]",
    "distinct keys": b"{" + b",".join(b'"%d":{}' % i for i in range(_N)) + b"}",
    "floats": b"[" + b",".join([b"0.5"] * _N) + b"]",
    "two-letter strings": b"[" + b",".join([b'"ab"'] * _N) + b"]",
    "astral strings": b"[" + b",".join(['"\U0001f600"'.encode()] * _N) + b"]",
    "escaped astral strings": b"[" + b",".join([b'"\\ud83d\\ude00"'] * _N) + b"]",
    "one astral then ascii": ('"\U0001f600' + "a" * 2_000_000 + '"').encode(),
    "one escaped astral then ascii": ('"\\ud83d\\ude00' + "a" * 2_000_000 + '"').encode(),
    "bmp then ascii": ('"\u4e00' + "a" * 2_000_000 + '"').encode(),
    "ascii then astral": ('"' + "a" * 2_000_000 + '\U0001f600"').encode(),
    "an escape, ascii, then astral": ('"\\n' + "a" * 2_000_000 + '\U0001f600"').encode(),
}


@pytest.mark.parametrize("shape", sorted(_SHAPES))
def test_the_estimate_bounds_what_the_parse_holds(shape):
    text = _SHAPES[shape]
    tracemalloc.start()
    try:
        value = json.loads(text.decode("utf-8"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del value
    assert _json.estimate(text) >= peak + len(text), (shape, _json.estimate(text), peak)


@pytest.mark.slow
def test_an_astral_pad_is_refused_before_parsing():
    text = ('{"pad":"\U0001f600' + "a" * (64 << 20) + '"}').encode()
    start = time.perf_counter()
    with pytest.raises(cc.CheckpointError, match=r"^f: index is malformed \(.*more than the 512 MiB allowed"):
        parse_json(text, "f")
    assert time.perf_counter() - start < 5
    # The same length of ASCII fits: it is the width that was missed.
    assert len(parse_json(text.replace("\U0001f600".encode(), b"b"), "f")["pad"]) == (64 << 20) + 1


@pytest.mark.parametrize(
    "text,reason",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b"{not json", "bad JSON: Expecting property name"),
        (b"\xff\xfe", "not UTF-8 text"),
        (b"[" + b"1" * 5000 + b"]", "bad JSON: Exceeds the limit"),
    ],
)
def test_malformed_text_is_the_callers_error(text, reason):
    with pytest.raises(cc.CollectiveError, match=f"^rank 1 sent settings that are not JSON \\({reason}"):
        agreement.peer_json(
            text.decode("utf-8", "surrogateescape") if text[0] != 0xFF else text,
            "rank 1 sent settings that are not JSON",
        )


def test_a_peers_deep_settings_are_a_collective_error_not_recursion():
    with pytest.raises(cc.CollectiveError, match="nested too deeply"):
        agreement.peer_json("[" * 50_000 + "]" * 50_000, "rank 1 sent settings that are not JSON")


def test_parses_in_flight_share_one_budget():
    """A parse waits while others hold the budget, and goes on when they are done."""
    budget = _json.budget
    text = b'{"a":[' + b"1," * 1000 + b"1]}"
    need = _json.estimate(text)
    held = budget.total - need + 1  # what another parse holds: this one does not fit beside it
    budget.acquire(held)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (_json.loads(text, error=ValueError), done.set()))
    try:
        worker.start()
        assert not done.wait(0.5), "the parse ran past the budget"
    finally:
        budget.release(held)
    assert done.wait(10)
    worker.join()
    assert budget.used == 0


def test_a_padded_codebook_file_is_refused_before_parsing(tmp_path, monkeypatch):
    books = cc.CodebookSet.default()
    books.save(tmp_path / "ok.json")
    (tmp_path / "pad.json").write_bytes(crafted.padded_json((tmp_path / "ok.json").read_bytes(), 60 << 20))
    start = time.perf_counter()
    with pytest.raises(cc.CodebookError, match=r"pad\.json: not a valid codebook file \(.* MiB allowed"):
        cc.CodebookSet.load(tmp_path / "pad.json")
    assert time.perf_counter() - start < 40
    # A real set with a small pad still loads: the estimate does not refuse what fits.
    (tmp_path / "small.json").write_bytes(crafted.padded_json((tmp_path / "ok.json").read_bytes(), 1 << 20))
    assert isinstance(cc.CodebookSet.load(tmp_path / "small.json"), cc.CodebookSet)


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    d = tmp_path_factory.mktemp("seeds")
    g = torch.Generator().manual_seed(3)
    w = torch.randn(20_000, generator=g) * 0.02
    save_file({"w": w.bfloat16(), "v": w}, d / "m.safetensors")
    ck.compress_file(d / "m.safetensors", d / "m.cckp", threads=1)
    torch.save({"model": {"w": w}}, d / "a.pt")
    lossy.compress_file(d / "a.pt", d / "a.ccl", threads=1)
    return d


@pytest.mark.cli
@pytest.mark.slow
def test_padded_indexes_exit_cleanly_in_bounded_memory(seeds, tmp_path):
    """Finding 3's reproductions through the command line: ls, verify, decompress, and a
    directory verified on two threads whose two files each parse into hundreds of MB."""
    exact, lossy_file = (seeds / "m.cckp").read_bytes(), (seeds / "a.ccl").read_bytes()
    chars = (128 << 20) - 4096
    (tmp_path / "astral.cckp").write_bytes(crafted.padded_index(exact, chars))
    (tmp_path / "astral.ccl").write_bytes(crafted.padded_index(lossy_file, chars))
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("a", "b"):  # ASCII: within one parse's limit, so both are parsed, one at a time
        (tree / f"{name}.safetensors.cckp").write_bytes(crafted.padded_index(exact, 100 << 20, astral=False))
    astral_tree = tmp_path / "astral_tree"
    astral_tree.mkdir()
    for name in ("a", "b"):
        (astral_tree / f"{name}.safetensors.cckp").write_bytes(crafted.padded_index(exact, 40 << 20))
    p = lambda n: str(tmp_path / n)
    cases = [
        (["ls", p("astral.cckp")], (2,)),
        (["verify", p("astral.cckp")], (2,)),
        (["decompress", p("astral.cckp"), p("astral.out")], (2,)),
        (["ls", p("astral.ccl")], (2,)),
        (["decompress", p("astral.ccl"), p("astral.pt")], (2,)),
        (["verify", "--threads", "2", str(tree)], (0,)),
        (["verify", "--threads", "2", str(astral_tree)], (0, 2)),
    ]
    results = run_crafted([argv for argv, _ in cases], tmp_path, [str(tmp_path), *_roots()], timeout=400)
    bad = []
    for (argv, statuses), res in zip(cases, results):
        lines = [x for x in res["stderr"].splitlines() if x.strip() and not x.startswith("INFO ")]
        if (
            res["rc"] not in statuses
            or len(lines) > 1
            or any(len(x) > 1024 for x in lines)
            or res["rss_mb"] > 1024
            or res["seconds"] > 40
            or res["foreign"]
        ):
            bad.append(
                f"{argv[0]} {os.path.basename(argv[-1])}: rc {res['rc']} rss {res['rss_mb']:.0f} MB "
                f"{res['seconds']:.1f} s opened {res['foreign']} stderr {res['stderr'][-300:]!r}"
            )
    assert not bad, "\n".join(bad)
    assert not os.path.exists(p("astral.out")) and not os.path.exists(p("astral.pt"))


def _roots() -> list:
    import sys
    import sysconfig

    return sorted(
        {
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            sys.prefix,
            sys.base_prefix,
            sysconfig.get_paths()["purelib"],
            "/proc/",
            "/sys/",
            "/dev/null",
            "/dev/urandom",
            "/dev/shm",
            "/etc/localtime",
            "/usr/",
            "/lib",
        }
    )


_PICKLING_COLLECTIVES = {
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
    "all_to_all_object",
}


@pytest.mark.slow
def test_nothing_between_ranks_is_a_pickle():
    """Finding 7: the package, its demos and its launch scripts call no collective that
    unpickles what a peer sends (a peer's ``__reduce__`` would run on every rank)."""
    import ast

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    calls = []
    for top in ("comm_codec", "launch_scripts"):
        for folder, _, names in os.walk(os.path.join(repo, top)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    with open(path, encoding="utf-8") as fh:
                        tree = ast.parse(fh.read(), path)
                    calls += [
                        f"{os.path.relpath(path, repo)}:{node.lineno} {node.func.attr}"
                        for node in ast.walk(tree)
                        if isinstance(node, ast.Call)
                        and isinstance(node.func, ast.Attribute)
                        and node.func.attr in _PICKLING_COLLECTIVES
                    ]
    assert not calls, calls
