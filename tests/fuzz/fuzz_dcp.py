"""atheris fuzz target: the DCP reader (comm_codec.dcp.Reader, Reader.verify), run by hand.

Not collected by pytest (no ``test_`` prefix). A real directory is written once (frames,
a pack frame, int64 and bool tensors stored as DCP stores them, a non-tensor value);
each input then replaces one of its files, chosen by the first byte: the ``.metadata``
pickle; the data file; or the data file's first bytes (its items) under the real book
table, resealed (trailer offset and CRC-32 recomputed, so edits reach the frame and
``torch.save`` record parsers). Then the directory is loaded and verified. A finding
is any exception other than CheckpointError, a hang (-timeout), memory past
-rss_limit_mb, or a file written outside the directory.

    python tests/fuzz/fuzz_dcp.py --seeds CORPUS_DIR    # once: the real files, one per mode
    python tests/fuzz/fuzz_dcp.py -max_total_time=600 -rss_limit_mb=1024 -timeout=20 CORPUS_DIR
"""

import os
import shutil
import struct
import sys
import tempfile
import warnings
import zlib

import atheris

# The codec and its numba kernels first, uninstrumented: numba cannot compile atheris's
# branch hooks. Only the checkpoint package (the parsers under test) is instrumented.
import comm_codec.books.profiler  # noqa: E402,F401
import comm_codec.core.codec  # noqa: E402,F401
import comm_codec.kernels.plan  # noqa: E402,F401  (the planner's kernels: the writer plans each tensor)

with atheris.instrument_imports(include=["comm_codec.checkpoint"]):
    from comm_codec.checkpoint import dcp as ccd
    from comm_codec.core.errors import CheckpointError

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

warnings.simplefilter("ignore")
_ROOT = tempfile.mkdtemp(prefix="cc-fuzz-dcp-")
_GOOD = os.path.join(_ROOT, "good")
_WORK = os.path.join(_ROOT, "work")
torch.manual_seed(0)
_SD = {
    "w": (torch.randn(200, 100) * 0.02).to(torch.bfloat16),
    "b": torch.randn(64),
    "n": torch.arange(100),
    "m": torch.arange(20) % 2 == 0,
    "step": 5,
}
dcp.save(_SD, storage_writer=ccd.Writer(_GOOD))
_TRAILER = struct.Struct("<8sQQII")


def _target():
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in _SD.items()}


def _reseal(items: bytes, table: bytes) -> bytes:
    return items + table + _TRAILER.pack(b"CCDCPBK2", len(items), len(table), zlib.crc32(table), 0)


def TestOneInput(data: bytes):
    if not data:
        return
    shutil.rmtree(_WORK, ignore_errors=True)
    shutil.copytree(_GOOD, _WORK)
    how, body = data[0] % 3, data[1:]
    distcp = os.path.join(_WORK, "__0_0.distcp")
    if how == 0:
        with open(os.path.join(_WORK, ".metadata"), "wb") as fh:
            fh.write(body)
    elif how == 1:
        with open(distcp, "wb") as fh:
            fh.write(body)
    else:
        with open(distcp, "rb") as fh:
            good = fh.read()
        _, offset, length, _, _ = _TRAILER.unpack(good[-_TRAILER.size :])
        with open(distcp, "wb") as fh:  # new items before the real (resealed) book table
            fh.write(_reseal(body[:offset] + good[len(body[:offset]) : offset], good[offset : offset + length]))
    before = set(os.listdir(_ROOT))
    for call in (lambda: ccd.load(_target(), _WORK), lambda: ccd.Reader(_WORK).verify()):
        try:
            call()
        except CheckpointError:
            pass
    assert set(os.listdir(_ROOT)) == before, "a file written outside the checkpoint directory"


def _write_seeds(folder: str) -> None:
    """One seed per mode, from the real directory: its .metadata, its data file, its items."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(_GOOD, ".metadata"), "rb") as fh:
        metadata = fh.read()
    with open(os.path.join(_GOOD, "__0_0.distcp"), "rb") as fh:
        data = fh.read()
    offset = _TRAILER.unpack(data[-_TRAILER.size :])[1]
    for mode, body in enumerate((metadata, data, data[:offset])):
        with open(os.path.join(folder, f"seed{mode}"), "wb") as fh:
            fh.write(bytes([mode]) + body)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--seeds":
        _write_seeds(sys.argv[2])
        sys.exit(0)
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
