"""comm_codec.dcp across releases and from other writers (issue 49: items 1, 2, 5's DCP part, 7).

* Golden directories (tests/make_golden_dcp.py): book table v1 (shipped books named by
  id) reads with the set that wrote it and says which set otherwise; v2 (every book in
  the file) reads with no argument whatever the default books are, and today's Writer
  still writes its data file byte for byte.
* A directory saved now, and a ``.cckp`` golden, read after the shipped default books
  changed (the default lookup pointed at another set).
* Directories written by torch's own FileSystemWriter, with and without ZStandard, on
  one process and on 2 gloo ranks, read bit-exact by comm_codec.dcp.Reader.
* Writer takes FileSystemWriter's options.
* ``comm-codec verify / ls / inspect`` of a comm_codec.dcp directory and its data files.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from make_golden import checkpoint_inputs
from make_golden_dcp import BOOKS, OUT, state_dict
from test_dcp import _assert_same, _full, _trained, _zeros_like
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._extension import ZStandard

import comm_codec as cc
import comm_codec.dcp as ccd
from comm_codec import checkpoint
from comm_codec.core import codebooks as codebooks_module
from comm_codec.core.errors import CheckpointError

import dist_utils

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:.*torch.distributed.*:UserWarning")]


def _empty_like(sd):
    """A load target: zeros for tensors, placeholders for values."""
    return {
        k: _empty_like(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else type(v)()
        for k, v in sd.items()
    }


@pytest.fixture
def other_default(monkeypatch):
    """The shipped default books replaced by another set, as an upgrade that changes codebooks/default.json does."""
    other = cc.CodebookSet.load(BOOKS)
    real = cc.CodebookSet.default()
    assert other.digest != real.digest
    monkeypatch.setattr(codebooks_module, "_default_cache", other)
    assert cc.CodebookSet.default() is other
    return other


@pytest.fixture
def no_default(monkeypatch):
    """No shipped books at all."""
    monkeypatch.setattr(codebooks_module, "_default_cache", cc.CodebookSet({}))


# -- golden directories -----------------------------------------------------------------------
def test_golden_v1_reads_with_the_set_that_wrote_it():
    out = _empty_like(state_dict())
    ccd.load(out, os.path.join(OUT, "dcp_v1"), codebooks=BOOKS)
    _assert_same(out, state_dict())


def test_golden_v1_without_that_set_says_which_set_and_codebooks():
    with pytest.raises(CheckpointError) as info:
        ccd.load(_empty_like(state_dict()), os.path.join(OUT, "dcp_v1"))
    msg = str(info.value)
    assert cc.CodebookSet.load(BOOKS).digest in msg and "codebooks=" in msg and "__0_0.distcp" in msg


def test_golden_v2_reads_with_no_books_argument_whatever_the_default(no_default):
    out = _empty_like(state_dict())
    ccd.load(out, os.path.join(OUT, "dcp_v2"))
    _assert_same(out, state_dict())


def test_golden_v2_data_file_is_what_todays_writer_writes(tmp_path):
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        dcp.save(state_dict(), storage_writer=ccd.Writer("dcp_v2", codebooks=BOOKS))
    finally:
        os.chdir(here)
    with open(os.path.join(OUT, "dcp_v2", "__0_0.distcp"), "rb") as fh:
        assert (tmp_path / "dcp_v2" / "__0_0.distcp").read_bytes() == fh.read()


def test_a_directory_saved_now_loads_bit_exact_after_the_default_books_change(tmp_path, monkeypatch):
    g = torch.Generator().manual_seed(11)
    sd = {
        "w": (torch.randn(300, 200, generator=g) * 0.02).to(torch.bfloat16),  # planned
        "b": (torch.randn(300, generator=g) * 0.01).to(torch.bfloat16),  # packed: the shipped books
        "s": torch.randn(1000, generator=g),
        "n": torch.arange(7),
    }
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path))
    monkeypatch.setattr(codebooks_module, "_default_cache", cc.CodebookSet.load(BOOKS))
    out = _empty_like(sd)
    ccd.load(out, tmp_path)
    _assert_same(out, sd)


def test_cckp_golden_reads_after_the_default_books_change(tmp_path, other_default):
    _, pt = checkpoint_inputs(str(tmp_path))
    restored = tmp_path / "restored"
    checkpoint.decompress_file(os.path.join(OUT, "golden_pt.cckp"), str(restored), progress=False)
    with open(pt, "rb") as fh:
        assert restored.read_bytes() == fh.read()


# -- migration: torch's own writer ------------------------------------------------------------
def _model_and_adam():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 4)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    state = {f"{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()}
    return {"model": model.state_dict(), "optim": {"state": state}, "epoch": 7, "name": "run"}


@pytest.mark.parametrize("zstd", [False, True], ids=["plain", "zstd"])
def test_reader_reads_torch_filesystemwriter_directories(tmp_path, zstd):
    sd = _model_and_adam()
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path, _extensions=[ZStandard()] if zstd else None))
    out = _empty_like(sd)
    ccd.load(out, tmp_path)
    _assert_same(out, sd)


def _w_save_torch(rank, world, path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net, opt = _trained(world)
    msd, osd = get_state_dict(net, opt)
    sd = {"model": msd, "optim": osd}
    dcp.save(sd, storage_writer=FileSystemWriter(os.path.join(path, "zstd"), _extensions=[ZStandard()]))
    dcp.save(sd, storage_writer=ccd.Writer(os.path.join(path, "ours"), thread_count=2, single_file_per_rank=False))
    full = _full(sd)  # a collective: every rank gathers
    return full if rank == 0 else None


@pytest.mark.dist
def test_zstd_and_writer_options_on_two_ranks_load_bit_exact(tmp_path):
    want = dist_utils.run(_w_save_torch, 2, str(tmp_path), timeout=180)[0]
    assert len([n for n in os.listdir(tmp_path / "ours") if n.endswith(".distcp")]) > 2  # one file per item
    for which in ("zstd", "ours"):
        target = _zeros_like(want)
        target["optim"]["param_groups"] = want["optim"]["param_groups"]
        ccd.load(target, tmp_path / which)
        _assert_same(target, want)


def test_writer_takes_filesystemwriters_options(tmp_path):
    sd = _model_and_adam()
    sd["big"] = (torch.randn(400, 300) * 0.02).to(torch.bfloat16)
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path / "one", thread_count=1))
    dcp.save(
        sd,
        storage_writer=ccd.Writer(
            tmp_path / "two",
            thread_count=2,
            sync_files=False,
            overwrite=True,
            per_thread_copy_ahead=1 << 20,
            cache_staged_state_dict=False,
        ),
    )
    assert (tmp_path / "one" / "__0_0.distcp").read_bytes() == (tmp_path / "two" / "__0_0.distcp").read_bytes()
    with pytest.raises(ValueError, match="extensions"):
        ccd.Writer(tmp_path / "x", _extensions=[ZStandard()])
    with pytest.raises(ValueError, match="thread_count"):
        ccd.Writer(tmp_path / "x", thread_count=0)


# -- the command line ---------------------------------------------------------------------------
def _cli(capsys, *argv):
    from comm_codec.tools import cli

    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "ckpt"
    shutil.copytree(os.path.join(OUT, "dcp_v2"), path)
    return path


def test_cli_verify_ls_and_inspect_of_a_dcp_directory(capsys, saved):
    code, out, err = _cli(capsys, "verify", str(saved))
    assert code == 0 and "verified" in out and "frames" in out, (out, err)
    code, out, _ = _cli(capsys, "ls", str(saved))
    assert code == 0 and "__0_0.distcp" in out and "layer.0.weight" in out
    code, out, _ = _cli(capsys, "inspect", str(saved / "__0_0.distcp"))
    assert code == 0 and "comm_codec.dcp data file" in out and "book table" in out


def test_cli_verify_of_a_dcp_directory_with_one_flipped_byte_exits_2_naming_the_file(capsys, saved, tmp_path):
    md = ccd.Reader(saved).read_metadata()
    for fqn in ("model.layer.0.weight", "counts", "meta.name"):
        d = tmp_path / fqn
        shutil.copytree(saved, d)
        info = next(r for i, r in md.storage_data.items() if i.fqn == fqn)
        with open(d / info.relative_path, "r+b") as fh:
            fh.seek(info.offset + info.length // 2)
            b = fh.read(1)
            fh.seek(-1, 1)
            fh.write(bytes([b[0] ^ 0x10]))
        code, out, err = _cli(capsys, "verify", str(d))
        assert code == 2 and str(d / "__0_0.distcp") in err and len(err.strip().splitlines()) == 1, (fqn, out, err)
