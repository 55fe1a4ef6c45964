"""Find the tensors inside a checkpoint file without running any of its code.

Used by the exact and lossy formats. safetensors headers are parsed as JSON; torch
``.pt``/``.bin`` zip files are read from their zip layout, and their ``data.pkl`` is
*scanned* opcode by opcode (:mod:`.pickle_scan`; nothing is imported or called) to learn
each storage's dtype and the tensor names that point into it. Whatever is not understood
is left to the caller as opaque bytes. :func:`zip_crc_fields` says where a zip record's
CRC-32 is stored, for writers that replace a record's bytes; :func:`storage_keys` which
record holds which storage.
"""

from __future__ import annotations

import dataclasses
import math
import logging
import re
import struct
import zipfile

from typing import TYPE_CHECKING

from ..core.streams import SUPPORTED_NAMES, spec_for
from .container import parse_json
from .pickle_scan import scan_torch_pickle

if TYPE_CHECKING:
    from ..core.codec import Codec
    from .files import FileMap

__all__ = ["CODABLE", "CODABLE_NAMES", "FileTensor", "find_tensors", "itemsize", "is_int", "zip_crc_fields", "storage_keys"]

log = logging.getLogger("comm_codec.checkpoint")

# The dtype names ("bfloat16") the codec codes; spec_for takes them as they are.
CODABLE_NAMES = frozenset(SUPPORTED_NAMES)


def __getattr__(name: str):
    # CODABLE (dtype name -> torch dtype) imports torch when first read, for the callers
    # that make tensors; the exact format needs only CODABLE_NAMES and spec_for.
    if name == "CODABLE":
        return {n: spec_for(n).dtype for n in SUPPORTED_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
_MAX_PICKLE_BYTES = 64 << 20  # torch.save writes ~100 bytes per tensor
_MAX_BYTEORDER_BYTES = 16
_MAX_NAME = 4096


def itemsize(dtype: str) -> int | None:
    """Return the bytes per element of a codable dtype name ("bfloat16"), None for any other."""
    return spec_for(dtype).itemsize if dtype in CODABLE_NAMES else None


def is_int(x, lo=0, hi=1 << 62) -> bool:
    """Return whether x is an int (not a bool) from lo to hi."""
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


# -- finding tensors ------------------------------------------------------------------------
@dataclasses.dataclass
class FileTensor:
    """One tensor's bytes in a file."""

    name: str
    dtype: str  # torch dtype name ("bfloat16"); the file's own name when torch has none
    shape: list | None
    offset: int
    nbytes: int
    kind: str = "weight"
    codable: bool = False
    # set by the planner
    coding: str = "opaque"
    transform: str = "none"
    base_offset: int | None = None
    books: list | None = None
    chunk_elems: int | None = None
    codec: Codec | None = None
    # [name, shape] of each state-dict entry on this storage, where several share it
    entries: list | None = None

    @property
    def spec(self):
        return spec_for(self.dtype)

    def record(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": self.shape, "offset": self.offset,
                "nbytes": self.nbytes, "kind": self.kind, "coding": self.coding,
                "transform": self.transform, "base_offset": self.base_offset, "books": self.books,
                "chunk_elems": self.chunk_elems, **({"entries": self.entries} if self.entries else {})}


_OPTIMIZER_NAME = re.compile(r"exp_avg|momentum|optim|(^|[./])state([./]|$)", re.IGNORECASE)


def _guess_kind(name: str) -> str:
    return "optimizer_state" if _OPTIMIZER_NAME.search(name) else "weight"


def find_tensors(m: FileMap) -> tuple[str, list[FileTensor]]:
    """Return the file's format and its tensors, sorted by offset, never overlapping."""
    head = bytes(m.u8(0, min(m.size, 9)))
    found, fmt = [], "generic"
    # Any failure to parse means "not this format": the bytes are then coded opaquely,
    # which is always correct. Input is untrusted, so the net is deliberately wide.
    try:
        if len(head) == 9 and head[8:9] == b"{":
            found, fmt = _safetensors_tensors(m), "safetensors"
        elif head[:4] == b"PK\x03\x04":
            found, fmt = _torch_zip_tensors(m), "torch_zip"
    except Exception as exc:  # noqa: BLE001
        log.debug("%s: not parsed as a checkpoint (%s: %s); coding it as opaque bytes",
                  m.path, type(exc).__name__, exc)
        found, fmt = [], "generic"
    kept, end = [], 0
    for t in sorted(found, key=lambda t: (t.offset, t.nbytes)):
        if t.nbytes <= 0 or t.offset < end or t.offset + t.nbytes > m.size:
            continue
        if t.codable and t.nbytes % t.spec.itemsize:
            t.codable = False
        if len(t.name) > _MAX_NAME or len(t.dtype) > 64:  # names from the file: keep the index readable
            t.name, t.dtype = t.name[:_MAX_NAME] + "...", t.dtype[:60]
        kept.append(t)
        end = t.offset + t.nbytes
    return fmt, kept


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
              "U16": "uint16", "U32": "uint32", "U64": "uint64"}


