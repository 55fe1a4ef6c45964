"""Lossy checkpoint modes: error bounds, closed-loop chains, metadata, format fidelity, errors.

Every reconstruction is loaded through the standard loaders (torch.load with
weights_only=True, safetensors.torch.load_file) and compared with the original tensor by
tensor; the errors the file records must be the errors achieved.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from comm_codec import checkpoint as ck
from comm_codec.checkpoint import lossy, lossy_transforms
from comm_codec.tools.tinylm import TinyLM, batches, load_corpus, train_steps

from helpers import run_cli

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _fresh_cache():
    """Each test decodes its chains itself (the process-wide cache would hide a missing file)."""
    lossy.clear_cache()
    yield
    lossy.clear_cache()


def _records(path) -> dict:
    return {r["name"]: r for r in lossy.read_index(path)["tensors"]}


def _flat(sd, prefix=""):
    """Name every tensor of a nested state dict as checkpoint_formats does ("optimizer.state.0.exp_avg")."""
    out = {}
    for k, v in sd.items():
        name = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[name] = v
        elif isinstance(v, dict):
            out.update(_flat(v, name + "."))
    return out


@pytest.fixture(scope="module")
def series(tmp_path_factory):
    """Five real torch checkpoints of a tiny TinyLM trained with AdamW, 2 steps apart."""
    folder = tmp_path_factory.mktemp("series")
    torch.manual_seed(0)
    model = TinyLM(d_model=32, n_layers=1, seq_len=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(load_corpus(200_000), batch_size=2, seq_len=16)
    files = []
    for k in range(5):
        train_steps(model, opt, data, steps=3 if k == 0 else 2)
        path = folder / f"step{k}.pt"
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": k, "loss": 1.5}, path)
        files.append(path)
    return files


def _compress_chain(files, folder, **kw):
    out = []
    for k, src in enumerate(files):
        dst = folder / f"{src.stem}.ccl"
        lossy.compress_file(src, dst, base=None if k == 0 else out[-1], force=True, **kw)
        out.append(dst)
    return out


# -- ExCP chains ------------------------------------------------------------------------------
@pytest.mark.slow
def test_torch_chain_reconstructs_within_recorded_bounds(series, tmp_path):
    packed = _compress_chain(series, tmp_path)
    for src, ccl in zip(series, packed):
        lossy.clear_cache()
        out = tmp_path / f"{src.stem}.recon.pt"
        lossy.decompress_file(ccl, out)
        with zipfile.ZipFile(out) as zf, zipfile.ZipFile(src) as zs:
            assert zf.testzip() is None  # every patched CRC-32 is right
            assert zf.namelist() == zs.namelist()
        orig, recon = torch.load(src, weights_only=True), torch.load(out, weights_only=True)
        assert recon["step"] == orig["step"] and recon["loss"] == orig["loss"]
        assert recon["optimizer"]["param_groups"] == orig["optimizer"]["param_groups"]
        assert os.path.getsize(out) == os.path.getsize(src)
        recs = _records(ccl)
        flat_o, flat_r = _flat(orig), _flat(recon)
        assert flat_o.keys() == flat_r.keys()
        for name, t in flat_o.items():
            r = flat_r[name]
            assert r.dtype == t.dtype and r.shape == t.shape
            err = (r.double() - t.double()).abs().max().item() if t.numel() else 0.0
            rec = recs.get(name)
            if rec is None or rec["coding"] in ("frame", "skeleton"):
                assert torch.equal(r, t), name  # passed through exactly
                continue
            assert err == pytest.approx(rec["stats"]["max_abs_error"], rel=1e-9, abs=1e-30), name
            if rec["coding"] == "residual":
                # Pruned residuals are below the threshold, kept ones within the quantization
                # error; the fp32 sum adds at most one rounding.
                assert err <= rec["stats"]["bound"] * (1 + 1e-6) + 2**-23 * t.abs().max().item(), name
        index = lossy.read_index(ccl)
        assert index["reconstruction"]["sha256"] != index["source"]["sha256"]


def test_safetensors_chain_of_five_does_not_drift(tmp_path):
    """Closed loop: each residual is taken against the reconstruction, so errors stay at one
    step's size; an open loop (residuals against the originals) would add them up."""
    g = torch.Generator().manual_seed(3)
    w = {"a": torch.randn(128, 64, generator=g) * 0.02, "b": torch.randn(300, generator=g) * 0.02}
    v = {k: torch.rand(t.shape, generator=g) * 1e-6 for k, t in w.items()}
    files, worst = [], []
    for step in range(5):
        drift = {k: torch.randn(t.shape, generator=g) * 1e-3 + 5e-4 for k, t in w.items()}  # biased walk
        w = {k: t + drift[k] for k, t in w.items()}
        tensors = dict(w)
        for k in w:
            tensors[f"exp_avg/{k}"] = drift[k] * 0.1
            tensors[f"exp_avg_sq/{k}"] = v[k]
        path = tmp_path / f"w{step}.safetensors"
        save_file(tensors, path)
        files.append(path)
    packed = _compress_chain(files, tmp_path)
    for src, ccl in zip(files, packed):
        lossy.clear_cache()
        out = tmp_path / f"{src.stem}.out.safetensors"
        lossy.decompress_file(ccl, out)
        orig, recon = load_file(src), load_file(out)
        recs = _records(ccl)
        errs = []
        for k in ("a", "b"):
            err = (recon[k] - orig[k]).abs().max().item()
            if recs[k]["coding"] == "residual":
                assert err <= recs[k]["stats"]["bound"] * (1 + 1e-6) + 1e-9
            errs.append(err)
        worst.append(max(errs))
    assert worst[0] == 0.0  # the keyframe's weights are exact
    # Five biased steps would add to ~5x one step's error without the closed loop.
    assert max(worst[2:]) <= 1.6 * worst[1], worst


