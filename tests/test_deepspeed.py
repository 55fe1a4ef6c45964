"""Tests of the DeepSpeed plugin (comm_codec.deepspeed) with real DeepSpeed on gloo ranks.

What is pinned: the "comm_codec" config section is validated with messages that name the
key and what is allowed; unsupported setups (ZeRO++, NVMe offload, pipeline engine, 1-bit optimizers,
other DeepSpeed versions) and unreadable codebook files fail at initialize; and on two
gloo ranks, ZeRO stages 0, 1 and 2 in fp32 and bf16 train to the same losses with the
plugin as without it, while sending fewer bytes.

The losses are compared with ``==``: with two ranks the plugin's rank-order float32 sum of
two addends is the same number gloo computes, and the rest of each step is DeepSpeed's
own code, so nothing may differ at all (with three ranks summation order can move the last
bit; see launch_scripts/train_deepspeed.py --matrix for longer runs). All DeepSpeed cases
run in one fresh 2-rank group (tests/dist_utils.py), since starting ranks and importing
DeepSpeed costs seconds apiece.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import comm_codec as cc

import dist_utils
from helpers import error_text, join_deepspeed

pytestmark = pytest.mark.unit

try:
    import comm_codec.deepspeed as ccds
except ImportError:  # DeepSpeed not installed: only the import test below runs
    ccds = None

needs_deepspeed = pytest.mark.skipif(ccds is None, reason="needs the deepspeed extra")


# DeepSpeed's builds of its ops, private to these tests: a build killed half way in the
# shared ~/.cache/torch_extensions leaves a lock on which every later run waits forever.
EXTENSIONS_DIR = Path(tempfile.gettempdir()) / f"comm_codec-tests-torch-extensions-{os.getuid()}"
# A build lock older than this is a dead build's (the op builds in about a minute).
_STALE_LOCK_SECONDS = 900


@contextlib.contextmanager
def torch_extensions_env():
    """Build DeepSpeed's CPU shared-memory comm op in the tests' own extension dir; yield the ranks' env.

    Its first build (ninja + g++) takes a minute or more; inside a rank it would race the
    other rank and eat the per-call timeout. Later loads come from the cache. A lock left
    by a killed build is removed once it is older than any build takes.
    """
    env = {
        "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_DIR),
        "DS_ACCELERATOR": "cpu",
        # Two numba threads: numba's OpenMP layer would reset torch's thread count to 2.
        "NUMBA_NUM_THREADS": "2",
    }
    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(EXTENSIONS_DIR)
    try:
        for lock in EXTENSIONS_DIR.glob("*/*/lock"):
            if time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
                lock.unlink(missing_ok=True)
        if ccds is not None:
            from deepspeed.accelerator import get_accelerator

            get_accelerator().create_op_builder("ShareMemCommBuilder").load()
        yield env
    finally:
        if saved is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved


STEPS = 3
STATS_KEYS = (
    "bytes_in",
    "bytes_out",
    "ratio",
    "bytes_saved",
    "encode_seconds",
    "decode_seconds",
    "steps",
    "calls",
    "raw_calls",
    "warming_up",
    "books",
)
# (name, ZeRO stage, dtype, "comm_codec" section, zero_optimization extras)
CASES = [(f"zero{stage}-{dtype}", stage, dtype, {}, {}) for stage in (0, 1, 2) for dtype in ("fp32", "bf16")] + [
    # ZeRO 1/2 with each bucket slice reduced to its owner: the coded reduce.
    ("zero2-fp32-reduce", 2, "fp32", {}, {"use_multi_rank_bucket_allreduce": False}),
    ("zero1-bf16-reduce", 1, "bf16", {}, {"use_multi_rank_bucket_allreduce": False}),
    # "reduce_scatter": false: DeepSpeed's gradient_reduction_w_predivide.
    ("zero2-bf16-allreduce", 2, "bf16", {}, {"reduce_scatter": False}),
]
# The natural config: warmup_steps alone means books built online.
WARMUP = ("zero2-bf16-online", 2, "bf16", {"warmup_steps": 2, "mode": "always"}, {})
CAST = ("zero0-fp32-cast", 0, "fp32", {"cast": "bf16", "mode": "always"}, {})


# ----------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 8))


def _ds_config(stage, dtype, section, zero_extra, top=None):
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "steps_per_print": 10_000,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": dict({"stage": stage}, **zero_extra),
        "comm_codec": section,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    config.update(top or {})
    return config


def _train(rank, stage, dtype, section, zero_extra, steps, top=None):
    """Train a few steps; return (losses, stats or None, digests of coded all-reduce results)."""
    import comm_codec.deepspeed as ccds
    from comm_codec.comm import collectives

    model = _model()
    engine, *_ = ccds.initialize(
        model=model, model_parameters=model.parameters(), config=_ds_config(stage, dtype, section, zero_extra, top)
    )
    digests = []
    real_all_reduce = collectives.all_reduce

    def recording_all_reduce(tensor, *args, **kwargs):
        result = real_all_reduce(tensor, *args, **kwargs)
        digests.append(hashlib.sha256(result.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest())
        return result

    collectives.all_reduce = recording_all_reduce
    try:
        g = torch.Generator().manual_seed(1000 + rank)
        dt = engine.module[0].weight.dtype
        losses = []
        for _ in range(steps):
            x, y = torch.randn(8, 32, generator=g).to(dt), torch.randn(8, 8, generator=g).to(dt)
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    finally:
        collectives.all_reduce = real_all_reduce
    stats = ccds.stats(engine)  # a disabled section gives a disabled record
    return losses, stats, digests


def _w_deepspeed(rank, world, bad_books_path, monitor_dir):
    """Every DeepSpeed case on this rank; returns a dict of results by case name."""
    import comm_codec.deepspeed as ccds

    join_deepspeed(rank, world)
    out = {}
    for name, stage, dtype, section, zero_extra in CASES:
        base, no_stats, _ = _train(rank, stage, dtype, {"enabled": False}, zero_extra, STEPS)
        losses, stats, digests = _train(
            rank, stage, dtype, dict({"enabled": True, "mode": "always"}, **section), zero_extra, STEPS
        )
        out[name] = {
            "base": base,
            "plugin": losses,
            "stats": stats,
            "digests": digests,
            "no_stats": no_stats,
            "torch_threads": torch.get_num_threads(),
        }  # dist_utils pins 1; coding must not move it
    name, stage, dtype, section, zero_extra = WARMUP
    base, _, _ = _train(rank, stage, dtype, {"enabled": False}, zero_extra, 4)
    monitor = {"csv_monitor": {"enabled": True, "output_path": monitor_dir, "job_name": "ccds"}}
    losses, stats, digests = _train(rank, stage, dtype, dict(section, log_every=2), zero_extra, 4, monitor)
    out[name] = {"base": base, "plugin": losses, "stats": stats, "digests": digests}

    name, stage, dtype, section, zero_extra = CAST
    losses, stats, _ = _train(rank, stage, dtype, section, zero_extra, STEPS)
    out[name] = {"base": out["zero0-fp32"]["base"], "plugin": losses, "stats": stats}

    # Failures at initialize that need a process group.
    model = _model()
    config = _ds_config(0, "fp32", {"codebooks": bad_books_path}, {})
    out["bad_books"] = error_text(
        lambda: ccds.initialize(model=model, model_parameters=model.parameters(), config=config)
    )
    from deepspeed.pipe import PipelineModule

    pipe = PipelineModule(layers=[nn.Linear(8, 8), nn.Linear(8, 8)], num_stages=1)
    out["pipeline"] = error_text(
        lambda: ccds.initialize(model=pipe, model_parameters=pipe.parameters(), config=_ds_config(0, "fp32", {}, {}))
    )
    model = _model()
    engine, *_ = ccds.initialize(model=model, model_parameters=model.parameters(), config=_ds_config(0, "fp32", {}, {}))
    out["twice"] = error_text(lambda: ccds.install(engine))
    out["register"] = _register_and_detach(rank)
    return out


def _register_and_detach(rank):
    """register() on an engine built by plain deepspeed.initialize, then detach(): DeepSpeed's own again."""
    import deepspeed

    import comm_codec.deepspeed as ccds

    model = _model()
    config = _ds_config(2, "fp32", {}, {})
    del config["comm_codec"]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    state = ccds.register(engine, mode="always", min_bytes=0)
    g = torch.Generator().manual_seed(2000 + rank)

    def step():
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 8, generator=g)
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()

    step()
    step()
    coded = state.stats()
    state.detach()
    step()
    after = state.stats()
    return {
        "type": type(state).__name__,
        "calls": coded["calls"],
        "ratio": coded["ratio"],
        "calls_after_detach": after["calls"] + after["raw_calls"] - coded["calls"] - coded["raw_calls"],
        "same_record": type(coded).__name__,
        "restored": "allreduce_bucket" not in vars(engine),
    }


