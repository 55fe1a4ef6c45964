"""Find the tensors inside a checkpoint file without running any of its code.

Used by the exact and lossy formats. safetensors headers are parsed as JSON; torch
``.pt``/``.bin`` zip files are read from their zip layout, and their ``data.pkl`` is
*scanned* opcode by opcode (:mod:`.pickle_scan`; nothing is imported or called) to learn
each storage's dtype and the tensor names that point into it. A DCP data file
(``.distcp``, torch's ``FileSystemWriter``) is a sequence of such zip records and raw
bytes: each record is read from its own headers. A legacy ``torch.save`` file is a row of
pickles (scanned the same way) followed by its storages. Whatever is not understood
is left to the caller as opaque bytes. :func:`zip_crc_fields` says where a zip record's
CRC-32 is stored, for writers that replace a record's bytes; :func:`storage_keys` which
record holds which storage.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import math
import pickletools
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

__all__ = [
    "CODABLE",
    "CODABLE_NAMES",
    "ST_DTYPES",
    "FileTensor",
    "find_tensors",
    "find_tensors_noted",
    "FORMATS",
    "itemsize",
    "is_int",
    "zip_crc_fields",
    "storage_keys",
]

log = logging.getLogger("comm_codec.checkpoint")

# The dtype names ("bfloat16") the codec codes; spec_for takes them as they are.
CODABLE_NAMES = frozenset(SUPPORTED_NAMES)
# What find_tensors calls a file (an index's source.format).
FORMATS = ("safetensors", "torch_zip", "distcp", "torch_legacy", "generic")


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
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": self.shape,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "kind": self.kind,
            "coding": self.coding,
            "transform": self.transform,
            "base_offset": self.base_offset,
            "books": self.books,
            "chunk_elems": self.chunk_elems,
            **({"entries": self.entries} if self.entries else {}),
        }


_OPTIMIZER_NAME = re.compile(r"exp_avg|momentum|optim|(^|[./])state([./]|$)", re.IGNORECASE)


def _guess_kind(name: str) -> str:
    return "optimizer_state" if _OPTIMIZER_NAME.search(name) else "weight"


def find_tensors(m: FileMap) -> tuple[str, list[FileTensor]]:
    """Return the file's format and its tensors, sorted by offset, never overlapping."""
    fmt, kept, _ = find_tensors_noted(m)
    return fmt, kept


def find_tensors_noted(m: FileMap) -> tuple[str, list[FileTensor], str | None]:
    """Return the file's format, its tensors (as :func:`find_tensors`) and, when none of
    its tensors can be coded, one line saying why and what would help (else None).

    Formats: ``safetensors``; ``torch_zip`` (one ``torch.save`` zip); ``distcp`` (a
    sequence of ``torch.save`` zip records and raw bytes, as torch's DCP
    ``FileSystemWriter`` writes its data files); ``torch_legacy``
    (``torch.save(..., _use_new_zipfile_serialization=False)``); ``generic``.
    """
    head = bytes(m.u8(0, min(m.size, 64)))
    found, fmt = [], "generic"
    # Any failure to parse means "not this format": the bytes are then coded opaquely,
    # which is always correct. Input is untrusted, so the net is deliberately wide.
    try:
        if len(head) >= 9 and head[8:9] == b"{":
            found, fmt = _safetensors_tensors(m), "safetensors"
        elif head[:4] == b"PK\x03\x04" and not m.path.endswith(".distcp"):
            try:
                found, fmt = _torch_zip_tensors(m, whole=True), "torch_zip"
            except _NotOneZip:  # records one after another: a DCP data file by another name
                found, fmt = _record_tensors(m), "distcp"
        elif _is_legacy(head):
            found, fmt = _legacy_tensors(m), "torch_legacy"
        elif m.path.endswith(".distcp"):
            found, fmt = _record_tensors(m), "distcp"
    except Exception as exc:  # noqa: BLE001
        log.debug("%s: not parsed as a checkpoint (%s: %s); coding it as opaque bytes", m.path, type(exc).__name__, exc)
        found, fmt = [], "torch_legacy" if _is_legacy(head) else "generic"
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
    return fmt, kept, _opaque_note(fmt, kept, m.size)


# Files smaller than this get no note: zstd alone is the right coding for them.
_NOTE_BYTES = 64 << 10


