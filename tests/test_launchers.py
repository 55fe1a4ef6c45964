"""The launchers run what the docs say: launch_scripts/run_ddp.sh, run_fsdp.sh and
run_deepspeed.sh in their multi-node form, as two local "nodes" on 127.0.0.1.

Each "node" is its own launcher command (its own torchrun agent), as on two machines; the
two meet at one rendezvous address and train a few steps of TinyLM together. ``torchrun``
on PATH is a shim for this interpreter's ``python -m torch.distributed.run``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
# A tiny run: 1 warmup step, then coded steps; the kernels come from numba's cache.
TRAIN = ["--steps", "3", "--warmup-steps", "1", "--batch", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def env(tmp_path):
    shim = tmp_path / "bin" / "torchrun"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m torch.distributed.run "$@"\n')
    shim.chmod(0o755)
    return dict(
        os.environ,
        PATH=f"{shim.parent}:{os.environ['PATH']}",
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        TORCH_EXTENSIONS_DIR=str(tmp_path / "torch_extensions"),
        GLOO_SOCKET_IFNAME="lo",
    )


def _two_nodes(script: str, rendezvous: list, extra: list, env: dict) -> list[str]:
    """Start the launcher once per "node" and return each node's output (both must exit 0)."""
    procs = [
        subprocess.Popen(
            [
                "bash",
                f"launch_scripts/{script}",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                *rendezvous,
                *extra,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            outputs.append(out)
    finally:
        for proc in procs:
            proc.kill()
    for node, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{out[-4000:]}"
    return outputs


def test_run_ddp_on_two_nodes_with_a_c10d_rendezvous(env):
    out = "".join(_two_nodes("run_ddp.sh", ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}"], TRAIN, env))
    assert "on 2 processes (gloo)" in out and "bit-identical on all 2 ranks" in out, out[-3000:]


def test_run_fsdp_on_two_nodes_with_a_static_master(env):
    out = "".join(
        _two_nodes("run_fsdp.sh", ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())], TRAIN, env)
    )
    assert "2 processes" in out and "bit-identical" in out, out[-3000:]


@pytest.mark.parametrize("stage", [3])
def test_run_deepspeed_on_two_nodes(env, stage):
    from test_deepspeed import torch_extensions_env

    with torch_extensions_env() as built:  # built once here, not by both "nodes" racing for it
        env.update(built)
    out = _two_nodes(
        "run_deepspeed.sh",
        ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}"],
        ["--steps", "3", "--zero-stage", str(stage), "--warmup-steps", "1", "--d-model", "64"],
        env,
    )
    out = "".join(out)
    assert f"2 ranks, ZeRO {stage}" in out and "wire ratio" in out, out[-3000:]


def test_launcher_options_are_checked_before_anything_starts():
    for argv, message in (
        (["--nnodes", "2", "--node-rank", "0"], "needs --rdzv-endpoint HOST:PORT or --master-addr"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "--node-rank 2 is not in 0..1"),
        (["--nnodes", "x"], "expected a number, got 'x'"),
        (["--rdzv-endpoint"], "--rdzv-endpoint needs a value"),
    ):
        res = subprocess.run(
            ["bash", "launch_scripts/run_ddp.sh", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 2 and message in res.stderr, (argv, res.stderr)
