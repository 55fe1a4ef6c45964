"""comm_codec.dcp against crafted directories (issue 46's DCP findings), each made by tests/crafted_dcp.py.

Every case must raise one CheckpointError naming the file, fast and in little memory
(the targets: under 40 s and 1 GB; the bounds here are far tighter), run no code, and
write nothing outside the checkpoint directory.
"""

from __future__ import annotations

import io
import os
import pickle
import resource
import shutil
import threading
import time

import crafted_dcp as cr
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

import comm_codec.dcp as ccd
from comm_codec.checkpoint import _dcp_items, _dcp_metadata
from comm_codec.core.errors import CheckpointError

pytestmark = [pytest.mark.unit, pytest.mark.filterwarnings("ignore:.*torch.distributed.*:UserWarning")]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fails_fast(fn, match: str, seconds: float = 5.0, mb: float = 200.0) -> str:
    before, started = _rss_mb(), time.perf_counter()
    with pytest.raises(CheckpointError, match=match) as info:
        fn()
    assert time.perf_counter() - started < seconds
    assert _rss_mb() - before < mb
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.fixture(scope="module")
def plain_dir(tmp_path_factory):
    """A plain DCP directory (torch's FileSystemWriter): a bf16 matrix, an int64 vector, a value."""
    path = tmp_path_factory.mktemp("plain") / "ckpt"
    sd = {"w": torch.randn(64, 32).to(torch.bfloat16), "n": torch.arange(10), "meta": 3}
    dcp.save(sd, storage_writer=FileSystemWriter(path))
    return path, sd


@pytest.fixture(scope="module")
def ours_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ours") / "ckpt"
    sd = {
        "w": (torch.randn(200, 100) * 0.02).to(torch.bfloat16),
        "n": torch.arange(1000),
        "mask": torch.arange(50) % 3 == 0,
        "meta": "a value",
    }
    dcp.save(sd, storage_writer=ccd.Writer(path))
    return path, sd


def _copy(src, tmp_path):
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    return d


def _target(sd):
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}


# -- #1 and #12: the metadata unpickler -------------------------------------------------------
def test_a_330_byte_path_doubling_metadata_fails_fast(tmp_path):
    (tmp_path / ".metadata").write_bytes(cr.doubling_pickle("pathlib", "PosixPath", 26))
    assert (tmp_path / ".metadata").stat().st_size < 400
    msg = _fails_fast(lambda: ccd.load({}, tmp_path), "not DCP metadata", seconds=1.0, mb=50)
    assert str(tmp_path / ".metadata") in msg


def test_a_memo_index_of_2_to_the_31_fails_fast_in_little_memory(tmp_path):
    """Found by tests/fuzz/fuzz_dcp.py: the C unpickler resizes its memo array to the index (16 GB)."""
    (tmp_path / ".metadata").write_bytes(b"\x80\x04N" + b"r\xff\xff\xff\x7f" + b".")
    _fails_fast(lambda: ccd.load({}, tmp_path), "metadata .holds a NoneType", seconds=1.0, mb=50)


@pytest.mark.parametrize("name", [("torch", "Size"), ("collections", "OrderedDict")])
def test_constructors_that_copy_their_argument_fail_fast(tmp_path, name):
    (tmp_path / ".metadata").write_bytes(cr.copying_pickle(*name, items=1 << 14, copies=1 << 14))
    _fails_fast(lambda: ccd.load({}, tmp_path), "not DCP metadata", seconds=2.0, mb=50)


def test_real_metadata_with_a_path_checkpoint_id_still_reads(tmp_path):
    sd = {"w": torch.randn(20, 20)}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path))  # checkpoint_id: a PosixPath
    md = _dcp_metadata.read_metadata(tmp_path)
    assert md.storage_meta.checkpoint_id == str(tmp_path)
    out = _target(sd)
    ccd.load(out, tmp_path)
    assert torch.equal(out["w"], sd["w"])


def _edit(d, change):
    md = cr.read_metadata(d)
    change(md)
    cr.write_metadata(d, md)


def test_build_of_a_wrong_typed_storage_meta_is_a_checkpoint_error(tmp_path, plain_dir):
    d = _copy(plain_dir[0], tmp_path)
    _edit(d, lambda md: setattr(md, "storage_meta", ChunkStorageMetadata(torch.Size([1]), torch.Size([1]))))
    _fails_fast(lambda: ccd.load(_target(plain_dir[1]), d), "storage_meta is a ChunkStorageMetadata")


def test_build_of_a_chunk_without_sizes_is_a_checkpoint_error(tmp_path, plain_dir):
    d = _copy(plain_dir[0], tmp_path)
    _edit(d, lambda md: delattr(md.state_dict_metadata["w"].chunks[0], "sizes"))
    _fails_fast(lambda: ccd.load(_target(plain_dir[1]), d), "without sizes")


