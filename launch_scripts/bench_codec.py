"""Benchmark the codec: ratio, bounds and GB/s beside zstd, bz2 and zipnn.

A thin wrapper around :func:`comm_codec.tools.bench.run` (the same as ``comm-codec bench``);
see that module for what is measured and how.

Usage (from the repository root; a few minutes, --quick under one)::

    python launch_scripts/bench_codec.py [--quick] [--json bench.json]
"""

from __future__ import annotations

import os
import sys

try:
    import comm_codec  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from comm_codec.tools.bench import run

if __name__ == "__main__":
    sys.exit(run())
