"""The exact checkpoint path runs without torch: each API call and command in a fresh interpreter.

compress, decompress, verify, ls (``describe``) and ``read_index`` of a safetensors file
and of a ``torch.save`` zip must leave ``torch`` out of ``sys.modules``. The files are real: a safetensors file written with safetensors' numpy API and a torch zip
written by torch.save in this (the test's) process.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from helpers import REPO

pytestmark = pytest.mark.cli

_CHILD = r"""
import json, sys
from comm_codec.checkpoint import compress_file, decompress_file, describe, read_index, verify_file
src, work = sys.argv[1:3]
calls = {
    "compress": lambda: compress_file(src, work + "/x.cckp", threads=1),
    "decompress": lambda: decompress_file(work + "/x.cckp", work + "/x.out", threads=1),
    "verify": lambda: verify_file(work + "/x.cckp", threads=1),
    "ls": lambda: describe(work + "/x.cckp"),
    "read_index": lambda: read_index(work + "/x.cckp"),
}
seen = {}
for op, call in calls.items():
    call()
    seen[op] = "torch" in sys.modules
print(json.dumps(seen))
"""


def _files(tmp_path):
    """A safetensors file and a torch zip of bf16 and fp32 tensors (a few chunks each)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    # 16 chunks of layers at different scales: big enough that the planner grows a group of books
    w32 = (rng.standard_normal((16, 1 << 16)) * np.logspace(-4, 0, 16)[:, None]).astype(np.float32).ravel()
    w16 = (w32.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits
    st = tmp_path / "m.safetensors"
    save_file({"w32": w32, "small": w32[:100].copy()}, str(st))
    pt = tmp_path / "m.pt"
    torch.save(
        {
            "model": {"w32": torch.from_numpy(w32), "w16": torch.from_numpy(w16.view(np.int16)).view(torch.bfloat16)},
            "step": 3,
        },
        pt,
    )
    return {"safetensors": st, "torch_zip": pt}


@pytest.mark.parametrize("fmt", ["safetensors", pytest.param("torch_zip", marks=pytest.mark.slow)])
def test_checkpoint_calls_do_not_import_torch(tmp_path, fmt):
    src = _files(tmp_path)[fmt]
    # one fresh interpreter runs every call in turn (each interpreter start imports numba)
    r = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert not any(seen.values()), f"these calls on a {fmt} file imported torch: {seen}"
    assert (tmp_path / "x.out").read_bytes() == src.read_bytes()


@pytest.mark.slow
def test_checkpoint_commands_do_not_import_torch(tmp_path):
    # The command line as a user runs it; -X importtime lists every module each command loads.
    src = _files(tmp_path)["safetensors"]
    cckp, out = tmp_path / "c.cckp", tmp_path / "c.out"
    for args in (
        ["compress", "-q", src, cckp],
        ["decompress", "-q", cckp, out],
        ["verify", cckp],
        ["ls", cckp],
        ["inspect", cckp],
    ):
        r = subprocess.run(
            [sys.executable, "-X", "importtime", "-m", "comm_codec", *map(str, args)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, (args[0], r.stderr[-2000:])
        imported = {
            line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")
        }
        assert "torch" not in imported, f"comm-codec {args[0]} imported torch"
    assert out.read_bytes() == src.read_bytes()
