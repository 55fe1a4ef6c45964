"""Craft hostile checkpoint inputs whose checksums still hold, so edits reach the parsers.

A corrupted byte is caught by a CRC long before any parser sees it; a red team recomputes
the CRCs. These helpers do the same for our own containers (edit the JSON index or a
segment, then reseal: zstd, CRC-32 and trailer) and build torch-like zips around any
pickle bytes. Used by tests/test_untrusted.py and the atheris targets in tests/fuzz/.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import sys
import time
import zipfile
import zlib

import zstandard

HEADER = struct.Struct("<8sHHI")
TRAILER = struct.Struct("<QQIHH8s")


class Container:
    """A comm_codec container (exact or lossy) opened for editing: payload bytes and index."""

    def __init__(self, data: bytes):
        off, length, _crc, self.version, self.flags, self.magic = TRAILER.unpack(data[-TRAILER.size :])
        blob = data[off : off + length]
        if self.flags & 1:
            blob = zstandard.ZstdDecompressor().decompressobj().decompress(blob)
        self.index = json.loads(blob)
        self.body = bytearray(data[:off])  # header + payload

    @classmethod
    def read(cls, path) -> Container:
        with open(path, "rb") as fh:
            return cls(fh.read())

    def seal(self, index_bytes: bytes | None = None) -> bytes:
        """Return the file: body, index (this JSON, or raw ``index_bytes``), fresh CRC and trailer."""
        text = json.dumps(self.index, separators=(",", ":")).encode() if index_bytes is None else index_bytes
        blob = zstandard.ZstdCompressor(level=3).compress(text)
        return (
            bytes(self.body)
            + blob
            + TRAILER.pack(len(self.body), len(blob), zlib.crc32(blob), self.version, 1, self.magic)
        )

    def write(self, path, **kw) -> None:
        with open(path, "wb") as fh:
            fh.write(self.seal(**kw))

    def put_segment(self, k: int, payload: bytes) -> None:
        """Replace exact segment k's coded bytes in place (same length) and reseal its CRC."""
        seg = self.index["segments"][k]
        off, length = seg[2], seg[3]
        assert len(payload) == length, (len(payload), length)
        self.body[off : off + length] = payload
        if seg[4] != "frame":
            seg[5] = zlib.crc32(payload)


def zstd_with_claimed_size(data: bytes, claimed: int) -> bytes:
    """A zstd frame of ``data`` whose header declares ``claimed`` content bytes."""
    frame = bytearray(zstandard.ZstdCompressor(level=1, write_content_size=True).compress(data))
    # Frame header descriptor (byte 4): FCS flag in bits 6-7; rewrite with an 8-byte size.
    fhd = frame[4]
    single = (fhd >> 5) & 1
    fcs_code = fhd >> 6
    fcs_len = (1, 2, 4, 8)[fcs_code] if (fcs_code or single) else 0
    did_len = (0, 1, 2, 4)[fhd & 3]
    wd_len = 0 if single else 1
    start = 5 + wd_len + did_len
    new_fhd = (fhd & 0x3F) | (3 << 6)
    return (
        bytes(frame[:4])
        + bytes([new_fhd])
        + bytes(frame[5:start])
        + struct.pack("<Q", claimed)
        + bytes(frame[start + fcs_len :])
    )


