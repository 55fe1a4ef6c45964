"""A ds_config "comm_codec" section is never silent, and the plugin's lines show where DeepSpeed users look.

Real DeepSpeed on two gloo ranks. An engine built by plain ``deepspeed.initialize`` (as HF
Trainer and Accelerate build theirs) with a "comm_codec" section and no plugin logs one
WARNING through DeepSpeed's logger at its first backward, on rank 0 only; an engine with the
plugin, or with ``"enabled": false``, logs none. The plugin's INFO lines go through
DeepSpeed's logger when the ds_config's ``"log_level"`` shows INFO, else to comm_codec's
verbosity switch, and nowhere when neither asks for them.

This module imports only ``comm_codec`` at the top (never DeepSpeed), so each rank's
interpreter imports comm_codec first and DeepSpeed later: the path where the check is
hooked into DeepSpeed's engine module as it loads.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import tempfile
from pathlib import Path

import pytest

import comm_codec

import dist_utils
from helpers import join_deepspeed

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# Whether the extra is installed, without importing it (the ranks import it after comm_codec).
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

# The same private op-build directory as test_deepspeed.py (see torch_extensions_env there).
EXTENSIONS_DIR = Path(tempfile.gettempdir()) / f"comm_codec-tests-torch-extensions-{os.getuid()}"


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))


def _config(section, log_level=None):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 10_000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 0},
    }
    if section is not None:
        config["comm_codec"] = section
    if log_level is not None:
        config["log_level"] = log_level
    return config


def _w_silent(rank, world):
    deepspeed_first = "deepspeed" in sys.modules  # False: comm_codec was imported first
    join_deepspeed(rank, world)
    import deepspeed
    import torch
    from torch import nn

    import comm_codec.deepspeed as ccds

    ds_lines, our_lines = _Lines(), _Lines()
    deepspeed.utils.logger.addHandler(ds_lines)
    logging.getLogger("comm_codec").addHandler(our_lines)

    def train(build, section, steps=2, log_level=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
        before = (len(ds_lines.lines), len(our_lines.lines))
        engine, *_ = build(model=model, model_parameters=model.parameters(), config=_config(section, log_level))
        g = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            engine.backward(nn.functional.mse_loss(engine(torch.randn(4, 16, generator=g)), torch.randn(4, 4)))
            engine.step()
        if getattr(engine, "_comm_codec", None) is not None:
            engine._comm_codec.detach()  # its worker threads end here, not at interpreter exit
        return ds_lines.lines[before[0] :], our_lines.lines[before[1] :]

    out = {"deepspeed_first": deepspeed_first}
    section = {"mode": "always", "min_bytes": 0}
    out["plain"] = train(deepspeed.initialize, section, steps=3)
    out["plain_off"] = train(deepspeed.initialize, {"enabled": False})
    out["plain_none"] = train(deepspeed.initialize, None)
    out["plugin"] = train(ccds.initialize, section)
    comm_codec.set_verbosity("info")
    out["plugin_verbose"] = train(ccds.initialize, section)
    comm_codec.set_verbosity(None)
    out["plugin_ds_info"] = train(ccds.initialize, section, log_level="info")  # sets DeepSpeed's level: last
    return out


@pytest.fixture(scope="module")
def silent_run():
    if not HAVE_DEEPSPEED:
        pytest.skip("needs the deepspeed extra")
    from deepspeed.accelerator import get_accelerator

    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(EXTENSIONS_DIR)
    try:
        get_accelerator().create_op_builder("ShareMemCommBuilder").load()  # built once, outside the ranks
    finally:
        if saved is None:
            os.environ.pop("TORCH_EXTENSIONS_DIR", None)
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved
    env = {"TORCH_EXTENSIONS_DIR": str(EXTENSIONS_DIR), "DS_ACCELERATOR": "cpu", "NUMBA_NUM_THREADS": "2"}
    return dist_utils.run_fresh(_w_silent, 2, timeout=240, env=env)


def _ours(lines, level=None):
    return [m for lv, m in lines if "comm_codec" in m and (level is None or lv == level)]


def test_a_section_nobody_installs_warns_once_on_rank_0(silent_run):
    from comm_codec.core.logs import SILENT_SECTION

    assert silent_run[0]["deepspeed_first"] is False  # the hook went in as DeepSpeed loaded
    ds0, _ = silent_run[0]["plain"]
    assert [m for lv, m in ds0 if lv == "WARNING" and m == SILENT_SECTION] == [SILENT_SECTION]  # 3 steps, 1 line
    ds1, _ = silent_run[1]["plain"]
    assert SILENT_SECTION not in [m for _, m in ds1]


@pytest.mark.parametrize("case", ["plain_off", "plain_none", "plugin", "plugin_verbose", "plugin_ds_info"])
def test_no_warning_where_the_section_is_installed_disabled_or_absent(silent_run, case):
    from comm_codec.core.logs import SILENT_SECTION

    for res in silent_run:
        ds, ours = res[case]
        assert SILENT_SECTION not in [m for _, m in ds + ours]


def test_the_plugin_lines_follow_deepspeeds_log_level_or_comm_codecs_switch(silent_run):
    ds, ours = silent_run[0]["plugin"]  # DeepSpeed at its default WARNING, no switch: quiet
    assert _ours(ds, "INFO") == [] and _ours(ours, "INFO") == []
    ds, ours = silent_run[0]["plugin_verbose"]  # comm_codec.set_verbosity("info")
    assert any(m.startswith("comm_codec installed") for m in _ours(ours, "INFO")) and _ours(ds, "INFO") == []
    ds, ours = silent_run[0]["plugin_ds_info"]  # "log_level": "info": beside DeepSpeed's own lines
    assert any(m.startswith("comm_codec installed") for m in _ours(ds, "INFO")) and _ours(ours, "INFO") == []
    assert len([m for lv, m in ds if lv == "INFO" and "comm_codec" not in m]) > 0  # DeepSpeed's own show too
