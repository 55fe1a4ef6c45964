"""atheris fuzz target: the sized JSON reader (``comm_codec.core._json``), run by hand.

Not collected by pytest (no ``test_`` prefix). Each input is parsed as is, and again
inside a real codebook file and a real checkpoint index (``tests/crafted.py`` reseals
it). A finding is any exception other than the caller's error class (CodebookError,
CheckpointError, ValueError), a hang (-timeout), memory past -rss_limit_mb, or a parse
that held more than its estimate (tracemalloc's peak over :func:`estimate`).

    python tests/fuzz/fuzz_json.py -max_total_time=600 -rss_limit_mb=1024 -timeout=20 CORPUS_DIR
"""

import json
import sys
import tempfile
import tracemalloc

import atheris

with atheris.instrument_imports(include=["comm_codec.core._json"]):
    from comm_codec.core import _json

import comm_codec as cc

_DIR = tempfile.mkdtemp(prefix="cc-fuzz-json-")
_BOOKS = None


def _books() -> bytes:
    global _BOOKS
    if _BOOKS is None:
        cc.CodebookSet.default().save(f"{_DIR}/ok.json")
        with open(f"{_DIR}/ok.json", "rb") as fh:
            _BOOKS = fh.read()
    return _BOOKS


def TestOneInput(data: bytes):
    tracemalloc.start()
    try:
        _json.loads(data, error=ValueError, limit=64 << 20)
    except ValueError:
        pass
    else:
        _, peak = tracemalloc.get_traced_memory()
        if peak > _json.estimate(data):
            raise AssertionError(f"parse held {peak} bytes, estimate {_json.estimate(data)}")
    finally:
        tracemalloc.stop()
    # Inside a codebook file: the value of its "meta" key.
    text = _books().rstrip()[:-1] + b',"meta":' + data + b"}"
    with open(f"{_DIR}/b.json", "wb") as fh:
        fh.write(text)
    try:
        cc.CodebookSet.load(f"{_DIR}/b.json")
    except cc.CodebookError:
        pass
    try:
        json.loads(data.decode("utf-8"))  # the reference: any UTF-8 JSON it parses, the reader parses too
    except (ValueError, RecursionError):
        return
    if len(data) < 1 << 16 and _json.estimate(data) <= 64 << 20:
        _json.loads(data, error=ValueError, limit=64 << 20)


if __name__ == "__main__":
    atheris.Setup(sys.argv, TestOneInput)
    atheris.Fuzz()
