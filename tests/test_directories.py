"""Checkpoint directories: a sharded HF model, a DCP checkpoint and any tree, compressed into a
mirror and restored byte for byte; links and special files never followed; outputs never
inside the input; a failure removes what it made."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from comm_codec.checkpoint import directory
from comm_codec.checkpoint.errors import CheckpointError
from comm_codec.tools import cli

pytestmark = pytest.mark.unit


def _regular_files(root) -> dict:
    out = {}
    for folder, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as fh:
                    out[os.path.relpath(path, root)] = fh.read()
    return out


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A model directory as trainers and hubs write them, with traps in it."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("trees")
    src = root / "model"
    src.mkdir()
    g = torch.Generator().manual_seed(3)
    save_file(
        {"a.weight": (torch.randn(256, 256, generator=g) * 0.02).bfloat16()}, src / "model-00001-of-00002.safetensors"
    )
    save_file(
        {"b.weight": torch.randn(128, 256, generator=g) * 0.02, "b.bias": torch.zeros(256)},
        src / "model-00002-of-00002.safetensors",
    )
    (src / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"a.weight": "model-00001-of-00002.safetensors", '
        '"b.weight": "model-00002-of-00002.safetensors", "b.bias": "model-00002-of-00002.safetensors"}}'
    )
    (src / "empty.txt").write_bytes(b"")
    (src / "nothing").mkdir()
    # A torch.distributed.checkpoint directory, saved in one process (no process group).
    with warnings.catch_warnings():  # "no process group: saving in a single process", as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"w": torch.randn(64, 512, generator=g) * 0.02, "step": torch.tensor(7)}, checkpoint_id=str(src / "dcp")
        )
    (src / "runs" / "0").mkdir(parents=True)
    torch.save(
        {
            "model_state_dict": {"l.weight": torch.randn(96, 96, generator=g)},
            "optimizer_state_dict": {"state": {0: {"exp_avg": torch.randn(96, 96, generator=g)}}},
        },
        src / "runs" / "0" / "ckpt.pt",
    )
    # Traps: links out of the tree (to a file and to a directory) and a FIFO.
    secret = root / "outside.txt"
    secret.write_text("never read through a link")
    os.symlink(secret, src / "link_to_file")
    os.symlink(root, src / "runs" / "link_to_dir")
    os.mkfifo(src / "pipe")
    return root, src


def test_a_tree_round_trips_byte_for_byte_and_links_are_never_followed(tree):
    root, src = tree
    out, back = root / "rt.cckp", root / "rt.back"
    seen = []
    s = directory.compress_dir(src, out, threads=2, on_file=seen.append)
    names = {f.path: f.action for f in s.files}
    assert names["model-00001-of-00002.safetensors"] == names["runs/0/ckpt.pt"] == "compressed"
    assert names["model.safetensors.index.json"] == names["empty.txt"] == names["dcp/.metadata"] == "copied"
    assert any(p.startswith("dcp/") and p.endswith(".distcp") and a == "compressed" for p, a in names.items())
    assert {names["link_to_file"], names["runs/link_to_dir"], names["pipe"]} == {"skipped"}
    assert sorted(f.path for f in seen) == sorted(p for p, a in names.items() if a != "skipped")
    assert os.path.isfile(out / "model-00001-of-00002.safetensors.cckp")
    assert not os.path.lexists(out / "link_to_file") and not os.path.lexists(out / "runs" / "link_to_dir")
    assert "never read" not in str(_regular_files(out))
    assert s.ratio > 1.0 and "3 copied, 3 skipped" in s.line() and "2 at once" in s.line()
    assert os.path.isdir(out / "nothing")

    v = directory.verify_dir(out, threads=2)
    assert sum(f.action == "verified" for f in v.files) == sum(a == "compressed" for a in names.values())
    listing = directory.describe_dir(out)
    assert "model-00002-of-00002.safetensors  compressed" in listing and "safetensors, 2 tensors" in listing

    d = directory.decompress_dir(out, back, threads=2)
    assert sum(f.action == "decompressed" for f in d.files) == sum(a == "compressed" for a in names.values())
    assert _regular_files(back) == {k: v for k, v in _regular_files(src).items()}
    assert os.path.isdir(back / "nothing")


def test_outputs_inside_the_input_existing_outputs_and_cckp_inputs_are_refused(tree, tmp_path):
    root, src = tree
    with pytest.raises(CheckpointError, match="is inside the input directory"):
        directory.compress_dir(src, src / "runs" / "out")
    with pytest.raises(CheckpointError, match="holds the input directory"):
        directory.compress_dir(src, root, force=True)
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="exists; pass --force"):
        directory.compress_dir(src, tmp_path / "taken")
    (tmp_path / "holds").mkdir()
    (tmp_path / "holds" / "x.cckp").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"already holds 1 \.cckp file"):
        directory.compress_dir(tmp_path / "holds", tmp_path / "holds.out")
    with pytest.raises(NotADirectoryError):
        directory.compress_dir(src / "empty.txt", tmp_path / "e.out")
    assert not os.path.exists(tmp_path / "holds.out") and not os.path.exists(tmp_path / "e.out")


def test_a_corrupted_member_is_named_and_a_failed_run_removes_what_it_made(tree, tmp_path):
    root, src = tree
    out = tmp_path / "c.cckp"
    directory.compress_dir(src, out, threads=1)
    victim = out / "runs" / "0" / "ckpt.pt.cckp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="ckpt.pt.cckp"):
        directory.verify_dir(out, threads=2)
    with pytest.raises(CheckpointError, match="ckpt.pt.cckp"):
        directory.decompress_dir(out, tmp_path / "c.back", threads=2)
    assert not os.path.exists(tmp_path / "c.back")


def test_the_command_line_takes_directories(tree, tmp_path, capsys):
    root, src = tree
    out, back = tmp_path / "cli.cckp", tmp_path / "cli.back"
    assert cli.main(["compress", str(src), str(out), "--threads", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert any(line.startswith("compressed model-00001-of-00002.safetensors: ") for line in lines)
    assert any(line.startswith("copied (not a checkpoint file) model.safetensors.index.json") for line in lines)
    assert lines[-1].startswith("compressed a directory of ") and len(lines) == 1 + sum(1 for _ in _regular_files(src))
    assert cli.main(["compress", str(src)]) == 0  # the default name: DIR.cckp beside it
    assert os.path.isdir(f"{src}.cckp")
    assert cli.main(["ls", str(out)]) == 0
    assert "directory " in capsys.readouterr().out
    assert cli.main(["verify", str(out)]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("verified a directory of ")
    assert cli.main(["decompress", str(out), str(back), "-q"]) == 0
    assert capsys.readouterr().out == ""
    assert _regular_files(back) == _regular_files(src)
    assert cli.main(["compress", str(src), str(src / "inside")]) == 2
    assert "is inside the input directory" in capsys.readouterr().err
    assert cli.main(["compress", str(src), str(out)]) == 2
    assert f"{out} exists; pass --force" in capsys.readouterr().err