@pytest.fixture(scope="module")
def ds_run(tmp_path_factory):
    bad = tmp_path_factory.mktemp("books") / "broken.json"
    bad.write_text('{"format": "something else"}')
    monitor_dir = tmp_path_factory.mktemp("monitor")
    with torch_extensions_env() as env:
        results = dist_utils.run_fresh(_w_deepspeed, 2, str(bad), str(monitor_dir), timeout=240, env=env)
    return results, monitor_dir


@pytest.fixture(scope="module")
def ds_results(ds_run):
    return ds_run[0]


# ----------------------------------------------------------------------------------------
# Training with the plugin: same losses, fewer bytes
# ----------------------------------------------------------------------------------------
@pytest.mark.dist
@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_losses_equal_without_plugin(ds_results, name):
    for rank, res in enumerate(ds_results):
        r = res[name]
        assert r["plugin"] == r["base"], f"rank {rank}: {r['plugin']} != {r['base']}"
        off = r["no_stats"]  # "enabled": false: a record that says so, nothing counted
        assert off["enabled"] is False and off["mode"] == "never" and off["coding"] is False
        assert off["bytes_in"] == off["bytes_out"] == off["calls"] == off["raw_calls"] == 0 and off["ratio"] == 1.0


@pytest.mark.dist
@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_stats_show_every_reduction_coded_and_fewer_bytes(ds_results, name):
    for res in ds_results:
        st = res[name]["stats"]
        assert set(STATS_KEYS) <= set(st)
        assert st["steps"] == STEPS and st["warming_up"] is False
        assert st["calls"] >= STEPS and st["raw_calls"] == 0, st  # nothing went uncoded
        assert st["ratio"] > 1.05 and st["bytes_out"] < st["bytes_in"], st
        assert st["ratio"] == pytest.approx(st["bytes_in"] / st["bytes_out"])


