"""One meaning per word across the checkpoint functions and DCP (issue 48).

``force`` is False everywhere (an existing output is refused unless asked for), options
come after the paths as keywords, ``codebooks`` takes a set, a path or None (a missing file
is a CodebookError), a callable that picks kinds goes in ``kind_of=``, the lossy method is
``method=`` (``mode`` is the comm engine's auto/always/never), and the DCP Writer and Reader
report through the checkpoint summary record with the traffic record's field names.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

import comm_codec as cc
import comm_codec.dcp as ccd
from comm_codec import checkpoint
from comm_codec.checkpoint import directory, lossy

pytestmark = pytest.mark.unit


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "w.pt"
    torch.manual_seed(0)
    torch.save({"w": torch.randn(64, 64).to(torch.bfloat16)}, path)
    return path


def test_compress_and_decompress_refuse_an_existing_output_by_default(tmp_path, src):
    out = tmp_path / "w.cckp"
    out.write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="force=True"):
        checkpoint.compress_file(src, out)
    assert out.read_bytes() == b"keep me"
    checkpoint.compress_file(src, out, force=True)
    back = tmp_path / "back.pt"
    back.write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        checkpoint.decompress_file(out, back)
    assert back.read_bytes() == b"keep me"
    checkpoint.decompress_file(out, back, force=True)
    assert back.read_bytes() == src.read_bytes()


def test_lossy_refuses_an_existing_output_by_default_and_takes_method(tmp_path):
    from safetensors.torch import save_file

    st = tmp_path / "m.safetensors"
    save_file({"w": torch.randn(128, 64)}, st)
    out = tmp_path / "m.ccl"
    out.write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        lossy.compress_file(st, out, method="precision", keep_bits=7)
    s = lossy.compress_file(st, out, method="precision", keep_bits=7, force=True)
    assert s.method == "precision" and s.as_dict()["bytes_in"] == st.stat().st_size
    with pytest.raises(TypeError):
        lossy.compress_file(st, tmp_path / "n.ccl", mode="precision", keep_bits=7)  # mode is the engine's word
    with pytest.raises(ValueError, match="method must be one of"):
        lossy.compress_file(st, tmp_path / "n.ccl", method="lossy")
    back = tmp_path / "back.safetensors"
    back.write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        lossy.decompress_file(out, back)
    lossy.decompress_file(out, back, force=True)


@pytest.mark.parametrize(
    "call",
    [
        lambda a, b: checkpoint.compress_file(a, b, None),
        lambda a, b: checkpoint.decompress_file(a, b, None),
        lambda a, b: checkpoint.verify_file(a, None),
        lambda a, b: checkpoint.save({}, b, None),
        lambda a, b: checkpoint.load(a, None),
        lambda a, b: lossy.compress_file(a, b, "excp"),
        lambda a, b: lossy.decompress_file(a, b, None),
        lambda a, b: lossy.verify_file(a, None),
        lambda a, b: directory.compress_dir(a, b, 2),
        lambda a, b: directory.decompress_dir(a, b, 2),
        lambda a, b: directory.verify_dir(a, 2),
    ],
)
def test_every_checkpoint_function_takes_its_options_as_keywords(tmp_path, call):
    with pytest.raises(TypeError, match="positional"):
        call(tmp_path / "a", tmp_path / "b")


def test_a_missing_codebooks_file_is_a_codebook_error_everywhere(tmp_path, src):
    from comm_codec.ddp import HuffmanState

    missing = tmp_path / "missing.json"
    for make in (
        lambda: HuffmanState(codebooks=str(missing)),
        lambda: checkpoint.compress_file(src, tmp_path / "a.cckp", codebooks=missing),
        lambda: ccd.Writer(tmp_path / "d", codebooks=missing),
        lambda: ccd.Reader(tmp_path / "d", codebooks=missing),
        lambda: cc.Codec(codebooks=missing),
    ):
        with pytest.raises(cc.CodebookError, match="no such file"):
            make()
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "w.pt").write_bytes(src.read_bytes())
    with pytest.raises(cc.CodebookError, match="no such file"):
        directory.compress_dir(tree, tmp_path / "out", codebooks=missing)
    assert not (tmp_path / "out").exists()  # refused before anything was made
    books = tmp_path / "books.json"
    cc.CodebookSet.default().save(books)
    directory.compress_dir(tree, tmp_path / "out", codebooks=str(books))


def _state_dict():
    torch.manual_seed(1)
    return {
        "layer.0.w": torch.randn(256, 128).to(torch.bfloat16),
        "optim.state.layer.0.w.exp_avg": torch.randn(256, 128).to(torch.bfloat16) * 1e-3,
        "bias": torch.randn(16),
        "step": 7,
    }


def test_dcp_writer_refuses_an_existing_checkpoint_unless_forced(tmp_path):
    sd = _state_dict()
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path))
    with pytest.raises(dcp.CheckpointException) as caught:  # DCP wraps what a storage writer raises
        dcp.save(sd, storage_writer=ccd.Writer(tmp_path))
    error = caught.value.failures[0]
    error = error[0] if isinstance(error, tuple) else error
    assert isinstance(error, FileExistsError) and "pass force=True" in str(error)
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path, force=True))
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path, overwrite=True))  # FileSystemWriter's spelling
    with pytest.raises(ValueError, match="disagree"):
        ccd.Writer(tmp_path, force=True, overwrite=False)


def test_dcp_writer_takes_a_kind_callable_as_kind_of(tmp_path):
    seen = []

    def pick(fqn: str) -> str:
        seen.append(fqn)
        return "weight"

    dcp.save(_state_dict(), storage_writer=ccd.Writer(tmp_path, kind_of=pick))
    assert "layer.0.w" in seen
    with pytest.raises(TypeError):
        ccd.Writer(tmp_path, kind=pick)
    with pytest.raises(TypeError, match="kind_of must be a callable"):
        ccd.Writer(tmp_path, kind_of="weight")


def test_dcp_writer_and_reader_report_a_summary_with_the_traffic_names(tmp_path):
    sd = _state_dict()
    writer = ccd.Writer(tmp_path)
    assert writer.stats().as_dict()["bytes_in"] == 0
    dcp.save(sd, storage_writer=writer)
    saved = writer.stats()
    data = sum(p.stat().st_size for p in tmp_path.glob("*.distcp"))
    assert isinstance(saved, checkpoint.Summary) and saved.op == "save" and saved.format == "dcp"
    assert saved.bytes_out == saved.compressed_bytes == data
    assert saved.tensors == 3 and saved.coded == 3
    assert saved.bytes_in > 256 * 128 * 2 * 2 and saved.bytes_saved == saved.bytes_in - saved.bytes_out > 0
    d = saved.as_dict()
    assert {"bytes_in", "bytes_out", "bytes_saved", "ratio", "seconds"} <= set(d) and d["ratio"] == saved.ratio
    assert "saved" in saved.line()

    out = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else 0) for k, v in sd.items()}
    loaded = ccd.load(out, tmp_path)
    assert loaded.op == "load" and loaded.tensors == 3 and loaded.coded == 3
    tensor_bytes = sum(v.numel() * v.element_size() for v in sd.values() if isinstance(v, torch.Tensor))
    assert tensor_bytes < loaded.bytes_in < tensor_bytes + 4096  # and the pickled step
    assert 0 < loaded.bytes_out <= data
    assert all(torch.equal(out[k].view(torch.int16), sd[k].view(torch.int16)) for k in ("layer.0.w",))
