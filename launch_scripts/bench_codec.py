"""Benchmark the codec: ratio, bounds and GB/s beside zstd, bz2, zipnn and huff0.

``comm-codec bench`` (:func:`comm_codec.tools.bench.run`) plus the huff0 rows of
``launch_scripts/huff0.py`` where ``launch_scripts/build_huff0.sh`` has built the library;
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

from comm_codec.tools.bench import run  # noqa: E402

import huff0  # noqa: E402  (launch_scripts/huff0.py, beside this script)

if __name__ == "__main__":
    sys.exit(run(extra=huff0.comparators))
