"""The one logging switch: COMM_CODEC_VERBOSITY and comm_codec.set_verbosity."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import comm_codec as cc

pytestmark = pytest.mark.unit


@pytest.fixture
def quiet_again():
    yield
    cc.set_verbosity(None)


def test_set_verbosity_shows_the_codec_is_on_and_none_takes_it_back(capsys, quiet_again):
    from comm_codec.ddp import HuffmanState

    HuffmanState(mode="always")
    assert "HuffmanState: mode=always" not in capsys.readouterr().err  # a library is quiet by default
    cc.set_verbosity("info")
    HuffmanState(mode="always")
    assert "[comm_codec INFO] HuffmanState: mode=always, warmup_steps=0" in capsys.readouterr().err
    cc.set_verbosity(None)
    HuffmanState(mode="always")
    assert "HuffmanState: mode=always" not in capsys.readouterr().err
    assert logging.getLogger("comm_codec").handlers == []
    with pytest.raises(ValueError, match="verbosity 'loud'; allowed: debug, info, warning, error or None"):
        cc.set_verbosity("loud")


@pytest.mark.slow
def test_the_environment_variable_switches_it_on_at_import():
    code = "import comm_codec.ddp as d; d.HuffmanState(mode='never')"
    env = {"COMM_CODEC_VERBOSITY": "info", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert out.returncode == 0, out.stderr
    assert "[comm_codec INFO] HuffmanState: mode=never" in out.stderr


def test_every_integration_logs_the_same_fields():
    from comm_codec.comm.stats import LOGGED, TrafficStats, traffic_line

    line = traffic_line(TrafficStats())
    assert [part.split("=")[0] for part in line.split()] == list(LOGGED)