# -- #5: chunks tile their tensor -------------------------------------------------------------
def _chunks(d, chunks):
    _edit(d, lambda md: setattr(md.state_dict_metadata["w"], "chunks", chunks))


def test_one_chunk_listed_6000_times_fails_fast(tmp_path, plain_dir):
    d = _copy(plain_dir[0], tmp_path)
    chunk = cr.read_metadata(d).state_dict_metadata["w"].chunks[0]
    _chunks(d, [chunk] * 6000)
    _fails_fast(lambda: ccd.load(_target(plain_dir[1]), d), "listed twice")


def test_overlapping_short_and_many_distinct_overlapping_chunks_are_refused(tmp_path, plain_dir):
    d = _copy(plain_dir[0], tmp_path)
    size = torch.Size
    cases = [
        # rows 0..40 and 24..48 of 64: the element counts add up, rows 24..40 twice, 48..64 never
        (
            "two chunks overlap",
            [ChunkStorageMetadata(size([0, 0]), size([40, 32])), ChunkStorageMetadata(size([24, 0]), size([24, 32]))],
        ),
        ("do not add up", [ChunkStorageMetadata(size([0, 0]), size([32, 32]))]),
        # 1,024 distinct chunks, 16 per row each 2 wide starting one column apart: counts add up
        (
            "two chunks overlap",
            [ChunkStorageMetadata(size([r, c]), size([1, 2])) for r in range(64) for c in range(16)],
        ),
    ]
    for match, chunks in cases:
        _chunks(d, chunks)
        _fails_fast(lambda: ccd.load(_target(plain_dir[1]), d), match)


def test_a_grid_of_chunks_tiles_and_is_checked_quickly():
    size = torch.Size
    chunks = [ChunkStorageMetadata(size([i * 4, j * 4]), size([4, 4])) for i in range(100) for j in range(100)]
    started = time.perf_counter()
    assert _dcp_metadata._tiling_problem(size([400, 400]), chunks) == ""
    assert time.perf_counter() - started < 5
    chunks[5] = ChunkStorageMetadata(size([0, 21]), size([4, 4]))  # overlaps its neighbour, one cell left uncovered
    assert _dcp_metadata._tiling_problem(size([400, 400]), chunks) == "two chunks overlap"


# -- #2: torch.save records are checked before torch reads them -------------------------------
def test_a_deflated_value_record_is_refused_before_torch_reads_it(tmp_path, plain_dir):
    d = _copy(plain_dir[0], tmp_path)
    cr.point_value_at(d, "meta", cr.deflated_torch_record(cr.slow_pickle(60 << 20)))
    assert os.path.getsize(d / "__0_0.distcp") < 2 << 20
    msg = _fails_fast(lambda: ccd.load(_target(plain_dir[1]), d), "is compressed", seconds=3.0)
    assert str(d / "__0_0.distcp") in msg


def test_a_value_pickle_over_the_bound_is_refused(tmp_path, plain_dir):
    d = _copy(plain_dir[0], tmp_path)
    cr.point_value_at(d, "meta", cr.stored_torch_record(cr.slow_pickle(_dcp_items.MAX_VALUE_PICKLE + 100)))
    _fails_fast(lambda: ccd.load(_target(plain_dir[1]), d), "more than the", seconds=3.0)


@pytest.mark.slow
def test_a_value_pickle_at_the_bound_loads_in_bounded_time(tmp_path, plain_dir):
    d = _copy(plain_dir[0], tmp_path)
    cr.point_value_at(d, "meta", cr.stored_torch_record(cr.slow_pickle(_dcp_items.MAX_VALUE_PICKLE - 100)))
    out = _target(plain_dir[1])
    started = time.perf_counter()
    ccd.load(out, d)
    assert len(out["meta"]) == (_dcp_items.MAX_VALUE_PICKLE - 106) // 2 and time.perf_counter() - started < 40


class _RecordingPlanner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value):
        self.got = value.getvalue()
        super().load_bytes(read_item, value)


def test_the_planner_gets_bytes_this_process_made_not_the_files(tmp_path, plain_dir):
    d = _copy(plain_dir[0], tmp_path)
    stored = cr.stored_torch_record(b"\x80\x02K\x03.")  # 3, in a zip torch.save would not write
    cr.point_value_at(d, "meta", stored)
    planner = _RecordingPlanner()
    out = _target(plain_dir[1])
    ccd.load(out, d, planner=planner)
    assert out["meta"] == 3
    assert planner.got != stored and torch.load(io.BytesIO(planner.got), weights_only=True) == 3


