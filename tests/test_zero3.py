"""ZeRO-3 and ZeRO-Offload with the DeepSpeed plugin, on real DeepSpeed processes over gloo.

What is pinned: with ``"zero_optimization": {"stage": 3}`` the plugin codes the parameter
all-gathers (every rank ends with the owners' exact bits) and the gradient reduce-scatters
(the rank-order float32 sum, then DeepSpeed's division by W, rounded once), so losses and
parameters are bit-identical to a run whose reduce-scatter is an uncoded rank-order
reference; warmup builds books for both kinds; offload at stages 2 and 3 still codes the
gradients; settings the plugin does not cover fail with one message naming the key and
the values allowed, on every rank, before the first step; a stalled rank fails the other
within the user's ``init_process_group`` timeout.

Every run of the quick tier shares one fresh 2-rank group (DeepSpeed engines cost seconds
apiece); 4 ranks and the stall are in the slow tier.
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch
from test_deepspeed import ccds, needs_deepspeed, torch_extensions_env
from torch import nn

import dist_utils
from helpers import error_text, join_deepspeed

pytestmark = pytest.mark.dist

STEPS = 3
# Small buckets still code: the model is small.
CODED = {"enabled": True, "mode": "always", "min_bytes": 256}


# ----------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 8))


def _config(stage, section, zero_extra=None, dtype="bf16"):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": dict({"stage": stage, "stage3_param_persistence_threshold": 0}, **(zero_extra or {})),
        "zero_force_ds_cpu_optimizer": False,
        "comm_codec": section,
    }
    if stage < 3:
        del config["zero_optimization"]["stage3_param_persistence_threshold"]
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _reference_reduce_scatter(tensors, group=None):
    """ZeRO-3's reduce-scatter, uncoded: every rank's raw rows summed in rank order in float32,
    divided by W and rounded once (the rule the plugin follows)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = [-(-t.numel() // world) for t in tensors]
    rows = torch.zeros(world, sum(sizes), dtype=tensors[0].dtype)
    offset = 0
    for t, size in zip(tensors, sizes):
        flat = t.reshape(-1)
        for r in range(world):
            part = flat[r * size : (r + 1) * size]
            rows[r, offset : offset + part.numel()] = part
        offset += size
    everyone = [torch.empty_like(rows) for _ in range(world)]
    dist.all_gather(everyone, rows, group=group)
    acc = torch.zeros(rows.shape[1], dtype=torch.float32)
    for r in range(world):
        acc += everyone[r][rank].float()
    out = (acc / world).to(rows.dtype)
    parts, offset = [], 0
    for t, size in zip(tensors, sizes):
        parts.append(out.narrow(0, offset, max(0, min(size, t.numel() - rank * size))))
        offset += size
    return parts


def _train(rank, stage, section, steps=STEPS, zero_extra=None, reference=False, record=None):
    """Train; return (losses, digest of every full parameter, stats or None)."""
    import deepspeed
    from deepspeed.runtime.zero import stage3

    model = _model()
    saved = stage3.reduce_scatter_coalesced  # DeepSpeed's, or the plugin's dispatcher once installed
    if reference:
        stage3.reduce_scatter_coalesced = _reference_reduce_scatter
    try:
        engine, *_ = ccds.initialize(
            model=model, model_parameters=model.parameters(), config=_config(stage, section, zero_extra)
        )
        g = torch.Generator().manual_seed(1000 + rank)
        losses = []
        for _ in range(steps):
            x, y = torch.randn(4, 32, generator=g).bfloat16(), torch.randn(4, 8, generator=g).bfloat16()
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    finally:
        if reference:
            stage3.reduce_scatter_coalesced = saved
    params = list(engine.module.parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(params):
            digests = [_digest(p) for p in params]
    else:
        digests = [_digest(p) for p in params]
    stats = ccds.stats(engine) if section.get("enabled", True) else None
    return losses, digests, stats


def _recording_all_gathers(calls):
    """Wrap the coded all-gather: record every rank's shard and what each rank decoded."""
    from comm_codec.comm import collectives

    real = collectives.all_gather

    def recording(tensor_list, tensor, *args, **kwargs):
        own = _digest(tensor)
        result = real(tensor_list, tensor, *args, **kwargs)
        calls.append((own, [_digest(t) for t in tensor_list]))
        return result

    return collectives, real, recording


def _w_zero3(rank, world, books_fp32_path, cases):

    join_deepspeed(rank, world)
    out = {"reference": _train(rank, 3, {"enabled": False}, reference=True)}
    calls = []
    module, real, recording = _recording_all_gathers(calls)
    module.all_gather = recording
    try:
        out["coded"] = _train(rank, 3, CODED)
    finally:
        module.all_gather = real
    out["gathers"] = calls
    if "errors" in cases:
        model = _model()
        bad = {
            "books": _config(3, {"enabled": True, "codebooks": books_fp32_path}),
            "quantized": _config(3, CODED, {"zero_quantized_weights": True}),
            "cast": _config(3, dict(CODED, cast="bf16")),
        }
        out["errors"] = {
            name: error_text(lambda c=c: ccds.initialize(model=model, model_parameters=model.parameters(), config=c))
            for name, c in bad.items()
        }
    if "more" in cases:
        out["plain"] = _train(rank, 3, {"enabled": False}, steps=4)
        out["warmup"] = _train(
            rank, 3, {"enabled": True, "warmup_steps": 2, "mode": "always", "min_bytes": 256}, steps=4
        )
        offload = {"offload_optimizer": {"device": "cpu"}}
        out["offload3"] = _train(rank, 3, CODED, zero_extra=offload)
        out["offload3_reference"] = _train(rank, 3, {"enabled": False}, zero_extra=offload, reference=True)
        out["offload2_base"] = _train(rank, 2, {"enabled": False}, zero_extra=offload)
        out["offload2"] = _train(rank, 2, CODED, zero_extra=offload)
    return out


def _w_stall(rank, world, timeout):

    join_deepspeed(rank, world)
    model = _model()
    engine, *_ = ccds.initialize(model=model, model_parameters=model.parameters(), config=_config(3, CODED))
    x, y = torch.randn(4, 32).bfloat16(), torch.randn(4, 8).bfloat16()
    for step in range(3):
        if step == 2 and rank == 1:
            time.sleep(3 * timeout)  # stalls before its forward
        start = time.monotonic()
        try:
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        except Exception as exc:
            return {"step": step, "error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - start}
    return {"step": None}


@pytest.fixture(scope="module")
def books_fp32(tmp_path_factory):
    """Books profiled on fp32 tensors only: a bf16 engine has no book to code with."""
    import comm_codec as cc

    prof = cc.WarmupProfiler()
    g = torch.Generator().manual_seed(3)
    for kind in ("gradient", "weight", "reduced_gradient"):
        prof.observe(torch.randn(1 << 14, generator=g) * 1e-3, kind)
    path = tmp_path_factory.mktemp("books") / "fp32.json"
    prof.build().save(path)
    return str(path)


@pytest.fixture(scope="module")
def z3(books_fp32):
    with torch_extensions_env() as env:
        return dist_utils.run_fresh(_w_zero3, 2, books_fp32, ("errors",), timeout=300, env=env)


@pytest.fixture(scope="module")
def z3_more():
    """Warmup and offload runs (slow tier: six more engines)."""
    with torch_extensions_env() as env:
        return dist_utils.run_fresh(_w_zero3, 2, "", ("more",), timeout=400, env=env)


# ----------------------------------------------------------------------------------------
# ZeRO-3: bit-identical to the rank-order reference, gathered bits are the owners'
# ----------------------------------------------------------------------------------------
@needs_deepspeed
@pytest.mark.slow
def test_zero3_losses_and_parameters_bit_identical_to_rank_order_reference(z3):
    for rank, res in enumerate(z3):
        ref_losses, ref_params, _ = res["reference"]
        losses, params, _ = res["coded"]
        assert losses == ref_losses, f"rank {rank}: {losses} != {ref_losses}"
        assert params == ref_params, f"rank {rank}: parameters differ from the reference"
    assert z3[0]["coded"][1] == z3[1]["coded"][1]


@needs_deepspeed
def test_zero3_codes_both_collectives_and_every_rank_gathers_the_owners_bits(z3):
    for res in z3:
        st = res["coded"][2]
        assert st["steps"] == STEPS and st["raw_calls"] == 0, st
        for name in ("reduce_scatter", "all_gather"):
            assert st[name]["calls"] >= STEPS and st[name]["ratio"] > 1.05, (name, st[name])
        assert st["bytes_out"] < st["bytes_in"]
    gathers = [res["gathers"] for res in z3]
    assert len(gathers[0]) == len(gathers[1]) >= STEPS
    for k, (g0, g1) in enumerate(zip(*gathers)):
        owners = [g0[0], g1[0]]
        assert g0[1] == g1[1] == owners, f"all-gather {k}: decoded rows differ from the owners' shards"


@pytest.mark.slow
@needs_deepspeed
def test_zero3_warmup_builds_books_for_weights_and_gradients(z3_more):
    for res in z3_more:
        losses, params, st = res["warmup"]
        plain_losses, plain_params, _ = res["plain"]
        assert losses[:2] == plain_losses[:2]  # the warmup steps are DeepSpeed's own
        assert st["steps"] == 4 and st["warming_up"] is False and st["books"] is not None
        for name in ("reduce_scatter", "all_gather"):
            assert st[name]["raw_calls"] >= 2 and st[name]["calls"] >= 2, (name, st[name])
    assert z3_more[0]["warmup"][2]["books"] == z3_more[1]["warmup"][2]["books"]


@pytest.mark.slow
@needs_deepspeed
def test_offload_at_stage_3_codes_gradients_bit_identically(z3_more):
    for res in z3_more:
        losses, params, st = res["offload3"]
        assert (losses, params) == res["offload3_reference"][:2]
        assert st["reduce_scatter"]["calls"] >= STEPS and st["reduce_scatter"]["ratio"] > 1.05


@pytest.mark.slow
@needs_deepspeed
def test_offload_at_stage_2_codes_gradients_and_trains_the_same(z3_more):
    for res in z3_more:
        losses, params, st = res["offload2"]
        assert (losses, params) == res["offload2_base"][:2]
        assert st["calls"] >= STEPS and st["raw_calls"] == 0 and st["ratio"] > 1.05, st


@needs_deepspeed
def test_settings_not_covered_fail_on_every_rank_naming_key_and_values(z3):
    for res in z3:
        errors = res["errors"]
        assert (
            "comm_codec.codebooks: the books" in errors["books"]
            and "hold no 'gradient' book for bfloat16" in errors["books"]
        ), errors["books"]
        assert (
            "zero_optimization.zero_quantized_weights: True; allowed with comm_codec: false" in errors["quantized"]
        ), errors["quantized"]
        assert (
            "comm_codec.cast: 'bf16' at ZeRO stage 3" in errors["cast"] and "allowed at stage 3: null" in errors["cast"]
        ), errors["cast"]
    assert z3[0]["errors"] == z3[1]["errors"]


# ----------------------------------------------------------------------------------------
# Slow tier: 4 ranks, a stalled rank
# ----------------------------------------------------------------------------------------
@pytest.mark.slow
@needs_deepspeed
def test_zero3_world4_bit_identical_to_rank_order_reference():
    with torch_extensions_env() as env:
        results = dist_utils.run_fresh(_w_zero3, 4, "", (), timeout=300, env=env)
    for rank, res in enumerate(results):
        assert res["coded"][:2] == res["reference"][:2], f"rank {rank} differs from the reference"
        for k, (_own, rows) in enumerate(res["gathers"]):
            assert rows == [other["gathers"][k][0] for other in results]
    assert len({res["coded"][1][0] for res in results}) == 1


@pytest.mark.slow
@needs_deepspeed
def test_a_stalled_rank_fails_the_other_within_the_users_timeout():
    timeout = 6.0
    with torch_extensions_env() as env:
        outcomes = dist_utils.run_outcomes(_w_stall, 2, timeout, timeout=120, env=env, pg_timeout=timeout)
    healthy = outcomes[0]
    assert healthy["status"] == "ok", healthy
    value = healthy["value"]
    assert value["step"] == 2 and value["seconds"] < 2 * timeout, value
    assert "comm_codec" in value["error"] or "timed out" in value["error"].lower() or "Timeout" in value["error"], value
