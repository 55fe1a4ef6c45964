"""Checkpoint files as the tools users have write them: DCP data files from torch's own
FileSystemWriter (every tensor of every record coded) and legacy torch.save files (storages
found without unpickling); a file whose tensors all stay opaque says why; crafted files
never crash a reader and always restore byte for byte."""

from __future__ import annotations

import io
import os
import warnings

import ckpt_formats_data as data
import pytest
import torch

from comm_codec import checkpoint
from comm_codec.checkpoint import exact
from comm_codec.checkpoint.files import FileMap
from comm_codec.checkpoint.formats import find_tensors_noted
from comm_codec.tools import cli

pytestmark = pytest.mark.unit


def _roundtrip(src, tmp_path, name="x"):
    """Compress and restore src; return the summary and the index; assert the bytes came back."""
    packed, out = tmp_path / f"{name}.cckp", tmp_path / f"{name}.out"
    s = checkpoint.compress_file(src, packed, progress=False, force=True)
    checkpoint.decompress_file(packed, out, progress=False, force=True)
    with open(src, "rb") as fh:
        assert out.read_bytes() == fh.read()
    checkpoint.verify_file(packed)
    return s, exact.read_index(packed)


def _all_coded(index) -> None:
    """Every tensor large enough to be coded is frame-coded."""
    for t in index["tensors"]:
        if t["nbytes"] >= exact.MIN_CODED_BYTES:
            assert t["coding"] == "frame", t