@pytest.mark.dist
@pytest.mark.slow
@needs_deepspeed
@pytest.mark.parametrize("name", [c[0] for c in CASES if "reduce" not in c[0] or "allreduce" in c[0]])
def test_all_reduced_gradients_bit_identical_across_ranks(ds_results, name):
    digests = [res[name]["digests"] for res in ds_results]
    assert len(digests[0]) >= STEPS
    assert digests[0] == digests[1]


@pytest.mark.dist
@pytest.mark.slow
@needs_deepspeed
def test_owner_reduce_path_sends_no_all_reduce(ds_results):
    # use_multi_rank_bucket_allreduce=false: slices go to their owners only.
    for res in ds_results:
        assert res["zero2-fp32-reduce"]["digests"] == []


@pytest.mark.dist
@pytest.mark.slow
@needs_deepspeed
def test_online_warmup_reduces_plainly_then_codes_with_identical_books(ds_results):
    stats = [res[WARMUP[0]]["stats"] for res in ds_results]
    for res, st in zip(ds_results, stats):
        assert res[WARMUP[0]]["plugin"] == res[WARMUP[0]]["base"]
        assert st["steps"] == 4 and st["raw_calls"] >= 2 and st["calls"] >= 2 and st["ratio"] > 1.05
    assert stats[0]["books"] is not None and stats[0]["books"] == stats[1]["books"]


@pytest.mark.dist
@pytest.mark.slow
@needs_deepspeed
def test_cast_bf16_is_lossy_but_close_and_sends_about_half(ds_results):
    for res in ds_results:
        r = res[CAST[0]]
        assert r["plugin"] != r["base"] and r["plugin"] == pytest.approx(r["base"], rel=1e-2)
        assert r["stats"]["ratio"] > 2.0 * res["zero0-fp32"]["stats"]["ratio"] * 0.9


@pytest.mark.dist
@pytest.mark.slow
@needs_deepspeed
def test_deepspeed_monitor_gets_comm_codec_events(ds_run):
    # log_every=2 over 4 steps: DeepSpeed's CSV monitor writes rank 0's ratio at steps 2 and 4.
    rows = (ds_run[1] / "ccds" / "comm_codec_ratio.csv").read_text().splitlines()
    assert len(rows) == 3, rows  # header + 2 events
    assert float(rows[-1].split(",")[1]) > 1.05


