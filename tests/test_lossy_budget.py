"""The excp error budget (``max_error``): honoured on every weight tensor, recorded, shown.

Each reconstruction is loaded with safetensors' own loader and its relative RMS error
‖Ŵ−W‖/‖W‖ computed here, per tensor, against the original: it must be within the
budget and be the error the file records.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from comm_codec.checkpoint import lossy
from comm_codec.checkpoint.lossy_budget import _lloyd, _Sorted, choose, estimate
from comm_codec.checkpoint.lossy_transforms import quantize

from helpers import run_cli

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _fresh_cache():
    lossy.clear_cache()
    yield
    lossy.clear_cache()


def _series(count: int, seed: int = 0) -> list[dict]:
    """A made-up AdamW run: fp32, bf16 and fp16 weights (matrices and vectors) with their moments."""
    rng = np.random.default_rng(seed)
    w = {
        "emb": rng.normal(0, 0.05, (200, 48)),
        "fc": rng.normal(0, 0.05, (48, 96)),
        "half": rng.normal(0, 0.5, (64, 80)),
        "bias": rng.normal(0, 0.01, 4096),
    }
    dtypes = {"emb": torch.float32, "fc": torch.bfloat16, "half": torch.float16, "bias": torch.float32}
    out = []
    for _ in range(count):
        state = {}
        for name, x in w.items():
            g = rng.normal(0, 1e-3, x.shape) * rng.gamma(0.5, 2, x.shape[:1])[(...,) + (None,) * (x.ndim - 1)]
            x += 3e-3 * np.tanh(g / 1e-3)
            state[name] = torch.from_numpy(x.copy()).to(dtypes[name])
            state[f"exp_avg/{name}"] = torch.from_numpy(0.1 * g).float()
            state[f"exp_avg_sq/{name}"] = torch.from_numpy(1e-3 * g * g).float()
        out.append(state)
    return out


def _chain(tmp_path, states, **kw):
    files = []
    for k, state in enumerate(states):
        src = tmp_path / f"s{k}.safetensors"
        save_file(state, src)
        dst = tmp_path / f"s{k}.ccl"
        lossy.compress_file(src, dst, base=files[-1][1] if files else None, force=True, **kw)
        files.append((src, dst))
    return files


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm()) if b.norm() else float((a - b).norm())


@pytest.mark.parametrize("budget", [0.0, 1e-4, 3e-3, 3e-2])
def test_budget_is_honoured_on_every_weight_tensor(tmp_path, budget):
    files = _chain(tmp_path, _series(4), max_error=budget)
    kinds = set()
    for k, (src, ccl) in enumerate(files):
        lossy.clear_cache()
        out = tmp_path / f"s{k}.out"
        lossy.decompress_file(ccl, out)
        recon, orig = load_file(out), load_file(src)
        index = lossy.read_index(ccl)
        assert index["params"]["max_error"] == budget
        for r in index["tensors"]:
            if r["role"] != "weight":
                continue
            err = _rel(recon[r["name"]], orig[r["name"]])
            assert err <= budget, (budget, k, r["name"], err)
            assert err == pytest.approx(r["stats"]["rel_rms_error"], rel=1e-6, abs=1e-15), r["name"]
            if k:
                kinds.add(r["coding"])
                if r["coding"] == "residual":
                    assert r["stats"]["budget"] == budget and r["stats"]["bits"] in (2, 3, 4, 5, 6, 7, 8)
        if k:
            assert index["errors"].get("weight", 0.0) <= budget  # no entry: every weight exact
    # A zero budget stores every weight exactly, a loose one codes residuals; at 1e-4 the
    # rounding of a bf16 or fp16 reconstruction alone can exceed it: those stay exact.
    assert kinds == {0.0: {"frame"}, 1e-4: {"frame", "residual"}}.get(budget, {"residual"}), kinds


def test_a_looser_budget_gives_a_smaller_file(tmp_path):
    sizes = []
    for budget in (1e-4, 1e-3, 1e-2):
        folder = tmp_path / f"b{budget}"
        folder.mkdir()
        files = _chain(folder, _series(2), max_error=budget)
        sizes.append(files[1][1].stat().st_size)
    assert sizes[0] > sizes[1] > sizes[2], sizes


def _patterns(dtype: str) -> torch.Tensor:
    """Every finite bit pattern of a 16-bit float dtype (normals, subnormals, both zeros)."""
    bits = np.arange(1 << 16, dtype=np.uint16).view(np.int16)
    t = torch.from_numpy(bits.copy()).view(getattr(torch, dtype))
    return t[torch.isfinite(t)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_budget_holds_over_every_finite_pattern_and_non_finite_weights_stay_exact(tmp_path, dtype):
    w0 = _patterns(dtype)
    g = torch.Generator().manual_seed(3)
    # Each value moved by ~2 % of itself, so every exponent range has a residual; values
    # within a few % of the dtype's largest stay put (a centroid added to one of them could
    # overflow: a tensor whose reconstruction would, is stored exactly).
    w1 = (w0.double() * (1 + 0.02 * torch.randn(w0.numel(), generator=g, dtype=torch.float64))).to(w0.dtype)
    w1 = torch.where(w0.double().abs() < torch.finfo(w0.dtype).max / 4, w1, w0)
    special = torch.tensor([float("inf"), float("-inf"), float("nan")] + [0.5] * 4093).to(w0.dtype)
    states = [{"w": w0.reshape(-1, 4) if k == 0 else w1.reshape(-1, 4), "s": special} for k in range(2)]
    for budget in (1e-3, 3e-2):
        folder = tmp_path / f"{budget}"
        folder.mkdir()
        _, (src1, ccl1) = _chain(folder, states, max_error=budget)
        lossy.decompress_file(ccl1, folder / "out")
        recon, orig = load_file(folder / "out"), load_file(src1)
        recs = {r["name"]: r for r in lossy.read_index(ccl1)["tensors"]}
        # the tightest budget may be out of reach of 255 centroids over 80 decades (then exact)
        assert recs["w"]["coding"] == "residual" or budget < 1e-2
        assert _rel(recon["w"], orig["w"]) <= budget
        assert recs["s"]["coding"] == "frame"  # Inf and NaN: no relative error to bound, stored exactly
        assert torch.equal(recon["s"].view(torch.int16), orig["s"].view(torch.int16))


def test_search_matches_kmeans_on_the_kept_values():
    rng = np.random.default_rng(1)
    x = rng.standard_t(3, 20000)
    z = _Sorted(x)
    for t in (0.0, 0.5, 2.0):
        i, j = z.split(t)
        kept = x[np.abs(x) > t]
        assert j - i == x.size - kept.size
        sse, counts, cents_search = _lloyd(z, i, j, 7, steps=300)
        sym, cents = quantize(kept, 7)
        ref = float(np.sum((kept - cents[sym - 1].astype(np.float64)) ** 2))
        assert sse == pytest.approx(ref, rel=1e-3)
        assert sorted(counts[counts > 0].tolist()) == sorted(np.bincount(sym)[1:].tolist())
        used = cents[np.bincount(sym, minlength=cents.size + 1)[1:] > 0]  # centroids that hold values
        assert np.allclose(np.sort(cents_search), np.sort(used), rtol=1e-5)
    x = rng.normal(0, 1, 20000)
    norm = float(np.linalg.norm(x))
    c = choose(x, norm, 0.05)
    assert c is not None and c.est_error <= 0.05 and c.centroids.size <= (1 << c.bits) - 1
    assert estimate(x.size, np.array([x.size])) == 0.0  # one symbol, everything kept: nothing to code
    assert choose(x, norm, 1.01).est_bytes == 0.0  # everything pruned fits: nothing is kept


@pytest.mark.cli
@pytest.mark.slow
def test_cli_max_error_round_trip_and_inspect(tmp_path):
    states = _series(2)
    for k, state in enumerate(states):
        save_file(state, tmp_path / f"s{k}.safetensors")
    a, b = tmp_path / "a.ccl", tmp_path / "b.ccl"
    assert run_cli("compress", tmp_path / "s0.safetensors", a, "--lossy", "excp").returncode == 0
    r = run_cli("compress", tmp_path / "s1.safetensors", b, "--lossy", "excp", "--base", a, "--max-error", "2e-3")
    assert r.returncode == 0 and "lossy excp" in r.stdout, r.stderr
    assert lossy.read_index(b)["params"]["max_error"] == 2e-3
    r = run_cli("inspect", b)
    assert r.returncode == 0, r.stderr
    assert "max_error=0.002" in r.stdout and "within budget" in r.stdout and "threshold" in r.stdout, r.stdout
    for args, message in (
        (("--lossy", "excp", "--max-error", "1e-3", "--alpha", "5e-4"), "not both"),
        (("--lossy", "excp", "--max-error", "-1"), "--max-error"),
        (("--lossy", "precision", "--keep-bits", "3", "--max-error", "1e-3"), "--max-error apply to --lossy excp"),
        (("--max-error", "1e-3"), "--max-error only apply to lossy compression"),
    ):
        r = run_cli("compress", tmp_path / "s1.safetensors", tmp_path / "x", *args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
    assert not (tmp_path / "x").exists()
