"""The trainer recipes, run for real: Accelerate, transformers' Trainer, Lightning, 2 gloo ranks.

Each worker trains a small MLP a few steps through the trainer with comm_codec
registered by the recipe, then checks what the recipe promises: the gradient traffic
was coded (ratio above 1, coded calls made), every rank ends with bit-identical
parameters, and the stats reach the trainer's logs. Trainers keep process-wide state
(Accelerate's singleton, Lightning's environment), so every test gets fresh ranks
(``dist_utils.run_fresh``); the ranks set the environment variables a launcher would.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dist_utils

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 5
WARMUP = 2


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))


def _batch(rank, step):
    g = torch.Generator().manual_seed(7919 * step + 104729 * rank + 1)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _launcher_env(rank, world, port):
    """What torchrun / accelerate launch would set (the process group already exists)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _same_everywhere(model: nn.Module) -> bool:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, h.hexdigest())
    return len(set(seen)) == 1


def _w_accelerate(rank, world, port):
    _launcher_env(rank, world, port)
    from accelerate import Accelerator

    from comm_codec.integrations.accelerate import register

    accelerator = Accelerator(cpu=True)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = accelerator.prepare(model, opt)
    state = register(accelerator, model, warmup_steps=WARMUP)
    for step in range(STEPS):
        x, y = _batch(rank, step)
        accelerator.backward(F.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    d = state.stats()
    return {
        "wrapper": type(model).__name__,
        "ratio": d["ratio"],
        "calls": d["calls"],
        "steps": d["steps"],
        "same": _same_everywhere(model),
    }


class _Regressor(nn.Module):
    """The MLP as the Trainer wants a model: forward(x, labels) -> {"loss", "logits"}."""

    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


def _w_hf_trainer(rank, world, port):
    _launcher_env(rank, world, port)
    from transformers import Trainer, TrainingArguments

    from comm_codec.integrations.hf import CommCodecCallback

    data = []
    for step in range(STEPS * world):
        x, y = _batch(0, step)  # one dataset; the Trainer's sampler gives each rank its share
        data += [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    callback = CommCodecCallback(warmup_steps=WARMUP)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=16,
            max_steps=STEPS,
            logging_steps=1,
            learning_rate=0.05,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            ddp_backend="gloo",
            seed=0,
        )
        model = _Regressor()
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.train()
    logged = [h for h in trainer.state.log_history if "comm_codec/ratio" in h]
    d = callback.state.stats()
    return {
        "world": args.world_size,
        "ratio": d["ratio"],
        "calls": d["calls"],
        "steps": d["steps"],
        "logged": len(logged),
        "last_logged_ratio": logged[-1]["comm_codec/ratio"] if logged else None,
        "same": _same_everywhere(model),
    }


def _w_lightning(rank, world, port):
    _launcher_env(rank, world, port)
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from comm_codec.ddp import HuffmanState, huffman_hook
    from comm_codec.integrations.lightning import CommCodecCallback

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    xs, ys = zip(*(_batch(0, step) for step in range(STEPS * world)))
    loader = DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=16)
    quiet = dict(
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )

    # Lightning's own recipe: on CPU the hook is never registered (Lightning registers on CUDA only).
    unused = HuffmanState(warmup_steps=WARMUP)
    L.Trainer(strategy=DDPStrategy(ddp_comm_state=unused, ddp_comm_hook=huffman_hook), **quiet).fit(Module(), loader)
    unused_calls = unused.stats()["calls"] + unused.stats()["raw_calls"]

    callback = CommCodecCallback(warmup_steps=WARMUP)
    module = Module()
    trainer = L.Trainer(strategy="ddp", callbacks=[callback], **quiet)
    trainer.fit(module, loader)
    d = callback.state.stats()
    return {
        "unused_calls": unused_calls,
        "ratio": d["ratio"],
        "calls": d["calls"],
        "steps": d["steps"],
        "logged": float(trainer.callback_metrics.get("comm_codec/ratio", 0.0)),
        "same": _same_everywhere(module),
    }


