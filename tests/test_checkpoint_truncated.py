"""A checkpoint input that shrinks while the command line reads it: one line, exit 2, nothing left.

A mapped input would be killed by SIGBUS on its first access past the new end; the
readers read with ``pread`` and say the file changed.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from helpers import run_cli, start_cli

pytestmark = pytest.mark.cli


def _truncate_once_writing(proc, folder, victim, keep: int) -> bool:
    """Truncate ``victim`` to ``keep`` bytes once ``proc``'s temp output in ``folder`` has bytes
    (its input's index and layout are read by then, its data is being read); False if it
    ended first."""
    while proc.poll() is None:
        for name in os.listdir(folder):
            with contextlib.suppress(FileNotFoundError):
                if ".comm_codec-tmp." in name and os.path.getsize(folder / name) > 0:
                    os.truncate(victim, keep)
                    return True
        time.sleep(0.002)
    return False


@pytest.mark.parametrize("op", ["compress", pytest.param("decompress", marks=pytest.mark.slow)])
def test_cli_input_truncated_while_read_is_one_line_error(tmp_path, op):
    """A file that shrinks while it is read: exit 2 with one line, no temp file left (a mapped
    input would die of SIGBUS)."""
    rng = np.random.default_rng(0)
    src = tmp_path / "big.safetensors"
    save_file({f"w{i}": (rng.standard_normal(4 << 20, dtype=np.float32) * 0.02) for i in range(4)}, str(src))
    if op == "decompress":
        assert run_cli("compress", "big.safetensors", "big.cckp", cwd=tmp_path).returncode == 0
        src = tmp_path / "big.cckp"
    out = tmp_path / "out"
    out.mkdir()
    proc = start_cli(op, str(src), str(out / "x"), "--threads", "1", cwd=tmp_path)
    truncated = _truncate_once_writing(proc, out, src, os.path.getsize(src) // 3)
    _, err = proc.communicate(timeout=120)
    assert truncated, f"{op} ended before the input could be truncated: {err}"
    assert proc.returncode == 2, (proc.returncode, err)
    assert err.count("\n") == 1 and err.startswith("comm-codec: error: ") and "changed while it was being read" in err
    assert os.listdir(out) == []