@pytest.mark.dist
@pytest.mark.slow
@needs_deepspeed
def test_failures_that_need_a_process_group(ds_results):
    for res in ds_results:
        assert "comm_codec.codebooks: cannot load codebook file" in res["bad_books"]
        assert "broken.json" in res["bad_books"]
        assert res["pipeline"].startswith("ConfigError: comm_codec.deepspeed does not support the pipeline engine")
        assert res["twice"] == "RuntimeError: comm_codec is already installed in this engine"
        r = res["register"]
        assert r["type"] == "DeepSpeedState" and r["same_record"] == "TrafficStats"
        assert r["calls"] >= 2 and r["ratio"] > 1.05, r
        assert r["calls_after_detach"] == 0 and r["restored"], r


@pytest.mark.dist
@pytest.mark.slow
@needs_deepspeed
def test_coding_leaves_torch_thread_count_alone(ds_results):
    # numba's OpenMP layer shares the OpenMP thread count with torch's intra-op pool; a
    # changed count would oversubscribe the cores and change the model's own arithmetic.
    threads = {(rank, c[0]): res[c[0]]["torch_threads"] for rank, res in enumerate(ds_results) for c in CASES}
    assert set(threads.values()) == {1}, threads


# ----------------------------------------------------------------------------------------
# Configuration and scope, checked before any engine exists
# ----------------------------------------------------------------------------------------
@needs_deepspeed
@pytest.mark.parametrize(
    "section, phrase",
    [
        ({"compresion": True}, "comm_codec.compresion: unknown key; allowed keys: codebooks, warmup_steps"),
        ({"cast": "fp8"}, "comm_codec.cast: \"fp8\"; allowed: None (lossless) or 'bf16'"),
        ({"warmup_steps": -1, "codebooks": "online"}, "comm_codec.warmup_steps: -1; allowed: an integer >= 0"),
        ({"warmup_steps": "5", "codebooks": "online"}, 'comm_codec.warmup_steps: "5"; allowed: an integer >= 0'),
        ({"enabled": "yes"}, 'comm_codec.enabled: "yes"; allowed: true or false'),
        ({"codebooks": "online"}, 'comm_codec: codebooks "online" needs warmup_steps >= 1'),
        (
            {"warmup_steps": 3, "codebooks": "default"},
            "warmup_steps builds the books online, but codebooks is 'default'",
        ),
        ({"mode": "sometimes"}, "comm_codec.mode: \"sometimes\"; allowed: 'auto', 'always', 'never'"),
        ({"hysteresis": 1.5}, "comm_codec.hysteresis: 1.5; allowed: a fraction in [0, 1)"),
        ({"kinds": ["activation"]}, "comm_codec.kinds: 'activation' is not coded by the DeepSpeed plugin"),
        ({"kinds": ["bogus"]}, "comm_codec.kinds: 'bogus' is an unknown tensor kind; allowed: ['gradient', 'weight']"),
        ({"kinds": []}, "comm_codec.kinds: []; allowed: a non-empty list of ['gradient', 'weight']"),
        ({"log_every": -5}, "comm_codec.log_every: -5; allowed: an integer >= 0"),
        ({"refresh_threshold": 0.05}, "refresh_threshold needs drift_every > 0"),
    ],
)
def test_bad_config_values_name_the_key(section, phrase):
    with pytest.raises(cc.ConfigError, match='invalid "comm_codec" section in the DeepSpeed config') as info:
        ccds.parse_config({"comm_codec": section})
    assert phrase in str(info.value)


@needs_deepspeed
def test_missing_codebook_file_is_named():
    with pytest.raises(cc.CodebookError) as info:
        ccds.parse_config({"comm_codec": {"codebooks": "/no/such/books.json"}})
    assert "comm_codec.codebooks: cannot load codebook file '/no/such/books.json'" in str(info.value)
    assert "no such file" in str(info.value)