@pytest.mark.cli
@pytest.mark.slow
def test_metadata_round_trip_and_inspect(series, tmp_path):
    packed = _compress_chain(series[:2], tmp_path, bits=3, alpha=2e-3, beta=1.5)
    index = lossy.read_index(packed[1])
    assert index["mode"] == "excp" and index["params"] == {"bits": 3, "alpha": 2e-3, "beta": 1.5}
    assert index["base"]["name"] == packed[0].name and len(index["base"]["sha256"]) == 64
    assert lossy.read_index(packed[0])["base"] is None
    assert any("keyframe" in n for n in lossy.read_index(packed[0])["notes"])
    assert set(index["errors"]) == {"weight", "exp_avg", "exp_avg_sq", "weight_all", "exp_avg_all", "exp_avg_sq_all"}
    assert index["errors"]["weight_all"] <= index["errors"]["weight"]
    roles = {r["role"] for r in index["tensors"]}
    assert {"weight", "exp_avg", "exp_avg_sq"} <= roles
    assert all(len(r["centroids"]) <= 7 for r in index["tensors"] if r["centroids"] is not None)
    # Each moment belongs to the weight of its parameter index, in model order.
    model = list(torch.load(series[1], weights_only=True)["model"])
    for r in index["tensors"]:
        if r["role"] == "exp_avg":
            i = int(r["name"].split(".")[2])
            assert r["param"] == f"model.{model[i]}"
    text = lossy.describe(packed[1])
    assert "LOSSY" in text and "mode excp" in text and "bits=3" in text and packed[0].name in text
    for cmd in ("inspect", "ls"):
        r = run_cli(cmd, packed[1])
        assert r.returncode == 0 and "LOSSY" in r.stdout and "exp_avg_sq" in r.stdout, r.stderr


