"""comm_codec.dcp: torch.distributed.checkpoint storage whose tensors are codec frames.

Round trips are checked bit for bit on the integer view. One-process tests save and load
without a process group (DCP's single-process mode); the FSDP2 tests run on real gloo
ranks (tests/dist_utils.py), save on 2 and load on 2, 1 (this process) and 4. Bad
directories are made from a good one by the edits a reader must survive: every one
raises CheckpointError naming the file, and none runs code or reads past its claim.

Worker functions (``_w_*``) run on every rank.
"""

from __future__ import annotations

import os
import pickle
import shutil
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

import comm_codec.dcp as ccd
from comm_codec.core.codec import Codec
from comm_codec.core.errors import CheckpointError
from comm_codec.core.streams import SUPPORTED_DTYPES

import dist_utils
from helpers import bits_equal, random_bits

UNCODED = (torch.int64, torch.int32, torch.int16, torch.bool, torch.float64, torch.complex64)
# DCP warns that it loads in one process when no process group exists: that is the point here.
pytestmark = [
    pytest.mark.unit,
    pytest.mark.filterwarnings(
        "ignore:torch.distributed is disabled:UserWarning", "ignore:.*torch.distributed.*:UserWarning"
    ),
]


def _zeros_like(sd):
    return {
        k: _zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
        for k, v in sd.items()
    }


def _assert_same(got, want, where=""):
    assert set(got) == set(want), where
    for k in want:
        if isinstance(want[k], dict):
            _assert_same(got[k], want[k], f"{where}.{k}")
        elif isinstance(want[k], torch.Tensor) and want[k].element_size() == 8:  # float64, complex64
            assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, f"{where}.{k}"
            assert torch.equal(got[k].contiguous().view(torch.int64), want[k].contiguous().view(torch.int64))
        elif isinstance(want[k], torch.Tensor):
            bits_equal(got[k], want[k])
        else:
            assert got[k] == want[k], f"{where}.{k}"


def _records(path):
    with open(os.path.join(path, ".metadata"), "rb") as fh:
        return pickle.load(fh)  # the tests' own files


# -- one process ------------------------------------------------------------------------------
def test_module_and_adam_state_round_trip_in_one_process(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 192), nn.GELU(), nn.Linear(192, 8)).to(torch.bfloat16)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 256, dtype=torch.bfloat16)).square().mean().backward()
        opt.step()
    state = {f"{i}.{k}": v for i, s in opt.state_dict()["state"].items() for k, v in s.items()}
    sd = {"model": model.state_dict(), "optim": {"state": state}, "epoch": 7}
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path))
    out = {"model": _zeros_like(sd["model"]), "optim": {"state": _zeros_like(state)}, "epoch": 0}
    dcp.load(out, storage_reader=ccd.Reader(tmp_path))
    _assert_same(out, sd)
    md = _records(tmp_path)
    frames = [i.fqn for i, r in md.storage_data.items() if r.transform_descriptors == [ccd.FRAME_DESCRIPTOR]]
    assert "model.0.weight" in frames and "optim.state.0.exp_avg_sq" in frames
    raw = sum(v.numel() * v.element_size() for v in list(sd["model"].values()) + list(state.values()))
    assert os.path.getsize(tmp_path / "__0_0.distcp") < raw  # coded, not stored


def _every_kind():
    g = torch.Generator().manual_seed(1)
    sd = {}
    for dtype in SUPPORTED_DTYPES:
        name = str(dtype).replace("torch.", "")
        sd[f"big.{name}"] = random_bits(40_000, dtype, g).view(200, 200)  # planned, own books or raw
        sd[f"small.{name}"] = random_bits(37, dtype, g)  # shipped books
        sd[f"strided.{name}"] = random_bits(60 * 70, dtype, g).view(60, 70).t()[::2]  # non-contiguous
        sd[f"scalar.{name}"] = random_bits(1, dtype, g).view(())
        sd[f"empty.{name}"] = random_bits(0, dtype, g).view(0, 3)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -1e-40, 3.0])
    sd["specials.fp32"] = specials.repeat(5000)
    sd["specials.bf16"] = specials.to(torch.bfloat16).repeat(5000)
    sd["weight.bf16"] = (torch.randn(300, 200, generator=g) * 0.02).to(torch.bfloat16)
    for dtype in UNCODED:
        sd[f"uncoded.{str(dtype).replace('torch.', '')}"] = torch.randn(7, 5, generator=g).to(dtype)[:, 1:4]
    sd["uncoded.scalar"] = torch.tensor(3, dtype=torch.int64)
    return sd


