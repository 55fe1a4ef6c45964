"""atheris fuzz target: the torch pickle scanner and the zip layout reader, run by hand.

Not collected by pytest. Each input is a ``data.pkl`` (scanned directly, and inside a
torch-like zip given to ``find_tensors``). The scanner never runs a pickle; its parse
errors are handled by its caller (the storages stay opaque), so a finding is a hang
(-timeout), memory past -rss_limit_mb, an exception ``find_tensors`` lets out, or a
storage claimed outside the file.

    python tests/fuzz/fuzz_pickle.py -max_total_time=600 -rss_limit_mb=1024 -timeout=20 CORPUS_DIR
"""

import os
import sys
import tempfile

import atheris

import comm_codec.books.profiler  # noqa: E402,F401

# The codec and its numba kernels first, uninstrumented: numba cannot compile atheris's
# branch hooks. Only the checkpoint package (the parsers under test) is instrumented.
import comm_codec.core.codec  # noqa: E402,F401

with atheris.instrument_imports(include=["comm_codec.checkpoint"]):
    from comm_codec.checkpoint import formats, pickle_scan
    from comm_codec.checkpoint.files import FileMap

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import crafted  # noqa: E402

_DIR = tempfile.mkdtemp(prefix="cc-fuzz-pkl-")


def TestOneInput(data: bytes):
    try:
        pickle_scan.scan_torch_pickle(data, formats.itemsize)
    except Exception:  # noqa: BLE001 - any parse failure is handled by the caller
        pass
    path = f"{_DIR}/x.pt"
    with open(path, "wb") as fh:
        fh.write(crafted.torch_zip(data, {"0": bytes(64), "1": bytes(4096)}))
    m = FileMap(path)
    try:
        fmt, tensors = formats.find_tensors(m)
        for t in tensors:
            assert 0 <= t.offset and t.offset + t.nbytes <= m.size, (t.offset, t.nbytes, m.size)
    finally:
        m.close()


if __name__ == "__main__":
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