def test_weights_only_checkpoint_falls_back_and_says_so(tmp_path, caplog):
    g = torch.Generator().manual_seed(5)
    w0 = torch.randn(64, 64, generator=g)
    save_file({"w": w0, "ids": torch.arange(10)}, tmp_path / "a.safetensors")
    save_file({"w": w0 + 1e-3 * torch.randn(64, 64, generator=g), "ids": torch.arange(10)}, tmp_path / "b.safetensors")
    lossy.compress_file(tmp_path / "a.safetensors", tmp_path / "a.ccl")
    # under the default error budget, no Adam state is needed: the budget holds
    s = lossy.compress_file(tmp_path / "b.safetensors", tmp_path / "budget.ccl", base=tmp_path / "a.ccl")
    assert any("weights-only" in n and "error budget" in n for n in s.notes)
    assert s.errors["weight"] <= lossy.DEFAULT_MAX_ERROR
    with caplog.at_level("WARNING", logger="comm_codec.checkpoint.lossy"):
        s = lossy.compress_file(
            tmp_path / "b.safetensors", tmp_path / "b.ccl", base=tmp_path / "a.ccl", alpha=lossy.DEFAULT_ALPHA
        )
    assert any("weights-only" in n for n in s.notes) and "weights-only" in caplog.text
    assert any("weights-only" in n for n in lossy.read_index(tmp_path / "b.ccl")["notes"])
    lossy.decompress_file(tmp_path / "b.ccl", tmp_path / "b.out")
    out, orig = load_file(tmp_path / "b.out"), load_file(tmp_path / "b.safetensors")
    assert torch.equal(out["ids"], orig["ids"])
    rec = _records(tmp_path / "b.ccl")["w"]
    assert rec["coding"] == "residual" and 0.4 < rec["kept"] / 4096 < 0.6  # median threshold
    assert (out["w"] - orig["w"]).abs().max().item() <= rec["stats"]["bound"] + 1e-6


def test_base_from_another_run_is_refused(series, tmp_path):
    lossy.compress_file(series[0], tmp_path / "k.ccl")
    save_file({"w": torch.zeros(64, 64)}, tmp_path / "other.safetensors")
    lossy.compress_file(tmp_path / "other.safetensors", tmp_path / "other.ccl")
    with pytest.raises(ck.CheckpointError, match="not from the same run.*holds no weight 'model.tok_emb.weight'"):
        lossy.compress_file(series[1], tmp_path / "x.ccl", base=tmp_path / "other.ccl")
    save_file({"w": torch.zeros(32, 64)}, tmp_path / "shape.safetensors")
    with pytest.raises(ck.CheckpointError, match="not from the same run: weight 'w'"):
        lossy.compress_file(tmp_path / "shape.safetensors", tmp_path / "x.ccl", base=tmp_path / "other.ccl")
    with pytest.raises(ck.CheckpointError, match="not a lossy comm_codec file"):
        lossy.compress_file(series[1], tmp_path / "x.ccl", base=series[0])
    assert not (tmp_path / "x.ccl").exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_missing_or_wrong_chain_file_is_named(series, tmp_path):
    packed = _compress_chain(series[:3], tmp_path)
    lossy.clear_cache()
    os.rename(packed[0], tmp_path / "moved.ccl")
    with pytest.raises(lossy.ChainError, match=f"against {packed[0].name} .*missing: no file {packed[0]}") as info:
        lossy.decompress_file(packed[2], tmp_path / "out.pt")
    assert info.value.missing == str(packed[0])
    assert not (tmp_path / "out.pt").exists()
    os.rename(tmp_path / "moved.ccl", packed[0])
    with pytest.raises(ck.CheckpointError, match="wrong base"):
        lossy.decompress_file(packed[2], tmp_path / "out.pt", base=packed[0])
    lossy.decompress_file(packed[2], tmp_path / "out.pt", base=packed[1])  # --base names the first link
    torch.load(tmp_path / "out.pt", weights_only=True)


