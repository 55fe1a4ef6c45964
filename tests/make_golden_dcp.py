"""Write the golden ``comm_codec.dcp`` directories that pin the DCP data file format.

``tests/data/golden/dcp_v1/``: a directory whose data file names the shipped books by id
only (book table version 1, written before data files held every book they use);
``tests/data/golden/dcp_v2/``: the same state dict as today's Writer stores it (every
book in the file). Both were written with the small book set
``tests/data/golden/dcp_books.json`` (made here from a seeded profile) standing in for the
shipped books, so that the fixtures stay readable whatever ``codebooks/default.json``
becomes. The inputs come from a seeded numpy generator, identically here and in
``tests/test_dcp_golden.py``; only the written bytes are committed. Rerun only when a
format change is intended, and say so in the commit:

    python tests/make_golden_dcp.py v2      # (v1 was written by the code before books were stored)
"""

from __future__ import annotations

import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "golden")
BOOKS = os.path.join(OUT, "dcp_books.json")


def state_dict() -> dict:
    """The deterministic state dict of the DCP goldens (coded, packed, plain and non-tensor items)."""
    import torch

    rng = np.random.default_rng(49)

    def bf16(n, scale):
        return torch.from_numpy((rng.standard_normal(n) * scale).astype(np.float32)).to(torch.bfloat16)

    big = bf16(128 * 160, 0.02).view(128, 160)  # planned: books of its own
    big.view(-1).view(torch.int16)[:4] = torch.tensor(
        [0x7FC0, 0x7F80, -32768, 1], dtype=torch.int16
    )  # NaN, Inf, -0, subnormal
    return {
        "model": {
            "layer.0.weight": big,
            "layer.0.bias": bf16(160, 0.01),
            "norm.weight": bf16(160, 1.0) + 1,
            "scale": torch.from_numpy(rng.standard_normal(50).astype(np.float32)),
        },
        "optim": {"state": {"0.exp_avg": bf16(160, 1e-4), "0.step": torch.tensor(12.0)}},
        "counts": torch.from_numpy(rng.integers(-5, 5, size=33).astype(np.int64)),
        "mask": torch.from_numpy(rng.integers(0, 2, size=17).astype(bool)),
        "meta": {"epoch": 3, "name": "golden"},
    }


def books():
    """The small deterministic book set the goldens were written with (weights and optimizer state)."""
    import torch

    import comm_codec as cc

    rng = np.random.default_rng(7)
    prof = cc.WarmupProfiler(chunk_elems=1024)
    for _ in range(3):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.from_numpy((rng.standard_normal(8192) * 0.03).astype(np.float32)).to(dtype)
            prof.observe(x, kind="weight")
            prof.observe(x * 1e-3, kind="optimizer_state")
    return prof.build()


def main(version: str) -> int:
    import torch.distributed.checkpoint as dcp

    import comm_codec as cc
    import comm_codec.dcp as ccd

    if not os.path.exists(BOOKS):
        books().save(BOOKS)
    target = os.path.join(OUT, f"dcp_{version}")
    os.makedirs(target, exist_ok=True)
    here = os.getcwd()
    os.chdir(OUT)  # the metadata records the path it was given: a relative one
    try:
        dcp.save(state_dict(), storage_writer=ccd.Writer(f"dcp_{version}", codebooks=cc.CodebookSet.load(BOOKS)))
    finally:
        os.chdir(here)
    print("wrote", target, sorted(os.listdir(target)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "v2"))
