"""Find the tensors inside a checkpoint file without running any of its code.

Private to :mod:`comm_codec.checkpoint` and :mod:`comm_codec.lossy`. safetensors headers are parsed as JSON; torch
``.pt``/``.bin`` zip files are read from their zip layout, and their ``data.pkl`` is
*scanned* opcode by opcode with :mod:`pickletools` — nothing is imported or called — to
learn each storage's dtype and the tensor names that point into it. Whatever is not
understood is left to the caller as opaque bytes. :func:`_zip_crc_fields` says where a
zip record's CRC-32 is stored, for writers that replace a record's bytes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pickletools
import re
import struct
import zipfile

from typing import TYPE_CHECKING

import numpy as np

from .codec import Codec
from .streams import SUPPORTED_DTYPES, spec_for

if TYPE_CHECKING:
    from .checkpoint import _Map

log = logging.getLogger("comm_codec.checkpoint")

_CODABLE = {str(d).replace("torch.", ""): d for d in SUPPORTED_DTYPES}
_MAX_PICKLE_BYTES = 256 << 20


def _int(x, lo=0, hi=1 << 62) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


# -- finding tensors ------------------------------------------------------------------------
@dataclasses.dataclass
class _Tensor:
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

    @property
    def spec(self):
        return spec_for(_CODABLE[self.dtype])

    def record(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": self.shape, "offset": self.offset,
                "nbytes": self.nbytes, "kind": self.kind, "coding": self.coding,
                "transform": self.transform, "base_offset": self.base_offset, "books": self.books,
                "chunk_elems": self.chunk_elems}


_OPTIMIZER_NAME = re.compile(r"exp_avg|momentum|optim|(^|[./])state([./]|$)", re.IGNORECASE)


def _guess_kind(name: str) -> str:
    return "optimizer_state" if _OPTIMIZER_NAME.search(name) else "weight"


def _find_tensors(m: _Map) -> tuple[str, list[_Tensor]]:
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
        kept.append(t)
        end = t.offset + t.nbytes
    return fmt, kept


_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
              "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
              "U16": "uint16", "U32": "uint32", "U64": "uint64"}


def _safetensors_tensors(m: _Map) -> list[_Tensor]:
    """Parse a safetensors header: u64 length, JSON {name: {dtype, shape, data_offsets}}."""
    (hlen,) = struct.unpack("<Q", bytes(m.u8(0, 8)))
    if hlen > min(m.size - 8, 100 << 20):
        raise ValueError(f"header length {hlen} exceeds the file")
    header = json.loads(bytes(m.u8(8, hlen)).decode("utf-8"))
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
        t = _Tensor(str(name), dtype, shape, start + begin, end - begin, _guess_kind(str(name)))
        if dtype in _CODABLE:
            t.codable = int(np.prod(shape, dtype=np.int64)) * t.spec.itemsize == t.nbytes
        out.append(t)
    return out


def _torch_zip_tensors(m: _Map) -> list[_Tensor]:
    """Find the storages of a ``torch.save`` zip from its layout and its pickle's opcodes."""
    with open(m.path, "rb") as fh, zipfile.ZipFile(fh) as zf:
        infos = zf.infolist()
        pickles = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
        if len(pickles) != 1:
            raise ValueError(f"{len(pickles)} data.pkl entries, expected 1")
        prefix = pickles[0].filename[: -len("data.pkl")]
        storages = {}
        if pickles[0].file_size <= _MAX_PICKLE_BYTES:
            try:
                storages = _scan_torch_pickle(zf.read(pickles[0]))
            except Exception as exc:  # noqa: BLE001 - an unreadable pickle: storages stay opaque
                log.debug("%s: pickle not understood (%s); its storages are coded as opaque bytes", m.path, exc)
        names = {i.filename for i in infos}
        little = prefix + "byteorder" not in names or zf.read(prefix + "byteorder") == b"little"
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
        dtype, name, nbytes, shape = storages.get(key, (None, None, None, None))
        t = _Tensor(name or f"storage/{key}", dtype or "unknown", shape, offset, info.compress_size,
                    _guess_kind(name or ""))
        t.codable = (little and dtype in _CODABLE and info.compress_size == info.file_size == nbytes)
        out.append(t)
    return out