def test_every_dtype_noncontiguous_0d_and_uncoded_bit_exact(tmp_path):
    sd = _every_kind()
    sd["meta"] = {"lr": 0.5, "names": ["a", "b"], "flag": None}
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path))
    out = {k: torch.full_like(v, 1) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    out["meta"] = {"lr": 0.0, "names": [], "flag": 1}
    ccd.load(out, tmp_path)
    _assert_same(out, sd)
    md = _records(tmp_path)
    coded = {i.fqn for i, r in md.storage_data.items() if r.transform_descriptors}
    assert {f"big.{str(d).replace('torch.', '')}" for d in SUPPORTED_DTYPES} <= coded
    assert not any(k.startswith("uncoded.") for k in coded)  # stored as DCP stores them


def test_plain_dcp_reader_refuses_frames_and_reader_reads_plain_dcp(tmp_path):
    sd = {"w": torch.randn(64, 300).to(torch.bfloat16), "n": torch.arange(4)}
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path / "ours"))
    with pytest.raises(CheckpointException, match="Unknown extension name='comm_codec.frame'"):
        dcp.load(_zeros_like(sd), storage_reader=FileSystemReader(tmp_path / "ours"))
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp_path / "plain"))
    out = _zeros_like(sd)
    ccd.load(out, tmp_path / "plain")
    _assert_same(out, sd)


def _frame_of(path, fqn):
    """The frame params of an item's record (its frame, or the pack frame it lies in)."""
    md = _records(path)
    info = next(r for i, r in md.storage_data.items() if i.fqn == fqn)
    with open(os.path.join(path, info.relative_path), "rb") as fh:
        fh.seek(info.offset)
        buf = fh.read(info.length)
    return info, Codec.frame_parameters(buf)


def test_small_tensors_share_one_frame_per_dtype_and_kind(tmp_path):
    g = torch.Generator().manual_seed(3)
    model = {
        f"layer.{i}.{n}": (torch.randn(size, generator=g) * 0.02).to(dtype)
        for i in range(12)
        for n, size, dtype in (("bias", 384, torch.bfloat16), ("scale", 96, torch.float32), ("gain", 7, torch.float16))
    }
    model["scalar"] = torch.tensor(1.5, dtype=torch.bfloat16)
    model["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    state = {f"{i}.exp_avg": (torch.randn(384, generator=g) * 1e-4).to(torch.bfloat16) for i in range(12)}
    sd = {"model": model, "optim": {"state": state}}
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path))
    out = _zeros_like(sd)
    ccd.load(out, tmp_path)
    _assert_same(out, sd)
    md = _records(tmp_path)
    packs = {}
    for index, info in md.storage_data.items():
        assert info.transform_descriptors[0] == ccd.PACK_DESCRIPTOR, index.fqn
        packs.setdefault(info.offset, []).append(index.fqn)
    # one frame each: bf16 weights, fp32 weights, fp16 weights, bf16 optimizer state
    assert len(packs) == 4, packs
    info, params = _frame_of(tmp_path, "model.layer.3.bias")
    assert params.numel == 12 * 384 + 1 + 0 and str(params.dtype) == "torch.bfloat16"
    raw = sum(v.numel() * v.element_size() for v in list(model.values()) + list(state.values()))
    frames = {(info.offset, info.length) for info in md.storage_data.values()}
    assert sum(length for _, length in frames) < raw  # coded; the file adds its books (~3 kB here)