def _opaque_note(fmt: str, tensors: list[FileTensor], size: int) -> str | None:
    """One line for a file whose tensors all stay opaque: why, and what would help."""
    if size < _NOTE_BYTES or any(t.codable for t in tensors):
        return None
    if fmt == "generic":
        return (
            "no tensors found: not safetensors, a torch.save file (zip or legacy) or a DCP .distcp file, so "
            "it is coded with zstd only; save it with safetensors or torch.save to have its tensors coded"
        )
    if not tensors:
        return (
            f"a {fmt} file whose layout was not understood (comm-codec -v compress says why), so it "
            "is coded with zstd only; re-saving it with torch.save (zip format) or safetensors would help"
        )
    kinds = sorted({t.dtype for t in tensors})[:4]
    return (
        f"none of its {len(tensors)} tensors has a dtype the codec codes ({', '.join(kinds)}; it codes "
        f"{', '.join(sorted(CODABLE_NAMES))}), so they are coded with zstd"
    )


ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
}


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
        if not (
            isinstance(begin, int)
            and isinstance(end, int)
            and isinstance(shape, list)
            and all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise ValueError(f"tensor {name!r}: malformed entry")
        dtype = ST_DTYPES.get(info["dtype"], str(info["dtype"]))
        # Exact integers: a shape whose product wraps int64 must not pass for the size. A
        # shape no reader could take (dims past 2^62, 64+ dims) is not recorded at all.
        if len(shape) > 64 or any(d > 1 << 62 for d in shape) or math.prod(shape) > 1 << 62:
            shape = None
        t = FileTensor(str(name), dtype, shape, start + begin, end - begin, _guess_kind(str(name)))
        if dtype in CODABLE_NAMES and shape is not None:
            t.codable = math.prod(shape) * t.spec.itemsize == t.nbytes
        out.append(t)
    return out


class _Window(io.RawIOBase):
    """A read-only file object over bytes start..end of a FileMap (one zip record of a
    longer file, for :mod:`zipfile`, whose offsets are then the record's own)."""

    def __init__(self, m: FileMap, start: int, end: int):
        super().__init__()
        self._m, self._start, self._size, self._pos = m, start, end - start, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = max(0, {0: 0, 1: self._pos, 2: self._size}[whence] + offset)
        return self._pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self._size - self._pos))
        if n:
            memoryview(b).cast("B")[:n] = self._m.u8(self._start + self._pos, n).data
        self._pos += n
        return n


class _NotOneZip(ValueError):
    """The file's last zip does not start at its first byte: zip records one after another."""


def _torch_zip_tensors(m: FileMap, start: int = 0, end: int | None = None, whole: bool = False) -> list[FileTensor]:
    """Find the storages of a ``torch.save`` zip (the file, or its bytes start..end) from
    its layout and its pickle's opcodes.

    Raises:
        _NotOneZip: with ``whole``, the zip that ends the file starts past its first byte
            (zipfile reads the last one; a DCP data file is several).
    """
    end = m.size if end is None else end
    with _Window(m, start, end) as fh, zipfile.ZipFile(fh) as zf:
        infos = zf.infolist()
        if whole and infos and min(i.header_offset for i in infos) > 0:
            raise _NotOneZip("zip records one after another")
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
        key = info.filename[len(prefix + "data/") :]
        h = start + info.header_offset
        local = bytes(m.u8(h, 30)) if h + 30 <= end else b""
        if local[:4] != b"PK\x03\x04":
            continue
        nlen, xlen = struct.unpack_from("<HH", local, 26)
        offset = h + 30 + nlen + xlen
        if offset + info.compress_size > end:
            continue
        dtype, name, nbytes, shape, entries = storages.get(key, (None, None, None, None, None))
        t = FileTensor(
            name or f"storage/{key}", dtype or "unknown", shape, offset, info.compress_size, _guess_kind(name or "")
        )
        t.entries = entries
        t.codable = little and dtype in CODABLE_NAMES and info.compress_size == info.file_size == nbytes
        out.append(t)
    return out


