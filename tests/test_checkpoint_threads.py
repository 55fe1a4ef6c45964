"""The checkpoint path's worker threads leave numba's threading layer alone.

No kernel is compiled with ``parallel=True`` (threads share chunks through
comm_codec.core.parallel), so nothing needs numba's threading layer: starting it loads an
OpenMP or TBB runtime (a fork hazard) and its pool, for no use.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

_SCRIPT = textwrap.dedent("""
    import sys, torch
    from numba.np.ufunc import parallel
    from comm_codec import checkpoint

    d = sys.argv[1]
    g = torch.Generator().manual_seed(0)
    torch.save({"w": torch.randn(300, 500, generator=g).to(torch.bfloat16), "b": torch.randn(4000, generator=g)},
               f"{d}/a.pt")
    checkpoint.compress_file(f"{d}/a.pt", f"{d}/a.cc", threads=2, progress=False)
    checkpoint.decompress_file(f"{d}/a.cc", f"{d}/a.out", threads=2, progress=False)
    assert open(f"{d}/a.pt", "rb").read() == open(f"{d}/a.out", "rb").read()
    print("THREADING LAYER STARTED", parallel._is_initialized)
""")


def test_checkpoint_threads_do_not_start_numbas_threading_layer(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=tmp_path
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "THREADING LAYER STARTED False" in run.stdout, run.stdout