# -- DCP data files -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_dcp(tmp_path_factory):
    """A DCP directory saved by torch's FileSystemWriter in one process: a model, its AdamW
    state, a raw bytes item holding zip signatures, and plain values."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("dcp") / "ck"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 128)).sum().backward()
    opt.step()
    sd = {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "blob": io.BytesIO(b"PK\x03\x04 not a record PK\x05\x06" * 50),
        "step": 7,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # no process group: one process, as meant
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(root)))
    return root


def _tensor_items(root) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(root)).read_metadata()
    return sum(len(v.chunks) for v in md.state_dict_metadata.values() if isinstance(v, TensorStorageMetadata))


@pytest.mark.slow
def test_distcp_every_tensor_of_every_record_is_found_and_coded(small_dcp, tmp_path):
    files = sorted(small_dcp.glob("*.distcp"))
    found = 0
    for f in files:
        s, index = _roundtrip(f, tmp_path, f.stem)
        assert s.format == "distcp" and s.note is None
        _all_coded(index)
        found += len(index["tensors"])
        # the first (a zip record) and its neighbours: not just the file's first record
        assert sum(t["coding"] == "frame" for t in index["tensors"]) >= 4
    assert found == _tensor_items(small_dcp)


def test_distcp_directory_through_the_cli_lists_its_tensors(small_dcp, tmp_path, capsys):
    out = tmp_path / "packed"
    assert cli.main(["compress", str(small_dcp), str(out)]) == 0
    assert cli.main(["ls", str(out / "__0_0.distcp.cckp")]) == 0
    listing = capsys.readouterr().out
    assert "distcp" in listing and "0 coded" not in listing
    assert cli.main(["decompress", str(out), str(tmp_path / "back")]) == 0
    for f in small_dcp.iterdir():
        assert (tmp_path / "back" / f.name).read_bytes() == f.read_bytes()


@pytest.fixture(scope="module")
def minilm_dcp(tmp_path_factory):
    """all-MiniLM-L6-v2 + AdamW saved by FileSystemWriter on 2 real gloo ranks."""
    import dist_utils

    root = tmp_path_factory.mktemp("minilm") / "dcp"
    dist_utils.run_fresh(data.dcp_rank, 2, str(root), 1, timeout=600, env={"HF_HUB_OFFLINE": "1"})
    return root


@pytest.mark.dist
@pytest.mark.slow
def test_distcp_of_a_real_model_and_adamw_on_two_ranks(minilm_dcp, tmp_path):
    files = sorted(minilm_dcp.glob("*.distcp"))
    assert len(files) == 2
    found = 0
    for f in files:
        s, index = _roundtrip(f, tmp_path, f.stem)
        assert s.format == "distcp", f.name
        _all_coded(index)
        assert s.ratio > 1.3  # fp32 weights + AdamW moments; zstd alone gets ~1.08
        found += len(index["tensors"])
    assert found == _tensor_items(minilm_dcp)


# -- legacy torch.save ----------------------------------------------------------------------
@pytest.mark.slow
def test_legacy_torch_save_of_a_real_model_codes_every_storage(tmp_path):
    src = tmp_path / "minilm_legacy.pt"
    sd = data.save_legacy(str(src))
    s, index = _roundtrip(src, tmp_path)
    assert s.format == "torch_legacy" and s.note is None
    _all_coded(index)
    names = {t["name"] for t in index["tensors"]}
    assert names == set(sd)  # every storage, named by its state-dict key
    assert s.ratio > 1.15
    assert exact.load(tmp_path / "x.cckp").keys() == sd.keys()


def test_legacy_file_with_a_malicious_reduce_is_never_unpickled(tmp_path):
    src, marker = tmp_path / "evil.pt", tmp_path / "UNPICKLED"
    tensors = data.save_legacy_with_payload(str(src), str(marker))
    assert not marker.exists()
    s, index = _roundtrip(src, tmp_path)
    assert cli.main(["ls", str(tmp_path / "x.cckp")]) == 0
    assert cli.main(["verify", str(tmp_path / "x.cckp")]) == 0
    assert not marker.exists()
    assert s.format == "torch_legacy"
    coded = {t["name"]: t for t in index["tensors"]}
    assert coded["w"]["coding"] == "frame" and coded["w"]["dtype"] == "float32"
    assert coded["w"]["nbytes"] == tensors["w"].numel() * 4


@pytest.mark.parametrize("cut", ["storage", "keys", "pickle"])
def test_truncated_legacy_file_is_exact_and_parsed_as_far_as_it_goes(tmp_path, cut):
    full = tmp_path / "full.pt"
    torch.save({"a": torch.randn(4096), "b": torch.randn(4096)}, full, _use_new_zipfile_serialization=False)
    raw = full.read_bytes()
    size = {"storage": len(raw) - 100, "keys": len(raw) - 2 * (8 + 16384) - 3, "pickle": 300}[cut]
    src = tmp_path / "cut.pt"
    src.write_bytes(raw[:size])
    s, index = _roundtrip(src, tmp_path)
    assert s.format == "torch_legacy"
    assert len(index["tensors"]) == {"storage": 1, "keys": 0, "pickle": 0}[cut]


def test_legacy_file_whose_element_count_lies_keeps_the_rest_opaque(tmp_path):
    full = tmp_path / "full.pt"
    torch.save({"a": torch.randn(16384), "b": torch.randn(16384)}, full, _use_new_zipfile_serialization=False)
    raw = bytearray(full.read_bytes())
    first = len(raw) - 2 * (8 + 65536)
    raw[first : first + 8] = (1 << 60).to_bytes(8, "little")
    src = tmp_path / "lie.pt"
    src.write_bytes(raw)
    s, index = _roundtrip(src, tmp_path)
    assert index["tensors"] == [] and s.note is not None and "not understood" in s.note


def test_crafted_distcp_records_restore_exactly(small_dcp, tmp_path):
    raw = bytearray((small_dcp / "__0_0.distcp").read_bytes())
    cases = {
        "truncated": bytes(raw[: len(raw) * 2 // 3]),
        "flipped_descriptor": bytes(raw.replace(b"PK\x07\x08", b"PK\x07\x09", 3)),
        "flipped_end": bytes(raw.replace(b"PK\x05\x06", b"PK\x05\x07", 1)),
        "junk_between": bytes(raw[:5000]) + b"PK\x03\x04" * 100 + bytes(raw[5000:]),
        "much_junk": bytes(raw[:5000]) + b"PK\x03\x04" * 5000 + bytes(raw[5000:]),
        "random": os.urandom(200_000),
    }
    for name, blob in cases.items():
        src = tmp_path / f"{name}.distcp"
        src.write_bytes(blob)
        s, index = _roundtrip(src, tmp_path, name)
        assert s.format == "distcp", name
        if name in ("truncated", "junk_between", "flipped_descriptor"):  # the records that are whole
            assert any(t["coding"] == "frame" for t in index["tensors"]), name


def test_a_file_whose_tensors_stay_opaque_says_why(tmp_path, capsys):
    src = tmp_path / "weights.bin"
    src.write_bytes(os.urandom(100_000))
    s, _ = _roundtrip(src, tmp_path)
    assert s.format == "generic" and "no tensors found" in s.note
    capsys.readouterr()
    assert cli.main(["compress", str(src), str(tmp_path / "y.cckp")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("note: no tensors found")
    assert cli.main(["ls", str(tmp_path / "y.cckp")]) == 0
    assert "note      no tensors found" in capsys.readouterr().out
    ints = tmp_path / "ints.pt"
    torch.save({"ids": torch.arange(100_000)}, ints, _use_new_zipfile_serialization=False)
    m = FileMap(str(ints))
    fmt, tensors, note = find_tensors_noted(m)
    m.close()
    assert fmt == "torch_legacy" and len(tensors) == 1 and "int64" in note


# -- verify and decompress refuse what holds nothing of ours --------------------------------
def test_verify_and_decompress_of_a_directory_with_nothing_compressed_exit_2(small_dcp, tmp_path, capsys):
    for args in (["verify", str(small_dcp)], ["decompress", str(small_dcp), str(tmp_path / "out")]):
        capsys.readouterr()
        assert cli.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "holds no compressed file (.cckp)" in err[0], err
    assert not (tmp_path / "out").exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["verify", str(empty)]) == 2
    assert cli.main(["verify", str(small_dcp / "__0_0.distcp")]) == 2  # a file that is not ours


# -- tensors straight from compressed files -------------------------------------------------
@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """MiniLM saved by save_pretrained in 3 shards, and its mirror by `comm-codec compress DIR`."""
    root = tmp_path_factory.mktemp("hf")
    (src,) = data.hf_dirs(str(root))
    assert cli.main(["compress", src, str(root / "packed")]) == 0
    return src, root / "packed"


@pytest.mark.slow
def test_load_file_and_lazy_open_are_bit_exact_against_safetensors(hf_model):
    from safetensors.torch import load_file as st_load_file

    from comm_codec.checkpoint import tensors

    src, packed = hf_model
    shards = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    assert len(shards) == 3
    for shard in shards:
        ref = st_load_file(os.path.join(src, shard))
        got = tensors.load_file(packed / (shard + ".cckp"))
        assert list(got) == list(ref)
        for k in ref:
            assert got[k].dtype == ref[k].dtype and torch.equal(got[k].view(torch.uint8), ref[k].view(torch.uint8))
        with tensors.open(packed / (shard + ".cckp")) as f:
            assert sorted(f.keys()) == sorted(ref)
            for k in reversed(f.keys()):  # any order, one at a time
                t = f.get_tensor(k)
                assert t.shape == ref[k].shape and torch.equal(t.view(torch.uint8), ref[k].view(torch.uint8))
            assert f.metadata() == {"format": "pt"}
            with pytest.raises(KeyError):
                f.get_tensor("no.such.tensor")


def test_from_pretrained_of_a_compressed_directory_equals_the_original(hf_model):
    from transformers import AutoModel

    from comm_codec.integrations.hf import from_pretrained

    src, packed = hf_model
    ref = AutoModel.from_pretrained(src).state_dict()
    got = from_pretrained(AutoModel, packed).state_dict()
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_loaders_refuse_crafted_inputs(hf_model, tmp_path):
    from comm_codec.checkpoint import tensors
    from comm_codec.integrations.hf import load_state_dict

    src, packed = hf_model
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors.index.json").write_text('{"weight_map": {"x": "../outside.safetensors"}}')
    with pytest.raises(checkpoint.CheckpointError, match="not a file name inside"):
        load_state_dict(bad)
    (bad / "model.safetensors.index.json").write_text('{"weight_map": {"x": "gone.safetensors"}}')
    with pytest.raises(checkpoint.CheckpointError, match="is missing"):
        load_state_dict(bad)
    # A compressed safetensors file whose header lies about a tensor's size.
    from safetensors.torch import save_file

    st = tmp_path / "lie.safetensors"
    save_file({"w": torch.randn(64, 64)}, st)
    raw = bytearray(st.read_bytes())
    at = raw.index(b"[64,64]")
    raw[at : at + 7] = b"[65,64]"
    st.write_bytes(raw)
    checkpoint.compress_file(st, tmp_path / "lie.cckp")
    with pytest.raises(checkpoint.CheckpointError, match="malformed safetensors entry"):
        tensors.open(tmp_path / "lie.cckp")
    with pytest.raises(checkpoint.CheckpointError, match="malformed safetensors entry"):
        tensors.load_file(tmp_path / "lie.cckp")
    # A flipped byte inside a coded tensor: its frame's checksum says so.
    packed_file = packed / "model-00001-of-00003.safetensors.cckp"
    blob = bytearray(packed_file.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    (tmp_path / "flip.cckp").write_bytes(blob)
    with pytest.raises(checkpoint.CheckpointError):
        with tensors.open(tmp_path / "flip.cckp") as f:
            for k in f.keys():
                f.get_tensor(k)
    with pytest.raises(checkpoint.CheckpointError):
        tensors.load_file(tmp_path / "flip.cckp")


def test_load_file_checks_the_whole_file_digest_as_well_as_the_frames(tmp_path):
    """Every segment's own check passes, only the recorded digest of the original is wrong:
    load_file (safetensors and torch.save originals, small files on one thread and large ones
    on several) refuses it, naming the digest; the same file with its digest intact loads."""
    from safetensors.torch import save_file

    from comm_codec.checkpoint import tensors

    from crafted import Container

    gen = torch.Generator().manual_seed(3)
    sd = {"w": torch.randn(96, 64, generator=gen), "b": torch.randn(64, generator=gen).to(torch.bfloat16)}
    big = {"e": torch.randn(3 << 20, generator=gen)}  # 12 MiB: restored by several threads where there are cores
    for name, state, save in (
        ("s.safetensors", sd, save_file),
        ("t.pt", sd, torch.save),
        ("big.safetensors", big, save_file),
    ):
        src, packed = tmp_path / name, tmp_path / (name + ".cckp")
        save(state, src)
        checkpoint.compress_file(src, packed, progress=False)
        got = tensors.load_file(packed)
        assert list(got) == list(state)
        for k in state:
            assert got[k].dtype == state[k].dtype and torch.equal(got[k].view(torch.uint8), state[k].view(torch.uint8))
        c = Container.read(packed)
        digest = c.index["source"]["blake3"]
        c.index["source"]["blake3"] = digest[:-1] + ("0" if digest[-1] != "0" else "1")
        c.write(tmp_path / "lie.cckp")
        with pytest.raises(checkpoint.CheckpointError, match="blake3 .* corrupted"):
            tensors.load_file(tmp_path / "lie.cckp")


def test_from_pretrained_refuses_a_shard_whose_digest_is_wrong(hf_model, tmp_path):
    """The digests are checked while transformers builds the model: a wrong one still
    fails the call (and load_state_dict), whichever shard it is."""
    import shutil

    from transformers import AutoModel

    from comm_codec.integrations.hf import from_pretrained, load_state_dict

    from crafted import Container

    _, packed = hf_model
    bad = tmp_path / "bad"
    shutil.copytree(packed, bad)
    c = Container.read(bad / "model-00002-of-00003.safetensors.cckp")
    digest = c.index["source"]["blake3"]
    c.index["source"]["blake3"] = digest[::-1] if digest[::-1] != digest else "0" * len(digest)
    c.write(bad / "model-00002-of-00003.safetensors.cckp")
    with pytest.raises(checkpoint.CheckpointError, match="model-00002-of-00003.*blake3 .* corrupted"):
        from_pretrained(AutoModel, bad)
    with pytest.raises(checkpoint.CheckpointError, match="model-00002-of-00003.*blake3 .* corrupted"):
        load_state_dict(bad)


def test_load_file_of_a_delta_asks_for_its_base(tmp_path):
    from safetensors.torch import save_file

    from comm_codec.checkpoint import tensors

    a = {"w": torch.randn(128, 64)}
    save_file(a, tmp_path / "a.safetensors")
    save_file({"w": a["w"] + 1e-3}, tmp_path / "b.safetensors")
    checkpoint.compress_file(tmp_path / "b.safetensors", tmp_path / "b.cckp", base=tmp_path / "a.safetensors")
    with pytest.raises(checkpoint.CheckpointError, match="is a delta against .*decompress_file"):
        tensors.load_file(tmp_path / "b.cckp")


# -- directory deltas -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_steps(tmp_path_factory):
    """MiniLM saved by save_pretrained (3 shards) before and after 2 AdamW steps."""
    root = tmp_path_factory.mktemp("steps")
    return data.hf_dirs(str(root), steps=(0, 2))


def _tree_bytes(root) -> dict:
    out = {}
    for folder, _, files in os.walk(root):
        for f in files:
            p = os.path.join(folder, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


@pytest.mark.slow
def test_directory_delta_pairs_files_by_relative_path(hf_steps, tmp_path, capsys):
    a, b = hf_steps
    extra = os.path.join(b, "only_here.safetensors")  # no partner in the base
    from safetensors.torch import save_file

    save_file({"x": torch.randn(4096)}, extra)
    try:
        full, delta = tmp_path / "full", tmp_path / "delta"
        assert cli.main(["compress", b, str(full)]) == 0
        capsys.readouterr()
        assert cli.main(["compress", b, str(delta), "--base", a]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert any("only_here.safetensors" in ln and "no partner in the base directory" in ln for ln in lines)
        assert sum("as deltas" in ln for ln in lines) == 3  # the three shards
        size = lambda d: sum(len(v) for v in _tree_bytes(d).values())
        assert size(delta) < size(full)
        # Restored with the same base, byte for byte; refused without it.
        assert cli.main(["decompress", str(delta), str(tmp_path / "back"), "--base", a]) == 0
        assert _tree_bytes(tmp_path / "back") == _tree_bytes(b)
        capsys.readouterr()
        assert cli.main(["decompress", str(delta), str(tmp_path / "nobase")]) == 2
        assert "--base" in capsys.readouterr().err
        assert not (tmp_path / "nobase").exists()
        # The base may be the previous directory's compressed mirror.
        assert cli.main(["compress", a, str(tmp_path / "a.cc")]) == 0
        assert cli.main(["decompress", str(delta), str(tmp_path / "back2"), "--base", str(tmp_path / "a.cc")]) == 0
        assert _tree_bytes(tmp_path / "back2") == _tree_bytes(b)
    finally:
        os.unlink(extra)


def test_crafted_headers_cannot_make_the_walk_read_a_file_over_and_over(tmp_path):
    # Local headers whose data descriptors never come: each one would search to the end.
    blob = (b"PK\x03\x04" + b"\x00\x00\x08\x00" + b"\x00" * 18 + b"\x08\x00\x00\x00" + b"data.pkl") * 200
    src = tmp_path / "many.distcp"
    src.write_bytes(blob + os.urandom(4 << 20))
    m = FileMap(str(src))
    from comm_codec.checkpoint import formats

    reads = []
    real = m.u8
    m.u8 = lambda offset, length, keep=False: (reads.append(length), real(offset, length, keep))[1]
    fmt, tensors, _ = find_tensors_noted(m)
    m.close()
    assert fmt == "distcp" and tensors == []
    assert sum(reads) < 3 * m.size + (64 << 20) + 300 * formats._SEARCH_STEP


def test_a_dcp_data_file_by_another_name_is_still_read_record_by_record(small_dcp, tmp_path):
    src = tmp_path / "renamed.bin"
    src.write_bytes((small_dcp / "__0_0.distcp").read_bytes())
    s, index = _roundtrip(src, tmp_path)
    assert s.format == "distcp" and any(t["coding"] == "frame" for t in index["tensors"])
    torch.save({"w": torch.randn(64, 64)}, tmp_path / "one.pt")  # one zip: still torch_zip
    s, _ = _roundtrip(tmp_path / "one.pt", tmp_path, "one")
    assert s.format == "torch_zip" and s.coded == 1