def test_a_tensor_record_with_a_deflated_member_is_refused(tmp_path, plain_dir):
    d = _copy(plain_dir[0], tmp_path)
    cr.point_value_at(d, "n", cr.deflated_torch_record(b"\x80\x02N."))
    _fails_fast(lambda: ccd.load(_target(plain_dir[1]), d), "is compressed")


# -- integrity of items stored as DCP stores them ---------------------------------------------
@pytest.mark.parametrize("fqn", ["n", "mask", "meta"])
def test_a_flipped_byte_in_an_item_stored_as_dcp_stores_it_is_caught(tmp_path, ours_dir, fqn):
    d = _copy(ours_dir[0], tmp_path)
    info = next(r for i, r in cr.read_metadata(d).storage_data.items() if i.fqn == fqn)
    assert not info.transform_descriptors
    with open(d / info.relative_path, "r+b") as fh:
        fh.seek(info.offset + info.length - 30)  # in the zip's central directory: torch would not notice
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 1]))
    msg = _fails_fast(lambda: ccd.load(_target(ours_dir[1]), d), "CRC-32 mismatch")
    assert str(d / info.relative_path) in msg


# -- #6: the writer never writes through a planted name ---------------------------------------
def test_a_symlink_planted_at_the_data_file_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    d = tmp_path / "ckpt"
    d.mkdir()
    os.symlink(victim, d / "__0_0.distcp")
    sd = {"w": torch.randn(100, 100).to(torch.bfloat16)}
    dcp.save(sd, storage_writer=ccd.Writer(d))
    assert victim.read_bytes() == b"keep me" and not os.path.islink(d / "__0_0.distcp")
    out = _target(sd)
    ccd.load(out, d)
    assert torch.equal(out["w"].view(torch.int16), sd["w"].view(torch.int16))


def test_symlinks_planted_at_the_metadata_names_are_not_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    d = tmp_path / "ckpt"
    d.mkdir()
    for name in (".metadata", ".metadata.tmp"):
        os.symlink(victim, d / name)
    sd = {"w": torch.randn(10)}
    dcp.save(sd, storage_writer=ccd.Writer(d, force=True))  # .metadata "exists" (the link's target)
    assert victim.read_bytes() == b"keep me" and not os.path.islink(d / ".metadata")
    out = _target(sd)
    ccd.load(out, d)
    assert torch.equal(out["w"], sd["w"])


def test_a_fifo_planted_at_the_data_file_does_not_block_the_save(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    os.mkfifo(d / "__0_0.distcp")
    done = []
    t = threading.Thread(
        target=lambda: done.append(dcp.save({"w": torch.randn(10)}, storage_writer=ccd.Writer(d))), daemon=True
    )
    t.start()
    t.join(60)
    assert done, "dcp.save blocked on a FIFO"
    assert os.path.isfile(d / "__0_0.distcp")


# -- load() reads the metadata once -----------------------------------------------------------
def test_load_unpickles_the_metadata_once(tmp_path, monkeypatch):
    sd = {"w": torch.randn(30, 30)}
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path))
    calls = []
    real = _dcp_metadata._MetadataUnpickler.load

    def counting(self):
        calls.append(1)
        return real(self)

    monkeypatch.setattr(_dcp_metadata._MetadataUnpickler, "load", counting)
    out = _target(sd)
    ccd.load(out, tmp_path)
    assert len(calls) == 1 and torch.equal(out["w"], sd["w"])


def test_pickle_of_metadata_is_what_dcp_writes(tmp_path):
    """The allow-list reads what torch 2.13 itself writes (guards against a DCP change)."""
    sd = {"a": torch.randn(5), "b": {"c": 1}}
    dcp.save(sd, storage_writer=FileSystemWriter(tmp_path))
    raw = (tmp_path / ".metadata").read_bytes()
    assert (
        pickle.loads(raw).state_dict_metadata.keys() == _dcp_metadata.read_metadata(tmp_path).state_dict_metadata.keys()
    )


def test_metadata_without_an_entry_the_state_dict_asks_for_is_a_checkpoint_error(tmp_path, plain_dir):
    """Found by tests/fuzz/fuzz_dcp.py: DCP's planner raised "Missing key", wrapped in CheckpointException."""
    d = _copy(plain_dir[0], tmp_path)

    def drop(md):
        md.state_dict_metadata.pop("w")
        md.storage_data = {i: r for i, r in md.storage_data.items() if i.fqn != "w"}

    _edit(d, drop)
    msg = _fails_fast(lambda: ccd.load(_target(plain_dir[1]), d), "Missing key")
    assert str(d / ".metadata") in msg