def _check(results, world=2):
    for r in results:
        assert r["same"], "ranks ended with different parameters"
        assert r["steps"] == STEPS and r["calls"] > 0
        assert r["ratio"] > 1.0
    assert len({r["ratio"] for r in results}) >= 1


def test_accelerate_register():
    results = dist_utils.run_fresh(_w_accelerate, 2, dist_utils.free_port(), timeout=150)
    _check(results)
    assert results[0]["wrapper"] == "DistributedDataParallel"


def test_hf_trainer_callback():
    results = dist_utils.run_fresh(_w_hf_trainer, 2, dist_utils.free_port(), timeout=150)
    _check(results)
    for r in results:
        assert r["world"] == 2
        assert r["logged"] >= STEPS and r["last_logged_ratio"] > 1.0  # every step, and the summary


def test_lightning_callback_on_cpu():
    results = dist_utils.run_fresh(_w_lightning, 2, dist_utils.free_port(), timeout=150)
    _check(results)
    for r in results:
        assert r["unused_calls"] == 0, "Lightning registered the hook on CPU: update the README's note"
        assert r["logged"] > 1.0


# One keyword set for every adapter: the same settings attach DDP and FSDP2 alike.
SHARED_SETTINGS = {
    "warmup_steps": 1,
    "mode": "always",
    "min_bytes": 0,
    "threads": 1,
    "log_every": 0,
    "drift_every": 1,
    "refresh_steps": 1,
    "recheck_every": 10,
    "probe_steps": 2,
    "hysteresis": 0.1,
}


def _w_attach_same_settings(rank, world):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from comm_codec.integrations import attach

    results = {}
    for name in ("ddp", "fsdp2"):
        model = _mlp()
        if name == "ddp":
            model = DDP(model)
        else:
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(model)
        state = attach(model, **SHARED_SETTINGS)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(3):
            x, y = _batch(rank, step)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        s = state.stats()
        results[name] = {
            "type": type(state).__name__,
            "calls": s["calls"],
            "steps": s["steps"],
            "min_bytes": state.min_bytes,
            "warmup": state.warmup_steps,
        }
    return results


def test_attach_takes_one_keyword_set_for_ddp_and_fsdp2():
    for r in dist_utils.run(_w_attach_same_settings, 2, timeout=120):
        assert r["ddp"]["type"] == "HuffmanState" and r["fsdp2"]["type"] == "FSDPState"
        for name in ("ddp", "fsdp2"):
            assert r[name]["min_bytes"] == 0 and r[name]["warmup"] == 1
            assert r[name]["steps"] == 3 and r[name]["calls"] > 0, (name, r[name])


# HF Trainer with TrainingArguments(deepspeed=ds_config): the ds_config's "comm_codec"
# section configures the callback, which installs into the engine the Trainer built.
def _w_hf_deepspeed(rank, world, port, stage, section):
    _launcher_env(rank, world, port)
    from transformers import Trainer, TrainingArguments

    from comm_codec.integrations.hf import CommCodecCallback

    data = []
    for step in range(STEPS * world):
        x, y = _batch(0, step)
        data += [{"x": x[i], "labels": y[i]} for i in range(len(x))]
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10_000,
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "torch_adam": True}},
    }
    callbacks = []
    if section is not None:
        ds_config["comm_codec"] = section
        callbacks.append(CommCodecCallback())
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=16,
            max_steps=STEPS,
            logging_steps=1,
            learning_rate=0.01,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            ddp_backend="gloo",
            seed=0,
            deepspeed=ds_config,
        )
        model = _Regressor()
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        trainer.train()
    engine = trainer.model_wrapped
    h = hashlib.sha256()
    with __import__("deepspeed").zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        for p in engine.module.parameters():
            h.update(p.detach().float().contiguous().view(torch.uint8).numpy().tobytes())
    out = {
        "engine": type(engine).__name__,
        "digest": h.hexdigest(),
        "losses": [x["loss"] for x in trainer.state.log_history if "loss" in x],
    }
    if callbacks:
        d = callbacks[0].state.stats()
        out["stats"] = {key: d[key] for key in ("calls", "raw_calls", "ratio", "bytes_saved", "steps")}
        callbacks[0].state.detach()
    return out