def torch_zip(
    pickle_bytes: bytes, records: dict | None = None, compress_pickle: bool = False, extra: dict | None = None
) -> bytes:
    """A torch.save-like zip: archive/data.pkl (deflated if asked), archive/data/<key> stored."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(
            zipfile.ZipInfo("archive/data.pkl"),
            pickle_bytes,
            compress_type=zipfile.ZIP_DEFLATED if compress_pickle else zipfile.ZIP_STORED,
        )
        for key, data in (records or {}).items():
            zf.writestr(f"archive/data/{key}", data)
        for name, (data, deflate) in (extra or {}).items():
            zf.writestr(
                zipfile.ZipInfo(name), data, compress_type=zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
            )
    return buf.getvalue()


def nested_lists_pickle(depth: int) -> bytes:
    """Protocol-2 pickle of ``depth`` nested one-element lists: ``[[[...]]]``."""
    return b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b"."


def many_ints_pickle(count: int) -> bytes:
    """Protocol-2 pickle of one list of ``count`` small ints, appended in batches of 1000."""
    out = bytearray(b"\x80\x02]")
    batch = b"(" + b"K\x01" * 1000 + b"e"
    for _ in range(count // 1000):
        out += batch
    return bytes(out + b".")


def deep_json(depth: int) -> bytes:
    """JSON nested ``depth`` levels deep."""
    return b"[" * depth + b"]" * depth


def padded_index(data: bytes, chars: int, astral: bool = True) -> bytes:
    """A real container whose index gains ``"pad": "😀aaa..."`` (``chars`` characters), resealed.

    One astral character makes Python hold the whole string at 4 bytes per character:
    a few kB of zstd that parse into GBs unless the reader sizes the text first.
    """
    c = Container(data)
    c.index["pad"] = ("\U0001f600" if astral else "a") + "a" * (chars - 1)
    return c.seal(index_bytes=json.dumps(c.index, separators=(",", ":"), ensure_ascii=False).encode())


def padded_json(text: bytes, nbytes: int) -> bytes:
    """A JSON object's text with ``"pad": [{},{},...]`` added, ``nbytes`` long in all (millions of dicts)."""
    head = text.rstrip()[:-1] + b',"pad":['
    count = max(1, (nbytes - len(head) - 2) // 3)
    return head + b"{}," * (count - 1) + b"{}]}"


# -- running the command line on crafted inputs, one process for many cases ---------------
class _Sink:
    """A stream whose target changes per case (logging binds its stream once)."""

    target = io.StringIO()

    def write(self, text):
        return self.target.write(text)

    def flush(self):
        pass

    def isatty(self):
        return False


def _hwm_kb() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))


def run_cases(cases: list, allowed_roots: list) -> list:
    """Run ``comm_codec.tools.cli.main(argv)`` for each case; return what each did.

    Per case: exit status, stderr text, wall seconds, peak RSS in MB (VmHWM, reset before
    the case through /proc/self/clear_refs) and the paths opened outside ``allowed_roots``
    and the case's own named paths (seen by an audit hook on ``open``).
    """
    import logging

    from comm_codec.tools import cli

    opened = []

    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            opened.append(os.fsdecode(args[0]))

    sys.addaudithook(hook)
    sink = _Sink()
    logging.basicConfig(level=logging.INFO, stream=sink, format="%(levelname)s %(name)s: %(message)s")
    results = []
    for argv in cases:
        sink.target = io.StringIO()
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        del opened[:]
        start = time.perf_counter()
        out = io.StringIO()
        with contextlib.redirect_stderr(sink), contextlib.redirect_stdout(out):
            try:
                rc = cli.main(argv)
            except SystemExit as exc:  # argparse
                rc = exc.code
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                import traceback

                sink.write("Traceback (uncaught)\n" + "".join(traceback.format_exception(exc)))
                rc = -1
        seconds = time.perf_counter() - start
        named = {os.path.abspath(a) for a in argv if os.path.sep in a}
        foreign = sorted(
            {
                p
                for p in map(os.path.abspath, opened)
                if p not in named and not any(p.startswith(r) for r in allowed_roots)
            }
        )
        results.append(
            {
                "argv": argv,
                "rc": rc,
                "stderr": sink.target.getvalue(),
                "seconds": seconds,
                "rss_mb": _hwm_kb() / 1024,
                "foreign": foreign,
            }
        )
    return results


if __name__ == "__main__":
    # python tests/crafted.py CASES.json RESULTS.json: [[argv...], ...] -> results
    spec = json.load(open(sys.argv[1]))
    json.dump(run_cases(spec["cases"], spec["allowed"]), open(sys.argv[2], "w"))