def test_lossy_and_exact_readers_refuse_each_other(series, tmp_path):
    lossy.compress_file(series[0], tmp_path / "a.ccl")
    ck.compress_file(series[0], tmp_path / "a.cckp")
    with pytest.raises(ck.CheckpointError, match="is a lossy comm_codec checkpoint"):
        ck.decompress_file(tmp_path / "a.ccl", tmp_path / "o")
    with pytest.raises(ck.CheckpointError, match=r"exact \(lossless\) comm_codec checkpoint"):
        lossy.decompress_file(tmp_path / "a.cckp", tmp_path / "o")
    assert not ck.is_checkpoint(tmp_path / "a.ccl") and not lossy.is_lossy(tmp_path / "a.cckp")
    data = bytearray((tmp_path / "a.ccl").read_bytes())
    data[len(data) // 2] ^= 0x40
    (tmp_path / "bad.ccl").write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError):
        lossy.decompress_file(tmp_path / "bad.ccl", tmp_path / "o")
    assert not (tmp_path / "o").exists()


# -- precision mode -------------------------------------------------------------------------
@pytest.mark.parametrize("keep", [0, 3, 7, 10])
def test_precision_mode_bounds(tmp_path, keep):
    g = torch.Generator().manual_seed(keep)
    base = torch.randn(4096, generator=g) * torch.exp(torch.randn(4096, generator=g) * 3)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.4028235e38, -3.4e38, 0.0])
    f32 = torch.cat([base, special])
    tensors = {
        "f32": f32,
        "bf16": f32.to(torch.bfloat16),
        "f16": (base * 1e-3).to(torch.float16),
        "ids": torch.arange(3000),
        "small": torch.randn(10, generator=g),
    }
    save_file(tensors, tmp_path / "p.safetensors")
    s = lossy.compress_file(tmp_path / "p.safetensors", tmp_path / "p.ccl", method="precision", keep_bits=keep)
    lossy.decompress_file(tmp_path / "p.ccl", tmp_path / "p.out")
    out = load_file(tmp_path / "p.out")
    recs = _records(tmp_path / "p.ccl")
    assert torch.equal(out["ids"], tensors["ids"]) and torch.equal(out["small"], tensors["small"])
    for name in ("f32", "bf16", "f16"):
        a, b = tensors[name].double(), out[name].double()
        fin = torch.isfinite(a)
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a[torch.isinf(a)], b[torch.isinf(a)])
        normal = fin & (a.abs() >= torch.finfo(tensors[name].dtype).tiny)
        rel = ((b - a).abs() / a.abs())[normal].max().item()
        bound = recs[name]["stats"]["bound_rel"]
        assert rel <= bound and rel == pytest.approx(recs[name]["stats"]["max_rel_error"], abs=1e-12), name
        assert torch.isfinite(b[fin]).all()  # nothing rounded up to Inf
    if keep <= 7:  # fp32 cut to 7 bits is coded as the bf16 it equals
        assert recs["f32"]["frame"]["dtype"] == "bfloat16"
        if keep == 7:  # round to nearest even, as torch's cast; where torch overflows to Inf we truncate
            ref = f32.to(torch.bfloat16).float()
            same = torch.isfinite(ref)
            assert torch.equal(out["f32"][same], ref[same])
    assert s.ratio > 1.0


def test_precision_mode_torch_zip_and_refusals(series, tmp_path):
    lossy.compress_file(series[0], tmp_path / "p.ccl", method="precision", keep_bits=7)
    lossy.decompress_file(tmp_path / "p.ccl", tmp_path / "p.pt")
    sd, orig = torch.load(tmp_path / "p.pt", weights_only=True), torch.load(series[0], weights_only=True)
    w, o = sd["model"]["tok_emb.weight"], orig["model"]["tok_emb.weight"]
    assert torch.equal(w, o.to(torch.bfloat16).float())
    loaded = lossy.load(tmp_path / "p.ccl")
    assert torch.equal(loaded["model"]["tok_emb.weight"], w)
    with pytest.raises(ValueError, match="keep_bits"):
        lossy.compress_file(series[0], tmp_path / "x.ccl", method="precision")
    with pytest.raises(ValueError, match="single checkpoints"):
        lossy.compress_file(series[1], tmp_path / "x.ccl", method="precision", keep_bits=3, base=tmp_path / "p.ccl")
    (tmp_path / "t.txt").write_text("not a checkpoint")
    with pytest.raises(ck.CheckpointError, match="not a safetensors or torch.save checkpoint"):
        lossy.compress_file(tmp_path / "t.txt", tmp_path / "x.ccl", method="precision", keep_bits=3)