# -- DCP data files: torch.save zip records one after another -------------------------------
_LOCAL, _CENTRAL, _DESCRIPTOR = b"PK\x03\x04", b"PK\x01\x02", b"PK\x07\x08"
_ZIP64_END, _ZIP64_LOCATOR, _END = b"PK\x06\x06", b"PK\x06\x07", b"PK\x05\x06"
# Most bytes read per step when searching for a signature.
_SEARCH_STEP = 1 << 20
# Candidate record starts tried in the bytes between records before the rest is left opaque.
_MAX_FALSE_STARTS = 256
# Records read per file at most (each costs a zip directory's parse).
_MAX_RECORDS = 1 << 20


class _Reader:
    """Small reads of a FileMap served from one block read ahead (a record's headers lie
    together: one read instead of dozens)."""

    def __init__(self, m: FileMap, block: int = 4 << 10):
        self.m, self.size, self._block, self._at, self._buf = m, m.size, block, 0, b""
        self._scanned: dict = {}
        # Bytes searches may still read: crafted headers cannot make the walk read the file
        # over and over (a search past the budget finds nothing).
        self.search_budget = 2 * m.size + (64 << 20)

    def scan(self, offset: int, size: int) -> dict:
        """scan_torch_pickle's answer for the pickle at offset (sizes by _layout_itemsize);
        {} when it is not understood. A DCP file's records mostly hold the same few
        pickles (one tensor of a given shape each): each is scanned once."""
        data = self.m.u8(offset, size).tobytes()
        got = self._scanned.get(data)
        if got is None:
            try:
                got = scan_torch_pickle(data, _layout_itemsize)
            except Exception as exc:  # noqa: BLE001 - then its storages stay opaque
                log.debug("%s: pickle at %d not understood (%s)", self.m.path, offset, exc)
                got = {}
            if len(self._scanned) < 4096:
                self._scanned[data] = got
        return got

    def get(self, pos: int, n: int) -> bytes:
        """Return bytes pos..pos+n (fewer at the end of the file)."""
        n = max(0, min(n, self.size - pos))
        if n == 0 or pos < 0:
            return b""
        if not (self._at <= pos and pos + n <= self._at + len(self._buf)):
            self._at = pos
            self._buf = bytes(self.m.u8(pos, min(max(n, self._block), self.size - pos)))
        return self._buf[pos - self._at : pos - self._at + n]


def _find(r: _Reader, sig: bytes, start: int, stop: int) -> int:
    """Return the first position of sig in bytes start..stop, or -1; read a step at a time."""
    pos, step = start, 4096  # most searches end within a few hundred bytes: read little first
    while pos < stop:
        n, step = min(step, stop - pos), min(2 * step, _SEARCH_STEP)
        if r.search_budget < n:
            return -1
        r.search_budget -= n
        at = r.get(pos, n).find(sig)
        if at >= 0 and pos + at + len(sig) <= stop:
            return pos + at
        if pos + n >= stop:
            return -1
        pos += n - len(sig) + 1
    return -1


def _after_descriptor(r: _Reader, data: int, size: int) -> int | None:
    """Where the member whose data starts at ``data`` ends, if ``size`` bytes of data are
    followed by its data descriptor (then the next header): the descriptor's end, else None."""
    at = data + size
    for sig in (True, False):
        for width in (8, 4):  # zip64 sizes, then 32-bit ones
            n = (4 if sig else 0) + 4 + 2 * width
            desc = r.get(at, n + 4)
            if len(desc) < n + 4 or (sig and desc[:4] != _DESCRIPTOR):
                continue
            body = desc[4:] if sig else desc
            csize = int.from_bytes(body[4 : 4 + width], "little")
            if csize == size and desc[n : n + 4] in (_LOCAL, _CENTRAL):
                return at + n
    return None


def _member_end(r: _Reader, data: int, claimed: int | None) -> tuple[int, int] | None:
    """(end, data size) of a member with a data descriptor: at its claimed size if one
    fits, else found by searching for a descriptor that matches the bytes before it."""
    if claimed is not None:
        got = _after_descriptor(r, data, claimed)
        if got is not None:
            return got, claimed
    pos = data
    while (at := _find(r, _DESCRIPTOR, pos, r.size)) >= 0:
        got = _after_descriptor(r, data, at - data)
        if got is not None:
            return got, at - data
        pos = at + 1
    return None


