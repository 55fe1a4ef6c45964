"""The exact checkpoint path runs without torch: each API call in a fresh interpreter.

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

_CHILD = r"""
import json, sys
from comm_codec.checkpoint import compress_file, decompress_file, describe, read_index, verify_file
op, src, work = sys.argv[1:4]
if op == "compress":
    compress_file(src, work + "/x.cckp", threads=1)
elif op == "decompress":
    decompress_file(work + "/ref.cckp", work + "/x.out", threads=1)
elif op == "verify":
    verify_file(work + "/ref.cckp", threads=1)
elif op == "ls":
    describe(work + "/ref.cckp")
elif op == "read_index":
    read_index(work + "/ref.cckp")
print(json.dumps({"torch": "torch" in sys.modules}))
"""


def _files(tmp_path):
    """A safetensors file and a torch zip of bf16 and fp32 tensors (a few chunks each)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    w32 = (rng.standard_normal(150_000) * 0.02).astype(np.float32)
    w16 = (w32.view(np.uint32) >> 16).astype(np.uint16)  # bf16 bits
    st = tmp_path / "m.safetensors"
    save_file({"w32": w32, "small": w32[:100].copy()}, str(st))
    pt = tmp_path / "m.pt"
    torch.save({"model": {"w32": torch.from_numpy(w32), "w16": torch.from_numpy(w16.view(np.int16)).view(
        torch.bfloat16)}, "step": 3}, pt)
    return {"safetensors": st, "torch_zip": pt}


@pytest.mark.parametrize("fmt", ["safetensors", "torch_zip"])
def test_checkpoint_calls_do_not_import_torch(tmp_path, fmt):
    src = _files(tmp_path)[fmt]
    from comm_codec.checkpoint import compress_file

    compress_file(src, tmp_path / "ref.cckp", threads=1)
    for op in ("compress", "decompress", "verify", "ls", "read_index"):
        r = subprocess.run([sys.executable, "-c", _CHILD, op, str(src), str(tmp_path)], cwd=REPO,
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (op, r.stderr)
        seen = json.loads(r.stdout.strip().splitlines()[-1])
        assert seen["torch"] is False, f"{op} of a {fmt} file imported torch"
    assert (tmp_path / "x.out").read_bytes() == src.read_bytes()