# -- reading a torch pickle without running it ---------------------------------------------
class _G:
    """A reference to a global (module, name), never imported."""

    __slots__ = ("module", "name")

    def __init__(self, module, name):
        self.module, self.name = module, name


class _Obj:
    """Whatever a REDUCE/NEWOBJ would have built: only its pieces are kept."""

    __slots__ = ("func", "args", "items", "state")

    def __init__(self, func, args):
        self.func, self.args, self.items, self.state = func, args, [], None


class _Pair:
    """One dict entry (key, value)."""

    __slots__ = ("key", "value")

    def __init__(self, key, value):
        self.key, self.value = key, value


class _Storage:
    __slots__ = ("key", "dtypes", "numel", "typed", "name", "shape")

    def __init__(self, key, numel):
        self.key, self.numel, self.dtypes, self.typed, self.name, self.shape = key, numel, set(), None, None, None


class _TensorRef:
    __slots__ = ("storage", "size")

    def __init__(self, storage, size):
        self.storage, self.size = storage, size


_UNKNOWN = object()
_STORAGE_TYPES = {"BFloat16Storage": "bfloat16", "HalfStorage": "float16", "FloatStorage": "float32",
                  "DoubleStorage": "float64", "LongStorage": "int64", "IntStorage": "int32",
                  "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
                  "BoolStorage": "bool"}
_REBUILD = {"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3"}
_PUSH_ARG = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
             "STRING", "BINSTRING", "SHORT_BINSTRING", "BINBYTES", "SHORT_BINBYTES", "BINBYTES8",
             "BYTEARRAY8", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
_CONSTS = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}


def _scan_torch_pickle(data: bytes) -> dict:
    """Map each storage key of a torch pickle to (dtype or None, name, bytes, shape or None).

    The pickle is *read*, never run: :func:`pickletools.genops` parses opcodes and a
    symbolic stack machine tracks strings, numbers, tuples, dicts and global *names*
    (no import, no call). A storage's dtype comes from its storage class
    (``torch.BFloat16Storage``...) or the dtype argument of ``_rebuild_tensor_v3``; a
    storage claimed with two dtypes gets None (coded as opaque bytes). A tensor's name
    is its path of dict keys from the root ("state.0.exp_avg").
    """
    stack, marks, memo, storages = [], [], {}, {}
    root = None

    def pop_mark():
        k = marks.pop()
        items = stack[k:]
        del stack[k:]
        return items

    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name in _PUSH_ARG:
            stack.append(arg)
        elif name in _CONSTS:
            stack.append(_CONSTS[name])
        elif name in ("PROTO", "FRAME"):
            pass
        elif name == "STOP":
            root = stack.pop()
            break
        elif name == "MARK":
            marks.append(len(stack))
        elif name == "TUPLE":
            stack.append(tuple(pop_mark()))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            n = int(name[-1])
            items = tuple(stack[-n:])
            if len(items) != n:
                raise IndexError("stack underflow")
            del stack[-n:]
            stack.append(items)
        elif name in ("EMPTY_LIST", "EMPTY_DICT"):
            stack.append(_Obj(name, ()))
        elif name in ("LIST", "DICT"):
            o = _Obj(name, ())
            items = pop_mark()
            o.items = items if name == "LIST" else [_Pair(k, v) for k, v in zip(items[::2], items[1::2])]
            stack.append(o)
        elif name in ("APPEND", "SETITEM"):
            v = stack.pop()
            if name == "SETITEM":
                v = _Pair(stack.pop(), v)
            if isinstance(stack[-1], _Obj):
                stack[-1].items.append(v)
        elif name in ("APPENDS", "SETITEMS"):
            items = pop_mark()
            if name == "SETITEMS":
                items = [_Pair(k, v) for k, v in zip(items[::2], items[1::2])]
            if isinstance(stack[-1], _Obj):
                stack[-1].items.extend(items)
        elif name == "GLOBAL":
            module, _, qual = arg.partition(" ")
            stack.append(_G(module, qual))
        elif name == "STACK_GLOBAL":
            qual, module = stack.pop(), stack.pop()
            stack.append(_G(module, qual) if isinstance(module, str) and isinstance(qual, str) else _UNKNOWN)
        elif name in ("REDUCE", "NEWOBJ"):
            args, func = stack.pop(), stack.pop()
            stack.append(_reduce(func, args))
        elif name == "BUILD":
            state = stack.pop()
            if isinstance(stack[-1], _Obj):
                stack[-1].state = state
        elif name == "BINPERSID":
            stack.append(_persistent(stack.pop(), storages))
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1]
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif name == "DUP":
            stack.append(stack[-1])
        elif name == "POP":
            if stack and (not marks or len(stack) > marks[-1]):
                stack.pop()
            else:
                pop_mark()
        elif name == "POP_MARK":
            pop_mark()
        else:  # anything else: apply its stack effect, its result is unknown
            before = op.stack_before
            if pickletools.markobject in before:
                pop_mark()
                n = before.index(pickletools.markobject)
            else:
                n = len(before)
            for _ in range(n):
                stack.pop()
            stack.extend(_UNKNOWN for _ in op.stack_after)
    _name_storages(root)
    out = {}
    for key, s in storages.items():
        dtype = next(iter(s.dtypes)) if len(s.dtypes) == 1 else None
        nbytes = shape = None
        if dtype in _CODABLE:
            # A typed storage counts elements, an untyped one bytes.
            itemsize = spec_for(_CODABLE[dtype]).itemsize
            nbytes = s.numel * itemsize if s.typed else s.numel
            if s.shape is not None and int(np.prod(s.shape, dtype=np.int64)) * itemsize == nbytes:
                shape = list(s.shape)  # its first tensor spans the storage
        out[key] = (dtype, s.name, nbytes, shape)
    return out