@dataclasses.dataclass
class _Record:
    """One ``torch.save`` zip record inside a longer file, as its headers describe it."""

    end: int
    members: dict  # name -> (data offset, size)
    storages: dict  # scan_torch_pickle's answer for its data.pkl (sizes by _layout_itemsize)
    pickle: str | None  # the data.pkl member's name


def _record_end(m: FileMap, start: int) -> int | None:
    """Return the end of the ``torch.save`` zip record at ``start``, or None when there is none."""
    rec = _walk_record(_Reader(m), start)
    return None if rec is None else rec.end


def _walk_record(r: _Reader, start: int) -> _Record | None:
    """Read the ``torch.save`` zip record at ``start`` header by header (its data is not
    read: a tensor's size is the one its pickle claims, checked against the data descriptor
    after it); None when the bytes there are not one."""
    pos, members, storages, pickle = start, {}, {}, None
    while (local := r.get(pos, 30))[:4] == _LOCAL and len(local) == 30:
        _, _, flag, method, _, _, _, csize, _, nlen, xlen = struct.unpack("<IHHHHHIIIHH", local)
        if method != zipfile.ZIP_STORED or len(members) >= 1 << 16:
            return None
        name = r.get(pos + 30, nlen).decode("utf-8", "replace")
        data = pos + 30 + nlen + xlen
        if data > r.size:
            return None
        if not flag & 0x8:
            if csize == 0xFFFFFFFF:
                return None  # zip64 sizes in the extra field: torch's writer uses descriptors
            end = data + csize
        else:
            key = name.rpartition("/data/")[2] if "/data/" in name else None
            got = _member_end(r, data, storages.get(key, (None,) * 3)[2])
            if got is None:
                return None
            end, csize = got
        if end > r.size:
            return None
        members[name] = (data, csize)
        if (name.endswith("/data.pkl") or name == "data.pkl") and pickle is None and csize <= _MAX_PICKLE_BYTES:
            pickle = name
            storages = r.scan(data, csize)
        pos = end
    if pos == start:
        return None
    while (head := r.get(pos, 46))[:4] == _CENTRAL and len(head) == 46:
        nlen, xlen, clen = struct.unpack_from("<HHH", head, 28)
        pos += 46 + nlen + xlen + clen
    if r.get(pos, 4) == _ZIP64_END:
        pos += 12 + int.from_bytes(r.get(pos + 4, 8), "little")
    if r.get(pos, 4) == _ZIP64_LOCATOR:
        pos += 20
    if r.get(pos, 4) == _END and pos + 22 <= r.size:
        end = pos + 22 + int.from_bytes(r.get(pos + 20, 2), "little")
        return _Record(end, members, storages, pickle) if end <= r.size else None
    return None


def _record_tensors(m: FileMap) -> list[FileTensor]:
    """Find every tensor of a DCP data file: each ``torch.save`` zip record is read as a
    file of its own, from its headers; bytes between records (raw bytes items) stay opaque.

    A record's tensors are named ``item<i>/<name in the record>``, ``i`` counting records
    from the file's start, so that the same item of the next checkpoint has the same name.
    """
    out, pos, misses, r = [], 0, 0, _Reader(m)
    for i in range(_MAX_RECORDS):
        if pos >= m.size:
            break
        start = pos if r.get(pos, 4) == _LOCAL else _find(r, _LOCAL, pos, m.size)
        if start < 0:
            break
        try:
            rec = _walk_record(r, start)
        except Exception as exc:  # noqa: BLE001 - the rest of the file stays opaque
            log.debug("%s: record at %d not read (%s: %s)", m.path, start, type(exc).__name__, exc)
            break
        if rec is None:
            misses += 1
            if misses > _MAX_FALSE_STARTS:
                break
            pos = start + 1
            continue
        out += _record_storages(rec, r, f"item{i}/")
        pos = rec.end
    return out


def _record_storages(rec: _Record, r: _Reader, prefix_name: str) -> list[FileTensor]:
    if rec.pickle is None:
        return []
    prefix = rec.pickle[: -len("data.pkl")]
    order = rec.members.get(prefix + "byteorder")
    little = order is None or (order[1] <= _MAX_BYTEORDER_BYTES and r.get(order[0], order[1]) == b"little")
    out = []
    for member, (offset, size) in rec.members.items():
        if not member.startswith(prefix + "data/"):
            continue
        key = member[len(prefix + "data/") :]
        dtype, name, nbytes, shape, entries = rec.storages.get(key, (None, None, None, None, None))
        t = FileTensor(
            prefix_name + (name or f"storage/{key}"), dtype or "unknown", shape, offset, size, _guess_kind(name or "")
        )
        t.entries = [[prefix_name + n, sh] for n, sh in entries] if entries else None
        t.codable = little and dtype in CODABLE_NAMES and size == nbytes
        out.append(t)
    return out


