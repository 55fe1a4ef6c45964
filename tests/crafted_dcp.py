"""Craft hostile DCP inputs: metadata pickles that grow, torch.save records that inflate, chunks that repeat.

Everything is generated here from a few bytes of Python (no binaries in the repository).
Used by tests/test_dcp_untrusted.py and tests/fuzz/fuzz_dcp.py.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def doubling_pickle(module: str, name: str, levels: int = 26, seed: bytes = b"X\x01\x00\x00\x00a") -> bytes:
    """A pickle that calls module.name(x, x) on its own result ``levels`` times, 10 bytes a level.

    With ``pathlib.PosixPath`` (which concatenates its parts) 26 levels make a path of
    2^26 parts from ~300 bytes: the round-3 report's ``.metadata``.
    """
    out = bytearray(b"\x80\x02" + _global(module, name) + b"q\x00" + seed + b"q\x01")
    for _ in range(levels):
        out += b"h\x00" + b"h\x01h\x01" + b"\x86" + b"R" + b"q\x01"  # BINGET 0, (x, x), REDUCE, BINPUT 1
    return bytes(out + b".")


def copying_pickle(module: str, name: str, items: int = 1 << 16, copies: int = 1 << 16) -> bytes:
    """A pickle that builds one tuple of ``items`` ints, then calls module.name(that tuple) ``copies`` times.

    A constructor that copies its argument (``torch.Size``, ``OrderedDict``) turns
    ~4 bytes of pickle into a copy of the whole tuple each time.
    """
    out = bytearray(b"\x80\x02" + _global(module, name) + b"q\x00(")
    out += b"K\x01" * items
    out += b"tq\x01"
    # a list holding every copy, so none is freed
    out += b"]q\x02"
    for _ in range(copies):
        out += b"h\x02h\x00h\x01\x85Ra"  # list, callable, (tuple,), REDUCE, APPEND
    return bytes(out + b".")


def deflated_torch_record(pickle_bytes: bytes) -> bytes:
    """A torch.save-like zip whose ``data.pkl`` is deflated (torch.save itself stores every member)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        zf.writestr("archive/data.pkl", pickle_bytes)
        zf.writestr("archive/byteorder", b"little", compress_type=zipfile.ZIP_STORED)
        zf.writestr("archive/version", b"3\n", compress_type=zipfile.ZIP_STORED)
    return buf.getvalue()


def stored_torch_record(pickle_bytes: bytes) -> bytes:
    """The same, every member stored (as torch.save writes them)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("archive/data.pkl", pickle_bytes)
        zf.writestr("archive/byteorder", b"little")
        zf.writestr("archive/version", b"3\n")
    return buf.getvalue()


def slow_pickle(nbytes: int) -> bytes:
    """A valid pickle of a list of ones, nbytes long at most: one opcode per 2 bytes (weights-only
    unpicklers read them in pure Python, a few hundred thousand a second)."""
    n = max(0, (nbytes - 6) // 2)
    return b"\x80\x02](" + b"K\x01" * n + b"e."


def read_metadata(path):
    with open(os.path.join(path, ".metadata"), "rb") as fh:
        return pickle.load(fh)  # the tests' own files


def write_metadata(path, md) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as fh:
        pickle.dump(md, fh)


def point_value_at(path, fqn: str, record: bytes) -> None:
    """Append record to the data file of fqn's value and point its storage record there (plain DCP: no trailer)."""
    md = read_metadata(path)
    index = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[index]
    data = os.path.join(path, info.relative_path)
    info.offset = os.path.getsize(data)
    info.length = len(record)
    with open(data, "ab") as fh:
        fh.write(record)
    write_metadata(path, md)


__all__ = [
    "copying_pickle",
    "deflated_torch_record",
    "doubling_pickle",
    "point_value_at",
    "read_metadata",
    "slow_pickle",
    "stored_torch_record",
    "write_metadata",
]