def _safetensors_tensors(m: FileMap) -> list[FileTensor]:
    """Parse a safetensors header: u64 length, JSON {name: {dtype, shape, data_offsets}}."""
    (hlen,) = struct.unpack("<Q", bytes(m.u8(0, 8)))
    if hlen > min(m.size - 8, 100 << 20):
        raise ValueError(f"header length {hlen} exceeds the file")
    header = parse_json(bytes(m.u8(8, hlen)), m.path, "safetensors header")  # sized before parsing
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    start = 8 + hlen
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        shape = info["shape"]
        if not (isinstance(begin, int) and isinstance(end, int) and isinstance(shape, list)
                and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError(f"tensor {name!r}: malformed entry")
        dtype = _ST_DTYPES.get(info["dtype"], str(info["dtype"]))
        # Exact integers: a shape whose product wraps int64 must not pass for the size. A
        # shape no reader could take (dims past 2^62, 64+ dims) is not recorded at all.
        if len(shape) > 64 or any(d > 1 << 62 for d in shape) or math.prod(shape) > 1 << 62:
            shape = None
        t = FileTensor(str(name), dtype, shape, start + begin, end - begin, _guess_kind(str(name)))
        if dtype in CODABLE_NAMES and shape is not None:
            t.codable = math.prod(shape) * t.spec.itemsize == t.nbytes
        out.append(t)
    return out


def _torch_zip_tensors(m: FileMap) -> list[FileTensor]:
    """Find the storages of a ``torch.save`` zip from its layout and its pickle's opcodes."""
    with open(m.path, "rb") as fh, zipfile.ZipFile(fh) as zf:
        infos = zf.infolist()
        pickles = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
        if len(pickles) != 1:
            raise ValueError(f"{len(pickles)} data.pkl entries, expected 1")
        prefix = pickles[0].filename[: -len("data.pkl")]
        storages = {}
        data = _read_member(zf, pickles[0], _MAX_PICKLE_BYTES)
        if data is not None:
            try:
                storages = scan_torch_pickle(data, itemsize)
            except Exception as exc:  # noqa: BLE001 - an unreadable pickle: storages stay opaque
                log.debug("%s: pickle not understood (%s); its storages are coded as opaque bytes", m.path, exc)
        del data
        order = next((i for i in infos if i.filename == prefix + "byteorder"), None)
        # Read only a size a byte order can have ("little"): the entry is untrusted.
        little = order is None or _read_member(zf, order, _MAX_BYTEORDER_BYTES) == b"little"
    out = []
    for info in infos:
        if not info.filename.startswith(prefix + "data/") or info.compress_type != zipfile.ZIP_STORED:
            continue
        if info.flag_bits & 0x1:  # encrypted
            continue
        key = info.filename[len(prefix + "data/"):]
        h = info.header_offset
        local = bytes(m.u8(h, 30)) if h + 30 <= m.size else b""
        if local[:4] != b"PK\x03\x04":
            continue
        nlen, xlen = struct.unpack_from("<HH", local, 26)
        offset = h + 30 + nlen + xlen
        dtype, name, nbytes, shape, entries = storages.get(key, (None, None, None, None, None))
        t = FileTensor(name or f"storage/{key}", dtype or "unknown", shape, offset, info.compress_size,
                    _guess_kind(name or ""))
        t.entries = entries
        t.codable = (little and dtype in CODABLE_NAMES and info.compress_size == info.file_size == nbytes)
        out.append(t)
    return out


# Zip methods whose members are inflated in bounded pieces: zipfile hands deflate a cap
# on its output per call, but inflates a bzip2 or LZMA member's compressed bytes in one
# call, whatever the member claims (18 kB of bzip2 make 1 GiB).
_BOUNDED_METHODS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
_READ_STEP = 1 << 20


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int) -> bytes | None:
    """Return a zip member's bytes, or None when it is encrypted, of another method than
    stored or deflate, or larger than ``limit`` (declared or actual): read in pieces."""
    if info.compress_type not in _BOUNDED_METHODS or info.flag_bits & 0x1 or info.file_size > limit:
        return None
    parts, total = [], 0
    with zf.open(info) as fh:
        while part := fh.read(min(_READ_STEP, limit + 1 - total)):
            total += len(part)
            if total > limit:
                return None
            parts.append(part)
    return b"".join(parts)