@needs_deepspeed
def test_config_section_from_file_and_defaults(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 2, "comm_codec": {"cast": "bf16"}}))
    section = ccds.parse_config(str(path))
    assert section.enabled and section.cast == "bf16" and section.codebooks == "default"
    assert section.kinds is None and section.warmup_steps == 0 and section.mode == "auto"  # None: what the stage moves
    # warmup_steps alone means books built online, as HuffmanState(warmup_steps=3) does.
    natural = ccds.parse_config({"comm_codec": {"enabled": True, "warmup_steps": 3}})
    assert natural.codebooks == "online" and natural.warmup_steps == 3
    assert ccds.parse_config({"train_batch_size": 2}) is None
    with pytest.raises(ValueError, match="must be an object"):
        ccds.parse_config({"comm_codec": True})


def _initialize_error(config, model=None):
    model = model or nn.Linear(4, 4)
    with pytest.raises((ValueError, RuntimeError)) as info:
        ccds.initialize(model=model, model_parameters=model.parameters(), config=config)
    # Refused before DeepSpeed built anything (no process group was started).
    assert not torch.distributed.is_initialized()
    return str(info.value)


@needs_deepspeed
@pytest.mark.parametrize(
    "zero, phrase",
    [
        ({"stage": 4}, "does not support ZeRO stage 4 (zero_optimization.stage; allowed: 0, 1, 2, 3)"),
        (
            {"stage": 3, "zero_quantized_gradients": True},
            "ZeRO++ quantized gradients (a lossy all-to-all reduction) (zero_optimization.zero_quantized_gradients: True; "
            "allowed with comm_codec: false)",
        ),
        (
            {"stage": 3, "zero_hpz_partition_size": 2},
            "(zero_optimization.zero_hpz_partition_size: 2; allowed with comm_codec: 1)",
        ),
        ({"stage": 3, "reduce_scatter": False}, "(zero_optimization.reduce_scatter: false; allowed at stage 3: true)"),
        (
            {"stage": 2, "offload_optimizer": {"device": "nvme"}},
            'offload to \'nvme\' (zero_optimization.offload_optimizer.device; allowed: "cpu", "none")',
        ),
    ],
)
def test_zero_settings_not_covered_rejected_at_initialize(zero, phrase):
    msg = _initialize_error({"train_batch_size": 2, "zero_optimization": zero, "comm_codec": {}})
    assert msg.startswith("comm_codec.deepspeed does not support") and phrase in msg, msg
    assert '"comm_codec": {"enabled": false}' in msg


@needs_deepspeed
def test_weight_kind_below_stage_3_rejected_at_initialize():
    msg = _initialize_error(
        {"train_batch_size": 2, "zero_optimization": {"stage": 2}, "comm_codec": {"kinds": ["weight"]}}
    )
    assert (
        "comm_codec.kinds: 'weight' (parameter all-gathers) is coded at ZeRO stage 3 only; allowed at stage 2: "
        "['gradient']" in msg
    ), msg


@needs_deepspeed
def test_one_bit_optimizer_rejected_at_initialize():
    msg = _initialize_error({"train_batch_size": 2, "optimizer": {"type": "OneBitAdam"}, "comm_codec": {}})
    assert "does not support 1-bit optimizers (optimizer.type 'OneBitAdam'" in msg


@needs_deepspeed
def test_bad_section_rejected_at_initialize():
    msg = _initialize_error({"train_batch_size": 2, "comm_codec": {"cast": "int8"}})
    assert "comm_codec.cast: \"int8\"; allowed: None (lossless) or 'bf16'" in msg


@needs_deepspeed
def test_unknown_deepspeed_version_rejected(monkeypatch):
    import deepspeed

    monkeypatch.setattr(deepspeed, "__version__", "0.20.1")
    msg = _initialize_error({"train_batch_size": 2, "comm_codec": {}})
    assert msg.startswith("comm_codec.deepspeed supports DeepSpeed 0.19.x")
    assert "found DeepSpeed 0.20.1" in msg and "pip install 'comm_codec[deepspeed]'" in msg


@needs_deepspeed
def test_stats_of_an_engine_without_plugin():
    with pytest.raises(ValueError, match="this engine has no comm_codec plugin"):
        ccds.stats(nn.Linear(2, 2))


@pytest.mark.slow
def test_without_deepspeed_comm_codec_imports_and_the_plugin_says_how_to_install():
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "import comm_codec, comm_codec.ddp, comm_codec.collectives\n"
        "try:\n    import comm_codec.deepspeed\nexcept ImportError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'comm_codec[deepspeed]'" in out.stdout