def test_quantizer_is_lloyd_optimal_and_rounding_matches_torch():
    rng = np.random.default_rng(0)
    x = rng.laplace(size=5000).astype(np.float32)
    sym, cents = lossy_transforms.quantize(x, 15)
    assert cents.size == 15 and sym.min() >= 1 and sym.max() <= 15
    deq = lossy_transforms.dequantize(sym, cents, "value")
    # Nearest-centroid assignment, and each centroid the mean of its cluster (a Lloyd fixed point).
    assert np.all(np.abs(x - deq) <= np.abs(x[:, None] - cents[None, :]).min(axis=1) + 1e-7)
    for s in range(1, 16):
        assert cents[s - 1] == pytest.approx(x[sym == s].astype(np.float64).mean(), abs=1e-5)
    counts = np.bincount(sym, minlength=16)[1:]
    assert np.all(np.diff(counts) <= 0)  # numbered by frequency
    few = np.array([1.0, 2.0, 2.0], np.float32)
    s2, c2 = lossy_transforms.quantize(few, 15)
    assert np.array_equal(lossy_transforms.dequantize(s2, c2, "value"), few)  # fewer values than centroids: exact
    bits = torch.randn(10000).mul(1e3).view(torch.int32).numpy().view(np.uint32)
    ours = lossy_transforms.round_mantissa(bits, 16, "float32")
    ref = torch.from_numpy(bits.view(np.float32)).to(torch.bfloat16).float().numpy().view(np.uint32)
    assert np.array_equal(ours, ref)  # ties to even, like torch's fp32 -> bf16


# -- command line ---------------------------------------------------------------------------
@pytest.mark.cli
@pytest.mark.slow
def test_cli_round_trip_and_errors(series, tmp_path):
    a, b = tmp_path / "a.ccl", tmp_path / "b.ccl"
    r = run_cli("compress", series[0], a, "--lossy", "excp")
    assert r.returncode == 0 and "keyframe" in r.stderr and "lossy excp" in r.stdout, r.stderr
    r = run_cli("compress", series[1], b, "--lossy", "excp", "--base", a, "--bits", "3")
    assert r.returncode == 0 and f"base {a.name}" in r.stdout, r.stderr
    r = run_cli("decompress", b, tmp_path / "b.pt")
    assert r.returncode == 0, r.stderr
    torch.load(tmp_path / "b.pt", weights_only=True)
    assert run_cli("verify", b).returncode == 0
    r = run_cli("compress", series[0], tmp_path / "p.ccl", "--lossy", "precision", "--keep-bits", "5")
    assert r.returncode == 0, r.stderr
    bad = [
        (("compress", series[0], tmp_path / "x", "--bits", "3"), "--bits only apply to lossy compression"),
        (("compress", series[0], tmp_path / "x", "--lossy", "precision"), "needs --keep-bits"),
        (("compress", series[0], tmp_path / "x", "--lossy", "excp", "--keep-bits", "3"), "--keep-bits applies"),
        (("compress", series[0], tmp_path / "x", "--lossy", "excp", "--bits", "9"), "--bits takes an integer"),
        (("compress", series[1], tmp_path / "x", "--base", a), "is a lossy file"),
    ]
    for args, message in bad:
        r = run_cli(*args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    os.rename(a, tmp_path / "gone.ccl")
    r = run_cli("decompress", b, tmp_path / "c.pt")
    assert r.returncode == 2 and f"no file {a}" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "c.pt").exists() and not (tmp_path / "x").exists()