# -- zip layout ----------------------------------------------------------------------------
def storage_keys(path: str) -> dict:
    """Map each torch zip data record's data offset to its storage key (pickling order)."""
    keys = {}
    with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
        for info in zf.infolist():
            head, _, key = info.filename.rpartition("/data/")
            if not head or not key.isdigit():
                continue
            fh.seek(info.header_offset)
            local = fh.read(30)
            if local[:4] == b"PK\x03\x04":
                nlen, xlen = struct.unpack_from("<HH", local, 26)
                keys[info.header_offset + 30 + nlen + xlen] = int(key)
    return keys



def zip_crc_fields(path: str) -> dict:
    """Map each zip record's data offset to the file positions that hold its CRC-32.

    A record's CRC sits in its local header, in its data descriptor when flag bit 3 is
    set (torch's writer sets it), and in its central directory entry. A field is listed
    only if it holds the record's CRC now, so a writer that leaves one zero stays so.
    """
    out = {}
    with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
        infos = zf.infolist()
        by_name = {}
        for info in infos:
            fh.seek(info.header_offset)
            local = fh.read(30)
            if local[:4] != b"PK\x03\x04":
                continue
            nlen, xlen = struct.unpack_from("<HH", local, 26)
            data = info.header_offset + 30 + nlen + xlen
            where = [info.header_offset + 14] if struct.unpack_from("<I", local, 14)[0] == info.CRC else []
            if info.flag_bits & 0x8:
                d = data + info.compress_size
                fh.seek(d)
                desc = fh.read(8)
                if desc[:4] == b"PK\x07\x08":
                    d, desc = d + 4, desc[4:]
                if len(desc) >= 4 and struct.unpack_from("<I", desc, 0)[0] == info.CRC:
                    where.append(d)
            out[data] = where
            by_name[info.filename] = (data, info.CRC)
        pos = zf.start_dir
        for _ in infos:
            fh.seek(pos)
            entry = fh.read(46)
            if entry[:4] != b"PK\x01\x02":
                break
            nlen, xlen, clen = struct.unpack_from("<HHH", entry, 28)
            name = fh.read(nlen).decode("utf-8", "replace")
            if name in by_name and struct.unpack_from("<I", entry, 16)[0] == by_name[name][1]:
                out[by_name[name][0]].append(pos + 16)
            pos += 46 + nlen + xlen + clen
    return out