def _run_deepspeed_ranks(fn, *args):
    # DeepSpeed's CPU accelerator and its shared-memory op, built once per machine.
    env = {
        "DS_ACCELERATOR": "cpu",
        "NUMBA_NUM_THREADS": "2",
        "TORCH_EXTENSIONS_DIR": os.path.join(tempfile.gettempdir(), f"comm_codec-tests-torch-extensions-{os.getuid()}"),
    }
    group = dist_utils.WorkerGroup(2, env=env)
    try:
        return group.run(fn, *args, timeout=900)
    finally:
        group.kill()  # DeepSpeed leaves threads that keep a finished rank from exiting promptly


def test_hf_trainer_deepspeed_section_is_coded_and_bit_identical():
    for stage in (2, 3):
        coded = _run_deepspeed_ranks(_w_hf_deepspeed, dist_utils.free_port(), stage, {"mode": "always", "min_bytes": 0})
        plain = _run_deepspeed_ranks(_w_hf_deepspeed, dist_utils.free_port(), stage, None)
        for c, p in zip(coded, plain):
            assert c["engine"] == "DeepSpeedEngine"
            assert c["digest"] == p["digest"] and c["losses"] == p["losses"], (stage, c, p)
            s = c["stats"]
            assert s["steps"] == STEPS and s["calls"] >= STEPS and s["raw_calls"] == 0, (stage, s)
            assert s["bytes_saved"] > 0 and s["ratio"] > 1.05, (stage, s)


# Accelerate's DeepSpeed plugin: prepare() builds the engine; register() installs into it.
def _w_accelerate_deepspeed(rank, world, port, stage, section):
    _launcher_env(rank, world, port)
    from accelerate import Accelerator, DeepSpeedPlugin

    from comm_codec.integrations.accelerate import register

    ds_config = {
        "train_micro_batch_size_per_gpu": 16,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10_000,
    }
    if section is not None:
        ds_config["comm_codec"] = section
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds_config))
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    engine, opt = accelerator.prepare(model, opt)
    state = register(accelerator, engine) if section is not None else None
    losses = []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        loss = F.mse_loss(engine(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    h = hashlib.sha256()
    with __import__("deepspeed").zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        for p in engine.module.parameters():
            h.update(p.detach().float().contiguous().view(torch.uint8).numpy().tobytes())
    out = {"engine": type(engine).__name__, "digest": h.hexdigest(), "losses": losses}
    if state is not None:
        d = state.stats()
        out["stats"] = {key: d[key] for key in ("calls", "raw_calls", "ratio", "bytes_saved", "steps")}
        out["state"] = type(state).__name__
        state.detach()
    return out


def test_accelerate_deepspeed_plugin_section_is_coded_and_bit_identical():
    for stage in (2, 3):
        coded = _run_deepspeed_ranks(
            _w_accelerate_deepspeed, dist_utils.free_port(), stage, {"mode": "always", "min_bytes": 0}
        )
        plain = _run_deepspeed_ranks(_w_accelerate_deepspeed, dist_utils.free_port(), stage, None)
        for c, p in zip(coded, plain):
            assert c["engine"] == "DeepSpeedEngine" and c["state"] == "DeepSpeedState"
            assert c["digest"] == p["digest"] and c["losses"] == p["losses"], (stage, c, p)
            s = c["stats"]
            assert s["steps"] == STEPS and s["calls"] >= STEPS and s["raw_calls"] == 0, (stage, s)
            assert s["bytes_saved"] > 0 and s["ratio"] > 1.05, (stage, s)