def test_a_full_pack_is_written_and_the_next_one_started(tmp_path):
    g = torch.Generator().manual_seed(5)
    # 80 x 16000 bf16 elements: more than one pack frame (1 Mi elements) holds
    sd = {f"norm.{i}": (torch.randn(16000, generator=g) * 0.02).to(torch.bfloat16) for i in range(80)}
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path))
    out = _zeros_like(sd)
    ccd.load(out, tmp_path)
    _assert_same(out, sd)
    packs = {}
    for fqn in sd:
        info, params = _frame_of(tmp_path, fqn)
        assert info.transform_descriptors[0] == ccd.PACK_DESCRIPTOR
        packs[info.offset] = params.numel
    assert len(packs) == 2 and all(n <= 1 << 20 for n in packs.values()) and sum(packs.values()) == 80 * 16000


def test_a_layer_plan_is_reused_by_its_siblings_unless_it_misfits(tmp_path):
    g = torch.Generator().manual_seed(4)
    sd = {f"enc.layer.{i}.w": (torch.randn(300, 200, generator=g) * 0.02).to(torch.bfloat16) for i in range(4)}
    # same name pattern and shape, a distribution of its own: few distinct exponents
    sd["enc.layer.4.w"] = (torch.randint(0, 3, (300, 200), generator=g).float() * 0.5 + 0.25).to(torch.bfloat16)
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path / "all"))
    out = _zeros_like(sd)
    ccd.load(out, tmp_path / "all")
    _assert_same(out, sd)
    ids = {k: _frame_of(tmp_path / "all", k)[1].book_ids for k in sd}
    assert ids["enc.layer.1.w"] == ids["enc.layer.0.w"] == ids["enc.layer.3.w"]
    assert ids["enc.layer.4.w"] != ids["enc.layer.0.w"]
    # the misfit coded as well as when it is planned alone
    dcp.save({"enc.layer.4.w": sd["enc.layer.4.w"]}, storage_writer=ccd.Writer(tmp_path / "alone"))
    alone = _frame_of(tmp_path / "alone", "enc.layer.4.w")[0].length
    assert _frame_of(tmp_path / "all", "enc.layer.4.w")[0].length <= alone


class _Unsafe:
    """A value that weights-only loading refuses (any class of the user's)."""

    def __init__(self, x=1):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, _Unsafe) and other.x == self.x


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "ckpt"
    g = torch.Generator().manual_seed(2)
    sd = {
        "w": (torch.randn(256, 256, generator=g) * 0.05).to(torch.bfloat16),
        "b": torch.randn(100, generator=g),
        "step": 5,
    }
    dcp.save(sd, storage_writer=ccd.Writer(path))
    return path, sd


def _frame_record(path, fqn="w"):
    md = _records(path)
    return md, next(i for i in md.storage_data if i.fqn == fqn)


def _rewrite_metadata(path, edit):
    md = _records(path)
    edit(md)
    with open(os.path.join(path, ".metadata"), "wb") as fh:
        pickle.dump(md, fh)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _edit_byte(path, offset, value=None):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([(old[0] ^ 0x5A) if value is None else value]))


def _bad_no_metadata(d):
    os.remove(d / ".metadata")
    return ".metadata"


def _bad_foreign_metadata(d):
    (d / ".metadata").write_bytes(b"PK\x03\x04 this is a zip, not a pickle" * 10)
    return ".metadata"


def _bad_pickle_runs_code(d):
    (d / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(d / "pwned"))))
    return ".metadata"