def _persistent(pid, storages):
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _G)
            and isinstance(pid[2], str) and isinstance(pid[4], int)):
        return _UNKNOWN
    s = storages.get(pid[2])
    if s is None:
        s = storages[pid[2]] = _Storage(pid[2], pid[4])
    typed = _STORAGE_TYPES.get(pid[1].name) if pid[1].module == "torch" else None
    if typed is not None:
        s.typed = typed
        s.dtypes.add(typed)
    elif pid[1].name != "UntypedStorage":
        s.dtypes.add(None)  # a storage class we do not know: ambiguous, opaque
    return s


def _reduce(func, args):
    if (isinstance(func, _G) and func.module == "torch._utils" and func.name in _REBUILD
            and isinstance(args, tuple) and args and isinstance(args[0], _Storage)):
        storage = args[0]
        if func.name == "_rebuild_tensor_v3":
            dt = args[-1]
            storage.dtypes.add(dt.name if isinstance(dt, _G) and dt.module == "torch" else None)
        size = args[2] if len(args) > 2 and isinstance(args[2], tuple) else None
        return _TensorRef(storage, size if size is not None and all(_int(d) for d in size) else None)
    return _Obj(func, args)


def _name_storages(root) -> None:
    """Name each storage after the first path of dict keys that leads to a tensor on it."""
    todo, seen = [(root, ())], set()
    while todo:
        obj, path = todo.pop()
        if isinstance(obj, _TensorRef):
            if obj.storage.name is None:
                obj.storage.name = ".".join(path) or f"storage/{obj.storage.key}"
                obj.storage.shape = obj.size
            continue
        if id(obj) in seen or len(seen) > 1_000_000:
            continue
        seen.add(id(obj))
        children = []
        if isinstance(obj, tuple):
            children = [(v, path + (str(i),)) for i, v in enumerate(obj)]
        elif isinstance(obj, _Obj):
            for i, item in enumerate(obj.items):
                if isinstance(item, _Pair):
                    key = item.key if isinstance(item.key, (str, int)) else i
                    children.append((item.value, path + (str(key),)))
                else:
                    children.append((item, path + (str(i),)))
            children.append((obj.args, path))
            children.append((obj.state, path))
        todo.extend(reversed(children))


# -- zip CRCs -------------------------------------------------------------------------------
def _zip_crc_fields(path: str) -> dict:
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