# -- legacy torch.save files ----------------------------------------------------------------
# The first pickle of a legacy file holds this number (torch.serialization.MAGIC_NUMBER).
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
# Bytes per element of every storage class a legacy file can hold: storages lie back to
# back, so one of unknown size ends the walk.
_LAYOUT_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


def _layout_itemsize(dtype: str) -> int | None:
    return _LAYOUT_ITEMSIZE.get(dtype)


def _pickle_ops(m: FileMap, start: int, limit: int) -> tuple[list, int]:
    """Parse the pickle at ``start`` (at most ``limit`` bytes); return its opcodes
    ((name, arg) pairs) and its end. Read in growing pieces; nothing is run."""
    n = min(4096, limit, m.size - start)
    while True:
        data = bytes(m.u8(start, n))
        try:
            ops = [(op.name, arg, pos) for op, arg, pos in pickletools.genops(data)]
        except ValueError:
            if n >= min(limit, m.size - start):
                raise
            n = min(n * 4, limit, m.size - start)
            continue
        return ops, start + ops[-1][2] + 1


def _is_legacy(head: bytes) -> bool:
    """Whether a file starts with the magic-number pickle of a legacy ``torch.save`` file."""
    try:
        ops = [(op.name, arg) for op, arg, _ in pickletools.genops(head)]
    except Exception:  # noqa: BLE001
        return False
    return [o for o, _ in ops if o not in ("PROTO", "FRAME")] == ["LONG1", "STOP"] and ops[-2][1] == _LEGACY_MAGIC


def _legacy_tensors(m: FileMap) -> list[FileTensor]:
    """Find the storages of a legacy ``torch.save`` file without unpickling it.

    Layout: the magic-number pickle, the protocol number (1001), a system-info dict, the
    object pickle (storages as persistent ids), a pickled list of storage keys, then each
    storage in that order as its element count (8 bytes, little-endian) and its bytes.
    """
    _, pos = _pickle_ops(m, 0, 64)
    ops, pos = _pickle_ops(m, pos, 64)
    if [a for o, a, _ in ops if o not in ("PROTO", "FRAME", "STOP")] != [_LEGACY_PROTOCOL]:
        raise ValueError("not protocol 1001")
    ops, pos = _pickle_ops(m, pos, 1 << 16)
    names = [(o, a) for o, a, _ in ops if o not in ("PROTO", "FRAME", "BINPUT", "PUT", "MEMOIZE", "MARK")]
    little = any(
        a == "little_endian" and names[i + 1][0] == "NEWTRUE"
        for i, (o, a) in enumerate(names[:-1])
        if o.endswith("UNICODE")
    )
    start = pos
    _, pos = _pickle_ops(m, pos, _MAX_PICKLE_BYTES)
    storages = scan_torch_pickle(bytes(m.u8(start, pos - start)), _layout_itemsize)
    ops, pos = _pickle_ops(m, pos, _MAX_PICKLE_BYTES)
    keys = [a for o, a, _ in ops if o in ("BINUNICODE", "SHORT_BINUNICODE", "UNICODE", "BINUNICODE8")]
    out = []
    for key in keys:
        dtype, name, nbytes, shape, entries = storages.get(key, (None, None, None, None, None))
        size = _layout_itemsize(dtype) if dtype else None
        if size is None or pos + 8 > m.size:
            break  # where the next storage starts is unknown: the rest stays opaque
        numel = int.from_bytes(bytes(m.u8(pos, 8)), "little")
        if numel * size != nbytes or pos + 8 + nbytes > m.size:
            break
        t = FileTensor(name or f"storage/{key}", dtype, shape, pos + 8, nbytes, _guess_kind(name or ""))
        t.entries = entries
        t.codable = little and dtype in CODABLE_NAMES
        out.append(t)
        pos += 8 + nbytes
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