def _bad_truncated_metadata(d):
    raw = (d / ".metadata").read_bytes()
    (d / ".metadata").write_bytes(raw[: len(raw) // 2])
    return ".metadata"


def _bad_truncated_data(d):
    raw = (d / "__0_0.distcp").read_bytes()
    (d / "__0_0.distcp").write_bytes(raw[: len(raw) // 3])
    return "__0_0.distcp"


def _bad_missing_data(d):
    os.remove(d / "__0_0.distcp")
    return "__0_0.distcp"


def _bad_frame_byte(d):
    md, index = _frame_record(d)
    info = md.storage_data[index]
    _edit_byte(d / "__0_0.distcp", info.offset + info.length - 100)  # in the payload: a chunk checksum fails
    return "__0_0.distcp"


def _bad_frame_header(d):
    md, index = _frame_record(d)
    _edit_byte(d / "__0_0.distcp", md.storage_data[index].offset + 12)
    return "__0_0.distcp"


def _bad_book_table(d):
    size = os.path.getsize(d / "__0_0.distcp")
    _edit_byte(d / "__0_0.distcp", size - 40)  # inside the JSON book table
    return "__0_0.distcp"


def _bad_huge_length_claim(d):
    def edit(md):
        _, index = _frame_record(d)
        md.storage_data[index].length = 1 << 40

    _rewrite_metadata(d, edit)
    return "__0_0.distcp"


def _bad_chunk_claim(d):
    def edit(md):  # a chunk bigger than its tensor
        md.state_dict_metadata["w"].chunks[0].sizes = torch.Size([1 << 20, 256])

    _rewrite_metadata(d, edit)
    return ".metadata"


def _bad_frame_of_other_size(d):
    def edit(md):  # "b"'s record pointing at "w"'s frame: 65536 bf16 elements where 100 fp32 are known
        md.storage_data[_frame_record(d, "b")[1]] = md.storage_data[_frame_record(d, "w")[1]]

    _rewrite_metadata(d, edit)
    return "__0_0.distcp"


def _bad_path_outside(d):
    def edit(md):
        _, index = _frame_record(d)
        md.storage_data[index].relative_path = "../../etc/passwd"

    _rewrite_metadata(d, edit)
    return ".metadata"


def _edit_pack(d, descriptor):
    def edit(md):
        md.storage_data[_frame_record(d, "b")[1]].transform_descriptors = [ccd.PACK_DESCRIPTOR, descriptor]

    _rewrite_metadata(d, edit)
    return "__0_0.distcp"


def _bad_pack_range_outside(d):
    return _edit_pack(d, "elements=90+100")


def _bad_pack_count(d):
    return _edit_pack(d, "elements=0+99")


def _bad_pack_descriptor(d):
    return _edit_pack(d, "elements=-1+100")


def _bad_pack_pointing_at_a_big_frame(d):
    def edit(md):  # "b"'s pack record pointing at "w"'s frame (65536 bf16 elements)
        w = md.storage_data[_frame_record(d, "w")[1]]
        info = md.storage_data[_frame_record(d, "b")[1]]
        info.offset, info.length = w.offset, w.length

    _rewrite_metadata(d, edit)
    return "__0_0.distcp"


BAD = {
    f.__name__[5:]: f
    for f in (
        _bad_no_metadata,
        _bad_foreign_metadata,
        _bad_pickle_runs_code,
        _bad_truncated_metadata,
        _bad_truncated_data,
        _bad_missing_data,
        _bad_frame_byte,
        _bad_frame_header,
        _bad_book_table,
        _bad_huge_length_claim,
        _bad_chunk_claim,
        _bad_frame_of_other_size,
        _bad_path_outside,
        _bad_pack_range_outside,
        _bad_pack_count,
        _bad_pack_descriptor,
        _bad_pack_pointing_at_a_big_frame,
    )
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_directory_raises_one_checkpoint_error_naming_the_file(tmp_path, good_dir, case):
    src, sd = good_dir
    d = tmp_path / "ckpt"
    shutil.copytree(src, d)
    names = BAD[case](d)
    out = _zeros_like(sd)
    with pytest.raises(CheckpointError) as info:
        ccd.load(out, d)
    message = str(info.value)
    assert os.path.join(str(d), names) in message, message
    assert "\n" not in message
    assert not (d / "pwned").exists()
    # Through dcp.load itself, DCP's own exception carries the same error.
    if names != ".metadata":
        with pytest.raises(CheckpointException) as wrapped:
            dcp.load(_zeros_like(sd), storage_reader=ccd.Reader(d))
        assert any(isinstance(e, CheckpointError) for e, _ in wrapped.value.failures.values())


def test_values_weights_only_refuses_need_trusted(tmp_path):
    sd = {"w": torch.randn(50, 400).to(torch.bfloat16), "obj": _Unsafe(3)}
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path))
    with pytest.raises(CheckpointError, match="trusted=True") as info:
        ccd.load({"w": torch.zeros(50, 400, dtype=torch.bfloat16), "obj": None}, tmp_path)
    assert str(tmp_path / "__0_0.distcp") in str(info.value)
    out = {"w": torch.zeros(50, 400, dtype=torch.bfloat16), "obj": None}
    ccd.load(out, tmp_path, trusted=True)
    assert out["obj"] == _Unsafe(3) and bits_equal(out["w"], sd["w"])


def test_files_hold_every_book_so_a_reader_without_shipped_books_reads_them(tmp_path):
    import comm_codec as cc

    sd = {"w": (torch.randn(50, 40) * 0.02).to(torch.bfloat16)}  # small: shipped books
    dcp.save(sd, storage_writer=ccd.Writer(tmp_path))
    out = _zeros_like(sd)
    ccd.load(out, tmp_path, codebooks=cc.CodebookSet({}))  # no shipped books at all
    _assert_same(out, sd)


# -- FSDP2 on gloo ranks ---------------------------------------------------------------------
class _Net(nn.Module):
    """Rows that shard unevenly, and one layer big enough for books of its own."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(24, 37)
        self.big = nn.Linear(37, 1200)
        self.out = nn.Linear(1200, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.big(torch.tanh(self.inp(x)))))


def _trained(world):
    torch.manual_seed(0)
    net = _Net().to(torch.bfloat16)
    for m in (net.inp, net.big, net.out, net):
        fully_shard(m)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        net(torch.randn(8, 24, generator=g, dtype=torch.bfloat16)).float().square().mean().backward()
        opt.step()
        opt.zero_grad()
    return net, opt


def _full(sd):
    """Nested dict of a DTensor state dict, every tensor full (gathered), as plain CPU tensors."""
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out[k] = _full(v)
        elif hasattr(v, "full_tensor"):
            out[k] = v.full_tensor().clone()
        elif isinstance(v, torch.Tensor):
            out[k] = v.clone()
        else:
            out[k] = v
    return out


class _ThreadWriter(ccd.Writer):
    """A Writer that notes the thread its data is coded on."""

    def write_data(self, plan, planner):
        self.thread = threading.get_ident()
        return super().write_data(plan, planner)


def _w_save(rank, world, path):
    net, opt = _trained(world)
    msd, osd = get_state_dict(net, opt)
    sd = {"model": msd, "optim": osd}
    dcp.save(sd, storage_writer=ccd.Writer(os.path.join(path, "sync")))
    writer = _ThreadWriter(os.path.join(path, "async"))
    future = dcp.async_save(sd, storage_writer=writer)
    future.result()
    full = _full(sd)
    # load back on the same ranks, into a fresh model
    fresh, fresh_opt = _trained(world)
    for p in fresh.parameters():
        p.data.zero_()
    for which in ("sync", "async"):
        msd2, osd2 = get_state_dict(fresh, fresh_opt)
        target = {"model": msd2, "optim": osd2}
        ccd.load(target, os.path.join(path, which))
        set_state_dict(fresh, fresh_opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
        _assert_same(_full(get_state_dict(fresh, fresh_opt)[0]), full["model"])
        _assert_same(_full(target["optim"]), full["optim"])
    return full if rank == 0 else None, writer.thread != threading.get_ident()


def _w_load(rank, world, path, want):
    net, opt = _trained(world)
    msd, osd = get_state_dict(net, opt)
    target = {"model": msd, "optim": osd}
    for t in msd.values():
        t.to_local().zero_()
    ccd.load(target, path)
    _assert_same(_full(target), want)
    return True


@pytest.fixture(scope="module")
def saved_on_two(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp"))
    results = dist_utils.run(_w_save, 2, path, timeout=180)
    return path, results


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_save_async_save_and_load_on_two_ranks(saved_on_two):
    _, results = saved_on_two
    assert all(off_thread for _, off_thread in results)  # async_save coded on DCP's thread


@pytest.mark.dist
def test_fsdp2_checkpoint_of_two_ranks_loads_in_one_process(saved_on_two):
    path, results = saved_on_two
    want = results[0][0]
    for which in ("sync", "async"):
        target = _zeros_like(want)
        target["optim"]["param_groups"] = want["optim"]["param_groups"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ccd.load(target, os.path.join(path, which))
        _assert_same(target, want)


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_checkpoint_of_two_ranks_loads_on_four(saved_on_two):
    path, results = saved_on_two
    assert dist_utils.run(_w_load, 4, os.path.join(path, "sync"), results[0][0], timeout=180) == [True] * 4
